"""Triton side of `flashspec.rng`: the same Philox words and the same float32 Gumbel noise.

Keep every operation here in step with `flashspec/rng.py`; `tests/test_rng.py` checks the
two bit for bit through the interpreter (and on a GPU when one is present).
"""

import triton
import triton.language as tl

GUMBEL_STREAM: tl.constexpr = tl.constexpr(0)
ACCEPT_STREAM: tl.constexpr = tl.constexpr(1)


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
def gumbel_noise(seed, position, token_ids):
    """float32 Gumbel noise of the sampling stream for each (seed, position, token id)."""
    return -tl.log(exponential_from_bits(philox_bits(seed, position, token_ids, GUMBEL_STREAM)))


@triton.jit
def philox_blocks(groups, quads):
    """``[1, len(groups), 4]`` Philox blocks ``4 * groups[j] + m`` of 16-token groups (`quads`
    is ``arange(0, 4)``), as `gumbel_noise_tile` takes them."""
    return (groups[:, None] * 4 + quads[None, :])[None, :, :]


@triton.jit
def gumbel_noise_tile(seed, position, blocks, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """float32 Gumbel noise ``[BLOCK_R, BLOCK_V]`` of the tokens of ``BLOCK_V // 16`` groups of
    16 (column 16 j + i is token 16 groups[j] + i).

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
    bits = tl.reshape(tl.permute(bits, (0, 1, 4, 2, 3)), (BLOCK_R, BLOCK_V))
    return -tl.log(exponential_from_bits(bits))
