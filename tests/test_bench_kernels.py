"""scripts/bench_kernels.py: the --quick smoke run (CPU, flashspec's kernels interpreted),
its JSON schema, and the command line's refusals."""

import importlib
import importlib.util
import json
import numbers
import os
import sys
import types

import pytest
import torch

from script_module import load_script

FLASHSPEC_VARIANTS = {"flashspec_argmax": "fused_argmax",
                      "flashspec_sample": "fused_sample",
                      "flashspec_sample_topk50": "fused_sample",
                      "flashspec_sample_qwen": "fused_sample"}
# A smaller vocabulary than --quick's 1000 keeps the interpreted truncated kernels ~1 s a call.
QUICK_ARGS = ["--quick", "--shapes", "64x256", "--batch-sizes", "1,2"]


bench = load_script("bench_kernels")


def _kernel_importable(name: str) -> bool:
    try:
        return hasattr(importlib.import_module("flashspec.kernels"), name)
    except Exception:  # noqa: BLE001 - whatever breaks the import, the bench records it
        return False


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    # Without CUDA, tests/conftest.py has set TRITON_INTERPRET=1, so the flashspec variants
    # run in Triton's interpreter instead of being skipped.
    assert torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    out = tmp_path_factory.mktemp("bench")
    return out, bench.main(QUICK_ARGS + ["--out", str(out)])


@pytest.fixture(scope="module")
def report(quick_run):
    out, _ = quick_run
    return json.loads((out / "bench_kernels.json").read_text())


def _is_ms(value) -> bool:
    return isinstance(value, numbers.Real) and value > 0


def _is_ratio(value) -> bool:
    return value is None or (isinstance(value, numbers.Real) and value > 0)


def test_quick_run_succeeds_and_writes_files(quick_run):
    out, code = quick_run
    assert code == 0
    assert (out / "bench_kernels.json").is_file()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench_kernels.png").stat().st_size > 0


def test_report_header(report):
    cuda = torch.cuda.is_available()
    assert report["cuda"] is cuda
    assert report["device"] == (torch.cuda.get_device_name() if cuda else "cpu")
    assert report["torch"] == torch.__version__
    for key in ("triton", "transformers", "flashinfer", "date_utc", "timing_method"):
        assert key in report
    assert report["date_utc"].endswith("+00:00")
    assert _is_ms(report["bandwidth_gb_per_s"])
    assert report["shapes"] == [{"D": 64, "V": 256}]
    assert report["batch_sizes"] == [1, 2]
    assert report["variants"] == list(bench.VARIANTS)
    assert "NOT measured" in report["reference_quoted"]["source"]


def test_rows_schema(report):
    rows = report["rows"]
    assert [(r["D"], r["V"], r["B"]) for r in rows] == [(64, 256, 1), (64, 256, 2)]
    for row in rows:
        assert _is_ms(row["floor_ms"])
        assert set(row["ms"]) == set(row["status"]) == set(bench.VARIANTS)
        for name, status in row["status"].items():
            ms = row["ms"][name]
            if status == "ok":
                assert _is_ms(ms), (name, ms)
            else:
                assert ms is None, (name, ms)
                assert status == "not installed" or status.startswith(("skipped:", "error:"))
            assert _is_ratio(row["x_floor"][name]) and _is_ratio(row["x_matmul"][name])
            assert (row["x_floor"][name] is None) is (ms is None)
        assert row["x_matmul"]["matmul"] == pytest.approx(1.0)
        assert row["best_truncation_baseline"] in bench.TRUNCATION_BASELINES
        assert all(_is_ratio(v) for v in row["speedup"].values())
        assert set(row["truncation_cost"]) == set(bench.TRUNCATED_FLASHSPEC)
        assert all(isinstance(n, int) and 0 <= n <= row["B"] for n in row["rows_not_ok"].values())
        # How each timed variant was timed: CUDA-graph replays on a GPU, eagerly here.
        assert row["timing"] == {name: "eager" for name, status in row["status"].items()
                                 if status == "ok"}


def test_materialized_baselines_are_timed(report):
    always = ("matmul", "matmul_argmax", "matmul_exponential_race", "matmul_sort_topk_topp",
              "matmul_topk50")
    for row in report["rows"]:
        assert all(row["status"][name] == "ok" for name in always), row["status"]
        if not report["cuda"]:
            assert row["status"]["matmul_softmax_multinomial"].startswith("skipped:")
            assert row["status"]["flashinfer_sample"].startswith("skipped:")


def test_flashspec_variants_attempted(report):
    for row in report["rows"]:
        for name, kernel in FLASHSPEC_VARIANTS.items():
            status = row["status"][name]
            assert not status.startswith("skipped"), status
            if not _kernel_importable(kernel):
                assert status.startswith("error: "), status
            else:
                assert status == "ok", status
                assert _is_ms(row["ms"][name])
                assert name in row["rows_not_ok"]


def test_table_is_printed_last(tmp_path, capsys):
    assert bench.main(["--quick", "--shapes", "16x64", "--batch-sizes", "3", "--variants",
                       "matmul,matmul_argmax", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[-2].split()[:3] == ["B", "floor", "matmul"]
    assert lines[-1].split()[0] == "3"
    assert max(map(len, lines)) <= 120
    report = json.loads((tmp_path / "bench_kernels.json").read_text())
    assert list(report["rows"][0]["ms"]) == ["matmul", "matmul_argmax"]


@pytest.mark.parametrize("option,value", [("--batch-sizes", "0"), ("--batch-sizes", "1,x"),
                                          ("--shapes", "12"), ("--shapes", "64x0"),
                                          ("--variants", "nope"), ("--rep-ms", "-1")])
def test_bad_arguments_exit_nonzero_naming_the_option(option, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--quick", option, value, "--out", str(tmp_path)])
    assert exit_info.value.code != 0
    assert option in capsys.readouterr().err


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--shapes", "--batch-sizes", "--variants", "--rep-ms", "--out", "--quick"):
        assert option in text
    assert "PYTHONPATH=. python scripts/bench_kernels.py" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_full_run_needs_cuda(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path)]) == 2
    assert "CUDA" in capsys.readouterr().err


def test_broken_flashspec_is_recorded_and_baselines_go_on(tmp_path, monkeypatch, capsys):
    # An empty flashspec.kernels: what the bench sees before the kernels exist.
    monkeypatch.setitem(sys.modules, "flashspec.kernels", types.ModuleType("flashspec.kernels"))
    assert bench.main(["--quick", "--shapes", "16x64", "--batch-sizes", "2", "--variants",
                       "flashspec_argmax,flashspec_sample,matmul", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "bench_kernels.json").read_text())["rows"][0]
    assert row["status"]["matmul"] == "ok" and _is_ms(row["ms"]["matmul"])
    for name in ("flashspec_argmax", "flashspec_sample"):
        assert row["ms"][name] is None
        assert row["status"][name].startswith("error: ImportError: ")
        assert FLASHSPEC_VARIANTS[name] in row["status"][name]
    assert "flashspec_sample (1 rows): error: ImportError" in capsys.readouterr().out
