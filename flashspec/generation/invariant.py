"""Decoder forwards whose every row is bitwise independent of the call's shape.

`invariant_forward(decoder)` runs a transformers decoder with the kernels of
`flashspec.kernels.invariant` in place of the operations whose summation order depends on
the shape of the call: its linear layers (``F.linear``, and ``torch.addmm`` as GPT-2's
Conv1D uses it), its means over the last dimension (RMSNorm), ``F.layer_norm`` and
``F.rms_norm``, and its attention (registered in transformers' `AttentionInterface` as
``"flashspec_invariant"``; it reads keys by sequence position through the cache's
``key_index``). Everything else a decoder does is elementwise or a gather, which no call
shape changes. The operations are swapped by a `TorchFunctionMode`, which torch.compile
traces through, so the compiled layers and the eager prefill use the same kernels.

Seeded sampling then gives the same tokens with or without drafts (a verification forward
over k+1 tokens computes each position's hidden state as the one-token forward would) and
alone or in any batch. `generate(sampler="flash", invariant=True)` asks for it
(`check_supported` refuses a decoder these kernels cannot run); it costs about 10% of a
decode step (BENCHMARKS.md), so it is off by default.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface

from ..kernels import invariant as kernels

ATTENTION = "flashspec_invariant"


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


@torch.library.custom_op("flashspec::invariant_attention", mutates_args=())
def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               key_index: torch.Tensor, positions: torch.Tensor, scaling: float,
               window: int) -> torch.Tensor:
    return kernels.attention(query, key, value, key_index, positions, scaling, window)


@_attention.register_fake
def _(query, key, value, key_index, positions, scaling, window):
    B, H, T, D = query.shape
    return query.new_empty(B, T, H, D)


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


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      sliding_window=None, softcap=None, key_index=None, position_ids=None,
                      **kwargs):
    """transformers' attention interface: causal attention by position (the mask is not
    read; the cache's ``key_index`` and the queries' ``position_ids`` say the same)."""
    if key_index is None or position_ids is None:
        raise ValueError(
            f"{type(module).__name__} did not pass `key_index` and `position_ids` to its "
            "attention function; flashspec's invariant forward supports models whose "
            "attention passes its keyword arguments on (transformers' own models)")
    if softcap is not None or getattr(module, "sinks", None) is not None or dropout:
        raise ValueError(f"{type(module).__name__}'s attention uses a logit softcap, sinks or "
                         "dropout, which flashspec's invariant attention does not implement")
    scaling = module.head_dim ** -0.5 if scaling is None else scaling
    return _attention(query, key, value, key_index, position_ids, float(scaling),
                      int(sliding_window or 0)), None


AttentionInterface.register(ATTENTION, attention_forward)


@contextlib.contextmanager
def invariant_forward(decoder: torch.nn.Module):
    """Run `decoder` (called inside) with the invariant kernels: its attention implementation
    is ``"flashspec_invariant"`` meanwhile; the caller passes ``key_index``."""
    config = decoder.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        with InvariantOps():
            yield
    finally:
        config._attn_implementation = previous


def unsupported_reason(decoder: torch.nn.Module) -> str | None:
    """Why `decoder` cannot run invariantly, or None."""
    if getattr(decoder.config, "attn_logit_softcapping", None):
        return "its attention softcaps logits"
    if not uses_attention_interface(decoder):
        return ("its attention is computed by the model's own code (as Bloom's, Falcon's, "
                "MPT's, GPT-J's is) rather than through transformers' attention interface")
    return None


def uses_attention_interface(decoder: torch.nn.Module) -> bool:
    """Whether one of the modeling files of `decoder`'s modules looks its attention up in
    transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``). Those that do not
    (transformers 5.17's Bloom, Falcon, MPT, GPT-J, GPT-Neo, CodeGen, XGLM...) compute
    attention themselves, with the mask the invariant forward does not build."""
    names = {type(module).__module__ for module in decoder.modules()}
    return any("ALL_ATTENTION_FUNCTIONS" in vars(sys.modules[name])
               for name in names if name in sys.modules)


def check_supported(decoders) -> None:
    """ValueError naming `invariant` if one of `decoders` cannot run the invariant kernels."""
    for decoder in decoders:
        reason = unsupported_reason(decoder)
        if reason is not None:
            raise ValueError(f"`invariant`=True is not supported for {type(decoder).__name__}: "
                             f"{reason}, which flashspec's invariant attention does not "
                             "implement; drop `invariant` (seeded tokens may then differ with "
                             "drafts or batch)")
