"""Logit edits (`flashspec.params.LogitEdits`) inside the fused kernels, against the torch
reference with the same codes, and against transformers' own processors in float64.

The codes are applied to the fp32 logits at the start of stage 1's epilogue, so every
summary (Gumbel race, screen, log-sum-exp, candidates, the draft left out) sees the edited
logits: each test runs several tile configurations. On a CPU machine the kernels run
through Triton's interpreter on small shapes.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings, strategies as st
from transformers.generation import logits_process as lp

from flashspec import SamplingParams, kernels, reference, rng, sampling
from flashspec.bench.statistics import is_near_tie
from flashspec.params import BAN, KEEP, PENALIZE, LogitEdits

from test_kernels import DEVICE, OTHER, SMALL, mixed_params, random_problem
from test_reference import TRUNCATION_CASES
from test_verify_kernel import random_drafts

# Screen and race change how a tile's best is found (not what it is): with bans, wholly
# banned parts and banned drafts go through each of them.
SCREENED = kernels.TileConfig(block_v=32, block_r=16, block_d=16, candidates=4, max_support=32,
                              screen=True, race=True)
CONFIGS = {"small": SMALL, "parts": OTHER, "screen+race": SCREENED}


def random_edits(g, rows_shape, vocab_size, batch, ban=0.1, penalize=0.2) -> LogitEdits:
    """Codes ``[*rows_shape, V]``: about `ban` of the tokens banned, `penalize` penalized,
    one whole 32-token tile banned in every row (a tile with no token left), penalties in
    [0.5, 3) per batch row."""
    u = torch.rand(*rows_shape, vocab_size, generator=g)
    codes = torch.full(u.shape, KEEP, dtype=torch.uint8)
    codes[u < penalize + ban] = PENALIZE
    codes[u < ban] = BAN
    codes[..., 32:64] = BAN
    penalty = 0.5 + 2.5 * torch.rand(batch, generator=g, dtype=torch.float64)
    return LogitEdits(codes.to(DEVICE), penalty.to(DEVICE))


def edited_logits64(hidden, weight, edits: LogitEdits) -> torch.Tensor:
    """float64 logits after transformers' own repetition penalty and bans (-inf)."""
    flat = hidden.reshape(-1, hidden.shape[-1]).double().cpu()
    logits = reference.compute_logits(flat, weight.double().cpu())
    flat_edits = edits.flat().to("cpu")
    codes, penalty = flat_edits.codes, flat_edits.penalty
    penalized = lp.RepetitionPenaltyLogitsProcessor(1.0)
    out = logits.clone()
    for row in range(out.shape[0]):
        penalized.penalty = float(penalty[row])
        ids = (codes[row] == PENALIZE).nonzero().flatten()[None]
        out[row] = penalized(ids, logits[row:row + 1].clone())[0]
    return out.masked_fill(codes == BAN, float("-inf"))


