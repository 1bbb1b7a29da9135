"""Additive logit edits (`flashspec.params.LogitEdits`: ``bias``, ``counts`` with vLLM's
``frequency`` and ``presence`` penalties) in the fused kernels and the torch reference.

The reference is held to transformers' `SequenceBiasLogitsProcessor` and
`RepetitionPenaltyLogitsProcessor` and to vLLM's penalty rule, applied in their order (bias,
repetition penalty, frequency and presence, bans), bit for bit in float64 and, for vLLM's
rule, in float32 as vLLM computes it. The kernels, which apply the edits at the start of stage
1's epilogue, are held to the reference pathwise (same noise; near-ties detected, never a
blanket tolerance) through Triton's interpreter on small shapes, with several tile
configurations. Verification derives each position's counts from the drafts before it: its
emitted tokens and logprobs equal plain steps whose counts hold those drafts, bit for bit.
The Gluon kernel runs only on a Hopper GPU (the `gpu` tests); its CPU twin is the interpreter
tests of the same epilogue code here.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings, strategies as st
from transformers.generation import logits_process as lp

from flashspec import SamplingParams, kernels, reference, sampling
from flashspec.params import BAN, BANNED_LOGIT, PENALIZE, LogitEdits, drafted_counts

from test_fused_edits import (CONFIGS, assert_near_ties, assert_verify_differences_are_near_ties,
                              random_edits)
from test_fused_head import TRITON_TILES, _ws_configs
from test_generate import _quiet_single_threaded  # noqa: F401 - the module's autouse fixture
from test_kernels import DEVICE, SMALL, mixed_params, random_problem
from test_verify_kernel import random_drafts

F64 = dict(dtype=torch.float64, device=DEVICE)


def additive_edits(g, batch, vocab_size, positions=None, codes=True,
                   per_position_bias=False) -> LogitEdits:
    """Random edits of `batch` rows: codes as `random_edits` (one row per position with
    `positions`, or none), a bias of scale 2 (one row per position with
    `per_position_bias`), counts of 1 to 4 on a fifth of the tokens, frequency and presence
    penalties in [-1, 2)."""
    shape = (batch,) if positions is None else (batch, positions)
    edits = random_edits(g, shape, vocab_size, batch) if codes else LogitEdits(None, None)
    bias_shape = (batch, positions, vocab_size) if per_position_bias else (batch, vocab_size)
    counts = torch.randint(1, 5, (batch, vocab_size), generator=g, dtype=torch.int32)
    counts *= torch.rand(batch, vocab_size, generator=g) < 0.2
    return edits._replace(
        bias=(2.0 * torch.randn(bias_shape, generator=g)).to(DEVICE),
        counts=counts.to(DEVICE),
        frequency=(-1.0 + 3.0 * torch.rand(batch, generator=g, dtype=torch.float64)).to(DEVICE),
        presence=(-1.0 + 3.0 * torch.rand(batch, generator=g, dtype=torch.float64)).to(DEVICE))


def edited64(hidden, weight, edits: LogitEdits | None, drafts=None) -> torch.Tensor:
    """float64 logits ``[rows, V]`` on the CPU after the reference's edits (bans -inf), as
    the near-tie checks take them (`test_reference_is_transformers_then_vllm_in_float64`
    holds these to transformers' processors and vLLM's rule)."""
    flat = hidden.reshape(-1, hidden.shape[-1]).double().cpu()
    logits = reference.compute_logits(flat, weight.double().cpu())
    if edits is None:
        return logits
    edited = reference.edit_logits(logits, edits.flat(drafts).to("cpu"))
    return edited.masked_fill(edited == BANNED_LOGIT, float("-inf"))


def transformers_then_vllm64(logits: torch.Tensor, edits: LogitEdits) -> torch.Tensor:
    """float64 `logits` ``[R, V]`` through, row by row: transformers'
    `SequenceBiasLogitsProcessor` (a single-token sequence per biased token),
    `RepetitionPenaltyLogitsProcessor` (the PENALIZE tokens as the context), vLLM's rule
    ``l -= frequency * c; l -= presence * (c > 0)`` (here in float64), then bans (-inf)."""
    out = logits.clone()
    no_ids = torch.zeros(1, 1, dtype=torch.long)
    for r in range(out.shape[0]):
        row = out[r:r + 1].clone()
        if edits.bias is not None:
            sequence_bias = {(t,): float(b) for t, b in enumerate(edits.bias[r].tolist()) if b}
            if sequence_bias:
                row = lp.SequenceBiasLogitsProcessor(sequence_bias)(no_ids, row)
        if edits.codes is not None:
            context = (edits.codes[r] == PENALIZE).nonzero().flatten()[None]
            row = lp.RepetitionPenaltyLogitsProcessor(float(edits.penalty[r]))(context, row)
        if edits.counts is not None:
            counts = edits.counts[r].double()
            row = row - float(edits.frequency[r]) * counts
            row = row - float(edits.presence[r]) * (counts > 0).double()
        if edits.codes is not None:
            row = row.masked_fill(edits.codes[r] == BAN, float("-inf"))
        out[r] = row[0]
    return out


def position_edits(edits: LogitEdits, drafts: torch.Tensor, j: int) -> LogitEdits:
    """Verification's edits of position j as `sample` takes them for a plain step after the
    drafts before j: codes and a per-position bias of position j, the counts with those
    drafts in them."""
    return edits._replace(
        codes=None if edits.codes is None else edits.codes[:, j],
        bias=edits.bias[:, j] if edits.bias is not None and edits.bias.dim() == 3 else edits.bias,
        counts=edits.counts + drafted_counts(drafts, edits.counts.shape[-1])[:, j])


# --------------------------------------------------------------------------------------
# The reference: transformers' processors and vLLM's rule, in their order
# --------------------------------------------------------------------------------------

def test_reference_is_transformers_then_vllm_in_float64():
    """`reference.edit_logits` on float64 logits equals transformers' processors and vLLM's
    rule applied one after the other, bit for bit; for verification too, where position j's
    counts hold the drafts before it (`LogitEdits.flat`)."""
    g = torch.Generator().manual_seed(1)
    batch, vocab_size, positions = 4, 97, 3
    logits = 3.0 * torch.randn(batch * positions, vocab_size, generator=g, dtype=torch.float64)
    edits = additive_edits(g, batch, vocab_size, positions).to("cpu")
    drafts = torch.tensor([[5, 5], [7, -1], [-1, 9], [3, 4]])
    edits.counts[0, 5] = 0                                        # drafted, no count before
    flat = edits.flat(drafts)
    assert flat.counts[0, 5] == 0 and flat.counts[1, 5] == 1 and flat.counts[2, 5] == 2
    assert torch.equal(flat.counts[3:6, 7], edits.counts[1, 7] + torch.tensor([0, 1, 1]))
    assert torch.equal(flat.counts[7], edits.counts[2])           # padding counts nothing
    ours = reference.edit_logits(logits, flat)
    theirs = transformers_then_vllm64(logits, flat)
    assert torch.equal(ours.masked_fill(ours == BANNED_LOGIT, float("-inf")), theirs)
    sample_edits = additive_edits(g, batch, vocab_size).to("cpu")
    ours = reference.edit_logits(logits[:batch], sample_edits)
    theirs = transformers_then_vllm64(logits[:batch], sample_edits)
    assert torch.equal(ours.masked_fill(ours == BANNED_LOGIT, float("-inf")), theirs)


def test_reference_is_vllms_float32_arithmetic():
    """On float32 logits the penalties are vLLM's torch code itself, bit for bit: fp32
    penalties, ``logits -= frequency * counts`` then ``logits -= presence * mask``."""
    g = torch.Generator().manual_seed(2)
    batch, vocab_size = 6, 501
    logits = 5.0 * torch.randn(batch, vocab_size, generator=g)
    counts = torch.randint(0, 40, (batch, vocab_size), generator=g, dtype=torch.int32)
    frequency = torch.randn(batch, generator=g, dtype=torch.float64) * 1.7
    presence = torch.randn(batch, generator=g, dtype=torch.float64) * 1.3
    edits = LogitEdits(None, None, counts=counts, frequency=frequency, presence=presence)
    vllm = logits.clone()
    vllm -= frequency.float().unsqueeze(dim=1) * counts.long()
    vllm -= presence.float().unsqueeze(dim=1) * (counts > 0)
    assert torch.equal(reference.edit_logits(logits, edits), vllm)


# Logits (hidden row b is e_b, so weight[:, b] is row b's logits, exact in fp32) and edits
# whose argmax depends on the order of the edits.
#   row 0: bias before the penalty: (1 - 3) * 2 = -4 < -3 (token 1); the other order gives
#          1 / 2 - 3 = -2.5 (token 0). Token 4 (logit 50, bias 1000) is banned.
#   row 1: frequency and presence after the penalty: 1 / 2 - 1 - 1 = -1.5 > -1.75 (token 2);
#          the other order gives (1 - 1 - 1) * 2 = -2 (token 3).
#   row 2: bans after the counts: token 5's frequency -1e30 would lift it past token 6's 0.
#   row 3: the drafts count: token 2 (1 > 0) once drafted loses to token 3 (1 - 2 < 0).
ORDER_LOGITS = {0: {0: 1.0, 1: -3.0, 4: 50.0}, 1: {2: 1.0, 3: -1.75}, 2: {5: 10.0, 6: 0.0},
                3: {2: 1.0, 3: 0.0}}


def order_problem(vocab_size=64, positions=None):
    weight = torch.full((vocab_size, 16), 0.0)
    weight[:, :4] = -100.0
    for row, logits in ORDER_LOGITS.items():
        for token, logit in logits.items():
            weight[token, row] = logit
    hidden = torch.eye(16)[:4]
    codes = torch.zeros(4, vocab_size, dtype=torch.uint8)
    codes[0, 0] = codes[1, 2] = PENALIZE
    codes[0, 4] = codes[2, 5] = BAN
    bias = torch.zeros(4, vocab_size)
    bias[0, 0], bias[0, 4] = -3.0, 1000.0
    counts = torch.zeros(4, vocab_size, dtype=torch.int32)
    counts[1, 2] = counts[2, 5] = 1
    edits = LogitEdits(codes, torch.tensor([2.0, 2.0, 1.0, 1.0]).double(), bias, counts,
                       frequency=torch.tensor([0.0, 1.0, -1e30, 2.0]).double(),
                       presence=torch.tensor([0.0, 1.0, 0.0, 0.0]).double())
    if positions is not None:
        hidden = hidden[:, None].expand(4, positions, 16).contiguous()
        edits = edits._replace(codes=codes[:, None].expand(4, positions, vocab_size).contiguous())
    return hidden.to(DEVICE), weight.to(DEVICE), edits.to(DEVICE)


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_the_order_of_the_edits_decides(backend):
    """Greedy tokens that only the order bias, repetition penalty, frequency and presence,
    bans gives (`ORDER_LOGITS`); in verification the drafted token 2 of row 3 counts at the
    next position (accepted there, then no longer the argmax)."""
    config = dict(config=SMALL) if backend == "fused" else {}
    hidden, weight, edits = order_problem()
    expected = [1, 2, 6, 2]
    greedy = SamplingParams.create(4, do_sample=False, seed=0, device=DEVICE)
    positions = torch.zeros(4, dtype=torch.long, device=DEVICE)
    assert sampling.argmax(hidden, weight, edits=edits, backend=backend,
                           **config).tokens.tolist() == expected
    assert sampling.sample(hidden, weight, greedy, positions, edits=edits, backend=backend,
                           **config).tokens.tolist() == expected
    hidden, weight, edits = order_problem(positions=2)
    drafts = torch.tensor([[1], [2], [6], [2]], device=DEVICE)
    out = sampling.verify(hidden, weight, drafts, greedy, positions, edits=edits,
                          backend=backend, **config)
    assert out.num_accepted.tolist() == [1, 1, 1, 1]
    # Row 1: its count of token 2 becomes 2, 1/2 - 2 - 1 = -2.5 < -1.75.
    assert out.tokens.tolist() == [[1, 1], [2, 3], [6, 6], [2, 3]]


# --------------------------------------------------------------------------------------
# The fused kernels against the reference (Triton's interpreter on CPU)
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("config,codes", [("small", True), ("screen+race", False),
                                          ("parts", True)])
def test_sample_with_additive_edits_equals_the_reference(config, codes):
    """Every truncation mode and greedy rows, 300 tokens (the last tile partly past V): the
    reference's tokens up to near-ties of the float64 edited logits, its logprobs and
    log-sum-exp; and the additive edits matter (without them, another log-sum-exp)."""
    g = torch.Generator().manual_seed(3 + codes)
    batch, vocab_size = 6, 300
    hidden, weight, positions = random_problem(g, batch, vocab_size, 32)
    params = mixed_params(g, batch, seed=7)
    edits = additive_edits(g, batch, vocab_size, codes=codes)
    ours = sampling.sample(hidden, weight, params, positions, edits=edits, backend="fused",
                           config=CONFIGS[config])
    theirs = sampling.sample(hidden, weight, params, positions, edits=edits,
                             backend="reference")
    assert_near_ties(ours.tokens, theirs.tokens, edited64(hidden, weight, edits), params,
                     positions, config)
    same = ours.tokens == theirs.tokens
    assert torch.allclose(ours.logprobs[same], theirs.logprobs[same], atol=2e-4, rtol=1e-4)
    assert torch.allclose(ours.lse, theirs.lse, atol=2e-4, rtol=1e-5)
    if codes:
        assert not (edits.codes == BAN).gather(1, ours.tokens[:, None]).any()
    plain = edits._replace(bias=None, counts=None, frequency=None, presence=None)
    if plain.codes is None:
        plain = None
    without = sampling.sample(hidden, weight, params, positions, edits=plain, backend="fused",
                              config=CONFIGS[config])
    assert not torch.allclose(without.lse, ours.lse, atol=1e-2)


def test_argmax_with_additive_edits():
    """Greedy rows take the argmax of the edited logits: every row's unedited argmax
    counted often, under a positive frequency penalty, loses it."""
    g = torch.Generator().manual_seed(4)
    batch, vocab_size = 9, 333
    hidden, weight, _ = random_problem(g, batch, vocab_size, 32)
    plain = sampling.argmax(hidden, weight, backend="reference").tokens
    edits = additive_edits(g, batch, vocab_size)
    edits.counts[torch.arange(batch), plain] = 100
    edits.frequency.copy_(torch.linspace(0.5, 2.0, batch, dtype=torch.float64))
    ours = sampling.argmax(hidden, weight, edits=edits, backend="fused", config=SMALL).tokens
    theirs = sampling.argmax(hidden, weight, edits=edits, backend="reference").tokens
    greedy = SamplingParams.create(batch, do_sample=False, seed=0, device=DEVICE)
    assert_near_ties(ours, theirs, edited64(hidden, weight, edits), greedy,
                     torch.zeros(batch, dtype=torch.long), "argmax")
    assert not (ours == plain).any()


def correlated_positions(g, batch, num_positions, dim):
    """Hidden states ``[B, G+1, D]`` that differ little between a row's positions: a token
    drafted at one position is a contender at the next ones, where its count (or a count
    left out) moves the draw."""
    base = 3.0 * torch.randn(batch, 1, dim, generator=g)
    return (base + 0.3 * torch.randn(batch, num_positions, dim, generator=g)).to(DEVICE)


def plain_steps(hidden, weight, params, positions, edits, drafts=None, **kwargs):
    """Tokens ``[B, G+1]`` and logprobs of plain `sample` steps at each position of
    verification's `hidden` ``[B, G+1, D]``: position j's counts hold `drafts[:, :j]`, or
    with no `drafts`, the tokens sampled before it (so that they, as drafts, are all
    accepted)."""
    batch, num_positions, _ = hidden.shape
    tokens = torch.zeros(batch, 0, dtype=torch.long, device=hidden.device)
    logprobs = []
    for j in range(num_positions):
        context = tokens if drafts is None else drafts
        out = sampling.sample(hidden[:, j], weight, params, positions + j,
                              edits=position_edits(edits, context[:, :num_positions - 1], j),
                              **kwargs)
        tokens = torch.cat([tokens, out.tokens[:, None]], dim=1)
        logprobs.append(out.logprobs)
    return tokens, torch.stack(logprobs, dim=1)


@pytest.mark.parametrize("acceptance,config,per_position_bias",
                         [("strict", "small", False), ("probabilistic", "screen+race", True)])
def test_verify_with_additive_edits_equals_the_reference(acceptance, config, per_position_bias):
    """Verification with a bias (per batch row, or per position) and counts: the reference's
    verification up to near-ties, with the plain samples as drafts (all accepted: each
    position's counts hold the drafts before it) and with wrong and padded drafts; under
    the strict rule the emitted tokens are the plain steps' with the drafts counted."""
    g = torch.Generator().manual_seed(17 + per_position_bias)
    batch, num_drafts, vocab_size, dim = 5, 3, 200, 24
    hidden = correlated_positions(g, batch, num_drafts + 1, dim)
    _, weight, _ = random_problem(g, 1, vocab_size, dim)
    positions = torch.randint(0, 1000, (batch,), generator=g).to(DEVICE)
    params = mixed_params(g, batch, seed=4)
    edits = additive_edits(g, batch, vocab_size, num_drafts + 1,
                           per_position_bias=per_position_bias)
    plain, _ = plain_steps(hidden, weight, params, positions, edits, backend="reference")
    for right, drafts in ((True, plain[:, :-1]),
                          (False, random_drafts(g, plain.cpu(), vocab_size).to(DEVICE))):
        ours = sampling.verify(hidden, weight, drafts, params, positions, edits=edits,
                               acceptance=acceptance, backend="fused", config=CONFIGS[config])
        theirs = sampling.verify(hidden, weight, drafts, params, positions, edits=edits,
                                 acceptance=acceptance, backend="reference")
        logits64 = edited64(hidden, weight, edits, drafts).view(batch, num_drafts + 1, -1)
        differing = assert_verify_differences_are_near_ties(ours, theirs, logits64, params,
                                                            positions, vocab_size)
        same = ~differing.to(DEVICE)
        assert torch.allclose(ours.accept_probs[same], theirs.accept_probs[same].float(),
                              atol=2e-5)
        if acceptance == "strict":
            emitted = (ours.tokens >= 0) & same[:, None]
            assert torch.equal(ours.tokens[emitted], plain[emitted])
            if right:
                assert (ours.num_accepted[same] == num_drafts).all()


@pytest.mark.parametrize("config", ["small", "screen+race"])
def test_speculation_invariance_bit_for_bit(config, index_order_dot):
    """The same fused kernels, plain and verifying: a plain step whose counts hold the
    drafts before it computes the fp32 logits that the verified position derives from the
    drafts, so the emitted tokens and their logprobs are equal bit for bit (no near-tie
    allowed), with every draft right and with wrong and padded drafts. (The interpreter's
    dot adds in index order here, as a GPU's MMA adds each row's products whatever the
    rows around it.)"""
    g = torch.Generator().manual_seed(23)
    batch, num_drafts, vocab_size, dim = 4, 2, 160, 16
    hidden = correlated_positions(g, batch, num_drafts + 1, dim)
    _, weight, _ = random_problem(g, 1, vocab_size, dim)
    positions = torch.randint(0, 1000, (batch,), generator=g).to(DEVICE)
    params = SamplingParams.create(batch, do_sample=[True, True, True, False],
                                   temperature=[1.0, 0.7, 1.3, 1.0], top_k=[0, 0, 3, 0],
                                   seed=5, device=DEVICE)
    edits = additive_edits(g, batch, vocab_size, num_drafts + 1)
    edits.frequency.fill_(1.5)    # a drafted token's count moves its logit far
    fused = dict(backend="fused", config=CONFIGS[config])
    plain, logprobs = plain_steps(hidden, weight, params, positions, edits, **fused)
    accepted = sampling.verify(hidden, weight, plain[:, :-1], params, positions, edits=edits,
                               **fused)
    assert (accepted.num_accepted == num_drafts).all()
    assert torch.equal(accepted.tokens, plain)
    assert torch.equal(accepted.logprobs, logprobs)
    assert_drafts_count(g, hidden, weight, params, positions, edits, plain, **fused)


def assert_drafts_count(g, hidden, weight, params, positions, edits, plain, **kwargs):
    """With right, wrong and padded drafts (`random_drafts` of the `plain` tokens), the
    emitted tokens and logprobs of `verify` are those of plain steps whose counts hold the
    drafts before them, bit for bit. Returns the drafts and the verification."""
    drafts = random_drafts(g, plain.cpu(), weight.shape[0]).to(DEVICE)
    tokens, logprobs = plain_steps(hidden, weight, params, positions, edits, drafts, **kwargs)
    out = sampling.verify(hidden, weight, drafts, params, positions, edits=edits, **kwargs)
    emitted = out.tokens >= 0
    assert torch.equal(out.tokens[emitted], tokens[emitted])
    assert torch.equal(out.logprobs[emitted], logprobs[emitted])
    return drafts, out


def test_neutral_additive_edits_change_nothing():
    """A bias of zeros, and counts of 0 whatever the penalties: the tokens, logprobs and
    log-sum-exp of the call without them, bit for bit (the edits' flags on, their values
    neutral)."""
    g = torch.Generator().manual_seed(9)
    batch, vocab_size = 6, 257
    hidden, weight, positions = random_problem(g, batch, vocab_size, 24)
    params = mixed_params(g, batch, seed=2)
    plain = sampling.sample(hidden, weight, params, positions, backend="fused", config=SMALL)
    neutral = LogitEdits(None, None, bias=torch.zeros(batch, vocab_size, device=DEVICE),
                         counts=torch.zeros(batch, vocab_size, dtype=torch.int32, device=DEVICE),
                         frequency=torch.linspace(-2, 2, batch, **F64),
                         presence=torch.linspace(2, -2, batch, **F64))
    out = sampling.sample(hidden, weight, params, positions, edits=neutral, backend="fused",
                          config=SMALL)
    for mine, theirs in zip(out, plain):
        assert torch.equal(mine, theirs)


@seed(0)
@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 4), vocab_size=st.integers(40, 260),
       bias_scale=st.sampled_from([None, 0.5, 4.0, 30.0]),
       penalty_scale=st.sampled_from([None, 0.3, 2.0, 20.0]), setting=st.integers(0, 1_000_000))
