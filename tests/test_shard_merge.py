"""The ranks' summaries merged in one kernel (`kernels.merge_shard_summaries`, Triton's
interpreter here) against the torch merge (`flashspec.parallel.merge` and `acceptance`) on
the same gathered words: every field equal but the log-sum-exps and logprobs (float32 sums
in another order, to rounding). A decision within rounding of its boundary could go either
way (`kernels/shard_merge.py`), so the examples are fixed (derandomized; 400 random ones
found none there on 2026-11-28); the ties and the top-p boundary below are written exactly.

The words are what the ranks' torch summaries (`parallel.shard.summarize`) write for random
logits of small integers over 4, so that scores tie within a shard and across shards, and
rows that are not finite; the shard sizes,
ranks, drafts (with padding), modes (truncated ones too) and candidates per rank (few: some
supports stay uncertified and are flagged) are drawn by Hypothesis.
"""

import pytest
import torch
from hypothesis import given, seed, settings, strategies as st

from flashspec import SamplingParams, kernels, rng
from flashspec.outputs import NON_FINITE, OK, SampleOutput
from flashspec.parallel import VocabShards, acceptance, merge, sampling, shard, summary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODES = {
    "greedy": dict(do_sample=False),
    "temperature": dict(temperature=[0.5, 1.0, 2.0, 0.7]),
    "top_k": dict(temperature=[0.5, 1.0, 0.75, 1.0], top_k=[1, 3, 6, 40]),
    "top_p": dict(temperature=[1.0, 0.5, 2.0, 1.0], top_p=[0.5, 0.9, 0.8, 0.99]),
    "min_p": dict(temperature=[1.0, 2.0, 0.25, 1.0], min_p=[0.05, 0.2, 0.1, 0.5]),
    "mixed": dict(do_sample=[False, True, True, True], temperature=[1.0, 0.5, 1.0, 0.0],
                  top_k=[0, 4, 0, 2], top_p=[1.0, 0.9, 0.7, 1.0], min_p=[0.0, 0.0, 0.1, 0.0]),
}


