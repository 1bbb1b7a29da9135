"""EAGLE-3 drafts on CUDA: compiled, captured steps (the taps copied inside the target's
graphs, the head's steps graphs of their own). CPU twin: tests/test_eagle3.py (the same
drafter, eager steps, the same reference)."""

from __future__ import annotations

import functools

import pytest
import torch

import flashspec

from flashspec.bench.random_init import peak_weights
from flashspec.generation.engine import cached_engine

from test_eagle3 import head_for, left_padded, reference_drafts, target
from test_generate_gpu import assert_calls_in_turn_agree

pytestmark = pytest.mark.gpu


@functools.lru_cache(maxsize=None)
def _model(dtype):
    model = target().to(device="cuda", dtype=dtype)
    return model, head_for(model)


def _generate(model, ids, mask, **kwargs):
    return model.generate(ids.cuda(), attention_mask=mask.cuda(), sampler="flash",
                          return_dict_in_generate=True, **kwargs)


CASES = [dict(do_sample=False), dict(do_sample=True, top_k=8, seed=11),
         dict(do_sample=True, top_p=0.9, temperature=1.3, seed=2, eos_token_id=7)]


@pytest.mark.parametrize("dtype, invariant", [(torch.float32, False), (torch.bfloat16, True)])
def test_tokens_with_eagle3_drafts_are_the_tokens_without_on_cuda(dtype, invariant):
    """fp32, and bf16 with invariant=True (bitwise invariant kernels): the same tokens with
    EAGLE-3 drafts as without, a ragged batch and one row, greedy and seeded sampling; the
    steps ran as captured graphs."""
    model, head = _model(dtype)
    ids, mask = left_padded()
    for rows in (slice(None), slice(1, 2)):
        for kwargs in CASES:
            plain = _generate(model, ids[rows], mask[rows], max_new_tokens=24,
                              invariant=invariant, **kwargs)
            drafted = _generate(model, ids[rows], mask[rows], max_new_tokens=24, drafter=head,
                                num_assistant_tokens=4, invariant=invariant, **kwargs)
            assert torch.equal(plain.sequences, drafted.sequences), kwargs
            assert int(drafted.flash_stats.drafted.sum()) > 0
    steps = cached_engine(model.model).last_call_steps
    assert {"eagle3_first", "eagle3_next", ("verify", 4)} <= steps, steps


def test_greedy_with_eagle3_drafts_equals_stock_on_cuda():
    model, head = _model(torch.float32)
    ids, mask = left_padded()
    stock = model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=20,
                           do_sample=False)
    drafted = _generate(model, ids, mask, max_new_tokens=20, drafter=head, num_assistant_tokens=3)
    assert torch.equal(drafted.sequences, stock)


class _DraftRecorder:
    """An engine step timer (`Engine.step_timer`) that records, before each verification
    graph's replay, each running row's tokens and the drafts the graphs wrote."""

    def __init__(self, engine):
        self.engine, self.records = engine, []

    def replay(self, key, graph):
        if isinstance(key, tuple) and key[0] == "verify":
            slot = list(self.engine.slots.values())[-1]       # the call's: most recent last
            width = key[1]
            allowed = torch.minimum(slot.num_drafts, slot.end - slot.length - 1)
            for b in range(slot.rows):
                if not bool(slot.finished[b]) and int(allowed[b]) > 0:
                    length = int(slot.length[b])
                    self.records.append((slot.seq[b, :length].tolist(),
                                         slot.drafts[b, :min(width, int(allowed[b]))].tolist()))
        graph.replay()


def test_captured_drafts_equal_the_reference():
    """The drafts the captured steps write (fp32) equal the from-scratch reference's (on
    the CPU copy of the same model), but at near-ties of the reference."""
    model, head = _model(torch.float32)
    ids, mask = left_padded()
    _generate(model, ids, mask, max_new_tokens=24, drafter=head, num_assistant_tokens=3)
    engine = cached_engine(model.model)
    engine.step_timer = recorder = _DraftRecorder(engine)
    try:
        _generate(model, ids, mask, max_new_tokens=24, drafter=head, num_assistant_tokens=3)
    finally:
        engine.step_timer = None
    cpu_model = target()
    cpu_head = head_for(cpu_model)
    assert len(recorder.records) > 20
    compared = 0
    for tokens, drafts in recorder.records:        # left-padded rows: no position offset
        want, margins = reference_drafts(cpu_model, cpu_head, tokens, len(drafts))
        for got, expected, margin in zip(drafts, want, margins):
            assert got == expected or margin < 1e-3, (tokens, drafts, want)
            compared += 1
            if got != expected:
                break
    assert compared > 60


@pytest.mark.parametrize("batch", [1, 8])
def test_calls_of_every_kind_cross_the_capacity_an_earlier_call_sized(batch):
    """On one engine: plain, EAGLE-3, prompt lookup, EAGLE-3 with another draft count, each
    ending at the capacity the first call sized (128 + 128 columns), each followed by a timed
    call (`step_ms`); bf16, peaked weights: the same tokens from every call."""
    model = peak_weights(target().to(device="cuda", dtype=torch.bfloat16))
    head = head_for(model)
    torch.manual_seed(3)
    ids = torch.randint(1, 100, (batch, 128), device="cuda")
    assert_calls_in_turn_agree(model, ids, [
        ({}, 0), (dict(drafter=head, num_assistant_tokens=5), 5),
        (dict(prompt_lookup_num_tokens=5), 5), (dict(drafter=head, num_assistant_tokens=3), 3)])


def test_warmup_captures_what_a_call_with_the_head_needs():
    """`flashspec.warmup(model, drafter=head, ...)` compiles and captures every step a later
    call with that head and draft count runs: the call adds no compilation or capture."""
    model, head = _model(torch.bfloat16)
    ids, mask = left_padded()
    kwargs = dict(drafter=head, num_assistant_tokens=4, do_sample=False)
    flashspec.warmup(model, batch_sizes=(len(ids),), max_length=128, progress=False, **kwargs)
    engine = cached_engine(model.model)
    events = len(engine.events)
    _generate(model, ids, mask, max_new_tokens=24, **kwargs)
    assert engine.events[events:] == []
    assert {"eagle3_first", "eagle3_next", ("verify", 4)} <= engine.last_call_steps
