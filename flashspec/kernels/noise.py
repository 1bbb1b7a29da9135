"""Triton side of `flashspec.rng`: the same Philox words and the same float32 Gumbel noise.

Keep every operation here in step with `flashspec/rng.py`; `tests/test_rng.py` checks the
two bit for bit through the interpreter (and on a GPU when one is present).

`gumbel_screen_log2` is a cheap approximation of that noise, within `SCREEN_ERROR` of it,
which the fused kernels use only to find the one token that can win a tile (`epilogue._screen`);
the noise they report is always the exact one.
"""

import triton
import triton.language as tl

GUMBEL_STREAM: tl.constexpr = tl.constexpr(0)
ACCEPT_STREAM: tl.constexpr = tl.constexpr(1)

# Bound on |SCREEN_BIAS - ln 2 * gumbel_screen_log2(x) - gumbel_from_bits(x)| over all 32-bit
# words x, before or after rounding to float32: 3.7x the analysis in `gumbel_screen_log2`;
# tests/test_screen.py checks half of it over every word on a GPU.
SCREEN_ERROR = 2.0**-14
_SCREEN_ERROR: tl.constexpr = tl.constexpr(SCREEN_ERROR)
# -ln(E) = -ln(ln 2 * E / ln 2) = -ln(ln 2) - ln 2 * log2(E / ln 2)
SCREEN_BIAS = 0.36651292058166435
_SCREEN_BIAS: tl.constexpr = tl.constexpr(SCREEN_BIAS)
NEG_LN2: tl.constexpr = tl.constexpr(-0.6931471805599453)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
# Triton's interpreter cannot run PTX: there `lg2.approx` is numpy's log2 and the screen
# adds an error of 0.9 SCREEN_ERROR (its sign from the word), so that CPU tests exercise the
# screening at the worst error it is certified for. (Read when this module is imported.)
_INTERPRETED: tl.constexpr = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def philox_bits(seed, position, token_ids, STREAM: tl.constexpr):
    """uint32 Philox word of each token: see `flashspec.rng` for the (block, word) of a token.

    `seed`, `position` and `token_ids` are int64 and broadcast against each other.
    """
    token_ids = token_ids + position * 0
    position = position + token_ids * 0
    c0 = (((token_ids >> 4) << 2) | ((token_ids >> 1) & 3)).to(tl.uint32)
    c1 = position.to(tl.uint32)
    zero = c0 * 0
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, zero + STREAM, zero)
    lane = (token_ids & 1) | ((token_ids >> 2) & 2)
    return tl.where(lane == 0, w0, tl.where(lane == 1, w1, tl.where(lane == 2, w2, w3)))


