"""Decoders whose windowed layers the model's own code picks, on the engine, on CPU.

GPT-Neo's attention modules apply a causal buffer by key column, with a window of
``config.window_size`` columns in its "local" layers (``config.attention_layers``), and add
the one mask its forward hands every layer. The engine reads those layers' kinds from the
config (`kv_cache.layer_kinds`) and, while it runs the decoder, gives each attention module
the cache's position-addressed mask of its own kind with the buffer all True
(`kv_cache.engine_layer_masks`). With a window smaller than prompt + new tokens, greedy
tokens equal stock transformers' (one row; a left-padded batch; prompt lookup; an assistant
of the same class); seeded sampling gives the same tokens with and without drafts; the
model is left as it was; a mask with holes whose columns exceed the window runs on stock.

The models are tiny random float32 models built here (peaked like tests/_models.py's).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from transformers import GPTNeoConfig, GPTNeoForCausalLM

import flashspec
from flashspec.generation.kv_cache import FULL, SLIDING, layer_kinds

from test_generate import _quiet_single_threaded, left_pad  # noqa: F401 - its autouse fixture

VOCAB = 128
PAD = 0                      # test_generate.left_pad's
HEAD_SCALE = 6.0
WINDOW = 7
NEW = 30                     # 20 + 30 columns: past the window, and past one eager KV view
DEFERS = "sampler='flash' defers this call to stock"

# Repeated n-grams, so that prompt lookup drafts; lengths 20, 13 and 7 (left padding).
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 40, 41, 5, 6, 7],
    [9, 10, 11, 12, 9, 10, 11, 12, 9, 10, 11, 12, 9],
    [20, 21, 22, 20, 21, 22, 20],
]


def _config(size: str, window: int = WINDOW) -> GPTNeoConfig:
    hidden, layers = (48, 2) if size == "target" else (24, 2)
    return GPTNeoConfig(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
                        hidden_size=hidden, num_layers=layers, num_heads=4,
                        attention_types=[[["global", "local"], layers // 2]], window_size=window,
                        max_position_embeddings=256, initializer_range=0.1)


@functools.lru_cache(maxsize=None)
def model(size: str = "target"):
    """A float32 random GPT-Neo in eval mode, wrapped; the assistant ("draft") is smaller."""
    torch.manual_seed(0 if size == "target" else 1)
    lm = GPTNeoForCausalLM(_config(size)).float().eval()
    with torch.no_grad():
        lm.get_output_embeddings().weight.mul_(HEAD_SCALE)
    return flashspec.wrap(lm)


def generate(lm, ids, mask, **kwargs) -> torch.Tensor:
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("max_new_tokens", NEW)
    if kwargs.get("sampler") == "flash":
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=DEFERS)
            return lm.generate(ids, attention_mask=mask, **kwargs)
    return lm.generate(ids, attention_mask=mask, **kwargs)


@functools.lru_cache(maxsize=None)
def stock_greedy(rows: int) -> torch.Tensor:
    ids, mask = left_pad(PROMPTS[:rows])
    return generate(model(), ids, mask)


def modes() -> dict:
    return {"plain": {}, "lookup": dict(prompt_lookup_num_tokens=3),
            "assistant": dict(assistant_model=model("draft"), num_assistant_tokens=3)}


def test_layer_kinds_read_gpt_neo_attention_layers():
    assert layer_kinds(_config("target")) == {FULL: None, SLIDING: WINDOW}
    local = _config("target")
    local.attention_layers = ["local", "local"]
    assert layer_kinds(local) == {SLIDING: WINDOW}
    local.attention_layers = ["global", "sparse"]
    assert layer_kinds(local) is None


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("mode", ["plain", "lookup", "assistant"])
def test_greedy_equals_stock(rows, mode):
    """Greedy flash = stock greedy, token for token, with a local window (7) smaller than
    the prompt (20) + 30 new tokens: one row, or three left-padded rows; with drafts, rows
    accept different numbers of them, which leaves holes between a row's keys in the shared
    columns (the window counts positions, as stock's counts a row's adjacent columns)."""
    ids, mask = left_pad(PROMPTS[:rows])
    out = generate(model(), ids, mask, sampler="flash", return_dict_in_generate=True,
                   **modes()[mode])
    expected = stock_greedy(rows)
    assert torch.equal(out.sequences, expected), (out.sequences[:, ids.shape[1]:].tolist(),
                                                  expected[:, ids.shape[1]:].tolist())
    if mode != "plain":
        assert int(out.flash_stats.drafted.sum()) > 0, out.flash_stats.summary()


def test_seeded_sampling_same_tokens_with_drafts():
    ids, mask = left_pad(PROMPTS)
    runs = {mode: generate(model(), ids, mask, sampler="flash", do_sample=True, seed=0, **kwargs)
            for mode, kwargs in modes().items()}
    assert torch.equal(runs["plain"], runs["lookup"])
    assert torch.equal(runs["plain"], runs["assistant"])


def test_the_model_is_left_as_it_was():
    """The attention modules' causal buffers and forwards are their own again after a call
    (and while stock runs: a stock call after a flash call gives stock's tokens)."""
    lm = model()
    modules = [m for m in lm.modules() if type(m).__name__ == "GPTNeoSelfAttention"]
    buffers = [m.bias for m in modules]
    ids, mask = left_pad(PROMPTS[:2])
    generate(lm, ids, mask, sampler="flash", max_new_tokens=3)
    assert all(m.bias is b for m, b in zip(modules, buffers))
    assert not any("forward" in vars(m) for m in modules)
    assert torch.equal(generate(lm, ids, mask), stock_greedy(2))


def test_holes_past_the_window_run_on_stock():
    """A mask with padding between a row's tokens, whose columns exceed the local window:
    stock's window counts the padding columns, the engine's does not: stock runs it."""
    ids, mask = left_pad(PROMPTS[:2])
    mask[0, 3] = 0
    with pytest.warns(UserWarning, match="exceed the model's sliding window"):
        ours = model().generate(ids, attention_mask=mask, sampler="flash", max_new_tokens=4)
    assert torch.equal(ours, model().generate(ids, attention_mask=mask, max_new_tokens=4))


def test_doge_keeps_its_dynamic_mask():
    """Doge's attention adds a bias made from the keys' values to its mask and keeps its top
    `keep_window_size` keys (a window by value): the attention by position (the compiled
    steps' on CUDA) does not read masks, so Doge keeps the mask path, where greedy tokens
    equal stock's with a keep window (8) smaller than prompt + new tokens."""
    from transformers import DogeConfig, DogeForCausalLM

    from flashspec.generation import attention

    torch.manual_seed(0)
    config = DogeConfig(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
                        hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, keep_window_size=8,
                        max_position_embeddings=256, initializer_range=0.1)
    lm = DogeForCausalLM(config).eval()
    with torch.no_grad():
        lm.get_output_embeddings().weight.mul_(HEAD_SCALE)
        for name, parameter in lm.named_parameters():
            if name.endswith(".A"):       # zeros at init: every key's bias ties
                parameter.normal_()
    assert "Doge's dynamic mask" in attention.unsupported_reason(lm.get_decoder())
    lm = flashspec.wrap(lm)
    ids, mask = left_pad(PROMPTS[1:])
    assert torch.equal(generate(lm, ids, mask, sampler="flash", max_new_tokens=12),
                       generate(lm, ids, mask, max_new_tokens=12))
