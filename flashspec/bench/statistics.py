"""Statistical test kit: do samples come from an exact (float64) distribution?

Every exactness test in the project goes through `assert_samples_match`, which runs a
chi-squared goodness-of-fit test with pooled small bins:

* a sample outside the support (probability 0) fails at once, whatever its count;
* outcomes are sorted by probability and merged, smallest first, until every bin expects
  at least `min_expected` counts (the usual validity condition of the chi-squared
  approximation); the merged tail keeps its total mass, so nothing is dropped;
* the p-value is P(chi2_{bins-1} >= statistic).

False alarms: when the samples truly follow `probs`, one call fails with probability about
`alpha` (the chi-squared approximation is good at these bin sizes). Tests draw with fixed
seeds, so each one is reproducible; a suite of N calls at level alpha has a family-wise
false-alarm rate of at most N * alpha. The default alpha = 1e-4 keeps a suite of a few
hundred calls below a few percent, while each test's sample size gives it the power to
see the errors it targets (demonstrated in tests/test_teeth.py).
"""

from __future__ import annotations

import dataclasses
import math

import torch

DEFAULT_ALPHA = 1e-4


@dataclasses.dataclass(frozen=True)
class GoodnessOfFit:
    statistic: float
    dof: int
    pvalue: float
    num_samples: int
    outside_support: int  # samples that fell on outcomes of probability 0

    def passed(self, alpha: float = DEFAULT_ALPHA) -> bool:
        return self.outside_support == 0 and self.pvalue >= alpha


def chi2_sf(statistic: float, dof: int) -> float:
    """Survival function of the chi-squared distribution, P(X >= statistic)."""
    if dof <= 0:
        return 1.0
    x = torch.tensor(statistic / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), x))


def goodness_of_fit(samples: torch.Tensor, probs: torch.Tensor,
                    min_expected: float = 5.0) -> GoodnessOfFit:
    """Chi-squared test of integer `samples` (outcome ids) against `probs` ``[K]``."""
    probs = probs.detach().to(torch.float64).cpu()
    if probs.dim() != 1:
        raise ValueError(f"`probs` must be 1-D, got shape {tuple(probs.shape)}")
    if bool((probs < 0).any()) or not math.isclose(float(probs.sum()), 1.0, abs_tol=1e-9):
        raise ValueError(f"`probs` must be a distribution (>= 0, sum 1), sums to {float(probs.sum())}")
    samples = samples.detach().reshape(-1).cpu().long()
    n = samples.numel()
    if n == 0:
        raise ValueError("no samples")
    in_range = (samples >= 0) & (samples < probs.numel())
    counts = torch.bincount(samples[in_range], minlength=probs.numel()).to(torch.float64)
    outside = int((~in_range).sum()) + int(counts[probs == 0].sum())

    support = probs > 0
    p, c = probs[support], counts[support]
    order = torch.argsort(p)
    p, c = p[order], c[order]
    bins_p, bins_c = [], []
    acc_p, acc_c = 0.0, 0.0
    for pi, ci in zip(p.tolist(), c.tolist()):
        acc_p += pi
        acc_c += ci
        if acc_p * n >= min_expected:
            bins_p.append(acc_p)
            bins_c.append(acc_c)
            acc_p, acc_c = 0.0, 0.0
    if acc_p > 0:  # leftover mass joins the last bin
        if bins_p:
            bins_p[-1] += acc_p
            bins_c[-1] += acc_c
        else:
            bins_p.append(acc_p)
            bins_c.append(acc_c)
    expected = torch.tensor(bins_p, dtype=torch.float64) * n
    observed = torch.tensor(bins_c, dtype=torch.float64)
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(bins_p) - 1
    return GoodnessOfFit(statistic, dof, chi2_sf(statistic, dof), n, outside)


def assert_samples_match(samples: torch.Tensor, probs: torch.Tensor,
                         alpha: float = DEFAULT_ALPHA, what: str = "samples") -> GoodnessOfFit:
    """Fail unless `samples` pass the goodness-of-fit test against `probs` at level `alpha`."""
    result = goodness_of_fit(samples, probs)
    if result.outside_support:
        raise AssertionError(
            f"{what}: {result.outside_support} of {result.num_samples} samples fell outside the "
            "support (outcomes of probability 0)"
        )
    if result.pvalue < alpha:
        raise AssertionError(
            f"{what}: chi-squared {result.statistic:.1f} on {result.dof} dof, p={result.pvalue:.3g} "
            f"< alpha={alpha:g} ({result.num_samples} samples)"
        )
    return result


@dataclasses.dataclass(frozen=True)
class AcceptanceCheck:
    """Realised accepted drafts against their expectation from p(x) (a z-test)."""

    realised: int
    expected: float
    std: float
    z: float
    pvalue: float        # two-sided, normal approximation

    def passed(self, alpha: float = DEFAULT_ALPHA) -> bool:
        return self.pvalue >= alpha


