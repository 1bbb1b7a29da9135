"""The decode steps' attention: each query reads its keys by sequence position through the
cache's ``key_index`` (`flashspec.kernels.attention`), with no mask tensor to build.

transformers' models look their attention function up in `AttentionInterface` by
``config._attn_implementation``; `by_position(decoder)` sets it to ``"flashspec_positions"``
for the forwards run inside, whose caller passes the cache's ``key_index`` (the model hands
its keyword arguments on to the attention function, with the queries' ``position_ids``).
The mask functions do not know the name, so transformers builds no mask either.

The engine's captured steps (CUDA) run this attention; the prefill, whose queries are the
whole prompt, keeps the model's own (sdpa or eager) with the cache's mask. The invariant
forward (`flashspec.generation.invariant`) runs it in every forward: a query's result
depends only on its own keys and position.

Models that compute attention in their own code (Bloom, Falcon, GPT-J, GPT-Neo...), whose
attention has sinks, or whose mask is made from the keys' values (Doge) are not served
(`unsupported_reason`): their steps keep the mask path.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from transformers import AttentionInterface

from ..kernels import attention as kernel

NAME = "flashspec_positions"


@torch.library.custom_op("flashspec::position_attention", mutates_args=())
def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               key_index: torch.Tensor, positions: torch.Tensor, scaling: float, window: int,
               softcap: float) -> torch.Tensor:
    return kernel.attention(query, key, value, key_index, positions, scaling, window,
                            softcap if softcap > 0 else None)


@_attention.register_fake
def _(query, key, value, key_index, positions, scaling, window, softcap):
    B, H, T, D = query.shape
    return query.new_empty(B, T, H, D)


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      sliding_window=None, softcap=None, key_index=None, position_ids=None,
                      query_positions=None, **kwargs):
    """transformers' attention interface: causal attention by position (the mask is not
    read; the cache's ``key_index`` and the queries' cache positions say the same). The
    engine passes those as ``query_positions``: the model's ``position_ids`` (its rotary
    positions) may differ from them (a right-padded row's new tokens, as stock feeds them)."""
    if query_positions is not None:
        position_ids = query_positions
    if key_index is None or position_ids is None:
        raise ValueError(
            f"{type(module).__name__} did not pass `key_index` and `position_ids` to its "
            "attention function; flashspec's attention by position supports models whose "
            "attention passes its keyword arguments on (transformers' own models)")
    if getattr(module, "sinks", None) is not None or dropout:
        raise ValueError(f"{type(module).__name__}'s attention uses sinks or dropout, which "
                         "flashspec's attention by position does not implement")
    scaling = module.head_dim ** -0.5 if scaling is None else scaling
    return _attention(query, key, value, key_index, position_ids, float(scaling),
                      int(sliding_window or 0), float(softcap or 0.0)), None


AttentionInterface.register(NAME, attention_forward)


@contextlib.contextmanager
def by_position(decoder: torch.nn.Module):
    """Run `decoder` (called inside) with the attention by position; the caller passes the
    cache's ``key_index`` and no mask."""
    config = decoder.config
    previous = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous


def unsupported_reason(decoder: torch.nn.Module) -> str | None:
    """Why `decoder`'s attention cannot be run by position, or None."""
    if not uses_attention_interface(decoder):
        return ("its attention is computed by the model's own code (as Bloom's, Falcon's, "
                "MPT's, GPT-J's is) rather than through transformers' attention interface")
    if any(getattr(module, "sinks", None) is not None for module in decoder.modules()):
        return "its attention has sinks"
    if any(hasattr(module, "prepare_dynamic_mask") for module in decoder.modules()):
        return ("its attention mask is made from the keys' values (Doge's dynamic mask: a "
                "bias per key, and its top `keep_window_size` keys), which the attention by "
                "position does not read")
    return None


def uses_attention_interface(decoder: torch.nn.Module) -> bool:
    """Whether one of the modeling files of `decoder`'s modules looks its attention up in
    transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``). Those that do not
    (transformers 5.17's Bloom, Falcon, MPT, GPT-J, GPT-Neo, CodeGen, XGLM...) compute
    attention themselves, with the mask this attention does not build."""
    names = {type(module).__module__ for module in decoder.modules()}
    return any("ALL_ATTENTION_FUNCTIONS" in vars(sys.modules[name])
               for name in names if name in sys.modules)
