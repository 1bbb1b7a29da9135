"""`generate(sampler="flash")` on a model that accelerate placed with a ``device_map``:
a layer offloaded to disk, or layers on two GPUs. The engine runs the model's layers, whose
patched forwards move inputs and load weights, eagerly: the tokens equal those of the same
model loaded whole, in every mode, also where the KV cache compacts and grows.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import flashspec

from test_generate import _quiet_single_threaded  # noqa: F401 - the module's autouse fixture

PROMPTS = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [0, 0, 0, 9, 10, 11, 9, 10, 11, 9]])
MASK = (PROMPTS != 0).long()
MASK[0] = 1
MODES = {
    "greedy": dict(do_sample=False),
    "sampled": dict(do_sample=True, temperature=0.9, top_k=20, top_p=0.9),
    "prompt lookup": dict(do_sample=True, temperature=0.9, top_k=0, prompt_lookup_num_tokens=3),
    "self-drafted": dict(do_sample=True, temperature=0.9, top_k=0, num_assistant_tokens=3),
    "edits": dict(do_sample=True, temperature=0.9, top_k=0, repetition_penalty=1.5,
                  no_repeat_ngram_size=2, frequency_penalty=0.5),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=None,
                         eos_token_id=None)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    path = str(tmp_path_factory.mktemp("device_map") / "model")
    model.save_pretrained(path)
    return path


def _generate(model, mode: str, max_new_tokens: int = 12, **kwargs):
    extra = dict(MODES[mode])
    if "num_assistant_tokens" in extra:
        extra["assistant_model"] = model
    device = model.lm_head.weight.device
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(PROMPTS.to(device), attention_mask=MASK.to(device),
                             max_new_tokens=max_new_tokens, sampler="flash", seed=3, **extra,
                             **kwargs).cpu()
    messages = [str(w.message) for w in caught]
    assert not any("defers this call to stock" in m or "materialized path" in m
                   for m in messages), messages    # the engine's fused path ran
    return out


def _assert_same_tokens(placed, whole):
    for mode in MODES:
        assert torch.equal(_generate(placed, mode), _generate(whole, mode)), mode
    # Past the slot's first 256 KV columns: the caches compact, then grow.
    assert torch.equal(_generate(placed, "prompt lookup", max_new_tokens=300),
                       _generate(whole, "prompt lookup", max_new_tokens=300))


def test_a_layer_offloaded_to_disk(folder, tmp_path):
    placement = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                 "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # accelerate: parameters on the meta device
        placed = flashspec.from_pretrained(folder, dtype=torch.float32, device_map=placement,
                                           offload_folder=str(tmp_path))
    whole = flashspec.from_pretrained(folder, dtype=torch.float32)
    assert flashspec.generation.heads.output_head(placed, "model").spread
    assert not flashspec.generation.heads.output_head(whole, "model").spread
    _assert_same_tokens(placed, whole)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (PARTS=multi of "
                    "scripts/gpu_check.sh runs it)")
def test_layers_over_two_gpus(folder):
    """Layers on two GPUs (the KV cache's write columns follow each layer to its GPU): the
    tokens of the model whole on one GPU, in every mode; inputs on the embedding's GPU
    (``model.device``, where stock takes them) give the same tokens, returned there,
    whichever GPU is current."""
    placement = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0,
                 "model.layers.1": 1, "model.norm": 1, "lm_head": 1}
    placed = flashspec.from_pretrained(folder, dtype=torch.float32, device_map=placement)
    whole = flashspec.from_pretrained(folder, dtype=torch.float32, device_map={"": 1})
    assert flashspec.generation.heads.output_head(placed, "model").spread
    assert placed.device == torch.device("cuda", 0)
    with torch.cuda.device(0):        # the engine made off the head's GPU
        out = placed.generate(PROMPTS.to(placed.device), attention_mask=MASK.to(placed.device),
                              max_new_tokens=12, sampler="flash", seed=3, **MODES["sampled"])
    assert out.device == placed.device
    with torch.cuda.device(1):
        _assert_same_tokens(placed, whole)
        assert torch.equal(out.cpu(), _generate(whole, "sampled"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (its CPU twin: "
                    "test_engine.py::test_layers_under_accelerate_hooks_compile_regionally)")
def test_layers_under_accelerate_hooks_compile_and_capture_on_a_gpu(folder):
    """accelerate's hooks on every layer (as a device_map puts them), all on one GPU, in
    bf16: the steps compile the layers inside the hooks and are captured, and the tokens are
    those of the same model without hooks, in every mode."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    from flashspec.generation.engine import cached_engine

    hooked, plain = (flashspec.from_pretrained(folder, dtype=torch.bfloat16, device_map={"": 0})
                     for _ in range(2))
    for layer in hooked.model.layers:
        add_hook_to_module(layer, AlignDevicesHook(execution_device=0, io_same_device=True))
    with torch.cuda.device(0):
        for mode in MODES:
            assert torch.equal(_generate(hooked, mode), _generate(plain, mode)), mode
    engine = cached_engine(hooked.model)
    assert engine.target.compiled and engine.graphs
    assert all("_old_forward" in vars(layer) for layer in hooked.model.layers)


def test_a_model_off_the_current_gpu_is_refused_by_name():
    """The engine captures its CUDA graphs on the current device: a model on another GPU is
    refused with the call that fixes it (checked on CPU through the rule itself)."""
    from flashspec.generation.plan import off_current_device

    assert off_current_device(torch.device("cuda", 0), 0) is None
    assert off_current_device(torch.device("cuda"), 1) is None
    why = off_current_device(torch.device("cuda", 1), 0)
    assert why.startswith("the model is on cuda:1 but the current CUDA device is cuda:0")
    assert "torch.cuda.set_device('cuda:1')" in why
