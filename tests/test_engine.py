"""The engine's own machinery, on CPU (its steps run eagerly here; the same steps are
captured as CUDA graphs on a GPU, see test_generate_gpu.py). test_generate.py pins the
contract of generate(); these pin what the engine adds: the position-addressed KV cache,
its views, growth and compaction, the exact completion of rows the fused kernels flag, one
engine serving every call shape, a drafter of the tests' own, masks for eager attention and
for mixed sliding/full layers, and its refusals."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch
from transformers import Qwen3Config

import flashspec
from flashspec.generation import attention
from flashspec.generation import engine as engine_module
from flashspec.generation import samplers
from flashspec.generation import slot as slot_module
from flashspec.generation.compiled import LOG, DecoderRunner
from flashspec.generation.drafters import AttachedDrafter, Drafter
from flashspec.generation.heads import check_decoder
from flashspec.generation.kv_cache import FULL, SLIDING, WindowCache, layer_kinds

from _models import tiny_draft, tiny_model
from test_generate import PROMPTS, flash, left_pad, stock, target

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
    assert cache.live[0].tolist() == [True] * 5 + [False] * 4      # 8 columns + the spare
    full = masks[FULL][0, 0]
    assert full[:, :5].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert masks[SLIDING][0, 0, 2, :5].int().tolist() == [0, 0, 1, 1, 1]   # positions 2..4
    assert not bool(full[:, 5:].any())


def test_window_cache_ragged_rows_leave_holes_that_compaction_removes():
    cache = WindowCache(2, 8, torch.device("cpu"), {FULL: None}, None)
    cache.begin(torch.tensor([[0, 1, 2], [0, 1, 2]]))
    cache.begin(torch.tensor([[1, 2], [3, 4]]))                     # row 0 drops 1 and 2
    assert cache.columns.tolist() == [3, 4]
    assert cache.live.int().tolist() == [[1, 0, 0, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0, 0]]
    keys = torch.arange(2 * 9, dtype=torch.float32).view(2, 1, 9, 1)
    cache.update(keys[:, :, :2], keys[:, :, :2], 0)                 # creates the layer buffers
    cache.layers[0].keys.copy_(keys)
    cache.compact()
    assert cache.live.int().tolist() == [[1, 1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0, 0]]
    assert cache.position[0, :3].tolist() == [0, 1, 2]
    assert cache.layers[0].keys[0, 0, :3, 0].tolist() == [0.0, 3.0, 4.0]
    assert cache.layers[0].keys[1, 0, :5, 0].tolist() == [9.0, 10.0, 11.0, 12.0, 13.0]


def test_layer_kinds_follow_the_config():
    assert layer_kinds(tiny_model("llama").config) == {FULL: None}
    assert layer_kinds(tiny_model("mistral").config) == {FULL: 6}
    mixed = Qwen3Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=6,
                        max_window_layers=2)
    assert layer_kinds(mixed) == {FULL: None, SLIDING: 6}
    mixed.layer_types = ["full_attention", "linear_attention"]
    assert layer_kinds(mixed) is None


def tight_capacity(monkeypatch):
    """Caches of exactly the columns a step needs, so that holes left by uneven acceptance
    fill them up and the slot grows column by column; returns the list of compactions."""
    compactions = []
    compact = WindowCache.compact
    for module in (slot_module, engine_module):
        monkeypatch.setattr(module, "bucket", lambda columns: columns)
    monkeypatch.setattr(WindowCache, "compact", lambda self: (compactions.append(1), compact(self)))
    return compactions


@pytest.mark.parametrize("drafter", ["assistant", "lookup"])
def test_compaction_and_growth_keep_every_row_exact(monkeypatch, drafter):
    ids, mask = left_pad(PROMPTS)
    kwargs = RAGGED if drafter == "assistant" else dict(prompt_lookup_num_tokens=4)
    sampling = dict(do_sample=True, top_k=0, seed=3, max_new_tokens=24)
    plain = flash(target(), ids, mask, **sampling)
    engine_module.drop_engine(target().model)
    compactions = tight_capacity(monkeypatch)
    fast = flash(target(), ids, mask, **kwargs, **sampling)
    assert compactions
    assert torch.equal(fast.sequences, plain.sequences)
    greedy = flash(target(), ids, mask, max_new_tokens=24, **kwargs)
    assert torch.equal(greedy.sequences, stock(target(), ids, mask, max_new_tokens=24))
    engine_module.drop_engine(target().model)


class _FlaggingSampler(samplers.MaterializedSampler):
    """Flags every other row as needing exact completion and returns garbage for it, as
    the fused kernels do when a truncated support overflows their candidate budget."""

    flagged = 0

    def _flag(self, tokens, status):
        rows = torch.arange(len(status)) % 2 == 0
        _FlaggingSampler.flagged += int(rows.sum())
        return torch.where(rows.view(-1, *[1] * (tokens.dim() - 1)), 7, tokens), \
            torch.where(rows, samplers.NEEDS_COMPLETION, status).to(torch.int32)

    def sample(self, hidden, positions, **edits):
        tokens, logprobs, status = super().sample(hidden, positions, **edits)
        tokens, status = self._flag(tokens, status)
        return tokens, logprobs, status

    def verify(self, hidden, drafts, positions, **edits):
        num_accepted, tokens, logprobs, accept_probs, status = super().verify(
            hidden, drafts, positions, **edits)
        tokens, status = self._flag(tokens, status)
        return num_accepted, tokens, logprobs, accept_probs, status


def _flagged_and_unflagged(monkeypatch, mode):
    """The same seeded call without and with `_FlaggingSampler` (fresh engines): both outputs,
    after checking that rows were flagged and that tokens and logprobs are the same."""
    ids, mask = left_pad(PROMPTS)
    kwargs = dict(RAGGED) if mode == "assistant" else {}
    sampling = dict(do_sample=True, top_k=5, seed=11, max_new_tokens=12, output_logprobs=True)
    engine_module.drop_engine(target().model)
    unflagged = flash(target(), ids, mask, **kwargs, **sampling)
    monkeypatch.setattr(samplers, "MaterializedSampler", _FlaggingSampler)
    _FlaggingSampler.flagged = 0
    engine_module.drop_engine(target().model)
    fast = flash(target(), ids, mask, **kwargs, **sampling)
    engine_module.drop_engine(target().model)
    assert _FlaggingSampler.flagged > 0
    assert torch.equal(fast.sequences, unflagged.sequences)
    torch.testing.assert_close(fast.logprobs, unflagged.logprobs)
    return fast, unflagged


@pytest.mark.parametrize("mode", ["plain", "assistant"])
def test_flagged_rows_are_completed_exactly(monkeypatch, mode):
    fast, unflagged = _flagged_and_unflagged(monkeypatch, mode)
    for name in ("emitted", "accepted"):
        assert torch.equal(getattr(fast.flash_stats, name), getattr(unflagged.flash_stats, name))
    torch.testing.assert_close(fast.flash_stats.accept_probs, unflagged.flash_stats.accept_probs,
                               rtol=1e-5, atol=1e-5)   # fp32 forwards of other shapes


class _Order(list):
    ahead = True


@pytest.fixture
def decoding_ahead(emulated_graphs, monkeypatch):
    """The CUDA decode loop that launches each step before reading the report of the one
    before (`Engine._decode_ahead`), on CPU under emulated graphs. Returns the order of
    launches ("launch") and report reads ("read"); `order.ahead = False` turns it off."""
    order = _Order()

    def ahead(self, slot, plan, stops, warm_widths):
        return (order.ahead and not slot.eager and not self.timed and stops is None
                and plan.streamer is None)

    copy_report, read = slot_module.Slot.copy_report, slot_module.PendingReport.read
    monkeypatch.setattr(engine_module.Engine, "_decodes_ahead", ahead)
    monkeypatch.setattr(slot_module.Slot, "copy_report",
                        lambda self, *args: order.append("launch") or copy_report(self, *args))
    monkeypatch.setattr(slot_module.PendingReport, "read",
                        lambda self: order.append("read") or read(self))
    return order


@pytest.mark.parametrize("mode", ["plain", "assistant", "lookup"])
def test_steps_launched_ahead_of_their_reports_give_the_same_output(decoding_ahead, mode):
    """Launching each step before the host has read the last one's report (rows that finish
    meanwhile emit nothing; near the end a step runs only if some row may still run) gives
    what one step at a time gives: a batch whose rows end at an EOS at different steps,
    seeded sampling, per-row emitted tokens and logprobs."""
    from test_generate import batch_eos_token, mode_kwargs
    ids, mask = left_pad(PROMPTS)
    kwargs = dict(eos_token_id=batch_eos_token(), pad_token_id=0, output_logprobs=True,
                  do_sample=True, top_k=5, seed=3, **mode_kwargs(mode))
    ahead = flash(target(), ids, mask, **kwargs)
    launches = list(decoding_ahead)
    decoding_ahead.ahead = False
    one_at_a_time = flash(target(), ids, mask, **kwargs)
    assert "launch,launch" in ",".join(launches)       # a step was in flight during a read
    assert torch.equal(ahead.sequences, one_at_a_time.sequences)
    torch.testing.assert_close(ahead.logprobs, one_at_a_time.logprobs)
    assert torch.equal(ahead.flash_stats.emitted.sum(dim=0),
                       one_at_a_time.flash_stats.emitted.sum(dim=0))


@pytest.mark.parametrize("mode", ["plain", "assistant"])
def test_flagged_rows_are_completed_exactly_when_steps_run_ahead(decoding_ahead, monkeypatch,
                                                                  mode):
    """A row flagged for exact completion while the next step is already in flight: that
    step computes the row's position again and its report completes it; the output is the
    unflagged run's (tokens, logprobs, tokens per row)."""
    fast, unflagged = _flagged_and_unflagged(monkeypatch, mode)
    assert torch.equal(fast.flash_stats.emitted.sum(dim=0), unflagged.flash_stats.emitted.sum(dim=0))


