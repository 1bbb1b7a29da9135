"""Every call finishes, and hands back what stock does: `past_key_values` out and in, and the
inputs decoder-only users pass (`inputs_embeds`, any 2-D attention mask ending with a live
token, `position_ids`, `token_type_ids`) on the engine, each against stock `generate` on the
tiny models of tests/_models.py (greedy tokens equal; seeded sampling equal with and without
speculation, and between one call and two calls that continue a returned cache).

What still runs on stock (other positions, holes or right padding under a sliding window the
call's columns exceed) is checked to say so and to give stock's tokens; right padding has
tests/test_right_padding.py.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from _models import SLIDING_WINDOW, tiny_model
from test_generate import _quiet_single_threaded, draft, target  # noqa: F401 (fixture)

ARCHS = ("llama", "qwen3", "gpt2", "mistral", "gemma2")
SLIDING = ("mistral", "gemma2")
IDS = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10, 11],
                    [3, 4, 5, 6, 7, 8, 9, 10, 11]])
MASK = (torch.arange(9)[None, :] >= torch.tensor([[2], [0]])).long()
MORE = torch.tensor([[7, 8], [9, 10]])       # the next turn's ids
DEFERS = "sampler='flash' defers this call to stock"


@contextlib.contextmanager
def on_engine():
    """Inside, a call that flashspec hands to stock fails the test."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=DEFERS)
        yield


def modes(arch: str) -> dict:
    return {"plain": {}, "lookup": dict(prompt_lookup_num_tokens=3),
            "assistant": dict(assistant_model=draft(arch), num_assistant_tokens=3)}


