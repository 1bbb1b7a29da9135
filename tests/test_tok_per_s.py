"""scripts/tok_per_s.py and its library (flashspec.bench: pairs, timing, tok_per_s,
tok_per_s_report): the command line's refusals, the pair specs, the expected-tok/s
arithmetic, and tiny CPU runs (built-in pair, fp32; a random-init model without a draft; a
random-init pair under torchrun on 2 gloo ranks) with their JSON schema."""

import importlib.util
import json
import numbers
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashspec.bench import pairs, timing, tok_per_s_report
from flashspec.bench import tok_per_s as sweep
from script_module import load_script

PLAIN = ["hf", "hf_static_compile", "flash_plain"]
SPECULATIVE = ["hf_assisted", "hf_lookup", "flash_draft", "flash_draft_materialized",
               "flash_lookup", "flash_lookup_materialized"]
VARIANTS = PLAIN[:2] + SPECULATIVE[:2] + PLAIN[2:] + SPECULATIVE[2:]     # table order
BATCH_SIZES = [1, 2]
DECODINGS = ["greedy", "sample"]
NUM_DRAFTS = [2, 3]
NEW_TOKENS = 8
# code_edit's first two prompts are 152 and 133 tokens with the tiny pair's tokenizer: at
# most 140 truncates the first and left-pads the second.
PROMPT_LENGTH = 140
RUN_ARGS = ["--pair", "tiny", "--prompts", "code_edit", "--decoding", ",".join(DECODINGS),
            "--num-drafts", ",".join(map(str, NUM_DRAFTS)),
            "--batch-sizes", ",".join(map(str, BATCH_SIZES)), "--new-tokens", str(NEW_TOKENS),
            "--prompt-length", str(PROMPT_LENGTH), "--reps", "1", "--dtype", "fp32",
            "--device", "cpu", "--variants", ",".join(VARIANTS)]


tok_per_s = load_script("tok_per_s")
TINY_TARGET = str(pairs.PAIRS["tiny"].target)


