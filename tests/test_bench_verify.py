"""scripts/bench_verify.py: the --quick smoke run (CPU, flashspec's kernel interpreted), its
JSON schema, the materialized baseline's semantics, and the command line's refusals."""

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

BASELINES = ("matmul", "materialized", "materialized_qwen")
FLASHSPEC_VARIANTS = ("flashspec_verify", "flashspec_verify_qwen")


bench = load_script("bench_verify")


def _verify_importable() -> bool:
    try:
        return hasattr(importlib.import_module("flashspec.kernels"), "fused_verify")
    except Exception:  # noqa: BLE001 - whatever breaks the import, the bench records it
        return False


def _is_ms(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0


def _is_ratio(value) -> bool:
    return value is None or _is_ms(value)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    # Without CUDA, tests/conftest.py has set TRITON_INTERPRET=1, so the flashspec variants
    # run in Triton's interpreter instead of being skipped.
    assert torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    out = tmp_path_factory.mktemp("bench_verify")
    return out, bench.main(["--quick", "--out", str(out)])


@pytest.fixture(scope="module")
def report(quick_run):
    out, _ = quick_run
    return json.loads((out / "bench_verify.json").read_text())


def test_quick_run_succeeds(quick_run):
    out, code = quick_run
    assert code == 0
    assert (out / "bench_verify.json").is_file()


def test_report_header(report):
    cuda = torch.cuda.is_available()
    assert report["cuda"] is cuda
    assert report["device"] == (torch.cuda.get_device_name() if cuda else "cpu")
    assert report["torch"] == torch.__version__
    for key in ("triton", "transformers", "date_utc", "timing_method", "sampling"):
        assert key in report
    assert report["date_utc"].endswith("+00:00")
    assert report["quick"] is True and report["materialized_compiled"] is False
    assert report["shape"] == {"D": 64, "V": 256}
    assert report["batch_sizes"] == [1, 2] and report["draft_lengths"] == [1, 3]
    assert report["variants"] == list(bench.VARIANTS)
    assert report["acceptance"] == "strict"
    assert report["bars"] == {"x_matmul_max": 1.05, "speedup_min": 1.3, "speedup_min_rows": 32}


def test_rows_schema(report):
    rows = report["rows"]
    assert [(r["B"], r["G"], r["R"]) for r in rows] == [(1, 1, 2), (1, 3, 4), (2, 1, 4),
                                                         (2, 3, 8)]
    for row in rows:
        assert set(row["ms"]) == set(row["status"]) == set(bench.VARIANTS)
        for name, status in row["status"].items():
            ms = row["ms"][name]
            if status == "ok":
                assert _is_ms(ms), (name, ms)
            else:
                assert ms is None, (name, ms)
                assert status.startswith(("skipped:", "error: ")), status
            assert _is_ratio(row["x_matmul"][name])
            assert (row["x_matmul"][name] is None) is (ms is None)
        assert row["x_matmul"]["matmul"] == pytest.approx(1.0)
        assert set(row["speedup"]) == {"untruncated", "qwen"}
        assert all(_is_ratio(v) for v in row["speedup"].values())
        for bar in ("x_matmul", "speedup"):
            assert set(row["meets_bar"][bar]) == {"untruncated", "qwen"}
            assert all(v in (True, False, None) for v in row["meets_bar"][bar].values())
        # R < 32 everywhere here: the speedup bar does not apply.
        assert set(row["meets_bar"]["speedup"].values()) == {None}
        assert set(row["rows_not_ok"]) <= set(FLASHSPEC_VARIANTS)
        assert row["notes"] == {}  # only compiled (CUDA, not --quick) baselines get notes
        assert all(isinstance(n, int) and 0 <= n <= row["B"] for n in row["rows_not_ok"].values())
        # How each timed variant was timed: CUDA-graph replays on a GPU, eagerly here.
        assert row["timing"] == {name: "eager" for name, status in row["status"].items()
                                 if status == "ok"}


def test_baselines_are_timed(report):
    for row in report["rows"]:
        for name in BASELINES:
            assert row["status"][name] == "ok", row["status"]
            assert _is_ms(row["ms"][name])


def test_flashspec_variants_attempted(report):
    importable = _verify_importable()
    for row in report["rows"]:
        for name in FLASHSPEC_VARIANTS:
            status = row["status"][name]
            if importable:
                assert status == "ok", status
                assert _is_ms(row["ms"][name])
                assert name in row["rows_not_ok"]
            else:
                assert status.startswith("error: "), status
        pair_measured = row["ms"]["flashspec_verify"] is not None
        assert (row["speedup"]["untruncated"] is not None) is pair_measured
        assert (row["meets_bar"]["x_matmul"]["untruncated"] is not None) is pair_measured


def test_broken_flashspec_is_recorded_and_table_printed_last(tmp_path, monkeypatch, capsys):
    # An empty flashspec.kernels: what the bench sees before the kernel exists.
    monkeypatch.setitem(sys.modules, "flashspec.kernels", types.ModuleType("flashspec.kernels"))
    assert bench.main(["--quick", "--shape", "16x64", "--batch-sizes", "3",
                       "--draft-lengths", "2", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "bench_verify.json").read_text())["rows"][0]
    assert (row["B"], row["G"], row["R"]) == (3, 2, 9)
    assert all(row["status"][name] == "ok" for name in BASELINES)
    for name in FLASHSPEC_VARIANTS:
        assert row["ms"][name] is None
        assert row["status"][name].startswith("error: ImportError: ")
        assert "fused_verify" in row["status"][name]
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[-2].split()[:5] == ["B", "G", "R", "matmul", "verify"]
    assert lines[-1].split()[:3] == ["3", "2", "9"]
    assert any(line.startswith("flashspec_verify (1 points): error: ImportError")
               for line in lines)
    assert max(map(len, lines)) <= 120


def test_materialized_accepts_certain_drafts_and_rejects_impossible_ones():
    batch, drafts, vocab = 4, 3, 32
    chosen = torch.randint(0, vocab, (batch, drafts + 1))
    logits = torch.full((batch, drafts + 1, vocab), -1e4)
    logits.scatter_(-1, chosen[..., None], 0.0)  # one token per position holds all the mass
    logits = logits.view(-1, vocab).bfloat16()
    k = torch.full((batch * (drafts + 1),), 20)
    p = torch.full((batch * (drafts + 1),), 0.95)
    for extra in ((), (k, p)):
        num, tokens, accept, logprobs = bench.materialized_verify(logits, chosen[:, :drafts],
                                                                  0.7, *extra)
        assert num.tolist() == [drafts] * batch
        assert torch.equal(tokens, chosen)  # all drafts, then the bonus token
        assert torch.allclose(accept, torch.ones(batch, drafts))
        assert torch.allclose(logprobs, torch.zeros(batch, drafts + 1), atol=1e-4)
        wrong = (chosen[:, :drafts] + 1) % vocab
        num, tokens, accept, logprobs = bench.materialized_verify(logits, wrong, 0.7, *extra)
        assert num.tolist() == [0] * batch
        assert torch.equal(tokens[:, 0], chosen[:, 0])  # recovered from the residual
        assert (tokens[:, 1:] == -1).all() and (logprobs[:, 1:] == 0).all()
        assert (accept == 0).all()


def _tiny_case(compile_: bool):
    batch, drafts, dim, vocab = 2, 1, 16, 64
    weight = torch.randn(vocab, dim, dtype=torch.bfloat16)
    hidden = torch.randn(batch, drafts + 1, dim, dtype=torch.bfloat16)
    return bench.Case(hidden, weight, torch.randint(0, vocab, (batch, drafts)),
                      torch.zeros(batch, dtype=torch.long), False, compile_, "strict")


def test_inductor_failure_on_the_truncation_falls_back_to_eager_sort(monkeypatch):
    def fake_compile(fn, dynamic):
        assert dynamic is False
        if getattr(fn, "keywords", {}).get("truncate") is bench.sort_top_k_top_p_eager:
            return fn

        def fails(*args, **kwargs):
            raise RuntimeError("inductor bug")
        return fails

    monkeypatch.setattr(torch, "compile", fake_compile)
    fn = bench._materialized(_tiny_case(True), bench.QWEN)
    assert fn.note == "compiled, top-k/top-p eager (error: RuntimeError: inductor bug)"
    num_accepted, tokens, _, _ = fn()
    assert num_accepted.shape == (2,) and tokens.shape == (2, 2)
    with pytest.raises(RuntimeError, match="inductor bug"):  # nothing to fall back to
        bench._materialized(_tiny_case(True), bench.UNTRUNCATED)
    assert not hasattr(bench._materialized(_tiny_case(False), bench.QWEN), "note")


@pytest.mark.parametrize("option,value", [("--batch-sizes", "0"), ("--batch-sizes", "1,x"),
                                          ("--draft-lengths", "0"), ("--draft-lengths", "-1"),
                                          ("--shape", "64x0"), ("--shape", "8x8,8x8"),
                                          ("--rep-ms", "-1"), ("--acceptance", "nope")])
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
    for option in ("--shape", "--batch-sizes", "--draft-lengths", "--acceptance", "--rep-ms",
                   "--out", "--quick"):
        assert option in text
    assert "PYTHONPATH=. python scripts/bench_verify.py" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_full_run_needs_cuda(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path)]) == 2
    assert "CUDA" in capsys.readouterr().err