@pytest.mark.parametrize("schedule, allowed", [
    ("constant", {3}), ("heuristic", {1, 2, 4, 8, 16, 19})])
def test_verification_steps_take_few_distinct_widths(emulated_graphs, monkeypatch, schedule,
                                                     allowed):
    """Each verification width is a compilation and a captured graph on CUDA, so the steps
    after the prompt verify a constant schedule's G (rows near their budget verify padding)
    or the heuristic schedule's next power of two (up to its most drafts, 19 here). The
    tokens stay the plain run's."""
    widths = []
    verify = slot_module.Slot.verify
    monkeypatch.setattr(slot_module.Slot, "verify", lambda self, width: (
        widths.append(width), verify(self, width))[1])
    ids, mask = left_pad(PROMPTS)
    sampling = dict(do_sample=True, top_k=0, seed=4, max_new_tokens=20)
    fast = flash(target(), ids, mask, assistant_model=target(), num_assistant_tokens=3,
                 num_assistant_tokens_schedule=schedule, **sampling)
    assert widths and set(widths) <= allowed
    assert torch.equal(fast.sequences, flash(target(), ids, mask, **sampling).sequences)


def test_padding_stays_inside_the_position_table():
    """GPT-2 learns a table of 256 positions. With prompt + max_new_tokens = 256 and 4 drafts
    per step, all accepted (the model drafts for itself), the prompt of 243 tokens grows to
    248 and 253, where the row may take 2 drafts: the step's 2 padding columns lie past the
    budget. They are fed at positions inside the table (and kept out of the cache), so the
    run ends as the plain run does."""
    model = target("gpt2")
    assert model.config.max_position_embeddings == 256
    ids = torch.randint(1, 100, (1, 243), generator=torch.Generator().manual_seed(0))
    kwargs = dict(assistant_model=model, num_assistant_tokens=4,
                  num_assistant_tokens_schedule="constant", max_new_tokens=13)
    fast = flash(model, ids, **kwargs)
    assert torch.equal(fast.sequences, flash(model, ids, max_new_tokens=13).sequences)


