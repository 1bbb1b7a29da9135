"""The statistical kit itself: goodness of fit and the near-tie detector."""

import torch

from flashspec.bench.statistics import goodness_of_fit, is_near_tie


def test_goodness_of_fit_accepts_truth_and_rejects_a_shifted_distribution():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(50, generator=g, dtype=torch.float64), -1)
    samples = torch.multinomial(probs, 20_000, replacement=True, generator=g)
    assert goodness_of_fit(samples, probs).passed()
    shifted = probs.clone()
    shifted[0], shifted[1] = probs[1], probs[0]
    if abs(float(probs[0] - probs[1])) > 0.01:
        assert not goodness_of_fit(samples, shifted).passed()
    zero_mass = probs.clone()
    zero_mass[int(samples[0])] = 0
    zero_mass /= zero_mass.sum()
    assert goodness_of_fit(samples, zero_mass).outside_support > 0


def test_near_tie_detector():
    logits = torch.tensor([1.0, 3.0, 3.0 + 1e-7, -2.0], dtype=torch.float64)
    noise = torch.zeros(4, dtype=torch.float64)
    # greedy: 1 and 2 are within rounding, 0 is far
    assert is_near_tie(logits, False, 1.0, 0, 1.0, 0.0, noise, 1, 2)
    assert not is_near_tie(logits, False, 1.0, 0, 1.0, 0.0, noise, 0, 2)
    # sampled: perturbed scores decide
    noise = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    assert is_near_tie(logits, True, 1.0, 0, 1.0, 0.0, noise, 1, 2)
    assert not is_near_tie(logits, True, 1.0, 0, 1.0, 0.0, noise, 0, 1)
    # top-k=2 boundary: tokens 0 and 3 tie for second place within rounding. With token 0
    # kept it wins (2 + 4 > 5); without it token 1 wins: both readings are defensible.
    logits = torch.tensor([2.0, 5.0, -1.0, 2.0 + 1e-8], dtype=torch.float64)
    noise = torch.tensor([4.0, 0.0, 0.0, 0.5], dtype=torch.float64)
    assert is_near_tie(logits, True, 1.0, 2, 1.0, 0.0, noise, 0, 1)
    assert not is_near_tie(logits, True, 1.0, 2, 1.0, 0.0, noise, 0, 3)  # 3 never wins
    assert not is_near_tie(logits, True, 1.0, 2, 1.0, 0.0, noise, 0, 2)  # 2 is far outside
