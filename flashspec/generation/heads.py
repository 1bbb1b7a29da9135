"""The output head of a transformers causal LM, as the fused kernels see it.

The kernels compute ``hidden @ weight.T`` and nothing else, so a model whose forward
transforms the logits after the LM head must either have that transform folded into the
sampling parameters exactly, or be refused: never silently sampled from the wrong
distribution.

* Cohere's ``logits * logit_scale`` and Granite's ``logits / logits_scaling`` are a positive
  scale s of the logits: greedy rows are unaffected and a sampled row's ``logits * s / T``
  is ``logits / (T / s)``, so the scale folds into the row temperature.
* Gemma-2/3/4's ``final_logit_softcapping`` (``c * tanh(logits / c)``) changes the
  distribution nonlinearly: refused for the target; a greedy draft is unaffected (tanh
  is increasing) so it is accepted there.
* An LM-head bias is refused (the kernels have no bias term).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class OutputHead:
    """What the kernels need from a model: its decoder (base model), the LM-head weight
    ``[V, D]`` and the positive factor s the model multiplies its logits by."""

    decoder: torch.nn.Module
    weight: torch.Tensor
    logit_scale: float

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]


def output_head(model, role: str, greedy_only: bool = False) -> OutputHead:
    """The `OutputHead` of `model`, or a ValueError naming what flashspec cannot reproduce.

    `role` names the model in messages ("model" or "assistant_model"); `greedy_only`: the
    model only ever drafts greedily, so a monotone transform of its logits does not matter.
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
    if getattr(head, "bias", None) is not None:
        raise ValueError(
            f"`{role}` ({name}) has an LM-head bias, which flashspec's fused kernels do not "
            "apply; run generate() without sampler='flash'"
        )
    softcap = getattr(config.get_text_config(decoder=True), "final_logit_softcapping", None)
    if softcap is not None and not greedy_only:
        raise ValueError(
            f"`{role}` ({name}) applies final_logit_softcapping={softcap} (Gemma-style "
            "c * tanh(logits / c)), which flashspec's fused kernels do not reproduce yet; run "
            "generate() without sampler='flash'"
        )
    scale = 1.0
    if getattr(model, "logit_scale", None) is not None:            # Cohere: logits * s
        scale = float(model.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:          # Granite: logits / s
        scale = 1.0 / float(config.logits_scaling)
    if not scale > 0 or scale == float("inf"):
        raise ValueError(
            f"`{role}` ({name}) scales its logits by {scale}; only a finite positive scale can "
            "be folded into the temperature"
        )
    return OutputHead(decoder=model.get_decoder(), weight=head.weight.contiguous(), logit_scale=scale)