@pytest.mark.parametrize("seed", [3, 11])
def test_ragged_rows_stay_inside_the_position_table(seed):
    """Two rows, one ending at GPT-2's last position, the model sampling and drafting for
    itself: acceptance is ragged, so the row at the end of its budget is padded, or keeps
    drafting, while the other row drafts more (seeds 3 and 11 reach the table's end in the
    assistant's and in the verification's padding). The engine feeds that work at positions
    inside the row's budget and agrees with the plain run."""
    model = target("gpt2")
    g = torch.Generator().manual_seed(0)
    ids, mask = left_pad([torch.randint(1, 100, (243,), generator=g).tolist(),
                          torch.randint(1, 100, (200,), generator=g).tolist()])
    kwargs = dict(assistant_model=model, num_assistant_tokens=4,
                  num_assistant_tokens_schedule="constant", max_new_tokens=13, do_sample=True,
                  seed=seed)
    fast = flash(model, ids, mask, **kwargs)
    plain = flash(model, ids, mask, max_new_tokens=13, do_sample=True, seed=seed)
    assert torch.equal(fast.sequences, plain.sequences)


class _Twin:
    """A second copy of the target (same weights, its own engine): the reference for
    calls that share one engine."""

    def __init__(self):
        self.model = tiny_model("llama")

    def __call__(self, ids, mask, **kwargs):
        engine_module.drop_engine(self.model.model)
        return flash(self.model, ids, mask, **kwargs)


def test_one_engine_serves_every_call_shape():
    """Varied prompt lengths, max_new_tokens, batch sizes, sampling settings and drafters
    run on one engine, alternating, without rebuilding it or its slots, with the tokens of
    a fresh engine for each call (issue 28's CPU acceptance)."""
    model = tiny_model("llama")
    twin = _Twin()
    assistant = tiny_draft("llama")
    g = torch.Generator().manual_seed(5)
    calls = []
    for rows, length, new in [(1, 5, 8), (3, 9, 20), (1, 14, 6), (2, 5, 40), (3, 30, 10), (1, 5, 8)]:
        ids, mask = left_pad([torch.randint(1, 100, (length - r,), generator=g).tolist()
                              for r in range(rows)])
        calls.append((ids, mask, new))
    settings = [dict(), dict(do_sample=True, top_k=20, top_p=0.9, seed=3),
                dict(prompt_lookup_num_tokens=3), dict(assistant_model=assistant, num_assistant_tokens=2),
                dict(do_sample=True, temperature=0.6, seed=[4, 5, 6][:1])]
    engine, slots = None, {}
    for index, (ids, mask, new) in enumerate(calls * 2):
        kwargs = dict(settings[index % len(settings)], max_new_tokens=new)
        if isinstance(kwargs.get("seed"), list):
            kwargs["seed"] = kwargs["seed"] * ids.shape[0]
        out = flash(model, ids, mask, **kwargs)
        assert torch.equal(out.sequences, twin(ids, mask, **kwargs).sequences), (index, kwargs)
        current = engine_module.cached_engine(model.model)
        assert engine is None or current is engine
        engine = current
        for batch, slot in engine.slots.items():
            assert slots.setdefault(batch, slot) is slot          # never rebuilt
    assert sorted(engine.slots) == [1, 2, 3]


def test_a_slot_grows_when_a_call_needs_more_columns():
    """A call longer than the slot's capacity grows it (and its views follow the live
    length: a later short call attends over the smallest view again)."""
    model, twin = tiny_model("llama"), _Twin()
    ids, mask = left_pad(PROMPTS[:2])
    flash(model, ids, mask, max_new_tokens=4)
    slot = engine_module.cached_engine(model.model).slots[2]
    assert slot.capacity == slot_module.MIN_VIEW
    out = flash(model, ids, mask, max_new_tokens=300, prompt_lookup_num_tokens=3)
    assert slot.capacity == 2 * slot_module.MIN_VIEW
    assert torch.equal(out.sequences, twin(ids, mask, max_new_tokens=300).sequences)
    flash(model, ids, mask, max_new_tokens=4)
    assert slot.target.cache.view <= slot_module.MIN_VIEW   # on CPU, the live length's


def _peaked_llama(seed: int, size: str):
    """A tiny Llama whose greedy tokens repeat the current one (flashspec.bench.random_init
    .peak_weights): every draft of another such model, and every prompt lookup, is accepted."""
    from flashspec.bench.random_init import peak_weights
    model = peak_weights(tiny_model("llama", size, seed=seed, wrap=False))
    return flashspec.wrap(model) if size == "target" else model


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_calls_of_every_kind_cross_the_capacity_an_earlier_call_sized(emulated_graphs, batch):
    """Plain, drafted, prompt lookup, plain again on one engine, each call ending exactly at
    the capacity of the slot that the first call sized (a 128-token prompt and 128 new
    tokens: 256 columns), with the buckets and views of CUDA (emulated graphs): every step's
    KV writes stay inside the cache (CPU raises on an index past it) and every call gives
    the same tokens. GPU twin: test_generate_gpu.py's test of the same sequence, timing each
    call's steps as scripts/tok_per_s.py does (where it crashed)."""
    model, assistant = _peaked_llama(0, "target"), _peaked_llama(1, "draft")
    torch.manual_seed(3)
    ids = torch.randint(1, 128, (batch, 128))
    mask = torch.ones_like(ids)
    kinds = [{}, dict(assistant_model=assistant, num_assistant_tokens=5,
                      num_assistant_tokens_schedule="constant"),
             dict(prompt_lookup_num_tokens=5), {}]
    outs = [flash(model, ids, mask, max_new_tokens=128, **kind).sequences for kind in kinds]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    slot = engine_module.cached_engine(model.model).slots[max(2, batch)]
    assert slot.capacity >= 256


class _FixedContinuation(Drafter):
    """A drafter of the tests' own: proposes ``continuation[length - start:]`` for every
    row, where ``length`` is the row's length so far (a known answer, so acceptance is
    predictable)."""

    def __init__(self, continuation: list[int], start: int):
        self.continuation = continuation
        self.start = start
        self.key = ("fixed", tuple(continuation), start)

    def attach(self, slot) -> AttachedDrafter:
        return _AttachedFixed(self, slot)


class _AttachedFixed(AttachedDrafter):
    def __init__(self, drafter: _FixedContinuation, slot):
        self.slot = slot
        self.tokens = torch.tensor(drafter.continuation + [-1] * slot.max_drafts)
        self.first = drafter.start

    def steps(self, width):
        def propose():
            offset = (self.slot.length - self.first).clamp(0, len(self.tokens) - 1)
            index = (offset[:, None] + torch.arange(width)).clamp_max(len(self.tokens) - 1)
            self.slot.drafts[:, :width] = self.tokens[index]
            self.slot.draft_failed[:, :width] = False
        return [(("fixed", width), propose)]


