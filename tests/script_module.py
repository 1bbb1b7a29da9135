"""The scripts in ``scripts/`` (not a package) imported as modules, for their tests."""

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """A fresh module of ``scripts/<name>.py``, registered in sys.modules under `name`
    (dataclasses look their module up there while defining)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
