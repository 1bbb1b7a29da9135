"""Fused LM-head Triton kernels: logits are computed tile by tile on chip and never stored.

Stage 1 (`lm_head_tiles_kernel`), one program per (vocab tile, row tile): the logits tile
``hidden[r0:r0+BR] @ weight[tile's tokens].T`` in fp32 (a tile holds BV consecutive tokens,
or, when truncating, BV / 16 interleaved groups of 16: `_column_tokens`), then per
(row, tile) summaries:

* the best score and its id: argmax of ``s + g`` for sampled rows (``s`` = logits /
  temperature, ``g`` = Gumbel noise of `flashspec.rng`), of the raw logits for greedy rows;
  with ``TileConfig.screen`` found through a cheap approximation of ``g`` that certifies
  the winner, whose exact score alone is computed (`_screen`; the same results);
* optionally the tile's max of ``s`` and sum of ``exp(s - max)`` (log-sum-exp), and the
  ``s`` of the best token (for its logprob);
* optionally the tile's top ``CAND`` raw logits as packed int64 keys (truncation);
* the count of non-finite ``s`` (NaN/inf is reported, never sampled).

With ``TileConfig.race``, each sampled row's best score so far is shared through global
memory, and a tile (or chunk of rows) that provably cannot beat it stores best -inf, id 0,
instead of its own (`_race_beaten`); stage 2 never picks such a tile. Where each row has at
most one column that the bound does not rule out, only that column's exact score is
computed (`_race_leaders`).

Above 64 rows on Hopper, stage 1 is `lm_head_ws.lm_head_tiles_ws_kernel` instead, a
warp-specialized Gluon kernel running the same epilogue helpers (`_scaled_logits`,
`_screen`, `_exact_best`, `_tile_summary`, `_store_summary`, `_store_candidates`), which
therefore create no index tensors of their own.

Stage 2 (`lm_head_rows_kernel`), one program per row, merges the tiles on the GPU: the
row's token, logprob, log-sum-exp and a status (`flashspec.outputs`: OK, NEEDS_COMPLETION,
NON_FINITE). Truncated rows (top-k / top-p / min-p) merge the candidate keys, apply HF's
rules on the top ``K_MAX`` of them, and sample among the survivors with the same noise.
The merged list is exact down to the largest "last candidate" of any tile (a missing
token sits below its tile's last one) and a bound on the logits of the tiles left out of
the merge (from the keys they were chosen by); the survivors are *certified* to be the
whole support when they, and top-k's tie class, end strictly above that key. Other rows get
NEEDS_COMPLETION and are completed exactly by the caller (`flashspec.sampling`).

Verification (DRAFT) flattens ``[B, G+1]`` positions into rows: stage 1 leaves each row's
drafted token out of the tile's best and writes the draft's scaled logit; stage 2 decides
whether the draft is the target's own sample (its perturbed score against the best other
token) and writes p(draft), the best other token and the logprobs; `verify_finalize_kernel`,
one program per batch row, runs the acceptance chain over the G+1 positions. Truncated rows
decide all of this among their candidates in stage 2; where every sampled row is truncated,
stage 1 computes no noise, and where every row is, no drafts' summaries (`ops._launch`).

Candidate keys: ``(order_key(raw logit) << 32) | (2**31 - 1 - token id)``, so that a
larger key means a larger logit, then a lower id (the preference order of argmax).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import outputs
from .noise import (_SCREEN_ERROR, ACCEPT_STREAM, LOG2E, NEG_LN2, exp2_ftz, gumbel_from_bits,
                    gumbel_noise, gumbel_screen_log2, opaque, philox_bits, philox_blocks,
                    philox_tile_bits)

_OK = tl.constexpr(outputs.OK)
_NEEDS_COMPLETION = tl.constexpr(outputs.NEEDS_COMPLETION)
_NON_FINITE = tl.constexpr(outputs.NON_FINITE)

# pack(-inf, id 2**31 - 1): below every real candidate, decodes to -inf.
PAD_KEY = -2139095041 * 2**32
# 2**-21: rounding allowance per unit of score magnitude in the screen's margin (`_screen`).
_ULPS = tl.constexpr(4.76837158203125e-07)
# The race (`_race_beaten`): each sampled row's best score found so far, shared by every
# program through global memory as an int32 order key (`_order_key`); NO_BOUND: none yet.
NO_BOUND = -2**31
_NO_BOUND = tl.constexpr(NO_BOUND)
# Bound's margin per unit of (1 + |bound|), far above the rounding it must cover (2**-16).
_RACE_MARGIN = tl.constexpr(2.0**-12)
# Cap on max(s) - the bound's lower edge: past it the row's max column survives anyway, and
# below it every column that matters has a normal exp(s - max) (>= e**-66).
_RACE_SPAN = tl.constexpr(40.0)
# Cap on the bound's lower edge (a lower edge only makes the test more cautious).
_RACE_CAP = tl.constexpr(2.0**120)


@triton.jit
def _order_key(x):
    """fp32 -> int32 whose signed order is the float order (for finite and +-inf)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _from_order_key(key):
    """Inverse of `_order_key` (int32 -> fp32)."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def pack_candidates(values, ids):
    return (_order_key(values).to(tl.int64) << 32) | (0x7FFFFFFF - ids).to(tl.int64)


@triton.jit
def unpack_candidates(keys):
    values = _from_order_key((keys >> 32).to(tl.int32))
    ids = 0x7FFFFFFF - (keys & 0x7FFFFFFF).to(tl.int32)
    return values, ids


@triton.jit
def _row_params(do_sample_ptr, temperature_ptr, rows, ROWS_PER_PARAM):
    """Sampled flag and effective temperature of (in-bounds) rows: the temperature rounded
    to fp32 as transformers rounds it, 1 for greedy rows."""
    param_rows = rows // ROWS_PER_PARAM
    do_sample = tl.load(do_sample_ptr + param_rows) != 0
    temperature = tl.load(temperature_ptr + param_rows).to(tl.float32)
    sampled = do_sample & (temperature != 0.0)
    return sampled, tl.where(sampled, temperature, 1.0)


@triton.jit
def _row_noise_keys(seed_ptr, position_ptr, rows, ROWS_PER_PARAM):
    """Seed and sequence position of (in-bounds) rows: row r is position j = r % ROWS_PER_PARAM
    of batch row r // ROWS_PER_PARAM (verification flattens [B, G+1] this way)."""
    param_rows = rows // ROWS_PER_PARAM
    seed = tl.load(seed_ptr + param_rows)
    position = tl.load(position_ptr + param_rows) + rows % ROWS_PER_PARAM
    return seed, position


