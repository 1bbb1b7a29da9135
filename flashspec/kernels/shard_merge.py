"""The ranks' gathered shard summaries merged into each row's result in one kernel
(`shard_merge_kernel`) and its launcher, `merge_shard_summaries`.

`flashspec.parallel` all-gathers every rank's summary words of its vocabulary shard
(`flashspec.parallel.summary`); this kernel does on every rank what
`flashspec.parallel.merge.merge_argmax` / `merge_rows` and, for verification,
`flashspec.parallel.acceptance.accept` do with tens to hundreds of torch kernels (the noise's
Philox rounds alone are some 250): one program per batch row reads its rows' words of every
rank and writes the call's typed result.

* The race: the best of the ranks' best scores, ties to the lower id; the log-sum-exp of the
  ranks' log-sum-exps; the logprob the winner's score minus it; a row is not finite where
  some rank's log-sum-exp (argmax: best) is NaN.
* Verification: each rank left the draft out of its best and sent the draft's logit; the
  target's own sample is the draft iff its perturbed score beats the best other token (the
  noise by `noise.gumbel_noise`, the fused kernels' own), then the acceptance chain of the
  one-GPU finaliser (`verify_finalize.accept_chain`).
* Truncated rows (top-k, top-p, min-p) are decided, position by position, by the ranks'
  candidate keys as `flashspec.parallel.merge._merge_candidates` decides them (`_truncated`):
  sorted, ordered as transformers orders them, certified against each rank's floor, filtered
  by transformers' rules (masses in float64), sampled among the survivors with their noise.

The torch merge's results, then, up to rounding: the kernel's `exp`, `log`, division and sums
(in another order) can differ from torch's in the last bits, so a decision that sits within
that rounding of its boundary (a Gumbel near-tie, a top-p or min-p threshold, an acceptance
uniform against p(draft)) can go the other way, as `flashspec.parallel` allows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..outputs import ArgmaxOutput, SampleOutput, VerifyOutput
from ..params import SamplingParams
from .keys import PAD_KEY, _from_order_key, _order_key, pack_candidates, unpack_candidates
from .merge import _NEEDS_COMPLETION, _NON_FINITE, _OK
from .noise import gumbel_noise
from .rows import _row_params
from .shard_summary import _BEST, _DRAFT, _LSE, _SCORE, _TOKEN
from .verify_finalize import accept_chain, row_drafts

_NO_ID = tl.constexpr(2**31 - 1)   # above every token id (ids < 2**31): loses every tie
_PAD = tl.constexpr(PAD_KEY)


# Sizes that change with the batch, the drafts and the layout are not specialised on (1, or
# multiples of 16): a new batch size compiles nothing; a width compiles once per power of two
# of its positions, a top-k once per power of two of its candidates.
@triton.jit(do_not_specialize=["NUM_RANKS", "NUM_ROWS", "WORDS", "NUM_DRAFTS", "NUM_CANDIDATES",
                               "V"])
def shard_merge_kernel(
    words_ptr, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr,
    position_ptr, draft_ptr,
    token_ptr, logprob_ptr, lse_ptr, status_ptr, num_accepted_ptr, accept_probs_ptr,
    NUM_RANKS, NUM_ROWS, WORDS, NUM_DRAFTS, NUM_CANDIDATES, V,
    FIELDS: tl.constexpr, CANDIDATES: tl.constexpr, PROBABILISTIC: tl.constexpr,
    RANKS_POW2: tl.constexpr, POSITIONS_POW2: tl.constexpr, CANDIDATES_POW2: tl.constexpr,
):
    """Batch row b's rows (its G + 1 positions in verification, else the row itself) from
    the words ``[NUM_RANKS, NUM_ROWS, WORDS]``: FIELDS 2 writes argmax's token and status,
    4 sampling's token, logprob, log-sum-exp and status, 5 verification's outputs. With
    CANDIDATES, a truncated row's positions are decided by the ranks' NUM_CANDIDATES keys
    each (`_truncated`) instead of the race."""
    b = tl.program_id(0)
    num_positions = NUM_DRAFTS + 1
    j = tl.arange(0, POSITIONS_POW2)
    valid = j < num_positions
    rows = b * num_positions + j
    ranks = tl.arange(0, RANKS_POW2)
    here = valid[:, None] & (ranks < NUM_RANKS)[None, :]
    at = words_ptr + (ranks[None, :].to(tl.int64) * NUM_ROWS + rows[:, None]) * WORDS
    best = tl.load(at + _BEST, mask=here, other=0).to(tl.float32, bitcast=True)
    best = tl.where(here, best, float("-inf"))
    ids = tl.load(at + _TOKEN, mask=here, other=0)
    top = tl.max(best, axis=1)
    contenders = tl.where(here & (best == top[:, None]), ids, _NO_ID)
    token = tl.min(contenders, axis=1)
    if FIELDS == 2:
        finite = tl.sum((here & (best != best)).to(tl.int32), axis=1) == 0
        tl.store(token_ptr + rows, tl.where(finite, token, -1).to(tl.int64), mask=valid)
        tl.store(status_ptr + rows, tl.where(finite, _OK, _NON_FINITE), mask=valid)
    else:
        parts = tl.load(at + _LSE, mask=here, other=0).to(tl.float32, bitcast=True)
        parts = tl.where(here, parts, float("-inf"))
        finite = tl.sum((here & (parts != parts)).to(tl.int32), axis=1) == 0
        lse = _logsumexp(parts, 1)
        score = tl.load(at + _SCORE, mask=here, other=0).to(tl.float32, bitcast=True)
        won = (contenders == token[:, None]) & (token < _NO_ID)[:, None]
        logprob = tl.sum(tl.where(won, score, 0.0), axis=1) - lse
        sampled, temperature = _row_params(do_sample_ptr, temperature_ptr, b, 1)
        seed = tl.load(seed_ptr + b)
        position = tl.load(position_ptr + b) + j
        target = token
        target_logprob = logprob
        draft_logprob = tl.zeros_like(logprob)
        if FIELDS == 5:
            drafts, is_draft = row_drafts(draft_ptr, b, j, NUM_DRAFTS)
            drafts = tl.where(is_draft, drafts, -1)
            drafted = tl.load(at + _DRAFT, mask=here, other=0).to(tl.float32, bitcast=True)
            draft_s = tl.max(tl.where(here, drafted, float("-inf")), axis=1)
            noise = gumbel_noise(seed, position, tl.maximum(drafts, 0))
            # `token` is the best other token; the draft's score is on its own rank only.
            draft_score = draft_s + tl.where(sampled, noise, 0.0)
            draft_wins = is_draft & ((draft_score > top)
                                     | ((draft_score == top) & (drafts < token)))
            draft_logprob = tl.where(is_draft, draft_s - lse, float("-inf"))
            target = tl.where(draft_wins, drafts, token)
            target_logprob = tl.where(draft_wins, draft_logprob, logprob)
        incomplete = j < 0
        if CANDIDATES:
            top_k = tl.load(top_k_ptr + b)
            top_p = tl.load(top_p_ptr + b)
            min_p = tl.load(min_p_ptr + b)
            if sampled & (((top_k > 0) & (top_k < V)) | (top_p < 1.0) | (min_p > 0.0)):
                for p in range(num_positions):
                    at_p = j == p
                    draft = -1
                    if FIELDS == 5:
                        draft = tl.sum(tl.where(at_p, drafts + 1, 0)) - 1
                    (t_token, t_logprob, t_lse, t_incomplete, t_masked, t_masked_logprob,
                     t_draft_logprob) = _truncated(
                        words_ptr, b * num_positions + p, NUM_RANKS, NUM_ROWS, WORDS,
                        NUM_CANDIDATES, V, temperature, top_k, top_p, min_p, seed,
                        tl.load(position_ptr + b) + p, draft, FIELDS, RANKS_POW2,
                        CANDIDATES_POW2)
                    target = tl.where(at_p, t_token, target)
                    target_logprob = tl.where(at_p, t_logprob, target_logprob)
                    lse = tl.where(at_p, t_lse, lse)
                    incomplete = tl.where(at_p, t_incomplete, incomplete)
                    token = tl.where(at_p, t_masked, token)
                    logprob = tl.where(at_p, t_masked_logprob, logprob)
                    draft_logprob = tl.where(at_p, t_draft_logprob, draft_logprob)
        row_status = tl.where(finite, tl.where(incomplete, _NEEDS_COMPLETION, _OK), _NON_FINITE)
        if FIELDS == 4:
            tl.store(token_ptr + rows, tl.where(row_status == _OK, target, -1).to(tl.int64),
                     mask=valid)
            tl.store(logprob_ptr + rows, tl.where(finite, target_logprob, float("nan")),
                     mask=valid)
            tl.store(lse_ptr + rows, tl.where(finite, lse, float("nan")), mask=valid)
            tl.store(status_ptr + rows, row_status, mask=valid)
        else:
            accept_chain(b, j, drafts, is_draft, target, target_logprob, token, logprob,
                         tl.exp(draft_logprob), draft_logprob, row_status, do_sample_ptr,
                         temperature_ptr, seed_ptr, position_ptr, num_accepted_ptr, token_ptr,
                         accept_probs_ptr, logprob_ptr, status_ptr, NUM_DRAFTS, PROBABILISTIC,
                         POSITIONS_POW2)


@triton.jit
def _logsumexp(x, axis: tl.constexpr):
    """torch.logsumexp's: shifted by the largest value, unless that is infinite."""
    largest = tl.max(x, axis=axis)
    shift = tl.where((largest == float("inf")) | (largest == float("-inf")), 0.0, largest)
    return shift + tl.log(tl.sum(tl.exp(x - tl.expand_dims(shift, axis)), axis=axis))


