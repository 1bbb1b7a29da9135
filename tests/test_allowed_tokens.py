"""Allowed-token masks (`flashspec.generation.allowed`): the bitmask layout, transformers'
`prefix_allowed_tokens_fn` read as stock reads it, and clear errors for bad masks."""

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation import logits_process as lp
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
    allowed = AllowedTokens.of_call(_prefix_fn, None, input_ids, 0, 20)
    got = allowed.masks(torch.arange(4), input_ids)
    assert torch.equal(unpack(got, 20), expected)
    # A subset of rows keeps each row's batch id.
    got = allowed.masks(torch.tensor([2, 3]), input_ids[2:])
    assert torch.equal(unpack(got, 20), expected[2:])
    # With allowed_tokens_fn too: the tokens both allow; and as a prefix function again.
    even = lambda rows, ids: (torch.arange(20) % 2 == 0).expand(len(rows), 20)  # noqa: E731
    both = AllowedTokens.of_call(_prefix_fn, even, input_ids, 0, 20)
    got = unpack(both.masks(torch.arange(4), input_ids), 20)
    assert torch.equal(got, expected & (torch.arange(20) % 2 == 0))
    for row in range(4):
        assert both.prefix_fn(row, input_ids[row]) == got[row].nonzero().flatten().tolist()


def test_prefix_fn_empty_or_out_of_vocabulary_is_a_clear_error():
    ids = torch.zeros(1, 3, dtype=torch.long)
    empty = AllowedTokens.of_call(lambda b, s: [], None, ids, 0, 20)
    with pytest.raises(ValueError, match="prefix_allowed_tokens_fn.*empty list.*batch ID 0"):
        empty.masks(torch.tensor([0]), ids)
    outside = AllowedTokens.of_call(lambda b, s: [3, 20], None, ids, 0, 20)
    with pytest.raises(ValueError, match=r"prefix_allowed_tokens_fn.*outside.*\[0, 20\).*20"):
        outside.masks(torch.tensor([0]), ids)
    # Disjoint sources, or a mask with only bits past V: no token for the row.
    odd = lambda rows, ids: torch.tensor([[0, 2**20]], dtype=torch.int32)  # noqa: E731 - token 52
    for source in (AllowedTokens.of_call(lambda b, s: [4], odd, ids, 0, 40),
                   AllowedTokens.of_call(None, odd, ids, 0, 40)):
        with pytest.raises(ValueError, match=r"allow.* no token for row 0 after its 3-token"):
            source.masks(torch.tensor([0]), ids)


@pytest.mark.parametrize("masks", [torch.ones(2, 19, dtype=torch.bool), torch.ones(2, 20),
                                   torch.ones(2, 2, dtype=torch.int64), [[1] * 20] * 2,
                                   torch.ones(3, 20, dtype=torch.bool)])
def test_bad_masks_name_the_argument_and_the_shapes_allowed(masks):
    allowed = AllowedTokens.of_call(None, lambda rows, ids: masks,
                                    torch.zeros(2, 3, dtype=torch.long), 0, 20)
    with pytest.raises(TypeError, match=r"`allowed_tokens_fn` returned .* for 2 contexts; "
                                        r"allowed: a bool tensor \[2, 20\] or an int32 bitmask \[2, 1\]"):
        allowed.masks(torch.arange(2), torch.zeros(2, 3, dtype=torch.long))


# --------------------------------------------------------------------------------------
# In generate: fused (no warning), exact, the same with and without speculation
# --------------------------------------------------------------------------------------

from test_logits_options import (PROMPTS, SAMPLING, SEED, assert_reference_tokens,  # noqa: E402
                                 flash, left_pad, target)
from test_generate import _quiet_single_threaded  # noqa: F401,E402 - the module's autouse fixture
from _models import VOCAB  # noqa: E402
from flashspec.params import row_seeds  # noqa: E402


def _allowed_ids(row: int, context: torch.Tensor) -> list[int]:
    """A grammar of sorts: after token t, row b may say t + b + {1, 2, 5, 9} (mod V) or 7."""
    return sorted({(int(context[-1]) + k + row) % VOCAB for k in (1, 2, 5, 9)} | {7})


