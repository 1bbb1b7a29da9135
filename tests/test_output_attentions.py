"""`output_attentions` / `output_hidden_states` run on the engine and return stock's outputs.

With ``return_dict_in_generate=True`` a call that asks for them runs on the materialized path
(`flashspec.generation.recording`): one entry per generated token, each a tuple over layers,
laid out over the columns of ``sequences`` as stock lays them out. Pinned here on float32 tiny
models (Llama, Qwen3, GPT-2; eager attention, which stock needs for attention weights):

1. Plain greedy calls (one row, a left-padded batch): sequences, scores, attentions and
   hidden states equal stock's, padding rows of the prompt's entry included.
2. With an assistant, the target drafting for itself and prompt lookup (batch 1, stock's
   assisted generation): the same sequences and scores, every entry of the shape stock's
   has and the values of stock's greedy search; stock's assisted values too, but for the
   tokens its first verification emits after the first, where stock returns the prompt's
   first rows (checked to be exactly those). Batches with drafts equal stock's greedy batch.
3. sdpa: attentions hold no layer's weights per token (as stock's greedy), hidden states
   equal stock's; a model switched to eager after a call runs with eager masks.
4. Stock's other cache layouts: sliding-window layers, a static cache, no cache
   (``use_cache=False``: every entry the whole sequence), a passed ``past_key_values``,
   ``inputs_embeds``, right padding; a row that ended earlier holds NaN after its end, as
   its scores do.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from _models import tiny_draft, tiny_model
from test_generate import _quiet_single_threaded, left_pad  # noqa: F401 - its autouse fixture

pytestmark = pytest.mark.filterwarnings("ignore:sampler='flash' runs this call")

ARCHS = ("llama", "qwen3", "gpt2")
OUTPUTS = dict(return_dict_in_generate=True, output_attentions=True, output_hidden_states=True,
               output_scores=True, do_sample=False)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9], [53, 53, 20, 21, 53]]
# A prompt per architecture from which its greedy tokens repeat (prompt lookup's drafts hit).
LOOKUP_PROMPT = {"llama": PROMPTS[1], "qwen3": PROMPTS[2], "gpt2": PROMPTS[2]}


def eager(model):
    model.set_attn_implementation("eager")
    return model


@functools.lru_cache(maxsize=None)
def target(arch: str):
    return eager(tiny_model(arch))


@functools.lru_cache(maxsize=None)
def draft(arch: str):
    return eager(tiny_draft(arch))


def stock(model, *args, **kwargs):
    return model.generate(*args, **kwargs)


def flash(model, *args, **kwargs):
    return model.generate(*args, sampler="flash", **kwargs)


def assert_entries_equal(ours, theirs, what, rows=slice(None)):
    """Per token, per layer: the same shapes, and values close (NaN where stock has NaN)."""
    assert isinstance(ours, tuple) and len(ours) == len(theirs), (what, len(ours), len(theirs))
    for step, (mine, stocks) in enumerate(zip(ours, theirs)):
        assert isinstance(mine, tuple) and len(mine) == len(stocks), (what, step)
        for layer, (a, b) in enumerate(zip(mine, stocks)):
            assert a.shape == b.shape, (what, step, layer, a.shape, b.shape)
            torch.testing.assert_close(a[rows], b[rows], equal_nan=True,
                                       msg=lambda m: f"{what}[{step}][{layer}]: {m}")


def assert_same_outputs(ours, theirs, rows=slice(None)):
    assert torch.equal(ours.sequences, theirs.sequences)
    assert_entries_equal(tuple((s,) for s in ours.scores), tuple((s,) for s in theirs.scores),
                         "scores")
    assert_entries_equal(ours.attentions, theirs.attentions, "attentions", rows)
    assert_entries_equal(ours.hidden_states, theirs.hidden_states, "hidden_states", rows)


# --------------------------------------------------------------------------------------
# 1. Plain calls: stock's outputs
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", ["one row", "left-padded batch"])
def test_plain_greedy_equals_stock(arch, batch):
    ids, mask = left_pad(PROMPTS[:1] if batch == "one row" else PROMPTS)
    model = target(arch)
    ours = flash(model, ids, attention_mask=mask, max_new_tokens=6, **OUTPUTS)
    theirs = stock(model, ids, attention_mask=mask, max_new_tokens=6, **OUTPUTS)
    assert_same_outputs(ours, theirs)
    width = ids.shape[1]
    heads = model.config.num_attention_heads
    layers = model.config.num_hidden_layers
    assert len(ours.attentions) == len(ours.hidden_states) == 6
    assert [a.shape for a in ours.attentions[0]] == [(len(ids), heads, width, width)] * layers
    assert [a.shape for a in ours.attentions[3]] == [(len(ids), heads, 1, width + 3)] * layers
    assert len(ours.hidden_states[0]) == layers + 1
    if batch != "one row":      # a token's weight on padding is 0, as after stock's masked softmax
        live = mask.bool()
        on_padding = live[:, None, :, None] & ~live[:, None, None, :]
        for layer in ours.attentions[0]:
            assert bool((layer[on_padding.expand_as(layer)] == 0).all())
        for entry in ours.attentions[1:]:
            for layer in entry:
                assert bool((layer[..., :width][~live[:, None, None, :].expand(
                    -1, heads, 1, -1)] == 0).all())


def test_only_what_is_asked_for():
    ids, mask = left_pad(PROMPTS[:2])
    model = target("llama")
    kwargs = dict(attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True)
    hidden = flash(model, ids, output_hidden_states=True, **kwargs)
    assert hidden.attentions is None and hidden.scores is None and len(hidden.hidden_states) == 3
    attentions = flash(model, ids, output_attentions=True, **kwargs)
    assert attentions.hidden_states is None and len(attentions.attentions) == 3
    # Without the output object stock collects nothing: the tokens alone.
    tokens = flash(model, ids, attention_mask=mask, max_new_tokens=3, output_attentions=True)
    assert torch.equal(tokens, stock(model, ids, attention_mask=mask, max_new_tokens=3))


def test_sampled_rows_get_their_tokens_entries():
    """Sampling (flashspec's noise, so no stock comparison of tokens): the entries are each
    token's own, the same with and without drafts (speculation invariance)."""
    ids, mask = left_pad(PROMPTS)
    model = target("llama")
    kwargs = dict(attention_mask=mask, max_new_tokens=6, seed=7, **{**OUTPUTS, "do_sample": True})
    plain = flash(model, ids, **kwargs)
    drafted = flash(model, ids, assistant_model=model, num_assistant_tokens=3, **kwargs)
    assert drafted.flash_stats.accepted.sum() > 0
    assert_same_outputs(drafted, plain)


# --------------------------------------------------------------------------------------
# 2. Drafts: stock's assisted generation (batch 1) and stock's greedy batch
# --------------------------------------------------------------------------------------

def _drafting(arch: str, mode: str) -> dict:
    if mode == "lookup":
        return dict(prompt_lookup_num_tokens=3)
    assistant = target(arch) if mode == "self" else draft(arch)
    assistant.generation_config.num_assistant_tokens = 3
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    return dict(assistant_model=assistant)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["assistant", "self", "lookup"])
def test_drafts_equal_stock_assisted_generation(arch, mode):
    prompt = LOOKUP_PROMPT[arch] if mode == "lookup" else PROMPTS[0]
    ids = torch.tensor([prompt])
    model = target(arch)
    drafting = _drafting(arch, mode)
    ours = flash(model, ids, max_new_tokens=10, **drafting, **OUTPUTS)
    if mode != "assistant":
        assert ours.flash_stats.accepted.sum() > 0          # drafts were accepted
    greedy = stock(model, ids, max_new_tokens=10, **OUTPUTS)
    assisted = stock(model, ids, max_new_tokens=10, **drafting, **OUTPUTS)
    assert_same_outputs(ours, greedy)                       # each token's own entries
    assert torch.equal(ours.sequences, assisted.sequences)
    # Stock's assisted generation: the same shapes; the same values but where its first
    # verification emitted several tokens: there its `_split_model_outputs` hands the k-th
    # of them the prompt's row k - 1.
    differing = []
    for step in range(len(assisted.hidden_states)):
        assert [h.shape for h in ours.hidden_states[step]] == \
            [h.shape for h in assisted.hidden_states[step]]
        assert [a.shape for a in ours.attentions[step]] == \
            [a.shape for a in assisted.attentions[step]]
        same = all(torch.allclose(a, b, rtol=1.3e-6, atol=1e-5) for a, b in
                   zip(ours.hidden_states[step] + ours.attentions[step],
                       assisted.hidden_states[step] + assisted.attentions[step]))
        if not same:
            differing.append(step)
            for theirs, prompt_rows in zip(assisted.hidden_states[step], greedy.hidden_states[0]):
                torch.testing.assert_close(theirs, prompt_rows[:, step - 1:step])
            for theirs, prompt_rows in zip(assisted.attentions[step], greedy.attentions[0]):
                row = torch.nn.functional.pad(prompt_rows[..., step - 1:step, :], (0, step))
                torch.testing.assert_close(theirs, row)
    assert differing == list(range(1, len(differing) + 1))  # the first verification's only
    if mode == "self":                  # its first drafts are accepted: stock's split shows
        assert differing


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", ["self", "lookup"])
def test_a_batch_with_drafts_equals_stock_greedy(arch, mode):
    ids, mask = left_pad([PROMPTS[0], LOOKUP_PROMPT[arch], PROMPTS[1]])
    model = target(arch)
    ours = flash(model, ids, attention_mask=mask, max_new_tokens=8, **_drafting(arch, mode),
                 **OUTPUTS)
    assert ours.flash_stats.accepted.sum() > 0
    theirs = stock(model, ids, attention_mask=mask, max_new_tokens=8, **OUTPUTS)
    assert_same_outputs(ours, theirs)


