"""Regression tests from the engine review: what must be refused or reported, never sampled
from the wrong distribution, and corner cases of the running batch."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import LlamaForCausalLM, MambaConfig, MambaForCausalLM

import flashspec

from _models import VOCAB, tiny_model
from test_generate import PROMPTS, draft, flash, left_pad, stock, target, tiny_tokenizer


def test_new_left_padding_cannot_complete_a_stop_string():
    """Row 0 advances by 1 token while row 1 advances by several, so row 0 gets new left
    padding; a stop string spanning the prompt and that padding must not fire. The row
    equals its single run."""
    tokenizer = tiny_tokenizer()
    ids = torch.tensor([[5], [9]])
    sampling = dict(do_sample=True, top_k=0, max_new_tokens=8)
    self_drafting = dict(assistant_model=target(), num_assistant_tokens=4)
    for seed in range(200):
        out = flash(target(), ids, seed=seed, **sampling, **self_drafting)
        emitted = out.flash_stats.emitted
        if emitted.shape[0] > 1 and emitted[0, 0] == 1 and emitted[0, 1] >= 2:
            break
    else:
        pytest.fail("no seed gives the uneven first step this test needs")
    row = out.sequences[0].tolist()
    # The old bug copied the prompt token into the new padding, so "xx t1 t2" could match.
    stop = tokenizer.decode([row[0], row[0], row[1], row[2]])
    kwargs = dict(stop_strings=[stop], tokenizer=tokenizer, **sampling)
    alone = flash(target(), ids[:1], seed=[seed], **kwargs).sequences[0]
    batched = flash(target(), ids, seed=seed, **kwargs, **self_drafting).sequences[0]
    assert torch.equal(batched[: len(alone)], alone)


class _TripledLogits(LlamaForCausalLM):
    """A head transform flashspec does not know: logits * 3 after the LM head."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 3
        return out


def test_unknown_head_transform_is_refused():
    model = tiny_model("llama")
    tripled = _TripledLogits(model.config).eval()
    tripled.load_state_dict(model.state_dict())
    flashspec.wrap(tripled)
    ids, mask = left_pad(PROMPTS[:1])
    with pytest.raises(ValueError, match="transforms its logits after the LM head"):
        tripled.generate(ids, attention_mask=mask, sampler="flash", max_new_tokens=2)


def test_recurrent_state_models_are_refused():
    torch.manual_seed(0)
    config = MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8,
                         pad_token_id=0, bos_token_id=None, eos_token_id=None)
    model = flashspec.wrap(MambaForCausalLM(config).eval())
    with pytest.raises(ValueError, match="layers other than full or sliding-window attention"):
        model.generate(torch.tensor([[3, 4, 5]]), sampler="flash", max_new_tokens=3)


def test_non_finite_weights_are_reported_not_sampled():
    broken = tiny_model("llama")
    with torch.no_grad():
        broken.lm_head.weight[7, 0] = float("nan")
    flashspec.wrap(broken)
    ids, mask = left_pad(PROMPTS[:2])
    with pytest.raises(flashspec.NonFiniteLogitsError, match="the model"):
        broken.generate(ids, attention_mask=mask, sampler="flash", max_new_tokens=3, do_sample=True)
    assistant = tiny_model("llama")
    with torch.no_grad():
        assistant.lm_head.weight[7, 0] = float("inf")
    with pytest.raises(flashspec.NonFiniteLogitsError, match="assistant_model"):
        target().generate(ids, attention_mask=mask, sampler="flash", max_new_tokens=3,
                          assistant_model=assistant)


def test_heuristic_schedule_persists_on_the_assistant_like_transformers():
    assistant = tiny_model("llama")
    assistant.generation_config.num_assistant_tokens = 2
    assistant.generation_config.num_assistant_tokens_schedule = "heuristic"
    ids, mask = left_pad(PROMPTS[:1])
    target().generate(ids, attention_mask=mask, sampler="flash", max_new_tokens=12,
                      assistant_model=assistant)           # drafts for itself: all accepted
    assert assistant.generation_config.num_assistant_tokens > 2
    transient = draft()
    transient.generation_config.num_assistant_tokens = 3
    target().generate(ids, attention_mask=mask, sampler="flash", max_new_tokens=12,
                      assistant_model=transient, num_assistant_tokens_schedule="heuristic_transient")
    assert transient.generation_config.num_assistant_tokens == 3


def test_logprobs_need_the_output_object():
    ids, mask = left_pad(PROMPTS[:1])
    with pytest.raises(ValueError, match="needs `return_dict_in_generate=True`"):
        target().generate(ids, attention_mask=mask, sampler="flash", max_new_tokens=2,
                          output_logprobs=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_beams=2), r"`num_beams`=2 \(set in the call\) selects transformers' 'beam_search'"),
    (dict(guidance_scale=1.5), "classifier-free guidance"),
    (dict(output_attentions=True, return_dict_in_generate=True), "attentions are not collected"),
    (dict(past_key_values=transformers.DynamicCache()), "`past_key_values`: the engine takes"),
])
def test_other_methods_defer_to_stock_with_a_warning(kwargs, message):
    """What the engine does not do runs stock generate (same tokens), with a warning."""
    ids, mask = left_pad(PROMPTS[:1])
    with pytest.warns(UserWarning, match=message):
        ours = target().generate(ids, attention_mask=mask, sampler="flash", max_new_tokens=3,
                                 **kwargs)
    if "past_key_values" in kwargs:
        kwargs = dict(past_key_values=transformers.DynamicCache())
    theirs = target().generate(ids, attention_mask=mask, max_new_tokens=3, **kwargs)
    ours = ours if torch.is_tensor(ours) else ours.sequences
    assert torch.equal(ours, theirs if torch.is_tensor(theirs) else theirs.sequences)


def test_trust_remote_code_is_accepted():
    ids, mask = left_pad(PROMPTS[:1])
    out = target().generate(ids, attention_mask=mask, sampler="flash", max_new_tokens=3,
                            trust_remote_code=False)
    assert torch.equal(out, stock(target(), ids, mask, max_new_tokens=3))
