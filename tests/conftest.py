"""Test session setup.

Without a GPU, Triton kernels run through the interpreter, which must be chosen before
Triton compiles anything, hence here. Test modules import each other's checks
(tests/test_teeth.py), hence the path entry.
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
