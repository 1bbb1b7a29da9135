"""The checks have teeth: each deliberately broken implementation below makes one of the
real checks fail. If one of these tests fails, the corresponding check has gone soft."""

import dataclasses

import pytest
import torch

from flashspec import reference, rng

import test_reference as semantics
import test_rng as noise_checks


def _fails(check, *args, **kwargs):
    with pytest.raises(AssertionError):
        check(*args, **kwargs)


def test_oracle_catches_top_p_off_by_a_hundredth(monkeypatch):
    original = reference._top_p
    monkeypatch.setattr(reference, "_top_p",
                        lambda scores, top_p: original(scores, (top_p + 0.01).clamp(max=1.0)))
    _fails(semantics.check_oracle, num_cases=200)


def test_oracle_catches_temperature_after_truncation(monkeypatch):
    # Top-k alone commutes with a positive scaling; top-p and min-p do not.
    def temperature_last(logits, params):
        unscaled = dataclasses.replace(params, temperature=torch.ones_like(params.temperature))
        scores = reference.transform_logits(logits, unscaled)
        scaled = ~params.is_greedy
        return torch.where(scaled[:, None], scores / params.temperature.float()[:, None], scores)
    _fails(semantics.check_oracle, num_cases=200, transform=temperature_last)


def test_bit_identity_catches_one_flipped_noise_bit(monkeypatch):
    original = rng.random_bits
    monkeypatch.setattr(rng, "random_bits", lambda *a, **k: original(*a, **k) ^ (1 << 7))
    _fails(noise_checks.check_triton_matches_torch)


def test_goodness_of_fit_catches_temperature_off_by_five_percent():
    def warm(hidden, weight, params, positions):
        hotter = dataclasses.replace(params, temperature=params.temperature * 1.05)
        return semantics.reference_tokens(hidden, weight, hotter, positions)
    _fails(semantics.check_truncation_gof, "temperature", sample=warm)


def test_goodness_of_fit_catches_top_k_off_by_one():
    def wider(hidden, weight, params, positions):
        return semantics.reference_tokens(hidden, weight,
                                          dataclasses.replace(params, top_k=params.top_k + 1),
                                          positions)
    _fails(semantics.check_truncation_gof, "top_k", sample=wider)


def test_invariance_catches_noise_keyed_one_position_off():
    def shifted(hidden, weight, drafts, params, positions, **kwargs):
        return semantics.reference_verify(hidden, weight, drafts, params, positions + 1, **kwargs)
    _fails(semantics.check_speculation_invariance, verify=shifted)


def test_probabilistic_check_catches_unmasked_recovery(monkeypatch):
    original = reference._choose
    monkeypatch.setattr(reference, "_choose",
                        lambda logits, scores, params, positions, exclude=None:
                        original(logits, scores, params, positions))
    _fails(semantics.check_probabilistic_acceptance)