# --------------------------------------------------------------------------------------
# 3. The attention implementation
# --------------------------------------------------------------------------------------

def test_sdpa_returns_what_stock_greedy_returns():
    """sdpa forms no attention weights: stock's greedy search returns an empty tuple per
    token (and its assisted generation fails on it); hidden states as stock's (a padding
    row whose every key is masked: sdpa's zeros)."""
    model = tiny_model("llama")
    assert model.config._attn_implementation == "sdpa"
    ids, mask = left_pad(PROMPTS)
    ours = flash(model, ids, attention_mask=mask, max_new_tokens=4, **OUTPUTS)
    theirs = stock(model, ids, attention_mask=mask, max_new_tokens=4, **OUTPUTS)
    assert ours.attentions == theirs.attentions == ((),) * 4
    assert_entries_equal(ours.hidden_states, theirs.hidden_states, "hidden_states")
    drafted = flash(model, ids[:1], attention_mask=mask[:1], max_new_tokens=4,
                    assistant_model=model, **OUTPUTS)
    assert drafted.attentions == ((),) * 4


def test_a_model_switched_to_eager_after_a_call_gets_eager_masks():
    """The engine's slot made boolean masks for sdpa; eager attention adds its mask to the
    scores, so a slot made before the switch is replaced."""
    model = tiny_model("llama")
    ids, mask = left_pad(PROMPTS)
    flash(model, ids, attention_mask=mask, max_new_tokens=4)
    eager(model)
    ours = flash(model, ids, attention_mask=mask, max_new_tokens=6, **OUTPUTS)
    assert_same_outputs(ours, stock(model, ids, attention_mask=mask, max_new_tokens=6, **OUTPUTS))