@pytest.mark.parametrize("args, options", [
    (["--batch-sizes", "0"], ["--batch-sizes"]),
    (["--batch-sizes", "1,x"], ["--batch-sizes"]),
    (["--new-tokens", "0"], ["--new-tokens"]),
    (["--prompt-length", "-1"], ["--prompt-length"]),
    (["--num-drafts", "0"], ["--num-drafts"]),
    (["--num-drafts", "2,x"], ["--num-drafts"]),
    (["--reps", "0"], ["--reps"]),
    (["--pair", "tiny,gpt5"], ["--pair"]),
    (["--variants", "hf,flash_turbo"], ["--variants"]),
    (["--dtype", "fp16"], ["--dtype"]),
    (["--weights", "sharp"], ["--weights"]),
    (["--decoding", "greedy,beam"], ["--decoding"]),
    (["--prompts", "poems"], ["--prompts"]),
    (["--random-init", "qwen9-1b"], ["--random-init"]),
    (["--random-init", "qwen3-1.7b,qwen3-0.6b,qwen3-0.6b"], ["--random-init"]),
    (["--pair", "tiny", "--target", TINY_TARGET], ["--pair", "--target"]),
    (["--pair", "qwen3", "--random-init", "qwen3-0.6b"], ["--pair", "--random-init"]),
    (["--target", TINY_TARGET, "--random-init", "qwen3-0.6b"], ["--target", "--random-init"]),
    (["--draft", TINY_TARGET], ["--draft", "--target"]),
    (["--pair", "tiny", "--draft", TINY_TARGET], ["--draft", "--target"]),
    (["--random-init", "qwen3-0.6b", "--prompts", "code_edit"], ["--prompts"]),
    (["--pair", "tiny,qwen3", "--prompts", "chat"], ["--prompts"]),
    (["--weights", "peaked"], ["--weights"]),                      # the default pair: tiny
    (["--target", TINY_TARGET, "--weights", "peaked"], ["--weights"]),
    (["--device", "cpu", "--gpus", "2"], ["--gpus"]),
    (["--gpus", "0"], ["--gpus"]),
])
def test_bad_arguments_exit_2_naming_the_option(args, options, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tok_per_s.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(option in err for option in options), err


def test_random_init_config_needs_a_model_type(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(SystemExit) as exit_info:
        tok_per_s.main(["--random-init", str(config)])
    assert exit_info.value.code == 2
    assert "--random-init" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_without_a_device_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tok_per_s.main(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device cuda" in capsys.readouterr().err


def test_help_states_every_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tok_per_s.main(["--help"])
    assert exit_info.value.code == 0
    options = capsys.readouterr().out.split("options:", 1)[1]
    entries = [entry for entry in options.split("\n  -")[1:] if not entry.startswith("h, --help")]
    assert len(entries) == 19
    for entry in entries:
        assert "default" in " ".join(entry.split()), entry


def test_cpu_defaults():
    args = tok_per_s.parse_args(["--device", "cpu"])
    assert [spec.label for spec in tok_per_s.pair_specs(args)] == ["tiny"]
    assert (args.batch_sizes, args.prompt_length, args.new_tokens, args.reps, args.dtype) == (
        [1, 4], 64, 64, 1, "fp32")
    assert (args.num_drafts, args.decoding, args.prompts) == ([5], ["greedy"], "random")
    assert args.variants == list(sweep.VARIANTS)


def test_presets_are_random_init_aliases():
    args = tok_per_s.parse_args(["--random-init", "qwen3-1.7b,qwen3-0.6b", "--device", "cpu"])
    (spec,) = tok_per_s.pair_specs(args)
    assert spec[1:] == pairs.PAIRS["qwen3"][1:]
    assert spec.label == "qwen3-1.7b"
    args = tok_per_s.parse_args(["--target", TINY_TARGET, "--device", "cpu"])
    (spec,) = tok_per_s.pair_specs(args)
    assert (spec.target, spec.draft, spec.random_init) == (TINY_TARGET, None, False)


def test_sweep_plan():
    args = tok_per_s.parse_args(["--device", "cpu", "--batch-sizes", "1,4", "--decoding",
                                 "sample,greedy", "--num-drafts", "4,2,4",
                                 "--variants", "flash_self,hf,flash_plain"])
    assert args.decoding == ["greedy", "sample"] and args.num_drafts == [2, 4]
    assert sweep.plan_runs(args)[:4] == [
        (1, "greedy", None, "hf"), (1, "greedy", None, "flash_plain"),
        (1, "greedy", 2, "flash_self"), (1, "greedy", 4, "flash_self")]
    assert len(sweep.plan_runs(args)) == 2 * 2 * (2 + 2)


def test_peaked_weights_need_a_random_init_pair():
    with pytest.raises(ValueError, match="'peaked' applies to random-init pairs"):
        pairs.load_pair(pairs.PAIRS["tiny"], "cpu", torch.float32, weights="peaked")


def test_variants_run_in_table_order():
    assert tok_per_s.parse_variants("flash_lookup,flash_self,hf") == [
        "hf", "flash_self", "flash_lookup"]


@pytest.mark.parametrize("num_drafts", [1, 3, 5])
def test_expected_tokens_per_round(num_drafts):
    assert timing.expected_tokens_per_round(1.0, num_drafts) == num_drafts + 1
    assert timing.expected_tokens_per_round(0.0, num_drafts) == 1.0
    a = 0.5
    assert timing.expected_tokens_per_round(a, num_drafts) == pytest.approx(
        sum(a ** i for i in range(num_drafts + 1)))


def test_expected_tok_s_from_step_times():
    plain = timing.expected_tok_s({"plain": 2.0}, batch_size=4, verify_width=5,
                                     measured_tokens_per_round=1.0)
    assert plain == {"all_accepted": 2000.0, "at_measured_acceptance": 2000.0,
                     "at_assumed_acceptance": None}
    # One round: 3 ms of drafts + 2 ms of verification; all accepted gives G + 1 = 4 tokens.
    speculative = timing.expected_tok_s({"draft_round": 3.0, "verify": 2.0}, batch_size=2,
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


def _rows(report) -> dict:
    return {(row["batch_size"], row["decoding"], row["num_drafts"], row["variant"]): row
            for row in report["rows"]}


def test_tiny_run_writes_files(tiny_run):
    out, code = tiny_run
    assert code == 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "tok_per_s.png").stat().st_size > 0


def test_report_header(report):
    assert report["device"] == "cpu"
    assert report["versions"]["torch"] == torch.__version__
    assert {"transformers", "triton", "flashspec", "python"} <= set(report["versions"])
    assert report["date"].endswith("+00:00")
    assert (report["world_size"], report["backend"]) == (1, None)
    assert report["args"]["variants"] == VARIANTS
    assert report["args"]["num_drafts"] == NUM_DRAFTS
    assert report["decodings"] == {
        "greedy": {"do_sample": False, "seed": 0},
        "sample": {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "seed": 0}}
    assert report["prompts"]["source"] == "code_edit"
    assert report["prompts"]["max_length"] == PROMPT_LENGTH
    assert _positive(report["copy_gbps"])
    pair = report["pairs"]["tiny"]
    assert pair["target"] == "tiny_pair/target" and pair["draft"] == "tiny_pair/draft"
    assert pair["target_weight_bytes"] > pair["draft_weight_bytes"] > 0
    assert pair["target_weight_bytes_per_rank"] == pair["target_weight_bytes"]
    assert pair["logits_gather_bytes_per_row"] is None


def test_one_row_per_setting(report):
    """Per (B, decoding): the plain variants once, then the speculative ones per G."""
    keys = [(row["pair"], row["batch_size"], row["decoding"], row["num_drafts"], row["variant"])
            for row in report["rows"]]
    assert keys == [("tiny", batch, decoding, num_drafts, name)
                    for batch in BATCH_SIZES for decoding in DECODINGS
                    for num_drafts, names in [(None, PLAIN)] + [(g, SPECULATIVE)
                                                                for g in NUM_DRAFTS]
                    for name in names]


def test_rows_record_their_prompts(report):
    for row in report["rows"]:
        prompts = row["prompts"]
        assert prompts["source"] == "code_edit"
        # Row 0 is cut to PROMPT_LENGTH; row 1 is shorter (left padded in the batch).
        assert prompts["truncated"] == 1
        if row["batch_size"] == 1:
            assert prompts["mean_tokens"] == PROMPT_LENGTH
        else:
            assert 100 < prompts["mean_tokens"] < PROMPT_LENGTH


def test_skipped_rows_say_why(report):
    skipped = {key: row for key, row in _rows(report).items() if row["status"] != "ok"}
    # No compile on CPU; stock assisted generation and prompt lookup refuse batches.
    assert set(skipped) == (
        {(batch, decoding, None, "hf_static_compile")
         for batch in BATCH_SIZES for decoding in DECODINGS}
        | {(2, decoding, num_drafts, name) for decoding in DECODINGS for num_drafts in NUM_DRAFTS
           for name in ("hf_assisted", "hf_lookup")})
    for row in skipped.values():
        assert row["status"].startswith("skipped: ")
        assert row["tok_s"] is None and row["seconds"] is None and row["first_call_seconds"] is None


def test_rows_that_ran(report):
    for row in report["rows"]:
        if row["status"] != "ok":
            continue
        assert _positive(row["tok_s"]) and all(map(_positive, row["seconds"]))
        assert _positive(row["first_call_seconds"])  # compilation and capture, on CUDA
        assert row["tok_s"] == pytest.approx(row["batch_size"] * NEW_TOKENS / row["seconds"][0])
        assert all(value is None or _positive(value) for value in row["ratio"].values())
        assert row["step_ms"] is None and row["expected_tok_s"] is None     # no graphs on CPU
        assert row["exchange"] is None                                        # one process
        plain = row["variant"] in ("hf", "flash_plain")
        assert _positive(row["weight_bandwidth_fraction"]) if plain else (
            row["weight_bandwidth_fraction"] is None)
        assert (row["num_drafts"] is None) is (row["variant"] in PLAIN)
        # fp32 on CPU: greedy flashspec, stock assisted, stock lookup and stock plain agree
        # token for token, padded rows too; sampled rows are not compared.
        expected = None if row["variant"] == "hf" or row["decoding"] == "sample" else True
        assert row["same_tokens_as_hf"] is expected


def test_ratios_match_twins_on_g(report):
    rows = _rows(report)
    for decoding in DECODINGS:
        hf = rows[1, decoding, None, "hf"]
        for num_drafts in NUM_DRAFTS:
            for fused, stock, materialized in [
                    ("flash_draft", "hf_assisted", "flash_draft_materialized"),
                    ("flash_lookup", "hf_lookup", "flash_lookup_materialized")]:
                row = rows[1, decoding, num_drafts, fused]
                assert row["ratio"]["vs_hf"] == pytest.approx(row["tok_s"] / hf["tok_s"])
                assert row["ratio"]["vs_stock_assisted"] == pytest.approx(
                    row["tok_s"] / rows[1, decoding, num_drafts, stock]["tok_s"])
                assert row["ratio"]["vs_materialized"] == pytest.approx(
                    row["tok_s"] / rows[1, decoding, num_drafts, materialized]["tok_s"])
                assert row["ratio"]["vs_hf_static_compile"] is None       # skipped on CPU
                assert rows[2, decoding, num_drafts, fused]["ratio"]["vs_stock_assisted"] is None


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
            assert len(stats["per_position_acceptance"]) <= row["num_drafts"]
            if row["variant"].startswith("flash_draft"):
                assert stats["drafted"] > 0 and 0 <= stats["acceptance_rate"] <= 1


def test_table_is_printed(report, capsys):
    tok_per_s_report.print_table(report)
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:4] == ["pair", "B", "dec", "G"] and "tok/s" in line
               for line in lines)
    assert any(line.split()[:5] == ["tiny", "2", "sample", "3", "hf_lookup"] and "skipped" in line
               for line in lines)
    assert any(line.split()[:5] == ["tiny", "1", "greedy", "-", "flash_plain"] for line in lines)


def small_config(folder, **fields):
    """A small random-init shape's config.json in `folder` (a one-layer Llama unless
    `fields` say otherwise); returns its path."""
    folder.mkdir()
    path = folder / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, **fields}))
    return path


