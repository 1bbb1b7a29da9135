"""The probes in ``probes/`` (not a package) imported as modules, for their tests."""

import importlib.util
import sys
from pathlib import Path

PROBES = Path(__file__).resolve().parents[1]


def load_probe(name: str):
    """A fresh module of ``probes/<name>.py``, registered in sys.modules under `name`
    (dataclasses look their module up there while defining)."""
    spec = importlib.util.spec_from_file_location(name, PROBES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
