"""Bitwise invariance in bf16 on CPU: a row's seeded tokens are the same alone, in a batch,
and with any drafter (issue 29's CPU part; its GPU part needs the decoder forward itself to
be invariant, see test_generate_gpu.py).

Tiny bf16 Llama, LM head scaled down so that Gumbel races are close: a forward whose hidden
state differs in its last bit from the plain run's would change tokens, which
`test_a_one_ulp_difference_is_seen` shows this comparison catches.
"""

from __future__ import annotations

import functools

import pytest
import torch

from flashspec.generation.compiled import DecoderRunner

from _models import tiny_draft, tiny_model

ROWS, NEW_TOKENS = 16, 32


def _bf16(model):
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.div_(4.0)          # HEAD_SCALE 6 -> 1.5: close races
    return model


def _prompts() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    halves = torch.randint(1, 128, (ROWS, 8), generator=g)
    return torch.cat([halves, halves], dim=1)   # repeated n-grams: prompt lookup drafts


SAMPLINGS = {"sampled": dict(do_sample=True, top_k=0), "greedy": dict(do_sample=False)}
DRAFTERS = ("plain", "self", "assistant", "lookup")


def _runs(sampling: str, drafters=DRAFTERS) -> dict:
    """Each row's tokens generated alone with each of `drafters`, and the rows in one batch
    (with "plain" among `drafters`)."""
    model, assistant = _bf16(tiny_model("llama")), _bf16(tiny_draft("llama"))
    ids, seeds = _prompts(), torch.arange(ROWS)
    kwargs = dict(sampler="flash", max_new_tokens=NEW_TOKENS, pad_token_id=0, **SAMPLINGS[sampling])
    every = dict(assistant_confidence_threshold=0)      # full-width verifications
    drafting = {"plain": {}, "self": dict(assistant_model=model, num_assistant_tokens=5, **every),
                "assistant": dict(assistant_model=assistant, num_assistant_tokens=3, **every),
                "lookup": dict(prompt_lookup_num_tokens=4)}
    runs = {name: torch.cat([model.generate(ids[r:r + 1], seed=seeds[r:r + 1], **drafting[name],
                                            **kwargs) for r in range(ROWS)])
            for name in drafters}
    if "plain" in drafters:
        runs["batch"] = model.generate(ids, seed=seeds, **kwargs)
    return runs


@functools.lru_cache(maxsize=None)
def _unaltered_runs(sampling: str) -> dict:
    """`_runs` of every drafter, made once (the one-ulp test compares with its plain run)."""
    return _runs(sampling)


def _equal_rows(runs: dict, plain: torch.Tensor) -> dict:
    return {name: int((tokens == plain).all(dim=1).sum()) for name, tokens in runs.items()}


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_bf16_tokens_do_not_depend_on_drafts_or_batch(sampling):
    runs = _unaltered_runs(sampling)
    assert _equal_rows(runs, runs["plain"]) == {name: ROWS for name in
                                                ("plain", "self", "assistant", "lookup", "batch")}


def test_a_one_ulp_difference_is_seen(monkeypatch):
    """Verification forwards whose hidden states are one bf16 ulp off (what an M-dependent
    GEMM does on a GPU) change some self-drafted row: the comparison above has teeth."""
    plain = _unaltered_runs("sampled")["plain"]
    step = DecoderRunner.step

    def one_ulp_off(self, cache, input_ids, *args):
        hidden = step(self, cache, input_ids, *args)
        if input_ids.shape[1] > 2:                # a verification, not a one-token step
            hidden = torch.nextafter(hidden, torch.full_like(hidden, float("inf")))
        return hidden

    monkeypatch.setattr(DecoderRunner, "step", one_ulp_off)
    assert _equal_rows(_runs("sampled", drafters=("self",)), plain)["self"] < ROWS


def test_only_the_first_token_comes_from_the_eager_prefill(monkeypatch):
    """An eager forward and a compiled step round differently (inductor fuses casts; on a
    GPU it computes transcendental functions its own way), so no generated position may
    come from the eager prefill in one run and from a step in another. With the prefill's
    hidden states garbled past the prompt, self-drafted tokens still equal the plain ones:
    the prefill reads the prompt only, and drafts begin at the next step."""
    forward = DecoderRunner.forward
    prompt_width = _prompts().shape[1]

    def garbled_past_the_prompt(self, cache, input_ids, *args, **kwargs):
        hidden = forward(self, cache, input_ids, *args, **kwargs)
        return torch.cat([hidden[:, :prompt_width], -hidden[:, prompt_width:]], dim=1)

    monkeypatch.setattr(DecoderRunner, "forward", garbled_past_the_prompt)
    model = tiny_model("llama")
    ids = _prompts()[:4]
    kwargs = dict(sampler="flash", max_new_tokens=12, pad_token_id=0, do_sample=False)
    plain = model.generate(ids, **kwargs)
    assert torch.equal(model.generate(ids, assistant_model=model, num_assistant_tokens=4,
                                      **kwargs), plain)