def test_invariant_kernels_are_refused():
    with pytest.raises(ValueError, match="not supported with `invariant=True`"):
        flash(target("llama"), torch.tensor([PROMPTS[0]]), max_new_tokens=2, invariant=True,
              **OUTPUTS)


# --------------------------------------------------------------------------------------
# 4. Stock's cache layouts and inputs; rows that end early
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_window_layers_span_their_window(arch):
    """Stock's sliding-window cache layers hand attention their last window - 1 columns and
    the new one: a token's entry spans those (Gemma-2 alternates full and sliding layers)."""
    model = eager(tiny_model(arch))
    ids, mask = left_pad(PROMPTS)
    ours = flash(model, ids, attention_mask=mask, max_new_tokens=6, **OUTPUTS)
    assert_same_outputs(ours, stock(model, ids, attention_mask=mask, max_new_tokens=6, **OUTPUTS))
    window = model.config.sliding_window
    assert ours.attentions[3][0].shape[-1] == window


def test_static_cache_spans_its_length():
    """A static cache hands attention all of its columns (those not written yet: weight 0).
    Without padding every value is stock's (with left padding, stock's padding rows of the
    prompt's entry average over the empty columns too: see `recording`)."""
    model = target("llama")
    ids = torch.tensor([PROMPTS[0]])
    kwargs = dict(max_new_tokens=5, cache_implementation="static", **OUTPUTS)
    ours = flash(model, ids, **kwargs)
    assert_same_outputs(ours, stock(model, ids, **kwargs))
    assert {a.shape[-1] for entry in ours.attentions for a in entry} == {ids.shape[1] + 4}


