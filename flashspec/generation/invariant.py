"""Decoder forwards whose every row is bitwise independent of the call's shape.

`invariant_forward(decoder)` runs a transformers decoder with the kernels of
`flashspec.kernels.invariant` in place of the operations whose summation order depends on
the shape of the call: its linear layers (``F.linear``, and ``torch.addmm`` as GPT-2's
Conv1D uses it), its means over the last dimension (RMSNorm), ``F.layer_norm`` and
``F.rms_norm``; its attention is `flashspec.generation.attention`'s, by sequence position
through the cache's ``key_index``. Everything else a decoder does is elementwise or a
gather, which no call shape changes. The operations are swapped by a `TorchFunctionMode`, which torch.compile
traces through, so the compiled layers and the eager prefill use the same kernels.

Seeded sampling then gives the same tokens with or without drafts (a verification forward
over k+1 tokens computes each position's hidden state as the one-token forward would) and
alone or in any batch. `generate(sampler="flash", invariant=True)` asks for it
(`check_supported` refuses a decoder these kernels cannot run); it costs about 10% of a
decode step (BENCHMARKS.md), so it is off by default.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..kernels import invariant as kernels
from .attention import by_position, unsupported_reason


@torch.library.custom_op("flashspec::invariant_linear", mutates_args=())
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return kernels.linear(x, weight, bias)


@_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("flashspec::invariant_row_mean", mutates_args=())
def _row_mean(x: torch.Tensor, keepdim: bool) -> torch.Tensor:
    return kernels.row_mean(x, keepdim)


@_row_mean.register_fake
def _(x, keepdim):
    return x.new_empty(*x.shape[:-1], *((1,) if keepdim else ()))


def _last_dim_mean(args, kwargs) -> tuple[torch.Tensor, bool] | None:
    """(input, keepdim) if this ``mean`` call averages the last dimension only, else None."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if (not isinstance(x, torch.Tensor) or not isinstance(dim, int) or x.dim() == 0
            or dim % x.dim() != x.dim() - 1 or kwargs.get("dtype") is not None
            or not x.is_floating_point()):
        return None
    return x, bool(keepdim)


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    if len(normalized_shape) != 1:
        return None
    dtype = x.dtype
    x = x.float()
    centered = x - _row_mean(x, True)
    out = centered * torch.rsqrt(_row_mean(centered * centered, True) + eps)
    if weight is not None:
        out = out * weight.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


def _rms_norm(x, normalized_shape, weight=None, eps=None):
    if len(normalized_shape) != 1:
        return None
    dtype = x.dtype
    x = x.float()
    eps = torch.finfo(dtype).eps if eps is None else eps
    out = x * torch.rsqrt(_row_mean(x * x, True) + eps)
    if weight is not None:
        out = out * weight.float()
    return out.to(dtype)


class InvariantOps(TorchFunctionMode):
    """Routes the shape-dependent reductions of a decoder to the invariant kernels."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return _linear(x, weight, bias)
        if func is torch.addmm and len(args) == 3 and not kwargs and args[1].dim() == 2:
            bias, x, weight = args
            if bias.dim() == 1:
                return _linear(x, weight.T, bias)
        if func in (torch.mean, torch.Tensor.mean):
            found = _last_dim_mean(args, kwargs)
            if found is not None:
                return _row_mean(*found)
        if func is F.layer_norm:
            out = _layer_norm(*args, **kwargs)
            if out is not None:
                return out
        if func is F.rms_norm:
            out = _rms_norm(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def invariant_forward(decoder: torch.nn.Module):
    """Run `decoder` (called inside) with the invariant kernels and the attention by position
    (`flashspec.generation.attention`); the caller passes ``key_index``."""
    with by_position(decoder), InvariantOps():
        yield


def check_device(model: torch.nn.Module) -> None:
    """ValueError naming `invariant` when `model` (its LM head, which sits on the GPU of a
    model spread over devices) is where the invariant kernels cannot run: they are
    Triton's, which runs CUDA tensors, or any under its interpreter (TRITON_INTERPRET=1:
    tests; far too slow for use). Checked before anything runs."""
    try:
        import triton
        interpreted = triton.knobs.runtime.interpret
    except ImportError:           # no Triton (macOS, Windows): nothing runs the kernels
        interpreted = False
    head = model.get_output_embeddings()
    device = (head.weight if head is not None else next(model.parameters())).device
    if device.type != "cuda" and not interpreted:
        raise ValueError(
            f"`invariant`=True is not supported for a model on {device}: its batch-invariant "
            "decoder kernels are Triton kernels, which need a CUDA GPU (or Triton's "
            "interpreter, TRITON_INTERPRET=1, meant for tests); drop `invariant` (seeded "
            "tokens may then differ with drafts or batch where the float rounding of two "
            "tokens' logits ties them)")


def check_supported(decoders) -> None:
    """ValueError naming `invariant` if one of `decoders` cannot run the invariant kernels."""
    for decoder in decoders:
        reason = unsupported_reason(decoder)   # its attention cannot run by position
        if reason is not None:
            raise ValueError(f"`invariant`=True is not supported for {type(decoder).__name__}: "
                             f"{reason}, which flashspec's attention by position does not "
                             "serve; drop `invariant` (seeded tokens may then differ with "
                             "drafts or batch)")