@triton.jit
def exponential_from_bits(bits):
    """float32 ``-log(u)``, ``u = (bits + 0.5) / 2**32``; both tails at full relative precision."""
    upper = bits >= 0x80000000
    near = tl.where(upper, bits ^ 0xFFFFFFFF, bits)
    near = (near.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2**-32
    w = 1.0 - near
    exact_w = w == 1.0
    safe_w = tl.where(exact_w, 0.5, w)
    # One log per value; log(1 - near) through Kahan's trick (log(w) * near / (1 - w)).
    log_x = tl.log(tl.where(upper, safe_w, near))
    log1p_neg = tl.where(exact_w, -near, log_x * (-near) / (safe_w - 1.0))
    return tl.where(upper, -log1p_neg, -log_x)


@triton.jit
def gumbel_from_bits(bits):
    """float32 Gumbel noise ``-log(-log(u))`` of Philox words."""
    return -tl.log(exponential_from_bits(bits))


@triton.jit
def gumbel_noise(seed, position, token_ids):
    """float32 Gumbel noise of the sampling stream for each (seed, position, token id)."""
    return gumbel_from_bits(philox_bits(seed, position, token_ids, GUMBEL_STREAM))


@triton.jit
def _log2_approx(x):
    """``lg2.approx.ftz.f32``: the SFU's log2, one instruction; error at most 2**-22 absolute
    on [0.5, 2] and 2 ulp elsewhere (CUDA C Programming Guide, intrinsic ``__log2f``). Its
    inputs here are normal floats, so flushing subnormals changes nothing."""
    if _INTERPRETED:
        return tl.log2(x)
    else:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def exp2_ftz(x):
    """``ex2.approx.ftz.f32``: the SFU's 2**x, one instruction (relative error at most 2**-22,
    PTX ISA); results below 2**-126 flush to 0. Triton's `tl.exp2` and `tl.exp` keep
    subnormal results, which costs a compare and two predicated multiplies around it."""
    if _INTERPRETED:
        return tl.exp2(x)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def opaque(x):
    """`x`, through an instruction the compiler cannot see into: what it computes from the
    result is never merged with what it computes from `x` (the screening's exact fallback
    recomputes Philox words rather than keep the screen's alive through it)."""
    if _INTERPRETED:
        return x
    elif x.dtype.primitive_bitwidth == 64:
        return tl.inline_asm_elementwise("mov.b64 $0, $1;", "=l,l", [x], dtype=x.dtype,
                                         is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype,
                                         is_pure=True, pack=1)


@triton.jit
def gumbel_screen_log2(bits):
    """``L`` with ``SCREEN_BIAS - ln 2 * L`` within SCREEN_ERROR of `gumbel_from_bits(bits)`
    for every word, in about a quarter of its instructions: two SFU log2 and a short
    polynomial instead of two precise logs and a division. (The kernels add ``-ln 2 * L`` to
    the scores, one FMA; a constant per row changes no comparison.)

    ``L = log2(E2)``, ``E2 = E / ln 2 = -log2(u)``. With ``near`` the distance of u from the
    nearer end of (0, 1) (as `exponential_from_bits`): below 1/2, ``E2 = -log2(near)``
    (relative error <= 2**-21); above, ``E2 = -log2(1 - near)`` for near >= 1/32 (1 - near
    rounded by <= 2**-25 and log2's 2**-22, against |log2(1 - near)| >= 0.045: relative
    error <= 2**-17.1), else the series ``(near + near**2/2 + near**3/3 + near**4/4) / ln 2``
    (truncation <= near**4 / (5 (1 - near)) relative). The outer log2 adds <= 2 ulp of
    |L| <= 34: |g - exact| <= 2**-15.9 before g is rounded, the exact path's own rounding
    included, and 2**-15.9 + 2**-20 after.
    """
    upper = bits >= 0x80000000
    near = tl.where(upper, bits ^ 0xFFFFFFFF, bits).to(tl.float32)
    near = near * 2.3283064365386963e-10 + 1.1641532182693481e-10  # (near + 0.5) / 2**32
    log2_u = _log2_approx(tl.where(upper, 1.0 - near, near))  # = -E2 (<= 0)
    # -E2 by the series, -log1p(-w) / ln 2 = (w + w^2/2 + w^3/3 + w^4/4) / ln 2 + O(w^5)
    series = near * (-1.4426950408889634 + near * (-0.7213475204444817 + near * (
        -0.48089834696298783 + near * -0.36067376022224085)))
    log2_u = tl.where(upper & (near < 0.03125), series, log2_u)
    screen = _log2_approx(tl.abs(log2_u))
    if _INTERPRETED:
        screen += tl.where((bits & 0x80) != 0, 0.9, -0.9) * (_SCREEN_ERROR / -NEG_LN2)
    return screen


@triton.jit
def gumbel_screen(bits):
    """The screen's Gumbel noise, ``SCREEN_BIAS - ln 2 * gumbel_screen_log2(bits)``."""
    return gumbel_screen_log2(bits) * NEG_LN2 + _SCREEN_BIAS


@triton.jit
def philox_blocks(groups, quads):
    """``[1, len(groups), 4]`` Philox blocks ``4 * groups[j] + m`` of 16-token groups (`quads`
    is ``arange(0, 4)``), as `philox_tile_bits` takes them."""
    return (groups[:, None] * 4 + quads[None, :])[None, :, :]


@triton.jit
def philox_tile_bits(seed, position, blocks, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """Philox words ``[BLOCK_R, BLOCK_V]`` (Gumbel stream) of the tokens of ``BLOCK_V // 16``
    groups of 16 (column 16 j + i is token 16 groups[j] + i).

    `seed` and `position` are ``[BLOCK_R, 1, 1]``; `blocks` is ``[1, BLOCK_V // 16, 4]``, the
    Philox blocks ``4 * groups[j] + m``. Token ``16a + 8h + 2m + l`` is word ``2h + l`` of
    Philox block ``4a + m`` (see `flashspec.rng`): the four words of one call land in the
    registers of the one thread that holds those columns of a tensor-core accumulator, so no
    data moves between threads. The caller builds the index tensors (`philox_blocks`; the
    Gluon kernel needs them in explicit layouts).
    """
    c0 = (blocks + position * 0).to(tl.uint32)
    c1 = (position + blocks * 0).to(tl.uint32)
    zero = c0 * 0
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, zero + GUMBEL_STREAM, zero)
    bits = tl.join(tl.join(w0, w1), tl.join(w2, w3))  # [r, a, m, l, h] = word 2h + l
    return tl.reshape(tl.permute(bits, (0, 1, 4, 2, 3)), (BLOCK_R, BLOCK_V))
