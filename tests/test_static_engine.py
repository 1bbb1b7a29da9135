"""The static engine's own machinery, on CPU (its steps run eagerly here; the same steps are
captured as CUDA graphs on a GPU, see test_generate_gpu.py). Every test of test_generate.py
also runs on this engine; these pin what only it has: the position-addressed window cache
and its compaction, the exact completion of rows the fused kernels flag, engine reuse,
masks for eager attention and for mixed sliding/full layers, and its refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

import flashspec
from flashspec.generation import samplers, static
from flashspec.generation.window import FULL, SLIDING, WindowCache, layer_kinds

from _models import tiny_draft, tiny_model
from test_generate import PROMPTS, flash, left_pad, stock, target, tiny_tokenizer

# Sampled rows drafted for greedily by their own model: uneven acceptance per row.
RAGGED = dict(assistant_model=target(), num_assistant_tokens=4,
              num_assistant_tokens_schedule="constant")


def test_window_cache_rolls_back_by_position():
    """A batch of one reuses a rejected entry's column at once; a query sees the live
    entries at or before its position only (and within the window)."""
    cache = WindowCache(1, 8, torch.device("cpu"), {FULL: None, SLIDING: 3}, None)
    cache.begin(torch.arange(4)[None, :])                        # positions 0..3
    assert cache.columns.tolist() == [0, 1, 2, 3]
    masks = cache.begin(torch.tensor([[2, 3, 4]]))                 # 2 and 3 are stale
    assert cache.columns.tolist() == [2, 3, 4]
    assert cache.live[0].tolist() == [True] * 5 + [False] * 3
    full = masks[FULL][0, 0]
    assert full[:, :5].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert masks[SLIDING][0, 0, 2, :5].int().tolist() == [0, 0, 1, 1, 1]   # positions 2..4
    assert not bool(full[:, 5:].any())


def test_window_cache_ragged_rows_leave_holes_that_compaction_removes():
    cache = WindowCache(2, 8, torch.device("cpu"), {FULL: None}, None)
    cache.begin(torch.tensor([[0, 1, 2], [0, 1, 2]]))
    cache.begin(torch.tensor([[1, 2], [3, 4]]))                     # row 0 drops 1 and 2
    assert cache.columns.tolist() == [3, 4]
    assert cache.live.int().tolist() == [[1, 0, 0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    keys = torch.arange(2 * 8, dtype=torch.float32).view(2, 1, 8, 1)
    cache.update(keys[:, :, :2], keys[:, :, :2], 0)                 # creates the layer buffers
    cache.layers[0].keys.copy_(keys)
    cache.compact()
    assert cache.live.int().tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    assert cache.position[0, :3].tolist() == [0, 1, 2]
    assert cache.layers[0].keys[0, 0, :3, 0].tolist() == [0.0, 3.0, 4.0]
    assert cache.layers[0].keys[1, 0, :5, 0].tolist() == [8.0, 9.0, 10.0, 11.0, 12.0]


def test_layer_kinds_follow_the_config():
    assert layer_kinds(tiny_model("llama").config) == {FULL: None}
    assert layer_kinds(tiny_model("mistral").config) == {FULL: 6}
    mixed = Qwen3Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=6,
                        max_window_layers=2)
    assert layer_kinds(mixed) == {FULL: None, SLIDING: 6}
    mixed.layer_types = ["full_attention", "linear_attention"]
    assert layer_kinds(mixed) is None


def tight_capacity(monkeypatch):
    """Caches of exactly prompt + max_new_tokens + 1 columns, so that holes left by uneven
    acceptance fill them up; returns the list of compactions."""
    compactions = []
    compact = WindowCache.compact
    monkeypatch.setattr(static, "_round_up", lambda value, multiple: value)
    monkeypatch.setattr(WindowCache, "compact", lambda self: (compactions.append(1), compact(self)))
    return compactions


@pytest.mark.parametrize("drafter", ["assistant", "lookup"])
def test_compaction_keeps_every_row_exact(monkeypatch, drafter):
    compactions = tight_capacity(monkeypatch)
    ids, mask = left_pad(PROMPTS)
    kwargs = RAGGED if drafter == "assistant" else dict(prompt_lookup_num_tokens=4)
    sampling = dict(do_sample=True, top_k=0, seed=3, max_new_tokens=24)
    fast = flash(target(), ids, mask, engine="static", **kwargs, **sampling)
    eager = flash(target(), ids, mask, engine="eager", **kwargs, **sampling)
    assert compactions
    assert torch.equal(fast.sequences, eager.sequences)
    greedy = flash(target(), ids, mask, engine="static", max_new_tokens=24, **kwargs)
    assert torch.equal(greedy.sequences, stock(target(), ids, mask, max_new_tokens=24))


class _FlaggingSampler(samplers.MaterializedSampler):
    """Flags every other row as needing exact completion and returns garbage for it, as
    the fused kernels do when a truncated support overflows their candidate budget."""

    flagged = 0

    def _flag(self, tokens, status):
        rows = torch.arange(len(status)) % 2 == 0
        _FlaggingSampler.flagged += int(rows.sum())
        return torch.where(rows.view(-1, *[1] * (tokens.dim() - 1)), 7, tokens), \
            torch.where(rows, samplers.NEEDS_COMPLETION, status).to(torch.int32)

    def sample(self, hidden, positions):
        tokens, logprobs, status = super().sample(hidden, positions)
        tokens, status = self._flag(tokens, status)
        return tokens, logprobs, status

    def verify(self, hidden, drafts, positions):
        num_accepted, tokens, logprobs, accept_probs, status = super().verify(hidden, drafts,
                                                                              positions)
        tokens, status = self._flag(tokens, status)
        return num_accepted, tokens, logprobs, accept_probs, status


@pytest.mark.parametrize("mode", ["plain", "assistant"])
def test_flagged_rows_are_completed_exactly(monkeypatch, mode):
    monkeypatch.setattr(samplers, "MaterializedSampler", _FlaggingSampler)
    _FlaggingSampler.flagged = 0
    static.drop_engine(target().model)
    ids, mask = left_pad(PROMPTS)
    kwargs = dict(RAGGED) if mode == "assistant" else {}
    sampling = dict(do_sample=True, top_k=5, seed=11, max_new_tokens=12, output_logprobs=True)
    fast = flash(target(), ids, mask, engine="static", **kwargs, **sampling)
    static.drop_engine(target().model)
    eager = flash(target(), ids, mask, engine="eager", **kwargs, **sampling)
    assert _FlaggingSampler.flagged > 0
    assert torch.equal(fast.sequences, eager.sequences)
    torch.testing.assert_close(fast.logprobs, eager.logprobs)
    for name in ("emitted", "accepted"):
        assert torch.equal(getattr(fast.flash_stats, name), getattr(eager.flash_stats, name))
    torch.testing.assert_close(fast.flash_stats.accept_probs, eager.flash_stats.accept_probs,
                               rtol=1e-5, atol=1e-5)   # fp32 forwards of other shapes


@pytest.mark.parametrize("drafter, schedule", [
    ("assistant", "constant"), ("assistant", "heuristic"), ("self", "constant"),
    ("self", "heuristic"), ("lookup", None)])
def test_speculation_stats_equal_the_eager_loop(drafter, schedule):
    """Same drafts per step and row, same acceptances, same emitted counts, same p(x)."""
    ids, mask = left_pad(PROMPTS)
    kwargs = {"assistant": dict(assistant_model=tiny_draft("llama")),
              "self": dict(assistant_model=target()),
              "lookup": dict(prompt_lookup_num_tokens=3)}[drafter]
    if schedule is not None:
        kwargs.update(num_assistant_tokens=3, num_assistant_tokens_schedule=schedule)
    sampling = dict(do_sample=True, top_k=0, seed=4, max_new_tokens=20)
    fast = flash(target(), ids, mask, engine="static", **kwargs, **sampling).flash_stats
    eager = flash(target(), ids, mask, engine="eager", **kwargs, **sampling).flash_stats
    for name in ("drafted", "accepted", "emitted"):
        assert torch.equal(getattr(fast, name), getattr(eager, name)), name
    assert fast.accept_probs.gt(0).any() and fast.accept_probs.lt(1).any()
    torch.testing.assert_close(fast.accept_probs, eager.accept_probs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule, allowed", [
    ("constant", {3}), ("heuristic", {1, 2, 4, 8, 16, 19})])
def test_verification_steps_take_few_distinct_widths(monkeypatch, schedule, allowed):
    """Each verification width is a compilation and a captured graph on CUDA, so the steps
    after the prompt verify a constant schedule's G (rows near their budget verify padding)
    or the heuristic schedule's next power of two (up to its most drafts, 19 here). The
    tokens and statistics stay the eager loop's."""
    widths = []
    verify = static._Engine._verify
    monkeypatch.setattr(static._Engine, "_verify", lambda self, width, prompt=None: (
        widths.append(width) if prompt is None else None, verify(self, width, prompt))[1])
    ids, mask = left_pad(PROMPTS)
    kwargs = dict(assistant_model=target(), num_assistant_tokens=3,
                  num_assistant_tokens_schedule=schedule, do_sample=True, top_k=0, seed=4,
                  max_new_tokens=20)
    fast = flash(target(), ids, mask, engine="static", **kwargs)
    eager = flash(target(), ids, mask, engine="eager", **kwargs)
    assert widths and set(widths) <= allowed
    assert torch.equal(fast.sequences, eager.sequences)
    assert torch.equal(fast.flash_stats.drafted, eager.flash_stats.drafted)


