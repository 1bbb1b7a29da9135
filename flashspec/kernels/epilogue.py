"""Stage 1's epilogue: the per-(row, vocab tile) summaries of one logits tile.

From the fp32 logits tile ``acc`` ``[rows, columns]``, first made the model's own logits where
its head transforms them (`_head_logits`: an LM-head bias, then Gemma-2's softcap), then
edited where the call has logit edits (`_edited_logits`: a logit bias, the repetition
penalty, vLLM's frequency and presence penalties, banned tokens, after the model and before
temperature, as in transformers), ``s`` = logits / temperature
(`_scaled_logits`), then per row

* the best score and its id: argmax of ``s + g`` for sampled rows (``g`` = Gumbel noise of
  `flashspec.rng`, keyed by the global token id: over a vocabulary shard, its first id
  `vocab_offset` + the column's token), of the raw logits for greedy rows (`_exact_best`);
  with ``TileConfig.screen`` found through a cheap approximation of ``g`` that certifies the
  winner, whose exact score alone is computed (`_screen`, `_screened_best`; the same results);
* optionally the tile's max of ``s`` and sum of ``exp(s - max)`` (log-sum-exp), and the
  ``s`` of the best token (for its logprob);
* with drafts (verification), the best with each row's drafted token left out, and the
  draft's ``s`` (`_leave_out_draft`);
* the sum of ``s``, whose non-finite value reports NaN/inf (never sampled);
* optionally the tile's top ``CAND`` logits (before temperature) as candidate keys
  (`_store_candidates`).

Every summary, and stage 2's candidates, thus sees the transformed logits: nothing after
this point recomputes a logit from the weight.

Both stage-1 kernels run this code: the Triton one (`lm_head.py`) and the warp-specialized
Gluon one (`lm_head_ws.py`), which is why nothing here creates an index tensor of its own
(Gluon needs those in explicit layouts: the callers pass them in).
"""

import triton
import triton.language as tl

from .. import params
from .keys import pack_candidates
from .noise import (_INTERPRETED, _SCREEN_ERROR, GUMBEL_STREAM, LOG2E, NEG_LN2, exp2_ftz,
                    gumbel_from_bits, gumbel_noise, gumbel_screen_log2, opaque, philox_bits,
                    philox_tile_bits)
from .rows import _column_tokens, _draft_here

# 2**-21: rounding allowance per unit of score magnitude in the screen's margin (`_screen`).
_ULPS = tl.constexpr(4.76837158203125e-07)
_PENALIZE = tl.constexpr(params.PENALIZE)
_BAN = tl.constexpr(params.BAN)
_BANNED_LOGIT = tl.constexpr(params.BANNED_LOGIT)


@triton.jit
def _argmax_combine(value, column, other_value, other_column):
    first = (value > other_value) | ((value == other_value) & (column < other_column))
    return tl.where(first, value, other_value), tl.where(first, column, other_column)


@triton.jit
def _row_argmax(score, columns):
    """Each row's largest score and the first column that has it (argmax's preference):
    `tl.argmax` with the column positions passed in (Gluon needs them in an explicit
    layout). Positions known when compiling (an arange) cost no registers; token ids
    computed per column would (verification's epilogue on 128x64 tiles: 128 -> 167
    registers, one program per SM instead of two)."""
    return tl.reduce((score, tl.broadcast_to(columns[None, :], score.shape)), 1, _argmax_combine)