def _logits(g: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    logits = torch.randint(-12, 13, (rows, vocab), generator=g) / 4
    logits[torch.rand(rows, generator=g) < 0.05, vocab // 3] = float("nan")
    return logits


def _gathered(logits, shards, layout, params, positions, drafts):
    return torch.stack([
        shard.summarize(logits[:, offset:offset + size], layout, params, positions, offset,
                        shards.vocab_size, drafts)
        for offset, size in zip(shards.offsets, shards.sizes)]).to(DEVICE)


def _assert_close(kernel, torch_out, name):
    kernel, torch_out = (type(out)(*(field.cpu() for field in out)) for out in (kernel, torch_out))
    if hasattr(kernel, "accept_probs"):      # (not defined for rows whose status is not OK)
        kernel, torch_out = (out._replace(accept_probs=torch.where(
            (out.status == OK)[:, None], out.accept_probs, 0.0)) for out in (kernel, torch_out))
    for field, (a, b) in zip(type(kernel)._fields, zip(kernel, torch_out)):
        if a.dtype.is_floating_point:
            torch.testing.assert_close(a, b.to(a.dtype), rtol=2e-6, atol=2e-6, equal_nan=True,
                                       msg=f"{name}: {field}")
        else:
            assert torch.equal(a, b.to(a.dtype)), (name, field, a.tolist(), b.tolist())


def _torch_sample(words, layout, shards, params, positions):
    """What `parallel.sample(check=False, complete=False)` returns on its torch route."""
    rows = merge.merge_rows(summary.unpack(words, layout), shards, params, positions)
    out = SampleOutput(torch.where(rows.finite, rows.tokens, -1),
                       torch.where(rows.finite, rows.logprobs, float("nan")),
                       torch.where(rows.finite, rows.lse, float("nan")),
                       torch.where(rows.finite, OK, NON_FINITE).to(torch.int32))
    return sampling._flag_incomplete(out, rows.incomplete)


def _torch_verify(words, layout, shards, params, positions, drafts, how):
    """What `parallel.verify(check=False, complete=False)` returns on its torch route."""
    num_positions = drafts.shape[1] + 1
    flat = acceptance.flat_drafts(drafts)
    rows = merge.merge_rows(summary.unpack(words, layout), shards,
                            params.repeat_interleave(num_positions, validate=False),
                            (positions[:, None] + torch.arange(num_positions,
                                                               device=DEVICE)).flatten(), flat)
    out = acceptance.accept(rows, drafts, params, positions, how)
    used = (torch.arange(num_positions, device=DEVICE)[None, :]
            <= (flat.view(-1, num_positions) >= 0).sum(dim=1, keepdim=True))
    return sampling._flag_incomplete(
        out, (rows.incomplete.view(-1, num_positions) & used).any(dim=1))


@seed(0)
@settings(max_examples=60, deadline=None, derandomize=True)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       batch=st.integers(1, 4), num_drafts=st.integers(0, 3), mode=st.sampled_from(list(MODES)),
       candidates=st.integers(1, 6), probabilistic=st.booleans(),
       data_seed=st.integers(0, 2**16))
def test_the_kernel_merges_as_torch_does(sizes, batch, num_drafts, mode, candidates,
                                         probabilistic, data_seed):
    """Every op and mode, with candidates few enough that some rows stay uncertified."""
    g = torch.Generator().manual_seed(data_seed)
    shards = VocabShards(tuple(sizes), 0)
    vocab = shards.vocab_size
    modes = {k: (v[:batch] if isinstance(v, list) else v) for k, v in MODES[mode].items()}
    params = SamplingParams.create(batch, **modes, seed=data_seed)
    positions = torch.randint(0, 1000, (batch,), generator=g)
    on = params.to(DEVICE), positions.to(DEVICE)

    logits = _logits(g, batch, vocab)
    layout = summary.summary_layout("argmax", shards)
    words = _gathered(logits, shards, layout, None, None, None)
    _assert_close(kernels.merge_shard_summaries(words, layout, vocab),
                  merge.merge_argmax(summary.unpack(words, layout)), "argmax")

    layout = summary.summary_layout("sample", shards, params, candidates)
    words = _gathered(logits, shards, layout, params, positions, None)
    _assert_close(kernels.merge_shard_summaries(words, layout, vocab, *on),
                  _torch_sample(words, layout, shards, *on), "sample")

    # verify: drafts mostly the target's likely tokens, some padding, some beyond it
    num_positions = num_drafts + 1
    logits = _logits(g, batch * num_positions, vocab)
    drafts = torch.where(torch.rand(batch, num_drafts, generator=g) < 0.5,
                         logits.view(batch, num_positions, vocab)[:, :-1].nan_to_num(0.0)
                         .argmax(dim=-1),
                         torch.randint(0, vocab, (batch, num_drafts), generator=g))
    drafts[torch.rand(batch, num_drafts, generator=g) < 0.2] = -1
    flat_params = params.repeat_interleave(num_positions, validate=False)
    flat_positions = (positions[:, None] + torch.arange(num_positions)).flatten()
    layout = summary.summary_layout("verify", shards, params, candidates)
    words = _gathered(logits, shards, layout, flat_params, flat_positions,
                      acceptance.flat_drafts(drafts))
    how = "probabilistic" if probabilistic else "strict"
    _assert_close(kernels.merge_shard_summaries(words, layout, vocab, *on, drafts.to(DEVICE),
                                                how),
                  _torch_verify(words, layout, shards, *on, drafts.to(DEVICE), how),
                  f"verify {how}")


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
        out = kernels.merge_shard_summaries(words.to(DEVICE), layout, 8, params.to(DEVICE),
                                            positions.to(DEVICE), drafts.to(DEVICE))
        _assert_close(out, expected, f"draft {draft}")


def test_a_top_p_boundary_met_exactly_removes_the_token():
    """Two equal logits under a top-k of 2: the second's mass from it down is exactly
    1 - top_p of the total, so transformers removes it; every seed samples the first."""
    shards = VocabShards((1, 2), 0)
    logits = torch.tensor([[0.0, 0.0, -4.0]]).repeat(8, 1)
    params = SamplingParams.create(8, temperature=1.0, top_k=2, top_p=0.5, seed=list(range(8)))
    positions = torch.arange(8)
    layout = summary.summary_layout("sample", shards, params)
    words = _gathered(logits, shards, layout, params, positions, None)
    on = params.to(DEVICE), positions.to(DEVICE)
    out = kernels.merge_shard_summaries(words, layout, 3, *on)
    _assert_close(out, _torch_sample(words, layout, shards, *on), "top-p boundary")
    assert out.tokens.tolist() == [0] * 8 and out.status.tolist() == [OK] * 8


def test_words_of_another_layout_are_refused():
    shards = VocabShards((4, 4), 0)
    params = SamplingParams.create(1, temperature=1.0, top_k=3)
    layout = summary.summary_layout("sample", shards, params)
    words = torch.zeros(2, 1, layout.fields, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=f"the layout has {layout.words} words per row"):
        kernels.merge_shard_summaries(words, layout, 8, params.to(DEVICE),
                                      torch.zeros(1, dtype=torch.int64, device=DEVICE))