def test_a_drafter_of_the_tests_own_runs_through_generate():
    """The engine runs any `Drafter`: one proposing the greedy continuation (known from a
    plain run) gets every draft accepted; one proposing garbage gets the same tokens."""
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = flash(target(), ids, max_new_tokens=12)
    continuation = plain.sequences[0, 4:].tolist()
    right = flash(target(), ids, max_new_tokens=12, drafter=_FixedContinuation(continuation, 4),
                  num_assistant_tokens=3)
    assert torch.equal(right.sequences, plain.sequences)
    stats = right.flash_stats
    assert int(stats.accepted.sum()) == int(stats.drafted.sum()) > 0
    wrong = flash(target(), ids, max_new_tokens=12, num_assistant_tokens=3,
                  drafter=_FixedContinuation([(t + 1) % 100 for t in continuation], 4))
    assert torch.equal(wrong.sequences, plain.sequences)
    assert int(wrong.flash_stats.drafted.sum()) > 0
    with pytest.raises(ValueError, match="`drafter` is a flashspec option"):
        target().generate(ids, drafter=_FixedContinuation(continuation, 4), max_new_tokens=2)


def test_engine_is_rebuilt_when_the_weights_are_new_tensors():
    """A replaced LM-head weight, or a model moved to another dtype, gets a new engine (the
    old one's samplers and graphs hold the old tensors): the tokens follow the new weights,
    as a fresh engine's do."""
    model = flashspec.wrap(tiny_model("llama"))
    ids, mask = left_pad(PROMPTS)
    sampling = dict(do_sample=True, top_k=5, seed=3, max_new_tokens=8)

    def fresh():
        engine_module.drop_engine(model.model)
        return flash(model, ids, mask, **sampling).sequences

    flash(model, ids, mask, **sampling)
    engine = engine_module.cached_engine(model.model)
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.flip(0).clone())
    fast = flash(model, ids, mask, **sampling).sequences
    assert engine_module.cached_engine(model.model) is not engine
    assert torch.equal(fast, fresh())
    engine = engine_module.cached_engine(model.model)
    model.double()
    fast = flash(model, ids, mask, **sampling).sequences
    assert engine_module.cached_engine(model.model) is not engine
    assert torch.equal(fast, fresh())


def test_materialized_sampler_gives_the_same_tokens():
    ids, mask = left_pad(PROMPTS)
    sampling = dict(do_sample=True, top_p=0.9, seed=5, max_new_tokens=10)
    for kwargs in ({}, RAGGED, dict(prompt_lookup_num_tokens=3)):
        fused = target().generate(ids, attention_mask=mask, sampler="flash", **kwargs, **sampling)
        materialized = target().generate(ids, attention_mask=mask, sampler="materialized",
                                         **kwargs, **sampling)
        assert torch.equal(fused, materialized)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="runs the CUDA steps' attention on CPU tensors through Triton's "
                           "interpreter, which a CUDA machine does not use (its kernel runs "
                           "on the GPU in tests/test_attention_kernel.py)")
@pytest.mark.usefixtures("index_order_dot")
@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_steps_attending_by_position_equal_stock(monkeypatch, arch):
    """The steps' attention by sequence position (`flashspec.generation.attention`, what
    the captured steps on CUDA run; here through Triton's interpreter): grouped heads, a
    sliding window (Mistral), softcapped logits beside sliding and full layers (Gemma-2),
    with a left-padded batch and an assistant's rejected drafts leaving holes: stock's
    greedy tokens."""
    init = DecoderRunner.__init__

    def by_position(self, decoder, *args, **kwargs):
        init(self, decoder, *args, **kwargs)
        self.steps_by_position = attention.unsupported_reason(decoder) is None
    monkeypatch.setattr(DecoderRunner, "__init__", by_position)
    model, assistant = tiny_model(arch), tiny_draft(arch)
    ids, mask = left_pad(PROMPTS[:3])
    expected = stock(model, ids, mask, max_new_tokens=8)
    for kwargs in ({}, dict(assistant_model=assistant, num_assistant_tokens=3)):
        assert torch.equal(flash(model, ids, mask, max_new_tokens=8, **kwargs).sequences,
                           expected)
    runner = engine_module.cached_engine(model.model).target
    assert runner.steps_by_position


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_eager_attention_gets_additive_masks(arch):
    model, assistant = tiny_model(arch), tiny_draft(arch)
    for each in (model, assistant):
        each.set_attn_implementation("eager")
        assert each.config._attn_implementation == "eager"
    ids, mask = left_pad(PROMPTS)
    for kwargs in ({}, dict(assistant_model=assistant, num_assistant_tokens=3)):
        out = flash(model, ids, mask, **kwargs)
        assert torch.equal(out.sequences, stock(model, ids, mask))


def test_mixed_sliding_and_full_layers_equal_stock():
    """Qwen3 with sliding-window layers after two full ones: one mask per layer kind."""
    model = tiny_model("qwen3", num_hidden_layers=4, use_sliding_window=True, sliding_window=5,
                       max_window_layers=2,
                       layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2)
    ids, mask = left_pad(PROMPTS)
    for kwargs in ({}, dict(assistant_model=model, num_assistant_tokens=3),
                   dict(prompt_lookup_num_tokens=3)):
        out = flash(model, ids, mask, max_new_tokens=16, **kwargs)
        assert torch.equal(out.sequences, stock(model, ids, mask, max_new_tokens=16))


def test_attention_it_cannot_address_by_position_is_refused():
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'.*'sdpa'"):
        check_decoder(model.model, "model")
    ids, mask = left_pad(PROMPTS[:1])
    for kwargs, message in [
        (dict(sampler="flash", engine="static"), r"`engine` is not supported"),
        (dict(sampler="fast"), r"`sampler`='fast' is not allowed"),
    ]:
        with pytest.raises(ValueError, match=message):
            target().generate(ids, attention_mask=mask, max_new_tokens=2, **kwargs)


