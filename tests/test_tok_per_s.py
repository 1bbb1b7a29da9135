"""scripts/tok_per_s.py: the command line's refusals, the expected-tok/s arithmetic, and a
tiny CPU run (built-in pair, fp32) with its JSON schema."""

import importlib.util
import json
import numbers
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tok_per_s.py"
VARIANTS = ["hf", "hf_static_compile", "hf_assisted", "flash_plain", "flash_draft",
            "flash_draft_materialized"]
BATCH_SIZES = [1, 2]
NEW_TOKENS = 8
RUN_ARGS = ["--pair", "tiny", "--batch-sizes", ",".join(map(str, BATCH_SIZES)),
            "--new-tokens", str(NEW_TOKENS), "--prompt-length", "8", "--num-drafts", "3",
            "--reps", "1", "--dtype", "fp32", "--device", "cpu",
            "--variants", ",".join(VARIANTS)]


def _load_script():
    spec = importlib.util.spec_from_file_location("tok_per_s", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tok_per_s = _load_script()


@pytest.mark.parametrize("args, option", [
    (["--batch-sizes", "0"], "--batch-sizes"),
    (["--batch-sizes", "1,x"], "--batch-sizes"),
    (["--new-tokens", "0"], "--new-tokens"),
    (["--prompt-length", "-1"], "--prompt-length"),
    (["--num-drafts", "0"], "--num-drafts"),
    (["--reps", "0"], "--reps"),
    (["--pair", "tiny,gpt5"], "--pair"),
    (["--variants", "hf,flash_turbo"], "--variants"),
    (["--dtype", "fp16"], "--dtype"),
])
def test_bad_arguments_exit_2_naming_the_option(args, option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tok_per_s.main(args)
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_without_a_device_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tok_per_s.main(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device cuda" in capsys.readouterr().err


def test_variants_run_in_table_order():
    assert tok_per_s.parse_variants("flash_self,hf") == ["hf", "flash_self"]


@pytest.mark.parametrize("num_drafts", [1, 3, 5])
def test_expected_tokens_per_round(num_drafts):
    assert tok_per_s.expected_tokens_per_round(1.0, num_drafts) == num_drafts + 1
    assert tok_per_s.expected_tokens_per_round(0.0, num_drafts) == 1.0
    a = 0.5
    assert tok_per_s.expected_tokens_per_round(a, num_drafts) == pytest.approx(
        sum(a ** i for i in range(num_drafts + 1)))


def test_expected_tok_s_from_step_times():
    plain = tok_per_s.expected_tok_s({"plain": 2.0}, batch_size=4, verify_width=5,
                                     measured_tokens_per_round=1.0)
    assert plain == {"all_accepted": 2000.0, "at_measured_acceptance": 2000.0}
    # One round: 3 ms of drafts + 2 ms of verification; all accepted gives G + 1 = 4 tokens.
    speculative = tok_per_s.expected_tok_s({"draft_round": 3.0, "verify": 2.0}, batch_size=2,
                                           verify_width=3, measured_tokens_per_round=2.5)
    assert speculative["all_accepted"] == pytest.approx(2 * 4 / 5e-3)
    assert speculative["at_measured_acceptance"] == pytest.approx(2 * 2.5 / 5e-3)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok_per_s")
    return out, tok_per_s.main(RUN_ARGS + ["--out", str(out)])


@pytest.fixture(scope="module")
def report(tiny_run):
    out, _ = tiny_run
    return json.loads((out / "tok_per_s.json").read_text())


def _positive(value) -> bool:
    return isinstance(value, numbers.Real) and value > 0


def test_tiny_run_writes_files(tiny_run):
    out, code = tiny_run
    assert code == 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "tok_per_s.png").stat().st_size > 0


def test_report_header(report):
    assert report["device"] == "cpu"
    assert report["versions"]["torch"] == torch.__version__
    assert {"transformers", "triton", "python"} <= set(report["versions"])
    assert report["date"].endswith("+00:00")
    assert report["args"]["variants"] == VARIANTS
    assert _positive(report["copy_gbps"])
    pair = report["pairs"]["tiny"]
    assert pair["target_weight_bytes"] > pair["draft_weight_bytes"] > 0


def test_one_row_per_setting(report):
    keys = [(row["pair"], row["batch_size"], row["variant"]) for row in report["rows"]]
    assert keys == [("tiny", batch, name) for batch in BATCH_SIZES for name in VARIANTS]


def test_skipped_rows_say_why(report):
    skipped = {(row["batch_size"], row["variant"]): row for row in report["rows"]
               if row["status"] != "ok"}
    # No compile on CPU; stock assisted generation refuses batches.
    assert set(skipped) == {(1, "hf_static_compile"), (2, "hf_static_compile"),
                            (2, "hf_assisted")}
    for row in skipped.values():
        assert row["status"].startswith("skipped: ")
        assert row["tok_s"] is None and row["seconds"] is None


def test_rows_that_ran(report):
    for row in report["rows"]:
        if row["status"] != "ok":
            continue
        assert _positive(row["tok_s"]) and all(map(_positive, row["seconds"]))
        assert row["tok_s"] == pytest.approx(row["batch_size"] * NEW_TOKENS / row["seconds"][0])
        assert all(value is None or _positive(value) for value in row["ratio"].values())
        assert row["step_ms"] is None and row["expected_tok_s"] is None     # no graphs on CPU
        plain = row["variant"] in ("hf", "flash_plain")
        assert _positive(row["weight_bandwidth_fraction"]) if plain else (
            row["weight_bandwidth_fraction"] is None)
        # fp32 on CPU: greedy flashspec, stock assisted and stock plain agree token for token.
        assert row["same_tokens_as_hf"] is (None if row["variant"] == "hf" else True)


def test_ratios(report):
    rows = {(row["batch_size"], row["variant"]): row for row in report["rows"]}
    flash_draft = rows[1, "flash_draft"]
    assert flash_draft["ratio"]["vs_hf"] == pytest.approx(
        flash_draft["tok_s"] / rows[1, "hf"]["tok_s"])
    assert flash_draft["ratio"]["vs_stock_assisted"] == pytest.approx(
        flash_draft["tok_s"] / rows[1, "hf_assisted"]["tok_s"])
    assert flash_draft["ratio"]["vs_materialized"] == pytest.approx(
        flash_draft["tok_s"] / rows[1, "flash_draft_materialized"]["tok_s"])
    assert flash_draft["ratio"]["vs_hf_static_compile"] is None       # skipped on CPU
    assert rows[2, "flash_draft"]["ratio"]["vs_stock_assisted"] is None


def test_flash_rows_carry_speculation_stats(report):
    for row in report["rows"]:
        stats = row["flash_stats"]
        if not row["variant"].startswith("flash"):
            assert stats is None
            continue
        assert stats["mean_accepted_length"] >= 1
        if row["variant"] == "flash_plain":
            assert stats["drafted"] == 0 and stats["acceptance_rate"] is None
        else:
            assert stats["drafted"] > 0 and 0 <= stats["acceptance_rate"] <= 1
            assert len(stats["per_position_acceptance"]) <= 3


def test_table_is_printed(tiny_run, capsys):
    tok_per_s.print_table(json.loads((tiny_run[0] / "tok_per_s.json").read_text()))
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("pair ") and "tok/s" in line for line in lines)
    assert any(line.split()[:3] == ["tiny", "2", "hf_assisted"] and "skipped" in line
               for line in lines)
