"""scripts/cold_start.py and `flashspec.bench.cold_start` on the CPU (the tiny built-in pair):
the report has every call of issue 28's sequence, the time to first token and the capacity
check; which calls may pay for compilation follows the drafter kind and batch bucket."""

import json

from script_module import load_script

from flashspec.bench.cold_start import CALLS, first_of_its_kind
from flashspec.generation.engine import batch_bucket


def test_report_on_cpu(tmp_path, capsys, monkeypatch):
    cold_start = load_script("cold_start")
    monkeypatch.setattr("flashspec.bench.cold_start.STEADY_TOKENS", 8)
    assert cold_start.main(["--pair", "tiny", "--device", "cpu", "--new-tokens", "4",
                            "--ttft-prompt", "300", "--no-second-process",
                            "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "cold_start.json").read_text())
    assert [row["name"] for row in report["calls"]] == [call.name for call in CALLS]
    for row in report["calls"]:
        assert row["first"]["tokens"] == row["batch_size"] * 4
        assert row["first"]["seconds"] > 0 and row["warm"]["seconds"] > 0
    assert report["time_to_first_token"]["prompt_length"] == 300
    assert report["time_to_first_token"]["flash"] > 0 and report["time_to_first_token"]["stock"] > 0
    capacity = report["capacity_cost"]
    assert capacity["small"]["capacity"] == 256 and capacity["large"]["capacity"] == 512
    out = capsys.readouterr().out
    assert "time to first token, prompt 300" in out and "KV columns against 256" in out


def test_calls_that_may_compile():
    rows = [{"drafter": "none", "batch_size": 1}, {"drafter": "none", "batch_size": 2},
            {"drafter": "none", "batch_size": 3}, {"drafter": "lookup", "batch_size": 1},
            {"drafter": "none", "batch_size": 4}]
    assert first_of_its_kind(rows, lambda n: batch_bucket(n, True)) == [True, False, True, True, False]
    assert first_of_its_kind(rows, lambda n: batch_bucket(n, False)) == [True, True, True, True, True]