@triton.jit
def _key_at(ptr):
    """The int64 key stored as two int32 words at `ptr`, low then high."""
    return (tl.load(ptr + 1).to(tl.int64) << 32) | (tl.load(ptr).to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def _keys_at(ptr, mask):
    """`_key_at` of each pointer of `ptr`; PAD_KEY where masked."""
    low = tl.load(ptr, mask=mask, other=0).to(tl.int64) & 0xFFFFFFFF
    high = tl.load(ptr + 1, mask=mask, other=0).to(tl.int64)
    return tl.where(mask, (high << 32) | low, _PAD)


@triton.jit
def _next_below(x):
    """float32 ``nextafter(x, -inf)`` (-inf stays)."""
    key = tl.where(x == 0.0, -1, _order_key(x))   # below +-0: the smallest negative float
    return tl.where(x == float("-inf"), x, _from_order_key(key - 1))


@triton.jit
def _pick(among, perturbed, ids, scores, lse, index):
    """The Gumbel-max token of the entries `among` (the lowest id of equal scores; the first
    entry where none is among) and its logprob."""
    race = tl.where(among, perturbed, float("-inf"))
    won = among & (race == tl.max(race, axis=0))
    at = tl.argmin(tl.where(won, ids.to(tl.int64), 2**62), axis=0, tie_break_left=True)
    chosen = index == at
    return (tl.sum(tl.where(chosen, ids, 0), axis=0),
            tl.sum(tl.where(chosen, scores, 0.0), axis=0) - lse)


@triton.jit
def _truncated(words_ptr, row, NUM_RANKS, NUM_ROWS, WORDS, NUM_CANDIDATES, V, temperature,
               top_k, top_p, min_p, seed, position, draft, FIELDS: tl.constexpr,
               RANKS_POW2: tl.constexpr, CANDIDATES_POW2: tl.constexpr):
    """A truncated row's results from the ranks' candidate keys and floors, as
    `flashspec.parallel.merge._merge_candidates` decides them: its sample, logprob,
    log-sum-exp over the support, whether the support is uncertified, and, with a `draft`
    (-1: none), the best other token, its logprob and the draft's logprob."""
    index = tl.arange(0, RANKS_POW2 * CANDIDATES_POW2)
    rank = index // CANDIDATES_POW2
    column = index % CANDIDATES_POW2
    listed = (rank < NUM_RANKS) & (column < NUM_CANDIDATES)
    base = words_ptr + (rank.to(tl.int64) * NUM_ROWS + row) * WORDS + FIELDS
    keys = tl.sort(_keys_at(base + 2 * column, listed), descending=True)
    raw, ids = unpack_candidates(keys)
    scaled = temperature != 1.0
    scores = tl.where(scaled, raw / temperature, raw)
    # transformers' preference: higher transformed logit, then lower id (two raw logits can
    # round to one transformed value); -0.0 ties with +0.0.
    scores, ids = unpack_candidates(tl.sort(
        pack_candidates(tl.where(scores == 0.0, 0.0, scores), ids), descending=True))
    real = scores > float("-inf")

    # A token missing from the list has a key below its rank's floor: an entry is certified
    # when it ranks before every such token, on every rank that could not list its shard.
    certified_entry = real
    partial_ranks = 0
    for i in range(NUM_RANKS):
        floor = _key_at(words_ptr + (i * NUM_ROWS + row).to(tl.int64) * WORDS + FIELDS
                        + 2 * NUM_CANDIDATES)
        partial = floor != _PAD
        last_raw, last_id = unpack_candidates(floor)
        below_raw = _next_below(last_raw)
        last_s = tl.where(scaled, last_raw / temperature, last_raw)
        below_s = tl.where(scaled, below_raw / temperature, below_raw)
        before_missing = (scores > last_s) | ((scores == last_s) & (ids <= last_id)
                                              & (scores > below_s))
        certified_entry = certified_entry & tl.where(partial, before_missing, real)
        partial_ranks += partial.to(tl.int32)
    certified = tl.sum(certified_entry.to(tl.int32), axis=0)

    top = tl.max(scores, axis=0)
    gap = scores.to(tl.float64) - top.to(tl.float64)
    weights = tl.exp(gap)
    keep = real
    num_listed = NUM_RANKS * NUM_CANDIDATES
    use_top_k = (top_k > 0) & (top_k < V)
    kth = tl.sum(tl.where(index == tl.minimum(tl.maximum(top_k, 1), num_listed) - 1, scores,
                          0.0), axis=0)
    if use_top_k:
        keep = keep & (scores >= kth)
    top_k_support = tl.sum(keep.to(tl.int32), axis=0)
    after_top = index > 0
    if top_p < 1.0:
        # The mass from the token down (itself included) against 1 - top_p in float32, over
        # the top-k's support, or over the whole vocabulary (the ranks' log-sum-exp).
        mass = tl.where(keep, weights, 0.0)
        ranks = tl.arange(0, RANKS_POW2)
        lse_parts = tl.load(words_ptr + (ranks.to(tl.int64) * NUM_ROWS + row) * WORDS + _LSE,
                            mask=ranks < NUM_RANKS, other=0)
        lse_parts = tl.where(ranks < NUM_RANKS,
                             lse_parts.to(tl.float32, bitcast=True).to(tl.float64),
                             float("-inf"))
        total = tl.where(use_top_k, tl.sum(mass, axis=0),
                         tl.exp(_logsumexp(lse_parts, 0) - top.to(tl.float64)))
        from_here = total - (tl.cumsum(mass, 0) - mass)
        threshold = (1.0 - top_p).to(tl.float32).to(tl.float64) * total
        keep = keep & ~((from_here <= threshold) & after_top)
    if min_p > 0.0:   # probability against min_p times the top one's
        keep = keep & ~((weights < min_p.to(tl.float32).to(tl.float64)) & after_top)
    num_keep = tl.sum(keep.to(tl.int32), axis=0)
    incomplete = (partial_ranks > 0) & (
        (num_keep >= certified)
        | (use_top_k & ((top_k > num_listed) | (top_k_support >= certified))))

    lse = (top.to(tl.float64) + tl.log(tl.sum(tl.where(keep, weights, 0.0), axis=0)))
    lse = lse.to(tl.float32)
    perturbed = tl.where(keep, scores + gumbel_noise(seed, position, ids.to(tl.int64)),
                         float("-inf"))
    token, logprob = _pick(keep, perturbed, ids, scores, lse, index)
    masked = token
    masked_logprob = logprob
    draft_logprob = float("-inf")
    if FIELDS == 5:
        # The support is certified whole: a draft outside the kept entries has probability 0.
        is_draft = keep & (ids == draft)
        draft_kept = tl.sum(is_draft.to(tl.int32), axis=0) > 0
        draft_logprob = tl.where(draft_kept,
                                 tl.sum(tl.where(is_draft, scores, 0.0), axis=0) - lse,
                                 float("-inf"))
        others = keep & ~is_draft
        other, other_logprob = _pick(others, perturbed, ids, scores, lse, index)
        # A support of the draft alone: it is accepted with probability 1, `masked` unused.
        alone = tl.sum(others.to(tl.int32), axis=0) == 0
        masked = tl.where(alone, token, other)
        masked_logprob = tl.where(alone, logprob, other_logprob)
    return token, logprob, lse, incomplete, masked, masked_logprob, draft_logprob


def merge_shard_summaries(words: torch.Tensor, layout, vocab_size: int,
                          params: SamplingParams | None = None,
                          positions: torch.Tensor | None = None,
                          draft_tokens: torch.Tensor | None = None, acceptance: str = "strict"):
    """The call's result from every rank's summary words ``[n, R, layout.words]``
    (`layout`: the call's `flashspec.parallel.summary.SummaryLayout`, whose fields say the
    op) over a vocabulary of `vocab_size` tokens:

    * argmax (2 fields): `ArgmaxOutput` of the R rows;
    * sample (4): `SampleOutput` of the R rows with `params` and noise `positions` ``[R]``;
    * verify (5): `VerifyOutput` of ``draft_tokens [B, G]`` (R = B * (G+1), position j of
      batch row b at b * (G+1) + j), `params` and `positions` ``[B]`` per batch row (the
      first draft's index), `acceptance` "strict" or "probabilistic".

    Rows whose truncated support the candidates leave uncertified come back with status
    `NEEDS_COMPLETION` (tokens -1), as `flashspec.parallel` flags them with
    ``complete=False``. Unchecked; no host read, no data-dependent allocation (a CUDA graph
    can hold it).
    """
    num_ranks, num_rows, num_words = words.shape
    fields, num_candidates = layout.fields, layout.num_candidates
    if num_words != layout.words:
        raise ValueError(f"the layout has {layout.words} words per row, the summaries "
                         f"{num_words}")
    words = words.contiguous()
    device = words.device
    num_drafts = 0 if draft_tokens is None else draft_tokens.shape[1]
    batch_size = num_rows // (num_drafts + 1)
    tokens = torch.empty(batch_size, num_drafts + 1, dtype=torch.int64, device=device)
    status = torch.empty(batch_size, dtype=torch.int32, device=device)
    logprobs = lse = num_accepted = accept_probs = words     # (unwritten where not returned)
    if fields > 2:
        logprobs = torch.empty(batch_size, num_drafts + 1, dtype=torch.float32, device=device)
    if fields == 4:
        lse = torch.empty(num_rows, dtype=torch.float32, device=device)
    if fields == 5:
        num_accepted = torch.empty(batch_size, dtype=torch.int64, device=device)
        accept_probs = torch.empty(batch_size, num_drafts, dtype=torch.float32, device=device)
    row = (words,) * 6 if params is None else (
        params.do_sample, params.temperature, params.top_k, params.top_p, params.min_p,
        params.seed)
    ranks_pow2 = triton.next_power_of_2(num_ranks)
    candidates_pow2 = triton.next_power_of_2(max(num_candidates, 1))
    listed = ranks_pow2 * candidates_pow2
    shard_merge_kernel[(batch_size,)](
        words, *row, words if positions is None else positions,
        draft_tokens.contiguous() if num_drafts else words,
        tokens, logprobs, lse, status, num_accepted, accept_probs,
        num_ranks, num_rows, num_words, num_drafts, num_candidates, vocab_size,
        FIELDS=fields, CANDIDATES=num_candidates > 0,
        PROBABILISTIC=acceptance == "probabilistic", RANKS_POW2=ranks_pow2,
        POSITIONS_POW2=triton.next_power_of_2(num_drafts + 1),
        CANDIDATES_POW2=candidates_pow2,
        num_warps=1 if not num_candidates else 4 if listed <= 1024 else 8,
    )
    if fields == 2:
        return ArgmaxOutput(tokens.view(-1), status)
    if fields == 4:
        return SampleOutput(tokens.view(-1), logprobs.view(-1), lse, status)
    return VerifyOutput(num_accepted, tokens, accept_probs, logprobs, status)
