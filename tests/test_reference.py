"""flashspec.reference, through `flashspec.sampling`'s reference backend: HF semantics
(oracle), exact sampling, greedy, verification, errors.

The `check_*` functions are the checks themselves; tests/test_teeth.py runs them against
deliberately broken implementations to show that they fail.
"""

import functools
import warnings

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessorList

from flashspec import NonFiniteLogitsError, SamplingParams, reference, sampling
from flashspec.outputs import NON_FINITE
from flashspec.bench.statistics import assert_samples_match

reference_argmax = functools.partial(sampling.argmax, backend="reference")
reference_sample = functools.partial(sampling.sample, backend="reference")
reference_verify = functools.partial(sampling.verify, backend="reference")


def reference_tokens(hidden, weight, params, positions):
    """The reference's sampled tokens ``[B]`` (the `sample` callback of the checks below)."""
    return reference_sample(hidden, weight, params, positions).tokens

# ---------------------------------------------------------------------------------------
# Semantic oracle: transformers' own LogitsProcessorList from the same GenerationConfig.


@functools.lru_cache(maxsize=1)
def _tiny_hf_model():
    config = LlamaConfig(vocab_size=64, hidden_size=8, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM(config)


def hf_processed_scores(logits: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """What transformers' `generate` feeds to its sampler for these logits and config."""
    model = _tiny_hf_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared, _ = model._prepare_generation_config(config)
        model._prepare_special_tokens(prepared, False, device="cpu")
        processors = model._get_logits_processor(
            generation_config=prepared, input_ids_seq_length=1,
            encoder_input_ids=torch.zeros(1, 1, dtype=torch.long), prefix_allowed_tokens_fn=None,
            logits_processor=LogitsProcessorList(), device="cpu", model_kwargs={},
        )
    return processors(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0]


def random_oracle_case(g: torch.Generator):
    """Random logits (normal, tied, huge, peaked) and a random sampling config that hits
    tiny and huge temperatures, top_k > V, top_p = 1 and min_p = 1."""
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=g))]  # noqa
    vocab_size = int(torch.randint(2, 65, (1,), generator=g))
    kind = pick(["normal", "ties", "huge", "peaked"])
    if kind == "ties":
        logits = torch.randint(0, 4, (vocab_size,), generator=g).float() * 1.5
    else:
        scale = {"normal": 2.0, "huge": 40.0, "peaked": 8.0}[kind]
        logits = torch.randn(vocab_size, generator=g) * scale
        if kind == "peaked":
            logits[int(torch.randint(vocab_size, (1,), generator=g))] += 30.0
    config = GenerationConfig(
        do_sample=pick([True] * 9 + [False]),
        temperature=pick([1e-3, 0.05, 0.5, 0.7, 1.0, 1.3, 10.0, 1e4]),
        top_k=pick([None, 0, 1, 2, 5, max(vocab_size - 1, 1), vocab_size, vocab_size + 7, 50]),
        top_p=pick([None, 1.0, 0.99, 0.9, 0.5, 0.1, float(torch.rand(1, generator=g))]),
        min_p=pick([None, 0.0, 0.01, 0.1, 0.5, 1.0]),
    )
    return logits, config