def test_property_fused_equals_reference(batch, vocab_size, bias_scale, penalty_scale, setting):
    """Any vocabulary, bias size and penalty size (from a nudge to ones that reorder the
    whole row), with or without each: fused = reference, up to near-ties."""
    g = torch.Generator().manual_seed(setting)
    hidden, weight, positions = random_problem(g, batch, vocab_size, 16)
    params = mixed_params(g, batch, seed=setting)
    edits = additive_edits(g, batch, vocab_size, codes=setting % 2 == 0)
    edits = edits._replace(bias=None if bias_scale is None else edits.bias * bias_scale)
    if penalty_scale is None:
        edits = edits._replace(counts=None, frequency=None, presence=None)
    else:
        edits = edits._replace(frequency=edits.frequency * penalty_scale,
                               presence=edits.presence * penalty_scale)
    if all(field is None for field in edits):
        edits = None
    ours = sampling.sample(hidden, weight, params, positions, edits=edits, backend="fused",
                           config=SMALL)
    theirs = sampling.sample(hidden, weight, params, positions, edits=edits, backend="reference")
    assert_near_ties(ours.tokens, theirs.tokens, edited64(hidden, weight, edits), params,
                     positions)


# --------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------

def _valid(batch=2, vocab_size=10, positions=None) -> LogitEdits:
    shape = (batch,) if positions is None else (batch, positions)
    return LogitEdits(torch.zeros(*shape, vocab_size, dtype=torch.uint8, device=DEVICE),
                      torch.ones(batch, **F64),
                      bias=torch.zeros(batch, vocab_size, device=DEVICE),
                      counts=torch.zeros(batch, vocab_size, dtype=torch.int32, device=DEVICE),
                      frequency=torch.zeros(batch, **F64), presence=torch.zeros(batch, **F64))