def assert_near_ties(ours, theirs, logits64, params, positions, what=""):
    """Token for token equal, but for float64 near-ties of the edited logits (at most 1 in
    20 rows)."""
    vocab = torch.arange(logits64.shape[-1])
    mismatches = (ours.cpu() != theirs.cpu()).nonzero().flatten().tolist()
    for row in mismatches:
        noise = rng.gumbel(params.seed[row].cpu(), positions[row].cpu(), vocab)
        assert is_near_tie(logits64[row], bool(params.do_sample[row]),
                           float(params.temperature[row]), int(params.top_k[row]),
                           float(params.top_p[row]), float(params.min_p[row]), noise,
                           int(ours[row]), int(theirs[row])), f"{what} row {row}"
    assert len(mismatches) <= max(1, len(ours) // 20), f"{what}: {len(mismatches)} near-ties"


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("batch,vocab_size,dim", [(5, 300, 40), (17, 257, 48), (3, 2000, 16)])
def test_sample_with_edits_equals_the_reference(batch, vocab_size, dim, config):
    g = torch.Generator().manual_seed(batch * 7 + vocab_size)
    hidden, weight, positions = random_problem(g, batch, vocab_size, dim)
    params = mixed_params(g, batch, seed=batch)
    edits = random_edits(g, (batch,), vocab_size, batch)
    ours = sampling.sample(hidden, weight, params, positions, edits=edits, backend="fused",
                           config=CONFIGS[config])
    theirs = sampling.sample(hidden, weight, params, positions, edits=edits, backend="reference")
    assert_near_ties(ours.tokens, theirs.tokens, edited_logits64(hidden, weight, edits), params,
                     positions, config)
    banned = (edits.codes == BAN).gather(1, ours.tokens[:, None]).flatten()
    assert not banned.any()
    same = ours.tokens == theirs.tokens
    assert torch.allclose(ours.logprobs[same], theirs.logprobs[same], atol=2e-4, rtol=1e-4)
    assert torch.allclose(ours.lse, theirs.lse, atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("case", list(TRUNCATION_CASES))
def test_each_truncation_mode_with_edits(case):
    g = torch.Generator().manual_seed(5)
    batch, vocab_size = 6, 200
    hidden, weight, positions = random_problem(g, batch, vocab_size, 32)
    params = SamplingParams.create(batch, seed=3, device=DEVICE, **TRUNCATION_CASES[case])
    edits = random_edits(g, (batch,), vocab_size, batch)
    ours = sampling.sample(hidden, weight, params, positions, edits=edits, backend="fused",
                           config=SMALL).tokens
    theirs = sampling.sample(hidden, weight, params, positions, edits=edits,
                             backend="reference").tokens
    assert_near_ties(ours, theirs, edited_logits64(hidden, weight, edits), params, positions, case)


def test_argmax_with_edits():
    g = torch.Generator().manual_seed(2)
    batch, vocab_size = 9, 333
    hidden, weight, _ = random_problem(g, batch, vocab_size, 32)
    plain = sampling.argmax(hidden, weight, backend="reference").tokens
    edits = random_edits(g, (batch,), vocab_size, batch)
    edits.codes[torch.arange(batch), plain] = BAN          # every row's argmax banned
    ours = sampling.argmax(hidden, weight, edits=edits, backend="fused", config=SMALL).tokens
    theirs = sampling.argmax(hidden, weight, edits=edits, backend="reference").tokens
    greedy = SamplingParams.create(batch, do_sample=False, seed=0, device=DEVICE)
    assert_near_ties(ours, theirs, edited_logits64(hidden, weight, edits), greedy,
                     torch.zeros(batch, dtype=torch.long), "argmax")
    assert not (ours == plain).any()


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("acceptance", ["strict", "probabilistic"])
def test_verify_with_edits_equals_the_reference(acceptance, config):
    g = torch.Generator().manual_seed(17)
    batch, num_drafts, vocab_size, dim = 5, 3, 300, 40
    flat, weight, _ = random_problem(g, batch * (num_drafts + 1), vocab_size, dim)
    hidden = flat.view(batch, num_drafts + 1, dim)
    positions = torch.randint(0, 1000, (batch,), generator=g).to(DEVICE)
    params = mixed_params(g, batch, seed=4)
    edits = random_edits(g, (batch, num_drafts + 1), vocab_size, batch)
    plain = torch.stack([sampling.sample(hidden[:, j], weight, params, positions + j,
                                         edits=LogitEdits(edits.codes[:, j], edits.penalty),
                                         backend="reference").tokens
                         for j in range(num_drafts + 1)], dim=1)
    for drafts in (plain[:, :-1], random_drafts(g, plain.cpu(), vocab_size).to(DEVICE)):
        ours = sampling.verify(hidden, weight, drafts, params, positions, edits=edits,
                               acceptance=acceptance, backend="fused", config=CONFIGS[config])
        theirs = sampling.verify(hidden, weight, drafts, params, positions, edits=edits,
                                 acceptance=acceptance, backend="reference")
        logits64 = edited_logits64(hidden, weight, edits).view(batch, num_drafts + 1, -1)
        differing = assert_verify_differences_are_near_ties(ours, theirs, logits64, params,
                                                            positions, vocab_size)
        same = ~differing.to(DEVICE)
        assert torch.allclose(ours.accept_probs[same], theirs.accept_probs[same].float(), atol=2e-5)
        if acceptance == "strict":   # emitted tokens are the plain samples, whatever the drafts
            emitted = ours.tokens >= 0
            assert torch.equal(ours.tokens[emitted & same[:, None]], plain[emitted & same[:, None]])


def assert_verify_differences_are_near_ties(ours, theirs, logits64, params, positions,
                                            vocab_size, dtype=torch.float32) -> torch.Tensor:
    """Rows where two verifications differ (bool ``[B]``, on the CPU): at most one, and its
    first differing position a near-tie of the float64 logits ``[B, G+1, V]`` with the row's
    noise (in `dtype`)."""
    differing = ((ours.tokens != theirs.tokens).any(dim=1)
                 | (ours.num_accepted != theirs.num_accepted)).cpu()
    for b in differing.nonzero().flatten().tolist():
        j = int((ours.tokens[b] != theirs.tokens[b]).nonzero()[0])
        noise = rng.gumbel(params.seed[b].cpu(), positions[b].cpu() + j,
                           torch.arange(vocab_size), dtype=dtype)
        assert is_near_tie(logits64[b, j], bool(params.do_sample[b]),
                           float(params.temperature[b]), int(params.top_k[b]),
                           float(params.top_p[b]), float(params.min_p[b]), noise,
                           int(ours.tokens[b, j]), int(theirs.tokens[b, j])), (b, j)
    assert int(differing.sum()) <= 1
    return differing


def test_ignored_codes_fail():
    """The codes decide: banning each row's unedited token changes it, and penalizing every
    token with a large penalty flattens the rows (the log-sum-exp moves)."""
    g = torch.Generator().manual_seed(8)
    batch, vocab_size = 8, 300
    hidden, weight, positions = random_problem(g, batch, vocab_size, 32)
    params = mixed_params(g, batch, seed=1)
    plain = sampling.sample(hidden, weight, params, positions, backend="fused", config=SMALL)
    codes = torch.zeros(batch, vocab_size, dtype=torch.uint8, device=DEVICE)
    codes[torch.arange(batch), plain.tokens] = BAN
    penalty = torch.ones(batch, dtype=torch.float64, device=DEVICE)
    banned = sampling.sample(hidden, weight, params, positions, edits=LogitEdits(codes, penalty),
                             backend="fused", config=SMALL)
    assert not (banned.tokens == plain.tokens).any()
    flattened = sampling.sample(hidden, weight, params, positions, backend="fused", config=SMALL,
                                edits=LogitEdits(torch.full_like(codes, PENALIZE), penalty * 8))
    assert not torch.allclose(flattened.lse, plain.lse, atol=1e-2)


def test_penalty_one_and_keep_codes_change_nothing():
    """Codes KEEP everywhere, or PENALIZE with penalty 1: the tokens, logprobs and
    log-sum-exp of the call without edits, bit for bit."""
    g = torch.Generator().manual_seed(9)
    batch, vocab_size = 6, 257
    hidden, weight, positions = random_problem(g, batch, vocab_size, 24)
    params = mixed_params(g, batch, seed=2)
    plain = sampling.sample(hidden, weight, params, positions, backend="fused", config=SMALL)
    ones = torch.ones(batch, dtype=torch.float64, device=DEVICE)
    for code in (KEEP, PENALIZE):
        codes = torch.full((batch, vocab_size), code, dtype=torch.uint8, device=DEVICE)
        out = sampling.sample(hidden, weight, params, positions, edits=LogitEdits(codes, ones),
                              backend="fused", config=SMALL)
        for mine, theirs in zip(out, plain):
            assert torch.equal(mine, theirs)


def test_edits_are_checked():
    hidden, weight = torch.zeros(2, 8, device=DEVICE), torch.zeros(10, 8, device=DEVICE)
    params = SamplingParams.create(2, seed=0, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.long, device=DEVICE)
    penalty = torch.ones(2, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match=r"uint8 tensor of shape \[2, 10\]"):
        sampling.sample(hidden, weight, params, positions, backend="reference",
                        edits=LogitEdits(torch.zeros(2, 9, dtype=torch.uint8, device=DEVICE),
                                         penalty))
    with pytest.raises(ValueError, match="float64 tensor of shape"):
        sampling.sample(hidden, weight, params, positions, backend="reference",
                        edits=LogitEdits(torch.zeros(2, 10, dtype=torch.uint8, device=DEVICE),
                                         penalty.float()))


@seed(0)
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 6), vocab_size=st.integers(40, 260), ban=st.floats(0.0, 0.9),
       penalize=st.floats(0.0, 1.0), setting=st.integers(0, 1_000_000))
