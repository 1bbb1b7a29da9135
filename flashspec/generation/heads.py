"""What the engine takes from a transformers causal LM: its decoder and output head (the
LM-head weight and the transforms the model applies to its logits), or a refusal naming
what it cannot reproduce.

The fused kernels compute ``hidden @ weight.T`` and apply, in their epilogue, the transforms
a model makes after it (`flashspec.sampling`'s ``bias`` and ``softcap``); a transform is
either applied there, folded into the sampling parameters exactly, or makes the call run on
the exact materialized path (`processing`), which forms the model's own logits
(`head_logits`):

* An LM-head bias (``+ bias``) and Gemma-2/3/4's ``final_logit_softcapping``
  (``c * tanh(logits / c)``), in that order, are applied in the fused kernels' epilogue
  (`OutputHead.bias`, `OutputHead.softcap`), before the logit edits and temperature, for
  every row, greedy rows included (a softcap can tie logits that fp32 tanh rounds to
  the same value, and the model's argmax sees those ties).
* Cohere's ``logits * logit_scale`` and Granite's ``logits / logits_scaling`` are a positive
  scale s of the logits: greedy rows are unaffected and a sampled row's ``logits * s / T``
  is ``logits / (T / s)``, so the scale folds into the row temperature (fused), after a
  bias as in the model. Under a softcap it does not fold (``softcap(s l)`` is not
  ``s softcap(l)``): a head with both runs on the materialized path
  (`OutputHead.unfused_transforms` names it).
* An assistant only drafts greedily: its softcap (tanh is increasing) changes nothing there,
  and its bias is left out of its drafts, which decide the speed only (verification makes
  the output exact whatever the drafts).

Forward hooks and pre-hooks on the LM-head module run where the model runs them: the
materialized path then forms the logits by calling the module (`OutputHead.module`). Hooks
on the model itself (its `forward` is never called) and global module hooks are named by
`model_hooks`, for the caller to hand the call to stock transformers. Both are looked up on
every call (a few dictionary reads).

A tensor-parallel model (``from_pretrained(..., tp_plan="auto")`` under torchrun: a DTensor
LM-head weight split over the vocabulary, transformers' ``colwise`` / ``colwise_gather_output``)
keeps its split: `OutputHead.weight` is this rank's rows and `OutputHead.shards` their place
(`flashspec.parallel.VocabShards`); the samplers then exchange per-row summaries
(`flashspec.parallel`), and `head_logits` gathers the logits where the materialized path
needs them all. A replicated head is used whole; any other layout is refused.

A model that accelerate placed over several devices, or partly offloaded to the CPU or disk
(``device_map=...``: its layers move their inputs and load their weights in patched
forwards), runs as it is, eagerly: `OutputHead.spread` says so.

Any other transform (a model-specific multiplier, say) is caught by `check_logits`, which
runs the model's own forward on one token and compares its logits with `head_logits`, within
the rounding of the model's dtype; it runs again when the head's weight, its hooks or the
model's mode change. `check_decoder` refuses attention the engine's position-addressed KV
cache cannot serve.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist

from .. import reference
from ..parallel import VocabShards
from ..parallel.exchange import all_gather_vocab
from .kv_cache import (ATTENTION, column_alibi, forward_globals, layer_kinds,
                       takes_padding_mask)

_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class OutputHead:
    """What the engine needs from a model: its decoder (base model), the LM-head weight
    ``[V, D]``, the positive factor s the model multiplies its logits by, its LM-head bias
    ``[V]`` and softcap c (``c * tanh(logits / c)``), which the fused kernels apply, and the
    LM-head module when hooks on it must run (`hooks` names them; only the materialized
    path runs them). With `shards` (a tensor-parallel head), `weight` and `bias` are this
    rank's rows of the vocabulary. `spread`: accelerate placed the model over several devices
    (or offloaded part of it)."""

    decoder: torch.nn.Module
    weight: torch.Tensor
    logit_scale: float
    bias: torch.Tensor | None = None
    softcap: float | None = None
    module: torch.nn.Module | None = None
    hooks: tuple[str, ...] = ()
    shards: VocabShards | None = None
    spread: bool = False

    @property
    def vocab_size(self) -> int:
        return self.shards.vocab_size if self.shards is not None else self.weight.shape[0]

    def unfused_transforms(self) -> tuple[str, ...]:
        """The head's transforms that only the materialized path reproduces, as reasons for
        its warning: a softcap after a logit scale other than 1, which does not fold into
        the temperature through the tanh. (Hooks on the LM head are named by `hooks`.)"""
        if self.softcap is not None and self.logit_scale != 1.0:
            return (f"the model's final_logit_softcapping={self.softcap} after its logit "
                    f"scale {self.logit_scale:g} (a scale folds into the temperature only "
                    "without a softcap)",)
        return ()


def output_head(model, role: str, greedy_only: bool = False) -> OutputHead:
    """The `OutputHead` of `model`, or a ValueError naming what flashspec cannot reproduce.

    `role` names the model in messages ("model" or "assistant_model"); `greedy_only`: the
    model only ever drafts greedily (an assistant), so its bias and softcap are left out.
    """
    name = type(model).__name__
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"`{role}` is an encoder-decoder model ({name}); sampler='flash' supports decoder-only "
            "causal LMs; run generate() without sampler='flash'"
        )
    head = model.get_output_embeddings()
    if head is None or not torch.is_tensor(getattr(head, "weight", None)) or head.weight.dim() != 2:
        raise ValueError(
            f"`{role}` ({name}) has no linear output embedding (get_output_embeddings() returned "
            f"{type(head).__name__}); sampler='flash' needs an LM head weight [vocab, hidden]"
        )
    bias = getattr(head, "bias", None)
    softcap = getattr(config.get_text_config(decoder=True), "final_logit_softcapping", None)
    if greedy_only:
        bias = softcap = None
    if softcap is not None and not softcap > 0:
        raise ValueError(f"`{role}` ({name}) has final_logit_softcapping={softcap}; a softcap "
                         "must be positive")
    scale = 1.0
    if getattr(model, "logit_scale", None) is not None:            # Cohere: logits * s
        scale = float(model.logit_scale)
    elif getattr(config, "logits_scaling", None) is not None:        # Granite: logits / s
        scale = 1.0 / float(config.logits_scaling)
    if not scale > 0 or scale == float("inf"):
        raise ValueError(
            f"`{role}` ({name}) scales its logits by {scale}; only a finite positive scale can "
            "be folded into the temperature"
        )
    hooks = () if greedy_only else _hook_names(head, "lm_head")
    decoder = model.get_decoder()
    if decoder is model:   # transformers' lookup can miss, e.g. base_model_prefix != attribute
        decoder = getattr(model, "model", None)
    if not isinstance(decoder, torch.nn.Module) or decoder is model:
        raise ValueError(
            f"`{role}` ({name}): cannot find its decoder (the model without the LM head; "
            "get_decoder() returned the model itself); sampler='flash' needs it to skip the LM "
            "head"
        )
    if head.weight.is_meta:
        raise ValueError(f"`{role}` ({name}) has its LM head offloaded (its weight is on the meta "
                         "device: the device_map sends lm_head to disk or to a CPU that "
                         "accelerate offloads); sampler='flash' reads the LM head's weight "
                         "itself: map lm_head to a device")
    weight, bias, shards = _local_head(head.weight, bias, role, name)
    return OutputHead(decoder=decoder, weight=weight.contiguous(), logit_scale=scale,
                      bias=None if bias is None else bias.detach(),
                      softcap=None if softcap is None else float(softcap),
                      module=head if hooks else None, hooks=hooks, shards=shards,
                      spread=len(device_map_places(model)) > 1)


def device_map_places(model) -> set[str]:
    """Where accelerate placed `model`'s parts (its device_map names 0 and "cuda:0" alike):
    devices, "cpu" or "disk"; empty for a model it did not place."""
    return {str(torch.device("cuda", place) if isinstance(place, int) else place)
            for place in (getattr(model, "hf_device_map", None) or {}).values()}


def tensor_parallel_head(model) -> bool:
    """Whether `model`'s LM head is a DTensor split over ranks (not replicated), from its
    weight alone: nothing runs, nothing is refused here."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return _split(getattr(head, "weight", None))


