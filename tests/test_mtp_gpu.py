"""MTP drafts on CUDA: the MTP layer's steps captured beside the target's (CPU twin:
tests/test_mtp.py, the same checkpoint)."""

from __future__ import annotations

import pytest
import torch
from transformers import Glm4MoeForCausalLM

import flashspec
from flashspec.generation.engine import cached_engine

from test_mtp import LAYERS, prompts, write_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("glm4_moe_mtp")
    write_checkpoint(folder)
    loaded = Glm4MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    loaded._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}\..*"]
    return flashspec.wrap(loaded)


def test_mtp_tokens_on_cuda_are_stocks_and_the_tokens_without(model):
    ids, mask = (t.cuda() for t in prompts())
    stock = model.generate(ids[:1], max_new_tokens=20, do_sample=False, use_mtp=True)
    flash = model.generate(ids[:1], max_new_tokens=20, do_sample=False, use_mtp=True,
                           sampler="flash")
    assert torch.equal(flash, stock)
    for drafts in (1, 3):
        for sampling in (dict(do_sample=False), dict(do_sample=True, top_k=8, seed=3)):
            plain = model.generate(ids, attention_mask=mask, max_new_tokens=16, sampler="flash",
                                   **sampling)
            drafted = model.generate(ids, attention_mask=mask, max_new_tokens=16,
                                     sampler="flash", use_mtp=True, num_assistant_tokens=drafts,
                                     **sampling)
            assert torch.equal(drafted, plain), (drafts, sampling)
    assert {"mtp_first", "mtp_next", ("verify", 3)} <= cached_engine(model.model).last_call_steps