def test_padding_stays_inside_the_position_table():
    """GPT-2 learns a table of 256 positions. With prompt + max_new_tokens = 256 and 4 drafts
    per step, all accepted (the model drafts for itself), the prompt of 243 tokens grows to
    248 and 253, where the row may take 2 drafts: the step's 2 padding columns lie past the
    budget. They are fed at positions inside the table (and kept out of the cache), so the
    run ends as the eager loop's does."""
    model = target("gpt2")
    assert model.config.max_position_embeddings == 256
    ids = torch.randint(1, 100, (1, 243), generator=torch.Generator().manual_seed(0))
    kwargs = dict(assistant_model=model, num_assistant_tokens=4,
                  num_assistant_tokens_schedule="constant", max_new_tokens=13)
    fast = flash(model, ids, engine="static", **kwargs)
    eager = flash(model, ids, engine="eager", **kwargs)
    assert torch.equal(fast.sequences, eager.sequences)


@pytest.mark.parametrize("seed", [3, 11])
def test_ragged_rows_stay_inside_the_position_table(seed):
    """Two rows, one ending at GPT-2's last position, the model sampling and drafting for
    itself: acceptance is ragged, so the row at the end of its budget is padded, or keeps
    drafting, while the other row drafts more (seed 3 overran the table in the eager loop's
    assistant, seed 11 in its verification). Both engines feed that work at positions inside
    the row's budget and agree."""
    model = target("gpt2")
    g = torch.Generator().manual_seed(0)
    ids, mask = left_pad([torch.randint(1, 100, (243,), generator=g).tolist(),
                          torch.randint(1, 100, (200,), generator=g).tolist()])
    kwargs = dict(assistant_model=model, num_assistant_tokens=4,
                  num_assistant_tokens_schedule="constant", max_new_tokens=13, do_sample=True,
                  seed=seed)
    fast = flash(model, ids, mask, engine="static", **kwargs)
    eager = flash(model, ids, mask, engine="eager", **kwargs)
    assert torch.equal(fast.sequences, eager.sequences)