@triton.jit
def _tanh(x):
    """fp32 tanh within 2 ulp of the exact value with an exact exp and division, as the
    interpreter's (measured against float64 over [-12, 12] and magnitudes from 10**-40 to
    50, tests/test_fused_head.py), and within 5 ulp with the GPU's approximate ones (Triton's
    fp32 `tl.exp` and `/`: ex2.approx, div.full; 4.2 in a simulation at their error bounds);
    tanh(+-inf) = +-1, NaN stays NaN. libdevice's tanh does not run in Triton's interpreter,
    so both run this.
    Below |x| = 0.625, ``x + x**3 P(x**2)`` with P the degree-4 minimax fit of
    (tanh(x) - x) / x**3 (relative error 4e-9: no cancellation near 0); above,
    ``1 - 2 / (exp(2|x|) + 1)``, whose result is at least 0.55 there (the subtraction loses
    under a bit) and 1 once exp overflows."""
    a = tl.abs(x)
    y = a * a
    p = -0.3333328068256378 + y * (0.13331441581249237 + y * (
        -0.05373970791697502 + y * (0.02063906379044056 + y * -0.005704963579773903)))
    near_zero = a + a * y * p
    far = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
    t = tl.where(a < 0.625, near_zero, far)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _head_logits(acc, bias_ptr, softcap, tokens, v_ok, BIAS: tl.constexpr,
                 SOFTCAP: tl.constexpr):
    """The model's logits from `acc` = hidden @ weight.T ``[rows, tokens]``, in the model's
    order: with BIAS ``+ bias[token]`` (``[V]``, any float dtype, added in fp32), then with
    SOFTCAP Gemma-2's ``softcap * tanh(logits / softcap)`` (`_tanh`; the division as a
    product by the inverse, one ulp from transformers' at most, which only matters at
    near-ties). Columns past V
    stay 0. Logit edits come after this (transformers' processors run on the model's
    output), and so does every summary: the screen and the race only compare the s they
    are given, so their margins hold for softcapped scores as for any other."""
    if BIAS:
        acc = acc + tl.load(bias_ptr + tokens, mask=v_ok, other=0.0).to(tl.float32)[None, :]
    if SOFTCAP:
        acc = _tanh(acc * (1.0 / softcap)) * softcap
    return acc


