"""flashspec/bench/random_init.py and the --random-init argparse type of flashspec/bench/cli.py:
the shipped configs, the refusals, seeded random models, and peak_weights."""

import argparse
import json
import tomllib
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import flashspec
from flashspec.bench import random_init
from flashspec.bench.cli import random_init_shapes

SHIPPED = ["llama-3.1-8b", "llama-3.2-1b", "qwen3-0.6b", "qwen3-1.7b", "qwen3.5-9b-mtp"]
SMALL_LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32,
               "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
               "num_key_value_heads": 1, "head_dim": 16}


def _write_config(path: Path, fields) -> str:
    path.write_text(json.dumps(fields))
    return str(path)


def test_shipped_configs_are_real_shapes_and_ship_with_the_package():
    assert random_init.config_names() == SHIPPED
    config = random_init.random_config("qwen3-1.7b")
    assert (config.model_type, config.vocab_size, config.hidden_size,
            config.num_hidden_layers) == ("qwen3", 151936, 2048, 28)
    assert not hasattr(config, random_init.SOURCE_FIELD)
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert "assets/configs/*.json" in pyproject["tool"]["setuptools"]["package-data"]["flashspec"]


def test_the_mtp_shape_reads_what_qwen35_9b_reads():
    """qwen3.5-9b-mtp: Qwen3.5-9B's widths as a GLM-4-MoE model (transformers' MTP family);
    its main layers dense, its MTP layer's experts reading a dense FFN's bytes per token."""
    config = random_init.random_config("qwen3.5-9b-mtp")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert 8.1e9 < sum(p.numel() for p in model.parameters()) < 8.3e9
    assert {type(layer.mlp).__name__ for layer in model.model.layers} == {"Glm4MoeMLP"}
    active = config.moe_intermediate_size * (config.num_experts_per_tok + config.n_shared_experts)
    assert (config.num_mtp_layers, active) == (1, config.intermediate_size)


def test_the_mtp_shape_drafts_on_the_engine():
    """The qwen3.5-9b-mtp config's structure at small widths: random MTP layers, and
    use_mtp's greedy tokens equal the plain call's (top-1 of two routed experts)."""
    fields = json.loads(random_init.config_path("qwen3.5-9b-mtp").read_text())
    fields.pop(random_init.SOURCE_FIELD)
    fields.update(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                  first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, moe_intermediate_size=96)
    torch.manual_seed(0)
    model = flashspec.wrap(AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields)).eval())
    random_init.random_mtp(model)
    ids = torch.randint(0, 256, (2, 12))
    plain = model.generate(ids, max_new_tokens=20, do_sample=False, sampler="flash")
    drafted = model.generate(ids, max_new_tokens=20, do_sample=False, sampler="flash",
                             use_mtp=True, return_dict_in_generate=True)
    assert torch.equal(drafted.sequences, plain)
    assert int(drafted.flash_stats.drafted.sum()) > 5


def test_config_path_prefers_a_shipped_name(tmp_path):
    assert random_init.config_path("qwen3-0.6b") == random_init.CONFIGS_DIR / "qwen3-0.6b.json"
    path = tmp_path / "config.json"
    assert random_init.config_path(str(path)) == path


@pytest.mark.parametrize("fields, message", [
    (None, "neither a config shipped in flashspec/assets/configs (llama-3.1-8b, "),
    ("{not json", "cannot read"),
    ([1, 2], "has no 'model_type'"),
    ({"hidden_size": 64}, "has no 'model_type'"),
    ({"model_type": "transformer9000"}, "model_type 'transformer9000'"),
])
def test_bad_configs_are_refused_saying_why(tmp_path, fields, message):
    path = tmp_path / "config.json"
    if isinstance(fields, str):
        path.write_text(fields)
    elif fields is not None:
        _write_config(path, fields)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        random_init.random_config(str(path))


def test_random_model_is_seeded_and_built_as_asked(tmp_path):
    shape = _write_config(tmp_path / "config.json", SMALL_LLAMA)
    model = random_init.random_model(shape, "cpu", torch.bfloat16, seed=3)
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    weights = model.get_input_embeddings().weight
    assert weights.dtype == torch.bfloat16 and weights.shape == (256, 32)
    again = random_init.random_model(shape, "cpu", torch.bfloat16, seed=3)
    other = random_init.random_model(shape, "cpu", torch.bfloat16, seed=4)
    assert torch.equal(weights, again.get_input_embeddings().weight)
    assert not torch.equal(weights, other.get_input_embeddings().weight)


def test_random_init_shapes_parses_one_or_two_shapes(tmp_path):
    shape = _write_config(tmp_path / "config.json", SMALL_LLAMA)
    assert random_init_shapes("qwen3-1.7b") == ["qwen3-1.7b"]
    assert random_init_shapes(f" qwen3-1.7b, {shape}") == ["qwen3-1.7b", shape]


@pytest.mark.parametrize("text, message", [
    ("qwen3-1.7b,qwen3-0.6b,qwen3-0.6b", "expected TARGET_SHAPE[,DRAFT_SHAPE]"),
    ("qwen3-1.7b,", "expected TARGET_SHAPE[,DRAFT_SHAPE]"),
    ("qwen9-1b", "'qwen9-1b' is neither a config shipped"),
])
def test_random_init_shapes_refusals_say_why(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message.replace("[", r"\[")):
        random_init_shapes(text)


def _small_qwen3(tied: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", vocab_size=4096, hidden_size=256, intermediate_size=768,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=64, tie_word_embeddings=tied, pad_token_id=0,
                                  eos_token_id=None)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def _greedy_margins(model, prompts):
    """(top-1 - top-2 logit) / the logits' standard deviation, at every position."""
    with torch.no_grad():
        logits = model(prompts).logits.float()
    top = logits.topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1]) / logits.std(dim=-1)


@pytest.mark.parametrize("tied", [True, False])
def test_peaked_weights_make_greedy_decisions_decisive(tied):
    """bf16, Qwen3 shape in miniature: the random model has near-ties (where one-token and
    many-token forwards may round to different argmaxes); after peak_weights every
    position's top logit leads by many standard deviations, the greedy self-draft accepts
    every draft and its tokens equal plain greedy decoding's."""
    prompts = torch.randint(1, 4096, (2, 64), generator=torch.Generator().manual_seed(0))
    assert _greedy_margins(_small_qwen3(tied), prompts).min() < 0.05
    model = _small_qwen3(tied)
    assert random_init.peak_weights(model) is model
    assert torch.equal(model.get_output_embeddings().weight, model.get_input_embeddings().weight)
    assert _greedy_margins(model, prompts).min() > 5.0
    model = flashspec.wrap(model)
    common = dict(input_ids=prompts[:, :16], attention_mask=torch.ones_like(prompts[:, :16]),
                  max_new_tokens=24, do_sample=False, sampler="flash", return_dict_in_generate=True)
    plain = model.generate(**common)
    speculative = model.generate(**common, assistant_model=model, num_assistant_tokens=5,
                                 num_assistant_tokens_schedule="constant")
    stats = speculative.flash_stats.summary()
    assert stats["drafted"] > 0 and stats["accepted"] == stats["drafted"]
    assert torch.equal(speculative.sequences, plain.sequences)


def test_peaked_weights_refuse_models_without_the_named_projections():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="found 0 residual output projections"):
        random_init.peak_weights(model)