def test_property_fused_equals_reference(batch, vocab_size, ban, penalize, setting):
    """Any density of bans and penalties, any vocabulary (including rows with a handful of
    tokens left, below a top-k): fused = reference, up to near-ties."""
    g = torch.Generator().manual_seed(setting)
    hidden, weight, positions = random_problem(g, batch, vocab_size, 16)
    params = mixed_params(g, batch, seed=setting)
    u = torch.rand(batch, vocab_size, generator=g)
    codes = torch.where(u < ban, BAN, torch.where(u < ban + penalize, PENALIZE, KEEP))
    codes[:, int(torch.randint(vocab_size, (1,), generator=g))] = KEEP   # a token left per row
    edits = LogitEdits(codes.to(torch.uint8).to(DEVICE),
                       (0.3 + 3 * torch.rand(batch, generator=g, dtype=torch.float64)).to(DEVICE))
    ours = sampling.sample(hidden, weight, params, positions, edits=edits, backend="fused",
                           config=SMALL)
    theirs = sampling.sample(hidden, weight, params, positions, edits=edits, backend="reference")
    assert_near_ties(ours.tokens, theirs.tokens, edited_logits64(hidden, weight, edits), params,
                     positions)
    assert not (edits.codes == BAN).gather(1, ours.tokens[:, None]).any()