@triton.jit
def _rounded(x, y, OP: tl.constexpr):
    """fp32 ``x OP y`` (OP "add", "sub" or "mul") rounded once, and never contracted with a
    product that made x or y, or with an addition of its product, into an FMA (Triton fuses
    fp32 ``a * b + c`` on GPUs): it rounds as the torch reference's operation does (a
    softcapped logit ``tanh * c`` plus a bias, vLLM's ``l - frequency * c``)."""
    if _INTERPRETED:
        if OP == "add":
            return x + y
        elif OP == "sub":
            return x - y
        else:
            return x * y
    else:
        return tl.inline_asm_elementwise(OP + ".rn.f32 $0, $1, $2;", "=r,r,r", [x, y],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _additive_operands(logit_bias_ptr, counts_ptr, draft_ptr, rows, tokens, r_ok, v_ok, V,
                       ROWS_PER_PARAM, LOGIT_BIAS: tl.constexpr, BIAS_PER_POSITION: tl.constexpr,
                       COUNTS: tl.constexpr):
    """The tiles ``[rows, tokens]`` of the additive edits of `_edited_logits` in kernel rows
    `rows` (0 where their flag is off):

    * with LOGIT_BIAS the fp32 bias of batch row r // ROWS_PER_PARAM (``[B, V]``; with
      BIAS_PER_POSITION of row r, ``[R, V]``);
    * with COUNTS each token's int32 count for vLLM's penalties: ``counts[r //
      ROWS_PER_PARAM]`` (``[B, V]``) plus, in verification (row r is position
      j = r % ROWS_PER_PARAM of its batch row), the drafts before position j (``draft_ptr``:
      ``[B, G]``, -1 padded), which is the count a plain step after those drafts reads.

    The Triton kernel loads both before its main loop, the Gluon kernel the counts before it
    takes the tile from the MMA (the bias with the tile): the fewest registers and spills in
    offline sm90 compiles (Triton 3.6, cuobjdump). Verification on the Triton kernel's 64x128
    tiles (8 warps) then takes 128 registers with counts or with a bias, as without edits
    (two programs per SM), against 169 and 137 loaded beside the logits; the Gluon 8-warp
    verification epilogue spills 80 bytes with counts (32 without edits), against 192. The
    codes load best beside the logits (`_edited_logits`).
    """
    param_rows = rows // ROWS_PER_PARAM
    ok = r_ok[:, None] & v_ok[None, :]
    bias = 0.0
    if LOGIT_BIAS:
        bias_rows = param_rows
        if BIAS_PER_POSITION:
            bias_rows = rows
        bias = tl.load(logit_bias_ptr + bias_rows[:, None].to(tl.int64) * V + tokens[None, :],
                       mask=ok, other=0.0)
    count = 0
    if COUNTS:
        count = tl.load(counts_ptr + param_rows[:, None].to(tl.int64) * V + tokens[None, :],
                        mask=ok, other=0)
        num_drafts = ROWS_PER_PARAM - 1      # 0 outside verification
        position = rows % ROWS_PER_PARAM
        for m in range(num_drafts):
            draft = tl.load(draft_ptr + param_rows * num_drafts + m, mask=r_ok & (m < position),
                            other=-1)
            count += (tokens[None, :] == draft[:, None]).to(tl.int32)
    return bias, count


@triton.jit
def _edited_logits(acc, codes_ptr, penalty_ptr, additive, frequency_ptr, presence_ptr, rows,
                   tokens, r_ok, v_ok, V, ROWS_PER_PARAM, CODES: tl.constexpr,
                   LOGIT_BIAS: tl.constexpr, COUNTS: tl.constexpr):
    """`acc` ``[rows, tokens]`` with the edits of `flashspec.params.LogitEdits` of kernel rows
    `rows` and tokens `tokens`, in its order: `additive` (`_additive_operands`: the bias and
    the counts), the uint8 codes ``[R, V]`` at row r, row r's penalties at
    ``[r // ROWS_PER_PARAM]`` (its batch row):

    1. with LOGIT_BIAS ``+ bias`` in fp32;
    2. with CODES, PENALIZE: transformers' repetition penalty, a product by the penalty where
       the logit is negative and otherwise by its inverse: one ulp from transformers'
       division at most, as the temperature's product (`lm_head_tiles_kernel`), which only
       matters at near-ties;
    3. with COUNTS, vLLM's ``l - frequency * c`` then ``l - presence * (c > 0)`` in fp32 (in
       verification c holds the drafts before the position, so that speculation changes no
       logit). The product and the difference each round once, as vLLM's torch ops
       (`_rounded`); the presence product is exact, so it needs no such care;
    4. with CODES, BAN gives `BANNED_LOGIT` (`flashspec.params`: finite, so that no summary
       below needs to know of bans), whatever came before.

    Every summary of the tile (the race, the screen, the log-sum-exp, the candidates, the
    draft left out) then sees the edited logits. Bytes per logit read: one for the codes
    (under 2% of the weight's at 64 rows and D = 4096), four for the bias, four for the
    counts (int32: a long generation's counts pass 2**16)."""
    bias, count = additive
    if LOGIT_BIAS:
        acc = _rounded(acc, bias, "add")
    if CODES:
        code = tl.load(codes_ptr + rows[:, None].to(tl.int64) * V + tokens[None, :],
                       mask=r_ok[:, None] & v_ok[None, :], other=0)
        penalty = tl.load(penalty_ptr + rows // ROWS_PER_PARAM).to(tl.float32)
        factor = tl.where(acc < 0.0, penalty[:, None], (1.0 / penalty)[:, None])
        acc = tl.where(code == _PENALIZE, acc * factor, acc)
    if COUNTS:
        param_rows = rows // ROWS_PER_PARAM
        frequency = tl.load(frequency_ptr + param_rows).to(tl.float32)
        presence = tl.load(presence_ptr + param_rows).to(tl.float32)
        penalties = _rounded(frequency[:, None], count.to(tl.float32), "mul")
        acc = _rounded(acc, penalties, "sub")
        acc = acc - presence[:, None] * (count > 0).to(tl.float32)
    if CODES:
        acc = tl.where(code == _BAN, _BANNED_LOGIT, acc)
    return acc


def edit_arguments(edits, num_rows: int, vocab_size: int, unused) -> tuple[tuple, dict]:
    """The pointers (codes, penalty, bias, counts, frequency, presence) and constexpr flags
    (CODES, LOGIT_BIAS, BIAS_PER_POSITION, COUNTS) of `_additive_operands` and
    `_edited_logits` for `edits` (`flashspec.params.LogitEdits` of a launch of `num_rows`
    rows, or None); `unused` (a tensor) stands for each pointer of an edit the launch does
    not make, so that launches without an edit compile the kernel they compiled before it
    existed."""
    if edits is None:
        edits = params.LogitEdits()
    codes, bias = edits.codes, edits.bias
    flags = dict(CODES=codes is not None, LOGIT_BIAS=bias is not None,
                 BIAS_PER_POSITION=bias is not None and bias.dim() == 3,
                 COUNTS=edits.counts is not None)
    if codes is not None:
        codes = codes.reshape(num_rows, vocab_size)
    if bias is not None:
        bias = bias.reshape(-1, vocab_size)
    pointers = (codes, edits.penalty, bias, edits.counts, edits.frequency, edits.presence)
    return tuple(unused if t is None else t.contiguous() for t in pointers), flags


@triton.jit
def _scaled_logits(acc, columns, pid_v, NUM_VT, V, inv_t, BLOCK_V: tl.constexpr,
                   INTERLEAVE: tl.constexpr, EVEN_V: tl.constexpr):
    """s = logits / temperature of columns `columns` ``[N]`` of vocab tile `pid_v` (-inf past
    V), the rows' sums of s (the non-finite check) and the columns' token ids."""
    offs_v = _column_tokens(columns, pid_v, NUM_VT, BLOCK_V, INTERLEAVE)
    s = acc * inv_t[:, None]
    row_sum = tl.sum(s, axis=1)  # masked columns hold 0 here
    if not EVEN_V:
        s = tl.where((offs_v < V)[None, :], s, float("-inf"))
    return s, row_sum, offs_v


@triton.jit
def _leave_out_draft(score, s, row_sum, offs_v, draft, DRAFT: tl.constexpr):
    """With DRAFT, `score` with each row's drafted token at -inf and the draft's s (summed over
    its column: 0 where the tile does not hold it); otherwise `score` and `row_sum`."""
    draft_s = row_sum
    if DRAFT:
        is_draft = offs_v[None, :] == draft[:, None]
        draft_s = tl.sum(tl.where(is_draft, s, 0.0), axis=1)
        score = tl.where(is_draft, float("-inf"), score)
    return score, draft_s


@triton.jit
def _drafts_in_tile(draft, pid_v, NUM_VT, BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Whether vocab tile `pid_v` holds some row's drafted token (-1: none). Most tiles hold
    none, and under the screen they skip the draft's mask and logit (`_leave_out_draft`: a
    compare, two selects and an add per logit); the exact path always does both."""
    here = _draft_here(draft, pid_v, NUM_VT, BLOCK_V, INTERLEAVE)
    return tl.max(here.to(tl.int32), axis=0) > 0


@triton.jit
def _exact_best(s, row_sum, offs_v, columns, noise, sampled, draft, SAMPLE: tl.constexpr,
                LSE: tl.constexpr, DRAFT: tl.constexpr):
    """Each row's best score ``s + g`` (``s`` for greedy rows; with DRAFT the row's drafted token
    `draft` left out), the first column that has it and, with LSE, that column's s, from the
    exact Gumbel noise `noise` of every column; and the sum of s over the draft's column
    (`row_sum` without DRAFT)."""
    score = s
    if SAMPLE:
        score = s + tl.where(sampled[:, None], noise, 0.0)
    score, draft_s = _leave_out_draft(score, s, row_sum, offs_v, draft, DRAFT)
    # The max on its own, as tl.argmax's callers had it: with the pair's value instead,
    # verification's epilogue on 128x64 tiles takes 133 registers, not 128.
    best = tl.max(score, axis=1)
    _, best_column = _row_argmax(score, columns)
    best_s = best
    if LSE:
        best_s = tl.sum(tl.where(columns[None, :] == best_column[:, None], s, 0.0), axis=1)
    return best, best_column, best_s, draft_s


@triton.jit
def _screen(s, row_sum, columns, bits, sampled, BLOCK_V: tl.constexpr):
    """The tile's leaders under `noise.gumbel_screen`'s noise, within SCREEN_ERROR of the exact
    noise of the Philox words `bits`: a column that leads every other by more than twice that
    (plus the scores' rounding) also leads them under the exact noise, and only its exact
    score is needed (`_screened_best`). Returns whether some row has no such leader (a
    near-tie, about one sampled row in 10**4 per tile, or a non-finite score: then the
    caller computes every column's exact noise, `_exact_best`), and per row the screen's
    max, its first column and that column's s (greedy rows: the max of s, margin 0).
    Either way the summaries are those of the exact noise, bit for bit; the screen saves the
    two precise logs and the division per column that dominate the epilogue at large B.
    Verification leaves no draft out here: the caller takes the exact path for the one tile
    in a row's ~1,000 that holds its draft (`_drafts_in_tile`), and every other tile's best
    is the same with or without it, with no mask and no draft logit per column."""
    # s + gumbel_screen - SCREEN_BIAS, one FMA per column: the bias, the same for every
    # column of a row, changes no comparison.
    screen = s + gumbel_screen_log2(bits) * tl.where(sampled, NEG_LN2, 0.0)[:, None]
    top = tl.max(screen, axis=1)
    # A column's exact score and its screen + SCREEN_BIAS differ by at most SCREEN_ERROR (the
    # screen's noise unrounded: the FMA rounds once) and the rounding of each, an ulp of
    # |screen| + 1 at most: 2**-21 (|top| + 1) covers every column that could come close.
    # With `>=`, a leader that passes beats every other column strictly (no tie to break).
    margin = tl.where(sampled, 2.0 * (_SCREEN_ERROR + (tl.abs(top) + 1.0) * _ULPS), 0.0)
    near_top = screen >= (top - margin)[:, None]
    num_near = tl.sum(near_top.to(tl.int32), axis=1)
    leader = tl.min(tl.where(near_top, columns[None, :], BLOCK_V), axis=1)
    # The leader's s (alone near the top); a -0.0 comes out as +0.0, which changes no
    # `leader_s + g` (g is never -0.0).
    leader_s = tl.sum(tl.where(near_top, s, 0.0), axis=1)
    unsure = (sampled & (num_near != 1)) | ~(tl.abs(row_sum) < float("inf"))
    return tl.max(unsure.to(tl.int32), axis=0) > 0, top, leader, leader_s


@triton.jit
def _screened_best(top, leader, leader_s, sampled, seed, position, pid_v, NUM_VT, vocab_offset,
                   BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr):
    """`_exact_best` of a tile whose every sampled row has a certified leader (`_screen`): its
    exact score from its own noise (keyed by its global id, `vocab_offset` + its token); greedy
    rows' max is max(s + 0.0), as `_exact_best`'s. The best column's s is the leader's (greedy
    rows: the max), with no pass over the tile."""
    token = _column_tokens(leader, pid_v, NUM_VT, BLOCK_V, INTERLEAVE).to(tl.int64) + vocab_offset
    best = tl.where(sampled, leader_s + gumbel_noise(seed, position, token), top + 0.0)
    return best, leader, tl.where(sampled, leader_s, best)


@triton.jit
def _exp_below_max(s, tile_max):
    """Each row's terms ``exp(s - max)`` of its log-sum-exp (one SFU instruction each; terms
    below 2**-126, which no sum of them can feel, are 0)."""
    return exp2_ftz((s - tile_max[:, None]) * LOG2E)


@triton.jit
def _tile_summary(s, row_sum, best, best_column, best_s, draft_s, pid_v, NUM_VT,
                  BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr, LSE: tl.constexpr):
    """Per-row summaries of `_scaled_logits` (s, row_sum) given each row's best score, column
    and s and the draft's s (`_exact_best`, or `_screen` and `_screened_best`): best score and
    its id, the sum of s, the draft's s, and, with LSE, max and sum of exp of s and the s of
    the best token.
    Nothing here or in the helpers above creates an index tensor, so the Gluon kernel
    (lm_head_ws.py), which needs explicit layouts for those, runs the same code."""
    best_id = _column_tokens(best_column, pid_v, NUM_VT, BLOCK_V, INTERLEAVE)
    tile_max = best
    sumexp = best
    if LSE:
        tile_max = tl.max(s, axis=1)
        sumexp = tl.sum(_exp_below_max(s, tile_max), axis=1)
    return best, best_id, row_sum, tile_max, sumexp, best_s, draft_s


@triton.jit
def _part_bits(seed, position, word_keys, BLOCK_R: tl.constexpr, PART_V: tl.constexpr,
               COLUMN_NOISE: tl.constexpr):
    """Philox words ``[BLOCK_R, PART_V]`` (Gumbel stream) of the rows' (`seed`, `position`)
    and a part's columns, from `word_keys`: the Philox blocks of its groups of 16 tokens
    (`noise.philox_blocks`; four words per call, `noise.philox_tile_bits`), or with
    COLUMN_NOISE each column's global token id (one word per call: over a vocabulary shard
    whose first id is not a multiple of 16, a group of 16 columns spans two of the noise's)."""
    if COLUMN_NOISE:
        bits = philox_bits(seed[:, None], position[:, None], word_keys[None, :], GUMBEL_STREAM)
    else:
        bits = philox_tile_bits(seed[:, None, None], position[:, None, None], word_keys, BLOCK_R,
                                PART_V)
    return bits


@triton.jit
def _noise_summary(s, row_sum, offs_v, columns, bits, word_keys, pid_v, NUM_VT, vocab_offset,
                   sampled, seed, position, draft, BLOCK_R: tl.constexpr, PART_V: tl.constexpr,
                   BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr, LSE: tl.constexpr,
                   DRAFT: tl.constexpr, SCREEN: tl.constexpr, COLUMN_NOISE: tl.constexpr):
    """`_tile_summary` of a part with sampled rows, from the Philox words `bits` of its
    columns (`word_keys`: what `_part_bits` drew them from); with SCREEN through `_screen`."""
    if SCREEN:
        unsure, top, leader, leader_s = _screen(s, row_sum, columns, bits, sampled, BLOCK_V)
        draft_s = row_sum  # unused: a screened tile holds no draft (`_store_summary`)
        if DRAFT:  # the tile that holds a row's draft: exact (`_screen`)
            unsure |= _drafts_in_tile(draft, pid_v, NUM_VT, BLOCK_V, INTERLEAVE)
        if unsure:
            # The words anew (`opaque`: not merged with the screen's): kept, they would
            # stay live through the screen (64x128 tiles: 116 -> 195 registers).
            bits = _part_bits(opaque(seed), position, word_keys, BLOCK_R, PART_V, COLUMN_NOISE)
            best, best_column, best_s, draft_s = _exact_best(
                s, row_sum, offs_v, columns, gumbel_from_bits(bits), sampled, draft, True,
                LSE, DRAFT)
        else:
            best, best_column, best_s = _screened_best(top, leader, leader_s, sampled, seed,
                                                       position, pid_v, NUM_VT, vocab_offset,
                                                       BLOCK_V, INTERLEAVE)
    else:
        best, best_column, best_s, draft_s = _exact_best(
            s, row_sum, offs_v, columns, gumbel_from_bits(bits), sampled, draft, True, LSE,
            DRAFT)
    return _tile_summary(s, row_sum, best, best_column, best_s, draft_s, pid_v, NUM_VT, BLOCK_V,
                         INTERLEAVE, LSE)


@triton.jit
def _store_summary(summary, offs_r, r_ok, draft, pid_v, NUM_VT,
                   best_ptr, best_id_ptr, best_s_ptr, max_ptr, sumexp_ptr, bad_ptr, draft_s_ptr,
                   BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr, LSE: tl.constexpr,
                   DRAFT: tl.constexpr):
    """Writes a vocab tile's summaries of rows `offs_r` (``[R, NUM_VT]`` arrays)."""
    best, best_id, row_sum, tile_max, sumexp, best_s, draft_s = summary
    if DRAFT:
        in_tile = r_ok & _draft_here(draft, pid_v, NUM_VT, BLOCK_V, INTERLEAVE)
        tl.store(draft_s_ptr + offs_r, draft_s, mask=in_tile)
    out = offs_r * NUM_VT + pid_v
    # NaN/inf anywhere in a row makes its sum non-finite; a finite row could only
    # overflow the sum with |s| > 1e36, which is reported too.
    tl.store(bad_ptr + out, (~(tl.abs(row_sum) < float("inf"))).to(tl.int32), mask=r_ok)
    tl.store(best_ptr + out, best, mask=r_ok)
    tl.store(best_id_ptr + out, best_id, mask=r_ok)
    if LSE:
        tl.store(max_ptr + out, tile_max, mask=r_ok)
        tl.store(sumexp_ptr + out, sumexp, mask=r_ok)
        tl.store(best_s_ptr + out, best_s, mask=r_ok)


@triton.jit
def _store_candidates(acc, tokens, V, cand_row, r_ok, CAND: tl.constexpr, EVEN_V: tl.constexpr):
    """The tile's top CAND logits of each row (the model's, edited, before temperature) as
    packed keys, in descending order, at ``cand_row[r] + [0, CAND)``."""
    logits = acc
    if not EVEN_V:
        logits = tl.where((tokens < V)[None, :], acc, float("-inf"))
    # CAND rounds of (max, lowest id at the max, mask it out) on the fp32 logits: the
    # keys in descending order, as a sort of packed int64 keys gives them, for fewer
    # instructions and registers (H200, B=1: stage 1 300 -> 289 us).
    for c in tl.static_range(CAND):
        top = tl.max(logits, axis=1)
        top_id = tl.min(tl.where(logits == top[:, None], tokens[None, :], 0x7FFFFFFF), axis=1)
        tl.store(cand_row + c, pack_candidates(top, top_id), mask=r_ok)
        logits = tl.where(tokens[None, :] == top_id[:, None], float("-inf"), logits)