@triton.jit
def _row_drafts(draft_ptr, rows, ok, ROWS_PER_PARAM):
    """Drafted token id of each row (int32, -1 for none): row r is position
    j = r % ROWS_PER_PARAM of batch row b = r // ROWS_PER_PARAM, which verifies draft
    ``draft_tokens[b, j]`` (``[B, G]`` contiguous, G = ROWS_PER_PARAM - 1); the last
    position has none."""
    num_drafts = ROWS_PER_PARAM - 1
    j = rows % ROWS_PER_PARAM
    has = ok & (j < num_drafts)
    return tl.load(draft_ptr + (rows // ROWS_PER_PARAM) * num_drafts + j, mask=has,
                   other=-1).to(tl.int32)


@triton.jit
def _column_tokens(columns, pid_v, NUM_VT, BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Token ids of columns of vocab tile `pid_v`. Contiguous tiles hold tokens
    [pid_v * BLOCK_V, (pid_v + 1) * BLOCK_V). Interleaved tiles hold every NUM_VT-th group of
    16 tokens, groups pid_v, pid_v + NUM_VT, ...: tokenizers give neighbouring ids to
    related, frequent tokens, so a truncated support often crowds one contiguous tile past
    its candidate budget, and spreading groups over tiles keeps it within budget. Ids grow
    with the column either way, so argmax ties still go to the lower id."""
    if INTERLEAVE:
        return ((columns // 16) * NUM_VT + pid_v) * 16 + columns % 16
    return pid_v * BLOCK_V + columns


@triton.jit
def _token_tile(tokens, NUM_VT, BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr):
    """The vocab tile that holds each token (inverse of `_column_tokens`)."""
    if INTERLEAVE:
        return (tokens // 16) % NUM_VT
    return tokens // BLOCK_V


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
def _draft_here(draft, pid_v, NUM_VT, BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Per row, whether vocab tile `pid_v` holds its drafted token (-1: none)."""
    return (draft >= 0) & (_token_tile(draft, NUM_VT, BLOCK_V, INTERLEAVE) == pid_v)


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
def _screened_best(top, leader, leader_s, sampled, seed, position, pid_v, NUM_VT,
                   BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr):
    """`_exact_best` of a tile whose every sampled row has a certified leader (`_screen`): its
    exact score from its own noise; greedy rows' max is max(s + 0.0), as `_exact_best`'s. The
    best column's s is the leader's (greedy rows: the max), with no pass over the tile."""
    token = _column_tokens(leader, pid_v, NUM_VT, BLOCK_V, INTERLEAVE).to(tl.int64)
    best = tl.where(sampled, leader_s + gumbel_noise(seed, position, token), top + 0.0)
    return best, leader, tl.where(sampled, leader_s, best)


@triton.jit
def _row_bounds(bound_ptr, rows, ok):
    """Each row's race bound (`_race_beaten`): -inf where none is known yet. Read through L2
    (``.cg``): other programs raise it with atomics, and a stale value is only weaker."""
    key = tl.load(bound_ptr + rows, mask=ok, other=_NO_BOUND, cache_modifier=".cg")
    return tl.where(key == _NO_BOUND, float("-inf"), _from_order_key(key))


@triton.jit
def _publish_bounds(bound_ptr, rows, ok, sampled, best, row_sum, bound):
    """Raise sampled rows' race bounds to their tile's best where it is finite and higher
    (rows with a non-finite logit publish nothing: their token is never sampled)."""
    better = (ok & sampled & (best > bound) & (tl.abs(best) < float("inf"))
              & (tl.abs(row_sum) < float("inf")))
    tl.atomic_max(bound_ptr + rows, _order_key(best), mask=better, sem="relaxed")


@triton.jit
def _exp_below_max(s, tile_max):
    """Each row's terms ``exp(s - max)`` of its log-sum-exp (one SFU instruction each; terms
    below 2**-126, which no sum of them can feel, are 0)."""
    return exp2_ftz((s - tile_max[:, None]) * LOG2E)


@triton.jit
def _race_slack(s, bits, bound, tile_max, exp_s, LSE: tl.constexpr):
    """Per column, ``float(~bits) - 2**32 exp(s - lower)``: positive where the column provably
    cannot beat `bound` (`_race_beaten`, which explains the test and its rounding). With LSE,
    from the log-sum-exp's terms `exp_s` = exp(s - tile_max)."""
    # Capped at 2**120, a weaker bound, so that lower * LOG2E below cannot overflow.
    lower = tl.minimum(bound - (1.0 + tl.abs(bound)) * _RACE_MARGIN, _RACE_CAP)
    one_minus_u = (bits ^ 0xFFFFFFFF).to(tl.float32)  # 2**32 (1 - u) - 1/2, to 24 bits
    if LSE:  # 2**32 exp(s - lower) from the log-sum-exp's terms
        # -inf bound: e**40 2**32, which the max column (exp_s = 1) cannot pass.
        scale = exp2_ftz(tl.minimum(tile_max - lower, _RACE_SPAN) * LOG2E + 32.0)
        slack = one_minus_u - exp_s * scale[:, None]
    else:  # 2**32 exp(s - lower) directly; -inf bound: +inf for every column
        slack = one_minus_u - exp2_ftz(s * LOG2E - (lower * LOG2E - 32.0)[:, None])
    return slack


@triton.jit
def _racing_rows(sampled, draft, pid_v, NUM_VT, BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr,
                 DRAFT: tl.constexpr):
    """The rows the race serves in vocab tile `pid_v`: sampled rows, less, with DRAFT, those
    whose drafted token it holds (the draft's logit comes from that tile's exact path)."""
    racing = sampled
    if DRAFT:
        racing = racing & ~_draft_here(draft, pid_v, NUM_VT, BLOCK_V, INTERLEAVE)
    return racing


@triton.jit
def _race_rows(row_sum, tile_max, racing, LSE: tl.constexpr):
    """Rows whose columns the race may leave out: racing (`_racing_rows`), every logit
    finite, and with LSE some column in the vocabulary (a part wholly past V has no terms:
    its slack is NaN)."""
    rows = racing & (tl.abs(row_sum) < float("inf"))
    if LSE:
        rows = rows & (tile_max > float("-inf"))
    return rows


@triton.jit
def _race_beaten(s, row_sum, bits, bound, racing, r_ok, LSE: tl.constexpr):
    """Whether no column of any (in-bounds) row can beat `bound`, a score that some column of
    that row already has (`_publish_bounds`): the tile's best is then not needed. With LSE
    also each row's max of s and its terms exp(s - max) (`_exp_below_max`, as
    `_tile_summary` computes them, so that these summaries do not depend on the path).

    The test (`_race_slack`) costs a few instructions per column and no logarithm: with ``u``
    the column's uniform, ``-log(u) >= 1 - u``, and ``2**32 (1 - u) = ~bits + 0.5``. A column
    with ``float(~bits) > 2**32 exp(s - lower)`` (``lower`` = the bound less a margin) thus
    has ``-log(u) > exp(s - lower)`` (up to rounding, below), so its noise
    ``g = -log(-log(u))`` is below ``lower - s`` and its score below the bound. Columns near
    the top pass only with ``u`` close to 1, where the inequality is tight: the chance that
    any column of a row escapes a bound that is the row's best score is about the chance
    that it beats it, ``exp(logsumexp(tile) - bound)``.

    Rounding, as a shift of s: the SFU's 2**x (2**-22 relative), the products, the sums
    and the conversion of ~bits (2**-24 each) on arguments within about 70 of 0 for every
    column with ``s - lower >= -26`` (below that, ``g <= 33 ln 2 < 23`` keeps the score
    below the bound anyway; with LSE the cap `_RACE_SPAN` keeps ``s - max`` there within 66
    of 0, so exp(s - max) is normal): under 2**-17 + 2**-23 |bound| in all. The exact noise
    and the rounding of ``s + g`` (`_exact_best`) add under 2**-16 + 2**-23 |bound|. The
    margin, 2**-12 (1 + |bound|), covers both many times over: a beaten column's exact score
    is strictly below the bound, so it can be neither the row's best nor tied with it.
    Rows not `racing` (greedy rows; in verification the rows whose draft this tile holds),
    non-finite rows and rows without a bound (-inf) are never beaten."""
    tile_max = row_sum
    exp_s = s
    if LSE:
        tile_max = tl.max(s, axis=1)
        exp_s = _exp_below_max(s, tile_max)
    slack = _race_slack(s, bits, bound, tile_max, exp_s, LSE)
    beaten = (tl.min(slack, axis=1) > 0.0) & _race_rows(row_sum, tile_max, racing, LSE)
    return tl.min((beaten | ~r_ok).to(tl.int32), axis=0) > 0, tile_max, exp_s


@triton.jit
def _race_leaders(s, row_sum, columns, bits, bound, racing, r_ok, tile_max, exp_s,
                  BLOCK_V: tl.constexpr, LSE: tl.constexpr):
    """For a part that `_race_beaten` did not beat: whether every (in-bounds) row has at most
    one column that the race cannot rule out (a candidate); if so, only that column's exact
    score is needed (`_leader_summary`), as the screen's leader's. Also per row the number
    of candidates, the first one's column and its s (0 with none).

    A column that is not a candidate has an exact score below the bound (`_race_beaten`'s
    proof) or, with LSE, where `_RACE_SPAN` caps the test (no bound yet, or one more than 40
    below the part's max s), below max s - 40. In that case the max column (exp_s = 1) is
    always a candidate, and its score, at least max s - 3.2 (the least noise of a 32-bit
    word, -log(22.9)), beats every other: a lone candidate is then the part's exact best.

    Most parts that the race does not beat have one row with one candidate (a column that
    might beat the row's bound): at 256 rows on the benchmarks' problem without the
    log-sum-exp, 8% of the chunks of 32 rows in a lockstep model of the race, against 86%
    beaten and 6% (mostly before the rows have bounds) with more (BENCHMARKS.md, eighteenth
    session)."""
    # The slack anew (`opaque`: not merged with `_race_beaten`'s, which would then stay live
    # through its vote; sampling at 256 rows: 0 -> 24 bytes of spills).
    slack = _race_slack(s, bits, opaque(bound), tile_max, exp_s, LSE)
    candidate = ~(slack > 0.0)  # NaN slack: a candidate
    num_candidates = tl.sum(candidate.to(tl.int32), axis=1)
    leader = tl.min(tl.where(candidate, columns[None, :], BLOCK_V), axis=1)
    # The leader's s (alone); a -0.0 comes out as +0.0, which changes no `leader_s + g`.
    leader_s = tl.sum(tl.where(candidate, s, 0.0), axis=1)
    single = (num_candidates <= 1) & _race_rows(row_sum, tile_max, racing, LSE)
    return tl.min((single | ~r_ok).to(tl.int32), axis=0) > 0, num_candidates, leader, leader_s


@triton.jit
def _leader_summary(num_candidates, leader, leader_s, row_sum, tile_max, exp_s, seed, position,
                    pid_v, NUM_VT, BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr,
                    LSE: tl.constexpr):
    """`_tile_summary` of a part that `_race_leaders` passed: each row's best is its one
    candidate's exact score (as `_exact_best` computes it), or -inf with none, as a beaten
    row's (`_beaten_summary`). Every other column is below the row's bound (or its part
    has its best among the candidates: `_race_leaders`), so the winner, which is at or
    above the bound, is a candidate wherever it lies, and stage 2 picks it from these
    summaries as from the exact ones; a row's best here may fall below the part's exact
    best only where both are below the bound."""
    token = _column_tokens(leader, pid_v, NUM_VT, BLOCK_V, INTERLEAVE)
    one = num_candidates == 1
    best = tl.where(one, leader_s + gumbel_noise(seed, position, token.to(tl.int64)),
                    float("-inf"))
    return _raced_summary(best, tl.where(one, token, 0), leader_s, row_sum, tile_max, exp_s, LSE)


@triton.jit
def _beaten_summary(row_sum, tile_max, exp_s, LSE: tl.constexpr):
    """`_tile_summary` of a part that `_race_beaten` beat: best -inf (stage 2 never picks
    it), its id 0. (The constants come from `tl.where` on a row tensor: the Gluon kernel
    needs them in its layout.)"""
    return _raced_summary(tl.where(tile_max > 0.0, float("-inf"), float("-inf")),
                          tl.where(tile_max > 0.0, 0, 0), tl.where(tile_max > 0.0, 0.0, 0.0),
                          row_sum, tile_max, exp_s, LSE)


@triton.jit
def _raced_summary(best, best_id, best_s, row_sum, tile_max, exp_s, LSE: tl.constexpr):
    """`_tile_summary`'s tuple for the race's paths, given each row's best, its id and its s:
    the log-sum-exp terms from `_race_beaten`'s, which `_tile_summary` computes alike."""
    tile_sum = best
    tile_max_out = best
    best_s_out = best
    if LSE:
        tile_sum = tl.sum(exp_s, axis=1)
        tile_max_out = tile_max
        best_s_out = best_s
    return best, best_id, row_sum, tile_max_out, tile_sum, best_s_out, row_sum


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
def _noise_summary(s, row_sum, offs_v, columns, bits, blocks, pid_v, NUM_VT, sampled, seed,
                   position, draft, BLOCK_R: tl.constexpr, PART_V: tl.constexpr,
                   BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr, LSE: tl.constexpr,
                   DRAFT: tl.constexpr, SCREEN: tl.constexpr):
    """`_tile_summary` of a part with sampled rows, from the Philox words `bits` of its
    columns (`blocks`: their Philox blocks); with SCREEN through `_screen`."""
    if SCREEN:
        unsure, top, leader, leader_s = _screen(s, row_sum, columns, bits, sampled, BLOCK_V)
        draft_s = row_sum  # unused: a screened tile holds no draft (`_store_summary`)
        if DRAFT:  # the tile that holds a row's draft: exact (`_screen`)
            unsure |= _drafts_in_tile(draft, pid_v, NUM_VT, BLOCK_V, INTERLEAVE)
        if unsure:
            # The words anew (`opaque`: not merged with the screen's): kept, they would
            # stay live through the screen (64x128 tiles: 116 -> 195 registers).
            bits = philox_tile_bits(opaque(seed)[:, None, None], position[:, None, None],
                                    blocks, BLOCK_R, PART_V)
            best, best_column, best_s, draft_s = _exact_best(
                s, row_sum, offs_v, columns, gumbel_from_bits(bits), sampled, draft, True,
                LSE, DRAFT)
        else:
            best, best_column, best_s = _screened_best(top, leader, leader_s, sampled, seed,
                                                       position, pid_v, NUM_VT, BLOCK_V,
                                                       INTERLEAVE)
    else:
        best, best_column, best_s, draft_s = _exact_best(
            s, row_sum, offs_v, columns, gumbel_from_bits(bits), sampled, draft, True, LSE,
            DRAFT)
    return _tile_summary(s, row_sum, best, best_column, best_s, draft_s, pid_v, NUM_VT, BLOCK_V,
                         INTERLEAVE, LSE)


@triton.jit
def _part_summary(acc, first_column, pid_v, NUM_VT, V, inv_t, sampled, seed, position, draft,
                  bound, r_ok, BLOCK_R: tl.constexpr, PART_V: tl.constexpr,
                  BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr, EVEN_V: tl.constexpr,
                  SAMPLE: tl.constexpr, LSE: tl.constexpr, DRAFT: tl.constexpr,
                  SCREEN: tl.constexpr, RACE: tl.constexpr):
    """`_tile_summary` of columns first_column + [0, PART_V) of vocab tile `pid_v`; with SCREEN
    sampled rows through `_screen` (fewer instructions, more registers: for tiles where the
    epilogue, not the weight's stream, bounds the time); with RACE a part whose every row
    is beaten by its bound (`_race_beaten`) skips the search for its best."""
    columns = first_column + tl.arange(0, PART_V)
    s, row_sum, offs_v = _scaled_logits(acc, columns, pid_v, NUM_VT, V, inv_t, BLOCK_V,
                                        INTERLEAVE, EVEN_V)
    if SAMPLE:
        # Philox words after `_scaled_logits` (before it, verification's epilogue on 128x64
        # tiles takes 161 registers instead of 128: one program per SM instead of two).
        groups = _column_tokens(first_column + tl.arange(0, PART_V // 16) * 16, pid_v, NUM_VT,
                                BLOCK_V, INTERLEAVE) // 16
        blocks = philox_blocks(groups, tl.arange(0, 4))
        bits = philox_tile_bits(seed[:, None, None], position[:, None, None], blocks, BLOCK_R,
                                PART_V)
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
                                              BLOCK_V, INTERLEAVE, LSE)
                else:
                    summary = _noise_summary(s, row_sum, offs_v, columns, bits, blocks, pid_v,
                                             NUM_VT, sampled, seed, position, draft, BLOCK_R,
                                             PART_V, BLOCK_V, INTERLEAVE, LSE, DRAFT, SCREEN)
        else:
            summary = _noise_summary(s, row_sum, offs_v, columns, bits, blocks, pid_v, NUM_VT,
                                     sampled, seed, position, draft, BLOCK_R, PART_V, BLOCK_V,
                                     INTERLEAVE, LSE, DRAFT, SCREEN)
    else:
        best, best_column, best_s, draft_s = _exact_best(s, row_sum, offs_v, columns, s, sampled,
                                                         draft, SAMPLE, LSE, DRAFT)
        summary = _tile_summary(s, row_sum, best, best_column, best_s, draft_s, pid_v, NUM_VT,
                                BLOCK_V, INTERLEAVE, LSE)
    return summary


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
    """The tile's top CAND raw logits of each row as packed keys, in descending order, at
    ``cand_row[r] + [0, CAND)``."""
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
    draft_ptr, draft_s_ptr, bound_ptr,
    R, V, D, stride_hidden, stride_weight, NUM_VT, ROWS_PER_PARAM,
    SAMPLE: tl.constexpr, LSE: tl.constexpr, CAND: tl.constexpr, DRAFT: tl.constexpr,
    IEEE_DOT: tl.constexpr, INTERLEAVE: tl.constexpr,
    EVEN_V: tl.constexpr, EVEN_D: tl.constexpr, TMA: tl.constexpr, PARTS: tl.constexpr,
    SCREEN: tl.constexpr, RACE: tl.constexpr,
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
        summary = _part_summary(acc, 0, pid_v, NUM_VT, V, inv_t, sampled, seed, position, draft,
                                bound, r_ok, BLOCK_R, BLOCK_V, BLOCK_V, INTERLEAVE, EVEN_V, SAMPLE,
                                LSE, DRAFT, SCREEN, RACE)
    else:
        lo, hi = _halves(acc, BLOCK_R, BLOCK_V)
        if PARTS == 2:
            half: tl.constexpr = BLOCK_V // 2
            summary = _part_summary(lo, 0, pid_v, NUM_VT, V, inv_t, sampled, seed, position,
                                    draft, bound, r_ok, BLOCK_R, half, BLOCK_V, INTERLEAVE,
                                    EVEN_V, SAMPLE, LSE, DRAFT, SCREEN, RACE)
            summary = _merge_summaries(summary, _part_summary(
                hi, half, pid_v, NUM_VT, V, inv_t, sampled, seed, position, draft, bound, r_ok,
                BLOCK_R, half, BLOCK_V, INTERLEAVE, EVEN_V, SAMPLE, LSE, DRAFT, SCREEN, RACE), LSE)
        else:
            quarter: tl.constexpr = BLOCK_V // 4
            q0, q1 = _halves(lo, BLOCK_R, BLOCK_V // 2)
            q2, q3 = _halves(hi, BLOCK_R, BLOCK_V // 2)
            summary = _part_summary(q0, 0, pid_v, NUM_VT, V, inv_t, sampled, seed, position,
                                    draft, bound, r_ok, BLOCK_R, quarter, BLOCK_V, INTERLEAVE,
                                    EVEN_V, SAMPLE, LSE, DRAFT, SCREEN, RACE)
            summary = _merge_summaries(summary, _part_summary(
                q1, quarter, pid_v, NUM_VT, V, inv_t, sampled, seed, position, draft, bound, r_ok,
                BLOCK_R, quarter, BLOCK_V, INTERLEAVE, EVEN_V, SAMPLE, LSE, DRAFT, SCREEN, RACE),
                LSE)
            summary = _merge_summaries(summary, _part_summary(
                q2, 2 * quarter, pid_v, NUM_VT, V, inv_t, sampled, seed, position, draft, bound,
                r_ok, BLOCK_R, quarter, BLOCK_V, INTERLEAVE, EVEN_V, SAMPLE, LSE, DRAFT, SCREEN,
                RACE), LSE)
            summary = _merge_summaries(summary, _part_summary(
                q3, 3 * quarter, pid_v, NUM_VT, V, inv_t, sampled, seed, position, draft, bound,
                r_ok, BLOCK_R, quarter, BLOCK_V, INTERLEAVE, EVEN_V, SAMPLE, LSE, DRAFT, SCREEN,
                RACE), LSE)
    _store_summary(summary, offs_r, r_ok, draft, pid_v, NUM_VT, best_ptr, best_id_ptr, best_s_ptr,
                   max_ptr, sumexp_ptr, bad_ptr, draft_s_ptr, BLOCK_V, INTERLEAVE, LSE, DRAFT)
    if RACE and SAMPLE:
        _publish_bounds(bound_ptr, offs_r, r_ok, sampled, summary[0], summary[2], bound)
    if CAND > 0:
        _store_candidates(acc, offs_v, V, cand_ptr + (offs_r * NUM_VT + pid_v) * CAND, r_ok,
                          CAND, EVEN_V)


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
            # The top-K_MAX candidates lie in the TOP_TILES tiles with the largest maxima
            # (any other candidate has that many tile maxima above it), so only their
            # candidates are merged: a short sort instead of one over every tile. Tiles
            # are chosen by a 32-bit key, half the cost of sorting int64 keys (H200,
            # 2,048 tiles: 9.6 -> 5.6 us): the order key of the tile's largest logit with its
            # low bits replaced by the tile's index, which can order close maxima by index:
            # a tile left out has its largest logit's order key at most the chosen ones'
            # smallest with those bits set, and the certificate's floor covers that (below).
            low: tl.constexpr = VT_POW2 - 1
            tile_first = tl.load(cand_base + tiles * CAND, mask=t_ok, other=PAD)
            order = (tile_first >> 32).to(tl.int32)
            chosen = tl.topk(tl.where(t_ok, (order & ~low) | (low - tiles), -2**31), TOP_TILES)
            tile_of = low - (chosen & low)
            real = tile_of < NUM_VT  # padding tiles sort last; chosen only if there are few tiles
            gathered = tl.load(cand_base + tile_of[:, None] * CAND + tl.arange(0, CAND)[None, :],
                               mask=real[:, None], other=PAD)
            top = tl.topk(tl.reshape(gathered, (TOP_TILES * CAND,)), K_MAX)
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
            # K_MAX-th). The support and top-k's tie class must end strictly above it.
            tile_last = tl.load(cand_base + tiles * CAND + CAND - 1, mask=t_ok, other=PAD)
            floor_key = tl.maximum(tl.max(tile_last, axis=0),
                                   tl.sum(tl.where(rank == K_MAX - 1, top, 0)))
            # Tokens of the tiles left out have an order key below this one (an int64
            # overflow here only for NaN keys: such rows are reported non-finite).
            left_out = ((tl.min(chosen, axis=0) | low).to(tl.int64) + 1) << 32
            floor_key = tl.where(NUM_VT > TOP_TILES, tl.maximum(floor_key, left_out), floor_key)
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


@triton.jit
def verify_finalize_kernel(
    draft_ptr, target_ptr, masked_ptr, target_logprob_ptr, masked_logprob_ptr,
    draft_prob_ptr, draft_logprob_ptr, row_status_ptr,
    do_sample_ptr, temperature_ptr, seed_ptr, position_ptr,
    num_accepted_ptr, tokens_ptr, accept_probs_ptr, logprobs_ptr, status_ptr,
    NUM_DRAFTS, PROBABILISTIC: tl.constexpr, POSITIONS_POW2: tl.constexpr, PDL: tl.constexpr,
):
    """Per batch row: the acceptance chain over the G + 1 positions (DESIGN §3).

    strict: accept the draft iff it equals the target's own sample; the first rejection
    emits that sample (on the last position, the bonus token). probabilistic: accept iff
    u < p(draft), u from the acceptance stream; a rejection emits the best other token.
    Greedy rows accept iff the draft is the argmax either way.
    """
    if PDL:
        gdc_wait()
    b = tl.program_id(0)
    num_positions = NUM_DRAFTS + 1
    j = tl.arange(0, POSITIONS_POW2)
    valid = j < num_positions
    rows = b * num_positions + j
    drafts = tl.load(draft_ptr + b * NUM_DRAFTS + j, mask=j < NUM_DRAFTS, other=-1)
    # Drafts end at the first padding.
    is_draft = (tl.cumsum((drafts < 0).to(tl.int32), 0) == 0) & (j < NUM_DRAFTS)
    target = tl.load(target_ptr + rows, mask=valid, other=-1)
    target_logprob = tl.load(target_logprob_ptr + rows, mask=valid, other=0.0)
    draft_prob = tl.load(draft_prob_ptr + rows, mask=valid, other=0.0)
    draft_logprob = tl.load(draft_logprob_ptr + rows, mask=valid, other=0.0)
    row_status = tl.load(row_status_ptr + rows, mask=valid, other=0)
    sampled, _ = _row_params(do_sample_ptr, temperature_ptr, b, 1)
    matches = drafts == target
    accept_prob = tl.where(is_draft, tl.where(sampled, draft_prob, matches.to(tl.float32)), 0.0)
    if PROBABILISTIC:
        seed = tl.load(seed_ptr + b)
        position = tl.load(position_ptr + b) + j
        bits = philox_bits(seed, position, j.to(tl.int64) * 0, ACCEPT_STREAM)
        u = (bits.to(tl.float64) + 0.5) * 2.3283064365386963e-10  # exact, as flashspec.rng
        accepted = is_draft & tl.where(sampled, u < draft_prob.to(tl.float64), matches)
        masked = tl.load(masked_ptr + rows, mask=valid, other=-1)
        masked_logprob = tl.load(masked_logprob_ptr + rows, mask=valid, other=0.0)
        replacement = tl.where(is_draft, masked, target)
        replacement_logprob = tl.where(is_draft, masked_logprob, target_logprob)
    else:
        accepted = is_draft & matches
        replacement = target
        replacement_logprob = target_logprob
    num_accepted = tl.min(tl.where(accepted | ~valid, POSITIONS_POW2, j), axis=0)
    tokens = tl.where(j < num_accepted, drafts, tl.where(j == num_accepted, replacement, -1))
    logprobs = tl.where(j < num_accepted, draft_logprob,
                        tl.where(j == num_accepted, replacement_logprob, 0.0))
    # Positions after the drafts end (padding) are never emitted: their status is not the row's.
    used = valid & (j <= tl.sum(is_draft.to(tl.int32)))
    non_finite = tl.sum(((row_status == _NON_FINITE) & used).to(tl.int32)) > 0
    incomplete = tl.sum(((row_status == _NEEDS_COMPLETION) & used).to(tl.int32)) > 0
    status = tl.where(non_finite, _NON_FINITE, tl.where(incomplete, _NEEDS_COMPLETION, _OK))
    tl.store(num_accepted_ptr + b, tl.where(status == _OK, num_accepted, -1).to(tl.int64))
    tl.store(tokens_ptr + rows, tl.where(status == _OK, tokens, -1).to(tl.int64), mask=valid)
    tl.store(logprobs_ptr + rows, tl.where(status == _OK, logprobs, 0.0), mask=valid)
    tl.store(accept_probs_ptr + b * NUM_DRAFTS + j, accept_prob, mask=j < NUM_DRAFTS)
    tl.store(status_ptr + b, status)
