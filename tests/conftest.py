"""Test session setup.

Without a GPU, Triton kernels run through the interpreter, which must be chosen before
Triton compiles anything, hence here. Test modules import each other's checks
(tests/test_teeth.py), hence the path entry.
"""

import os
import sys

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def index_order_dot(monkeypatch):
    """On CPU, Triton's interpreter computes `tl.dot` with numpy's matmul, whose BLAS can add a
    row's products in an order that depends on the row's place in the tile (seen with
    OpenBLAS), which no GPU MMA does. This gives the interpreter a dot that adds the products
    in index order, so that tests of the batch-invariant kernels check the kernels' own
    structure. On a GPU it does nothing: the hardware's MMAs are what is tested."""
    if torch.cuda.is_available():
        return
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        total = np.zeros(d.data.shape, dtype=d.data.dtype)
        for k in range(a.data.shape[1]):
            total += np.multiply.outer(a.data[:, k], b.data[k, :]).astype(d.data.dtype)
        return interpreter.TensorHandle(total + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
