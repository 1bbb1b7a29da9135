"""The batch-invariant decoder kernels (`flashspec.kernels.invariant`): each row's result is
bitwise the same whatever shares the launch, and equals a float64 reference to rounding.

On CPU they run through Triton's interpreter, with a dot that adds products in index order
(conftest's `index_order_dot`), so that the tests check the kernels' own structure (fixed
chunks, position-ordered key blocks, masked blocks as exact no-ops). On a GPU the same tests
check the hardware's MMAs, and `linear`'s split-K and one-program paths against each other
at real widths.
"""

from __future__ import annotations

import pytest
import torch

from flashspec.kernels import invariant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


pytestmark = pytest.mark.usefixtures("index_order_dot")


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [96, invariant.CHUNK_K * 2 + 40])
def test_linear_rows_do_not_depend_on_the_other_rows(dtype, k):
    """A row alone, among a few rows (split-K path) and among many (one program per tile
    looping over the chunks) comes out bitwise the same; with a bias too."""
    weight, bias = _rand(80, k, dtype=dtype, seed=1), _rand(80, dtype=dtype, seed=2)
    x = _rand(130 if DEVICE == "cpu" else 2000, k, dtype=dtype, seed=3)
    for b in (None, bias):
        full = invariant.linear(x, weight, b)
        for rows in (slice(5, 6), slice(5, 11), slice(0, 70)):
            assert torch.equal(invariant.linear(x[rows], weight, b), full[rows])
        reference = x.double() @ weight.double().T + (0 if b is None else b.double())
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(full.double(), reference, rtol=tolerance, atol=tolerance)


def test_linear_takes_a_transposed_weight_and_any_leading_shape():
    x, weight = _rand(2, 3, 40, seed=4), _rand(40, 24, seed=5)
    out = invariant.linear(x, weight.T)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out, x @ weight, rtol=1e-5, atol=1e-5)
    assert invariant.linear(x[:, :0], weight.T).shape == (2, 0, 24)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_mean_rows_do_not_depend_on_the_other_rows(dtype):
    x = _rand(70, invariant.MEAN_BLOCK + 300, dtype=dtype, seed=6)
    full = invariant.row_mean(x, keepdim=True)
    assert full.shape == (70, 1)
    assert torch.equal(invariant.row_mean(x[3:4], keepdim=True), full[3:4])
    torch.testing.assert_close(full.double(), x.double().mean(-1, keepdim=True),
                               rtol=1e-3, atol=1e-3)


def _attention_reference(query, key, value, key_index, positions, scaling, window):
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
                weights = torch.softmax(query[b, h, t].double().cpu() @ k.T * scaling, dim=0)
                out[b, t, h] = weights @ v
    return out


def _cache(B, Hkv, D, columns, dtype, seed):
    return _rand(B, Hkv, columns, D, dtype=dtype, seed=seed), _rand(B, Hkv, columns, D, dtype=dtype,
                                                                   seed=seed + 1)


@pytest.mark.parametrize("window", [None, 5])
def test_attention_equals_the_reference(window):
    B, Hq, Hkv, D, length = 2, 4, 2, 16, 150
    key, value = _cache(B, Hkv, D, 200, torch.float32, 7)
    # Keys in scattered columns: row 0 in order, row 1 reversed with a hole.
    key_index = torch.stack([torch.arange(200), torch.arange(200).flip(0)]).to(DEVICE)
    positions = torch.tensor([[length - 3, length - 2, length - 1], [0, 1, 2]], device=DEVICE)
    query = _rand(B, Hq, 3, D, seed=9)
    out = invariant.attention(query, key, value, key_index, positions, 0.25, window)
    expected = _attention_reference(query, key, value, key_index, positions, 0.25, window)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_of_a_query_does_not_depend_on_the_call_or_the_layout(dtype):
    """The query at position 140 alone, as the first of several queries (a verification),
    in a batch beside a longer row, and with its keys moved to other columns of a larger
    cache (compaction, left padding, another view): bitwise the same."""
    Hq, Hkv, D, length = 4, 2, 16, 141
    key, value = _cache(1, Hkv, D, 160, dtype, 11)
    query = _rand(1, Hq, 6, D, dtype=dtype, seed=13)
    index = torch.arange(160, device=DEVICE)[None]
    alone = invariant.attention(query[:, :, :1], key, value, index,
                                torch.tensor([[length - 1]], device=DEVICE), 0.3)
    positions = torch.arange(length - 1, length + 5, device=DEVICE)[None]
    verify = invariant.attention(query, key, value, index, positions, 0.3)
    assert torch.equal(verify[:, :1], alone)
    # Another layout: 37 columns of padding first, a larger cache, and a second row.
    moved_key = torch.cat([_rand(1, Hkv, 37, D, dtype=dtype, seed=15), key,
                           _rand(1, Hkv, 50, D, dtype=dtype, seed=16)], dim=2)
    moved_value = torch.cat([_rand(1, Hkv, 37, D, dtype=dtype, seed=17), value,
                             _rand(1, Hkv, 50, D, dtype=dtype, seed=18)], dim=2)
    other_key, other_value = _cache(1, Hkv, D, 247, dtype, 19)
    batch_index = torch.cat([index + 37, torch.arange(247, device=DEVICE)[None, :160]])
    batch = invariant.attention(
        torch.cat([query[:, :, :1], _rand(1, Hq, 1, D, dtype=dtype, seed=21)]),
        torch.cat([moved_key, other_key]), torch.cat([moved_value, other_value]), batch_index,
        torch.tensor([[length - 1], [155]], device=DEVICE), 0.3)
    assert torch.equal(batch[:1], alone)
