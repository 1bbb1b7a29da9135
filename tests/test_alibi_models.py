"""Decoders whose forward reads the 2-D attention mask (ALiBi), on the engine, on CPU.

Bloom and Falcon with ``alibi=True`` build their ALiBi biases from the 2-D padding mask
(each key's position ``(mask.cumsum(-1) - 1) * mask``) and their causal mask from it: the
engine hands them the cache's 2-D live mask of the view and answers their
`create_causal_mask` with its position-addressed mask (`kv_cache.engine_causal_mask`).
Greedy tokens equal stock transformers' (one row; a left-padded batch; prompt lookup; an
assistant of the same class), over more than one KV view; seeded sampling gives the same
tokens with and without drafts. MPT, whose ALiBi follows key columns, is refused up front
by name; `invariant=True` refuses attention the models compute themselves.

The models are tiny random float32 models built here (peaked like tests/_models.py's).
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from transformers import (BloomConfig, BloomForCausalLM, FalconConfig, FalconForCausalLM,
                          MptConfig, MptForCausalLM, masking_utils)

import flashspec

VOCAB = 128
PAD = 0
HEAD_SCALE = 6.0
PROMPT, NEW = 20, 40          # 60 columns: past the first eager KV views (32 columns each)

# Repeated n-grams, so that prompt lookup drafts; lengths 20, 13 and 7 (left padding).
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 40, 41, 5, 6, 7],
    [9, 10, 11, 12, 9, 10, 11, 12, 9, 10, 11, 12, 9],
    [20, 21, 22, 20, 21, 22, 20],
]


@pytest.fixture(scope="module", autouse=True)
def _quiet_single_threaded():
    threads = torch.get_num_threads()
    verbosity = transformers.logging.get_verbosity()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    yield
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity(verbosity)


def _special() -> dict:
    return dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
                initializer_range=0.1, tie_word_embeddings=False)


def _config(arch: str, size: str, attention: str | None):
    hidden, layers = (48, 2) if size == "target" else (24, 1)
    if arch == "bloom":       # 6 heads: the slopes of a head count that is not a power of 2
        config = BloomConfig(**_special(), hidden_size=hidden, n_layer=layers, n_head=6)
    elif arch == "falcon":
        config = FalconConfig(**_special(), hidden_size=hidden, num_hidden_layers=layers,
                              num_attention_heads=4, alibi=True)
    elif arch == "falcon-rope":
        config = FalconConfig(**_special(), hidden_size=hidden, num_hidden_layers=layers,
                              num_attention_heads=4, alibi=False, max_position_embeddings=256)
    elif arch == "mpt":
        config = MptConfig(**_special(), d_model=hidden, n_layers=layers, n_heads=4,
                           max_seq_len=256)
    else:
        raise ValueError(arch)
    if attention is not None:
        config._attn_implementation = attention
    return config


_CLASSES = {"bloom": BloomForCausalLM, "falcon": FalconForCausalLM,
            "falcon-rope": FalconForCausalLM, "mpt": MptForCausalLM}


@functools.lru_cache(maxsize=None)
def model(arch: str, size: str = "target", attention: str | None = None):
    """A float32 random `arch` causal LM in eval mode, wrapped; the assistant ("draft") is
    smaller, of the same class."""
    torch.manual_seed(0 if size == "target" else 1)
    lm = _CLASSES[arch](_config(arch, size, attention)).float().eval()
    with torch.no_grad():
        lm.get_output_embeddings().weight.mul_(HEAD_SCALE)
    return flashspec.wrap(lm)


def left_pad(prompts) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def generate(lm, ids, mask, **kwargs) -> torch.Tensor:
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("max_new_tokens", NEW)
    return lm.generate(ids, attention_mask=mask, **kwargs)


@functools.lru_cache(maxsize=None)
def stock_greedy(arch: str, rows: int, attention: str | None = None) -> torch.Tensor:
    ids, mask = left_pad(PROMPTS[:rows])
    return generate(model(arch, attention=attention), ids, mask)


def modes(arch: str) -> dict:
    return {"plain": {}, "lookup": dict(prompt_lookup_num_tokens=3),
            "assistant": dict(assistant_model=model(arch, "draft"), num_assistant_tokens=3)}


# (arch, attention implementation or None for the model's default, rows, mode): Bloom's is
# eager, Falcon's sdpa; Falcon's eager path once, on the batch with drafts.
GREEDY_CASES = [(arch, None, rows, mode) for arch in ("bloom", "falcon") for rows in (1, 3)
                for mode in ("plain", "lookup", "assistant")] + [("falcon", "eager", 3, "lookup")]


@pytest.mark.parametrize("arch, attention, rows, mode", GREEDY_CASES,
                         ids=lambda value: "default" if value is None else str(value))
def test_greedy_equals_stock(arch, attention, rows, mode):
    """Greedy flash = stock greedy, token for token: one row of 20, or three left-padded rows
    of 20, 13 and 7; 40 new tokens (more than one KV view); with drafts, rows accept different
    numbers of them, which leaves holes between a row's keys in the shared columns."""
    lm = model(arch, attention=attention)
    ids, mask = left_pad(PROMPTS[:rows])
    out = generate(lm, ids, mask, sampler="flash", return_dict_in_generate=True,
                   **modes(arch)[mode])
    expected = stock_greedy(arch, rows, attention)
    assert torch.equal(out.sequences, expected), (out.sequences[:, ids.shape[1]:].tolist(),
                                                  expected[:, ids.shape[1]:].tolist())
    if mode != "plain":
        assert int(out.flash_stats.drafted.sum()) > 0, out.flash_stats.summary()


