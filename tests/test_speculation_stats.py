"""`SpeculationStats`' expected acceptance from p(x), against enumeration and against runs."""

import itertools

import pytest
import torch

from flashspec.generation.outputs import SpeculationStats
from flashspec.bench.statistics import acceptance_check

from _models import PAD, tiny_model


def _stats(drafted, accepted, accept_probs) -> SpeculationStats:
    drafted, accepted = torch.tensor(drafted), torch.tensor(accepted)
    return SpeculationStats(drafted, accepted, accepted + 1,
                            torch.tensor(accept_probs, dtype=torch.float64))


def test_expected_accepted_equals_enumeration():
    """Two steps of one row: mean and variance of the accepted count by enumerating every
    accept/reject path (draft i accepted with p_i once the ones before it were)."""
    probs = [[0.9, 0.5, 0.2], [0.3, 0.7, 0.0]]
    drafted = [[3], [2]]
    stats = _stats(drafted, [[0], [0]], [[p] for p in probs])
    mean, variance = 0.0, 0.0
    for p in probs:
        outcome = {}
        for accepts in itertools.product([True, False], repeat=3):
            chance, count, alive = 1.0, 0, True
            for i, accepted in enumerate(accepts):
                if not alive:
                    chance *= 0.5        # unreached positions: both branches, half each
                    continue
                chance *= p[i] if accepted else 1.0 - p[i]
                alive = accepted
                count += accepted
            outcome[count] = outcome.get(count, 0.0) + chance
        step_mean = sum(k * c for k, c in outcome.items())
        mean += step_mean
        variance += sum(k * k * c for k, c in outcome.items()) - step_mean ** 2
    expected, std = stats.expected_accepted()
    assert expected == pytest.approx(mean) and expected == pytest.approx(0.9 + 0.45 + 0.09 + 0.3 + 0.21)
    assert std == pytest.approx(variance ** 0.5)


def test_expected_per_position_acceptance_averages_over_proposing_steps():
    # Row 0: 3 drafts, 1 accepted; row 1: 2 drafts, both accepted. Expected at position i:
    # mean over the rows that proposed it of p_1 ... p_i.
    stats = _stats([[3, 2]], [[1, 2]], [[[0.8, 0.4, 0.9], [0.6, 0.5, 0.0]]])
    assert stats.per_position_acceptance.tolist() == [1.0, 0.5, 0.0]
    torch.testing.assert_close(stats.expected_per_position_acceptance,
                               torch.tensor([(0.8 + 0.6) / 2, (0.32 + 0.3) / 2, 0.288],
                                            dtype=torch.float64))


def test_plain_decoding_has_no_draft_probabilities():
    ids = torch.tensor([[5, 6, 7]])
    out = tiny_model("llama").generate(ids, sampler="flash", max_new_tokens=4, pad_token_id=PAD,
                                        return_dict_in_generate=True)
    assert out.flash_stats.accept_probs.shape == (4, 1, 0)
    assert out.flash_stats.expected_accepted() == (0.0, 0.0)


def test_greedy_acceptance_is_exactly_as_expected():
    """Greedy: p(x) is 1 (draft == argmax) or 0, so the expectation is the realised count."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    out = tiny_model("llama").generate(ids, sampler="flash", max_new_tokens=16,
                                        prompt_lookup_num_tokens=3, pad_token_id=PAD,
                                        return_dict_in_generate=True)
    stats = out.flash_stats
    assert 0 < int(stats.accepted.sum()) < int(stats.drafted.sum())
    assert ((stats.accept_probs == 0) | (stats.accept_probs == 1)).all()
    check = acceptance_check(stats)
    assert check.std == 0.0 and check.expected == check.realised == int(stats.accepted.sum())
    assert torch.equal(stats.expected_per_position_acceptance, stats.per_position_acceptance)
