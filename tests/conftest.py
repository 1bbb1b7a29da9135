"""Test session setup.

Without a GPU, Triton kernels run through the interpreter, which must be chosen before
Triton compiles anything, hence here. Test modules import each other's checks
(tests/test_teeth.py), hence the path entry.

README's command runs the suite in one process per core (pytest-xdist). Each then computes
on one thread: the tests' shapes are tiny, and two processes each running a two-thread pool
on two cores wait on each other's threads (measured 10-100x slower). The BLAS variables
must be set before numpy loads its library, hence first.
"""

import os
import sys

if os.environ.get("PYTEST_XDIST_WORKER"):
    for variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = "1"

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

sys.path.insert(0, os.path.dirname(__file__))

# transformers' vendored tests run in their own pytest process, routed
# (tests/test_transformers_suite.py), not as flashspec's tests.
collect_ignore = ["transformers_suite"]


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


@pytest.fixture
def emulated_graphs(monkeypatch):
    """A CPU stand-in for CUDA graphs: batches padded to their bucket and KV views as on
    CUDA, and each step's function kept under the engine's graph key and run again for later
    steps of that key, as a captured graph replays what it captured (a key that misses
    something a step depends on then replays the wrong step). Returns the keys in capture
    order."""
    from flashspec.generation import engine as engine_module
    from flashspec.generation import slot as slot_module

    captured, order = {}, []
    bucket_on_cuda = engine_module.batch_bucket
    monkeypatch.setattr(engine_module, "batch_bucket",
                        lambda rows, graphs: bucket_on_cuda(rows, True))
    view_on_cuda = slot_module.kv_view
    monkeypatch.setattr(slot_module, "kv_view",
                        lambda columns, graphs: view_on_cuda(columns, True))

    def run_step(self, slot, key, fn, drafter=None):
        full_key = self.graph_key(slot, key, drafter)
        if full_key not in captured:
            captured[full_key] = fn
            order.append(full_key)
        return captured[full_key]()

    monkeypatch.setattr(engine_module.Engine, "_run_step", run_step)
    monkeypatch.setattr(engine_module.Engine, "_verification_width",
                        lambda self, slot, width, step: step)
    return order
