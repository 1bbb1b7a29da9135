"""The ranks' summaries merged in one kernel (`kernels.merge_shard_summaries`, Triton's
interpreter here) against the torch merge (`flashspec.parallel.merge` and `acceptance`) on
the same gathered words: every field equal but the log-sum-exps and logprobs (float32 sums
in another order, to rounding).

The words are what the ranks' torch summaries (`parallel.shard.summarize`) write for random
logits of small integers over 4, so that scores tie within a shard and across shards, with
rows that are not finite, tokens banned (-inf) and shards banned whole; the shard sizes,
ranks, drafts (with padding) and modes are drawn by Hypothesis.
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from flashspec import SamplingParams, kernels, rng
from flashspec.outputs import NON_FINITE, OK, SampleOutput
from flashspec.parallel import VocabShards, acceptance, merge, shard, summary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODES = {
    "greedy": dict(do_sample=False),
    "temperature": dict(temperature=[0.5, 1.0, 2.0, 0.7]),
    "mixed": dict(do_sample=[False, True, True, False], temperature=[1.0, 0.5, 1.0, 0.0]),
}


def _logits(g: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    logits = torch.randint(-12, 13, (rows, vocab), generator=g) / 4
    logits[torch.rand(rows, vocab, generator=g) < 0.1] = float("-inf")
    odd = torch.rand(rows, generator=g)
    logits[odd < 0.1, vocab // 3] = float("nan")
    logits[odd > 0.9, : vocab // 2] = float("-inf")          # the first shard banned whole
    return logits


def _gathered(logits, shards, layout, params, positions, drafts):
    return torch.stack([
        shard.summarize(logits[:, offset:offset + size], layout, params, positions, offset,
                        shards.vocab_size, drafts)
        for offset, size in zip(shards.offsets, shards.sizes)]).to(DEVICE)


def _assert_close(kernel, torch_out, name):
    if hasattr(kernel, "accept_probs"):      # (not defined for rows whose status is not OK)
        kernel, torch_out = (out._replace(accept_probs=torch.where(
            (out.status == OK)[:, None], out.accept_probs, 0.0)) for out in (kernel, torch_out))
    for field, (a, b) in zip(type(kernel)._fields, zip(kernel, torch_out)):
        if a.dtype.is_floating_point:
            torch.testing.assert_close(a, b.to(a.dtype), rtol=2e-6, atol=2e-6, equal_nan=True,
                                       msg=f"{name}: {field}")
        else:
            assert torch.equal(a, b.to(a.dtype)), (name, field, a.tolist(), b.tolist())


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       batch=st.integers(1, 4), num_drafts=st.integers(0, 3), mode=st.sampled_from(list(MODES)),
       probabilistic=st.booleans(), data_seed=st.integers(0, 2**16))
def test_the_kernel_merges_as_torch_does(sizes, batch, num_drafts, mode, probabilistic,
                                         data_seed):
    g = torch.Generator().manual_seed(data_seed)
    shards = VocabShards(tuple(sizes), 0)
    vocab = shards.vocab_size
    modes = {k: (v[:batch] if isinstance(v, list) else v) for k, v in MODES[mode].items()}
    params = SamplingParams.create(batch, **modes, seed=data_seed)
    positions = torch.randint(0, 1000, (batch,), generator=g)

    # argmax
    logits = _logits(g, batch, vocab)
    layout = summary.summary_layout("argmax", shards)
    words = _gathered(logits, shards, layout, None, None, None)
    _assert_close(kernels.merge_shard_summaries(words, layout.fields),
                  merge.merge_argmax(summary.unpack(words, layout)), "argmax")

    # sample
    layout = summary.summary_layout("sample", shards, params)
    words = _gathered(logits, shards, layout, params, positions, None)
    rows = merge.merge_rows(summary.unpack(words, layout), shards, params.to(DEVICE),
                            positions.to(DEVICE))
    expected = SampleOutput(torch.where(rows.finite, rows.tokens, -1),
                            torch.where(rows.finite, rows.logprobs, float("nan")),
                            torch.where(rows.finite, rows.lse, float("nan")),
                            torch.where(rows.finite, OK, NON_FINITE).to(torch.int32))
    _assert_close(kernels.merge_shard_summaries(words, layout.fields, params.to(DEVICE),
                                                positions.to(DEVICE)), expected, "sample")

    # verify: drafts mostly the target's likely tokens, some padding, some beyond it
    num_positions = num_drafts + 1
    logits = _logits(g, batch * num_positions, vocab)
    drafts = torch.where(torch.rand(batch, num_drafts, generator=g) < 0.5,
                         logits.view(batch, num_positions, vocab)[:, :-1].nan_to_num(0.0)
                         .argmax(dim=-1),
                         torch.randint(0, vocab, (batch, num_drafts), generator=g))
    drafts[torch.rand(batch, num_drafts, generator=g) < 0.2] = -1
    flat = acceptance.flat_drafts(drafts)
    flat_params = params.repeat_interleave(num_positions, validate=False)
    flat_positions = (positions[:, None] + torch.arange(num_positions)).flatten()
    layout = summary.summary_layout("verify", shards, params)
    words = _gathered(logits, shards, layout, flat_params, flat_positions, flat)
    how = "probabilistic" if probabilistic else "strict"
    rows = merge.merge_rows(summary.unpack(words, layout), shards, flat_params.to(DEVICE),
                            flat_positions.to(DEVICE), flat.to(DEVICE))
    expected = acceptance.accept(rows, drafts.to(DEVICE), params.to(DEVICE),
                                 positions.to(DEVICE), how)
    _assert_close(kernels.merge_shard_summaries(words, layout.fields, params.to(DEVICE),
                                                positions.to(DEVICE), drafts.to(DEVICE), how),
                  expected, f"verify {how}")


def test_a_draft_tied_with_the_best_other_token_wins_by_the_lower_id():
    """The draft's perturbed score equal to the best other token's (words written so): the
    lower id is the target's sample, in the kernel as in torch."""
    shards = VocabShards((4, 4), 0)
    params = SamplingParams.create(1, temperature=1.0, seed=5)
    positions = torch.tensor([3])
    layout = summary.summary_layout("verify", shards, params)
    for draft, other in ((2, 6), (6, 2)):
        drafts = torch.tensor([[draft]])
        noise = rng.gumbel(5, positions, torch.tensor([draft]), dtype=torch.float32)
        tie = torch.tensor([1.0]) + noise                 # the draft's score, in float32
        words = torch.zeros(2, 2, layout.words, dtype=torch.int32)
        for rank in range(2):
            holds_draft = rank == draft // 4
            fields = [torch.tensor([float("-inf") if holds_draft else float(tie), 0.5]),
                      torch.tensor([4 * rank + (draft if holds_draft else other) % 4 ^ 1,
                                    4 * rank]),
                      torch.tensor([0.25, 0.5]), torch.tensor([2.0, 1.0]),
                      torch.tensor([1.0 if holds_draft else float("-inf"), float("-inf")])]
            if not holds_draft:
                fields[1][0] = other
            words[rank] = summary.pack(fields)
        flat = acceptance.flat_drafts(drafts)
        flat_params = params.repeat_interleave(2, validate=False)
        rows = merge.merge_rows(summary.unpack(words, layout), shards, flat_params,
                                positions + torch.arange(2), flat)
        expected = acceptance.accept(rows, drafts, params, positions, "strict")
        assert int(expected.tokens[0, 0]) == min(draft, other)
        out = kernels.merge_shard_summaries(words.to(DEVICE), layout.fields, params.to(DEVICE),
                                            positions.to(DEVICE), drafts.to(DEVICE))
        _assert_close(out, expected, f"draft {draft}")


def test_words_with_candidates_are_refused():
    shards = VocabShards((4, 4), 0)
    params = SamplingParams.create(1, temperature=1.0, top_k=3)
    layout = summary.summary_layout("sample", shards, params)
    words = torch.zeros(2, 1, layout.words, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="without candidates"):
        kernels.merge_shard_summaries(words, layout.fields, params.to(DEVICE),
                                      torch.zeros(1, dtype=torch.int64, device=DEVICE))