def test_warmup_runs_every_bucket_and_view_and_leaves_the_engine_serving():
    """On CPU nothing compiles or captures, but warm-up still meets every batch size and KV
    view up to max_length through real calls, leaves the engine with those slots, and the
    budget it was given."""
    model = tiny_model("llama")
    result = flashspec.generation.warmup(model, batch_sizes=(1, 3), max_length=600,
                                         prompt_lookup_num_tokens=3, memory_budget=2**30,
                                         progress=False)
    engine = engine_module.cached_engine(model.model)
    assert sorted(engine.slots) == [1, 3]
    assert engine.slots[1].capacity >= 1024 > 600
    assert engine.memory_budget == 2**30 and result["memory"]["budget_bytes"] == 2**30
    assert result["compilations"] == [] and result["captures"] == []
    ids, mask = left_pad(PROMPTS)
    assert torch.equal(flash(model, ids, mask, prompt_lookup_num_tokens=3).sequences,
                       flash(target(), ids, mask).sequences)
    for bad, message in [(dict(max_length=1), "`max_length`"), (dict(batch_sizes=(0,)), "`batch_sizes`"),
                         (dict(memory_budget=-1), "`memory_budget`")]:
        with pytest.raises(ValueError, match=message):
            flashspec.generation.warmup(model, progress=False, **bad)


def test_a_call_over_the_memory_budget_is_refused_naming_what_to_lower():
    model = tiny_model("llama")
    engine_module.set_memory_budget(model.model, 1000)
    ids, mask = left_pad(PROMPTS)
    with pytest.raises(ValueError, match="over its memory budget.*lower max_new_tokens"):
        flash(model, ids, mask, max_new_tokens=4)


def test_the_disk_cache_is_private(tmp_path, monkeypatch):
    """Created 0700; a directory others may write is refused (torch's caches hold pickles)."""
    from flashspec.generation import compiled
    monkeypatch.setenv(compiled.CACHE_ENV, str(tmp_path / "mine"))
    path = compiled.cache_dir()
    assert path.is_dir() and (path.stat().st_mode & 0o777) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv(compiled.CACHE_ENV, str(shared))
    with pytest.raises(PermissionError, match="writable by others"):
        compiled.cache_dir()


def test_compilers_cache_in_the_private_directory(tmp_path, monkeypatch):
    """Inductor's and Triton's caches go under flashspec's directory before anything
    compiles (inductor would otherwise point Triton at its own directory mid-process, and
    the LM-head kernels compiled before it would be looked up elsewhere next time); a
    directory the user chose is kept."""
    from flashspec.generation import compiled
    monkeypatch.setenv(compiled.CACHE_ENV, str(tmp_path / "mine"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "chosen"))
    compiled.use_disk_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine" / "torchinductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "chosen")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    compiled.use_disk_cache()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine" / "triton")
    assert (tmp_path / "mine" / "triton").stat().st_mode & 0o777 == 0o700


def _compiling_runner(self, decoder, role):
    """`Engine.runner` with compilation on whatever the device (here inductor's CPU backend)."""
    if decoder not in self.runners:
        self.runners[decoder] = DecoderRunner(decoder, role, True, self.events)
    return self.runners[decoder]


def test_one_compilation_per_decoder_serves_every_shape(monkeypatch):
    """With compilation on (as on CUDA; here inductor's CPU backend), varied batch sizes,
    prompt lengths, KV views, capacity growth, draft counts and drafters compile each decoder
    once: one graph for the target, one for the assistant, no recompilation."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(engine_module.Engine, "runner", _compiling_runner)
    torch._dynamo.reset()
    model, assistant, reference = tiny_model("qwen3"), tiny_draft("qwen3"), tiny_model("qwen3")
    before = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(0)
    for rows, length, new, kwargs in [
            (2, 5, 8, {}), (3, 9, 20, {}), (2, 140, 130, {}), (4, 14, 12, {}),
            (2, 5, 10, dict(prompt_lookup_num_tokens=3)), (5, 7, 12, dict(prompt_lookup_num_tokens=5)),
            (2, 6, 10, dict(assistant_model=assistant, num_assistant_tokens=3)),
            (6, 8, 12, dict(assistant_model=assistant, num_assistant_tokens=2))]:
        ids = torch.randint(1, 100, (rows, length), generator=g)
        out = model.generate(ids, sampler="flash", max_new_tokens=new, do_sample=False, **kwargs)
        assert torch.equal(out, reference.generate(ids, sampler="flash", max_new_tokens=new,
                                                   do_sample=False)), (rows, length, kwargs)
    events = engine_module.cached_engine(model.model).events
    assert [e.kind for e in events] == ["compile", "compile"]
    assert counters["stats"]["unique_graphs"] - before == 2


def test_layers_compile_once_for_any_depth(monkeypatch):
    """Regional compilation: the layer's compiled code serves every layer, so two decoders of
    one class and widths, 2 and 5 layers deep, compile one graph between them (a whole-decoder
    compilation would trace each stack), and tokens equal the eager engine's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    ids = torch.randint(1, 100, (3, 7), generator=torch.Generator().manual_seed(1))
    for layers in (2, 5):
        stack = dict(num_hidden_layers=layers, layer_types=["full_attention"] * layers)
        eager = flash(tiny_model("qwen3", **stack), ids, max_new_tokens=10, do_sample=False)
        with monkeypatch.context() as patch:
            patch.setattr(engine_module.Engine, "runner", _compiling_runner)
            model = tiny_model("qwen3", **stack)
            compiled = flash(model, ids, max_new_tokens=10, do_sample=False)
            assert [e.kind for e in engine_module.cached_engine(model.model).events] == ["compile"]
        assert torch.equal(compiled.sequences, eager.sequences), layers
    assert counters["stats"]["unique_graphs"] - before == 1


def test_layers_whose_forward_is_replaced_compile_whole():
    """A layer whose forward is replaced on the instance (not by accelerate's hooks) would
    lose the replacement under regional compilation: such decoders are compiled whole."""
    from flashspec.generation.compiled import _decoder_layers

    decoder = tiny_model("qwen3", wrap=False).model
    assert _decoder_layers(decoder) is decoder.layers
    layer = decoder.layers[1]
    layer.forward = layer.forward
    assert _decoder_layers(decoder) is None


