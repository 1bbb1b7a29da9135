"""The LM-head operations of the static engine, without host reads.

Both classes answer the same three questions from final hidden states and report
problems per row instead of raising, so that a step can be captured in a CUDA graph:

* ``argmax(hidden [B, D]) -> tokens [B]`` (-1 where the logits are not finite);
* ``sample(hidden [B, D], positions [B]) -> (tokens, logprobs, status)``;
* ``verify(hidden [B, G+1, D], drafts [B, G], positions [B]) -> (num_accepted [B],
  tokens [B, G+1], logprobs [B, G+1], accept_probs [B, G], status [B])``.

status is int32 ``[B]``: 0 ok, `NEEDS_COMPLETION` (a truncated support did not fit the
fused kernel's candidate budget: redo the row with `complete_sample` / `complete_verify`),
`NON_FINITE` (NaN or inf logits).

`FusedSampler` runs the Triton kernels (the logits never exist). `MaterializedSampler`
computes the ``[B, V]`` logits and samples them with the torch reference's arithmetic:
on CPU with `flashspec.reference.compute_logits` it *is* the reference; on CUDA with the
model-dtype matmul it is the baseline a stock stack would run, kept to compare against.
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import reference
from ..params import SamplingParams

NEEDS_COMPLETION, NON_FINITE = 1, 2


def model_dtype_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits the way transformers computes them: a matmul in the weight's dtype, then
    float32."""
    return torch.nn.functional.linear(hidden, weight).float()


class MaterializedSampler:
    def __init__(self, weight: torch.Tensor, params: SamplingParams,
                 logits: Callable = reference.compute_logits):
        self.weight = weight
        self.params = params
        self.logits = logits

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.logits(hidden, self.weight)
        return torch.where(torch.isfinite(logits).all(dim=-1), logits.argmax(dim=-1),
                           reference.INVALID_TOKEN)

    def sample(self, hidden: torch.Tensor, positions: torch.Tensor):
        tokens, logprobs, _ = reference.sample_logits(self.logits(hidden, self.weight),
                                                      self.params, positions)
        return tokens, logprobs, _status(tokens < 0)

    def verify(self, hidden: torch.Tensor, drafts: torch.Tensor, positions: torch.Tensor):
        logits = self.logits(hidden.reshape(-1, hidden.shape[-1]), self.weight)
        out = reference.verify_logits(logits, drafts, self.params, positions)
        return (out.num_accepted, out.tokens, out.logprobs, out.accept_probs,
                _status(out.num_accepted < 0))


class FusedSampler:
    def __init__(self, weight: torch.Tensor, params: SamplingParams):
        self.weight = weight
        self.params = params

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        from ..kernels import argmax_unchecked
        return argmax_unchecked(hidden, self.weight)

    def sample(self, hidden: torch.Tensor, positions: torch.Tensor):
        from ..kernels import sample_unchecked
        out = sample_unchecked(hidden, self.weight, self.params, positions, want_lse=True)
        return out.tokens, out.logprobs, out.status

    def verify(self, hidden: torch.Tensor, drafts: torch.Tensor, positions: torch.Tensor):
        from ..kernels import verify_unchecked
        out = verify_unchecked(hidden, self.weight, drafts, self.params, positions)
        return out.num_accepted, out.tokens, out.logprobs, out.accept_probs, out.status


def complete_sample(sampler, hidden: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor):
    """Exact `sample` of the given rows by the reference (eager): used for rows a fused step
    flagged `NEEDS_COMPLETION`, which are finite (non-finite rows are flagged `NON_FINITE`),
    as the checked kernel entry points complete them."""
    tokens, logprobs = reference.lm_head_sample(
        hidden[rows], sampler.weight, sampler.params.select(rows, validate=False),
        positions[rows], return_logprobs=True, check_finite=False)
    return tokens, logprobs.float()


def complete_verify(sampler, hidden: torch.Tensor, drafts: torch.Tensor, rows: torch.Tensor,
                    positions: torch.Tensor):
    """Exact `verify` of the given rows by the reference (eager), as `complete_sample`."""
    out = reference.lm_head_verify(hidden[rows], sampler.weight, drafts[rows],
                                   sampler.params.select(rows, validate=False), positions[rows],
                                   check_finite=False)
    return out.num_accepted, out.tokens, out.logprobs.float(), out.accept_probs


def _status(non_finite: torch.Tensor) -> torch.Tensor:
    return torch.where(non_finite, NON_FINITE, 0).to(torch.int32)