def test_edit_cost_benchmark_runs(tmp_path):
    """The GPU bar's benchmark (`flashspec.bench.edit_cost`) at a tiny shape: every timing
    and ratio present."""
    import json

    from flashspec.bench import edit_cost

    assert edit_cost.main(["--quick", "--vocab", "96", "--dim", "16", "--batch-sizes", "2",
                           "--drafts", "2", "--context", "8", "--bad-words", "5",
                           "--out", str(tmp_path)]) == 0
    row, = json.loads((tmp_path / "edit_cost.json").read_text())["rows"]
    assert set(row["ms"]) == set(edit_cost.TIMINGS) and row["x_verify_step"] > 0


# Transformers' own processors for a context of `width` tokens, per option set.
def _hf_processors(option, width, eos):
    return {
        "repetition_penalty": [lp.RepetitionPenaltyLogitsProcessor(1.3)],
        "bans": [lp.NoBadWordsLogitsProcessor([[5], [40], [77], [3]], eos),
                 lp.SuppressTokensLogitsProcessor([6, 41, 500])],
        "multi-token words": [lp.NoBadWordsLogitsProcessor(
            [[12, 13], [20, 21, 22], [30, 31], [31, 32], [12, 14]], eos)],
        "min_new_tokens": [lp.MinNewTokensLengthLogitsProcessor(width - 2, 5, eos)],
        "no_repeat_ngram_size 1": [lp.NoRepeatNGramLogitsProcessor(1)],
        "forced_eos_token_id": [lp.MinLengthLogitsProcessor(width + 3, eos),
                                lp.ForcedEOSTokenLogitsProcessor(width + 3, 70)],
        "all": [lp.RepetitionPenaltyLogitsProcessor(0.7), lp.NoRepeatNGramLogitsProcessor(2),
                lp.NoBadWordsLogitsProcessor([[5]], eos), lp.MinLengthLogitsProcessor(width + 2, eos),
                lp.ForcedEOSTokenLogitsProcessor(width + 2, 40), lp.SuppressTokensLogitsProcessor([6]),
                lp.SuppressTokensAtBeginLogitsProcessor([9, 10], width + 1)],
    }[option]