def _with(name, value=None, at=None):
    """`_valid()` with field `name` replaced by `value`, or with `value` written at `at`."""
    edits = _valid()
    if at is None:
        return edits._replace(**{name: value})
    getattr(edits, name)[at] = value
    return edits


@pytest.mark.parametrize("edits, match", [
    (_with("bias", torch.zeros(2, 10, dtype=torch.float64)),
     r"`edits.bias` must be a float32 tensor of shape \[2, 10\], got"),
    (_with("bias", torch.zeros(2, 9)), r"`edits.bias` must be a float32 tensor of shape \[2, 10\]"),
    (_with("bias", torch.zeros(2, 1, 10)), r"`edits.bias` must be a float32 tensor"),
    (_with("counts", torch.zeros(2, 10, dtype=torch.int64)),
     r"`edits.counts` must be an int32 tensor of shape \[2, 10\]"),
    (_with("frequency", torch.zeros(2)),
     r"`edits.frequency` must be a float64 tensor of shape \[2\]"),
    (_with("presence", torch.zeros(3, dtype=torch.float64)), r"`edits.presence` must be a float64"),
    (_with("counts", None), r"`edits.frequency` is given without `edits.counts`"),
    (_with("frequency", None), r"`edits.counts` is given without `edits.frequency`"),
    (_with("presence", None), r"`edits.counts` is given without `edits.presence`"),
    (_with("penalty", None), r"`edits.codes` is given without `edits.penalty`"),
    (_with("counts", -1, (1, 3)),
     r"`edits.counts`=-1 \(at \[1, 3\]\) is not allowed: must be >= 0"),
    (_with("bias", float("nan"), (0, 2)),
     r"`edits.bias`=nan \(at \[0, 2\]\) is not allowed: must be finite"),
    (_with("bias", float("-inf"), (1, 0)), r"`edits.bias`=-inf \(at \[1, 0\]\)"),
    (_with("frequency", 1e39, 1),
     r"`edits.frequency`=1e\+39 \(at \[1\]\) is not allowed: must be finite in float32"),
    (_with("presence", float("nan"), 0), r"`edits.presence`=nan \(at \[0\]\)"),
    (_with("penalty", 0.0, 0),
     r"`edits.penalty`=0.0 \(at \[0\]\) is not allowed: must be finite and > 0"),
])
def test_edits_are_checked(edits, match):
    hidden, weight = torch.zeros(2, 8, device=DEVICE), torch.zeros(10, 8, device=DEVICE)
    params = SamplingParams.create(2, seed=0, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.long, device=DEVICE)
    edits = edits.to(DEVICE)
    for backend in ("reference", "fused"):
        with pytest.raises(ValueError, match=match):
            sampling.sample(hidden, weight, params, positions, edits=edits, backend=backend)
        with pytest.raises(ValueError, match=match):
            sampling.argmax(hidden, weight, edits=edits, backend=backend)


