"""Regression tests from the engine review: what must be refused or reported, never sampled
from the wrong distribution, and corner cases of the running batch."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from transformers import (CompileConfig, DynamicCache, LlamaForCausalLM, MambaConfig,
                          MambaForCausalLM, StaticCache)

import flashspec
from flashspec.generation.drafters import PromptLookupDrafter

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
        # Step 0 is the prefill (one token per row); step 1 drafts.
        if emitted.shape[0] > 2 and emitted[1, 0] == 1 and emitted[1, 1] >= 2:
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


class _ScaledLogits(LlamaForCausalLM):
    """A head transform flashspec does not know: logits * `scale` after the LM head."""

    scale = 1.1

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * self.scale
        return out


class _TripledLogits(_ScaledLogits):
    scale = 3.0


def test_unknown_head_transform_is_refused():
    model = tiny_model("llama")
    tripled = _TripledLogits(model.config).eval()
    tripled.load_state_dict(model.state_dict())
    flashspec.wrap(tripled)
    ids, mask = left_pad(PROMPTS[:1])
    with pytest.raises(ValueError, match="transforms its logits after the LM head"):
        tripled.generate(ids, attention_mask=mask, sampler="flash", max_new_tokens=2)


@pytest.mark.parametrize("cls, refused", [(LlamaForCausalLM, False), (_ScaledLogits, True)])
def test_the_head_check_catches_small_transforms_in_bf16_at_a_real_width(cls, refused):
    """bf16, hidden 2,048 and 32,000 tokens: the tolerance follows each logit's rounding,
    not the dot products' size (about sqrt(D) larger), so a 10% multiplier is seen."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32_000, hidden_size=2048, intermediate_size=256,
                                      num_hidden_layers=1, num_attention_heads=16,
                                      num_key_value_heads=8, pad_token_id=0)
    model = flashspec.wrap(cls(config).to(torch.bfloat16).eval())
    ids = torch.tensor([[5, 6, 7]])
    if refused:
        with pytest.raises(ValueError, match="transforms its logits after the LM head"):
            model.generate(ids, sampler="flash", max_new_tokens=1)
    else:
        model.generate(ids, sampler="flash", max_new_tokens=1)


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


def _compile_everywhere() -> CompileConfig:
    """A compile_config stock honours on any device (transformers' own tests force it so)."""
    config = CompileConfig()
    config._compile_all_devices = True
    return config


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_beams=2), r"`num_beams`=2 \(set in the call\) selects transformers' 'beam_search'"),
    (dict(guidance_scale=1.5), "classifier-free guidance"),
    (dict(assistant_early_exit=1), "self-speculation by early exit"),
    (dict(position_ids=torch.arange(10)[None] + 2), "`position_ids` are not the positions"),
    (dict(compile_config=_compile_everywhere(), cache_implementation="static"),
     r"`compile_config` \(set in the call\) with a static cache on cpu: stock compiles"),
    (dict(compile_config=_compile_everywhere(), past_key_values="static"),
     r"`compile_config` \(set in the call\) with a static cache on cpu: stock compiles"),
])
def test_other_methods_defer_to_stock_with_a_warning(kwargs, message):
    """What the engine does not do runs stock generate (same tokens), with a warning."""
    ids, mask = left_pad(PROMPTS[:1])
    # A model of its own: a static cache's size is remembered on the model (transformers'
    # `_previous_max_cache_length`), which `target()` shares between tests.
    model = tiny_model("llama")
    if kwargs.get("past_key_values") == "static":       # a passed static cache, one per call
        kwargs = {**kwargs, "past_key_values": None}
        make = lambda: StaticCache(config=model.config, max_cache_len=16)  # noqa: E731
    else:
        make = None
    # Stock's torch.compile (a compile_config's) runs its graphs eagerly: what is tested is
    # who runs the call, not inductor on this machine.
    with torch.compiler.set_stance("force_eager"):
        if make is not None:
            kwargs["past_key_values"] = make()
        with pytest.warns(UserWarning, match=message):
            ours = model.generate(ids, attention_mask=mask, sampler="flash", max_new_tokens=3,
                                  **kwargs)
        if make is not None:
            kwargs["past_key_values"] = make()
        theirs = model.generate(ids, attention_mask=mask, max_new_tokens=3, **kwargs)
    ours = ours if torch.is_tensor(ours) else ours.sequences
    assert torch.equal(ours, theirs if torch.is_tensor(theirs) else theirs.sequences)


