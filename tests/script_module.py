"""The scripts in ``scripts/`` and the probes in ``probes/`` (not packages) imported as
modules, for their tests."""

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
PROBES = SCRIPTS.parent / "probes"


def load_script(name: str, folder: Path = SCRIPTS):
    """A fresh module of ``<folder>/<name>.py`` (``scripts/`` unless told), registered in
    sys.modules under `name` (dataclasses look their module up there while defining)."""
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
