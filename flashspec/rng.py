"""Counter-based noise: a pure function of (seed, sequence position, token id).

Every random number flashspec uses is derived here, so that the Triton kernels, the torch
reference and any later re-computation (stage-2 finalizers, verification) agree bit for bit
on the random *bits*, and up to rounding of `log` on the Gumbel values.

Definition (the contract; changing it changes every seeded output):

* Generator: Philox4x32-10, exactly as Triton's ``tl.philox`` computes it
  (key = (seed & 0xffffffff, seed >> 32), the Random123 round and key constants).
* Counter for token ``t`` at sequence position ``p`` in stream ``s``: ``(b, p, s, 0)`` with
  block ``b = 4 * (t >> 4) + ((t >> 1) & 3)``; the token's 32-bit word is output word
  ``(t & 1) + 2 * ((t >> 3) & 1)``. Writing ``t = 16a + 8h + 2m + l``: block ``4a + m``,
  word ``2h + l``. One Philox call thus serves tokens c, c + 1, c + 8, c + 9 (c = 16a + 2m),
  the four columns that one thread holds in an NVIDIA tensor-core accumulator tile, so
  the fused kernels use all four words without moving data between threads.
* Streams: ``GUMBEL_STREAM`` (0) keys the Gumbel-max noise of sampling and verification;
  ``ACCEPT_STREAM`` (1) keys the uniforms of probabilistic acceptance (token id 0).
* Uniform: ``u = (x + 0.5) / 2**32`` for the 32-bit word ``x``: exact in float64, strictly
  inside (0, 1), symmetric around 1/2.
* Exponential ``E = -log(u)``, computed from whichever of ``u`` and ``1 - u`` is below 1/2
  so that both tails keep full relative precision in float32 (``log1p`` through Kahan's
  ``log(w) * v / (w - 1)`` form, which needs only ``log``); Gumbel ``g = -log(E)``.
  ``E`` is finite and positive for every word, so ``g`` is never infinite.

Seeds are int64 in ``[0, 2**63)``, positions in ``[0, 2**32)``, token ids in ``[0, 2**34)``.
"""

from __future__ import annotations

import torch

GUMBEL_STREAM = 0
ACCEPT_STREAM = 1

# Bounds on every value `gumbel` returns, in float32 and float64: the extreme words give
# -3.13 (word 0) and 22.874 (word 2**32 - 1); the margins cover the rounding of `log`.
GUMBEL_MIN = -3.2
GUMBEL_MAX = 23.0

MAX_SEED = 2**63 - 1
MAX_POSITION = 2**32 - 1
MAX_TOKEN_ID = 2**34 - 1

PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_ROUNDS = 10

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF


def _mul_hi_lo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``a * b`` for uint32 values held in int64 tensors.

    The full product needs 64 unsigned bits, which int64 cannot hold, so ``b`` is split in
    16-bit halves and every partial product stays below 2**49.
    """
    b_lo, b_hi = b & _MASK16, b >> 16
    p_lo = a * b_lo
    p_hi = a * b_hi
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (((p_hi & _MASK16) << 16) + p_lo) & _MASK32
    return hi, lo


def philox4x32(
    c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
    k0: torch.Tensor, k1: torch.Tensor, rounds: int = PHILOX_ROUNDS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32 on broadcastable int64 tensors holding uint32 values (same as ``tl.philox``)."""
    for _ in range(rounds):
        hi_b, lo_b = _mul_hi_lo(c2, PHILOX_ROUND_B)
        hi_a, lo_a = _mul_hi_lo(c0, PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _MASK32
        k1 = (k1 + PHILOX_KEY_B) & _MASK32
    return c0, c1, c2, c3


def _as_int64(name: str, value, lo: int, hi: int, device, validate: bool) -> torch.Tensor:
    if type(value) is int:  # filled on the device: no copy from the host (a CUDA graph forbids it)
        value = torch.full((), value, dtype=torch.int64, device=device)
    t = torch.as_tensor(value, device=device)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"`{name}` must hold integers, got dtype {t.dtype}")
    t = t.to(torch.int64)
    if validate and t.numel() and (int(t.min()) < lo or int(t.max()) > hi):
        raise ValueError(
            f"`{name}` must lie in [{lo}, {hi}], got values in [{int(t.min())}, {int(t.max())}]"
        )
    return t