@pytest.mark.parametrize("kwargs", [
    dict(compile_config=CompileConfig(), cache_implementation="static"),  # not on this device
    dict(compile_config=_compile_everywhere()),                           # a dynamic cache
    dict(compile_config=_compile_everywhere(), cache_implementation="static", disable_compile=True),
    dict(compile_config=_compile_everywhere(), cache_implementation="static", use_cache=False),
    # Stock compiles only greedy search and sampling, never assisted generation.
    dict(compile_config=_compile_everywhere(), cache_implementation="static",
         prompt_lookup_num_tokens=2),
    dict(compile_config=_compile_everywhere(), cache_implementation="static", drafter="own"),
    dict(compile_config=_compile_everywhere(), past_key_values="dynamic"),
])
def test_a_compile_config_stock_would_not_use_runs_on_the_engine(kwargs):
    """Where stock would not compile the forward with the call's `compile_config` (it warns
    and skips compilation), the option changes nothing and the engine runs the call, with
    stock's tokens."""
    ids, mask = left_pad(PROMPTS[:2])
    model = tiny_model("llama")         # its own: it makes static caches
    if kwargs.get("drafter") == "own":
        kwargs = {**kwargs, "drafter": PromptLookupDrafter(2)}   # a caller's own drafter
    if kwargs.get("past_key_values") == "dynamic":
        kwargs = {**kwargs, "past_key_values": DynamicCache()}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*defers this call to stock.*")
        warnings.filterwarnings("error", message=".*compile_config.*")
        ours = model.generate(ids, attention_mask=mask, sampler="flash", max_new_tokens=4,
                              return_dict_in_generate=True, **kwargs)
    assert ours.flash_stats is not None                     # the engine's output
    # Stock's assisted generation refuses a static cache, and runs no drafter of flashspec's;
    # greedy tokens are the same without drafts.
    plain = {name: DynamicCache() if name == "past_key_values" else value
             for name, value in kwargs.items() if name not in ("prompt_lookup_num_tokens", "drafter")}
    theirs = model.generate(ids, attention_mask=mask, max_new_tokens=4,
                            return_dict_in_generate=True, **plain)
    assert torch.equal(ours.sequences, theirs.sequences)


def test_trust_remote_code_is_accepted():
    ids, mask = left_pad(PROMPTS[:1])
    out = target().generate(ids, attention_mask=mask, sampler="flash", max_new_tokens=3,
                            trust_remote_code=False)
    assert torch.equal(out, stock(target(), ids, mask, max_new_tokens=3))


# --------------------------------------------------------------------------------------
# Issue 36: every input gets stock's result or a clear error (tests/test_fuzz_generate.py
# draws them at random; these are the table, one row each)
# --------------------------------------------------------------------------------------

_IDS = torch.tensor([[5, 6, 7, 8]])


@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=1.5),                                   # 2 tokens, as stock
    dict(max_new_tokens=3, num_return_sequences=-1),            # means 1, as stock
    dict(max_new_tokens=3, max_length=2),                       # max_length unread, as stock
    dict(max_new_tokens=3, do_sample=False, temperature="0.5"),  # unread when greedy
])
def test_values_stock_accepts_give_stock_tokens(kwargs):
    assert torch.equal(target().generate(_IDS, sampler="flash", **kwargs),
                       target().generate(_IDS, **kwargs))


