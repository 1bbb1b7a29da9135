"""MTP drafts on CUDA: the MTP layer's steps captured beside the target's (CPU twin:
tests/test_mtp.py, the same checkpoint).

bf16: transformers' MoE experts run grouped GEMMs there; in float32 under torch.compile
they fall back to a loop that reads the expert counts on the host, which no CUDA graph can
capture (the engine's steps of any such MoE model, measured 2026-11-28)."""

from __future__ import annotations

import pytest
import torch
from transformers import Glm4MoeForCausalLM

import flashspec
from flashspec.bench.statistics import is_near_tie
from flashspec.generation.engine import cached_engine

from test_mtp import LAYERS, prompts, write_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the bf16 model on CUDA, the same weights in float64 on the CPU: judges near-ties)."""
    folder = tmp_path_factory.mktemp("glm4_moe_mtp")
    write_checkpoint(folder)
    loaded = Glm4MoeForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    loaded._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}\..*"]
    reference = Glm4MoeForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    return flashspec.wrap(loaded), reference


def _same_or_near_tie(reference, ids, mask, got, want):
    """Greedy rows equal, or their first difference a near-tie of the float64 model."""
    for row in range(len(ids)):
        a, b = got[row].cpu(), want[row].cpu()
        if torch.equal(a, b):
            continue
        k = int((a != b).nonzero()[0])
        assert k >= ids.shape[1], "the prompt itself differs"
        kept = mask[row].cpu().bool().tolist() + [True] * (k - ids.shape[1])
        with torch.no_grad():
            logits = reference(a[:k][kept][None]).logits[0, -1]
        assert is_near_tie(logits, False, 1.0, 0, 1.0, 0.0, torch.zeros_like(logits),
                           int(a[k]), int(b[k]), tol=2e-2), (row, k, int(a[k]), int(b[k]))


def test_mtp_tokens_on_cuda_are_the_tokens_without(models):
    model, reference = models
    ids, mask = (t.cuda() for t in prompts())
    stock = model.generate(ids[:1], max_new_tokens=20, do_sample=False, use_mtp=True)
    flash = model.generate(ids[:1], max_new_tokens=20, do_sample=False, use_mtp=True,
                           sampler="flash")
    _same_or_near_tie(reference, ids[:1], mask[:1], flash, stock)
    for drafts in (1, 3):
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=16, sampler="flash",
                               do_sample=False)
        drafted = model.generate(ids, attention_mask=mask, max_new_tokens=16, sampler="flash",
                                 use_mtp=True, num_assistant_tokens=drafts, do_sample=False)
        _same_or_near_tie(reference, ids, mask, drafted, plain)
    assert {"mtp_first", "mtp_next", ("verify", 3)} <= cached_engine(model.model).last_call_steps


def test_warmup_captures_what_a_call_with_mtp_needs(models):
    """`flashspec.warmup(model, use_mtp=True, ...)` compiles and captures every step a
    later `use_mtp` call with that draft count runs: the call adds no compilation or capture."""
    model, _ = models
    ids, mask = (t.cuda() for t in prompts())
    kwargs = dict(use_mtp=True, num_assistant_tokens=2, do_sample=False)
    flashspec.warmup(model, batch_sizes=(len(ids),), max_length=64, progress=False, **kwargs)
    engine = cached_engine(model.model)
    events = len(engine.events)
    model.generate(ids, attention_mask=mask, max_new_tokens=16, sampler="flash", **kwargs)
    assert engine.events[events:] == []
    assert {"mtp_first", "mtp_next", ("verify", 2)} <= engine.last_call_steps
