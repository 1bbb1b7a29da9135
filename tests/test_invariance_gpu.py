"""Bitwise invariance in bf16 on CUDA with the invariant decoder kernels (issue 29): a row's
seeded tokens are the same alone, drafted by itself, by prompt lookup and by an assistant,
and in a batch. Qwen3-0.6B shape, random weights, LM head x3 so that Gumbel races are close;
with cuBLAS and PyTorch's reductions (``invariant=False``) this fails (H100, 2026-11-25:
4 and 6 of 8 rows equal).

CPU twins: tests/test_invariant_kernels.py (each kernel's row invariance, under the
interpreter) and tests/test_invariance.py (the comparison itself, bf16 on CPU)."""

import pytest
import torch

import flashspec
from flashspec.bench.invariance import (WAYS, equal_rows, invariance_runs, repeating_prompts,
                                        scaled_head)
from flashspec.bench.random_init import random_model
from flashspec.generation.engine import drop_engine

pytestmark = pytest.mark.gpu

ROWS, NEW_TOKENS = 8, 64


@pytest.mark.parametrize("sampling", [dict(do_sample=True, temperature=1.0, top_k=0),
                                      dict(do_sample=False)], ids=["sampled", "greedy"])
def test_tokens_do_not_depend_on_drafts_or_batch_on_cuda(sampling):
    model = flashspec.wrap(random_model("qwen3-0.6b", device="cuda", dtype=torch.bfloat16))
    assistant = random_model("qwen3-0.6b", device="cuda", dtype=torch.bfloat16, seed=1)
    scaled_head(model, 3.0)
    for m in (model, assistant):
        m.generation_config.eos_token_id = None
    ids = repeating_prompts(ROWS, 64, model.config.vocab_size, "cuda")
    try:
        runs = invariance_runs(model, assistant, ids, NEW_TOKENS, sampling,
                               ways=WAYS, invariant=True)
    finally:
        drop_engine(model.model)
    counts = equal_rows(runs["tokens"])
    assert {way: counts[way]["equal"] for way in WAYS} == {way: ROWS for way in WAYS}
