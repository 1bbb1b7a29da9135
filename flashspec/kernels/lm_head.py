"""Stage 1 of the fused LM head, the Triton kernel: logits tiles on chip, never stored.

`lm_head_tiles_kernel`, one program per (vocab tile, row tile): the logits tile
``hidden[r0:r0+BR] @ weight[tile's tokens].T`` in fp32 (a tile holds BV consecutive tokens,
or, when truncating, BV / 16 interleaved groups of 16: `rows._column_tokens`), made the
model's logits with BIAS / SOFTCAP (`epilogue._head_logits`: its LM-head bias, Gemma-2's
softcap), edited by the rows' logit edits (`epilogue._edited_logits`: with LOGIT_BIAS a
bias, with CODES the repetition penalty and bans, with COUNTS vLLM's frequency and presence
penalties), summarised per (row, tile) by the epilogue (`epilogue.py`; with
``TileConfig.race``, `race.py`) into ``[R, NUM_VT]`` arrays that stage 2 (`merge.py`) reduces
per row. Without BIAS, SOFTCAP and the edits' flags the kernel compiles to what it is
without those features.

The weight may be a vocabulary shard (`flashspec.parallel`), whose token j is global token
``vocab_offset + j`` (0 for the whole vocabulary): the Gumbel noise is keyed by global ids,
everything else (weight rows, edits, ids written, drafts read) is in the shard's own. Where
the offset is not a multiple of 16, COLUMN_NOISE draws each column's Philox word on its own
(`epilogue._part_bits`: four times the Philox work of the sampled rows).

Above 64 rows on Hopper (32 when truncating), stage 1 is
`lm_head_ws.lm_head_tiles_ws_kernel` instead, a warp-specialized Gluon kernel running the
same epilogue, head transforms and edits included.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .epilogue import (_additive_operands, _edited_logits, _exact_best, _head_logits,
                       _noise_summary, _part_bits, _scaled_logits, _store_candidates,
                       _store_summary, _tile_summary)
from .noise import philox_blocks
from .race import (_beaten_summary, _leader_summary, _publish_bounds, _race_beaten,
                   _race_leaders, _racing_rows, _row_bounds)
from .rows import _column_tokens, _row_drafts, _row_noise_keys, _row_params


@triton.jit
def _part_word_keys(first_column, pid_v, NUM_VT, vocab_offset, PART_V: tl.constexpr,
                    BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr, COLUMN_NOISE: tl.constexpr):
    """What `epilogue._part_bits` draws the Philox words of columns first_column + [0, PART_V)
    of vocab tile `pid_v` from: the Philox blocks of their groups of 16 global ids (a tile's
    groups of 16 tokens are aligned, and so are the global ids' where `vocab_offset` is a
    multiple of 16), or with COLUMN_NOISE their global ids."""
    if COLUMN_NOISE:
        tokens = _column_tokens(first_column + tl.arange(0, PART_V), pid_v, NUM_VT, BLOCK_V,
                                INTERLEAVE)
        word_keys = tokens.to(tl.int64) + vocab_offset
    else:
        groups = _column_tokens(first_column + tl.arange(0, PART_V // 16) * 16, pid_v, NUM_VT,
                                BLOCK_V, INTERLEAVE) // 16
        word_keys = philox_blocks(groups + vocab_offset // 16, tl.arange(0, 4))
    return word_keys


@triton.jit
def _part_summary(acc, first_column, pid_v, NUM_VT, V, vocab_offset, inv_t, sampled, seed,
                  position, draft, bound, r_ok, BLOCK_R: tl.constexpr, PART_V: tl.constexpr,
                  BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr, EVEN_V: tl.constexpr,
                  SAMPLE: tl.constexpr, LSE: tl.constexpr, DRAFT: tl.constexpr,
                  SCREEN: tl.constexpr, RACE: tl.constexpr, COLUMN_NOISE: tl.constexpr):
    """`_tile_summary` of columns first_column + [0, PART_V) of vocab tile `pid_v`; with SCREEN
    sampled rows through `_screen` (fewer instructions, more registers: for tiles where the
    epilogue, not the weight's stream, bounds the time); with RACE a part whose every row
    is beaten by its bound (`_race_beaten`) skips the search for its best. The noise of a
    column is keyed by its global id, `vocab_offset` + its token."""
    columns = first_column + tl.arange(0, PART_V)
    s, row_sum, offs_v = _scaled_logits(acc, columns, pid_v, NUM_VT, V, inv_t, BLOCK_V,
                                        INTERLEAVE, EVEN_V)
    if SAMPLE:
        # Philox words after `_scaled_logits` (before it, verification's epilogue on 128x64
        # tiles takes 161 registers instead of 128: one program per SM instead of two).
        word_keys = _part_word_keys(first_column, pid_v, NUM_VT, vocab_offset, PART_V, BLOCK_V,
                                    INTERLEAVE, COLUMN_NOISE)
        bits = _part_bits(seed, position, word_keys, BLOCK_R, PART_V, COLUMN_NOISE)
        if RACE:
            racing = _racing_rows(sampled, draft, pid_v, NUM_VT, BLOCK_V, INTERLEAVE, DRAFT)
            beaten, tile_max, exp_s = _race_beaten(s, row_sum, bits, bound, racing, r_ok, LSE)
            if beaten:
                summary = _beaten_summary(row_sum, tile_max, exp_s, LSE)
            else:
                single, num_candidates, leader, leader_s = _race_leaders(
                    s, row_sum, columns, bits, bound, racing, r_ok, tile_max, exp_s, BLOCK_V,
                    LSE)
                if single:
                    summary = _leader_summary(num_candidates, leader, leader_s, row_sum,
                                              tile_max, exp_s, seed, position, pid_v, NUM_VT,
                                              vocab_offset, BLOCK_V, INTERLEAVE, LSE)
                else:
                    summary = _noise_summary(s, row_sum, offs_v, columns, bits, word_keys,
                                             pid_v, NUM_VT, vocab_offset, sampled, seed,
                                             position, draft, BLOCK_R, PART_V, BLOCK_V,
                                             INTERLEAVE, LSE, DRAFT, SCREEN, COLUMN_NOISE)
        else:
            summary = _noise_summary(s, row_sum, offs_v, columns, bits, word_keys, pid_v, NUM_VT,
                                     vocab_offset, sampled, seed, position, draft, BLOCK_R,
                                     PART_V, BLOCK_V, INTERLEAVE, LSE, DRAFT, SCREEN,
                                     COLUMN_NOISE)
    else:
        best, best_column, best_s, draft_s = _exact_best(s, row_sum, offs_v, columns, s, sampled,
                                                         draft, SAMPLE, LSE, DRAFT)
        summary = _tile_summary(s, row_sum, best, best_column, best_s, draft_s, pid_v, NUM_VT,
                                BLOCK_V, INTERLEAVE, LSE)
    return summary


@triton.jit
def _halves(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Columns [0, COLS/2) and [COLS/2, COLS) of x [ROWS, COLS] (register moves only)."""
    return tl.split(tl.permute(tl.reshape(x, (ROWS, 2, COLS // 2)), (0, 2, 1)))


@triton.jit
def _merge_summaries(a, b, LSE: tl.constexpr):
    """Summary of two neighbouring parts of a vocab tile, `a` holding the lower token ids."""
    best, best_id, row_sum, tile_max, sumexp, best_s, draft_s = a
    best1, best_id1, row_sum1, tile_max1, sumexp1, best_s1, draft_s1 = b
    second = best1 > best  # ties stay with the lower ids
    best = tl.where(second, best1, best)
    best_id = tl.where(second, best_id1, best_id)
    row_sum += row_sum1
    if LSE:
        merged_max = tl.maximum(tile_max, tile_max1)
        # A part of the last tile may lie wholly past V (its sum is NaN there).
        upper = tl.where(tile_max1 > float("-inf"), sumexp1 * tl.exp(tile_max1 - merged_max), 0.0)
        sumexp = sumexp * tl.exp(tile_max - merged_max) + upper
        tile_max = merged_max
        best_s = tl.where(second, best_s1, best_s)
    return best, best_id, row_sum, tile_max, sumexp, best_s, draft_s + draft_s1


@triton.jit
def lm_head_tiles_kernel(
    hidden_ptr, weight_ptr, hidden_desc, weight_desc, do_sample_ptr, temperature_ptr, seed_ptr, position_ptr,
    best_ptr, best_id_ptr, best_s_ptr, max_ptr, sumexp_ptr, bad_ptr, cand_ptr,
    draft_ptr, draft_s_ptr, bound_ptr, codes_ptr, penalty_ptr, logit_bias_ptr, counts_ptr,
    frequency_ptr, presence_ptr, bias_ptr, softcap,
    R, V, D, stride_hidden, stride_weight, NUM_VT, ROWS_PER_PARAM, vocab_offset,
    SAMPLE: tl.constexpr, LSE: tl.constexpr, CAND: tl.constexpr, DRAFT: tl.constexpr,
    CODES: tl.constexpr, LOGIT_BIAS: tl.constexpr, BIAS_PER_POSITION: tl.constexpr,
    COUNTS: tl.constexpr, BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    IEEE_DOT: tl.constexpr, INTERLEAVE: tl.constexpr,
    EVEN_V: tl.constexpr, EVEN_D: tl.constexpr, TMA: tl.constexpr, PARTS: tl.constexpr,
    SCREEN: tl.constexpr, RACE: tl.constexpr, COLUMN_NOISE: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # stage 2 may be scheduled once every program has started (it waits to read)
        gdc_launch_dependents()
    pid = tl.program_id(0)
    # Row tiles of one vocab tile are neighbours in launch order: the weight tile is read
    # from HBM once and from L2 by the other row tiles.
    num_rt = tl.cdiv(R, BLOCK_R)
    pid_r = pid % num_rt
    pid_v = pid // num_rt
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_v = _column_tokens(tl.arange(0, BLOCK_V), pid_v, NUM_VT, BLOCK_V, INTERLEAVE)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = offs_r < R
    v_ok = offs_v < V

    # The tile is [rows, vocab]: per-row reductions run along the MMA's N dimension, inside
    # a warp, instead of across warps through shared memory. Loads go through TMA
    # descriptors (zero-filled out of bounds) when the rows are 16-byte aligned and the
    # tile is one box (ops.tma_descriptors): at large B that is what brings the main loop
    # to cuBLAS's speed.
    h_ptrs = hidden_ptr + offs_r[:, None].to(tl.int64) * stride_hidden + offs_d[None, :]
    w_ptrs = weight_ptr + offs_v[:, None].to(tl.int64) * stride_weight + offs_d[None, :]
    # The additive edits' operands before the main loop (`epilogue._additive_operands`:
    # fewer registers than beside the logits, and their loads overlap the weight's).
    additive = _additive_operands(logit_bias_ptr, counts_ptr, draft_ptr,
                                  tl.where(r_ok, offs_r, 0), offs_v, r_ok, v_ok, V,
                                  ROWS_PER_PARAM, LOGIT_BIAS, BIAS_PER_POSITION, COUNTS)
    acc = tl.zeros((BLOCK_R, BLOCK_V), dtype=tl.float32)
    for k in tl.range(0, D, BLOCK_D, num_stages=NUM_STAGES):
        if TMA:
            h = hidden_desc.load([pid_r * BLOCK_R, k])
            if INTERLEAVE:  # the weight as [BLOCK_V / 16, NUM_VT, 16, D]: groups of the tile
                w = tl.reshape(weight_desc.load([0, pid_v, 0, k]), (BLOCK_V, BLOCK_D))
            else:
                w = weight_desc.load([pid_v * BLOCK_V, k])
        else:
            d_ok = ((k + offs_d) < D) | EVEN_D
            h = tl.load(h_ptrs + k, mask=r_ok[:, None] & d_ok[None, :], other=0.0)
            if EVEN_V and EVEN_D:
                w = tl.load(w_ptrs + k)
            else:
                w = tl.load(w_ptrs + k, mask=v_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE_DOT:
            acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(h, tl.trans(w), acc)

    safe_rows = tl.where(r_ok, offs_r, 0)
    if BIAS or SOFTCAP:  # the model's own logits: what transformers' processors receive
        acc = _head_logits(acc, bias_ptr, softcap, offs_v, v_ok, BIAS, SOFTCAP)
    if CODES or LOGIT_BIAS or COUNTS:  # the logits processors, before temperature
        acc = _edited_logits(acc, codes_ptr, penalty_ptr, additive, frequency_ptr,
                             presence_ptr, safe_rows, offs_v, r_ok, v_ok, V, ROWS_PER_PARAM,
                             CODES, LOGIT_BIAS, COUNTS)
    sampled, temperature = _row_params(do_sample_ptr, temperature_ptr, safe_rows, ROWS_PER_PARAM)
    # One division per row; the product differs from HF's division by at most an ulp,
    # which only matters at near-ties (stage 2 divides exactly where thresholds are set).
    inv_t = 1.0 / temperature
    seed, position = _row_noise_keys(seed_ptr, position_ptr, safe_rows, ROWS_PER_PARAM)
    draft = offs_r  # unused without DRAFT
    if DRAFT:
        # Verification: the drafted token is left out of the tile's best (the recovered
        # token on rejection); its scaled logit goes out from the one tile that holds it.
        draft = _row_drafts(draft_ptr, safe_rows, r_ok, ROWS_PER_PARAM)
    bound = inv_t  # unused without RACE
    if RACE:  # read after the main loop: the freshest bounds
        bound = _row_bounds(bound_ptr, offs_r, r_ok)
    # The tile is summarised in PARTS vocab parts one after the other: fewer values live
    # at once, so large tiles (what the main loop wants at large B) need fewer registers.
    if PARTS == 1:
        summary = _part_summary(acc, 0, pid_v, NUM_VT, V, vocab_offset, inv_t, sampled, seed,
                                position, draft, bound, r_ok, BLOCK_R, BLOCK_V, BLOCK_V,
                                INTERLEAVE, EVEN_V, SAMPLE, LSE, DRAFT, SCREEN, RACE, COLUMN_NOISE)
    else:
        lo, hi = _halves(acc, BLOCK_R, BLOCK_V)
        if PARTS == 2:
            half: tl.constexpr = BLOCK_V // 2
            summary = _part_summary(lo, 0, pid_v, NUM_VT, V, vocab_offset, inv_t, sampled, seed,
                                    position, draft, bound, r_ok, BLOCK_R, half, BLOCK_V,
                                    INTERLEAVE, EVEN_V, SAMPLE, LSE, DRAFT, SCREEN, RACE,
                                    COLUMN_NOISE)
            summary = _merge_summaries(summary, _part_summary(
                hi, half, pid_v, NUM_VT, V, vocab_offset, inv_t, sampled, seed, position, draft,
                bound, r_ok, BLOCK_R, half, BLOCK_V, INTERLEAVE, EVEN_V, SAMPLE, LSE, DRAFT,
                SCREEN, RACE, COLUMN_NOISE), LSE)
        else:
            quarter: tl.constexpr = BLOCK_V // 4
            q0, q1 = _halves(lo, BLOCK_R, BLOCK_V // 2)
            q2, q3 = _halves(hi, BLOCK_R, BLOCK_V // 2)
            summary = _part_summary(q0, 0, pid_v, NUM_VT, V, vocab_offset, inv_t, sampled, seed,
                                    position, draft, bound, r_ok, BLOCK_R, quarter, BLOCK_V,
                                    INTERLEAVE, EVEN_V, SAMPLE, LSE, DRAFT, SCREEN, RACE,
                                    COLUMN_NOISE)
            summary = _merge_summaries(summary, _part_summary(
                q1, quarter, pid_v, NUM_VT, V, vocab_offset, inv_t, sampled, seed, position,
                draft, bound, r_ok, BLOCK_R, quarter, BLOCK_V, INTERLEAVE, EVEN_V, SAMPLE, LSE,
                DRAFT, SCREEN, RACE, COLUMN_NOISE), LSE)
            summary = _merge_summaries(summary, _part_summary(
                q2, 2 * quarter, pid_v, NUM_VT, V, vocab_offset, inv_t, sampled, seed, position,
                draft, bound, r_ok, BLOCK_R, quarter, BLOCK_V, INTERLEAVE, EVEN_V, SAMPLE, LSE,
                DRAFT, SCREEN, RACE, COLUMN_NOISE), LSE)
            summary = _merge_summaries(summary, _part_summary(
                q3, 3 * quarter, pid_v, NUM_VT, V, vocab_offset, inv_t, sampled, seed, position,
                draft, bound, r_ok, BLOCK_R, quarter, BLOCK_V, INTERLEAVE, EVEN_V, SAMPLE, LSE,
                DRAFT, SCREEN, RACE, COLUMN_NOISE), LSE)
    _store_summary(summary, offs_r, r_ok, draft, pid_v, NUM_VT, best_ptr, best_id_ptr, best_s_ptr,
                   max_ptr, sumexp_ptr, bad_ptr, draft_s_ptr, BLOCK_V, INTERLEAVE, LSE, DRAFT)
    if RACE and SAMPLE:
        _publish_bounds(bound_ptr, offs_r, r_ok, sampled, summary[0], summary[2], bound)
    if CAND > 0:
        _store_candidates(acc, offs_v, V, cand_ptr + (offs_r * NUM_VT + pid_v) * CAND, r_ok,
                          CAND, EVEN_V)
