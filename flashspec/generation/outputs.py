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
    A step without drafts (plain decoding) has drafted = accepted = 0, emitted = 1."""

    drafted: torch.Tensor
    accepted: torch.Tensor
    emitted: torch.Tensor

    @classmethod
    def from_steps(cls, steps: list, num_rows: int) -> "SpeculationStats":
        """From one ``(rows, drafted, accepted, emitted)`` tuple per step, where ``rows``
        are the output rows still running and the other three their values."""
        table = torch.zeros(3, len(steps), num_rows, dtype=torch.long)
        for step, (rows, *values) in enumerate(steps):
            table[:, step, rows.cpu()] = torch.stack(values).long().cpu()
        return cls(*table)

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

    def summary(self) -> dict:
        return {"steps": self.num_steps, "drafted": int(self.drafted.sum()),
                "accepted": int(self.accepted.sum()), "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length,
                "per_position_acceptance": [round(float(x), 4) for x in self.per_position_acceptance]}


@dataclasses.dataclass
class FlashGenerateOutput(GenerateDecoderOnlyOutput):
    """transformers' `GenerateDecoderOnlyOutput` (``sequences``; ``scores`` and ``logits`` stay
    None: flashspec never materializes them) plus:

    Attributes:
        logprobs: float32 ``[B, new_tokens]`` with ``output_logprobs=True``: log-probability
            of each generated token under its row's transformed distribution (temperature,
            top-k, top-p, min-p applied; the raw softmax for greedy rows); 0 after the row's end.
        flash_stats: `SpeculationStats` of the run.

    ``past_key_values`` is None: flashspec's caches are laid out for its own loop (rows
    realigned as they advance unevenly) and are not returned.
    """

    logprobs: torch.Tensor | None = None
    flash_stats: SpeculationStats | None = None
