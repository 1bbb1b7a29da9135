"""Attention by sequence position (`flashspec.kernels.attention`), the decode steps' attention:
equal to a float64 reference (sliding window, softcap, grouped heads, keys in scattered
columns), and a query's result bitwise independent of the call (alone, first of a
verification, beside another row, its keys elsewhere in a larger cache, one chunk or
several).

On CPU it runs through Triton's interpreter, with a dot that adds products in index order
(conftest's `index_order_dot`), so that the tests check the kernel's own structure; on a GPU
the same tests check the hardware's MMAs, in bf16 too.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashspec.kernels import attention as kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])

pytestmark = pytest.mark.usefixtures("index_order_dot")


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def _reference(query, key, value, key_index, positions, scaling, window=None, softcap=None):
    """float64: each query against the keys at positions <= its own (and within the window)."""
    B, Hq, T, D = query.shape
    group = Hq // key.shape[1]
    out = torch.zeros(B, T, Hq, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            q = int(positions[b, t])
            seen = [p for p in range(q + 1) if window is None or p > q - window]
            cols = key_index[b, seen].cpu()
            for h in range(Hq):
                k = key[b, h // group, cols].double().cpu()
                v = value[b, h // group, cols].double().cpu()
                scores = query[b, h, t].double().cpu() @ k.T * scaling
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                out[b, t, h] = torch.softmax(scores, dim=0) @ v
    return out


@pytest.mark.parametrize("window, softcap, columns", [
    (None, None, 200), (5, None, 200), (None, 3.0, 200), (None, None, kernel.CHUNK + 150)])
def test_attention_equals_the_reference(window, softcap, columns):
    """Two rows, row 0's keys in column order, row 1's reversed; queries near the end of
    the cache (with `columns` past `CHUNK`, the chunked path) and at its start."""
    B, Hq, Hkv, D = 2, 4, 2, 16
    length = columns - 50
    key, value = _rand(B, Hkv, columns, D, seed=7), _rand(B, Hkv, columns, D, seed=8)
    key_index = torch.stack([torch.arange(columns), torch.arange(columns).flip(0)]).to(DEVICE)
    positions = torch.tensor([[length - 3, length - 2, length - 1], [0, 1, 2]], device=DEVICE)
    query = _rand(B, Hq, 3, D, seed=9)
    out = kernel.attention(query, key, value, key_index, positions, 0.25, window, softcap)
    expected = _reference(query, key, value, key_index, positions, 0.25, window, softcap)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_does_not_depend_on_the_call_or_the_layout(dtype):
    """The query at position 140 alone, as the first of several queries (a verification),
    in a batch beside a longer row, with its keys moved to other columns of a larger cache
    (compaction, left padding, another view), and in a cache long enough for several
    chunks: bitwise the same."""
    Hq, Hkv, D, length = 4, 2, 16, 141
    key, value = _rand(1, Hkv, 160, D, dtype=dtype, seed=11), _rand(1, Hkv, 160, D, dtype=dtype,
                                                                   seed=12)
    query = _rand(1, Hq, 6, D, dtype=dtype, seed=13)
    index = torch.arange(160, device=DEVICE)[None]
    alone = kernel.attention(query[:, :, :1], key, value, index,
                             torch.tensor([[length - 1]], device=DEVICE), 0.3)
    positions = torch.arange(length - 1, length + 5, device=DEVICE)[None]
    assert torch.equal(kernel.attention(query, key, value, index, positions, 0.3)[:, :1], alone)
    # 37 columns of padding first, a cache of several chunks, and a second, longer row.
    columns = 2 * kernel.CHUNK + 20
    pad = columns - 37 - 160
    moved_key = torch.cat([_rand(1, Hkv, 37, D, dtype=dtype, seed=15), key,
                           _rand(1, Hkv, pad, D, dtype=dtype, seed=16)], dim=2)
    moved_value = torch.cat([_rand(1, Hkv, 37, D, dtype=dtype, seed=17), value,
                             _rand(1, Hkv, pad, D, dtype=dtype, seed=18)], dim=2)
    other_key = _rand(1, Hkv, columns, D, dtype=dtype, seed=19)
    other_value = _rand(1, Hkv, columns, D, dtype=dtype, seed=20)
    moved_index = torch.arange(columns, device=DEVICE)[None] + 37
    batch_index = torch.cat([moved_index.clamp_max(columns - 1),
                             torch.arange(columns, device=DEVICE)[None]])
    batch = kernel.attention(
        torch.cat([query[:, :, :1], _rand(1, Hq, 1, D, dtype=dtype, seed=21)]),
        torch.cat([moved_key, other_key]), torch.cat([moved_value, other_value]), batch_index,
        torch.tensor([[length - 1], [columns - 1]], device=DEVICE), 0.3)
    assert torch.equal(batch[:1], alone)


def test_chunks_of_a_long_context_merge_to_one_softmax():
    """A query whose keys span three chunks against the reference, and its result with the
    keys' scores made large in one chunk only (the merge weighs each chunk by its maximum)."""
    Hq, Hkv, D = 2, 1, 16
    columns = 3 * kernel.CHUNK
    key, value = _rand(1, Hkv, columns, D, seed=23), _rand(1, Hkv, columns, D, seed=24)
    key[:, :, kernel.CHUNK + 7] *= 40.0
    index = torch.arange(columns, device=DEVICE)[None]
    positions = torch.tensor([[columns - 1]], device=DEVICE)
    query = _rand(1, Hq, 1, D, seed=25)
    out = kernel.attention(query, key, value, index, positions, 1 / math.sqrt(D))
    expected = _reference(query, key, value, index, positions, 1 / math.sqrt(D))
    torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-5, atol=1e-5)