def test_values_stock_accepts_when_sampling_run():
    """top_k=2**63 keeps everything, top_p=0 keeps the most likely token (the greedy one)."""
    out = target().generate(_IDS, sampler="flash", do_sample=True, top_k=2**63, max_new_tokens=3,
                            seed=0)
    assert out.shape == (1, 7)
    kept_one = target().generate(_IDS, sampler="flash", do_sample=True, top_p=0.0, top_k=0,
                                 max_new_tokens=4, seed=0)
    assert torch.equal(kept_one, target().generate(_IDS, max_new_tokens=4))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(do_sample=True, temperature=[0.5, 1.0]), ValueError,
     r"`temperature`=\[0.5, 1.0\] \(list\) \(set in the call\) is not allowed: with do_sample=True"),
    (dict(do_sample=True, temperature="0.5"), ValueError, r"`temperature`='0.5' \(str\)"),
    (dict(do_sample=True, top_p="0.9"), TypeError, r"`top_p`='0.9' \(str\) \(set in the call\)"),
    (dict(do_sample=True, temperature=0), ValueError,
     r"`temperature`=0 .*float > 0 \(for greedy decoding set do_sample=False\)"),
    (dict(max_new_tokens="3"), TypeError, r"`max_new_tokens`='3' \(str\)"),
    (dict(max_new_tokens=0), ValueError, r"`max_new_tokens`=0 .*must be > 0"),
    (dict(max_new_tokens=float("inf")), ValueError, r"`max_new_tokens`=inf .*must be finite"),
    (dict(num_return_sequences=2.0, do_sample=True), TypeError, r"`num_return_sequences`=2.0"),
    (dict(eos_token_id="3"), TypeError, r"`eos_token_id`='3' \(str\)"),
    (dict(max_time="1"), TypeError, r"`max_time`='1' \(str\)"),
    (dict(do_sample="no"), TypeError, r"`do_sample`='no' \(str\)"),
    (dict(input_ids=_IDS[:, :0]), ValueError, r"`input_ids` must have shape .* got \(1, 0\)"),
    (dict(input_ids=_IDS + VOCAB), ValueError, r"`input_ids` must be token ids in \[0, 128\)"),
    (dict(input_ids=_IDS.float()), ValueError, r"`input_ids` must be an int64 or int32 tensor"),
])
def test_bad_values_name_option_value_and_source(kwargs, error, match):
    ids = kwargs.pop("input_ids", _IDS)
    kwargs.setdefault("max_new_tokens", 3)
    with pytest.raises(error, match=match):
        target().generate(ids, sampler="flash", **kwargs)


def test_a_value_from_the_models_generation_config_is_named_so():
    model = tiny_model("llama")
    model.generation_config.top_k = 5.0
    with pytest.raises(ValueError, match=r"`top_k`=5.0 \(from the model's generation_config"):
        model.generate(_IDS, sampler="flash", do_sample=True, max_new_tokens=2)
    with pytest.raises(TypeError, match="`generation_config` must be a transformers GenerationConfig"):
        model.generate(_IDS, {"do_sample": True}, sampler="flash", max_new_tokens=2)


def test_every_seed_of_the_range_serves_every_row():
    out = target().generate(torch.tensor([[5, 6], [7, 8]]), sampler="flash", do_sample=True,
                            max_new_tokens=2, seed=2**63 - 1, num_return_sequences=2)
    assert out.shape == (4, 4)


def test_huge_limit_allocates_by_what_is_generated():
    model = target()
    out = model.generate(_IDS, sampler="flash", max_new_tokens=10**12,
                         eos_token_id=list(range(VOCAB)))
    assert out.shape == (1, 5)
    assert all(slot.capacity <= 256 for slot in model.model._flashspec_engine.slots.values())


def test_int32_ids_and_other_inputs_stock_takes_give_stock_tokens():
    """int32 ids, holed masks, the position_ids stock derives and inputs_embeds run on the
    engine, and so do right-padded masks; other position_ids run on stock generate (a
    warning says so). All give stock's tokens (tests/test_cache_and_inputs.py and
    tests/test_right_padding.py have the rest)."""
    model = target()
    assert torch.equal(model.generate(_IDS.int(), sampler="flash", max_new_tokens=3),
                       model.generate(_IDS, max_new_tokens=3))
    for kwargs in (dict(attention_mask=torch.tensor([[1, 0, 1, 1]])),
                   dict(attention_mask=torch.tensor([[1, 1, 1, 0]])),
                   dict(position_ids=torch.arange(4)[None]),
                   dict(inputs_embeds=model.get_input_embeddings()(_IDS).detach())):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*defers this call to stock")
            ours = model.generate(_IDS, sampler="flash", max_new_tokens=3, **kwargs)
        assert torch.equal(ours, model.generate(_IDS, max_new_tokens=3, **kwargs))
    for kwargs in (dict(position_ids=torch.arange(4)[None] + 3),):
        with pytest.warns(UserWarning, match="defers this call to stock"):
            ours = model.generate(_IDS, sampler="flash", max_new_tokens=3, **kwargs)
        assert torch.equal(ours, model.generate(_IDS, max_new_tokens=3, **kwargs))