def test_without_a_cache_every_entry_is_the_whole_sequence():
    """use_cache=False: stock feeds the whole sequence each step. The same rows (a query's
    entries do not depend on later columns), but for a padding row that sees no key (stock's
    eager softmax spreads it over every column of that forward: see `recording`)."""
    model = target("llama")
    ids, mask = left_pad(PROMPTS)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, use_cache=False, **OUTPUTS)
    ours = flash(model, ids, **kwargs)
    theirs = stock(model, ids, **kwargs)
    assert_same_outputs(ours, theirs, rows=0)              # the row without padding
    width = ids.shape[1]
    assert ours.attentions[3][0].shape == (3, model.config.num_attention_heads, width + 3, width + 3)
    live = mask[1].bool()
    for step in range(4):
        rows = torch.cat([live, torch.ones(step, dtype=torch.bool)])
        for a, b in zip(ours.hidden_states[step], theirs.hidden_states[step]):
            torch.testing.assert_close(a[1, rows], b[1, rows])
        for a, b in zip(ours.attentions[step], theirs.attentions[step]):
            torch.testing.assert_close(a[1, :, rows], b[1, :, rows])


def test_past_key_values_and_inputs_embeds():
    model = target("gpt2")
    ids, mask = left_pad(PROMPTS)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, **OUTPUTS)

    def prompt_cache():
        return model(ids[:, :4], attention_mask=mask[:, :4], use_cache=True).past_key_values

    ours = flash(model, ids, past_key_values=prompt_cache(), **kwargs)
    theirs = stock(model, ids, past_key_values=prompt_cache(), **kwargs)
    assert_same_outputs(ours, theirs)
    assert ours.attentions[0][0].shape[-2:] == (ids.shape[1] - 4, ids.shape[1])
    embeds = model.get_input_embeddings()(ids)
    ours = flash(model, inputs_embeds=embeds, **kwargs)
    assert_same_outputs(ours, stock(model, inputs_embeds=embeds, **kwargs))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_right_padding_as_stock_runs_it(arch):
    """transformers' own model testers build right-padded masks (``torch.tril``): stock takes
    a row's first token from its last (padding) column, whose query sees the row's prompt."""
    ids = torch.tensor([PROMPTS[1], PROMPTS[2] + [0, 0]])
    mask = torch.tensor([[1] * 7, [1] * 5 + [0, 0]])
    model = target(arch)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, **OUTPUTS)
    assert_same_outputs(flash(model, ids, **kwargs), stock(model, ids, **kwargs))


def test_a_row_that_ended_holds_nan_after_its_end():
    model = target("llama")
    ids, mask = left_pad(PROMPTS)
    plain = stock(model, ids, attention_mask=mask, max_new_tokens=6)
    eos = int(plain[0, ids.shape[1] + 1])                  # row 0's second token
    kwargs = dict(attention_mask=mask, max_new_tokens=6, eos_token_id=eos, **OUTPUTS)
    ours = flash(model, ids, **kwargs)
    theirs = stock(model, ids, **kwargs)
    assert torch.equal(ours.sequences, theirs.sequences)
    ended = next(step for step in range(6) if ours.sequences[0, ids.shape[1] + step] == eos) + 1
    for step, (attentions, hidden) in enumerate(zip(ours.attentions, ours.hidden_states)):
        for entry, stocks in ((attentions, theirs.attentions[step]),
                              (hidden, theirs.hidden_states[step])):
            for a, b in zip(entry, stocks):
                assert a.shape == b.shape
                assert bool(a[0].isnan().all()) == (step >= ended)
                torch.testing.assert_close(a[1:], b[1:])
                if step < ended:
                    torch.testing.assert_close(a[0], b[0])
    assert math.isnan(float(ours.scores[-1][0, 0]))