def acceptance_check(stats) -> AcceptanceCheck:
    """Compare a run's accepted drafts with `stats.expected_accepted()` (a
    `SpeculationStats`): under the strict rule the total is a sum of independent per-step
    counts with known mean and variance, so z = (realised - expected) / std is close to
    standard normal when many steps had an uncertain draft. With no uncertainty (std 0,
    e.g. greedy) the two must be equal."""
    realised = int(stats.accepted.sum())
    expected, std = stats.expected_accepted()
    if std == 0.0:
        z = 0.0 if abs(realised - expected) < 1e-6 else math.inf
    else:
        z = (realised - expected) / std
    return AcceptanceCheck(realised, expected, std, z, math.erfc(abs(z) / math.sqrt(2.0)))


def assert_acceptance_matches(stats, alpha: float = DEFAULT_ALPHA,
                              what: str = "acceptance") -> AcceptanceCheck:
    """Fail unless the realised accepted drafts agree with p(x) at level `alpha`."""
    check = acceptance_check(stats)
    if not check.passed(alpha):
        raise AssertionError(
            f"{what}: {check.realised} drafts accepted, {check.expected:.1f} +- {check.std:.1f} "
            f"expected from p(x): z={check.z:.2f}, p={check.pvalue:.3g} < alpha={alpha:g}")
    return check


def ks_uniform_pvalue(values: torch.Tensor) -> float:
    """Kolmogorov-Smirnov p-value of `values` against Uniform(0, 1) (asymptotic form with
    Stephens' small-sample correction)."""
    x = values.detach().reshape(-1).to(torch.float64).cpu().sort().values
    n = x.numel()
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = float(torch.maximum(i / n - x, x - (i - 1) / n).max())
    sqrt_n = math.sqrt(n)
    lam = (sqrt_n + 0.12 + 0.11 / sqrt_n) * d
    if lam < 0.2:
        return 1.0
    series = sum((-1) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam) for k in range(1, 101))
    return max(0.0, min(1.0, 2.0 * series))


def _support(scores: torch.Tensor, top_k: int, top_p: float, min_p: float,
             slack: float) -> torch.Tensor:
    """float64 support of HF's top-k -> top-p -> min-p on `scores` ``[V]``, with every
    threshold moved by `slack` (positive: more permissive, negative: stricter)."""
    keep = torch.isfinite(scores)
    vocab_size = scores.numel()
    if 0 < top_k < vocab_size:
        kth = scores.sort(descending=True).values[top_k - 1]
        keep &= scores >= kth - slack
    if top_p < 1.0:
        order = scores.masked_fill(~keep, float("-inf")).argsort(descending=True, stable=True)
        probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)[order]
        before = probs.cumsum(0) - probs
        kept_sorted = before < top_p + slack
        kept_sorted[0] = True
        keep &= torch.zeros_like(keep).scatter(0, order, kept_sorted)
    if min_p > 0.0:
        top = scores.masked_fill(~keep, float("-inf")).max()
        keep &= torch.exp(scores - top) >= min_p - slack
    return keep


def is_near_tie(logits64: torch.Tensor, do_sample: bool, temperature: float, top_k: int,
                top_p: float, min_p: float, noise64: torch.Tensor, token_a: int, token_b: int,
                tol: float = 1e-4) -> bool:
    """Can two implementations that differ only by floating-point rounding pick `token_a`
    and `token_b` for this row?

    Yes when, in float64, the two perturbed scores are within `tol` (relative) of each
    other, or when some token sits within `tol` of a truncation threshold and each token
    is the Gumbel-max winner of a support between the strict and the permissive reading.
    `logits64` and `noise64` are the row's float64 logits and Gumbel noise ``[V]``.
    """
    if token_a == token_b:
        return True
    if not do_sample or temperature == 0.0:
        a, b = float(logits64[token_a]), float(logits64[token_b])
        return abs(a - b) <= tol * (1.0 + max(abs(a), abs(b)))
    scores = logits64 / temperature
    perturbed = scores + noise64
    a, b = float(perturbed[token_a]), float(perturbed[token_b])
    supports = [_support(scores, top_k, top_p, min_p, slack) for slack in (-tol, 0.0, tol)]
    both_kept = all(bool(supports[2][t]) for t in (token_a, token_b))
    if both_kept and abs(a - b) <= tol * (1.0 + max(abs(a), abs(b))):
        return True
    winners = set()
    strict, permissive = supports[0], supports[2]
    borderline = (permissive & ~strict).nonzero().flatten().tolist()
    if len(borderline) > 12:
        return False
    for extra in range(2 ** len(borderline)):
        support = strict.clone()
        for i, token in enumerate(borderline):
            if extra >> i & 1:
                support[token] = True
        winners.add(int(perturbed.masked_fill(~support, float("-inf")).argmax()))
    return token_a in winners and token_b in winners
