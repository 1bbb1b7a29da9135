"""Stage 2 of the fused LM head (`lm_head_rows_kernel`): one program per row merges its tiles.

From stage 1's per-(row, tile) summaries: the row's token, logprob, log-sum-exp and a status
(`flashspec.outputs`: OK, NEEDS_COMPLETION, NON_FINITE). Truncated rows (top-k / top-p /
min-p) merge the candidate keys (`keys.py`), apply HF's rules on the top ``K_MAX`` of them,
and sample among the survivors with the same noise. The merged list is exact down to the
largest "last candidate" of any tile (a missing token sits below its tile's last one) and a
bound on the logits of the tiles left out of the merge (from the keys they were chosen by);
the survivors are *certified* to be the whole support when they, and top-k's tie class, end
strictly above that key. Other rows get NEEDS_COMPLETION and are completed exactly by the
caller (`flashspec.sampling`).

Verification (DRAFT): stage 1 left each row's drafted token out of the tile's best and wrote
the draft's scaled logit; here the row decides whether the draft is the target's own sample
(its perturbed score against the best other token) and writes p(draft), the best other token
and the logprobs, for `verify_finalize.py`. Truncated rows decide all of this among their
candidates; where every sampled row is truncated, stage 1 computes no noise, and where every
row is, no drafts' summaries (`ops.kernel_variant`).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import outputs
from .keys import unpack_candidates
from .noise import gumbel_noise
from .rows import _row_drafts, _row_noise_keys, _row_params

_OK = tl.constexpr(outputs.OK)
_NEEDS_COMPLETION = tl.constexpr(outputs.NEEDS_COMPLETION)
_NON_FINITE = tl.constexpr(outputs.NON_FINITE)


@triton.jit
def _merged_candidates(cand_base, tiles, t_ok, NUM_VT, CAND: tl.constexpr, K_MAX: tl.constexpr,
                       TOP_TILES: tl.constexpr, VT_POW2: tl.constexpr, PAD: tl.constexpr):
    """The top K_MAX of a row's candidate keys (`cand_base`: CAND per tile, largest first;
    `tiles` the arange of VT_POW2, `t_ok` those below NUM_VT), and a key above every
    candidate of the tiles left out of the merge (PAD where none is).

    The top-K_MAX candidates lie in the TOP_TILES tiles with the largest maxima (any other
    candidate has that many tile maxima above it), so only their candidates are merged: a
    short sort instead of one over every tile. Tiles are chosen by a 32-bit key, half the
    cost of sorting int64 keys (H200, 2,048 tiles: 9.6 -> 5.6 us): the order key of the
    tile's largest logit with its low bits replaced by the tile's index, which can order
    close maxima by index: a tile left out has its largest logit's order key at most the
    chosen ones' smallest with those bits set, whence the bound (an int64 overflow there
    only for NaN keys, whose rows are not finite)."""
    low: tl.constexpr = VT_POW2 - 1
    tile_first = tl.load(cand_base + tiles * CAND, mask=t_ok, other=PAD)
    order = (tile_first >> 32).to(tl.int32)
    chosen = tl.topk(tl.where(t_ok, (order & ~low) | (low - tiles), -2**31), TOP_TILES)
    tile_of = low - (chosen & low)
    real = tile_of < NUM_VT  # padding tiles sort last; chosen only if there are few tiles
    gathered = tl.load(cand_base + tile_of[:, None] * CAND + tl.arange(0, CAND)[None, :],
                       mask=real[:, None], other=PAD)
    top = tl.topk(tl.reshape(gathered, (TOP_TILES * CAND,)), K_MAX)
    left_out = ((tl.min(chosen, axis=0) | low).to(tl.int64) + 1) << 32
    return top, tl.where(NUM_VT > TOP_TILES, left_out, PAD)


@triton.jit
def lm_head_rows_kernel(
    best_ptr, best_id_ptr, best_s_ptr, max_ptr, sumexp_ptr, bad_ptr, cand_ptr, draft_s_ptr,
    do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, position_ptr,
    draft_ptr,
    token_ptr, logprob_ptr, lse_ptr, status_ptr,
    masked_ptr, masked_logprob_ptr, draft_prob_ptr, draft_logprob_ptr,
    V, NUM_VT, ROWS_PER_PARAM,
    LSE: tl.constexpr, CAND: tl.constexpr, DRAFT: tl.constexpr, TILE_DRAFTS: tl.constexpr,
    K_MAX: tl.constexpr,
    TOP_TILES: tl.constexpr, VT_POW2: tl.constexpr, PAD: tl.constexpr, PDL: tl.constexpr,
):
    """Per row: the token (the target's own sample), its logprob, the log-sum-exp and the
    status. With DRAFT (verification) also: the best token other than the draft (`masked`)
    and its logprob, and the draft's probability and logprob. TILE_DRAFTS: stage 1 left each
    row's draft out of its tiles and wrote its logit; without it (every row sampled and
    truncated: see `ops._launch`) the candidates alone decide, and stage 1's best is the argmax."""
    if PDL:  # launched before stage 1 ended: wait for its summaries, let the finaliser in
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    tiles = tl.arange(0, VT_POW2)
    t_ok = tiles < NUM_VT
    base = row * NUM_VT
    best = tl.load(best_ptr + base + tiles, mask=t_ok, other=float("-inf"))
    ids = tl.load(best_id_ptr + base + tiles, mask=t_ok, other=0)
    # Ties between tiles go to the lower token id (interleaved tiles do not follow id order).
    winner = tl.argmin(tl.where(best == tl.max(best, axis=0), ids, V), axis=0)
    token = tl.sum(tl.where(tiles == winner, ids, 0))
    bad = tl.sum(tl.load(bad_ptr + base + tiles, mask=t_ok, other=0))
    status = tl.where(bad > 0, _NON_FINITE, _OK)
    sampled, temperature = _row_params(do_sample_ptr, temperature_ptr, row, ROWS_PER_PARAM)
    seed, position = _row_noise_keys(seed_ptr, position_ptr, row, ROWS_PER_PARAM)

    lse = 0.0
    logprob = 0.0
    if LSE:
        tile_max = tl.load(max_ptr + base + tiles, mask=t_ok, other=float("-inf"))
        tile_sum = tl.load(sumexp_ptr + base + tiles, mask=t_ok, other=0.0)
        row_max = tl.max(tile_max, axis=0)
        lse = row_max + tl.log(tl.sum(tile_sum * tl.exp(tile_max - row_max), axis=0))
        best_s = tl.load(best_s_ptr + base + tiles, mask=t_ok, other=0.0)
        logprob = tl.sum(tl.where(tiles == winner, best_s, 0.0)) - lse

    masked = token
    masked_logprob = logprob
    draft_logprob = float("-inf")
    if DRAFT:
        draft = _row_drafts(draft_ptr, row, True, ROWS_PER_PARAM)
    if TILE_DRAFTS:  # only with DRAFT (`ops._launch`), which reads `draft`
        # Stage 1 left the draft out of every tile's best: `token` is the best other token.
        # The target's own sample is the draft iff its perturbed score beats that one (ties
        # go to the lower id, as everywhere); the noise is recomputed bit for bit.
        has_draft = draft >= 0
        draft_s = tl.load(draft_s_ptr + row, mask=has_draft, other=0.0)
        draft_noise = gumbel_noise(seed, position, tl.maximum(draft, 0).to(tl.int64))
        draft_score = draft_s + tl.where(sampled, draft_noise, 0.0)
        masked_score = tl.max(best, axis=0)
        draft_wins = has_draft & ((draft_score > masked_score)
                                  | ((draft_score == masked_score) & (draft < masked)))
        draft_logprob = tl.where(has_draft, draft_s - lse, float("-inf"))
        token = tl.where(draft_wins, draft, masked)
        logprob = tl.where(draft_wins, draft_logprob, masked_logprob)

    if CAND > 0:
        param_row = row // ROWS_PER_PARAM
        top_k = tl.load(top_k_ptr + param_row)
        top_p = tl.load(top_p_ptr + param_row).to(tl.float32)
        min_p = tl.load(min_p_ptr + param_row).to(tl.float32)
        use_top_k = (top_k > 0) & (top_k < V)
        truncated = sampled & (use_top_k | (top_p < 1.0) | (min_p > 0.0))
        if truncated:
            cand_base = cand_ptr + row.to(tl.int64) * NUM_VT * CAND
            top, left_out = _merged_candidates(cand_base, tiles, t_ok, NUM_VT, CAND, K_MAX,
                                               TOP_TILES, VT_POW2, PAD)
            raw, cand_ids = unpack_candidates(top)
            s = raw / temperature
            rank = tl.arange(0, K_MAX)
            s0 = tl.max(s, axis=0)
            keep = raw > float("-inf")
            kth = float("-inf")
            # A top-k longer than the merged list cuts below every candidate (none removed).
            listed_top_k = use_top_k & (top_k <= K_MAX)
            if listed_top_k:
                kth = tl.sum(tl.where(rank == top_k - 1, s, 0.0))
                keep = keep & (s >= kth)
            if top_p < 1.0:
                mass = tl.where(keep, tl.exp(s - s0), 0.0)
                if use_top_k:
                    total = tl.sum(mass)
                else:
                    total = tl.exp(lse - s0)
                before = tl.cumsum(mass, 0) - mass
                keep = keep & ((before < top_p * total) | (rank == 0))
            if min_p > 0.0:
                keep = keep & (tl.exp(s - s0) >= min_p)
            # Certificate: a token missing from the merged list has a key below its tile's
            # last candidate, so the list is exact down to the largest such key (or the
            # K_MAX-th, or the bound of the tiles left out). The support and top-k's tie
            # class must end strictly above it.
            tile_last = tl.load(cand_base + tiles * CAND + CAND - 1, mask=t_ok, other=PAD)
            floor_key = tl.maximum(tl.maximum(tl.max(tile_last, axis=0), left_out),
                                   tl.sum(tl.where(rank == K_MAX - 1, top, 0)))
            num_certified = tl.sum((top >= floor_key).to(tl.int32))
            num_keep = tl.sum(keep.to(tl.int32))
            saturated = num_keep >= num_certified
            if listed_top_k:
                top_k_support = tl.sum(((s >= kth) & (raw > float("-inf"))).to(tl.int32))
                saturated = saturated | (top_k_support >= num_certified)
            else:  # top-p normalises over the whole top-k, which the list does not hold
                saturated = saturated | (use_top_k & (top_p < 1.0))
            noise = gumbel_noise(seed, position, cand_ids.to(tl.int64))
            score = tl.where(keep, s + noise, float("-inf"))
            pick = tl.argmax(score, axis=0, tie_break_left=True)
            token = tl.sum(tl.where(rank == pick, cand_ids, 0))
            lse = s0 + tl.log(tl.sum(tl.where(keep, tl.exp(s - s0), 0.0)))
            logprob = tl.sum(tl.where(rank == pick, s, 0.0)) - lse
            if DRAFT:
                # The support is certified whole, so a draft outside the kept candidates
                # is outside the support: probability 0, never the target's sample.
                is_draft = keep & (cand_ids == draft)
                draft_kept = tl.sum(is_draft.to(tl.int32)) > 0
                draft_logprob = tl.where(draft_kept,
                                         tl.sum(tl.where(is_draft, s, 0.0)) - lse, float("-inf"))
                masked_scores = tl.where(is_draft, float("-inf"), score)
                masked_pick = tl.argmax(masked_scores, axis=0, tie_break_left=True)
                # A support of the draft alone has no other token; the draft is then
                # accepted with probability 1 and `masked` is never emitted.
                masked = tl.where(tl.max(masked_scores, axis=0) > float("-inf"),
                                  tl.sum(tl.where(rank == masked_pick, cand_ids, 0)), token)
                masked_logprob = tl.sum(tl.where(rank == masked_pick, s, 0.0)) - lse
            status = tl.where((status == _OK) & saturated, _NEEDS_COMPLETION, status)

    tl.store(token_ptr + row, tl.where(status == _OK, token, -1).to(tl.int64))
    tl.store(status_ptr + row, status)
    tl.store(lse_ptr + row, lse)  # 0 unless LSE: written here, no separate fill launch
    tl.store(logprob_ptr + row, logprob)
    if DRAFT:
        tl.store(masked_ptr + row, tl.where(status == _OK, masked, -1).to(tl.int64))
        tl.store(masked_logprob_ptr + row, masked_logprob)
        tl.store(draft_prob_ptr + row, tl.exp(draft_logprob))
        tl.store(draft_logprob_ptr + row, draft_logprob)