def test_verification_edits_are_checked():
    """A verification's bias is per batch row or per position; values are checked only with
    ``check`` (a device read)."""
    hidden, weight = torch.zeros(2, 4, 8, device=DEVICE), torch.zeros(10, 8, device=DEVICE)
    params = SamplingParams.create(2, seed=0, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.long, device=DEVICE)
    drafts = torch.zeros(2, 3, dtype=torch.long, device=DEVICE)
    edits = _valid(positions=4)
    for bias in (torch.zeros(2, 10), torch.zeros(2, 4, 10)):
        sampling.verify(hidden, weight, drafts, params, positions, backend="reference",
                        edits=edits._replace(bias=bias.to(DEVICE)))
    with pytest.raises(ValueError, match=r"of shape \[2, 10\] or \[2, 4, 10\], got"):
        sampling.verify(hidden, weight, drafts, params, positions, backend="reference",
                        edits=edits._replace(bias=torch.zeros(2, 3, 10, device=DEVICE)))
    edits.counts[0, 0] = -1
    with pytest.raises(ValueError, match="must be >= 0"):
        sampling.verify(hidden, weight, drafts, params, positions, backend="reference",
                        edits=edits)
    sampling.verify(hidden, weight, drafts, params, positions, backend="reference",
                    edits=edits, check=False)