def check_oracle(num_cases=600, seed=0, transform=None):
    """Support and probabilities of the transformed distribution equal transformers'.

    Where transformers' unstable sort decides which of several equal logits survive at the
    top-p boundary, the kept multiset of logits (hence the probabilities) must still agree.
    """
    transform = transform or reference.transform_logits
    g = torch.Generator().manual_seed(seed)
    tie_cases = 0
    for case in range(num_cases):
        logits, config = random_oracle_case(g)
        theirs = hf_processed_scores(logits, config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            params = SamplingParams.from_generation_config(config, 1, seed=0)
        ours = transform(logits[None], params)[0]
        their_support, our_support = torch.isfinite(theirs), torch.isfinite(ours)
        their_probs = theirs.double().softmax(-1)
        our_probs = ours.double().softmax(-1)
        where = f"case {case}: {config.to_diff_dict()} logits={logits.tolist()}"
        if torch.equal(their_support, our_support):
            assert torch.allclose(our_probs, their_probs, rtol=0, atol=1e-6), where
            continue
        tie_cases += 1
        assert torch.equal(logits[their_support].sort().values,
                           logits[our_support].sort().values), f"support differs, {where}"
        assert torch.allclose(our_probs.sort().values, their_probs.sort().values,
                              rtol=0, atol=1e-6), where
    return tie_cases


def test_semantic_oracle_matches_transformers():
    num_cases = 600
    tie_cases = check_oracle(num_cases)
    assert tie_cases < num_cases // 4  # ties straddling the top-p boundary are the exception


# ---------------------------------------------------------------------------------------
# Exact sampling: goodness of fit against float64 softmax.

TRUNCATION_CASES = {
    "none": dict(),
    "temperature": dict(temperature=0.5),
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.1),
    "qwen3": dict(temperature=0.6, top_k=20, top_p=0.95),
    "llama": dict(temperature=0.6, top_p=0.9),
    "all": dict(temperature=1.5, top_k=12, top_p=0.9, min_p=0.05),
}