def test_layers_under_accelerate_hooks_compile_regionally(monkeypatch):
    """accelerate's hooks (a device_map's) replace a layer's forward with one that moves the
    inputs to the layer's device and calls the layer's own, kept as ``_old_forward``:
    regional compilation replaces that one, inside the hooks, and puts it back after. One
    compilation serves the layers; the tokens equal those of the eager engine."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    from torch._dynamo.utils import counters

    from flashspec.generation.compiled import _decoder_layers

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    ids = torch.randint(1, 100, (3, 7), generator=torch.Generator().manual_seed(1))
    stack = dict(num_hidden_layers=3, layer_types=["full_attention"] * 3)
    eager = flash(tiny_model("qwen3", **stack), ids, max_new_tokens=10, do_sample=False)
    model = tiny_model("qwen3", **stack)
    for layer in model.model.layers:
        add_hook_to_module(layer, AlignDevicesHook(execution_device="cpu", io_same_device=True))
    hooked = [(layer.forward, layer._old_forward) for layer in model.model.layers]
    assert _decoder_layers(model.model) is model.model.layers
    with monkeypatch.context() as patch:
        patch.setattr(engine_module.Engine, "runner", _compiling_runner)
        compiled = flash(model, ids, max_new_tokens=10, do_sample=False)
        assert [e.kind for e in engine_module.cached_engine(model.model).events] == ["compile"]
    assert torch.equal(compiled.sequences, eager.sequences)
    assert counters["stats"]["unique_graphs"] - before == 1
    assert [(layer.forward, layer._old_forward) for layer in model.model.layers] == hooked


def _stats_equal(a, b) -> bool:
    return all(torch.equal(getattr(a, name), getattr(b, name)) for name in ("drafted", "accepted"))


def test_graph_keys_hold_everything_a_step_depends_on(emulated_graphs):
    """Under emulated replay, one engine alternating drafters (prompt lookup with other
    n-gram sizes, two assistants), padded buckets and one-token prompts drafts and emits
    exactly what a fresh engine does for each call."""
    model, twin = tiny_model("llama"), _Twin()
    first, second = tiny_draft("llama"), tiny_draft("llama", seed=5)
    ids, mask = left_pad(PROMPTS[:3])
    one_token = torch.tensor([[5]])
    calls = [(ids, mask, dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=1)),
             (ids, mask, dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=3)),
             (ids, mask, dict(assistant_model=second, num_assistant_tokens=3)),
             (ids, mask, dict(assistant_model=first, num_assistant_tokens=3)),
             (one_token, torch.ones_like(one_token), dict(assistant_model=first, num_assistant_tokens=3)),
             (ids[:1], mask[:1], dict(do_sample=True, top_k=3, seed=2))]
    for ids_, mask_, kwargs in calls * 2:
        kwargs = dict(kwargs, max_new_tokens=12)
        out, fresh = flash(model, ids_, mask_, **kwargs), twin(ids_, mask_, **kwargs)
        assert torch.equal(out.sequences, fresh.sequences), kwargs
        assert _stats_equal(out.flash_stats, fresh.flash_stats), kwargs
    assert sorted(engine_module.cached_engine(model.model).slots) == [2, 4]


def test_after_warmup_calls_capture_nothing(emulated_graphs):
    """Warm-up meets every step a later call of its settings takes, over the slot's final
    buffers: the calls after it add no graph."""
    model = tiny_model("llama")
    assistant = tiny_draft("llama")
    settings = dict(assistant_model=assistant, num_assistant_tokens=10)
    flashspec.generation.warmup(model, batch_sizes=(1, 3), max_length=600, progress=False,
                                **settings)
    captured = len(emulated_graphs)
    g = torch.Generator().manual_seed(3)
    for rows, length, new in [(1, 20, 40), (3, 300, 100), (2, 500, 90)]:
        ids = torch.randint(1, 100, (rows, length), generator=g)
        flash(model, ids, max_new_tokens=new, **settings)
    assert [key[1:2] + key[3:4] + key[-1:] for key in emulated_graphs[captured:]] == []


class _FlagRowOne(samplers.MaterializedSampler):
    """Flags row 1 as needing completion at every step (and gives it garbage)."""

    def sample(self, hidden, positions):
        tokens, logprobs, status = super().sample(hidden, positions)
        return tokens, logprobs, torch.where(torch.arange(len(status)) == 1,
                                             samplers.NEEDS_COMPLETION, status).to(torch.int32)


def test_rows_padding_a_bucket_never_ask_for_work(emulated_graphs, monkeypatch):
    """A batch of one runs in a bucket of two: the padding row is finished from the start,
    so whatever the kernels flag for it, nothing is completed or reported for it."""
    completions = []
    complete = samplers.complete_sample
    monkeypatch.setattr(samplers, "complete_sample",
                        lambda *args: (completions.append(1), complete(*args))[1])
    ids = torch.tensor([[5, 6, 7]])
    plain = flash(target(), ids, max_new_tokens=6, do_sample=True, seed=1).sequences
    model = tiny_model("llama")
    monkeypatch.setattr(samplers, "MaterializedSampler", _FlagRowOne)
    out = flash(model, ids, max_new_tokens=6, do_sample=True, seed=1)
    assert torch.equal(out.sequences, plain) and not completions
    assert engine_module.cached_engine(model.model).slots[2].batch_size == 2


def test_prompts_are_read_for_the_call_rows_only(emulated_graphs):
    """Three rows in a bucket of four: the prompt's forward (target's and assistant's) reads
    the three rows, not the row that pads the bucket, and the tokens are stock's."""
    model, assistant = tiny_model("llama"), tiny_draft("llama")
    ids, mask = left_pad(PROMPTS[:3])
    want = stock(model, ids, mask, max_new_tokens=8)       # greedy: the same for every drafter
    shapes = []

    def record(module, args, kwargs):
        if kwargs.get("past_key_values") is not None:          # the engine's forwards
            shapes.append(tuple(kwargs["input_ids"].shape))

    for decoder in (model.model, assistant.model):
        decoder.register_forward_pre_hook(record, with_kwargs=True)
    for kwargs in ({}, dict(prompt_lookup_num_tokens=3),
                   dict(assistant_model=assistant, num_assistant_tokens=3)):
        shapes.clear()
        out = flash(model, ids, mask, max_new_tokens=8, **kwargs)
        assert torch.equal(out.sequences, want), kwargs
        prompt_reads = [rows for rows, width in shapes if width >= ids.shape[1]]
        steps = [rows for rows, width in shapes if width < ids.shape[1]]
        assert prompt_reads and set(prompt_reads) == {3}, (kwargs, shapes)
        assert steps and set(steps) == {4}, (kwargs, shapes)