def _allowed_bool(rows: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(len(rows), VOCAB, dtype=torch.bool)
    for i, (row, context) in enumerate(zip(rows.tolist(), input_ids)):
        out[i, _allowed_ids(row, context)] = True
    return out


def _allowed_bitmask(rows, input_ids):
    return pack(_allowed_bool(rows, input_ids))


class _Constrained(PrefixConstrainedLogitsProcessor):
    def __init__(self):
        super().__init__(_allowed_ids, num_beams=1)


SPELLINGS = {"prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=_allowed_ids),
             "allowed_tokens_fn (bool)": dict(allowed_tokens_fn=_allowed_bool),
             "allowed_tokens_fn (bitmask)": dict(allowed_tokens_fn=_allowed_bitmask)}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize("sampling", ["sampled", "top-k", "greedy"])
def test_allowed_tokens_fused_exact_and_speculation_invariant(spelling, sampling):
    from transformers import LogitsProcessorList

    ids, mask = left_pad(PROMPTS)
    options = {"sampled": SAMPLING, "top-k": dict(do_sample=True, top_k=3, temperature=0.8),
               "greedy": dict(do_sample=False)}[sampling]
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # fused: no materialized-path warning
        plain = flash(target(), ids, mask, seed=SEED, **options, **SPELLINGS[spelling]).sequences
    processors = LogitsProcessorList([_Constrained()])
    if sampling != "greedy":
        processors.append(lp.TemperatureLogitsWarper(options["temperature"]))
    if sampling == "top-k":       # the mask comes first: the top 3 of the allowed tokens
        processors.append(lp.TopKLogitsWarper(3))
    assert_reference_tokens(plain, ids, mask, processors, row_seeds(SEED, 3), sampling != "greedy")
    for mode in ("self", "assistant", "lookup"):
        out = flash(target(), ids, mask, mode, seed=SEED, **options, **SPELLINGS[spelling])
        assert torch.equal(out.sequences, plain), mode


def test_allowed_tokens_fn_with_a_fallback_option_is_exact_there():
    """With an option only the materialized path runs (encoder_repetition_penalty), the mask
    is applied there, where transformers applies its prefix constraint."""
    from transformers import LogitsProcessorList

    ids, mask = left_pad(PROMPTS)
    with pytest.warns(UserWarning, match="materialized path"):
        out = flash(target(), ids, mask, seed=SEED, **SAMPLING, encoder_repetition_penalty=1.5,
                    allowed_tokens_fn=_allowed_bitmask).sequences
    processors = LogitsProcessorList([lp.EncoderRepetitionPenaltyLogitsProcessor(1.5, ids),
                                      _Constrained(),
                                      lp.TemperatureLogitsWarper(SAMPLING["temperature"])])
    assert_reference_tokens(out, ids, mask, processors, row_seeds(SEED, 3), True)


def test_allowed_tokens_errors_name_the_argument():
    ids, mask = left_pad(PROMPTS)
    with pytest.raises(TypeError, match="`allowed_tokens_fn` must be a callable"):
        flash(target(), ids, mask, allowed_tokens_fn=[1, 2])
    with pytest.raises(TypeError, match="`allowed_tokens_fn` returned a torch.float32 tensor"):
        flash(target(), ids, mask, allowed_tokens_fn=lambda rows, ids: torch.ones(len(rows), VOCAB))
    nothing = lambda rows, ids: torch.zeros(len(rows), VOCAB, dtype=torch.bool)  # noqa: E731
    with pytest.raises(ValueError, match="`allowed_tokens_fn` allows no token for row 0"):
        flash(target(), ids, mask, seed=SEED, **SAMPLING, allowed_tokens_fn=nothing)
    with pytest.raises(ValueError, match="allowed_tokens_fn"):
        flash(target(), ids, mask, num_beams=2, allowed_tokens_fn=_allowed_bool)


@pytest.mark.gpu
@pytest.mark.parametrize("spelling", ["prefix_allowed_tokens_fn", "allowed_tokens_fn"])
def test_allowed_tokens_on_cuda_bf16_hold_and_are_speculation_invariant(spelling):
    """On CUDA in bf16 the masks go through the codes kernel: every new token is allowed by
    its context, and with the invariant kernels (README: bitwise the same hidden states with
    and without drafts) the seeded tokens of an assistant and of prompt lookup equal plain
    decoding's."""
    from test_generate_gpu import MODES as GPU_MODES, VOCAB as GPU_VOCAB, _pair, _prompts, _run

    def ids_of(row, context):
        return sorted({(int(context[-1]) * 7 + k + row) % GPU_VOCAB for k in range(0, 60, 3)})

    def as_bitmask(rows, input_ids):
        allowed = torch.zeros(len(rows), GPU_VOCAB, dtype=torch.bool)
        for i, (row, context) in enumerate(zip(rows.tolist(), input_ids)):
            allowed[i, ids_of(row, context)] = True
        return pack(allowed)

    given = ({"prefix_allowed_tokens_fn": ids_of} if spelling == "prefix_allowed_tokens_fn"
             else {"allowed_tokens_fn": as_bitmask})
    model, draft = _pair(torch.bfloat16)
    ids, mask = _prompts("cuda")
    seeds = torch.tensor([41, 42, 43, 44])
    sampling = dict(do_sample=True, temperature=0.8, top_k=8)
    runs = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "sampler='flash' runs this call")
        for name, mode in GPU_MODES.items():
            runs[name] = _run(model, draft, ids, mask, mode, seed=seeds, invariant=True,
                              **sampling, **given).cpu()
    plain = runs["plain"]
    width = ids.shape[1]
    for row in range(plain.shape[0]):
        for t in range(width, plain.shape[1]):
            assert int(plain[row, t]) in ids_of(row, plain[row, :t]), (row, t)
    for name, out in runs.items():
        assert torch.equal(out, plain), name


def test_a_grammar_is_never_asked_past_a_draft_it_leaves_out():
    """A matcher-like function has no answer after a token it did not allow (here: an empty
    list, an error in transformers): speculation must not ask it there, since such a draft is
    never accepted. With it, every mode runs and gives plain decoding's tokens."""
    ids, mask = left_pad(PROMPTS)
    width = ids.shape[1]

    def grammar(token):
        return sorted({(token + k) % VOCAB for k in (1, 2, 5, 9)} | {7})

    def matcher(row, sent):
        if len(sent) > width and int(sent[-1]) not in grammar(int(sent[-2])):
            return []
        return grammar(int(sent[-1]))

    plain = flash(target(), ids, mask, seed=SEED, **SAMPLING, prefix_allowed_tokens_fn=matcher)
    for mode in ("self", "assistant", "lookup"):
        out = flash(target(), ids, mask, mode, seed=SEED, **SAMPLING,
                    prefix_allowed_tokens_fn=matcher)
        assert torch.equal(out.sequences, plain.sequences), mode