def _split(weight) -> bool:
    """Whether `weight` is a DTensor not replicated on every rank."""
    from torch.distributed.tensor import DTensor, Replicate

    return isinstance(weight, DTensor) and not all(isinstance(p, Replicate)
                                                   for p in weight.placements)


def _local_head(weight: torch.Tensor, bias, role: str, name: str):
    """``(weight, bias, shards)``: a DTensor head as this rank's rows and their
    `VocabShards` (split over the vocabulary), or whole (replicated); plain tensors as they
    are, with no shards."""
    from torch.distributed.tensor import DTensor, Shard

    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    if not _split(weight):
        return local(weight), local(bias), None
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    if mesh.ndim != 1 or placements != (Shard(0),) or (
            bias is not None and not (isinstance(bias, DTensor)
                                      and tuple(bias.placements) == (Shard(0),))):
        raise ValueError(
            f"`{role}` ({name}) has a distributed LM head laid out as {placements} over a "
            f"{mesh.ndim}-d device mesh (its bias: "
            f"{tuple(bias.placements) if isinstance(bias, DTensor) else 'not split'}); "
            "sampler='flash' runs heads, and their biases, split over the vocabulary "
            "on a 1-d mesh (tp_plan 'colwise' / 'colwise_gather_output' for lm_head) or "
            "replicated; run generate() without sampler='flash'")
    shards = VocabShards.chunked(weight.shape[0], group=mesh.get_group())
    weight = weight.to_local()
    if weight.shape[0] != shards.size:
        raise ValueError(f"`{role}` ({name}): this rank holds {weight.shape[0]} rows of the LM "
                         f"head, not the {shards.size} of DTensor's split of {shards.vocab_size}")
    return weight, local(bias), shards