def _hf_warpers(params, row):
    """transformers' warpers of `params`' row, in its order (the kernels' semantics)."""
    if not bool(params.do_sample[row]) or float(params.temperature[row]) == 0.0:
        return []
    warpers = [lp.TemperatureLogitsWarper(float(params.temperature[row]))]
    if int(params.top_k[row]) > 0:
        warpers.append(lp.TopKLogitsWarper(int(params.top_k[row])))
    if float(params.top_p[row]) < 1.0:
        warpers.append(lp.TopPLogitsWarper(float(params.top_p[row])))
    if float(params.min_p[row]) > 0.0:
        warpers.append(lp.MinPLogitsWarper(float(params.min_p[row])))
    return warpers


@pytest.mark.parametrize("option", ["repetition_penalty", "bans", "multi-token words",
                                    "min_new_tokens", "no_repeat_ngram_size 1",
                                    "forced_eos_token_id", "all"])
def test_fused_equals_transformers_processors_in_float64(option):
    """The codes that `EditRules` / `EditState` make from transformers' processors and a
    context, applied by the fused kernels, against those processors on the float64 logits of
    the same context (stock's input_ids: the row's tokens so far; its length decides the
    length rules), then transformers' warpers and the same Philox noise: the same token, or a
    float64 near-tie. Generated counts 0..3 cross the begin position, the EOS minimum and
    the forced EOS (one that the minimum length bans before it: the forcing undoes that);
    a bad word equal to an EOS id and an id past the vocabulary are dropped as transformers
    drops them."""
    from flashspec.generation.edits import EditRules, EditState

    g = torch.Generator().manual_seed(len(option))
    batch, vocab_size, width = 8, 96, 12
    eos = torch.tensor([3, 70])
    rules = EditRules.from_processors(_hf_processors(option, width, eos), width, vocab_size, 3)
    hidden, weight, positions = random_problem(g, batch, vocab_size, 32)
    params = mixed_params(g, batch, seed=7)
    context = torch.randint(0, vocab_size, (batch, width + 3), generator=g)
    # Contexts that end with bad words' prefixes, now and after the generated tokens.
    context[:3, width - 1] = 12
    context[3:5, width - 2:width + 1] = torch.tensor([20, 21, 30])
    context[5:, width:width + 3] = torch.tensor([31, 20, 21])
    logits64 = reference.compute_logits(hidden.double().cpu(), weight.double().cpu())
    for generated in range(4):
        state = EditState(batch, vocab_size, torch.device(DEVICE))
        state.load(rules, context[:, :width].to(DEVICE))
        state.absorb(context[:, width:width + generated].to(DEVICE),
                     torch.ones(batch, generated, dtype=torch.bool, device=DEVICE))
        edits = state.sample_edits(torch.full((batch,), generated, device=DEVICE))
        if option == "multi-token words" and generated == 0:   # the words bite
            assert (edits.codes[:3, [13, 14]] == BAN).all() and (edits.codes[3:5, 22] == BAN).all()
        ours = sampling.sample(hidden, weight, params, positions, edits=edits, backend="fused",
                               config=SMALL).tokens.cpu()
        ids = context[:, :width + generated]
        edited = lp.LogitsProcessorList(_hf_processors(option, width, eos))(ids, logits64.clone())
        if option == "forced_eos_token_id" and generated == 2:
            assert (ours == 70).all()
        for row in range(batch):
            _assert_transformers_draw(int(ours[row]), edited[row], ids[row], params, row,
                                      positions[row], (option, generated, row))


