"""Realised against expected acceptance, from the `SpeculationStats` of flashspec's
generate calls: per draft position (alpha_i and its expectation from p(x)), the distribution
of accepted lengths, and z-tests of agreement. scripts/acceptance_rate.py reports them."""

from __future__ import annotations

import dataclasses
import math

import torch

from flashspec.generation.outputs import SpeculationStats


# |z| above this is a disagreement: about 3 in 1,000 false alarms per comparison.
Z_LIMIT = 3.0


def _fit(values: torch.Tensor, width: int) -> torch.Tensor:
    """`values` along its last dim cut or zero-padded to `width`."""
    values = values[..., :width]
    return torch.nn.functional.pad(values, (0, width - values.shape[-1]))


def _number(value: float) -> float | None:
    """JSON-safe float: None for NaN and infinities."""
    return float(value) if math.isfinite(value) else None


def merge_stats(parts: list[SpeculationStats]) -> SpeculationStats:
    """One `SpeculationStats` for several generate calls: rows side by side, shorter runs
    padded with idle steps (all zero, which every statistic skips)."""
    steps = max(part.num_steps for part in parts)
    merged = {}
    for field in dataclasses.fields(SpeculationStats):
        values = [getattr(part, field.name) for part in parts]
        # [steps, B, ...]: every part zero-padded to the most steps (and the widest draft dim).
        tail = [max(value.shape[d] for value in values) for d in range(2, values[0].dim())]
        padded = []
        for value in values:
            zeros = value.new_zeros(steps, value.shape[1], *tail)
            zeros[tuple(slice(0, size) for size in value.shape)] = value
            padded.append(zeros)
        merged[field.name] = torch.cat(padded, dim=1)
    return SpeculationStats(**merged)


def agreement(realised: float, mean: float, std: float) -> tuple[float | None, bool]:
    """(z, agrees): z = (realised - mean) / std (None when std is 0), agrees when |z| <=
    Z_LIMIT, or, with std 0 (greedy), when realised equals mean up to rounding."""
    if std > 0:
        z = (realised - mean) / std
        return z, abs(z) <= Z_LIMIT
    return None, abs(realised - mean) <= 1e-6 * max(1.0, abs(mean))


def position_statistics(stats: SpeculationStats, num_drafts: int) -> dict:
    """Per draft position i = 1..G (lists of length G): verifications that proposed a
    draft there and that reached it (the drafts before it accepted); realised alpha_i
    (accepted / reached), its expectation (mean p(x) over reached) with standard error, z
    and agreement; and accepted / proposed with its expectation (mean p_1 ... p_i over
    proposed, `SpeculationStats.expected_per_position_acceptance`). None where no
    verification reached (or proposed) i."""
    positions = torch.arange(num_drafts)
    proposed = stats.drafted[..., None] > positions                  # [steps, B, G]
    reached = proposed & (stats.accepted[..., None] >= positions)
    passed = stats.accepted[..., None] > positions
    probs = _fit(stats.accept_probs.double(), num_drafts) * reached
    num_proposed = proposed.sum(dim=(0, 1)).tolist()
    num_reached = reached.sum(dim=(0, 1)).tolist()
    num_passed = passed.sum(dim=(0, 1)).tolist()
    prob_sums = probs.sum(dim=(0, 1)).tolist()
    spread = (probs * (1 - probs)).sum(dim=(0, 1)).sqrt().tolist()
    alpha = [k / n if n else None for k, n in zip(num_passed, num_reached)]
    expected = [total / n if n else None for total, n in zip(prob_sums, num_reached)]
    stderr = [sd / n if n else None for sd, n in zip(spread, num_reached)]
    checks = [agreement(*values) if n else (None, None)
              for *values, n in zip(alpha, expected, stderr, num_reached)]
    expected_of_proposed = _fit(stats.expected_per_position_acceptance.double(), num_drafts)
    return {"proposed": num_proposed, "reached": num_reached, "alpha": alpha,
            "alpha_expected": expected, "alpha_stderr": stderr,
            "alpha_z": [z for z, _ in checks], "alpha_agrees": [agrees for _, agrees in checks],
            "accepted_of_proposed": [k / n if n else None
                                     for k, n in zip(num_passed, num_proposed)],
            "accepted_of_proposed_expected": [float(e) if n else None for e, n in
                                              zip(expected_of_proposed, num_proposed)]}


def accepted_length_distribution(stats: SpeculationStats, num_drafts: int) -> dict:
    """Over verifications (steps with drafts): how many accepted k = 0..G drafts, realised
    counts and expected counts. A verification accepts at least k drafts with probability
    q_k = p_1 ... p_k (q_0 = 1), so exactly k with q_k - q_{k+1}; p is 0 past its drafts."""
    verifying = stats.drafted > 0
    counts = torch.bincount(stats.accepted[verifying], minlength=num_drafts + 1)
    probs = _fit(stats.accept_probs.double(), num_drafts)[verifying]          # [V, G]
    at_least = torch.cat([torch.ones(len(probs), 1, dtype=torch.float64), probs.cumprod(dim=1),
                          torch.zeros(len(probs), 1, dtype=torch.float64)], dim=1)
    expected = (at_least[:, :-1] - at_least[:, 1:]).sum(dim=0)
    return {"counts": counts[:num_drafts + 1].tolist(), "expected": expected.tolist()}


def acceptance_summary(stats: SpeculationStats, num_drafts: int) -> dict:
    """Everything the report says about one configuration's `stats` (G = `num_drafts`)."""
    verifying = stats.drafted > 0
    verifications = int(verifying.sum())
    realised = int(stats.accepted.sum())
    mean, std = stats.expected_accepted()
    z, agrees = agreement(realised, float(mean), float(std))
    per_verification = max(verifications, 1)
    return {
        "forwards": int((stats.emitted > 0).sum()),
        "verifications": verifications,
        "drafted": int(stats.drafted.sum()),
        "accepted": realised,
        "acceptance_rate": _number(stats.acceptance_rate),
        "accepted_per_verification": realised / per_verification,
        "tokens_per_verification": int(stats.emitted[verifying].sum()) / per_verification,
        "tokens_per_forward": stats.mean_accepted_length,
        "expected_accepted": {"realised": realised, "mean": float(mean), "std": float(std),
                              "z": z, "agrees": agrees},
        "positions": position_statistics(stats, num_drafts),
        "accepted_length": accepted_length_distribution(stats, num_drafts),
    }