@pytest.mark.parametrize("arch", ["bloom", "falcon"])
def test_alibi_biases_are_stocks_bitwise(arch, monkeypatch):
    """The prefill's ALiBi biases, built by the model's own build_alibi_tensor from the cache's
    2-D live mask, equal stock's on the prompt's columns bit for bit (left-padded batch)."""
    module = {"bloom": "transformers.models.bloom.modeling_bloom",
              "falcon": "transformers.models.falcon.modeling_falcon"}[arch]
    module = __import__(module, fromlist=["build_alibi_tensor"])
    built = []
    original = module.build_alibi_tensor

    def spy(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(module, "build_alibi_tensor", spy)
    ids, mask = left_pad(PROMPTS)
    generate(model(arch), ids, mask, max_new_tokens=1)
    generate(model(arch), ids, mask, max_new_tokens=1, sampler="flash")
    stock, engine = built[0], built[-1]
    assert torch.equal(engine[..., : ids.shape[1]], stock)


@pytest.mark.parametrize("arch", ["bloom", "falcon"])
def test_seeded_sampling_same_tokens_with_drafts(arch):
    """do_sample with a seed: the same tokens with and without drafts (prompt lookup, an
    assistant), in a left-padded batch."""
    lm = model(arch)
    ids, mask = left_pad(PROMPTS)
    runs = {mode: generate(lm, ids, mask, sampler="flash", do_sample=True, seed=0, **kwargs)
            for mode, kwargs in modes(arch).items()}
    assert torch.equal(runs["plain"], runs["lookup"])
    assert torch.equal(runs["plain"], runs["assistant"])


def test_positions_match_stock_after_holes_and_compaction():
    """A batch whose drafts leave holes and whose columns run past the capacity (256) so the
    cache compacts: greedy still equals stock (each live key's ALiBi position from the
    cache's 2-D live mask)."""
    lm = model("bloom")
    prompts = [PROMPTS[0] * 10, PROMPTS[2] * 3]          # 200 and 21 tokens
    ids, mask = left_pad(prompts)
    kwargs = dict(max_new_tokens=70, do_sample=False)
    expected = lm.generate(ids, attention_mask=mask, **kwargs)
    out = lm.generate(ids, attention_mask=mask, sampler="flash", prompt_lookup_num_tokens=5,
                      **kwargs)
    assert torch.equal(out, expected), (out[:, ids.shape[1]:].tolist(),
                                        expected[:, ids.shape[1]:].tolist())


def test_falcon_without_alibi_still_takes_the_4d_mask():
    """Falcon with rotary positions (alibi=False) reads no 2-D mask: the engine's 4-D mask,
    as before."""
    lm = model("falcon-rope")
    ids, mask = left_pad(PROMPTS)
    assert torch.equal(generate(lm, ids, mask, sampler="flash", prompt_lookup_num_tokens=3),
                       generate(lm, ids, mask))


def test_modeling_files_keep_transformers_create_causal_mask():
    """The engine's create_causal_mask sits in Bloom's modeling file only while an engine
    forward runs, and answers any other forward (here a stock forward of another Bloom, run
    from inside the engine's forward) with transformers' mask; afterwards the file has
    transformers' function again."""
    from transformers.models.bloom import modeling_bloom

    lm, other = model("bloom"), model("bloom", "draft")
    ids, mask = left_pad(PROMPTS[:3])
    with torch.no_grad():
        expected = other(input_ids=ids, attention_mask=mask).logits
    seen = []

    def stock_forward_inside(module, args):
        seen.append(modeling_bloom.create_causal_mask is not masking_utils.create_causal_mask)
        with torch.no_grad():
            seen.append(torch.equal(other(input_ids=ids, attention_mask=mask).logits, expected))

    handle = lm.transformer.h[0].register_forward_pre_hook(stock_forward_inside)
    try:
        generate(lm, ids, mask, sampler="flash", max_new_tokens=2)
    finally:
        handle.remove()
    assert seen and all(seen), seen
    assert modeling_bloom.create_causal_mask is masking_utils.create_causal_mask


def test_mpt_is_refused_by_name():
    """MPT adds its ALiBi biases by key column: refused before anything runs, naming it."""
    ids, mask = left_pad(PROMPTS[:1])
    with pytest.raises(ValueError, match=r"`model` \(MptModel\) adds ALiBi biases by key column.*"
                                         r"run generate\(\) without sampler='flash'"):
        generate(model("mpt"), ids, mask, sampler="flash")


@pytest.mark.parametrize("arch", ["bloom", "falcon"])
def test_invariant_refuses_attention_the_model_computes_itself(arch):
    ids, mask = left_pad(PROMPTS[:1])
    name = {"bloom": "BloomModel", "falcon": "FalconModel"}[arch]
    with pytest.raises(ValueError, match=rf"`invariant`=True is not supported for {name}: its "
                                         r"attention is computed by the model's own code"):
        generate(model(arch), ids, mask, sampler="flash", invariant=True)