def test_more_end_of_sequence_ids_than_a_slot_holds():
    eos = list(range(100, 100 + 2 * slot_module.EOS_SLOTS))
    ids, mask = left_pad(PROMPTS)
    for _ in range(2):                       # the second call reuses the widened buffer
        out = flash(target(), ids, mask, eos_token_id=eos, max_new_tokens=16)
        assert torch.equal(out.sequences, stock(target(), ids, mask, eos_token_id=eos,
                                                max_new_tokens=16))


def test_memory_follows_what_is_generated_not_the_limit():
    """max_new_tokens of 10**12 with an EOS three tokens away: the run ends at the EOS, in a
    slot of the smallest capacity (nothing is sized by the limit)."""
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7]])
    plain = flash(model, ids, max_new_tokens=6).sequences
    eos = int(plain[0, 5])
    for kwargs in ({}, dict(prompt_lookup_num_tokens=3)):
        out = flash(model, ids, max_new_tokens=10**12, eos_token_id=eos, **kwargs).sequences
        assert torch.equal(out, plain[:, :6])
    assert engine_module.cached_engine(model.model).slots[1].capacity == slot_module.MIN_VIEW


def test_ngram_context_follows_the_slot_not_the_limit():
    """no_repeat_ngram_size's context holds what a row can hold, growing with the slot: a
    call with max_new_tokens=10**12 and max_time allocates a context of the slot's columns
    (it took memory by the limit: 32 GiB for this call), and a call that grows its slot
    past 256 columns keeps its context and equals stock."""
    model = tiny_model("llama")
    ids = torch.tensor([[1]])
    flash(model, ids, max_new_tokens=10**12, max_time=0.1, no_repeat_ngram_size=2)
    slot = engine_module.cached_engine(model.model).slots[1]
    assert slot.edit_state.context.shape[1] <= 2 * slot.seq.shape[1]
    out = flash(model, ids, max_new_tokens=300, no_repeat_ngram_size=2).sequences
    assert slot.capacity > slot_module.MIN_VIEW
    assert torch.equal(out, stock(model, ids, max_new_tokens=300, no_repeat_ngram_size=2))


@pytest.mark.parametrize("verify", [False, True])
def test_compiled_kernel_variants_cover_every_sampling_setting(verify):
    """The variants a call compiles up front (`samplers.kernel_settings`) are every variant
    that rows sharing one sampling setting select: a later call changing only its sampling
    options compiles no kernel."""
    from flashspec.kernels.ops import kernel_variant
    from flashspec.params import SamplingParams
    vocab = 1000
    compiled = {kernel_variant(SamplingParams.create(2, **setting), vocab, verify)
                for setting in samplers.kernel_settings(vocab).values()}
    assert len(compiled) == len(samplers.kernel_settings(vocab))
    settings = [dict(do_sample=False), dict(temperature=0.0)] + [
        dict(temperature=t, top_k=k, top_p=p, min_p=m)
        for t in (0.6, 1.0) for k in (0, 1, 20, vocab, vocab + 1)
        for p in (1.0, 0.95) for m in (0.0, 0.05)]
    for setting in settings:
        assert kernel_variant(SamplingParams.create(2, **setting), vocab, verify) in compiled, setting


