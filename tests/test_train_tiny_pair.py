"""scripts/train_tiny_pair.py: a CPU smoke run (tiny models, a little data, a few steps) whose
folders load offline with AutoModelForCausalLM / AutoTokenizer, its card and JSON, the data
split and the speculation arithmetic, and the command line's refusals."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import flashspec.assets

from script_module import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_tiny_pair.py"

SMOKE_ARGS = [
    "--device", "cpu", "--max-train-chars", "100000", "--vocab-size", "512",
    "--seq-len", "32", "--batch-size", "4", "--steps", "8",
    "--target-layers", "2", "--target-hidden", "32", "--target-heads", "2",
    "--target-kv-heads", "1", "--target-ffn", "64",
    "--draft-layers", "1", "--draft-hidden", "32", "--draft-heads", "2",
    "--draft-kv-heads", "1", "--draft-ffn", "64",
    "--max-eval-tokens", "2048", "--spec-prompts", "3", "--spec-new-tokens", "12",
]

CODE = ('def fib(n: int) -> int:\n    """Fibonacci, naïvely."""\n\tif n < 2:  \n'
        "        return n\r\n    return fib(n - 1) + fib(n - 2)  # → ok ✓\n\n")


ttp = load_script("train_tiny_pair")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(output folder, returned summary, stdout) of one tiny CPU run."""
    out = tmp_path_factory.mktemp("tiny_pair")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        summary = ttp.main([*SMOKE_ARGS, "--out", str(out)])
    return out, summary, stdout.getvalue()


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1, also in huggingface_hub's constant (read once at import)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


# ---------------------------------------------------------------- the smoke run


def test_writes_both_folders_card_and_json(smoke):
    out, summary, _ = smoke
    for name in ("target", "draft"):
        files = {p.name for p in (out / name).iterdir()}
        assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json"} <= files
    assert (out / "MODEL_CARD.md").is_file()
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))


def test_summary_is_printed_last(smoke):
    _, summary, stdout = smoke
    lines = stdout.rstrip().splitlines()
    assert lines[-1].startswith("summary: held-out perplexity target")
    assert f"uniform {summary['tokenizer']['vocab_size']}" in lines[-1]
    progress = [line for line in lines if line.startswith("[target] step 8/8")]
    assert progress and "tok/s" in progress[0] and "loss" in progress[0]


def test_models_and_tokenizer_load_offline(smoke, offline):
    out, summary, _ = smoke
    vocab = summary["tokenizer"]["vocab_size"]
    eos = summary["tokenizer"]["eos_token_id"]
    tokenizers, models = {}, {}
    for name in ("target", "draft"):
        tokenizers[name] = AutoTokenizer.from_pretrained(out / name)
        models[name] = AutoModelForCausalLM.from_pretrained(out / name)
        model, tokenizer = models[name], tokenizers[name]
        assert model.dtype == torch.bfloat16
        assert model.config.model_type == "llama"
        assert model.config.vocab_size == vocab == len(tokenizer)
        assert model.config.tie_word_embeddings
        assert (model.config.eos_token_id, model.config.pad_token_id) == (eos, eos)
        assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) \
            == (eos, eos)
        assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (eos, eos)
        assert tokenizer.eos_token == "<|endoftext|>"
        assert tokenizer.padding_side == "left"
        assert model.num_parameters() == summary["models"][name]["parameters"]
    assert tokenizers["target"].get_vocab() == tokenizers["draft"].get_vocab()
    assert models["draft"].generation_config.num_assistant_tokens == ttp.SPEC_DRAFT_TOKENS
    assert models["target"].config.num_hidden_layers == 2
    assert models["draft"].config.num_hidden_layers == 1

    batch = tokenizers["target"](["def f(x):", "import os\n"], return_tensors="pt",
                                 padding=True)
    out_ids = models["target"].generate(**batch, max_new_tokens=3, do_sample=False)
    assert out_ids.shape[0] == 2 and out_ids.shape[1] <= batch["input_ids"].shape[1] + 3