def model_hooks(model) -> tuple[str, ...]:
    """The forward hooks and pre-hooks on `model` itself and the global module hooks
    (``torch.nn.modules.module.register_module_forward_hook``), by name: they act on a
    forward the engine never runs (the model's) or on every module (the engine's compiled
    layers included), so only stock generate applies them as the model would."""
    from torch.nn.modules import module as nn_module
    names = list(_hook_names(model, "model"))
    for kind, hooks in (("global forward hook", nn_module._global_forward_hooks),
                        ("global forward pre-hook", nn_module._global_forward_pre_hooks)):
        names += [f"{kind} {_name(hook)}" for hook in hooks.values()]
    return tuple(names)


def _hook_names(module: torch.nn.Module, role: str) -> tuple[str, ...]:
    return tuple([f"forward pre-hook {_name(h)} on {role}" for h in module._forward_pre_hooks.values()]
                 + [f"forward hook {_name(h)} on {role}" for h in module._forward_hooks.values()])


def _name(hook) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def head_logits(head: OutputHead, hidden: torch.Tensor) -> torch.Tensor:
    """The model's own logits from final hidden states ``[..., D]``, in the order the models
    apply them: ``hidden @ weight.T`` (+ bias), times the logit scale, then the softcap;
    float32 (float64 for float64 hidden states), as `flashspec.reference` forms logits. With
    hooks on the LM head, the module itself (and its hooks) forms them, in the model's dtype,
    as the model does."""
    if head.module is not None:
        logits = head.module(hidden)
        logits = logits if logits.dtype == torch.float64 else logits.float()
    else:
        logits = reference.compute_logits(hidden, head.weight, bias=head.bias)
        if head.shards is not None:
            logits = all_gather_vocab(logits, head.shards)
    if head.logit_scale != 1.0:
        logits = logits * head.logit_scale
    return reference.softcapped(logits, head.softcap)


