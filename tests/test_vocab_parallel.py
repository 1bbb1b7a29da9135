"""Vocab-parallel argmax / sample / verify (`flashspec.parallel`) over gloo, 2 and 3 ranks in
spawned processes: every rank returns what one process returns from the full weight.

One spawn per rank count runs every case; each rank checks its results against
`flashspec.sampling` (reference backend) itself and rank 0 writes the exchange counters
for the parent. The vocabulary, 1001, is divisible by neither rank count.

Exactness needs the same logits on both sides, but a CPU matmul's rounding depends on how
many vocabulary rows it multiplies. The cases' weights and hidden states are multiples of
1/16 and 1/8 with small numerators, so every product and sum is exact in float32 and the
logits are bitwise the same however they are split (ties included: they are frequent).
One case takes generic floats and compares with the reference on the shards' own logits.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from _ranks import run_ranks

import flashspec
from flashspec import parallel, reference, sampling
from flashspec.bench import parallel_head
from flashspec.checks import NonFiniteLogitsError
from flashspec.outputs import NEEDS_COMPLETION, SampleOutput, VerifyOutput
from flashspec.parallel import VocabShards, summary
from flashspec.params import BAN, KEEP, PENALIZE, LogitEdits

VOCAB, DIM, BATCH, DRAFTS = 1001, 32, 4, 3
# A collective that hangs fails the test instead of CI.
# The 3 ranks run the fused merge in Triton's interpreter: 116 s on 2 busy cores (2026-11-28).
COLLECTIVE_TIMEOUT_S, SPAWN_TIMEOUT_S = 60, 300

MODES = {
    "greedy": dict(do_sample=False),
    "temperature": dict(temperature=[0.5, 0.8, 1.0, 1.7]),
    "top_k": dict(temperature=0.9, top_k=[1, 5, 20, 60]),
    "top_k_default": dict(top_k=50),  # what transformers samples with when nothing is set
    "top_p": dict(temperature=[0.7, 1.0, 1.3, 2.0], top_p=[0.5, 0.8, 0.9, 0.95]),
    "min_p": dict(temperature=[1.0, 1.5, 2.0, 3.0], min_p=[0.01, 0.05, 0.1, 0.3]),
    "mixed": dict(do_sample=[False, True, True, True], temperature=[1.0, 0.7, 1.2, 1.0],
                  top_k=[0, 50, 0, 10], top_p=[1.0, 0.9, 0.8, 1.0], min_p=[0.0, 0.0, 0.05, 0.0]),
}
TRUNCATING = ("top_k", "top_k_default", "top_p", "min_p", "mixed")
ROUNDS = 3


def _grid(generator, *shape, denominator):
    return torch.randint(-16, 17, shape, generator=generator).float() / denominator


def _uneven_size(rank: int, world_size: int) -> int:
    """Shard sizes unlike transformers': (200, 801) and (1, 700, 300)."""
    return {2: (200, 801), 3: (1, 700, 300)}[world_size][rank]


def _assert_same(ours, theirs, what: str) -> None:
    """Integer fields equal; float fields to float32 rounding (measured within 2e-6 at
    these logits' magnitudes), NaN where theirs are NaN."""
    for name, a, b in zip(type(theirs)._fields, ours, theirs):
        if a.dtype.is_floating_point:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5, equal_nan=True,
                                       msg=lambda m, name=name: f"{what}: {name}: {m}")
        elif not torch.equal(a, b):
            raise AssertionError(f"{what}: {name} differ:\n{a.tolist()}\n{b.tolist()}")


def _drafts(weight, hidden, params, positions, generator):
    """Drafts that are often the target's own samples (accepted), else random, -1 padded
    (at the end, and first with ids after it)."""
    num_positions = hidden.shape[1]
    own = torch.stack([sampling.sample(hidden[:, j], weight, params, positions + j).tokens
                       for j in range(num_positions - 1)], dim=1)
    random = torch.randint(0, VOCAB, own.shape, generator=generator)
    drafts = torch.where(torch.rand(own.shape, generator=generator) < 0.6, own, random)
    drafts[0, -1] = -1
    drafts[1, 0] = -1           # drafts end at the first padding: the ids after it are unused
    return drafts