def test_random_init_without_a_draft(tmp_path, capsys):
    """A config.json path as the target shape, no draft shape: the draft variants are
    skipped, the others run; each row goes to stderr as a JSON line when measured."""
    config = small_config(tmp_path / "small")
    out = tmp_path / "out"
    assert tok_per_s.main(["--random-init", str(config), "--batch-sizes", "1", "--new-tokens",
                           "4", "--prompt-length", "8", "--reps", "1", "--device", "cpu",
                           "--weights", "peaked", "--variants", "hf,flash_self,flash_draft",
                           "--out", str(out)]) == 0
    report = json.loads((out / "tok_per_s.json").read_text())
    assert report["pairs"] == {"small": {
        "target": str(Path(*config.parts[-2:])), "draft": None,
        "weights": "random init, peaked (flashspec.bench.random_init.peak_weights)",
        "vocab_size": 512, "gpus": 1, "device_map": None,
        "target_weight_bytes": report["pairs"]["small"]["target_weight_bytes"],
        "draft_weight_bytes": None,
        "target_weight_bytes_per_rank": report["pairs"]["small"]["target_weight_bytes"],
        "logits_gather_bytes_per_row": None}}
    status = {row["variant"]: row["status"] for row in report["rows"]}
    assert status["hf"] == status["flash_self"] == "ok"
    assert status["flash_draft"].startswith("skipped: no draft model")
    assert report["prompts"]["source"] == "random"
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()
             if line.startswith("{")]
    assert [line["variant"] for line in lines] == ["hf", "flash_self", "flash_draft"]