def _assert_transformers_draw(got, edited, ids, params, row, position, what):
    """Token `got` of `params`' row is transformers' draw from its processed scores
    `edited` ``[V]`` (float64) for the context `ids` ``[L]``: its warpers, then Gumbel-max
    with the row's Philox noise at `position` (argmax when greedy), or a near-tie of it."""
    scores = lp.LogitsProcessorList(_hf_warpers(params, row))(ids[None], edited[None].clone())[0]
    noise = rng.gumbel(params.seed[row].cpu(), position.cpu(), torch.arange(edited.shape[0]),
                       dtype=torch.float64)
    sampled = bool(params.do_sample[row]) and float(params.temperature[row]) != 0.0
    want = int((scores + noise).argmax() if sampled else scores.argmax())
    assert got == want or is_near_tie(
        edited, bool(params.do_sample[row]), float(params.temperature[row]),
        int(params.top_k[row]), float(params.top_p[row]), float(params.min_p[row]),
        noise, got, want), (what, got, want)
    assert bool(torch.isfinite(edited[got])), what


@seed(0)
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 3), size=st.integers(1, 4), width=st.integers(1, 9),
       generated=st.integers(0, 4), num_drafts=st.integers(0, 4), alphabet=st.integers(2, 6),
       setting=st.integers(0, 10_000))
def test_no_repeat_ngram_codes_equal_transformers(batch, size, width, generated, num_drafts,
                                                 alphabet, setting):
    """Contexts over a few ids (so that n-grams repeat), any size, generated count and
    drafts (as many per row as it has): each verified position's BANs are exactly the -inf
    of transformers' `NoRepeatNGramLogitsProcessor` on that position's input_ids (the
    padded prompt, the generated tokens, the drafts before it; shorter than n: none), and
    the draws with those codes (the torch reference, which the tests above hold the kernels
    to) are transformers' (its processor, then its warpers, on the float64 logits with the
    same noise), or a near-tie."""
    from flashspec.generation.edits import EditRules, EditState

    g = torch.Generator().manual_seed(setting)
    vocab_size = 64
    context = torch.randint(0, alphabet, (batch, width + generated), generator=g)
    lengths = torch.randint(0, num_drafts + 1, (batch,), generator=g)
    drafts = torch.randint(0, alphabet, (batch, num_drafts), generator=g)
    drafts = torch.where(torch.arange(num_drafts)[None] < lengths[:, None], drafts, -1)
    processor = lp.NoRepeatNGramLogitsProcessor(size)
    rules = EditRules.from_processors([processor], width, vocab_size, generated + num_drafts + 1)
    state = EditState(batch, vocab_size, torch.device(DEVICE))
    state.load(rules, context[:, :width].to(DEVICE))
    state.absorb(context[:, width:].to(DEVICE),
                 torch.ones(batch, generated, dtype=torch.bool, device=DEVICE))
    codes = state.verify_edits(torch.full((batch,), generated, device=DEVICE),
                               drafts.to(DEVICE)).codes
    rows = batch * (num_drafts + 1)
    hidden, weight, positions = random_problem(g, rows, vocab_size, 16)
    params = mixed_params(g, rows, seed=setting)
    edits = LogitEdits(codes.reshape(rows, vocab_size),
                       torch.ones(rows, dtype=torch.float64, device=DEVICE))
    ours = sampling.sample(hidden, weight, params, positions, edits=edits,
                           backend="reference").tokens.cpu()
    logits64 = reference.compute_logits(hidden.double().cpu(), weight.double().cpu())
    codes = codes.cpu()
    for b in range(batch):
        for j in range(int(lengths[b]) + 1):
            row = b * (num_drafts + 1) + j
            ids = torch.cat([context[b], drafts[b, :j]])
            edited = processor(ids[None], logits64[row:row + 1].clone())[0]
            assert torch.equal(codes[b, j] == BAN, edited.isinf()), (b, j, ids.tolist())
            _assert_transformers_draw(int(ours[row]), edited, ids, params, row, positions[row],
                                      (b, j))