def live_columns(mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[B, L + new - 1] bool: the columns of a returned cache whose entries a next call reads."""
    return torch.cat([mask, torch.ones(mask.shape[0], new_tokens - 1, dtype=mask.dtype)], 1).bool()


def assert_same_cache(ours, theirs, mask: torch.Tensor, new_tokens: int, atol: float = 1e-5):
    """Same cache class, layer classes, shapes and lengths; the entries a next call reads
    equal up to float rounding (a padding column's entries are never read)."""
    assert type(ours) is type(theirs)
    assert [type(layer) for layer in ours.layers] == [type(layer) for layer in theirs.layers]
    assert int(ours.get_seq_length()) == int(theirs.get_seq_length())
    live = live_columns(mask, new_tokens)
    for mine, stocks in zip(ours.layers, theirs.layers):
        for a, b in ((mine.keys, stocks.keys), (mine.values, stocks.values)):
            assert a.shape == b.shape and a.dtype == b.dtype
            held = live[:, live.shape[1] - a.shape[2]:] if a.shape[2] < live.shape[1] \
                else torch.cat([live, live.new_zeros(live.shape[0], a.shape[2] - live.shape[1])], 1)
            difference = (a - b).abs().amax(dim=(1, 3))
            assert float(difference[held].max()) <= atol


# --------------------------------------------------------------------------------------
# past_key_values out
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_returned_cache_is_stocks(arch):
    """`return_dict_in_generate` hands back stock's cache: a DynamicCache of the model's
    config (sliding-window layers keep their last window - 1 entries), one column per
    column of `sequences` but the last; a row that ended early holds its EOS and padding
    tokens' entries, as stock feeds them."""
    model = target(arch)
    kwargs = dict(max_new_tokens=6, return_dict_in_generate=True)
    free = model.generate(IDS, attention_mask=MASK, **kwargs).sequences
    eos = int(free[0, 11])                    # row 0 ends after 3 tokens
    with on_engine():
        ours = model.generate(IDS, attention_mask=MASK, sampler="flash", eos_token_id=eos, **kwargs)
    theirs = model.generate(IDS, attention_mask=MASK, eos_token_id=eos, **kwargs)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert (ours.sequences[0, 12:] == 0).all()           # padded after its EOS
    new = ours.sequences.shape[1] - IDS.shape[1]
    assert_same_cache(ours.past_key_values, theirs.past_key_values, MASK, new)
    if arch in SLIDING:
        assert isinstance(ours.past_key_values.layers[0], DynamicSlidingWindowLayer)
    # without the output object, or with use_cache=False, nothing is gathered
    with on_engine():
        assert model.generate(IDS, attention_mask=MASK, sampler="flash", max_new_tokens=2,
                              return_dict_in_generate=True, use_cache=False).past_key_values is None


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_static_cache_implementation_gives_stocks_static_cache(arch):
    model = target(arch)
    kwargs = dict(max_new_tokens=5, return_dict_in_generate=True, cache_implementation="static")
    with on_engine():
        ours = model.generate(IDS, attention_mask=MASK, sampler="flash", **kwargs)
    theirs = model.generate(IDS, attention_mask=MASK, **kwargs)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert isinstance(ours.past_key_values, StaticCache)
    assert_same_cache(ours.past_key_values, theirs.past_key_values, MASK, 5)


# --------------------------------------------------------------------------------------
# past_key_values round trip: two calls == one call on the concatenated prompt
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["plain", "lookup", "assistant"])
@pytest.mark.parametrize("arch", ARCHS)
def test_two_calls_with_the_returned_cache_are_one_call(arch, mode):
    """A chat's second turn continues from the first's cache (prompt not read again): its
    tokens are those of one call on the concatenated prompt, greedy (also stock's) and
    seeded (the noise is keyed by sequence position), one row and a left-padded batch."""
    model, extra = target(arch), modes(arch)[mode]
    for rows in (1, 2):
        ids, mask = IDS[-rows:], MASK[-rows:]
        for sampling in (dict(do_sample=False), dict(do_sample=True, seed=11)):
            kwargs = dict(max_new_tokens=4, return_dict_in_generate=True, **sampling, **extra)
            with on_engine():
                first = model.generate(ids, attention_mask=mask, sampler="flash", **kwargs)
                ids2 = torch.cat([first.sequences, MORE[-rows:]], dim=1)
                mask2 = torch.nn.functional.pad(mask, (0, ids2.shape[1] - mask.shape[1]), value=1)
                cache = first.past_key_values
                assert cache.get_seq_length() == first.sequences.shape[1] - 1
                second = model.generate(ids2, attention_mask=mask2, sampler="flash",
                                        past_key_values=cache, **kwargs)
                assert second.past_key_values is cache      # updated in place, as stock's
                assert cache.get_seq_length() == second.sequences.shape[1] - 1
                once = model.generate(ids2, attention_mask=mask2, sampler="flash", **kwargs)
            assert torch.equal(second.sequences, once.sequences), (rows, sampling)
            if not sampling["do_sample"]:
                assert torch.equal(second.sequences,
                                   model.generate(ids2, attention_mask=mask2, max_new_tokens=4))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral"])
def test_transformers_continue_from_past_key_values(arch):
    """transformers' `test_generate_continue_from_past_key_values`: 4 tokens at once, or 3
    and then 1 more from the returned cache: same sequences, scores and caches."""
    model = target(arch)
    kwargs = dict(pad_token_id=-1, eos_token_id=-1, use_cache=True, do_sample=False,
                  return_dict_in_generate=True, output_scores=True)
    with on_engine(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*materialized path")
        whole = model.generate(IDS, attention_mask=MASK, sampler="flash", max_new_tokens=4, **kwargs)
        part = model.generate(IDS, attention_mask=MASK, sampler="flash", max_new_tokens=3, **kwargs)
        mask = torch.nn.functional.pad(MASK, (0, part.sequences.shape[1] - MASK.shape[1]), value=1)
        rest = model.generate(part.sequences, attention_mask=mask, sampler="flash",
                              past_key_values=part.past_key_values, max_new_tokens=1, **kwargs)
    assert torch.equal(whole.sequences, rest.sequences)
    for a, b in zip(whole.scores, part.scores + rest.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(whole.past_key_values.layers, rest.past_key_values.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


def test_a_cache_passed_in_is_filled_and_continued_in_place_as_stocks():
    """transformers' chat pattern: one DynamicCache passed to every turn (no output object):
    filled by the first call, continued by the next, as stock fills and continues it."""
    model = target()
    ours, theirs = DynamicCache(), DynamicCache()
    ids, mask = IDS, MASK
    for turn in range(2):
        with on_engine():
            a = model.generate(ids, attention_mask=mask, sampler="flash", max_new_tokens=4,
                               past_key_values=ours)
        b = model.generate(ids, attention_mask=mask, max_new_tokens=4, past_key_values=theirs)
        assert torch.equal(a, b), turn
        assert ours.get_seq_length() == theirs.get_seq_length() == a.shape[1] - 1
        ids = torch.cat([a, MORE], dim=1)
        mask = torch.nn.functional.pad(mask, (0, ids.shape[1] - mask.shape[1]), value=1)


def test_a_prompt_cache_and_only_the_new_ids():
    """A prompt cache filled by the model's forward (copied per call, as transformers'
    docs do), and a returned cache continued with only the ids after it (stock's other
    form: the attention mask covers every column): stock's tokens."""
    model = target()
    prefix = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=IDS[:, :6], attention_mask=MASK[:, :6], past_key_values=prefix,
              position_ids=(MASK[:, :6].cumsum(1) - 1).clamp_min(0))
    with on_engine():
        ours = model.generate(IDS, attention_mask=MASK, sampler="flash", max_new_tokens=4,
                              past_key_values=copy.deepcopy(prefix))
    assert torch.equal(ours, model.generate(IDS, attention_mask=MASK, max_new_tokens=4,
                                            past_key_values=copy.deepcopy(prefix)))
    assert torch.equal(ours, model.generate(IDS, attention_mask=MASK, max_new_tokens=4))
    first = model.generate(IDS, attention_mask=MASK, sampler="flash", max_new_tokens=3,
                           return_dict_in_generate=True)
    ids2 = torch.cat([first.sequences, MORE], dim=1)
    mask2 = torch.nn.functional.pad(MASK, (0, ids2.shape[1] - 9), value=1)
    held = first.past_key_values.get_seq_length()
    with on_engine():
        new_only = model.generate(ids2[:, held:], attention_mask=mask2, sampler="flash",
                                  max_new_tokens=4, past_key_values=first.past_key_values)
    assert torch.equal(new_only, model.generate(ids2, attention_mask=mask2, max_new_tokens=4)[:, held:])


def test_past_key_values_that_cannot_be_taken_are_refused_by_name():
    model = target()
    done = model.generate(IDS, attention_mask=MASK, max_new_tokens=2, return_dict_in_generate=True)
    other = target("gpt2").generate(IDS, attention_mask=MASK, max_new_tokens=2,
                                    return_dict_in_generate=True).past_key_values
    longer = torch.cat([done.sequences, MORE], 1)
    cases = [
        (IDS, MASK, dict(past_key_values=done.past_key_values), "holds 10 tokens, but the prompt has 9"),
        (longer, torch.ones_like(longer), dict(past_key_values=other), "KV heads"),
        (longer, torch.ones_like(longer), dict(past_key_values=(1, 2)), "as a tuple"),
        (longer, torch.ones_like(longer), dict(past_key_values=done.past_key_values,
                                              cache_implementation="static"), "not both"),
        (longer, torch.ones_like(longer), dict(past_key_values=done.past_key_values,
                                              use_cache=False), "needs `use_cache`"),
    ]
    for ids, mask, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            model.generate(ids, attention_mask=mask, sampler="flash", max_new_tokens=2, **kwargs)
    # a row that ends early has padding entries in the returned cache: they need a pad token
    eos = int(model.generate(IDS, attention_mask=MASK, max_new_tokens=2)[0, -1])
    with pytest.raises(ValueError, match="`pad_token_id`=-3 is not a token"):
        model.generate(IDS, attention_mask=MASK, sampler="flash", max_new_tokens=6, eos_token_id=eos,
                       pad_token_id=-3, return_dict_in_generate=True)


# --------------------------------------------------------------------------------------
# inputs_embeds, masks, position_ids, token_type_ids
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_inputs_embeds_give_stocks_tokens(arch):
    """The prefill takes the embeddings; `sequences` holds the new tokens alone (embeddings
    only) or the ids and the new tokens (both given), as stock's. Prompt lookup then has no
    prompt to search, an assistant no prompt to read: tokens unchanged."""
    model = target(arch)
    embeds = model.get_input_embeddings()(IDS).detach()
    expected = model.generate(inputs_embeds=embeds, attention_mask=MASK, max_new_tokens=5)
    assert expected.shape == (2, 5)
    for extra in ({}, dict(prompt_lookup_num_tokens=2),
                  dict(assistant_model=draft(arch), num_assistant_tokens=2)):
        with on_engine():
            ours = model.generate(inputs_embeds=embeds, attention_mask=MASK, sampler="flash",
                                  max_new_tokens=5, **extra)
            both = model.generate(IDS, inputs_embeds=embeds, attention_mask=MASK, sampler="flash",
                                  max_new_tokens=5, **extra)
        assert torch.equal(ours, expected)
        assert torch.equal(both, torch.cat([IDS, expected], dim=1))
    # the repetition penalty sees stock's input_ids: the new tokens alone
    with on_engine():
        penalised = model.generate(inputs_embeds=embeds, attention_mask=MASK, sampler="flash",
                                   max_new_tokens=5, repetition_penalty=1.5)
    assert torch.equal(penalised, model.generate(inputs_embeds=embeds, attention_mask=MASK,
                                                 max_new_tokens=5, repetition_penalty=1.5))


def test_inputs_embeds_with_a_cache_and_a_static_cache():
    # A model of its own: transformers sizes a static cache at least as large as the largest
    # one it made for the model before (`_previous_max_cache_length`).
    model = tiny_model("llama")
    first = model.generate(IDS, attention_mask=MASK, sampler="flash", max_new_tokens=3,
                           return_dict_in_generate=True)
    ids2 = torch.cat([first.sequences, MORE], dim=1)
    mask2 = torch.nn.functional.pad(MASK, (0, ids2.shape[1] - 9), value=1)
    embeds = model.get_input_embeddings()(ids2).detach()
    with on_engine():
        ours = model.generate(inputs_embeds=embeds, attention_mask=mask2, sampler="flash",
                              max_new_tokens=4, past_key_values=first.past_key_values)
        static = model.generate(inputs_embeds=embeds[:, :9], attention_mask=MASK, sampler="flash",
                                max_new_tokens=4, cache_implementation="static",
                                return_dict_in_generate=True).past_key_values
    assert torch.equal(ours, model.generate(ids2, attention_mask=mask2, max_new_tokens=4)[:, -4:])
    # stock's size: max_new_tokens + the embeddings' columns - 1
    assert static.layers[0].keys.shape[2] == 4 + 9 - 1


@pytest.mark.parametrize("arch", ARCHS)
def test_masks_with_holes_give_stocks_tokens(arch):
    """Padding between a row's tokens: live tokens at positions mask.cumsum - 1, the holes
    dead; greedy, with a repetition penalty (which reads stock's padded input_ids), and
    seeded the same with and without drafts. Under a sliding window that the call's
    columns exceed, stock's window counts the holes: stock runs it."""
    model = target(arch)
    holes = MASK.clone()
    holes[0, 4] = holes[1, 2] = holes[1, 3] = 0
    short = dict(max_new_tokens=3) if arch in SLIDING else dict(max_new_tokens=6)
    ids, mask = (IDS[:, -4:], holes[:, -4:]) if arch in SLIDING else (IDS, holes)
    if arch in SLIDING:
        mask = torch.tensor([[1, 0, 1, 1], [0, 1, 0, 1]])
        assert ids.shape[1] + short["max_new_tokens"] - 1 <= SLIDING_WINDOW
    for extra in ({}, dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=2)):
        with on_engine():
            ours = model.generate(ids, attention_mask=mask, sampler="flash", **short, **extra)
        assert torch.equal(ours, model.generate(ids, attention_mask=mask, **short, **extra)), extra
    seeded = [model.generate(ids, attention_mask=mask, sampler="flash", do_sample=True, seed=5,
                             **short, **extra) for extra in modes(arch).values()]
    assert all(torch.equal(seeded[0], other) for other in seeded[1:])
    if arch in SLIDING:
        with pytest.warns(UserWarning, match="exceed the model's sliding window"):
            ours = model.generate(IDS, attention_mask=holes, sampler="flash", max_new_tokens=4)
        assert torch.equal(ours, model.generate(IDS, attention_mask=holes, max_new_tokens=4))


def test_right_padding_runs_on_the_engine_as_stock():
    model = target()
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0, 0], [1] * 9])
    with on_engine():
        ours = model.generate(IDS, attention_mask=mask, sampler="flash", max_new_tokens=4)
    assert torch.equal(ours, model.generate(IDS, attention_mask=mask, max_new_tokens=4))