def test_lm_head_hooks_are_seen_on_every_call():
    """A hook registered after a first call is applied (materialized path, as stock applies
    it) and forgotten once removed; hooks on the model itself hand the call to stock."""
    model = tiny_model("llama")
    plain = model.generate(_IDS, sampler="flash", max_new_tokens=4)
    handle = model.lm_head.register_forward_hook(
        lambda module, args, out: out + 100.0 * (torch.arange(out.shape[-1]) == 3))
    with pytest.warns(UserWarning, match="forward hook .* on lm_head"):
        hooked = model.generate(_IDS, sampler="flash", max_new_tokens=4)
    assert torch.equal(hooked, model.generate(_IDS, max_new_tokens=4))
    assert hooked[0, 4:].tolist() == [3, 3, 3, 3]
    handle.remove()
    assert torch.equal(model.generate(_IDS, sampler="flash", max_new_tokens=4), plain)
    handle = model.register_forward_pre_hook(lambda module, args: None)
    with pytest.warns(UserWarning, match="forward pre-hook .* on model: the engine never runs"):
        model.generate(_IDS, sampler="flash", max_new_tokens=4)
    handle.remove()


class _NudgedLogits(_ScaledLogits):
    """A head transform of 0.1% (logits * 1.001): far above fp32 rounding."""

    scale = 1.001


def test_head_check_tolerance_follows_the_dtype():
    model = tiny_model("llama")
    nudged = flashspec.wrap(_NudgedLogits(model.config).eval())
    nudged.load_state_dict(model.state_dict())
    with pytest.raises(ValueError, match="transforms its logits.*rounding in torch.float32"):
        nudged.generate(_IDS, sampler="flash", max_new_tokens=2)
    # bf16 rounds logits by 2**-8: the same model in bf16 passes its own check
    out = flashspec.wrap(tiny_model("llama").to(torch.bfloat16)).generate(
        _IDS, sampler="flash", max_new_tokens=2)
    assert out.shape == (1, 6)


def test_head_check_is_redone_when_the_weight_changes_in_place():
    model = tiny_model("llama")
    tripled = flashspec.wrap(_TripledLogits(model.config).eval())
    tripled.load_state_dict(model.state_dict())
    with torch.no_grad():
        tripled.lm_head.weight.zero_()       # 3 * 0 == 0: the transform is invisible
    tripled.generate(_IDS, sampler="flash", max_new_tokens=2)
    tripled.load_state_dict(model.state_dict())      # in place: same storage
    with pytest.raises(ValueError, match="transforms its logits after the LM head"):
        tripled.generate(_IDS, sampler="flash", max_new_tokens=2)


def test_a_model_in_training_mode_is_named_with_the_remedy():
    model = tiny_model("gpt2").train()
    with pytest.raises(ValueError, match=r"is in training mode .*call model.eval\(\)"):
        model.generate(_IDS, sampler="flash", max_new_tokens=3)


def test_remove_invalid_values_substitutes_nan_as_stock():
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight[7, 0] = float("nan")
    kwargs = dict(max_new_tokens=3, remove_invalid_values=True)
    assert torch.equal(model.generate(_IDS, sampler="flash", **kwargs),
                       model.generate(_IDS, **kwargs))


@pytest.mark.parametrize("limits", [dict(max_new_tokens=10**400), dict(max_length=10**400),
                                    dict(max_time=10**400, max_new_tokens=3)],
                         ids=["max_new_tokens", "max_length", "max_time"])
def test_limits_beyond_the_floats_range_run_as_stock_does(limits):
    """An int too large for a float is still a finite limit (stock compares it exactly)."""
    model, ids = target(), torch.tensor([[5, 6, 7]])
    stop = dict(eos_token_id=list(range(VOCAB))) if "max_time" not in limits else {}
    out = model.generate(ids, sampler="flash", pad_token_id=0, **stop, **limits)
    assert out.shape[1] > ids.shape[1]