def test_goodness_of_fit_with_edits():
    """Many seeds of one edited row (a logit bias, penalized context, vLLM's penalties over
    generated counts, bans): the fused kernels' tokens follow the processed distribution of
    transformers' processors and vLLM's rule, in their order (chi-squared). Truncation with
    edits is pinned pathwise above; this samples the whole vocabulary, the Gumbel race's
    path."""
    from flashspec.bench.statistics import assert_samples_match

    g = torch.Generator().manual_seed(12)
    samples, vocab_size = 2048, 48
    hidden, weight, _ = random_problem(g, 1, vocab_size, 16, scale=1.0)
    codes = torch.zeros(vocab_size, dtype=torch.uint8)
    codes[:12] = PENALIZE
    codes[[2, 20, 30]] = BAN
    bias = torch.zeros(vocab_size)
    bias[[5, 13, 40]] = torch.tensor([1.5, -2.0, 0.75])
    counts = torch.zeros(vocab_size, dtype=torch.int32)
    counts[[5, 6, 13, 41]] = torch.tensor([1, 3, 2, 1], dtype=torch.int32)
    params = SamplingParams.create(samples, temperature=0.8,
                                   seed=torch.arange(samples, device=DEVICE), device=DEVICE)
    rows = lambda t: t.expand(samples, -1).contiguous().to(DEVICE)  # noqa: E731
    per_row = lambda value: torch.full((samples,), value, dtype=torch.float64, device=DEVICE)  # noqa: E731
    edits = LogitEdits(rows(codes), per_row(1.6), bias=rows(bias), counts=rows(counts),
                       frequency=per_row(0.4), presence=per_row(-0.3))
    positions = torch.zeros(samples, dtype=torch.long, device=DEVICE)
    config = kernels.TileConfig(block_v=32, block_r=64, block_d=16)
    tokens = sampling.sample(hidden.expand(samples, -1).contiguous(), weight, params, positions,
                             edits=edits, backend="fused", config=config).tokens
    logits = reference.compute_logits(hidden.double().cpu(), weight.double().cpu())
    scores = lp.SequenceBiasLogitsProcessor({(5,): 1.5, (13,): -2.0, (40,): 0.75})(None, logits)
    scores = lp.RepetitionPenaltyLogitsProcessor(1.6)(torch.arange(12)[None], scores)
    scores = scores - 0.4 * counts.double() + 0.3 * (counts > 0).double()
    scores = lp.LogitsProcessorList([lp.SuppressTokensLogitsProcessor([2, 20, 30]),
                                     lp.TemperatureLogitsWarper(0.8)])(None, scores)
    assert_samples_match(tokens, scores.softmax(dim=-1)[0], what="fused sample with edits")


def test_compile_variants_with_edits_runs_every_setting(monkeypatch):
    """`samplers.compile_variants(..., edits=("codes",))` runs each kernel setting with codes
    (the EDITS variants), sampling and verifying."""
    from flashspec.generation import samplers

    seen = []
    launch = kernels.ops._launch
    monkeypatch.setattr(kernels.ops, "_launch",
                        lambda *args, **kwargs: seen.append(kwargs.get("edits")) or launch(*args, **kwargs))
    weight = torch.randn(64, 16, device=DEVICE)
    for width in (0, 2):
        samplers.compile_variants(weight, 2, width, edits=("codes",))
    assert len(seen) == 2 * len(samplers.kernel_settings(64))
    assert all(edits is not None and not edits.codes.any() and edits.bias is None
               and edits.counts is None for edits in seen)
    # With a bias per position and counts: the additive variants, neutral.
    seen.clear()
    samplers.compile_variants(weight, 2, 2, edits=("codes", "position bias", "counts"))
    assert all(edits.bias.shape == (2, 3, 64) and not edits.bias.any()
               and edits.counts.shape == (2, 64) and not edits.counts.any() for edits in seen)
    for wrong in (("biases",), "codes", True):
        with pytest.raises(ValueError, match="must be a tuple of names from"):
            samplers.compile_variants(weight, 2, 0, edits=wrong)
