"""README's main job runs on the built-in pair, and what it prints holds: every flash mode
emits stock greedy's tokens, and seeded sampling is the same with and without drafts."""

import pytest

from flashspec.bench import demo


def test_demo_runs_and_every_mode_matches_stock(capsys):
    import torch

    threads = torch.get_num_threads()
    assert demo.main(["--max-new-tokens", "12", "--device", "cpu"]) == 0
    assert torch.get_num_threads() == threads     # the demo's one thread is given back
    printed = capsys.readouterr().out
    rows = [line.split() for line in printed.splitlines()
            if line.startswith("  stock HF") or line.startswith("  flash")]
    assert len(rows) == 7 * len(demo.PROMPTS)         # with the pair's EAGLE-3 head
    assert "On a CPU this shows exactness" in printed
    assert all(row[-1] == "True" for row in rows), printed
    assert "emit the same tokens: True" in printed


def test_demo_refuses_bad_arguments():
    with pytest.raises(SystemExit):
        demo.main(["--max-new-tokens", "0"])


def test_the_committed_pair_loads_offline(monkeypatch):
    """The built-in pair: HF folders that load without the hub, same tokenizer and vocabulary,
    within the 25 MB budget, with the model card next to them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    size = sum(f.stat().st_size for f in demo.TINY_PAIR.rglob("*") if f.is_file())
    assert size <= 25 * 2**20
    assert (demo.TINY_PAIR / "MODEL_CARD.md").is_file()
    models = {name: AutoModelForCausalLM.from_pretrained(demo.TINY_PAIR / name) for name in ("target", "draft")}
    tokenizers = {name: AutoTokenizer.from_pretrained(demo.TINY_PAIR / name) for name in ("target", "draft")}
    code = "def f(x):\n    return x ** 2  # square\n"
    assert tokenizers["target"].decode(tokenizers["target"](code)["input_ids"]) == code
    assert tokenizers["target"].get_vocab() == tokenizers["draft"].get_vocab()
    assert (models["target"].get_output_embeddings().weight.shape[0]
            == models["draft"].get_output_embeddings().weight.shape[0] == len(tokenizers["target"]))
    assert all(p.dtype == torch.bfloat16 for m in models.values() for p in m.parameters())