# Under torchrun: a 1-layer Llama (heads and vocabulary divisible by 2: transformers'
# colwise_gather_output LM head needs it), split over 2 gloo ranks; the draft replicated.
TP_CONFIG = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": False}
TP_BATCH_SIZES, TP_NEW_TOKENS = [1, 2], 4
TP_STOCK = ["hf", "hf_static_compile", "hf_assisted", "hf_lookup"]
TP_FLASH = ["flash_plain", "flash_self", "flash_draft", "flash_draft_materialized",
            "flash_lookup"]
TORCHRUN_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory):
    """The script under torchrun, 2 ranks on CPU: (stdout, report, the temporary folder the
    ranks ran with)."""
    root = tmp_path_factory.mktemp("tok_per_s_tp")
    config = root / "tp" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(TP_CONFIG))
    temp, out = root / "tmp", root / "out"
    temp.mkdir()
    repository = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TMPDIR": str(temp), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(repository),
                                                       os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", str(repository / "scripts" / "tok_per_s.py"),
               "--random-init", f"{config},{config}",
               "--batch-sizes", ",".join(map(str, TP_BATCH_SIZES)),
               "--new-tokens", str(TP_NEW_TOKENS), "--prompt-length", "8", "--num-drafts", "2",
               "--decoding", "greedy,sample", "--reps", "1", "--device", "cpu",
               "--variants", ",".join(TP_STOCK + TP_FLASH), "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False,
                          timeout=TORCHRUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads((out / "tok_per_s.json").read_text()), temp


