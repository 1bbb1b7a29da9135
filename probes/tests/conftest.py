"""Setup of the probes' tests (not in CI's default run: pytest's testpaths is tests/).

    TRITON_INTERPRET=1 PYTHONPATH=. python -m pytest -q probes/tests

As tests/conftest.py: without a GPU, Triton kernels run through the interpreter, chosen before
Triton compiles anything; tests marked gpu are skipped; probe_module is importable.
"""

import os
import sys

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