def test_position_ids_stock_derives_run_on_the_engine_others_on_stock():
    model = target()
    positions = (MASK.cumsum(1) - 1).masked_fill(MASK == 0, 0)
    for given in (positions, positions.masked_fill(MASK == 0, 7)):   # padding's do not matter
        with on_engine():
            ours = model.generate(IDS, attention_mask=MASK, position_ids=given, sampler="flash",
                                  max_new_tokens=4)
        assert torch.equal(ours, model.generate(IDS, attention_mask=MASK, max_new_tokens=4))
    shifted = positions + 3
    with pytest.warns(UserWarning, match="`position_ids` are not the positions"):
        ours = model.generate(IDS, attention_mask=MASK, position_ids=shifted, sampler="flash",
                              max_new_tokens=4)
    assert torch.equal(ours, model.generate(IDS, attention_mask=MASK, position_ids=shifted,
                                            max_new_tokens=4))


def test_token_type_ids_of_gpt2_give_stocks_tokens():
    """GPT-2's decoder adds each token's type embedding; stock repeats the prompt's last
    type for the new tokens. Every forward of the call takes them: prefill, steps with and
    without drafts, and a continuation from a returned cache."""
    model = target("gpt2")
    types = torch.zeros_like(IDS)
    types[:, 5:] = 1
    types[1, -1] = 2
    expected = model.generate(IDS, attention_mask=MASK, token_type_ids=types, max_new_tokens=6)
    assert not torch.equal(expected, model.generate(IDS, attention_mask=MASK, max_new_tokens=6))
    for extra in modes("gpt2").values():
        with on_engine():
            ours = model.generate(IDS, attention_mask=MASK, token_type_ids=types, sampler="flash",
                                  max_new_tokens=6, **extra)
        assert torch.equal(ours, expected)
    with on_engine():
        first = model.generate(IDS, attention_mask=MASK, token_type_ids=types, sampler="flash",
                               max_new_tokens=3, return_dict_in_generate=True)
        ids2 = torch.cat([first.sequences, MORE], dim=1)
        mask2 = torch.nn.functional.pad(MASK, (0, ids2.shape[1] - 9), value=1)
        types2 = torch.cat([types, types[:, -1:].expand(-1, ids2.shape[1] - 9)], dim=1)
        second = model.generate(ids2, attention_mask=mask2, token_type_ids=types2, sampler="flash",
                                max_new_tokens=3, past_key_values=first.past_key_values)
    assert torch.equal(second, model.generate(ids2, attention_mask=mask2, token_type_ids=types2,
                                              max_new_tokens=3))
