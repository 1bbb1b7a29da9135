"""scripts/pair_acceptance.py: a tiny end-to-end run and its output schema."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pair_acceptance.py"


def _script():
    spec = importlib.util.spec_from_file_location("pair_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_writes_the_report(tmp_path, capsys):
    out = tmp_path / "acceptance.json"
    assert _script().main(["--prompts", "2", "--prompt-tokens", "16", "--new-tokens", "8",
                           "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    for mode in ("assistant", "prompt_lookup"):
        result = report["results"][mode]
        assert len(result["per_position_acceptance"]) <= 4
        assert 0 <= result["accepted_drafts_per_verification"] <= 4
        assert result["tokens_per_verification"] == pytest.approx(result["accepted_drafts_per_verification"] + 1)
    assert "acceptance by position" in capsys.readouterr().out


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        _script().main(["--num-drafts", "0"])
