"""Stage 2 over a vocabulary shard (`shard_summary_kernel`) and its launcher,
`fused_shard_summaries`: each row's summary words of `flashspec.parallel.summary`, from
stage 1's tiles, the shard's logits never in memory.

Vocab-parallel sampling (`flashspec.parallel`) splits the LM head by vocabulary rows; each
rank summarises its shard per row, the ranks all-gather the summaries and merge them. Here
stage 1 (`lm_head.py`, `lm_head_ws.py`) runs over the shard with its noise keyed by global
ids (`vocab_offset`), and one program per row writes, instead of a token, what
`flashspec.parallel.shard.summarize` writes from the materialized logits: the best score
and its global id, the score's transformed logit, the shard's log-sum-exp, the draft's
logit, and, where the call truncates, the shard's top candidate keys and their floor.

The words are those of `summarize` for every field the merge reads, with one difference in
kind: the keys are the tiles' candidates merged (as `merge.lm_head_rows_kernel` merges
them), exact only down to a floor key that the merge certifies against, where `summarize`
lists the shard's top keys exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from ..params import LogitEdits, SamplingParams
from .keys import PAD_KEY
from .merge import _merged_candidates
from .ops import (_on_hidden_device, _stage1, check_device, greedy_params, kernel_variant,
                  programmatic_launch_ready)
from .rows import _row_drafts
from .tile_config import TileConfig

# Fields of `flashspec.parallel.summary`, in its order: argmax writes the first two,
# sampling four, verification five.
_BEST, _TOKEN, _SCORE, _LSE, _DRAFT = (tl.constexpr(field) for field in range(5))
# The smallest key of a finite logit (PAD_KEY is that of -inf, with no id bits).
_FINITE = tl.constexpr(PAD_KEY + 2**32)


@triton.jit
def _store_key(words_ptr, key, mask=None):
    """An int64 key as two int32 words, low then high (a little-endian int64 read back)."""
    tl.store(words_ptr, key.to(tl.int32), mask=mask)
    tl.store(words_ptr + 1, (key >> 32).to(tl.int32), mask=mask)


@triton.jit
def shard_summary_kernel(
    best_ptr, best_id_ptr, best_s_ptr, max_ptr, sumexp_ptr, bad_ptr, cand_ptr, draft_s_ptr,
    draft_ptr, words_ptr, num_words, vocab_offset, num_candidates, V, NUM_VT, ROWS_PER_PARAM,
    FIELDS: tl.constexpr, TILE_DRAFTS: tl.constexpr, BLOCK_V: tl.constexpr,
    CAND: tl.constexpr, K_MAX: tl.constexpr, TOP_TILES: tl.constexpr, VT_POW2: tl.constexpr,
    PAD: tl.constexpr, PDL: tl.constexpr,
):
    """Per row, its `num_words` summary words at ``words_ptr + row * num_words``:

    * BEST, the best tile's best (NaN where the row is not finite: some tile is `bad`),
      TOKEN its global id, ``vocab_offset`` + the lowest local id of the tiles that have it;
    * with FIELDS >= 4: SCORE, the best tile's s, and LSE, from the tiles' maxima and sums
      (NaN where not finite);
    * with FIELDS == 5: DRAFT, the draft's s where stage 1 left the drafts out (TILE_DRAFTS)
      and this shard holds the row's (`draft_ptr`: shard ids, -1 where it does not); -inf
      otherwise, where every sampled row is truncated and the merge reads none;
    * with CAND (stage 1's candidates per tile) > 0: `num_candidates` keys in global ids,
      the first min(num_candidates, K_MAX) of the tiles' merged candidates, then `PAD`; and
      the floor, the largest key that a token of the shard missing from them can lie below,
      as `merge.lm_head_rows_kernel`'s certificate: the last candidate of a tile that holds
      more of the shard's V tokens than its candidates, the last key written, the bound of
      the tiles left out of the merge; `PAD` where none can be missing. Tokens whose logit
      is -inf, which no truncation keeps, count as no candidates (and are never missing)."""
    if PDL:  # launched before stage 1 ended: wait for its summaries
        gdc_wait()
    row = tl.program_id(0)
    out = words_ptr + row.to(tl.int64) * num_words
    tiles = tl.arange(0, VT_POW2)
    t_ok = tiles < NUM_VT
    base = row * NUM_VT
    best = tl.load(best_ptr + base + tiles, mask=t_ok, other=float("-inf"))
    ids = tl.load(best_id_ptr + base + tiles, mask=t_ok, other=0)
    top = tl.max(best, axis=0)
    # Ties between tiles go to the lower token id (interleaved tiles do not follow id order).
    winner = tl.argmin(tl.where(best == top, ids, 0x7FFFFFFF), axis=0)
    token = tl.sum(tl.where(tiles == winner, ids, 0))
    bad = tl.sum(tl.load(bad_ptr + base + tiles, mask=t_ok, other=0)) > 0
    tl.store(out + _BEST, tl.where(bad, float("nan"), top).to(tl.int32, bitcast=True))
    tl.store(out + _TOKEN, token + vocab_offset)
    if FIELDS > _LSE:
        best_s = tl.load(best_s_ptr + base + tiles, mask=t_ok, other=0.0)
        tl.store(out + _SCORE, tl.sum(tl.where(tiles == winner, best_s, 0.0)).to(
            tl.int32, bitcast=True))
        tile_max = tl.load(max_ptr + base + tiles, mask=t_ok, other=float("-inf"))
        tile_sum = tl.load(sumexp_ptr + base + tiles, mask=t_ok, other=0.0)
        row_max = tl.max(tile_max, axis=0)
        lse = row_max + tl.log(tl.sum(tile_sum * tl.exp(tile_max - row_max), axis=0))
        tl.store(out + _LSE, tl.where(bad, float("nan"), lse).to(tl.int32, bitcast=True))
    if FIELDS > _DRAFT:
        here = (_row_drafts(draft_ptr, row, True, ROWS_PER_PARAM) >= 0) & TILE_DRAFTS
        draft_s = tl.where(here, tl.load(draft_s_ptr + row, mask=here, other=0.0),
                           float("-inf"))
        tl.store(out + _DRAFT, draft_s.to(tl.int32, bitcast=True))

    if CAND > 0:
        keys_out = out + FIELDS
        cand_base = cand_ptr + row.to(tl.int64) * NUM_VT * CAND
        merged, left_out = _merged_candidates(cand_base, tiles, t_ok, NUM_VT, CAND, K_MAX,
                                              TOP_TILES, VT_POW2, PAD)
        # Keys of -inf (a tile's columns past its tokens, or exhausted) are no candidates:
        # PAD. Global ids: MASK31 - (id + offset) = (MASK31 - id) - offset, no borrow.
        merged = tl.where(merged >= _FINITE, merged - vocab_offset, PAD)
        rank = tl.arange(0, K_MAX)
        written = tl.minimum(num_candidates, K_MAX)
        _store_key(keys_out + 2 * rank, merged, rank < written)
        for start in range(K_MAX, num_candidates, K_MAX):
            pad_rank = start + rank
            _store_key(keys_out + 2 * pad_rank, tl.full((K_MAX,), PAD, tl.int64),
                       pad_rank < num_candidates)
        # A token missing from the keys lies below its tile's last candidate (unless the
        # candidates hold the tile's every token: its interleaved groups of 16 up to V),
        # below the last key written, or in a tile left out (below `left_out`, a bound on
        # order keys with no id: the offset does not apply).
        held = tl.zeros((VT_POW2,), tl.int32)
        for group in tl.static_range(BLOCK_V // 16):
            held += tl.minimum(tl.maximum(V - (group * NUM_VT + tiles) * 16, 0), 16)
        tile_last = tl.max(tl.load(cand_base + tiles * CAND + CAND - 1,
                                   mask=t_ok & (held > CAND), other=PAD), axis=0)
        tile_last = tl.where(tile_last >= _FINITE, tile_last - vocab_offset, PAD)
        last_written = tl.sum(tl.where(rank == written - 1, merged, 0))
        floor_key = tl.maximum(tl.maximum(tile_last, last_written), left_out)
        _store_key(keys_out + 2 * num_candidates, floor_key)


@_on_hidden_device
def fused_shard_summaries(hidden: torch.Tensor, weight: torch.Tensor, layout,
                          params: SamplingParams | None, positions: torch.Tensor | None,
                          vocab_offset: int, vocab_size: int, *, drafts: torch.Tensor | None = None,
                          edits: LogitEdits | None = None, bias: torch.Tensor | None = None,
                          softcap: float | None = None,
                          config: TileConfig | None = None) -> torch.Tensor:
    """int32 summary words ``[R, layout.words]`` of each row over this rank's vocabulary shard,
    as `flashspec.parallel.shard.summarize` lays them out, without the shard's logits.

    Args:
        hidden: ``[B, D]`` (argmax, sample) or ``[B, G+1, D]`` (verify: R = B * (G+1) rows,
            row r position r % (G+1) of batch row r // (G+1)).
        weight: ``[V_r, D]``, the shard: global tokens ``vocab_offset .. vocab_offset + V_r - 1``.
        layout: the call's `flashspec.parallel.summary.SummaryLayout` (its fields say the op:
            2 argmax, 4 sample, 5 verify; its candidates, the keys written).
        params: `SamplingParams` of the B rows; None for argmax.
        positions: int64 ``[B]``, each row's noise position (verify: its first draft's; position
            j adds j); None for argmax.
        vocab_offset: the shard's first global token id: keys the noise, and the ids written.
        vocab_size: the whole vocabulary's size: the rules of top-k compare with it.
        drafts: verify only, int64 ``[B, G]`` global draft ids, -1 padded.
        edits: `LogitEdits` of the B rows in the shard's columns (codes ``[B, V_r]``, verify
            ``[B, G+1, V_r]``; counts before the first position), as `fused_sample` and
            `fused_verify` take them.
        bias, softcap: the model's head, the bias of the shard's columns ``[V_r]``.
        config: stage 1's tiles (None: `default_config`); its ``max_support`` and
            ``candidates`` bound the keys merged.

    Stage 1 always computes the log-sum-exp for sample and verify (the merge needs every
    shard's). No host synchronisation, no data-dependent allocation.

    Example:
        >>> layout = summary.summary_layout("sample", shards, params)
        >>> words = fused_shard_summaries(hidden, shards.local(full_weight), layout, params,
        ...                               positions, shards.offset, shards.vocab_size)
    """
    check_device(hidden)
    shard_size = weight.shape[0]
    verify = drafts is not None
    rows_per_param = 1
    if verify:
        batch_size, rows_per_param, dim = hidden.shape
        hidden = hidden.reshape(batch_size * rows_per_param, dim)
        here = (drafts >= vocab_offset) & (drafts < vocab_offset + shard_size)
        drafts = torch.where(here, drafts - vocab_offset, -1).contiguous()
    num_rows = hidden.shape[0]
    device = hidden.device
    if params is None and edits is not None:  # one greedy parameter row per row: its penalties
        params, positions = greedy_params(num_rows, device)
    num_candidates = layout.num_candidates
    variant = kernel_variant(params, vocab_size, verify)._replace(
        truncate=num_candidates > 0, need_lse=layout.fields > _LSE.value)
    tiles = _stage1(hidden, weight, params, positions, rows_per_param, config, variant, drafts,
                    edits, bias, softcap, vocab_offset)
    config, cand = tiles.config, tiles.cand
    words = torch.empty(num_rows, layout.words, dtype=torch.int32, device=device)
    vt_pow2 = triton.next_power_of_2(tiles.num_vt)
    # The keys merged: the call's (a power of two at least), up to the config's support.
    wanted = min(config.max_support, triton.next_power_of_2(max(num_candidates, 1)))
    top_tiles = min(wanted, vt_pow2)
    pdl = programmatic_launch_ready(device)
    shard_summary_kernel[(num_rows,)](
        tiles.best, tiles.best_id, tiles.best_s, tiles.tile_max, tiles.tile_sum, tiles.bad,
        tiles.candidates, tiles.draft_s, tiles.drafts, words, layout.words, vocab_offset,
        num_candidates, shard_size, tiles.num_vt, tiles.rows_per_param,
        FIELDS=layout.fields, TILE_DRAFTS=variant.tile_drafts, BLOCK_V=config.block_v,
        CAND=cand, K_MAX=min(wanted, top_tiles * max(cand, 1)), TOP_TILES=top_tiles,
        VT_POW2=vt_pow2, PAD=PAD_KEY, PDL=pdl, num_warps=config.merge_warps if cand else 4,
        launch_pdl=pdl,
    )
    return words