def _cases(rank: int, world_size: int) -> dict:
    generator = torch.Generator().manual_seed(1234)  # the same draws on every rank
    weight = _grid(generator, VOCAB, DIM, denominator=16)
    layouts = {"chunked": VocabShards.chunked(VOCAB),
               "uneven": VocabShards.gather(_uneven_size(rank, world_size))}
    chunk = -(-VOCAB // world_size)
    assert layouts["chunked"].sizes == tuple(len(c) for c in torch.arange(VOCAB).chunk(world_size))
    assert layouts["chunked"].offset == rank * chunk
    assert layouts["uneven"].sizes == tuple(_uneven_size(r, world_size) for r in range(world_size))
    report = {}
    for layout_name, shards in layouts.items():
        local = shards.local(weight)
        for mode, kwargs in MODES.items():
            parallel.reset_stats()
            # Modes that truncate run again with 2 candidates: retries and completion run often.
            budgets = (summary.DEFAULT_CANDIDATES, 2) if mode in TRUNCATING else (None,)
            stats = {budget: parallel.ExchangeStats() for budget in budgets}
            for round_ in range(ROUNDS):
                what = f"{world_size} ranks, {layout_name}, {mode}, round {round_}"
                params = flashspec.SamplingParams.create(BATCH, **kwargs, seed=100 * round_)
                positions = torch.randint(0, 10_000, (BATCH,), generator=generator)
                hidden = _grid(generator, BATCH, DRAFTS + 1, DIM, denominator=8)
                drafts = _drafts(weight, hidden, params, positions, generator)
                sampled = sampling.sample(hidden[:, 0], weight, params, positions)
                verified = {acceptance: sampling.verify(hidden, weight, drafts, params, positions,
                                                        acceptance=acceptance)
                            for acceptance in ("strict", "probabilistic")}
                for budget in budgets:
                    budget_kwargs = {} if budget is None else dict(candidates=budget)
                    parallel.reset_stats()
                    _assert_same(parallel.sample(hidden[:, 0], local, params, positions,
                                                 shards=shards, **budget_kwargs),
                                 sampled, f"{what}, {budget} candidates")
                    for acceptance, expected in verified.items():
                        _assert_same(parallel.verify(hidden, local, drafts, params, positions,
                                                     shards=shards, acceptance=acceptance,
                                                     **budget_kwargs),
                                     expected, f"{what}, {budget} candidates, verify {acceptance}")
                    stats[budget] = _added(stats[budget], parallel.stats())
            for budget, counted in stats.items():
                report[f"{layout_name}/{mode}/{budget}"] = dataclasses.asdict(counted)
        hidden = _grid(generator, 16, DIM, denominator=8)
        _assert_same(parallel.argmax(hidden, local, shards=shards),
                     sampling.argmax(hidden, weight), f"{layout_name}, argmax")
    _model_head_and_edits(weight, layouts["chunked"], generator)
    _non_finite_rows(weight, layouts["chunked"], generator)
    _generic_floats(layouts["uneven"], generator)
    _benchmark_steps(weight, layouts["uneven"], generator)
    for shards in layouts.values():
        _fused_shards(weight, shards, generator)
    _deferred_completion(weight, layouts["uneven"], generator)
    report["bytes_per_row"] = {
        op: summary.summary_layout(op, layouts["chunked"], params).bytes_per_row
        for op, params in (("argmax", None),
                           ("sample", flashspec.SamplingParams.create(BATCH, temperature=0.7)),
                           ("verify", flashspec.SamplingParams.create(BATCH, temperature=0.7)))}
    return report


def _added(a: parallel.ExchangeStats, b: parallel.ExchangeStats) -> parallel.ExchangeStats:
    return parallel.ExchangeStats(*(getattr(a, field.name) + getattr(b, field.name)
                                    for field in dataclasses.fields(a)))


def _model_head_and_edits(weight, shards, generator):
    """An LM-head bias, a softcap and logit edits, each rank holding its shard of them."""
    params = flashspec.SamplingParams.create(BATCH, **MODES["mixed"], seed=7)
    positions = torch.arange(BATCH) * 11
    bias = _grid(generator, VOCAB, denominator=128)
    hidden = _grid(generator, BATCH, DRAFTS + 1, DIM, denominator=8)
    # A tenth of the tokens penalized, a tenth banned.
    codes = torch.tensor([KEEP] * 8 + [PENALIZE, BAN], dtype=torch.uint8)[
        torch.randint(0, 10, (BATCH, DRAFTS + 1, VOCAB), generator=generator)]
    edits = LogitEdits(codes, torch.full((BATCH,), 1.3, dtype=torch.float64))
    local_edits = LogitEdits(shards.local(codes, dim=-1), edits.penalty)
    head = dict(bias=bias, softcap=20.0)
    local_head = dict(bias=shards.local(bias), softcap=20.0)
    first = LogitEdits(edits.codes[:, 0].contiguous(), edits.penalty)
    local_first = LogitEdits(local_edits.codes[:, 0].contiguous(), edits.penalty)
    _assert_same(parallel.sample(hidden[:, 0], shards.local(weight), params, positions,
                                 shards=shards, edits=local_first, **local_head),
                 sampling.sample(hidden[:, 0], weight, params, positions, edits=first, **head),
                 "head and edits, sample")
    drafts = _drafts(weight, hidden, params, positions, generator)
    _assert_same(parallel.verify(hidden, shards.local(weight), drafts, params, positions,
                                 shards=shards, edits=local_edits, **local_head),
                 sampling.verify(hidden, weight, drafts, params, positions, edits=edits, **head),
                 "head and edits, verify")


def _non_finite_rows(weight, shards, generator):
    params = flashspec.SamplingParams.create(BATCH, **MODES["mixed"], seed=3)
    positions = torch.arange(BATCH)
    hidden = _grid(generator, BATCH, DIM, denominator=8)
    hidden[1, 0] = float("inf")
    local = shards.local(weight)
    _assert_same(parallel.sample(hidden, local, params, positions, shards=shards, check=False),
                 sampling.sample(hidden, weight, params, positions, check=False), "non-finite")
    try:
        parallel.sample(hidden, local, params, positions, shards=shards)
    except NonFiniteLogitsError as error:
        assert error.rows == [1], error.rows
    else:
        raise AssertionError("a non-finite row did not raise")
    try:
        parallel.sample(hidden.double(), local.double(), params, positions, shards=shards)
    except ValueError as error:
        assert "float64" in str(error), error
    else:
        raise AssertionError("float64 inputs were not refused")


def _generic_floats(shards, generator):
    """Generic float32 logits: the reference on the very logits the shards compute."""
    weight = torch.randn(VOCAB, DIM, generator=generator)
    logits_of = lambda hidden: torch.cat(
        [parallel.shard.shard_logits(hidden, part) for part in
         weight.split(list(shards.sizes))], dim=-1)
    for mode, kwargs in MODES.items():
        params = flashspec.SamplingParams.create(BATCH, **kwargs, seed=11)
        positions = torch.randint(0, 10_000, (BATCH,), generator=generator)
        hidden = torch.randn(BATCH, DRAFTS + 1, DIM, generator=generator) / 2
        _assert_same(parallel.sample(hidden[:, 0], shards.local(weight), params, positions,
                                     shards=shards),
                     reference.sample_logits(logits_of(hidden[:, 0]), params, positions),
                     f"generic floats, {mode}")
        drafts = _drafts(weight, hidden, params, positions, generator)
        _assert_same(parallel.verify(hidden, shards.local(weight), drafts, params, positions,
                                     shards=shards),
                     reference.verify_logits(logits_of(hidden.flatten(0, 1)), drafts, params,
                                             positions),
                     f"generic floats, {mode}, verify")


def _with_gaps(words, layout, generator):
    """`words` ``[n, R, words]`` whose candidate lists miss some entries, as a fused summary
    (merged from its tiles' candidates) can: in each row and rank, a random subset of the
    entries after a random one dropped (the rest moved up, `PAD_KEY` after them) and the
    floor raised just above the largest dropped key (the next key up: the same logit with
    the next lower id, or the next float up)."""
    words = words.clone()
    start = layout.fields
    listed = words[..., start:].contiguous().view(torch.int64)
    for rank, row in itertools.product(*map(range, listed.shape[:2])):
        keys = listed[rank, row, :-1]
        first = int(torch.randint(0, keys.numel(), (), generator=generator))
        dropped = torch.zeros_like(keys, dtype=torch.bool)
        dropped[first + 1:] = torch.rand(keys.numel() - first - 1, generator=generator) < 0.5
        dropped &= keys != summary.PAD_KEY
        if not dropped.any():
            continue
        # The next key up: the same logit with the next lower id, or (id 0) the next float.
        kept, top = keys[~dropped], keys[dropped].max()
        floor = top + 1 if int(top) & 0x7FFFFFFF < 0x7FFFFFFF else ((top >> 32) + 1) << 32
        listed[rank, row, :-1] = summary.PAD_KEY
        listed[rank, row, :kept.numel()] = kept
        listed[rank, row, -1] = floor
    words[..., start:] = listed.view(torch.int32).view(*words.shape[:2], -1)
    return words


def _fused_shards(weight, shards, generator):
    """The fused kernels' summaries (Triton's interpreter here) give one process's results
    too: shards at offsets that are multiples of 16 or not (the noise's groups of 16
    tokens), every way a row is decided, verification."""
    local = shards.local(weight)
    hidden = _grid(generator, BATCH, DRAFTS + 1, DIM, denominator=8)
    _assert_same(parallel.argmax(hidden[:, 0], local, shards=shards, backend="fused"),
                 sampling.argmax(hidden[:, 0], weight), f"{shards.sizes}, fused argmax")
    for mode in ("temperature", "mixed"):
        params = flashspec.SamplingParams.create(BATCH, **MODES[mode], seed=5)
        positions = torch.randint(0, 10_000, (BATCH,), generator=generator)
        _assert_same(parallel.sample(hidden[:, 0], local, params, positions, shards=shards,
                                     backend="fused"),
                     sampling.sample(hidden[:, 0], weight, params, positions),
                     f"{shards.sizes}, fused, {mode}")
        drafts = _drafts(weight, hidden, params, positions, generator)
        _assert_same(parallel.verify(hidden, local, drafts, params, positions, shards=shards,
                                     backend="fused"),
                     sampling.verify(hidden, weight, drafts, params, positions),
                     f"{shards.sizes}, fused, {mode}, verify")


def _deferred_completion(weight, shards, generator):
    """``complete=False`` (the engine's calls): rows the candidates leave uncertified come
    back flagged, their tokens -1 (verification: no token accepted, logprobs 0), every
    other row as the completing call returns it."""
    local = shards.local(weight)
    hidden = _grid(generator, BATCH, DRAFTS + 1, DIM, denominator=8)
    params = flashspec.SamplingParams.create(BATCH, **MODES["top_p"], seed=9)
    positions = torch.randint(0, 10_000, (BATCH,), generator=generator)
    drafts = _drafts(weight, hidden, params, positions, generator)
    calls = {"sample": lambda **kw: parallel.sample(hidden[:, 0], local, params, positions,
                                                    shards=shards, candidates=1, **kw),
             "verify": lambda **kw: parallel.verify(hidden, local, drafts, params, positions,
                                                    shards=shards, candidates=1, **kw)}
    for op, call in calls.items():
        deferred, completed = call(complete=False), call()
        flagged = deferred.status == NEEDS_COMPLETION
        assert bool(flagged.any()), f"{op}: one candidate per rank leaves rows uncertified"
        assert bool((completed.status == 0).all())
        for name, ours, theirs in zip(type(deferred)._fields, deferred, completed):
            if name == "status":
                continue
            done = ~flagged.view(-1, *(1,) * (ours.dim() - 1)).expand_as(ours)
            assert torch.equal(ours[done], theirs[done]), (op, name)
            left = {"tokens": -1, "num_accepted": -1, "logprobs": 0.0}.get(name)
            if name == "tokens" or (op == "verify" and left is not None):
                assert bool((ours[~done] == left).all()), (op, name, ours[~done])


def _benchmark_steps(weight, shards, generator):
    """scripts/bench_parallel_head.py's two steps (timed on GPUs): the same greedy tokens as
    one process; the all-gather baseline's top-k draws within the top-k."""
    hidden = _grid(generator, BATCH, DIM, denominator=8)
    local = shards.local(weight)
    logits = hidden @ weight.T
    greedy = flashspec.SamplingParams.create(BATCH, do_sample=False)
    for step in (parallel_head.gathered_step, parallel_head.flash_step):
        assert torch.equal(step(hidden, local, greedy, shards)(), logits.argmax(dim=-1)), step
    top_k = flashspec.SamplingParams.create(BATCH, temperature=0.7, top_k=3, seed=0)
    tokens = parallel_head.gathered_step(hidden, local, top_k, shards)()
    kth = logits.topk(3, dim=-1).values[:, -1]
    assert (logits.gather(1, tokens[:, None]).squeeze(1) >= kth).all()
    out = parallel_head.flash_step(hidden, local, top_k, shards)()
    expected = sampling.sample(hidden, weight, top_k, torch.arange(BATCH) + 100)
    assert torch.equal(out.tokens, expected.tokens)


def _emulated(logits, sizes, params, positions, candidates, draft_tokens=None,
              acceptance="strict", gaps=None):
    """What ranks holding `sizes` columns of `logits` ``[R, V]`` merge, in one process: the
    summaries stacked as the all-gather would (with `gaps`, a generator: gaps in their
    candidate lists, `_with_gaps`), the merged rows (and, with `draft_tokens`, the
    `VerifyOutput`); completion not run."""
    shards = VocabShards(sizes, 0)
    op = "sample" if draft_tokens is None else "verify"
    layout = summary.summary_layout(op, shards, params, candidates)
    drafts = None
    if draft_tokens is not None:
        num_positions = draft_tokens.shape[1] + 1
        drafts = parallel.acceptance.flat_drafts(draft_tokens)
        row_params = params.repeat_interleave(num_positions, validate=False)
        row_positions = (positions[:, None] + torch.arange(num_positions)).flatten()
    else:
        row_params, row_positions = params, positions
    words = torch.stack([
        parallel.shard.summarize(logits[:, offset:offset + size], layout, row_params,
                                 row_positions, offset, shards.vocab_size, drafts)
        for offset, size in zip(shards.offsets, sizes)])
    if gaps is not None and layout.num_candidates:
        words = _with_gaps(words, layout, gaps)
    rows = parallel.merge.merge_rows(summary.unpack(words, layout), shards, row_params,
                                     row_positions, drafts)
    if draft_tokens is None:
        return rows
    return rows, parallel.acceptance.accept(rows, draft_tokens, params, positions, acceptance)


@pytest.mark.parametrize("gaps", [False, True], ids=["exact lists", "lists with gaps"])
def test_merged_candidates_certify_only_exact_supports(gaps):
    """Many layouts (shards of one token too), budgets down to one candidate, logits full of
    ties and temperatures that merge neighbouring logits, candidate lists exact or with gaps
    below a floor (as the fused summaries' can be): every row the merge certifies matches
    the reference, and small budgets do leave rows to complete."""
    torch.manual_seed(0)
    gap_generator = torch.Generator().manual_seed(1) if gaps else None
    vocab = 257
    rows_checked = rows_left = 0
    for trial in range(40):
        cuts = sorted(torch.randperm(vocab - 1)[:int(torch.randint(1, 5, ()))] + 1)
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, vocab])]
        if trial % 5 == 0:
            sizes = [1, vocab - 2, 1]
        logits = torch.randint(-40, 41, (8, vocab)).float() / 4  # ties everywhere
        params = flashspec.SamplingParams.create(
            8, do_sample=[True] * 7 + [False], temperature=[0.3, 1.0, 3.0, 0.7, 1.0, 1.9, 0.1, 1.0],
            top_k=[0, 3, 0, 20, 0, 7, 0, 0], top_p=[1.0, 1.0, 0.9, 0.8, 0.5, 1.0, 0.99, 1.0],
            min_p=[0.2, 0.0, 0.0, 0.0, 0.05, 0.1, 0.0, 0.0], seed=trial)
        positions = torch.randint(0, 1000, (8,))
        candidates = [1, 2, 4, 8, 32][trial % 5]
        rows = _emulated(logits, sizes, params, positions, candidates, gaps=gap_generator)
        expected = reference.sample_logits(logits, params, positions)
        done = ~rows.incomplete
        assert torch.equal(rows.tokens[done], expected.tokens[done]), (trial, sizes)
        torch.testing.assert_close(rows.lse[done], expected.lse[done], rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(rows.logprobs[done], expected.logprobs[done], rtol=1e-6,
                                   atol=1e-5)
        rows_checked += int(done.sum())
        rows_left += int(rows.incomplete.sum())

        hidden_rows = torch.randint(-40, 41, (8 * (DRAFTS + 1), vocab)).float() / 4
        own = reference.sample_logits(
            hidden_rows, params.repeat_interleave(DRAFTS + 1),
            (positions[:, None] + torch.arange(DRAFTS + 1)).flatten()).tokens
        drafts = torch.where(torch.rand(8, DRAFTS) < 0.6, own.view(8, -1)[:, :DRAFTS],
                             torch.randint(0, vocab, (8, DRAFTS)))
        for acceptance in ("strict", "probabilistic"):
            rows, out = _emulated(hidden_rows, sizes, params, positions, candidates, drafts,
                                  acceptance, gaps=gap_generator)
            expected = reference.verify_logits(hidden_rows, drafts, params, positions,
                                               acceptance=acceptance)
            done = ~rows.incomplete.view(8, -1).any(dim=1)
            _assert_same(VerifyOutput(*(field[done] for field in out)),
                         VerifyOutput(*(field[done] for field in expected)),
                         f"trial {trial}, {sizes}, {candidates} candidates, {acceptance}")
    # Gaps leave more rows to complete.
    assert rows_checked > (150 if gaps else 200) and rows_left > 20, (rows_checked, rows_left)


class _HostReads(TorchDispatchMode):
    """Records the aten ops that read a tensor on the host (`.item()`, `bool()`, `nonzero`)
    or build one from host data (`torch.tensor`, `new_tensor`, `as_tensor` of a number),
    which a CUDA graph's capture forbids."""

    FORBIDDEN = ("aten._local_scalar_dense", "aten.nonzero", "aten.lift_fresh")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.FORBIDDEN):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_what_follows_the_exchange_reads_nothing_from_the_host():
    """On GPUs a step's summaries come from the fused kernels and one collective; what
    follows (the merge with truncated rows, verification's acceptance chain, flagging the
    uncertified rows) must make no host read and no copy from the host, so that the engine
    can capture it: checked here by the aten ops it dispatches."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randint(-40, 41, (BATCH * (DRAFTS + 1), VOCAB), generator=generator) / 4
    params = flashspec.SamplingParams.create(BATCH, **MODES["mixed"], seed=1)
    positions = torch.randint(0, 1000, (BATCH,), generator=generator)
    drafts = torch.randint(0, VOCAB, (BATCH, DRAFTS), generator=generator)
    shards = VocabShards((400, VOCAB - 400), 0)
    for draft_tokens in (None, drafts):
        op = "sample" if draft_tokens is None else "verify"
        rows = logits[:BATCH] if draft_tokens is None else logits
        layout = summary.summary_layout(op, shards, params, 2)
        reads = _HostReads()
        with reads:   # verification's rows, as `parallel.sampling._verified` makes them
            flat = None if draft_tokens is None else parallel.acceptance.flat_drafts(draft_tokens)
            row_params = (params if flat is None
                          else params.repeat_interleave(DRAFTS + 1, validate=False))
            row_positions = positions if flat is None else \
                (positions[:, None] + torch.arange(DRAFTS + 1)).flatten()
        words = torch.stack([
            parallel.shard.summarize(rows[:, offset:offset + size], layout, row_params,
                                     row_positions, offset, VOCAB, flat)
            for offset, size in zip(shards.offsets, shards.sizes)])
        with reads:
            merged = parallel.merge.merge_rows(summary.unpack(words, layout), shards,
                                               row_params, row_positions, flat)
            if draft_tokens is None:
                out = SampleOutput(merged.tokens, merged.logprobs, merged.lse,
                                   torch.zeros_like(merged.tokens, dtype=torch.int32))
                incomplete = merged.incomplete
            else:
                out = parallel.acceptance.accept(merged, draft_tokens, params, positions,
                                                 "probabilistic")
                incomplete = merged.incomplete.view(BATCH, -1).any(dim=1)
            parallel.sampling._flag_incomplete(out, incomplete)
        assert reads.seen == [], (op, reads.seen)
        assert bool(merged.incomplete.any()), "two candidates leave rows uncertified"


def test_a_fused_call_without_check_reads_nothing_from_the_host(tmp_path):
    """The engine's calls (fused summaries, ``check=False, complete=False``) from end to end,
    the kernels through Triton's interpreter, on a group of one gloo rank: no host read and
    no tensor made from host data, for sampling (truncated or not) and verification."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    try:
        generator = torch.Generator().manual_seed(4)
        vocab = 256
        shards = VocabShards.chunked(vocab)
        weight = _grid(generator, vocab, DIM, denominator=16)
        hidden = _grid(generator, BATCH, DRAFTS + 1, DIM, denominator=8)
        positions = torch.arange(BATCH) + 7
        drafts = torch.randint(0, vocab, (BATCH, DRAFTS), generator=generator)
        for mode in ("temperature", "mixed"):     # mixed: greedy, top-k, top-p, min-p rows
            params = flashspec.SamplingParams.create(BATCH, **MODES[mode], seed=2)
            calls = (lambda: parallel.sample(hidden[:, 0], weight, params, positions,
                                             shards=shards, check=False, complete=False,
                                             backend="fused"),
                     lambda: parallel.verify(hidden, weight, drafts, params, positions,
                                             shards=shards, check=False, complete=False,
                                             backend="fused"))
            for call in calls:
                call()                       # Triton's first run of a variant, outside
                with _HostReads() as reads:
                    call()
                assert reads.seen == [], (mode, reads.seen)
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world_size: int, init_file: str, report_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        report = _cases(rank, world_size)
        if rank == 0:
            with open(report_file, "w") as f:
                json.dump(report, f)
    finally:
        dist.destroy_process_group()


