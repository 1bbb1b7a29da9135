"""The race bound (``TileConfig.race``): stage 1 skips tiles that cannot hold a row's winner.

Each sampled row's best score so far is shared by every program through global memory as
an int32 order key (`keys._order_key`; `_publish_bounds`, `_row_bounds`). A tile (or chunk
of rows) that provably cannot beat it stores best -inf, id 0, instead of its own
(`_race_beaten`); stage 2 never picks such a tile. Where each row has at most one column
that the bound does not rule out, only that column's exact score is computed
(`_race_leaders`, `_leader_summary`). The summaries equal the exact epilogue's wherever
they can matter; `tests/test_race.py` checks the bound's proof at its edges.
"""

import triton
import triton.language as tl

from .epilogue import _exp_below_max
from .keys import _from_order_key, _order_key
from .noise import LOG2E, exp2_ftz, gumbel_noise, opaque
from .rows import _column_tokens, _draft_here

# The bound of a row for which no program has published one yet.
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

    Why: most parts that the race does not beat have one row with one candidate (at 256
    rows, 8% of the chunks of 32 rows against 86% beaten and 6% with more candidates;
    BENCHMARKS.md history, eighteenth session)."""
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
                    pid_v, NUM_VT, vocab_offset, BLOCK_V: tl.constexpr,
                    INTERLEAVE: tl.constexpr, LSE: tl.constexpr):
    """`_tile_summary` of a part that `_race_leaders` passed: each row's best is its one
    candidate's exact score (as `_exact_best` computes it; its noise keyed by its global id,
    `vocab_offset` + its token), or -inf with none, as a beaten row's (`_beaten_summary`).
    Every other column is below the row's bound (or its part has its best among the
    candidates: `_race_leaders`), so the winner, which is at or above the bound, is a
    candidate wherever it lies, and stage 2 picks it from these summaries as from the exact
    ones; a row's best here may fall below the part's exact best only where both are below
    the bound."""
    token = _column_tokens(leader, pid_v, NUM_VT, BLOCK_V, INTERLEAVE)
    one = num_candidates == 1
    noise = gumbel_noise(seed, position, token.to(tl.int64) + vocab_offset)
    best = tl.where(one, leader_s + noise, float("-inf"))
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