def test_tokenizer_round_trips_code(smoke, offline):
    out, summary, _ = smoke
    tokenizer = AutoTokenizer.from_pretrained(out / "target")
    ids = tokenizer(CODE)["input_ids"]
    assert summary["tokenizer"]["eos_token_id"] not in ids      # nothing added when encoding
    assert tokenizer.decode(ids) == CODE
    assert tokenizer("<|endoftext|>")["input_ids"] == [tokenizer.eos_token_id]


def test_card_reports_what_was_measured(smoke):
    out, summary, _ = smoke
    card = (out / "MODEL_CARD.md").read_text()
    for section in ("## Data", "## Tokenizer", "## Models", "## Training", "## Held-out results"):
        assert section in card
    held = summary["heldout"]
    assert f"| target | {held['target_ppl']:.2f} |" in card
    assert f"| draft | {held['draft_ppl']:.2f} |" in card
    assert f"| uniform over the vocabulary | {held['uniform_ppl']:,} |" in card
    assert summary["command"] in card
    assert summary["command"].startswith("python scripts/train_tiny_pair.py --device cpu")
    assert f"CPython {summary['data']['python_version']}" in card
    assert f"{summary['data']['files']['train']} train files" in card
    assert f"{summary['models']['target']['parameters']:,}" in card
    assert "Greedy agreement" in card and summary["date"] in card and "CPU" in card


def test_summary_fields(smoke):
    out, summary, _ = smoke
    vocab = summary["tokenizer"]["vocab_size"]
    assert 257 < vocab <= 512
    held = summary["heldout"]
    assert held["uniform_ppl"] == vocab
    for key in ("target_ppl", "draft_ppl"):
        assert 1 < held[key] < 2 * vocab
    assert 0 <= held["greedy_agreement"] <= 1 and held["positions"] == 2048 - 2048 % 32
    spec = summary["speculation"]
    assert spec["draft_tokens"] == 4 and spec["prompts"] == 3 and spec["prompt_tokens"] == 16
    assert 0 <= spec["mean_accepted"] <= 4
    assert spec["tokens_per_verification"] == pytest.approx(spec["mean_accepted"] + 1)
    for name in ("target", "draft"):
        model = summary["models"][name]
        assert model["training"]["steps"] == 8 and model["training"]["stopped_by"] == "steps"
        assert model["folder_bytes"] > 2 * model["parameters"]            # bf16 weights
    assert summary["total_bytes"] == sum(m["folder_bytes"] for m in summary["models"].values())
    data = summary["data"]
    assert data["chars"]["train"] == 100000 < data["train_chars_before_cut"]
    assert data["heldout_files"] and all(ttp.split_of(f) == "heldout"
                                         for f in data["heldout_files"])