def test_torchrun_report_header(torchrun_run):
    stdout, report, temp = torchrun_run
    assert (report["world_size"], report["backend"]) == (2, "gloo")
    pair = report["pairs"]["tp"]
    assert pair["logits_gather_bytes_per_row"] == 512 // 2 * 4            # fp32 logits
    assert 0 < pair["target_weight_bytes_per_rank"] < pair["target_weight_bytes"]
    assert pair["draft_weight_bytes"] == pair["target_weight_bytes"]      # replicated
    assert not list(temp.glob("flashspec_*"))   # the random-init models' folder is deleted
    # Rank 0 alone writes and prints.
    written = [line for line in stdout.splitlines() if line.startswith("wrote ")]
    assert written and written[0].endswith("tok_per_s.json"), stdout   # the plot follows
    assert len(written) == len(set(written)) and "cpu, 2 ranks (gloo)" in stdout
    assert any(line.split()[:5] == ["tp", "2", "greedy", "-", "flash_plain"]
               and line.split()[-2] == "16.0" for line in stdout.splitlines()), stdout


def test_torchrun_rows(torchrun_run):
    _, report, _ = torchrun_run
    rows = {(row["batch_size"], row["decoding"], row["variant"]): row for row in report["rows"]}
    assert set(rows) == {(batch, decoding, name) for batch in TP_BATCH_SIZES
                         for decoding in DECODINGS for name in TP_STOCK + TP_FLASH}
    for (batch, decoding, name), row in rows.items():
        if name in ("hf_static_compile", "flash_draft_materialized"):
            assert row["status"].startswith("skipped: ") and "tensor-parallel" in row["status"]
            continue
        if batch > 1 and name in ("hf_assisted", "hf_lookup"):
            assert row["status"].startswith("skipped: stock assisted generation")
            continue
        assert row["status"] == "ok" and _positive(row["tok_s"])
        # fp32: greedy flash rows (and stock assisted, lookup) give stock TP generate's tokens.
        assert row["same_tokens_as_hf"] is (
            None if name == "hf" or decoding == "sample" else True)
        exchange = row["exchange"]
        if name in TP_STOCK:
            assert exchange is None            # stock gathers the logits instead
            continue
        if batch == 1 and name in ("flash_draft", "flash_lookup"):
            assert _positive(row["ratio"]["vs_stock_assisted"])
        assert exchange["bytes"] == exchange["summary_bytes"] > 0
        assert exchange["rows_retried"] == exchange["rows_completed"] == 0
        assert exchange["bytes_per_step"] == exchange["bytes"] / exchange["calls"]
        assert exchange["bytes_per_row_per_step"] == exchange["bytes"] / exchange["rows"]


@pytest.mark.parametrize("decoding, sample_bytes", [
    ("greedy", 16),
    # top-k 20: the rows send max(32, 20 + 1) candidate keys of 8 bytes after their 16, and
    # the keys' floor.
    ("sample", 16 + 32 * 8 + 8)])
def test_torchrun_plain_steps_send_the_sample_summary(torchrun_run, decoding, sample_bytes):
    """One exchange per generated token (the prefill's included), each the `sample` summary
    of every row."""
    _, report, _ = torchrun_run
    for batch in TP_BATCH_SIZES:
        (row,) = [row for row in report["rows"] if (row["batch_size"], row["decoding"],
                                                    row["variant"]) == (batch, decoding,
                                                                        "flash_plain")]
        exchange = row["exchange"]
        assert exchange["summary_bytes_per_row"] == {"argmax": 8, "sample": sample_bytes,
                                                     "verify": sample_bytes + 4}
        assert (exchange["calls"], exchange["rows"]) == (TP_NEW_TOKENS, TP_NEW_TOKENS * batch)
        assert exchange["bytes_per_row_per_step"] == sample_bytes
        assert exchange["bytes_per_step"] == sample_bytes * batch


