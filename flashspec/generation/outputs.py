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
    def empty(cls, num_rows: int, device) -> "SpeculationStats":
        zeros = lambda: torch.zeros(0, num_rows, dtype=torch.long, device=device)  # noqa: E731
        return cls(zeros(), zeros(), zeros())

    def record(self, rows: torch.Tensor, drafted: torch.Tensor, accepted: torch.Tensor,
               emitted: torch.Tensor) -> None:
        step = torch.zeros(3, 1, self.drafted.shape[1], dtype=torch.long, device=rows.device)
        step[:, 0, rows] = torch.stack([drafted, accepted, emitted]).long()
        self.drafted, self.accepted, self.emitted = (
            torch.cat([old, new]) for old, new in zip((self.drafted, self.accepted, self.emitted), step))

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
    """

    logprobs: torch.Tensor | None = None
    flash_stats: SpeculationStats | None = None
