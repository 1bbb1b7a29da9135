"""MTP drafts (`generate(use_mtp=True)`) on the engine, against stock transformers' own MTP
generation, on a tiny GLM-4-MoE whose checkpoint carries one MTP layer (CPU, fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
from transformers.generation import candidate_generator

import flashspec
from flashspec.generation import slot as slot_module

from _models import PAD, tiny_model

LAYERS = 3
HIDDEN = 48


def write_checkpoint(folder) -> None:
    """A GLM-4-MoE of LAYERS layers whose checkpoint holds one MTP layer as the released
    checkpoints do: the layer after the last (``model.layers.{LAYERS}.*``: a decoder layer,
    ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``), which the model itself ignores."""
    config = Glm4MoeConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        num_hidden_layers=LAYERS + 1, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        num_nextn_predict_layers=1, pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
        initializer_range=0.1, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)            # peaked: greedy rarely meets a near-tie
    model.save_pretrained(folder)
    path = folder / "model.safetensors"
    weights = load_file(str(path))
    generator = torch.Generator().manual_seed(1)
    prefix = f"model.layers.{LAYERS}."
    for name in ("enorm", "hnorm", "shared_head.norm"):
        weights[f"{prefix}{name}.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=generator)
    weights[f"{prefix}eh_proj.weight"] = 0.1 * torch.randn(HIDDEN, 2 * HIDDEN, generator=generator)
    save_file(weights, str(path), metadata={"format": "pt"})
    config_path = folder / "config.json"
    fields = json.loads(config_path.read_text())
    fields["num_hidden_layers"] = LAYERS
    config_path.write_text(json.dumps(fields))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("glm4_moe_mtp")
    write_checkpoint(folder)
    loaded = Glm4MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # transformers finds a checkpoint's MTP keys by the model class's ignore patterns, which
    # name the released models' layer numbers (46, 92): this one's is LAYERS.
    loaded._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}\..*"]
    return flashspec.wrap(loaded)


def prompts():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [PAD, PAD, PAD, 3, 4, 5, 3, 4],
                        [PAD, PAD, PAD, PAD, PAD, PAD, 17, 18]])
    return ids, (ids != PAD).long()


def test_greedy_tokens_and_drafts_equal_stocks_mtp(model, monkeypatch):
    """Batch 1 (stock's only size): flashspec's use_mtp tokens equal stock's use_mtp and plain
    tokens, and each step's draft equals the one stock's MTPCandidateGenerator made there."""
    stock_drafts, flash_drafts = {}, {}
    get_candidates = candidate_generator.MTPCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        candidates, logits = get_candidates(self, input_ids, *args, **kwargs)
        if candidates.shape[1] > input_ids.shape[1]:
            stock_drafts[input_ids.shape[1]] = candidates[0, input_ids.shape[1]:].tolist()
        return candidates, logits

    verify = slot_module.Slot.verify

    def verifying(slot, width):
        flash_drafts[int(slot.length[0])] = slot.drafts[0, :width].tolist()
        return verify(slot, width)

    monkeypatch.setattr(candidate_generator.MTPCandidateGenerator, "get_candidates", recording)
    monkeypatch.setattr(slot_module.Slot, "verify", verifying)
    ids = prompts()[0][:1]
    plain = model.generate(ids, max_new_tokens=20, do_sample=False)
    stock = model.generate(ids, max_new_tokens=20, do_sample=False, use_mtp=True)
    flash = model.generate(ids, max_new_tokens=20, do_sample=False, use_mtp=True, sampler="flash",
                           return_dict_in_generate=True)
    assert torch.equal(stock, plain) and torch.equal(flash.sequences, plain)
    assert int(flash.flash_stats.drafted.sum()) > 5
    shared = set(stock_drafts) & set(flash_drafts)
    assert len(shared) > 5
    for length in shared:
        assert flash_drafts[length][:1] == stock_drafts[length][:1], length


@pytest.mark.parametrize("drafts", [None, 3])
def test_batched_and_sampled_mtp_tokens_are_the_tokens_without(model, drafts):
    """A ragged batch (stock refuses batches), greedy and seeded sampling, one draft per step
    (stock's count) or three (the layer reused): the tokens of the call without drafts."""
    ids, mask = prompts()
    extra = {} if drafts is None else {"num_assistant_tokens": drafts}
    for sampling in (dict(do_sample=False), dict(do_sample=True, top_k=8, seed=3)):
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=16, sampler="flash",
                               **sampling)
        drafted = model.generate(ids, attention_mask=mask, max_new_tokens=16, sampler="flash",
                                 use_mtp=True, return_dict_in_generate=True, **extra, **sampling)
        assert torch.equal(drafted.sequences, plain)
        width = drafted.flash_stats.drafted.max()
        assert int(width) == (drafts or 1)


def test_the_mtp_layer_is_loaded_once_and_refused_where_it_cannot_run(model):
    from flashspec.generation.mtp import Mtp

    first = Mtp(model)
    assert Mtp(model).mtp is first.mtp                  # kept on the model
    llama = tiny_model("llama")
    with pytest.raises(ValueError, match="num_mtp_layers"):
        llama.generate(torch.tensor([[5, 6]]), max_new_tokens=2, use_mtp=True, sampler="flash")