def random_bits(seed, position, token_ids, stream: int = GUMBEL_STREAM, *,
                validate: bool = True) -> torch.Tensor:
    """The 32-bit Philox word for each (seed, position, token id), as int64 in [0, 2**32).

    Arguments broadcast against each other; the result lives on the device of the first
    tensor argument. ``validate=False`` skips the range checks, which read the device (for
    callers whose values are checked already, e.g. inside a CUDA graph).
    """
    device = next((a.device for a in (seed, position, token_ids) if torch.is_tensor(a)), None)
    seed = _as_int64("seed", seed, 0, MAX_SEED, device, validate)
    position = _as_int64("position", position, 0, MAX_POSITION, device, validate)
    token_ids = _as_int64("token_ids", token_ids, 0, MAX_TOKEN_ID, device, validate)
    if stream not in (GUMBEL_STREAM, ACCEPT_STREAM):
        raise ValueError(f"`stream` must be {GUMBEL_STREAM} or {ACCEPT_STREAM}, got {stream}")
    seed, position, token_ids = torch.broadcast_tensors(seed, position, token_ids)
    block = ((token_ids >> 4) << 2) | ((token_ids >> 1) & 3)
    words = philox4x32(
        block, position, torch.full_like(position, stream), torch.zeros_like(position),
        seed & _MASK32, seed >> 32,
    )
    lane = (token_ids & 1) | ((token_ids >> 2) & 2)
    out = words[3]
    for i in (2, 1, 0):
        out = torch.where(lane == i, words[i], out)
    return out


def uniform(seed, position, token_ids, stream: int = GUMBEL_STREAM, *,
            validate: bool = True) -> torch.Tensor:
    """Uniform noise ``(x + 0.5) / 2**32`` in the open interval (0, 1), float64 (exact)."""
    bits = random_bits(seed, position, token_ids, stream, validate=validate)
    return (bits.to(torch.float64) + 0.5) * 2.0**-32


def exponential_from_bits(bits: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``E = -log(u)`` with ``u = (bits + 0.5) / 2**32``, accurate in both tails in ``dtype``.

    Mirrored operation for operation by the Triton kernels (``flashspec.kernels.noise``):
    one ``log`` per value, of ``u`` itself below 1/2, of ``w = 1 - (1 - u)`` above, where
    Kahan's ``log(w) * v / (w - 1)`` recovers ``log1p(-v)`` for ``v = 1 - u``.
    """
    upper = bits >= 2**31
    # Distance of u from the nearer end of (0, 1): u itself, or 1 - u = (~x + 0.5) / 2**32.
    near = torch.where(upper, _MASK32 - bits, bits).to(dtype)
    near = (near + 0.5) * 2.0**-32
    w = 1.0 - near
    exact_w = w == 1.0  # then log1p(-near) = -near to within near / 2 relative
    safe_w = torch.where(exact_w, 0.5, w)
    log_x = torch.log(torch.where(upper, safe_w, near))
    log1p_neg = torch.where(exact_w, -near, log_x * (-near) / (safe_w - 1.0))
    return torch.where(upper, -log1p_neg, -log_x)


def gumbel(seed, position, token_ids, stream: int = GUMBEL_STREAM,
           dtype: torch.dtype = torch.float64, *, validate: bool = True) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` for each (seed, position, token id).

    Finite for every input: the largest value is about 22.9, the smallest about -3.1.
    ``dtype`` is float32 (what the kernels compute) or float64 (the precise value).
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"`dtype` must be torch.float32 or torch.float64, got {dtype}")
    bits = random_bits(seed, position, token_ids, stream, validate=validate)
    return -torch.log(exponential_from_bits(bits, dtype))
