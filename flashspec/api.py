"""Top-level entry points: fused Triton kernels for CUDA tensors, the torch reference for
CPU (and float64) tensors. Same signatures and results either way."""

from __future__ import annotations

import torch

from . import reference
from .params import SamplingParams


def _fused(hidden: torch.Tensor) -> bool:
    return hidden.is_cuda and hidden.dtype != torch.float64


def lm_head_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Greedy token per row of ``hidden[B, D] @ weight[V, D].T``; see `reference.lm_head_argmax`."""
    if _fused(hidden):
        from .kernels import lm_head_argmax as fused
        return fused(hidden, weight)
    return reference.lm_head_argmax(hidden, weight)


def lm_head_sample(hidden: torch.Tensor, weight: torch.Tensor, params: SamplingParams,
                   positions: torch.Tensor, return_logprobs: bool = False, **kwargs):
    """One token per row from softmax of the transformed logits; see
    `reference.lm_head_sample` for the arguments (`return_lse`, `check_finite`)."""
    if _fused(hidden):
        from .kernels import lm_head_sample as fused
        return fused(hidden, weight, params, positions, return_logprobs, **kwargs)
    return reference.lm_head_sample(hidden, weight, params, positions, return_logprobs, **kwargs)


def lm_head_verify(hidden: torch.Tensor, weight: torch.Tensor, draft_tokens: torch.Tensor,
                   params: SamplingParams, positions: torch.Tensor, **kwargs) -> reference.VerifyOutput:
    """Verify G drafted tokens per row in one pass over the LM head; see
    `reference.lm_head_verify` for the arguments (`acceptance`, `check_finite`)."""
    if _fused(hidden):
        from .kernels import lm_head_verify as fused
        return fused(hidden, weight, draft_tokens, params, positions, **kwargs)
    return reference.lm_head_verify(hidden, weight, draft_tokens, params, positions, **kwargs)
