"""Structured output on CUDA: the masked steps captured, split in two graphs (the decoder's
forward, the LM head's step reading the masks, filled on the host between them). CPU twin:
tests/test_structured_output.py (the same calls, eager steps)."""

from __future__ import annotations

import functools
import json

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM

import flashspec
from flashspec.assets import tiny_pair_path
from flashspec.generation.engine import cached_engine

from test_structured_output import (REGEX, SCHEMAS, SPECS, encoded, generated_texts, pair,
                                    stock_processor)

pytestmark = pytest.mark.gpu


@functools.lru_cache(maxsize=None)
def _cuda_pair(dtype):
    """The tiny pair on CUDA in `dtype`: target (wrapped), draft, tokenizer."""
    path = tiny_pair_path()
    target = AutoModelForCausalLM.from_pretrained(path / "target", dtype=dtype)
    draft = AutoModelForCausalLM.from_pretrained(path / "draft", dtype=dtype)
    return flashspec.wrap(target.cuda().eval()), draft.cuda().eval(), pair()[2]


def _captured(model) -> set:
    engine = cached_engine(model.model)
    assert any(event.kind == "capture" for event in engine.events)
    return engine.last_call_steps


@pytest.mark.parametrize("kind, source", SPECS, ids=["nested", "enums", "array", "numbers",
                                                     "regex", "ebnf"])
def test_greedy_tokens_are_stocks_on_cuda(kind, source):
    """fp32, a left-padded batch of three: stock's tokens with xgrammar's processor, the
    masked steps replayed as graphs."""
    model, _, tokenizer = _cuda_pair(torch.float32)
    ids, mask = (t.cuda() for t in encoded())
    common = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    stock = model.generate(ids, logits_processor=[stock_processor(model, tokenizer, kind, source)],
                           **common)
    flash = model.generate(ids, sampler="flash", structured_output={kind: source},
                           tokenizer=tokenizer, **common)
    assert torch.equal(flash, stock)
    assert {"plain forward", "plain head"} <= _captured(model)      # split steps


@pytest.mark.parametrize("dtype, invariant", [(torch.float32, False), (torch.bfloat16, True)])
def test_tokens_with_drafts_are_the_tokens_without_on_cuda(dtype, invariant):
    """Prompt lookup, an assistant and an EAGLE-3 head (the last two drafting among the
    grammar's tokens), greedy and seeded sampling: the same tokens as the call without
    drafts; the verifications of masked drafts captured."""
    model, draft, tokenizer = _cuda_pair(dtype)
    ids, mask = (t.cuda() for t in encoded())
    for sampling in (dict(do_sample=False), dict(do_sample=True, top_p=0.9, seed=3)):
        common = dict(attention_mask=mask, max_new_tokens=48, sampler="flash", pad_token_id=0,
                      structured_output={"json": SCHEMAS["nested"]}, tokenizer=tokenizer,
                      invariant=invariant, **sampling)
        plain = model.generate(ids, **common)
        head = flashspec.Eagle3.from_pretrained(tiny_pair_path() / "eagle3", model)
        for drafts in (dict(prompt_lookup_num_tokens=4),
                       dict(assistant_model=draft, num_assistant_tokens=4),
                       dict(drafter=head, num_assistant_tokens=4)):
            assert torch.equal(model.generate(ids, **common, **drafts), plain), (sampling, drafts)
            assert {("verify forward", 4), ("verify head", 4)} <= _captured(model)


def test_sampled_outputs_validate_and_calls_in_turn_keep_their_graphs():
    """bf16: 64 sampled rows validate; then a call without the grammar and one with it
    again, on the same engine, give the first calls' tokens."""
    model, _, tokenizer = _cuda_pair(torch.bfloat16)
    ids, mask = (t.cuda() for t in encoded(["{"] * 64))
    spec = {"json": SCHEMAS["nested"], "disable_any_whitespace": True}
    common = dict(attention_mask=mask, max_new_tokens=96, do_sample=True, seed=0,
                  sampler="flash", tokenizer=tokenizer, pad_token_id=0)
    first = model.generate(ids, structured_output=spec, **common)
    for text, ended in generated_texts(tokenizer, first.cpu(), ids.shape[1]):
        assert ended
        jsonschema.validate(json.loads(text), SCHEMAS["nested"])
    free = model.generate(ids, **common)
    assert torch.equal(model.generate(ids, structured_output=spec, **common), first)
    assert torch.equal(model.generate(ids, **common), free)
    regex = model.generate(ids[:3], attention_mask=mask[:3], max_new_tokens=40, do_sample=False,
                           sampler="flash", tokenizer=tokenizer, pad_token_id=0,
                           structured_output={"regex": REGEX})
    for text, ended in generated_texts(tokenizer, regex.cpu(), ids.shape[1]):
        assert ended
