"""scripts/cold_start.py and `flashspec.bench.cold_start` on the CPU (the tiny built-in pair):
the report has every call of issue 28's sequence, the time to first token and the capacity
check; which calls may pay for compilation follows the drafter kind and batch bucket."""

import functools
import json

from script_module import load_script

from flashspec.bench.cold_start import CALLS, capacity_cost, first_of_its_kind, steady_state
from flashspec.generation.engine import batch_bucket


def test_report_on_cpu(tmp_path, capsys, monkeypatch):
    cold_start = load_script("cold_start")
    # Short steady runs, one timed repeat of the capacity check: the test checks the report,
    # not the figures. (steady_state's default token count is bound when it is defined.)
    monkeypatch.setattr(cold_start, "steady_state", functools.partial(steady_state, new_tokens=8))
    monkeypatch.setattr(cold_start, "capacity_cost", functools.partial(capacity_cost, repeats=1))
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
