"""Right-padded prompts (rows whose last columns are padding) on the engine, as stock runs them.

transformers' `CausalLMModelTester` makes such masks with ``torch.tril``, so many of
transformers' generation tests use them. Stock (5.17) feeds the prompt at position ids
``mask.cumsum(-1) - 1`` (0 at padding), takes a row's first token from its last column (a
padding column, at position 0) and feeds the row's new tokens at positions 1, 2, ...
(`plan._stock_positions` has the details); the engine reproduces it with a per-row offset
between its cache positions and the model's position ids (`WindowCache.model_positions`).

Checked against stock `generate` on the tiny models of tests/_models.py: greedy tokens equal
(Llama, GPT-2, Qwen3; plain, prompt lookup, an assistant), seeded sampling the same with and
without drafts, and the inputs stock takes with such a mask (token types, position ids,
inputs_embeds, logit edits, a returned and continued cache). A sliding window the call's
columns exceed still runs on stock (its window counts the padding columns).
"""

from __future__ import annotations

import functools

import pytest
import torch

from test_cache_and_inputs import modes, on_engine
from test_generate import _quiet_single_threaded, target  # noqa: F401 (fixture)

ARCHS = ("llama", "gpt2", "qwen3")
NEW = 12
torch.manual_seed(3)
# transformers' tester: random ids, a `tril` mask (every row but the last right-padded)
IDS = torch.randint(1, 128, (4, 9))
MASK = torch.tril(torch.ones_like(IDS))
MASK[3] = 1
# A mixed batch: right padding, left padding, padding on both sides, a full row.
MIXED = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1, 1, 1],
                      [0, 1, 1, 1, 1, 0, 0, 0, 0], [1] * 9])


@functools.lru_cache(maxsize=None)
def stock(arch: str, which: str, rows: int) -> torch.Tensor:
    mask = {"tril": MASK, "mixed": MIXED}[which][:rows]
    return target(arch).generate(IDS[:rows], attention_mask=mask, max_new_tokens=NEW,
                                 do_sample=False)


@pytest.mark.parametrize("mode", ["plain", "lookup", "assistant"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_stock(arch, mode):
    """transformers' tester's `tril` mask (4 rows, 3 right-padded) and a mixed batch:
    flash greedy = stock greedy (stock without drafts), token for token."""
    for which, mask in (("tril", MASK), ("mixed", MIXED)):
        with on_engine():
            out = target(arch).generate(IDS, attention_mask=mask, max_new_tokens=NEW,
                                        do_sample=False, sampler="flash",
                                        return_dict_in_generate=True, **modes(arch)[mode])
        expected = stock(arch, which, 4)
        assert torch.equal(out.sequences, expected), (which, out.sequences[:, 9:].tolist(),
                                                      expected[:, 9:].tolist())
        if mode != "plain":
            assert int(out.flash_stats.drafted.sum()) > 0, out.flash_stats.summary()


@pytest.mark.parametrize("arch", ARCHS)
def test_one_right_padded_row(arch):
    with on_engine():
        ours = target(arch).generate(IDS[1:2], attention_mask=MASK[1:2], max_new_tokens=NEW,
                                     do_sample=False, sampler="flash")
    assert torch.equal(ours, target(arch).generate(IDS[1:2], attention_mask=MASK[1:2],
                                                   max_new_tokens=NEW, do_sample=False))


@pytest.mark.parametrize("arch", ARCHS)
def test_seeded_sampling_same_tokens_with_drafts(arch):
    with on_engine():
        runs = [target(arch).generate(IDS, attention_mask=MASK, max_new_tokens=NEW,
                                      sampler="flash", do_sample=True, seed=7, **kwargs)
                for kwargs in modes(arch).values()]
    assert all(torch.equal(runs[0], other) for other in runs[1:])


def test_inputs_stock_takes_with_right_padding():
    """GPT-2 (learned positions): token types, position ids of stock's (with another value
    at the padding: stock continues from the last column's), inputs_embeds and fused logit
    edits over the padded context, as stock."""
    model = target("gpt2")
    positions = (MASK.cumsum(1) - 1).masked_fill(MASK == 0, 3)
    for kwargs in (dict(token_type_ids=torch.randint(0, 3, IDS.shape)),
                   dict(position_ids=positions),
                   dict(inputs_embeds=model.get_input_embeddings()(IDS).detach()),
                   dict(repetition_penalty=1.3, no_repeat_ngram_size=2)):
        with on_engine():
            ours = model.generate(IDS, attention_mask=MASK, max_new_tokens=6, sampler="flash",
                                  **kwargs)
        assert torch.equal(ours, model.generate(IDS, attention_mask=MASK, max_new_tokens=6,
                                                **kwargs)), list(kwargs)


def test_returned_cache_continues_as_stocks():
    """The cache a right-padded call returns holds stock's entries at the live columns, and
    a second call continuing it gives stock's tokens."""
    model = target("llama")
    kwargs = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    theirs = model.generate(IDS, attention_mask=MASK, **kwargs)
    with on_engine():
        ours = model.generate(IDS, attention_mask=MASK, sampler="flash", **kwargs)
    assert torch.equal(ours.sequences, theirs.sequences)
    live = torch.cat([MASK, torch.ones(4, 4, dtype=torch.long)], 1).bool()
    for mine, stocks in zip(ours.past_key_values.layers, theirs.past_key_values.layers):
        assert torch.allclose(mine.keys.transpose(1, 2)[live], stocks.keys.transpose(1, 2)[live],
                              atol=1e-5)
    mask = torch.cat([MASK, torch.ones(4, 5, dtype=torch.long)], 1)
    second = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    with on_engine():
        again = model.generate(ours.sequences, past_key_values=ours.past_key_values,
                               sampler="flash", **second)
    assert torch.equal(again, model.generate(theirs.sequences,
                                             past_key_values=theirs.past_key_values, **second))


def test_sliding_window_past_the_padding_runs_on_stock():
    """Mistral (window 6): a right-padded call within the window runs on the engine; one
    whose columns exceed it runs on stock (stock's window counts the padding columns)."""
    model = target("mistral")
    ids, mask = IDS[:, :3], MASK[:, :3]
    with on_engine():
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=3, sampler="flash")
    assert torch.equal(ours, model.generate(ids, attention_mask=mask, max_new_tokens=3))
    with pytest.warns(UserWarning, match="exceed the model's sliding window"):
        ours = model.generate(IDS, attention_mask=MASK, max_new_tokens=4, sampler="flash")
    assert torch.equal(ours, model.generate(IDS, attention_mask=MASK, max_new_tokens=4))


def test_a_row_without_a_live_token_runs_on_stock():
    mask = MASK.clone()
    mask[0] = 0
    with pytest.warns(UserWarning, match="a row without a live token"):
        target().generate(IDS, attention_mask=mask, max_new_tokens=2, sampler="flash")


def test_invariant_kernels_read_the_last_padding_columns_query_as_stock():
    """With ``invariant=True`` every forward attends by position (Triton's interpreter on
    CPU), the prefill included: a right-padded row's last column is a dead query (its own key
    masked), which reads the keys before its position, as stock's mask has it."""
    model = target("llama")
    with on_engine():
        ours = model.generate(IDS[1:3], attention_mask=MASK[1:3], max_new_tokens=3,
                              do_sample=False, sampler="flash", invariant=True)
    assert torch.equal(ours, stock("llama", "tril", 4)[1:3, :IDS.shape[1] + 3])