def test_torchrun_stops_every_rank_when_rank_0_cannot_build_the_models(tmp_path):
    """Rank 0 builds the random-init models for all ranks: when it fails, every rank stops
    with its error at once, instead of waiting for it in a collective."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(TP_CONFIG, hidden_size=-64)))
    repository = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(repository),
                                                       os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", str(repository / "scripts" / "tok_per_s.py"),
               "--random-init", str(config), "--batch-sizes", "1", "--new-tokens", "2",
               "--prompt-length", "4", "--reps", "1", "--device", "cpu", "--variants", "hf",
               "--out", str(tmp_path / "out")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False,
                          timeout=TORCHRUN_TIMEOUT_S)
    assert done.returncode != 0
    assert "rank 0 could not build the random-init models" in done.stderr, done.stderr[-3000:]


def test_tp_same_tokens_under_torchrun(tmp_path):
    """scripts/tp_same_tokens.py (on GPUs: a tensor-parallel Llama-3.1-8B against one GPU) on
    2 gloo ranks: a tiny Llama split over the ranks gives its whole self's tokens in every
    case, and the report says so."""
    config = tmp_path / "tp" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(TP_CONFIG))
    repository = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(repository),
                                                       os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "tokens.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", str(repository / "scripts" / "tp_same_tokens.py"),
               "--random-init", f"{config},{config}", "--device", "cpu", "--dtype", "fp32",
               "--batch-size", "2", "--prompt-length", "8", "--new-tokens", "6",
               "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False,
                          timeout=TORCHRUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ranks"] == 2 and report["device"] == "cpu"
    assert sorted(report["cases"]) == sorted(
        f"{decoding}, {how}" for decoding in ("greedy", "seeded")
        for how in ("plain", "prompt lookup", "assistant"))
    for name, case in [*report["cases"].items(), ("stock greedy", report["stock greedy"])]:
        assert case == {"same": True, "first_difference": [None, None]}, name
        assert f"{name:>24}: same" in done.stdout


def test_first_difference_per_row():
    from flashspec.bench.parallel_tokens import first_difference
    a = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 5, 6]])
    b = torch.tensor([[1, 2, 3], [1, 5, 3], [0, 5, 0]])
    assert first_difference(a, b) == [None, 1, 0]


def test_random_init_mtp_and_eagle3_rows(tmp_path):
    """A random-init target whose config has MTP layers gets random ones (flash_mtp runs,
    greedy tokens stock's); without --eagle3 the EAGLE-3 row is skipped, saying why; a target
    without MTP layers skips flash_mtp."""
    config = small_config(tmp_path / "glm", model_type="glm4_moe", moe_intermediate_size=32,
                          n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                          first_k_dense_replace=1, num_hidden_layers=2,
                          num_nextn_predict_layers=1)
    out = tmp_path / "out"
    assert tok_per_s.main(["--random-init", str(config), "--batch-sizes", "1,2", "--new-tokens",
                           "6", "--prompt-length", "8", "--reps", "1", "--device", "cpu",
                           "--num-drafts", "2", "--variants", "hf,flash_mtp,flash_eagle3",
                           "--out", str(out)]) == 0
    rows = json.loads((out / "tok_per_s.json").read_text())["rows"]
    mtp = [row for row in rows if row["variant"] == "flash_mtp"]
    assert [row["status"] for row in mtp] == ["ok", "ok"]
    assert all(row["same_tokens_as_hf"] for row in mtp)
    assert all(row["flash_stats"]["drafted"] > 0 for row in mtp)
    eagle3 = [row for row in rows if row["variant"] == "flash_eagle3"]
    assert all(row["status"] == "skipped: no EAGLE-3 head (give --eagle3)" for row in eagle3)
    llama = small_config(tmp_path / "small")
    assert tok_per_s.main(["--random-init", str(llama), "--batch-sizes", "1", "--new-tokens",
                           "4", "--prompt-length", "8", "--reps", "1", "--device", "cpu",
                           "--variants", "flash_mtp", "--out", str(out)]) == 0
    row, = json.loads((out / "tok_per_s.json").read_text())["rows"]
    assert row["status"].startswith("skipped: the target has no MTP layers")