def test_command_line_run_qwen3_stopped_by_the_time_budget(tmp_path, offline):
    """The script as a program (offline from the start), Qwen3, a budget far below --steps."""
    args = list(SMOKE_ARGS)
    args[args.index("--steps") + 1] = "100000"
    out = tmp_path / "pair"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OUT": str(tmp_path)}
    result = subprocess.run([sys.executable, str(SCRIPT), *args, "--arch", "qwen3",
                             "--minutes", "0.002", "--out", str(out)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.rstrip().splitlines()[-1].startswith("summary:")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["arch"] == "qwen3"
    assert summary["command"].endswith('--out "$OUT/pair"')
    for name in ("target", "draft"):
        training = summary["models"][name]["training"]
        assert training["stopped_by"] == "minutes" and training["steps"] < 100000
        model = AutoModelForCausalLM.from_pretrained(out / name)
        assert model.config.model_type == "qwen3"
        assert model.config.vocab_size == summary["tokenizer"]["vocab_size"]


def test_same_seed_same_files(smoke, tmp_path):
    out, summary, _ = smoke
    with contextlib.redirect_stdout(io.StringIO()):
        again = ttp.main([*SMOKE_ARGS, "--out", str(tmp_path)])
    for name in ("target", "draft"):
        for file in ("model.safetensors", "tokenizer.json", "config.json"):
            assert (out / name / file).read_bytes() == (tmp_path / name / file).read_bytes()
    assert again["heldout"] == summary["heldout"]
    assert again["speculation"] == summary["speculation"]


# ---------------------------------------------------------------- pieces


def test_split_is_a_stable_hash_of_the_path():
    # Pinned values: SHA-256, not Python's per-process salted hash().
    assert ttp.split_of("ast.py") == "heldout"
    assert ttp.split_of("re/__init__.py") == "valid"
    assert ttp.split_of("argparse.py") == "train"


def test_source_files_skip_tests_and_generated_folders():
    files = ttp.list_source_files(ttp.stdlib_root())
    assert files == sorted(files) and "argparse.py" in files
    for rel in files:
        assert ttp.EXCLUDED_DIRS.isdisjoint(rel.split("/")[:-1]), rel
    assert not any(f.startswith("encodings/") for f in files)


@pytest.mark.parametrize("match, length, expected", [
    ([True] * 10, 10, [4, 4]),                 # 4 drafts + 1 target token, twice
    ([True] * 11, 11, [4, 4, 0]),              # the last token: no room left for drafts
    ([True] * 12, 12, [4, 4, 1]),
    ([False] * 5, 5, [0, 0, 0, 0, 0]),
    ([True, True, False, True, True, True, True, True], 8, [2, 4]),
    ([True], 1, [0]),
])
def test_accepted_runs(match, length, expected):
    runs = ttp.accepted_runs(match, length, 4)
    assert runs == expected
    assert sum(runs) + len(runs) == length


def test_schedule_warms_up_then_decays_to_the_floor():
    assert ttp.lr_factor(0.0) < 0.01
    assert ttp.lr_factor(ttp.WARMUP_FRACTION) == pytest.approx(1.0)
    assert ttp.lr_factor(1.0) == pytest.approx(ttp.MIN_LR_RATIO)
    values = [ttp.lr_factor(p / 100) for p in range(5, 101)]
    assert values == sorted(values, reverse=True)


def test_windows_predict_every_token_once():
    stream = torch.arange(21)
    windows = ttp.make_windows(stream, 5, None)
    assert windows.shape == (4, 6)
    assert torch.equal(windows[:, 1:].flatten(), torch.arange(1, 21))
    assert ttp.make_windows(stream, 5, 10).shape == (2, 6)
    with pytest.raises(RuntimeError, match="--seq-len"):
        ttp.make_windows(torch.arange(4), 5, None)


# ---------------------------------------------------------------- command line


@pytest.mark.parametrize("option, value, allowed", [
    ("--vocab-size", "100", "[300, 65536]"),
    ("--seq-len", "0", "[8, 2048]"),
    ("--batch-size", "-2", ">= 1"),
    ("--steps", "0", ">= 1"),
    ("--steps", "ten", ">= 1"),
    ("--epochs", "-1", "> 0"),
    ("--minutes", "0", "> 0"),
    ("--minutes", "nan", "> 0"),
    ("--lr", "0", "> 0"),
    ("--distill-weight", "1.5", "<= 1"),
    ("--seed", "-1", "[0, 2147483647]"),
    ("--max-train-chars", "10", ">= 1000"),
    ("--target-layers", "0", "[1, 64]"),
    ("--draft-hidden", "4", "[8, 8192]"),
    ("--arch", "gpt2", "llama"),
    ("--device", "tpu", "cuda"),
    ("--target-heads", "3", "--target-hidden"),
    ("--draft-kv-heads", "3", "--draft-heads"),
    ("--spec-new-tokens", "1", ">= 2"),
])
def test_bad_arguments_name_the_option_value_and_what_is_allowed(option, value, allowed,
                                                                 capsys):
    with pytest.raises(SystemExit) as exit_info:
        ttp.parse_args([option, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and value in err and allowed in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_refused(capsys):
    with pytest.raises(SystemExit):
        ttp.parse_args(["--device", "cuda"])
    assert "argument --device" in capsys.readouterr().err


def test_defaults():
    args = ttp.parse_args([])
    assert args.out == ttp.REPO / "flashspec" / "assets" / "tiny_pair"
    assert args.out == flashspec.assets.tiny_pair_path()
    assert args.arch == "llama" and args.vocab_size == 8192 and args.seq_len == 512
    assert args.target == ttp.DEFAULT_TARGET and args.draft == ttp.DEFAULT_DRAFT
    assert args.device in ("cpu", "cuda") and args.steps is None


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        ttp.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for action in ttp.build_parser()._actions:
        for option in action.option_strings:
            assert option in text
        assert action.help
