"""What `generate(..., sampler="flash", return_dict_in_generate=True)` returns."""

from __future__ import annotations

import dataclasses

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput


@dataclasses.dataclass
class SpeculationStats:
    """Per verification step s and output row b (int64 ``[steps, B]``, 0 where the row had
    already finished): drafts proposed, drafts accepted by the target, tokens emitted
    (accepted drafts plus the target's own token, cut at EOS, stop string or budget).
    A step without drafts (plain decoding) has drafted = accepted = 0, emitted = 1.

    ``accept_probs`` (float64 ``[steps, B, G]``, G the most drafts of any step): the
    probability that each proposed draft is accepted given the drafts before it, p(x)
    under the target's transformed distribution (1 or 0 for greedy rows: draft ==
    argmax), 0 where no draft was proposed. Under the strict rule a draft reached is
    accepted with exactly this probability, so the realised acceptance can be checked
    against it (`expected_per_position_acceptance`, `expected_accepted`)."""

    drafted: torch.Tensor
    accepted: torch.Tensor
    emitted: torch.Tensor
    accept_probs: torch.Tensor

    @classmethod
    def from_steps(cls, steps: list, num_rows: int) -> "SpeculationStats":
        """From one ``(rows, drafted, accepted, emitted, accept_probs)`` tuple per step,
        where ``rows`` are the output rows still running and the others their values
        (``accept_probs`` ``[rows, G_step]``)."""
        table = torch.zeros(3, len(steps), num_rows, dtype=torch.long)
        for step, (rows, drafted, accepted, emitted, _) in enumerate(steps):
            table[:, step, rows.cpu()] = torch.stack([drafted, accepted, emitted]).long().cpu()
        width = int(table[0].max()) if len(steps) else 0
        accept_probs = torch.zeros(len(steps), num_rows, width, dtype=torch.float64)
        for step, (rows, *_, probs) in enumerate(steps):
            probs = probs[:, :width].double().cpu()
            accept_probs[step, rows.cpu(), : probs.shape[1]] = probs
        return cls(*table, accept_probs)

    @property
    def num_steps(self) -> int:
        """Target forwards (one per step)."""
        return self.drafted.shape[0]

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (nan without drafts)."""
        return float(self.accepted.sum()) / float(self.drafted.sum()) if self.drafted.sum() else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward of a row (1.0 for plain decoding)."""
        active = self.emitted > 0
        return float(self.emitted.sum()) / max(int(active.sum()), 1)

    @property
    def per_position_acceptance(self) -> torch.Tensor:
        """float64 ``[G]``: among steps that proposed a draft at position i, the fraction
        where it was accepted (which requires the drafts before it to be accepted)."""
        width = int(self.drafted.max()) if self.drafted.numel() else 0
        positions = torch.arange(width, device=self.drafted.device)
        proposed = (self.drafted[..., None] > positions).sum(dim=(0, 1)).double()
        accepted = (self.accepted[..., None] > positions).sum(dim=(0, 1)).double()
        return accepted / proposed.clamp_min(1)

    @property
    def expected_per_position_acceptance(self) -> torch.Tensor:
        """float64 ``[G]``: over the steps that proposed draft i, the mean chance that drafts
        1..i were all accepted (p_1 ... p_i): what `per_position_acceptance` is in
        expectation under the strict rule."""
        width = self.per_position_acceptance.shape[0]
        positions = torch.arange(width)
        proposed = (self.drafted[..., None] > positions).sum(dim=(0, 1)).double()
        chance_all = self.accept_probs[..., :width].cumprod(dim=-1)
        return chance_all.sum(dim=(0, 1)) / proposed.clamp_min(1)

    def expected_accepted(self) -> tuple[float, float]:
        """(mean, standard deviation) of the total accepted drafts given the accept
        probabilities. Per step and row, with q_i = p_1 ... p_i the chance that the
        first i drafts are all accepted, A = accepted drafts has E[A] = sum_i q_i and
        E[A^2] = sum_i (2i - 1) q_i; steps are independent given their p's (fresh
        noise per position), so the variances add. Compare with ``accepted.sum()``."""
        chance_all = self.accept_probs.cumprod(dim=-1)
        odd = 2.0 * torch.arange(1, chance_all.shape[-1] + 1, dtype=torch.float64) - 1.0
        mean = chance_all.sum(dim=-1)
        variance = (chance_all * odd).sum(dim=-1) - mean ** 2
        return float(mean.sum()), float(variance.clamp_min(0).sum().sqrt())

    def summary(self) -> dict:
        expected, std = self.expected_accepted()
        return {"steps": self.num_steps, "drafted": int(self.drafted.sum()),
                "accepted": int(self.accepted.sum()), "acceptance_rate": self.acceptance_rate,
                "expected_accepted": expected, "expected_accepted_std": std,
                "mean_accepted_length": self.mean_accepted_length,
                "per_position_acceptance": [round(float(x), 4) for x in self.per_position_acceptance],
                "expected_per_position_acceptance":
                    [round(float(x), 4) for x in self.expected_per_position_acceptance]}


@dataclasses.dataclass
class Generated:
    """What the engine produced for a call: ``tokens[b, :count[b]]`` are row b's new tokens
    (the rest is padding), ``logprobs`` the same shape (or None), the statistics, and
    where the call hands back or updates `past_key_values`, the target's keys and values
    per layer as stock's cache holds them (`Slot.returned_kv`)."""

    tokens: torch.Tensor
    count: torch.Tensor
    logprobs: torch.Tensor | None
    stats: SpeculationStats
    kv: list | None = None


@dataclasses.dataclass
class FlashGenerateOutput(GenerateDecoderOnlyOutput):
    """transformers' `GenerateDecoderOnlyOutput`: ``sequences``; ``scores`` and ``logits``
    with `output_scores` / `output_logits` (one ``[B, V]`` tensor per new token, formed on
    the materialized path; NaN for a row after its end), else None; ``attentions`` and
    ``hidden_states`` with `output_attentions` / `output_hidden_states` (per new token a
    tuple over layers, as stock lays them out: `flashspec.generation.recording`; NaN for a
    row after its end), else None; plus:

    Attributes:
        logprobs: float32 ``[B, new_tokens]`` with ``output_logprobs=True``: log-probability
            of each generated token under its row's transformed distribution (temperature,
            top-k, top-p, min-p applied; the raw softmax for greedy rows); 0 after the row's end.
        flash_stats: `SpeculationStats` of the run.

    ``past_key_values`` (with ``use_cache``, as stock's): the cache stock would return, a
    transformers `DynamicCache` (`StaticCache` with ``cache_implementation="static"``; the
    caller's own cache, updated in place, when one was passed) holding the target's keys and
    values of every column of ``sequences`` but the last, laid out as ``sequences``: pass it
    to the next call with ``sequences`` (and more ids) to continue without reading the
    prompt again (`flashspec.generation.past`).
    """

    logprobs: torch.Tensor | None = None
    flash_stats: SpeculationStats | None = None
