"""Allowed-token masks (`flashspec.generation.allowed`): the bitmask layout, transformers'
`prefix_allowed_tokens_fn` read as stock reads it, and clear errors for bad masks."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor

from flashspec.generation.allowed import AllowedTokens, pack, unpack


@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(1, 200), rows=st.integers(1, 3), seed=st.integers(0, 2**31 - 1),
       density=st.floats(0.0, 1.0))
def test_pack_is_xgrammar_layout_and_unpack_inverts_it(vocab, rows, seed, density):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, vocab, generator=g) < density
    bitmask = pack(allowed)
    assert bitmask.dtype == torch.int32 and bitmask.shape == (rows, math.ceil(vocab / 32))
    for v in range(vocab):      # bit v % 32 of word v // 32, as xgrammar and vLLM lay it out
        word = bitmask[:, v // 32].to(torch.int64) & 0xFFFFFFFF
        assert torch.equal((word >> (v % 32)) & 1 == 1, allowed[:, v])
    assert torch.equal(unpack(bitmask, vocab), allowed)


def _prefix_fn(batch_id, sent):
    """Allowed: tokens congruent to the context's last token mod 3, plus the batch id."""
    last = int(sent[-1])
    return [v for v in range(20) if v % 3 == last % 3] + [batch_id]


def test_prefix_fn_masks_equal_transformers_processor():
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 20, (4, 7), generator=g)
    processor = PrefixConstrainedLogitsProcessor(_prefix_fn, num_beams=1)
    expected = processor(input_ids, torch.zeros(4, 20)) == 0
    allowed = AllowedTokens.from_prefix_fn(_prefix_fn, input_ids, 0, 20)
    got = allowed.masks_of(torch.arange(4), input_ids)
    assert torch.equal(got, expected)
    # A subset of rows keeps each row's batch id.
    got = allowed.masks_of(torch.tensor([2, 3]), input_ids[2:])
    assert torch.equal(got, expected[2:])


def test_prefix_fn_empty_or_out_of_vocabulary_is_a_clear_error():
    ids = torch.zeros(1, 3, dtype=torch.long)
    empty = AllowedTokens.from_prefix_fn(lambda b, s: [], ids, 0, 20)
    with pytest.raises(ValueError, match="prefix_allowed_tokens_fn.*empty list.*batch ID 0"):
        empty.masks_of(torch.tensor([0]), ids)
    outside = AllowedTokens.from_prefix_fn(lambda b, s: [3, 20], ids, 0, 20)
    with pytest.raises(ValueError, match=r"prefix_allowed_tokens_fn.*outside.*\[0, 20\).*20"):
        outside.masks_of(torch.tensor([0]), ids)


@pytest.mark.parametrize("masks", [torch.ones(2, 19, dtype=torch.bool), torch.ones(2, 20),
                                   torch.ones(2, 2, dtype=torch.int64), [[1] * 20] * 2,
                                   torch.ones(3, 20, dtype=torch.bool)])
def test_bad_masks_name_the_argument_and_the_shapes_allowed(masks):
    allowed = AllowedTokens(lambda rows, ids: masks, "allowed_tokens_fn",
                            torch.zeros(2, 3, dtype=torch.long), 0, 20)
    with pytest.raises(TypeError, match=r"`allowed_tokens_fn` returned .* for 2 contexts; "
                                        r"allowed: a bool tensor \[2, 20\] or an int32 bitmask \[2, 1\]"):
        allowed._checked(allowed.masks_of(None, None), 2)
