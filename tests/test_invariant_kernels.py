"""The batch-invariant decoder kernels (`flashspec.kernels.invariant`): each row's result is
bitwise the same whatever shares the launch, and equals a float64 reference to rounding.
(Attention by position, which the invariant forward uses: tests/test_attention_kernel.py.)

On CPU they run through Triton's interpreter, with a dot that adds products in index order
(conftest's `index_order_dot`), so that the tests check the kernels' own structure (fixed
chunks). On a GPU the same tests check the hardware's MMAs, and `linear`'s split-K and
one-program paths against each other at real widths.
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