@pytest.mark.alone
def test_max_time_bounds_a_call_with_long_drafts():
    """`max_time` counts from the call's start and caps each step's drafts by the time left
    (4,000 drafts per step would take seconds): the call overruns by at most about one step."""
    model, assistant = tiny_model("llama"), tiny_draft("llama")
    ids = torch.randint(1, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    kwargs = dict(sampler="flash", max_new_tokens=100_000, do_sample=False,
                  assistant_model=assistant, num_assistant_tokens=4000, pad_token_id=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                 # tiny matmuls: no thread pool to wait for
    try:
        seconds, one_forward, out = _timed_calls(model, ids, kwargs)
    finally:
        torch.set_num_threads(threads)
    assert out.shape[1] > ids.shape[1] + 1
    assert seconds < 0.5 + 0.2 + one_forward, (seconds, one_forward)


def _timed_calls(model, ids, kwargs):
    model.generate(ids, max_time=0.05, **kwargs)           # the engine and its slot exist
    started = time.monotonic()
    out = model.generate(ids, max_time=0.5, **kwargs)
    seconds = time.monotonic() - started
    return seconds, _one_forward(model, ids), out


def _one_forward(model, ids) -> float:
    """Seconds of a call that runs one forward (and the rest of a call's work)."""
    started = time.monotonic()
    model.generate(ids, sampler="flash", max_new_tokens=1, pad_token_id=0)
    return time.monotonic() - started


class _SlowCompile:
    """A CPU twin of a first compilation: installed as each runner's compiled forward, it
    waits `SECONDS` (inductor takes 5-40 s on CUDA) the first time, then runs the eager
    forward, so the engine's runners report that a step would compile."""

    SECONDS = 2.0

    def __init__(self, monkeypatch):
        self.waits = []
        init = DecoderRunner.__init__
        twin = self

        def patched(runner, *args, **kwargs):
            init(runner, *args, **kwargs)

            def compiled(*forward_args, inputs=None):
                if not runner.compiled:
                    twin.waits.append(runner.role)
                    time.sleep(twin.SECONDS)
                return runner._forward(*forward_args, inputs=inputs)

            runner.compile, runner._compiled = True, compiled

        monkeypatch.setattr(DecoderRunner, "__init__", patched)


@pytest.mark.alone
@pytest.mark.parametrize("drafts", ["plain", "assistant"])
def test_max_time_runs_uncompiled_where_its_steps_would_compile(monkeypatch, drafts):
    """A call with max_time whose steps would compile (here a twin compilation of 2 s) runs
    uncompiled: no compilation, one line in the log, greedy tokens exactly stock's, within
    max_time + 0.2 s + one forward. A call without max_time then compiles."""
    slow = _SlowCompile(monkeypatch)
    model = tiny_model("llama")
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    kwargs = dict(sampler="flash", do_sample=False, pad_token_id=0)
    if drafts == "assistant":
        kwargs.update(assistant_model=tiny_draft("llama"), num_assistant_tokens=4)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    LOG.addHandler(handler)
    level = LOG.level
    LOG.setLevel(logging.INFO)          # whatever FLASHSPEC_LOG_LEVEL says
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        started = time.monotonic()
        out = model.generate(ids, max_time=0.3, max_new_tokens=100_000, **kwargs)
        seconds = time.monotonic() - started
        one_forward = _one_forward(model, ids)
    finally:
        torch.set_num_threads(threads)
        LOG.removeHandler(handler)
        LOG.setLevel(level)
    assert seconds < 0.3 + 0.2 + one_forward, (seconds, one_forward)
    assert slow.waits == []
    engine = engine_module.cached_engine(model.model)
    assert not [e for e in engine.events if e.kind == "compile"]
    assert [line for line in lines if "runs uncompiled" in line] == [
        "this call has max_time and would compile the model's forward (LlamaModel): it runs "
        "uncompiled (eager forwards, no CUDA graphs, the LM head by torch ops); "
        "flashspec.warmup() with this call's settings prepares it"]
    new = out.shape[1] - ids.shape[1]
    assert new > 1
    want = stock(model, ids, max_new_tokens=new)
    for ours, theirs in zip(out.tolist(), want.tolist()):
        while ours[-1] == 0:                  # a row the clock stopped earlier is padded
            ours.pop()
        assert ours == theirs[:len(ours)]
    model.generate(ids, max_new_tokens=4, **kwargs)
    roles = ["model", "assistant_model"] if drafts == "assistant" else ["model"]
    assert sorted(slow.waits) == sorted(roles)
    assert [e.kind for e in engine.events] == ["compile"] * len(roles)


def test_warmup_meets_every_width_of_a_timed_call(emulated_graphs):
    """Warm-up verifies at each width a call with max_time can meet (powers of two up to
    the draft count), besides the schedule's own: after it, such calls find every step
    captured."""
    model, assistant = tiny_model("llama"), tiny_draft("llama")
    flashspec.generation.warmup(model, assistant_model=assistant, num_assistant_tokens=6,
                                batch_sizes=(1,), max_length=300, progress=False)
    engine = engine_module.cached_engine(model.model)
    slot = engine.slots[2]
    assert engine.timed_widths(slot) == [1, 2, 4, 6]
    verified = {key[3] for key in emulated_graphs if key[3][0] == "verify"}
    assert verified == {("verify", 1), ("verify", 2), ("verify", 4), ("verify", 6)}


def test_the_cache_goes_by_the_name_the_model_takes_it():
    """transformers 5.24 renamed decoders' and layers' ``past_key_values`` to ``cache`` (the
    old name warns there): the runner passes it by the name the forward declares."""
    from flashspec.generation.compiled import cache_keyword

    def before(self, input_ids=None, past_key_values=None, use_cache=None):
        pass

    def after(self, input_ids=None, cache=None, use_cache=None):
        pass

    assert cache_keyword(before) == "past_key_values"
    assert cache_keyword(after) == "cache"
    assert cache_keyword(lambda self, x, **kwargs: x) == "past_key_values"  # the old name


def test_a_step_cut_by_time_verifies_only_its_own_drafts(monkeypatch):
    """A step whose drafts `max_time` cut to 3 verifies 4 columns (a power of two, one graph
    per width); the fourth holds no draft of this step, so nothing is proposed there (an
    earlier step's fourth draft would be verified and counted again otherwise)."""
    widths = iter([4, 3] * 50)
    monkeypatch.setattr(engine_module, "_width_in_time", lambda width, *args: next(widths))
    model, assistant = tiny_model("llama"), tiny_draft("llama")
    ids = torch.randint(1, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, sampler="flash", max_new_tokens=40, do_sample=False,
                         assistant_model=assistant, num_assistant_tokens=4, max_time=100.0,
                         assistant_confidence_threshold=0, pad_token_id=0,
                         return_dict_in_generate=True)
    # The prefill drafts nothing; each step emits one token (these drafts are all rejected),
    # so the row's token budget cuts only the last few steps' drafts.
    drafted = out.flash_stats.drafted[1:31, 0].tolist()
    assert drafted == [4, 3] * 15


def test_a_failed_capture_leaves_no_cycle_holding_its_graph(monkeypatch):
    """A capture that raises frees its graph when the caller drops the error, not at some
    later garbage collection (which may come inside another capture, where freeing a graph
    can break it). CUDA's capture API is stood in for on the CPU; the garbage collector is
    off, so only reference counts free anything. GPU twin:
    test_generate_gpu.py::test_a_capture_that_fails_midway_leaves_later_calls_working."""
    import contextlib
    import gc
    import types
    import weakref

    graphs = []

    class Graph:
        def __init__(self):
            graphs.append(weakref.ref(self))

    capturing = [False]

    @contextlib.contextmanager
    def graph(graph, pool=None, stream=None, capture_error_mode=None):
        capturing[0] = True
        try:
            yield
        finally:
            capturing[0] = False

    def stream():
        return types.SimpleNamespace(wait_stream=lambda other: None)

    cuda = torch.cuda
    for name, value in [("Stream", stream), ("current_stream", stream),
                        ("stream", lambda s: contextlib.nullcontext()),
            ("CUDAGraph", Graph), ("graph", graph), ("memory_reserved", lambda device: 0),
            ("graph_pool_handle", lambda: object()), ("empty_cache", lambda: None)]:
        monkeypatch.setattr(cuda, name, value)
    monkeypatch.setattr(engine_module, "_anchor", lambda pool, stream, mode: object())
    engine = object.__new__(engine_module.Engine)
    engine.events, engine.graph_bytes, engine.pool = [], 0, object()
    engine.other_gpus, engine.capture_stream = None, stream()
    engine.device = torch.device("cpu")
    engine.head = types.SimpleNamespace(shards=None)
    slot = types.SimpleNamespace(state_tensors=lambda: [], batch_size=2, caches=[])

    def step():
        if capturing[0]:
            raise ValueError("refused inside a capture")

    enabled = gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(ValueError, match="refused inside a capture"):
            engine._capture(slot, "plain", step)
        assert len(graphs) == 1 and graphs[0]() is None
    finally:
        if enabled:
            gc.enable()