def test_engine_is_reused_by_calls_of_the_same_shape():
    static.drop_engine(target().model)
    ids, mask = left_pad(PROMPTS)
    first = flash(target(), ids, mask, engine="static", **RAGGED).sequences
    engine = static.cached_engine(target().model)
    again = flash(target(), ids, mask, engine="static", **RAGGED).sequences
    assert static.cached_engine(target().model) is engine
    assert torch.equal(first, again)
    flash(target(), ids[:2], mask[:2], engine="static", **RAGGED)
    assert static.cached_engine(target().model) is not engine


def test_engine_is_reused_across_top_k_values_that_pick_the_same_kernels():
    """Sampling parameters enter the engine as values; only the flags that select kernel
    variants key it. Top-k 20 and 10 share one engine (and its graphs); a top-k of the
    vocabulary size (128) or more keeps everything, another variant, another engine."""
    static.drop_engine(target().model)
    ids, mask = left_pad(PROMPTS)
    sampling = dict(do_sample=True, seed=1, max_new_tokens=8)
    flash(target(), ids, mask, engine="static", top_k=20, **sampling)
    engine = static.cached_engine(target().model)
    tokens = flash(target(), ids, mask, engine="static", top_k=10, **sampling).sequences
    assert static.cached_engine(target().model) is engine
    assert torch.equal(tokens, flash(target(), ids, mask, engine="eager", top_k=10,
                                     **sampling).sequences)
    flash(target(), ids, mask, engine="static", top_k=128, **sampling)
    assert static.cached_engine(target().model) is not engine