def exact_probs(hidden: torch.Tensor, weight: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float64 transformed distribution of each row."""
    logits = reference.compute_logits(hidden.double(), weight.double())
    return reference.transform_logits(logits, params).softmax(-1)


def draw_iid(hidden_row, weight, params_row, num_samples, sample=None, first_position=0):
    """`num_samples` independent tokens for one distribution: one row per position."""
    sample = sample or reference_tokens
    hidden = hidden_row.expand(num_samples, -1).contiguous()
    params = params_row.repeat_interleave(num_samples)
    positions = torch.arange(first_position, first_position + num_samples)
    return sample(hidden, weight, params, positions)


def check_truncation_gof(case: str, num_samples=20_000, vocab_size=40, seed=0, sample=None):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab_size, 16, generator=g)
    hidden = torch.randn(1, 16, generator=g) * 0.7
    params = SamplingParams.create(1, seed=1234 + seed, **TRUNCATION_CASES[case])
    tokens = draw_iid(hidden, weight, params, num_samples, sample)
    probs = exact_probs(hidden, weight, params)[0]
    assert_samples_match(tokens, probs, what=f"reference sampling, {case}")


@pytest.mark.parametrize("case", list(TRUNCATION_CASES))
def test_sampling_matches_float64_softmax(case):
    check_truncation_gof(case)


def test_logprobs_match_float64():
    g = torch.Generator().manual_seed(3)
    weight, hidden = torch.randn(50, 24, generator=g), torch.randn(6, 24, generator=g)
    params = SamplingParams.create(6, do_sample=[True, True, True, True, False, True],
                                   temperature=[1.0, 0.7, 0.6, 2.0, 1.0, 0.0],
                                   top_k=[0, 10, 20, 0, 0, 0], top_p=[1.0, 0.9, 0.95, 1.0, 1.0, 1.0],
                                   min_p=[0.0, 0.0, 0.0, 0.2, 0.0, 0.0], seed=9)
    tokens, logprobs, _, _ = reference_sample(hidden, weight, params, torch.arange(6))
    logits64 = reference.compute_logits(hidden.double(), weight.double())
    log_probs64 = reference.transform_logits(logits64, params).log_softmax(-1)
    expected = log_probs64.gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(logprobs.double(), expected, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Greedy.


def test_greedy_equals_float64_argmax():
    g = torch.Generator().manual_seed(1)
    for trial in range(20):
        vocab_size, dim, batch = 200 + trial, 32, 9
        weight = torch.randn(vocab_size, dim, generator=g)
        hidden = torch.randn(batch, dim, generator=g)
        logits64 = hidden.double() @ weight.double().T
        top2 = logits64.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-4  # float32 cannot rank closer pairs
        expected = logits64.argmax(-1)
        greedy_params = SamplingParams.create(batch, do_sample=False, seed=0)
        for tokens in (reference_argmax(hidden, weight).tokens,
                       reference_tokens(hidden, weight, greedy_params,
                                        torch.zeros(batch, dtype=torch.long))):
            assert torch.equal(tokens[clear], expected[clear])


def test_greedy_ties_pick_lowest_id():
    weight = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.5, 0.5]])
    hidden = torch.tensor([[1.0, 0.0]])
    assert reference_argmax(hidden, weight).tokens.item() == 1
    params = SamplingParams.create(1, temperature=0.0, seed=0)
    assert reference_tokens(hidden, weight, params, torch.tensor([0])).item() == 1


# ---------------------------------------------------------------------------------------
# Verification.


def _verify_setup(seed=0, batch=6, num_drafts=4, vocab_size=50, dim=16):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab_size, dim, generator=g)
    hidden = torch.randn(batch, num_drafts + 1, dim, generator=g) * 0.8
    params = SamplingParams.create(
        batch, do_sample=[True, True, False, True, True, True][:batch],
        temperature=[1.0, 0.7, 1.0, 0.0, 0.6, 1.3][:batch], top_k=[0, 10, 0, 0, 20, 0][:batch],
        top_p=[1.0, 1.0, 1.0, 1.0, 0.95, 0.9][:batch], min_p=[0.0, 0.0, 0.0, 0.0, 0.0, 0.1][:batch],
        seed=100 + seed)
    positions = torch.randint(0, 1000, (batch,), generator=g)
    return g, weight, hidden, params, positions


def _plain_samples(hidden, weight, params, positions):
    """What `sample` emits at each of the G+1 positions, row by row."""
    return torch.stack([reference_tokens(hidden[:, j], weight, params, positions + j)
                        for j in range(hidden.shape[1])], dim=1)


def check_speculation_invariance(seed=0, verify=None):
    verify = verify or reference_verify
    g, weight, hidden, params, positions = _verify_setup(seed)
    batch, num_positions = hidden.shape[:2]
    vocab_size = weight.shape[0]
    plain = _plain_samples(hidden, weight, params, positions)
    right = plain[:, :-1].clone()
    lengths = torch.randint(0, num_positions, (batch,), generator=g)
    padded = torch.where(torch.arange(num_positions - 1)[None, :] < lengths[:, None], right, -1)
    mixed = right.clone()
    mixed[:, 2] = (mixed[:, 2] + 1) % vocab_size
    drafts_by_kind = {
        "right": right, "wrong": (right + 1) % vocab_size, "padded": padded, "mixed": mixed,
        "random": torch.randint(0, vocab_size, right.shape, generator=g),
    }
    for kind, drafts in drafts_by_kind.items():
        out = verify(hidden, weight, drafts, params, positions)
        matches = ((drafts == plain[:, :-1]) & (drafts >= 0)).long().cumprod(dim=1).sum(dim=1)
        assert torch.equal(out.num_accepted, matches), kind
        for b in range(batch):
            n = int(matches[b])
            assert out.tokens[b, : n + 1].tolist() == plain[b, : n + 1].tolist(), (kind, b)
            assert (out.tokens[b, n + 1:] == -1).all(), (kind, b)
    assert torch.equal(verify(hidden, weight, right, params, positions).num_accepted,
                       torch.full((batch,), num_positions - 1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculation_invariance(seed):
    check_speculation_invariance(seed)


def test_verify_probabilities_match_float64():
    g, weight, hidden, params, positions = _verify_setup(seed=4)
    drafts = torch.randint(0, weight.shape[0], (hidden.shape[0], hidden.shape[1] - 1), generator=g)
    drafts[0, 3:] = -1
    out = reference_verify(hidden, weight, drafts, params, positions)
    flat = hidden.reshape(-1, hidden.shape[-1]).double()
    flat_params = params.repeat_interleave(hidden.shape[1])
    logits64 = reference.compute_logits(flat, weight.double())
    log_probs64 = reference.transform_logits(logits64, flat_params).log_softmax(-1)
    log_probs64 = log_probs64.view(*hidden.shape[:2], -1)
    draft_p = log_probs64[:, :-1].gather(-1, drafts.clamp_min(0)[..., None]).squeeze(-1).exp()
    greedy = params.is_greedy[:, None]
    argmax = logits64.view(*hidden.shape[:2], -1)[:, :-1].argmax(-1)
    expected = torch.where(greedy, (drafts == argmax).double(), draft_p)
    expected = torch.where(drafts >= 0, expected, 0.0)
    assert torch.allclose(out.accept_probs.double(), expected, rtol=0, atol=1e-5)
    emitted = out.tokens >= 0
    expected_lp = log_probs64.gather(-1, out.tokens.clamp_min(0)[..., None]).squeeze(-1)
    assert torch.allclose(out.logprobs.double()[emitted], expected_lp[emitted], atol=1e-5)
    assert (out.logprobs[~emitted] == 0).all()


def check_probabilistic_acceptance(num_samples=20_000, verify=None, seed=0):
    """One distribution, one fixed draft: accept frequency is p(x), the recovered token
    follows p without x, and the emitted token follows p."""
    verify = verify or reference_verify
    g = torch.Generator().manual_seed(seed)
    vocab_size, dim = 30, 16
    weight = torch.randn(vocab_size, dim, generator=g)
    hidden_row = torch.randn(1, 2, dim, generator=g) * 0.6
    row_params = SamplingParams.create(1, temperature=0.8, top_k=15, seed=77)
    probs = exact_probs(hidden_row[:, 0], weight, row_params)[0]
    draft = int(probs.argsort(descending=True)[1])  # a likely but not dominant token
    out = verify(hidden_row.expand(num_samples, -1, -1).contiguous(), weight,
                 torch.full((num_samples, 1), draft), row_params.repeat_interleave(num_samples),
                 torch.arange(num_samples) * 2, acceptance="probabilistic")
    accepted = out.num_accepted == 1
    p_draft = float(probs[draft])
    assert torch.allclose(out.accept_probs[:, 0].double(), torch.tensor(p_draft, dtype=torch.float64), atol=1e-5)
    assert_samples_match(accepted.long(), torch.tensor([1 - p_draft, p_draft], dtype=torch.float64),
                         what="probabilistic accept frequency")
    residual = probs.clone()
    residual[draft] = 0
    assert_samples_match(out.tokens[~accepted, 0], residual / residual.sum(),
                         what="recovered token after rejection")
    assert_samples_match(out.tokens[:, 0], probs, what="first emitted token")


def test_probabilistic_acceptance_is_exact():
    check_probabilistic_acceptance()


def test_greedy_rows_accept_while_draft_is_argmax():
    g, weight, hidden, params, positions = _verify_setup(seed=5)
    greedy_params = SamplingParams.create(hidden.shape[0], do_sample=False, seed=0)
    argmax = reference.compute_logits(hidden, weight).argmax(-1)
    drafts = argmax[:, :-1].clone()
    drafts[1, 2] = (drafts[1, 2] + 1) % weight.shape[0]
    for acceptance in ("strict", "probabilistic"):
        out = reference_verify(hidden, weight, drafts, greedy_params, positions,
                               acceptance=acceptance)
        assert out.num_accepted.tolist() == [4, 2, 4, 4, 4, 4]
        assert out.tokens[1].tolist() == argmax[1, :3].tolist() + [-1, -1]
        assert torch.equal(out.tokens[0], argmax[0])


# ---------------------------------------------------------------------------------------
# Errors and non-finite logits.


def test_non_finite_rows_are_reported_not_sampled():
    g = torch.Generator().manual_seed(0)
    weight, hidden = torch.randn(20, 8, generator=g), torch.randn(3, 8, generator=g)
    hidden[1, 2] = float("nan")
    params = SamplingParams.create(3, seed=0)
    positions = torch.zeros(3, dtype=torch.long)
    with pytest.raises(NonFiniteLogitsError, match=r"rows \[1\]"):
        reference_sample(hidden, weight, params, positions)
    out = reference_sample(hidden, weight, params, positions, check=False)
    assert out.tokens[1] == -1 and torch.isnan(out.logprobs[1]) and (out.tokens[[0, 2]] >= 0).all()
    assert out.status.tolist() == [0, NON_FINITE, 0]
    with pytest.raises(NonFiniteLogitsError, match=r"rows \[1\]"):
        reference_argmax(hidden, weight)
    greedy = reference_argmax(hidden, weight, check=False)
    assert greedy.tokens[1] == -1 and greedy.status.tolist() == [0, NON_FINITE, 0]
    weight_inf = weight.clone()
    weight_inf[4, 0] = float("inf")
    with pytest.raises(NonFiniteLogitsError, match=r"rows \[0, 1, 2\]"):
        reference_sample(hidden, weight_inf, params, positions)
    hidden3 = torch.randn(2, 3, 8, generator=g)
    hidden3[1, 2, 0] = float("inf")
    params2 = SamplingParams.create(2, seed=0)
    with pytest.raises(NonFiniteLogitsError, match=r"rows \[1\]"):
        reference_verify(hidden3, weight, torch.zeros(2, 2, dtype=torch.long), params2,
                         torch.zeros(2, dtype=torch.long))
    out = reference_verify(hidden3, weight, torch.zeros(2, 2, dtype=torch.long), params2,
                           torch.zeros(2, dtype=torch.long), check=False)
    assert out.num_accepted[1] == -1 and (out.tokens[1] == -1).all() and out.num_accepted[0] >= 0
    assert out.status.tolist() == [0, NON_FINITE]
    # Row 1 with one draft, then padding, emits positions 0 and 1 only: the inf after is unused.
    padded = torch.tensor([[0, 0], [0, -1]])
    out = reference_verify(hidden3, weight, padded, params2, torch.zeros(2, dtype=torch.long))
    clean = hidden3.clone()
    clean[1, 2, 0] = 0.0
    assert torch.equal(out.tokens, reference_verify(
        clean, weight, padded, params2, torch.zeros(2, dtype=torch.long)).tokens)


def test_overflowing_temperature_is_reported():
    weight, hidden = torch.ones(4, 2) * 1e30, torch.ones(1, 2) * 1e8
    params = SamplingParams.create(1, temperature=1e-3, seed=0)
    with pytest.raises(NonFiniteLogitsError):
        reference_sample(hidden, weight, params, torch.zeros(1, dtype=torch.long))


@pytest.mark.parametrize("make,match", [
    (lambda h, w, p, x: (h[:, :5], w, p, x), "hidden size mismatch.*D=5.*D=8"),
    (lambda h, w, p, x: (h.double(), w, p, x), "float64.*float32"),
    (lambda h, w, p, x: (h.long(), w, p, x), "`hidden` has dtype torch.int64"),
    (lambda h, w, p, x: (h[:0], w, p, x), "empty batch"),
    (lambda h, w, p, x: (h[0], w, p, x), r"`hidden` must have shape \[B, D\]"),
    (lambda h, w, p, x: (h, w.T.contiguous().T, p, x), "`weight` must be contiguous"),
    (lambda h, w, p, x: (h, w, p, x[:2]), r"`positions` must have shape \[3\]"),
    (lambda h, w, p, x: (h, w, p, x.int()), "`positions` must be an int64"),
    (lambda h, w, p, x: (h, w, p, x - 1), r"`positions` must lie in \[0"),
    (lambda h, w, p, x: (h, w, SamplingParams.create(2, seed=0), x), "`params` has 2 rows"),
])
def test_bad_sampling_inputs(make, match):
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(3, 8, generator=g), torch.randn(10, 8, generator=g),
            SamplingParams.create(3, seed=0), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=match):
        reference_sample(*make(*args))


def test_bad_verify_inputs():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 4, 8, generator=g), torch.randn(10, 8, generator=g)
    params, positions = SamplingParams.create(2, seed=0), torch.zeros(2, dtype=torch.long)
    drafts = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"`draft_tokens` must have shape \[B, G\] = \[2, 3\]"):
        reference_verify(hidden, weight, drafts[:, :2], params, positions)
    with pytest.raises(ValueError, match=r"token ids in \[0, 10\) or -1.*\[10, 10\]"):
        reference_verify(hidden, weight, drafts + 10, params, positions)
    with pytest.raises(ValueError, match="-1 for padding.*-2"):
        reference_verify(hidden, weight, drafts - 2, params, positions)
    with pytest.raises(ValueError, match="`acceptance`='lenient'"):
        reference_verify(hidden, weight, drafts, params, positions, acceptance="lenient")
    with pytest.raises(ValueError, match=r"`hidden` must have shape \[B, G\+1, D\]"):
        reference_verify(hidden[:, 0], weight, drafts, params, positions)


# ---------------------------------------------------------------------------------------
# The CPU's race among contenders: noise only for the tokens that can win.


def _race_cases(g: torch.Generator):
    """(logits [B * 4, V], params of B rows) covering flat, peaked, tied and huge rows, greedy
    rows among sampled ones, every truncation and both dtypes."""
    settings = [dict(), dict(top_k=0), dict(temperature=0.7, top_k=20, top_p=0.9),
                dict(top_k=0, top_p=0.8), dict(top_k=0, min_p=0.1), dict(temperature=0.01, top_k=3),
                dict(do_sample=[False, True, True], temperature=[1.0, 0.5, 1.3], top_k=[0, 5, 0],
                     top_p=[1.0, 0.9, 0.5])]
    for case in range(10):
        vocab_size = int(torch.randint(50, 1500, (1,), generator=g))
        scale = [0.05, 1.0, 5.0, 30.0, 1e6][case % 5]
        logits = torch.randn(12, vocab_size, generator=g) * scale
        if case % 3 == 0:
            logits = (logits * 4).round() / 4
        if case % 4 == 0:
            logits = logits.double()
        for setting in settings:
            yield logits, SamplingParams.create(3, **{"do_sample": True, "seed": case, **setting})


def test_cpu_race_among_contenders_equals_noise_for_every_token(monkeypatch):
    """Sample and verify (both acceptances) give bitwise the same results whether the CPU draws
    noise for the contenders only or for every token; the contenders' path is taken, and is
    left for the whole row when too many tokens contend."""
    g = torch.Generator().manual_seed(11)
    taken = []
    contenders = reference._contenders
    monkeypatch.setattr(reference, "_contenders",
                        lambda *args: taken.append(contenders(*args) is not None) or
                        contenders(*args))
    for logits, params in _race_cases(g):
        positions = torch.randint(0, 1000, (3,), generator=g)
        drafts = torch.randint(0, logits.shape[-1], (3, 3), generator=g)
        drafts[0, 2] = -1
        drafts[1] = reference.sample_logits(logits[3:6], params, positions[1:2] + torch.arange(3)
                                            ).tokens  # accepted drafts as well
        runs = {}
        for share in (reference.MAX_CONTENDER_SHARE, 0.0):
            with monkeypatch.context() as patch:
                patch.setattr(reference, "MAX_CONTENDER_SHARE", share)
                runs[share] = [reference.sample_logits(logits[:3], params, positions)] + [
                    reference.verify_logits(logits, drafts, params, positions, acceptance=mode)
                    for mode in ("strict", "probabilistic")]
        for fast, full in zip(*runs.values()):
            for a, b in zip(fast, full):
                assert torch.equal(a.nan_to_num(nan=7.0), b.nan_to_num(nan=7.0))
    assert any(taken) and not all(taken)
