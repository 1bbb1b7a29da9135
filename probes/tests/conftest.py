"""The probes' tests (not in CI's default run: pytest's testpaths is tests/) share the test
suite's session setup: tests/conftest.py (without a GPU the Triton interpreter, tests marked
gpu skipped, tests/ importable, hence `script_module`).

    TRITON_INTERPRET=1 PYTHONPATH=. python -m pytest -q probes/tests
"""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "tests_conftest", Path(__file__).resolve().parents[2] / "tests" / "conftest.py")
_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_suite)
pytest_collection_modifyitems = _suite.pytest_collection_modifyitems