def test_engine_is_rebuilt_when_the_weights_are_new_tensors():
    """A replaced LM-head weight, or a model moved to another dtype, gets a new engine (the
    old one's samplers and graphs hold the old tensors): the tokens follow the new weights,
    as the eager loop's do."""
    model = flashspec.wrap(tiny_model("llama"))
    ids, mask = left_pad(PROMPTS)
    sampling = dict(do_sample=True, top_k=5, seed=3, max_new_tokens=8)
    flash(model, ids, mask, engine="static", **sampling)
    engine = static.cached_engine(model.model)
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.flip(0).clone())
    fast = flash(model, ids, mask, engine="static", **sampling).sequences
    assert static.cached_engine(model.model) is not engine
    assert torch.equal(fast, flash(model, ids, mask, engine="eager", **sampling).sequences)
    engine = static.cached_engine(model.model)
    model.double()
    fast = flash(model, ids, mask, engine="static", **sampling).sequences
    assert static.cached_engine(model.model) is not engine
    assert torch.equal(fast, flash(model, ids, mask, engine="eager", **sampling).sequences)


def test_materialized_sampler_gives_the_same_tokens():
    ids, mask = left_pad(PROMPTS)
    sampling = dict(do_sample=True, top_p=0.9, seed=5, max_new_tokens=10)
    for kwargs in ({}, RAGGED, dict(prompt_lookup_num_tokens=3)):
        fused = target().generate(ids, attention_mask=mask, sampler="flash", engine="static",
                                  **kwargs, **sampling)
        materialized = target().generate(ids, attention_mask=mask, sampler="materialized",
                                         **kwargs, **sampling)
        assert torch.equal(fused, materialized)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_eager_attention_gets_additive_masks(arch):
    model, assistant = tiny_model(arch), tiny_draft(arch)
    for each in (model, assistant):
        each.set_attn_implementation("eager")
        assert each.config._attn_implementation == "eager"
    ids, mask = left_pad(PROMPTS)
    for kwargs in ({}, dict(assistant_model=assistant, num_assistant_tokens=3)):
        out = flash(model, ids, mask, engine="static", **kwargs)
        assert torch.equal(out.sequences, stock(model, ids, mask))


def test_mixed_sliding_and_full_layers_equal_stock():
    """Qwen3 with sliding-window layers after two full ones: one mask per layer kind."""
    model = tiny_model("qwen3", num_hidden_layers=4, use_sliding_window=True, sliding_window=5,
                       max_window_layers=2,
                       layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2)
    ids, mask = left_pad(PROMPTS)
    for kwargs in ({}, dict(assistant_model=model, num_assistant_tokens=3),
                   dict(prompt_lookup_num_tokens=3)):
        out = flash(model, ids, mask, engine="static", max_new_tokens=16, **kwargs)
        assert torch.equal(out.sequences, stock(model, ids, mask, max_new_tokens=16))


def test_static_engine_refusals_and_auto_fallback():
    ids, mask = left_pad(PROMPTS[:1])
    tokenizer = tiny_tokenizer()
    with pytest.raises(ValueError, match="static engine cannot run.*stop strings"):
        target().generate(ids, attention_mask=mask, sampler="flash", engine="static",
                          max_new_tokens=4, stop_strings=["x"], tokenizer=tokenizer)
    target().generate(ids, attention_mask=mask, sampler="flash", engine="auto",
                      max_new_tokens=4, stop_strings=["x"], tokenizer=tokenizer)
    for kwargs, message in [
        (dict(sampler="flash", engine="fast"), r"`engine`='fast' is not allowed"),
        (dict(engine="static"), r"`engine` is a flashspec option"),
        (dict(sampler="materialized", engine="eager"), r"runs on the static engine"),
    ]:
        with pytest.raises(ValueError, match=message):
            target().generate(ids, attention_mask=mask, max_new_tokens=2, **kwargs)


def test_non_finite_logits_are_reported_by_the_static_engine():
    broken = tiny_model("llama")
    with torch.no_grad():
        broken.lm_head.weight[7, 0] = float("nan")
    ids, mask = left_pad(PROMPTS[:2])
    with pytest.raises(flashspec.NonFiniteLogitsError, match="the model"):
        broken.generate(ids, attention_mask=mask, sampler="flash", engine="static",
                        max_new_tokens=3, do_sample=True)
    assistant = tiny_model("llama")
    with torch.no_grad():
        assistant.lm_head.weight[7, 0] = float("inf")
    with pytest.raises(flashspec.NonFiniteLogitsError, match="assistant_model"):
        target().generate(ids, attention_mask=mask, sampler="flash", engine="static",
                          max_new_tokens=3, assistant_model=assistant)
