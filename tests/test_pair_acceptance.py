"""scripts/pair_acceptance.py: a tiny end-to-end run and its output schema."""

import json

import pytest

from script_module import load_script

pair_acceptance = load_script("pair_acceptance")


def test_tiny_run_writes_the_report(tmp_path, capsys):
    out = tmp_path / "acceptance.json"
    assert pair_acceptance.main(["--prompts", "2", "--prompt-tokens", "16", "--new-tokens", "8",
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
        pair_acceptance.main(["--num-drafts", "0"])