def check_logits(model, head: OutputHead, token_ids: torch.Tensor, role: str = "model") -> None:
    """Raise unless `model`'s own logits for one token equal `head_logits` up to the rounding
    of the model's dtype: the guard against head transforms flashspec does not know. Two
    one-token forwards, again only when the head's weight (its storage or an in-place
    change), its hooks or the model's dtype changed since the last check."""
    key = (head.weight.data_ptr(), head.weight._version, head.weight.dtype, head.logit_scale,
           head.hooks)
    if _CHECKED.get(model) == key:
        return
    ids = token_ids.reshape(-1)[-1:].reshape(1, 1)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, -1].double()
        hidden = head.decoder(input_ids=ids, use_cache=False).last_hidden_state[0, -1:]
        hidden = hidden.to(head.weight.dtype)
        ours = head_logits(head, hidden)[0].double()
        # The size of the dot products: |logit| errors of rounding scale with it.
        size = hidden.double().abs() @ head.weight.double().abs().T
        if head.bias is not None:
            size = size + head.bias.double().abs()
        size = size.max()
        if head.shards is not None:    # every rank decides alike (each holds part of the head)
            dist.all_reduce(size, op=dist.ReduceOp.MAX, group=head.shards.group)
        size = float(size) * head.logit_scale
    if not bool(torch.isfinite(logits).all()):
        return                 # not comparable; the sampler reports non-finite logits itself
    error = float((logits - ours).abs().max())
    # The model rounds each logit to its dtype (eps / 2 of the logit; twice for slack), and
    # both sides accumulate D products in at least float32 (errors scale with the dot
    # products' size); a missed transform (a multiplier, a cap, an offset) is larger: in
    # float32 a relative change of 1e-5, in bfloat16 of a few percent.
    rounding = 2 * torch.finfo(head.weight.dtype).eps * float(ours.abs().max())
    tolerance = rounding + head.weight.shape[1] * torch.finfo(torch.float32).eps * size + 1e-30
    if not error <= tolerance:
        raise ValueError(
            f"`{role}` ({type(model).__name__}) transforms its logits after the LM head in a way "
            f"flashspec does not reproduce: its logits differ from hidden @ lm_head.weight.T "
            f"(+ bias, x {head.logit_scale:g}, softcap) by up to {error:.3g}, over the "
            f"{tolerance:.3g} that rounding in {head.weight.dtype} allows; run "
            "generate() without sampler='flash'"
        )
    _CHECKED[model] = key


def check_decoder(decoder: torch.nn.Module, role: str) -> None:
    """Refuse, naming why, a decoder whose attention the engine's KV cache cannot address by
    position (`flashspec.generation.kv_cache`)."""
    config = decoder.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ATTENTION:
        raise ValueError(
            f"`{role}` uses attn_implementation={implementation!r}; sampler='flash' builds "
            f"position-addressed attention masks, which {ATTENTION} take: load the model with "
            "attn_implementation='sdpa', or run generate() without sampler='flash'")
    if layer_kinds(config) is None:
        raise ValueError(
            f"`{role}` ({type(decoder).__name__}) has layers other than full or sliding-window "
            "attention (chunked, linear or recurrent), whose state sampler='flash' does not "
            "keep; run generate() without sampler='flash'")
    name = column_alibi(decoder)
    if name is not None:
        raise ValueError(
            f"`{role}` ({type(decoder).__name__}) adds ALiBi biases by key column ({name}'s "
            "alibi table, sliced to the last KV columns), which equal position differences only "
            "where each row's keys sit in adjacent columns; sampler='flash' keeps keys by "
            "sequence position, in columns shared by the batch, where a row's keys can be apart "
            "(other rows' longer accepted drafts, compaction), so its biases would not be the "
            "model's; run generate() without sampler='flash'")
    if takes_padding_mask(decoder) and "create_causal_mask" not in forward_globals(decoder):
        raise ValueError(
            f"`{role}` ({type(decoder).__name__}) reads the 2-D attention mask in its forward "
            "(ALiBi) but does not build its causal mask with transformers' create_causal_mask, "
            "through which sampler='flash' gives it the position-addressed mask; run "
            "generate() without sampler='flash'")


def uncapturable_experts(module: torch.nn.Module, role: str) -> str | None:
    """Why the engine's captured steps cannot run `module` on CUDA, or None: transformers'
    MoE experts (classes decorated with ``use_experts_implementation``) with the "grouped_mm"
    implementation and weights in another dtype than bfloat16 fall back, under
    torch.compile, to a loop over the experts that reads their token counts on the host
    (``_grouped_mm_fallback``), which no CUDA graph can capture (measured: a float32
    GLM-4-MoE on an H200, 2026-11-28)."""
    for name, experts in module.named_modules():
        config = getattr(experts, "config", None)
        if not hasattr(experts, "is_concatenated") or config is None:
            continue
        weight = next(experts.parameters(recurse=False), None)
        implementation = getattr(config, "_experts_implementation", None)
        if (weight is not None and implementation == "grouped_mm"
                and weight.dtype != torch.bfloat16):
            return (f"`{role}`'s MoE experts ({name}, {type(experts).__name__}) hold "
                    f"{weight.dtype} weights: transformers' grouped_mm experts then read their "
                    "token counts on the host under torch.compile, which the engine's CUDA "
                    "graphs cannot capture; load the model in bfloat16, or run generate() "
                    "without sampler='flash'")
    return None