# ---- generate(invariant=True): the invariant decoder kernels (interpreted on CPU) -------------

def _engine_runners(model) -> set:
    engine = model.model._flashspec_engine
    return {slot.target.runner.invariant for slot in engine.slots.values()}


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.usefixtures("index_order_dot")
def test_invariant_kernels_give_the_same_tokens_with_drafts_and_in_a_batch(monkeypatch):
    """The CPU twin of test_invariance_gpu.py: with ``invariant=True`` the target's forwards
    run the invariant kernels (on CPU through Triton's interpreter: every linear layer and
    attention of every forward goes through them), and each row's seeded tokens are the same
    alone, drafted by itself and by prompt lookup, and in a batch. (On CPU the torch path is
    invariant for this model too; the GPU test is the one that fails without the kernels.)"""
    from flashspec.kernels import attention, invariant

    calls = {"linear": 0, "attention": 0}
    for module, name in ((invariant, "linear"), (attention, "attention")):
        run = getattr(module, name)

        def counted(*args, _run=run, _name=name, **kwargs):
            calls[_name] += 1
            return _run(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    model = tiny_model("llama").to(DEVICE)
    ids, seeds = _prompts()[:3].to(DEVICE), torch.arange(3)
    kwargs = dict(sampler="flash", max_new_tokens=6, pad_token_id=0, do_sample=True, top_k=0,
                  invariant=True)
    alone = torch.cat([model.generate(ids[r:r + 1], seed=seeds[r:r + 1], **kwargs)
                       for r in range(3)])
    assert _engine_runners(model) == {True}
    assert torch.equal(model.generate(ids, seed=seeds, **kwargs), alone)
    assert torch.equal(model.generate(ids, seed=seeds, prompt_lookup_num_tokens=3, **kwargs), alone)
    assert torch.equal(model.generate(ids, seed=seeds, assistant_model=model,
                                      num_assistant_tokens=3, **kwargs), alone)
    layers = model.config.num_hidden_layers
    # 7 linear layers and one attention per layer, per forward: prefills and steps
    assert calls["attention"] >= 4 * 6 * layers and calls["linear"] == 7 * calls["attention"]


def test_switching_invariant_rebuilds_the_slot_with_the_other_kernels():
    model = tiny_model("llama").to(DEVICE)
    ids = _prompts()[:2].to(DEVICE)
    kwargs = dict(sampler="flash", max_new_tokens=2, pad_token_id=0, do_sample=False)
    first = model.generate(ids, **kwargs)
    assert _engine_runners(model) == {False}
    model.generate(ids, invariant=True, **kwargs)
    assert _engine_runners(model) == {True}
    assert torch.equal(model.generate(ids, **kwargs), first)
    assert _engine_runners(model) == {False}


@pytest.mark.parametrize("call, error, words", [
    (dict(sampler="flash", invariant="yes"), TypeError, "`invariant` must be True or False"),
    (dict(invariant=True), ValueError, "`invariant` is a flashspec option"),
    (dict(sampler="flash", invariant=True, num_beams=2), ValueError,
     "`invariant` needs flashspec's engine"),
])
def test_invariant_is_checked(call, error, words):
    model = tiny_model("llama")
    with pytest.raises(error, match=words):
        model.generate(_prompts()[:1], max_new_tokens=2, pad_token_id=0, **call)


@pytest.mark.usefixtures("index_order_dot")
def test_invariant_runs_softcapped_sliding_window_attention():
    """Gemma-2 (attention logits softcapped, sliding-window and full layers): seeded tokens
    alone equal those of a batch and of prompt lookup with ``invariant=True``."""
    model = tiny_model("gemma2").to(DEVICE)
    ids, seeds = _prompts()[:2].to(DEVICE), torch.arange(2)
    kwargs = dict(sampler="flash", max_new_tokens=5, pad_token_id=0, do_sample=True, top_k=0,
                  invariant=True)
    alone = torch.cat([model.generate(ids[r:r + 1], seed=seeds[r:r + 1], **kwargs)
                       for r in range(2)])
    assert torch.equal(model.generate(ids, seed=seeds, **kwargs), alone)
    assert torch.equal(model.generate(ids, seed=seeds, prompt_lookup_num_tokens=2, **kwargs),
                       alone)
