"""Argument checks of `flashspec.sampling`, the door to the torch reference and the Triton
kernels.

It validates here first, so bad input fails with a message naming the parameter, its value
and what is allowed, never deep inside a kernel.
"""

from __future__ import annotations

import torch

from . import rng
from .params import SamplingParams

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class NonFiniteLogitsError(ValueError):
    """Raised when logits are NaN or infinite for some rows; `rows` lists them."""

    def __init__(self, rows: list[int], source: str = "the model"):
        self.rows = rows
        super().__init__(
            f"logits of {source} are NaN or infinite for batch rows {rows}: check the hidden "
            "states and LM-head weight (or a temperature so small that logits / temperature "
            "overflows); these rows were not sampled"
        )


def check_lm_head(hidden: torch.Tensor, weight: torch.Tensor, hidden_dims: int) -> None:
    """`hidden` is ``[B, D]`` (or ``[B, G+1, D]`` when hidden_dims == 3), `weight` ``[V, D]``."""
    for name, tensor in (("hidden", hidden), ("weight", weight)):
        if not torch.is_tensor(tensor):
            raise ValueError(f"`{name}` must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"`{name}` has dtype {tensor.dtype}; allowed: float16, bfloat16, float32, float64"
            )
    shape = "[B, G+1, D]" if hidden_dims == 3 else "[B, D]"
    if hidden.dim() != hidden_dims:
        raise ValueError(f"`hidden` must have shape {shape}, got {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"`weight` must have shape [V, D], got {tuple(weight.shape)}")
    if hidden.shape[0] == 0:
        raise ValueError("`hidden` has an empty batch (B=0); pass at least one row")
    if weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(f"`weight` must be non-empty [V, D], got {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: `hidden` has D={hidden.shape[-1]} but `weight` has "
            f"D={weight.shape[1]} (weight must be [V, D], e.g. lm_head.weight)"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"`hidden` is {hidden.dtype} but `weight` is {weight.dtype}; cast one to match"
        )
    if hidden.device != weight.device:
        raise ValueError(f"`hidden` is on {hidden.device} but `weight` is on {weight.device}")
    if not weight.is_contiguous():
        raise ValueError(
            f"`weight` must be contiguous (got strides {weight.stride()}); pass weight.contiguous()"
        )


def check_sampling_inputs(hidden: torch.Tensor, params: SamplingParams,
                          positions: torch.Tensor, num_positions: int = 1,
                          check_values: bool = True) -> None:
    """`params` and `positions` match `hidden`'s batch and device; positions leave room for
    `num_positions` consecutive sequence indices (a device read: skipped when
    `check_values` is False, as in CUDA-graph capture)."""
    batch_size = hidden.shape[0]
    if not isinstance(params, SamplingParams):
        raise ValueError(f"`params` must be a flashspec.SamplingParams, got {type(params).__name__}")
    if params.batch_size != batch_size:
        raise ValueError(f"`params` has {params.batch_size} rows but `hidden` has {batch_size}")
    if params.device != hidden.device:
        raise ValueError(f"`params` is on {params.device} but `hidden` is on {hidden.device}")
    if not torch.is_tensor(positions) or positions.dtype != torch.int64:
        kind = positions.dtype if torch.is_tensor(positions) else type(positions).__name__
        raise ValueError(f"`positions` must be an int64 tensor of shape [B], got {kind}")
    if positions.shape != (batch_size,):
        raise ValueError(
            f"`positions` must have shape [{batch_size}], got {tuple(positions.shape)}"
        )
    if positions.device != hidden.device:
        raise ValueError(f"`positions` is on {positions.device} but `hidden` is on {hidden.device}")
    last = rng.MAX_POSITION - (num_positions - 1)
    if check_values and bool(((positions < 0) | (positions > last)).any()):
        raise ValueError(
            f"`positions` must lie in [0, {last}], got values in "
            f"[{int(positions.min())}, {int(positions.max())}]"
        )


def check_draft_tokens(draft_tokens: torch.Tensor, hidden: torch.Tensor, vocab_size: int,
                       check_values: bool = True) -> None:
    """`draft_tokens` is int64 ``[B, G]`` with ids in [0, V) or -1 (padding), G+1 = hidden.shape[1]
    (the ids are a device read: skipped when `check_values` is False)."""
    if not torch.is_tensor(draft_tokens) or draft_tokens.dtype != torch.int64:
        kind = draft_tokens.dtype if torch.is_tensor(draft_tokens) else type(draft_tokens).__name__
        raise ValueError(f"`draft_tokens` must be an int64 tensor of shape [B, G], got {kind}")
    batch_size, num_positions = hidden.shape[0], hidden.shape[1]
    if draft_tokens.shape != (batch_size, num_positions - 1):
        raise ValueError(
            f"`draft_tokens` must have shape [B, G] = [{batch_size}, {num_positions - 1}] for "
            f"`hidden` of shape {tuple(hidden.shape)} (G drafts need G+1 hidden states), got "
            f"{tuple(draft_tokens.shape)}"
        )
    if draft_tokens.device != hidden.device:
        raise ValueError(
            f"`draft_tokens` is on {draft_tokens.device} but `hidden` is on {hidden.device}"
        )
    if check_values and draft_tokens.numel() and bool(((draft_tokens < -1) | (draft_tokens >= vocab_size)).any()):
        raise ValueError(
            f"`draft_tokens` must be token ids in [0, {vocab_size}) or -1 for padding, got values "
            f"in [{int(draft_tokens.min())}, {int(draft_tokens.max())}]"
        )