def test_select_and_flat_keep_every_field():
    g = torch.Generator().manual_seed(5)
    edits = additive_edits(g, 3, 20, positions=3)
    rows = torch.tensor([2, 0], device=DEVICE)
    picked = edits.select(rows)
    for mine, theirs in zip(picked, edits):
        assert torch.equal(mine, theirs[rows])
    drafts = torch.tensor([[4, 4], [-1, 4], [1, 2]], device=DEVICE)
    flat = edits.flat(drafts)
    assert flat.codes.shape == flat.bias.shape == flat.counts.shape == (9, 20)
    assert torch.equal(flat.bias[3:6], edits.bias[1].expand(3, 20))
    assert torch.equal(flat.frequency, edits.frequency.repeat_interleave(3))
    assert torch.equal(flat.counts[:3, 4] - edits.counts[0, 4],
                       torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE))
    assert torch.equal(flat.counts[3:6, 4] - edits.counts[1, 4],
                       torch.tensor([0, 0, 1], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="needs the drafts"):
        edits.flat()
    assert LogitEdits(edits.codes, edits.penalty).flat().codes.shape == (9, 20)


# --------------------------------------------------------------------------------------
# GPU: bf16, compiled, the warp-specialized kernel on Hopper
# --------------------------------------------------------------------------------------

def reference64(op, hidden, weight, *args, **kwargs):
    return op(hidden.double(), weight.double(), *args, backend="reference", **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, vocab_size, dim", [(16, 32_003, 520), (256, 151_936, 4096)])
@pytest.mark.parametrize("truncation", [False, True])
def test_gpu_bf16_sample_with_additive_edits(rows, vocab_size, dim, truncation):
    """Compiled, bf16, the default tiles (the Gluon kernel above 64 rows on Hopper): the
    float64 reference's tokens up to near-ties; each warp-specialized configuration gives
    the Triton kernel's tokens with the same edits."""
    g = torch.Generator().manual_seed(rows)
    hidden, weight, positions = random_problem(g, rows, vocab_size, dim, torch.bfloat16)
    params = mixed_params(g, rows, seed=rows) if truncation else SamplingParams.create(
        rows, do_sample=(torch.arange(rows) % 4 != 0).tolist(), temperature=0.7, seed=rows,
        device=DEVICE)
    edits = additive_edits(g, rows, vocab_size)
    ours = sampling.sample(hidden, weight, params, positions, edits=edits, backend="fused")
    theirs = reference64(sampling.sample, hidden, weight, params, positions, edits=edits)
    logits64 = edited64(hidden, weight, edits)
    assert_near_ties(ours.tokens, theirs.tokens, logits64, params, positions, f"R={rows}")
    greedy = sampling.argmax(hidden, weight, edits=edits, backend="fused").tokens
    assert_near_ties(greedy, reference64(sampling.argmax, hidden, weight, edits=edits).tokens,
                     logits64, SamplingParams.create(rows, do_sample=False, seed=0, device=DEVICE),
                     torch.zeros_like(positions), "argmax")
    triton_out = kernels.fused_sample(hidden, weight, params, positions, edits=edits,
                                      config=TRITON_TILES)
    for config in _ws_configs(truncation):
        ws = kernels.fused_sample(hidden, weight, params, positions, edits=edits, config=config)
        assert torch.equal(ws.status, triton_out.status)
        assert torch.equal(ws.tokens, triton_out.tokens)
        assert torch.allclose(ws.lse, triton_out.lse, rtol=1e-6, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, vocab_size, dim", [(16, 151_936, 4096), (64, 32_003, 520)])
@pytest.mark.parametrize("per_position_bias", [False, True])
def test_gpu_bf16_verify_with_additive_edits(batch, vocab_size, dim, per_position_bias):
    """Compiled bf16 verification with the edits, counts derived from the drafts: with one
    tile configuration for both, the emitted tokens and logprobs of plain steps whose counts
    hold the drafts, bit for bit; the float64 reference's verification up to near-ties; the
    Gluon kernel's equals the Triton kernel's."""
    num_drafts = 3
    g = torch.Generator().manual_seed(batch)
    flat, weight, _ = random_problem(g, batch * (num_drafts + 1), vocab_size, dim, torch.bfloat16)
    hidden = flat.view(batch, num_drafts + 1, dim)
    # Truncated rows within the candidate budget: no row completed by the reference.
    params = SamplingParams.create(batch, do_sample=(torch.arange(batch) % 4 != 0).tolist(),
                                   temperature=0.7, top_k=[0, 3] * (batch // 2), seed=1,
                                   device=DEVICE)
    positions = torch.arange(batch, device=DEVICE) * 7
    edits = additive_edits(g, batch, vocab_size, num_drafts + 1,
                           per_position_bias=per_position_bias)
    tiles = dict(backend="fused", config=TRITON_TILES)
    plain, _ = plain_steps(hidden, weight, params, positions, edits, **tiles)
    drafts, ours = assert_drafts_count(g, hidden, weight, params, positions, edits, plain,
                                       **tiles)
    theirs = reference64(sampling.verify, hidden, weight, drafts, params, positions, edits=edits)
    logits64 = edited64(hidden, weight, edits, drafts).view(batch, num_drafts + 1, vocab_size)
    assert_verify_differences_are_near_ties(ours, theirs, logits64, params, positions,
                                            vocab_size)
    triton_out = kernels.fused_verify(hidden, weight, drafts, params, positions, edits=edits,
                                      config=TRITON_TILES)
    for config in _ws_configs(truncation=params.any_truncation):
        ws = kernels.fused_verify(hidden, weight, drafts, params, positions, edits=edits,
                                  config=config)
        for name in ("num_accepted", "tokens", "status"):
            assert torch.equal(getattr(ws, name), getattr(triton_out, name)), name
