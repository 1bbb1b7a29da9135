"""Integer keys by which the kernels order fp32 values.

An order key (`_order_key`) is an int32 whose signed order is the float order: the race
shares each row's best score through `atomic_max` on it (`race.py`). A candidate key packs
a raw logit and its token id into an int64, ``(order_key(logit) << 32) | (2**31 - 1 - id)``,
so that a larger key means a larger logit, then a lower id (argmax's preference): stage 1
keeps each tile's top candidates as such keys and stage 2 sorts them (`merge.py`).
"""

import triton
import triton.language as tl

# pack(-inf, id 2**31 - 1): below every real candidate, decodes to -inf.
PAD_KEY = -2139095041 * 2**32


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
