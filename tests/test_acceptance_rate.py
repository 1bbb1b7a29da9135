"""scripts/acceptance_rate.py and its library (flashspec.bench: acceptance,
acceptance_runs, acceptance_report): the command line's refusals, the statistics against values
computed by hand, and tiny CPU runs (built-in pair, fp32; a random-init model with the
self and lookup drafters) with their JSON and CSV schema."""

import csv
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from flashspec.assets import tiny_pair_path
from flashspec.bench import acceptance, acceptance_report, acceptance_runs, cli
from flashspec.generation.outputs import SpeculationStats

from script_module import load_script

TINY_TARGET = str(tiny_pair_path() / "target")
TINY_DRAFT = str(tiny_pair_path() / "draft")
# A random-init shape small enough for CPU tests, whose vocabulary holds the tiny pair's
# tokenizer (8192 tokens).
SMALL_LLAMA = {"model_type": "llama", "vocab_size": 8192, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
               "num_key_value_heads": 1, "head_dim": 32}


acceptance_rate = load_script("acceptance_rate")


@pytest.mark.parametrize("args, option", [
    (["--num-drafts", "0"], "--num-drafts"),
    (["--num-drafts", "2,x"], "--num-drafts"),
    (["--drafter", "assistant,oracle"], "--drafter"),
    (["--prompt-set", "chat,poetry"], "--prompt-set"),
    (["--prompts", "0"], "--prompts"),
    (["--batch-size", "-1"], "--batch-size"),
    (["--max-prompt-tokens", "0"], "--max-prompt-tokens"),
    (["--new-tokens", "0"], "--new-tokens"),
    (["--max-matching-ngram-size", "0"], "--max-matching-ngram-size"),
    (["--sample", "--temperature", "0"], "--temperature"),
    (["--sample", "--temperature", "nan"], "--temperature"),
    (["--sample", "--top-k", "-1"], "--top-k"),
    (["--sample", "--top-p", "0"], "--top-p"),
    (["--sample", "--top-p", "1.5"], "--top-p"),
    (["--sample", "--min-p", "-0.1"], "--min-p"),
    (["--temperature", "0.7"], "--temperature"),          # sampling options need --sample
    (["--top-k", "5"], "--top-k"),
    (["--seed", "-1"], "--seed"),
    (["--dtype", "int8"], "--dtype"),
    (["--device", "tpu"], "--device"),
    (["--target", "Qwen/Qwen3-8B"], "--draft"),         # the tiny draft fits only the tiny target
    (["--drafter", "self,oracle"], "--drafter"),
    (["--target", "Qwen/Qwen3-8B", "--drafter", "eagle3"], "--eagle3"),   # the tiny head fits one target
    (["--random-init", "qwen3-0.6b", "--drafter", "eagle3"], "--drafter eagle3"),
    (["--random-init", "qwen9-1b"], "--random-init"),
    (["--random-init", "qwen3-1.7b,qwen3-0.6b,qwen3-0.6b"], "--random-init"),
    (["--random-init", "qwen3-0.6b", "--target", TINY_TARGET], "--random-init"),
    (["--random-init", "qwen3-0.6b", "--drafter", "self", "--draft", TINY_DRAFT], "--draft"),
    (["--random-init", "qwen3-0.6b", "--drafter", "assistant"], "--drafter assistant"),
    (["--random-init", "qwen3-0.6b"], "--drafter assistant"),      # the default has assistant
    (["--weights", "sharp"], "--weights"),
    (["--weights", "peaked"], "--weights"),                        # the tiny pair is trained
    (["--target", TINY_TARGET, "--drafter", "lookup", "--weights", "peaked"], "--weights"),
    (["--tokenizer", "/nonexistent/tokenizer"], "--tokenizer"),
    (["--target", "/nonexistent/model", "--drafter", "lookup"], "--target"),
])
def test_bad_arguments_exit_2_naming_the_option(args, option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        acceptance_rate.main(args)
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_without_a_device_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        acceptance_rate.main(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device cuda" in capsys.readouterr().err


def _small_config(tmp_path, **changes) -> str:
    path = tmp_path / "small" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({**SMALL_LLAMA, **changes}))
    return str(path)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, capsys):
    shape = _small_config(tmp_path, vocab_size=4096)
    with pytest.raises(SystemExit) as exit_info:
        acceptance_rate.main(["--random-init", shape, "--drafter", "self", "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {TINY_TARGET}: its 8192 tokens" in err
    assert "vocab_size is 4096" in err and "at most 4096 tokens" in err


def test_model_defaults():
    args = acceptance_rate.parse_args([])
    assert (args.target, args.draft, args.tokenizer) == (TINY_TARGET, TINY_DRAFT, TINY_TARGET)
    assert args.drafter == ["assistant", "lookup", "eagle3"] and args.weights == "random"
    assert args.eagle3 == str(Path(TINY_TARGET).parent / "eagle3")
    assert args.random_init is None and not args.ignore_eos
    args = acceptance_rate.parse_args(["--target", TINY_TARGET, "--drafter", "self"])
    assert (args.draft, args.tokenizer) == (None, TINY_TARGET)


def test_random_init_shapes_become_the_models_with_the_tiny_tokenizer_and_eos_off():
    args = acceptance_rate.parse_args(["--random-init", "qwen3-1.7b,qwen3-0.6b", "--drafter",
                                       "lookup,self,assistant", "--weights", "peaked"])
    assert (args.target, args.draft, args.tokenizer) == ("qwen3-1.7b", "qwen3-0.6b", TINY_TARGET)
    assert args.drafter == ["assistant", "self", "lookup"]
    assert args.ignore_eos
    args = acceptance_rate.parse_args(["--random-init", "qwen3-0.6b", "--drafter", "self"])
    assert (args.target, args.draft) == ("qwen3-0.6b", None)


def test_peaked_random_models(tmp_path):
    args = acceptance_rate.parse_args(["--random-init", _small_config(tmp_path),
                                       "--drafter", "self", "--weights", "peaked"])
    target, draft = acceptance_runs.load_models(args, "cpu", torch.float32)
    assert draft is None and target.generation_config.eos_token_id is None
    assert torch.equal(target.get_output_embeddings().weight,
                       target.get_input_embeddings().weight)


def test_lists_are_parsed_in_a_fixed_order_without_repeats():
    args = acceptance_rate.parse_args(["--num-drafts", "4,1,4", "--drafter", "lookup,assistant",
                                       "--prompt-set", "chat,code_edit", "--sample",
                                       "--top-k", "0"])
    assert args.num_drafts == [1, 4]
    assert args.drafter == ["assistant", "lookup"]
    assert args.prompt_set == ["code_edit", "chat"]
    assert (args.temperature, args.top_k, args.top_p, args.min_p) == (0.6, 0, 0.95, 0.0)


# ---------------------------------------------------------------- statistics by hand


def _hand_stats() -> SpeculationStats:
    """2 steps x 2 rows, G = 2. Step 1: row 0 accepts 1 of 2 drafts, row 1 both; step 2:
    row 0 accepts none of 2, row 1 decodes plainly (no drafts, one token)."""
    return SpeculationStats(
        drafted=torch.tensor([[2, 2], [2, 0]]),
        accepted=torch.tensor([[1, 2], [0, 0]]),
        emitted=torch.tensor([[2, 3], [1, 1]]),
        accept_probs=torch.tensor([[[0.5, 0.4], [0.9, 0.8]], [[0.2, 0.7], [0.0, 0.0]]],
                                  dtype=torch.float64))


def test_positions_by_hand():
    positions = acceptance.position_statistics(_hand_stats(), 2)
    assert positions["proposed"] == [3, 3]
    assert positions["reached"] == [3, 2]                  # position 2 needs position 1 accepted
    assert positions["alpha"] == pytest.approx([2 / 3, 1 / 2])
    assert positions["alpha_expected"] == pytest.approx([(0.5 + 0.9 + 0.2) / 3, (0.4 + 0.8) / 2])
    # sqrt(sum p(1 - p)) / n over the verifications that reached the position
    assert positions["alpha_stderr"] == pytest.approx([math.sqrt(0.25 + 0.09 + 0.16) / 3,
                                                       math.sqrt(0.24 + 0.16) / 2])
    assert positions["alpha_z"] == pytest.approx([(2 / 3 - 1.6 / 3) / (math.sqrt(0.5) / 3),
                                                  (0.5 - 0.6) / (math.sqrt(0.4) / 2)])
    assert positions["alpha_agrees"] == [True, True]
    assert positions["accepted_of_proposed"] == pytest.approx([2 / 3, 1 / 3])
    # mean p_1 ... p_i over the verifications that proposed position i
    assert positions["accepted_of_proposed_expected"] == pytest.approx(
        [(0.5 + 0.9 + 0.2) / 3, (0.5 * 0.4 + 0.9 * 0.8 + 0.2 * 0.7) / 3])


def test_unreached_positions_are_null():
    stats = _hand_stats()
    positions = acceptance.position_statistics(stats, 4)     # G wider than any draft
    assert positions["proposed"] == [3, 3, 0, 0] and positions["reached"] == [3, 2, 0, 0]
    for key in ("alpha", "alpha_expected", "alpha_stderr", "alpha_z", "alpha_agrees",
                "accepted_of_proposed", "accepted_of_proposed_expected"):
        assert positions[key][2:] == [None, None]


def test_accepted_length_distribution_by_hand():
    lengths = acceptance.accepted_length_distribution(_hand_stats(), 2)
    assert lengths["counts"] == [1, 1, 1]
    # P(A = k) = q_k - q_{k+1}, q = (1, p1, p1 p2, 0): (.5 .3 .2) + (.1 .18 .72) + (.8 .06 .14)
    assert lengths["expected"] == pytest.approx([1.4, 0.54, 1.06])


def test_summary_by_hand():
    summary = acceptance.acceptance_summary(_hand_stats(), 2)
    assert (summary["forwards"], summary["verifications"]) == (4, 3)
    assert (summary["drafted"], summary["accepted"]) == (6, 3)
    assert summary["acceptance_rate"] == pytest.approx(0.5)
    assert summary["accepted_per_verification"] == pytest.approx(1.0)
    assert summary["tokens_per_verification"] == pytest.approx((2 + 3 + 1) / 3)
    assert summary["tokens_per_forward"] == pytest.approx(7 / 4)
    check = summary["expected_accepted"]
    # E[A] = q1 + q2; Var = q1 + 3 q2 - E[A]^2, per verification, summed.
    means = [0.5 + 0.2, 0.9 + 0.72, 0.2 + 0.14]
    variances = [0.5 + 3 * 0.2 - 0.7 ** 2, 0.9 + 3 * 0.72 - 1.62 ** 2, 0.2 + 3 * 0.14 - 0.34 ** 2]
    assert check["realised"] == 3
    assert check["mean"] == pytest.approx(sum(means))
    assert check["std"] == pytest.approx(math.sqrt(sum(variances)))
    assert check["z"] == pytest.approx((3 - sum(means)) / math.sqrt(sum(variances)))
    assert check["agrees"] is True


@pytest.mark.parametrize("realised, mean, std, z, agrees", [
    (12.0, 10.0, 1.0, 2.0, True),
    (6.5, 10.0, 1.0, -3.5, False),
    (10.0, 10.0, 0.0, None, True),       # greedy: p(x) is 0 or 1, so realised is exact
    (11.0, 10.0, 0.0, None, False),
])
def test_agreement(realised, mean, std, z, agrees):
    expected_z = pytest.approx(z) if z is not None else None
    assert acceptance.agreement(realised, mean, std) == (expected_z, agrees)


def test_merge_pads_shorter_runs_with_idle_steps_and_narrower_drafts_with_zeros():
    row_0 = SpeculationStats(drafted=torch.tensor([[2], [2]]), accepted=torch.tensor([[1], [0]]),
                             emitted=torch.tensor([[2], [1]]),
                             accept_probs=torch.tensor([[[0.5, 0.4]], [[0.2, 0.7]]],
                                                       dtype=torch.float64))
    row_1 = SpeculationStats(drafted=torch.tensor([[1]]), accepted=torch.tensor([[1]]),
                             emitted=torch.tensor([[2]]),
                             accept_probs=torch.tensor([[[0.9]]], dtype=torch.float64))
    merged = acceptance.merge_stats([row_0, row_1])
    assert merged.drafted.tolist() == [[2, 1], [2, 0]]
    assert merged.accepted.tolist() == [[1, 1], [0, 0]]
    assert merged.emitted.tolist() == [[2, 2], [1, 0]]
    assert merged.accept_probs.tolist() == [[[0.5, 0.4], [0.9, 0.0]], [[0.2, 0.7], [0.0, 0.0]]]
    assert merged.expected_accepted()[0] == pytest.approx(0.5 + 0.5 * 0.4 + 0.2 + 0.2 * 0.7 + 0.9)


# ---------------------------------------------------------------- end to end

NEW_TOKENS = 6
RUN_ARGS = ["--prompt-set", "code_edit,chat", "--prompts", "3", "--batch-size", "2",
            "--num-drafts", "1,3", "--new-tokens", str(NEW_TOKENS), "--max-prompt-tokens", "48",
            "--dtype", "fp32", "--device", "cpu"]


@pytest.fixture(scope="module")
def greedy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("greedy")
    assert acceptance_rate.main(RUN_ARGS + ["--out", str(out)]) == 0
    return out


def test_report_schema(greedy_run):
    report = json.loads((greedy_run / "acceptance_rate.json").read_text())
    assert set(report) == {"device", "versions", "date", "args", "models", "dtype", "sampling",
                           "z_limit", "prompt_sets", "rows"}
    assert report["models"] == {"target": "tiny_pair/target", "draft": "tiny_pair/draft",
                                "eagle3": "tiny_pair/eagle3", "weights": "trained",
                                "vocab_size": 8192,
                                "tokenizer": "tiny_pair/target", "tokenizer_size": 8192}
    assert report["device"] == "cpu" and report["dtype"] == "float32"
    assert {"torch", "transformers", "triton"} <= set(report["versions"])
    assert report["sampling"] == {"do_sample": False}
    assert set(report["prompt_sets"]) == {"code_edit", "chat"}
    for description in report["prompt_sets"].values():
        assert description["prompts"] == 3 and len(description["ids"]) == 3
        assert isinstance(description["truncated"], int)
        assert description["max_prompt_tokens"] <= 48
    rows = report["rows"]
    assert [(r["drafter"], r["prompt_set"], r["num_drafts"]) for r in rows] == [
        (d, s, g) for d in ("assistant", "lookup", "eagle3") for s in ("code_edit", "chat")
        for g in (1, 3)]
    for row in rows:
        g = row["num_drafts"]
        for key in ("prompts", "generated_tokens", "forwards", "verifications", "drafted",
                    "accepted"):
            assert isinstance(row[key], int), key
        for key in ("seconds", "accepted_per_verification", "tokens_per_verification",
                    "tokens_per_forward"):
            assert isinstance(row[key], float), key
        assert 0 < row["generated_tokens"] <= 3 * NEW_TOKENS
        assert 0 <= row["accepted_per_verification"] <= g
        assert set(row["expected_accepted"]) == {"realised", "mean", "std", "z", "agrees"}
        positions = row["positions"]
        assert all(len(values) == g for values in positions.values())
        assert sum(row["accepted_length"]["counts"]) == row["verifications"]
        assert len(row["accepted_length"]["expected"]) == g + 1


def test_greedy_acceptance_is_exactly_as_expected(greedy_run):
    """Greedy p(x) is 1 for the target's argmax and 0 otherwise: no sampling error."""
    for row in json.loads((greedy_run / "acceptance_rate.json").read_text())["rows"]:
        check = row["expected_accepted"]
        assert check["std"] == 0 and check["z"] is None and check["agrees"]
        assert check["mean"] == pytest.approx(row["accepted"])
        assert row["accepted_length"]["expected"] == pytest.approx(row["accepted_length"]["counts"])
        positions = row["positions"]
        for realised, expected in [*zip(positions["alpha"], positions["alpha_expected"]),
                                   *zip(positions["accepted_of_proposed"],
                                        positions["accepted_of_proposed_expected"])]:
            assert realised == pytest.approx(expected) if realised is not None else expected is None


def test_csv_header_and_rows(greedy_run):
    with (greedy_run / "acceptance_rate.csv").open() as handle:
        reader = csv.DictReader(handle)
        lines = list(reader)
    assert reader.fieldnames == [*acceptance_report.CSV_ROW_COLUMNS,
                                 *acceptance_report.CSV_CHECK_COLUMNS,
                                 "alpha_1", "alpha_2", "alpha_3",
                                 "alpha_expected_1", "alpha_expected_2", "alpha_expected_3"]
    assert len(lines) == 12
    assert all(line["alpha_2"] == "" for line in lines if line["num_drafts"] == "1")


def test_plot_is_written(greedy_run):
    pytest.importorskip("matplotlib")
    assert (greedy_run / "acceptance_rate.png").stat().st_size > 0


def test_sampled_run_agrees_with_p_x_and_prints_the_table(tmp_path, capsys):
    """Enough sampled verifications (seeded, so deterministic) that the realised acceptance
    must sit within a few standard errors of what p(x) predicts, in total and per position."""
    args = ["--drafter", "assistant", "--prompt-set", "chat", "--prompts", "8",
            "--batch-size", "8", "--num-drafts", "3", "--new-tokens", "40", "--dtype", "fp32",
            "--device", "cpu", "--sample", "--temperature", "1.0", "--top-k", "0",
            "--top-p", "0.9", "--out", str(tmp_path)]
    assert acceptance_rate.main(args) == 0
    report = json.loads((tmp_path / "acceptance_rate.json").read_text())
    assert report["sampling"] == {"do_sample": True, "temperature": 1.0, "top_k": 0,
                                  "top_p": 0.9, "min_p": 0.0}
    [row] = report["rows"]
    check, positions = row["expected_accepted"], row["positions"]
    assert check["std"] > 0 and check["agrees"]
    for reached, z in zip(positions["reached"], positions["alpha_z"]):
        assert reached < 20 or abs(z) <= 4, positions
    for realised, expected in zip(positions["accepted_of_proposed"],
                                  positions["accepted_of_proposed_expected"]):
        assert abs(realised - expected) < 0.1, positions
    out = capsys.readouterr().out
    table = out[out.index("drafter "):].splitlines()
    assert table[1].startswith("assistant chat        3")


def test_missing_matplotlib_and_tqdm_are_said_and_survived(greedy_run, tmp_path, monkeypatch,
                                                           capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import fails
    report = json.loads((greedy_run / "acceptance_rate.json").read_text())
    acceptance_report.write_plot(report, tmp_path / "x.png")
    assert "no plot" in capsys.readouterr().out and not (tmp_path / "x.png").exists()
    monkeypatch.setitem(sys.modules, "tqdm", None)
    progress = cli.Progress(2)
    progress.start("lookup chat G=1")
    progress.finish()
    progress.close()
    assert "[1/2] lookup chat G=1" in capsys.readouterr().err


# ---------------------------------------------------------------- random init, self-drafting

RANDOM_NEW_TOKENS = 40
RANDOM_PROMPTS = 8


def test_random_init_sampled_self_and_lookup_agree_with_p_x(tmp_path, capsys):
    """A random-init target (config.json path, no draft shape), prompts by the tiny pair's
    tokenizer, EOS off: every row generates exactly --new-tokens, and both drafters' realised
    acceptance agrees with p(x) (a self-draft's p(x) is the target's probability of its own
    argmax: strictly between 0 and 1 when sampling a flat random model)."""
    shape = _small_config(tmp_path)
    out = tmp_path / "out"
    assert acceptance_rate.main([
        "--random-init", shape, "--drafter", "self,lookup", "--sample", "--prompt-set", "chat",
        "--prompts", str(RANDOM_PROMPTS), "--batch-size", str(RANDOM_PROMPTS),
        "--num-drafts", "3", "--new-tokens", str(RANDOM_NEW_TOKENS), "--max-prompt-tokens", "48",
        "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads((out / "acceptance_rate.json").read_text())
    assert report["models"] == {"target": "small/config.json", "draft": None, "eagle3": None,
                                "weights": "random init", "vocab_size": 8192,
                                "tokenizer": "tiny_pair/target", "tokenizer_size": 8192}
    assert report["args"]["random_init"] == [shape] and report["args"]["ignore_eos"]
    assert report["dtype"] == "float32"
    assert [(row["drafter"], row["num_drafts"]) for row in report["rows"]] == [
        ("self", 3), ("lookup", 3)]
    for row in report["rows"]:
        assert row["generated_tokens"] == RANDOM_PROMPTS * RANDOM_NEW_TOKENS
        check = row["expected_accepted"]
        assert check["agrees"] and abs(check["z"]) <= acceptance.Z_LIMIT, row
    self_row = report["rows"][0]
    assert self_row["verifications"] > 100
    assert 0 < self_row["positions"]["alpha_expected"][0] < 1
    out = capsys.readouterr().out
    assert "target small/config.json, draft -; random init; prompts by the tokenizer " \
           "tiny_pair/target on cpu" in out


def test_random_init_greedy_self_drafts_accept_exactly_what_p_x_says(tmp_path):
    """Greedy: a self-draft is the target's argmax of the draft forward; p(x) is 1 when the
    verification forward agrees (it may not at near-ties), else 0, so realised = expected."""
    out = tmp_path / "out"
    assert acceptance_rate.main([
        "--random-init", _small_config(tmp_path), "--drafter", "self", "--prompt-set",
        "code_edit", "--prompts", "4", "--batch-size", "4", "--num-drafts", "4",
        "--new-tokens", "24", "--max-prompt-tokens", "48", "--device", "cpu",
        "--out", str(out)]) == 0
    [row] = json.loads((out / "acceptance_rate.json").read_text())["rows"]
    check = row["expected_accepted"]
    assert row["drafted"] > 0 and row["accepted"] > 0
    assert check["std"] == 0 and check["agrees"] and check["mean"] == pytest.approx(row["accepted"])
    assert row["accepted_length"]["expected"] == pytest.approx(row["accepted_length"]["counts"])