def _spawn(world_size: int, tmp_path) -> dict:
    return run_ranks(_worker, world_size, (str(tmp_path / "init"),),
                     str(tmp_path / "report.json"), __name__, SPAWN_TIMEOUT_S)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_return_one_process_results(world_size, tmp_path):
    report = _spawn(world_size, tmp_path)
    # The untruncated sampling step's summary is well under issue 32's 64 bytes per row.
    assert report["bytes_per_row"] == {"argmax": 8, "sample": 16, "verify": 20}
    assert report["chunked/temperature/None"]["rows_completed"] == 0
    # Every way of finishing a truncated row ran: certified at once, after a retry with more
    # candidates, and from the gathered logits.
    for layout in ("chunked", "uneven"):
        top_p = report[f"{layout}/top_p/2"]
        assert top_p["rows_retried"] > top_p["rows_completed"] > 0, top_p


def test_edits_are_checked_as_flashspec_sampling_checks_them(tmp_path):
    """This rank's columns of the edits get `flashspec.sampling`'s checks, with the shard's
    size for the vocabulary (before any collective: a group of one process is enough)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    try:
        _assert_edits_checked()
    finally:
        dist.destroy_process_group()


def _assert_edits_checked():
    shards = VocabShards((300,), 0)
    hidden, weight = torch.zeros(2, 8), torch.zeros(300, 8)
    params = flashspec.SamplingParams.create(2, seed=0)
    positions = torch.zeros(2, dtype=torch.long)
    codes = torch.zeros(2, 300, dtype=torch.uint8)
    penalty = torch.ones(2, dtype=torch.float64)
    bad = {"penalty": (LogitEdits(codes, None), "`edits.codes`"),
           "shard": (LogitEdits(torch.zeros(2, 299, dtype=torch.uint8), penalty), r"\[2, 300\]"),
           "counts": (LogitEdits(codes, penalty, counts=torch.full((2, 300), -1, dtype=torch.int32),
                                 frequency=penalty, presence=penalty), "counts")}
    for name, (edits, match) in bad.items():
        with pytest.raises(ValueError, match=match):
            parallel.sample(hidden, weight, params, positions, shards=shards, edits=edits)
