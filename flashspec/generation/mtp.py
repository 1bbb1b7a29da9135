"""MTP drafts: the multi-token-prediction layer shipped inside a model's own checkpoint.

    out = model.generate(ids, sampler="flash", use_mtp=True)          # as stock, batched

transformers 5.17 gives MTP layers to the models whose config has ``num_mtp_layers``
(DeepSeek-V3, GLM-4.5 / 4.6, and others: `MTPCandidateGenerator`) and loads their weights
from the model's checkpoint (`transformers.modeling_layers.MtpModel.from_pretrained`, which
this module calls once per model and keeps). One MTP layer at position p + 1 takes the
target's last hidden state at p (after the final norm) and the token at p + 1::

    x = eh_proj([enorm(embed(token)), hnorm(hidden)]);  h = post_norm(decoder_layer(x))

and its drafts are the argmax of the target's own LM head over ``h``; further drafts feed
``h`` back with the draft (`chain.ChainSteps`). Stock drafts ``num_mtp_layers`` tokens per
step at batch 1; here the default is the same count, ``num_assistant_tokens`` asks for more
(the one layer reused, as vLLM does), and batches run. Models with more than one MTP layer
are refused until they are implemented.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast

from . import fused_projections
from .allowed import mask_edits
from .chain import ChainHead, ChainSteps
from .drafters import AttachedDrafter, Drafter
from .heads import output_head, uncapturable_experts
from .taps import FINAL, tap_layers

_MTP_ATTRIBUTE = "_flashspec_mtp_model"


def keep_mtp(model, mtp) -> None:
    """Use `mtp` (a transformers `MtpModel` of `model`) as the model's MTP layers from now on,
    instead of loading them from its checkpoint (random-init models for benchmarks)."""
    object.__setattr__(model, _MTP_ATTRIBUTE, mtp)


def mtp_layers(model) -> int | None:
    """The model's ``num_mtp_layers`` (None: transformers gives it no MTP layers)."""
    return getattr(model.config.get_text_config(), "num_mtp_layers", None)


class MtpDecoder(nn.Module):
    """One MTP layer as a decoder the engine's runner drives: token ids and ``mtp_hidden``
    in, the layer's (post-norm) output out; the embedding and rotary tables are the
    target's."""

    def __init__(self, mtp, depth: int = 0):
        super().__init__()
        self.mtp = mtp
        self.depth = depth
        # The MTP model's own config (one layer per depth: `get_mtp_config`), which its
        # attention modules read: the engine switches their attention through it.
        self.config = mtp.config

    def get_input_embeddings(self) -> nn.Module:
        return self.mtp.embed_tokens

    def forward(self, input_ids: torch.Tensor, mtp_hidden: torch.Tensor, attention_mask=None,
                position_ids=None, past_key_values=None, use_cache=None,
                **kwargs) -> BaseModelOutputWithPast:
        embeds = self.mtp.embed_tokens(input_ids)
        mask = create_causal_mask(config=self.config, inputs_embeds=embeds,
                                  attention_mask=attention_mask, past_key_values=past_key_values,
                                  position_ids=position_ids)
        hidden = self.mtp.layers[self.depth](
            embeds, mtp_hidden.to(embeds.dtype),
            position_embeddings=self.mtp.rotary_emb(embeds, position_ids=position_ids),
            attention_mask=mask, position_ids=position_ids, past_key_values=past_key_values,
            **kwargs)
        if self.mtp.use_shared_post_norm:
            hidden = self.mtp.shared_post_norm(hidden)
        return BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=past_key_values)


def _follow(mtp, model, weight: torch.Tensor) -> None:
    """Keep a kept MTP model in step with `model`: its shared embedding and LM head the
    model's current modules, its own layers on the LM head's device in its dtype (the model
    may have been moved, cast or given new embeddings since)."""
    if (mtp.embed_tokens is not model.get_input_embeddings()
            or mtp.shared_head is not model.get_output_embeddings()):
        mtp.tie_with_main_model(model)
    own = [mtp.layers, *([mtp.shared_post_norm] if mtp.use_shared_post_norm else [])]
    for module in own:
        parameter = next(module.parameters())
        if parameter.device != weight.device or parameter.dtype != weight.dtype:
            module.to(device=weight.device, dtype=weight.dtype)


class Mtp(Drafter, ChainHead):
    """The MTP layer of `model` (its checkpoint's, loaded once and kept on the model) as a
    drafter; `generate(use_mtp=True)` builds it."""

    input_name = "mtp_hidden"
    role = "mtp"
    name = "the MTP layer (`use_mtp`)"
    shift = 1
    taps = (FINAL,)

    def __init__(self, model, mtp=None):
        layers = mtp_layers(model)
        if layers is None:
            raise ValueError(f"`use_mtp=True`: {type(model).__name__}'s config has no "
                             "num_mtp_layers (transformers gives it no MTP layers)")
        if layers != 1:
            raise ValueError(f"`use_mtp=True`: the model has {layers} MTP layers; sampler='flash' "
                             "runs models with one (DeepSeek-V3, GLM-4.5) so far")
        head = output_head(model, "model")
        if head.shards is not None:
            raise ValueError("`use_mtp=True` with a tensor-parallel model is not supported yet")
        tap_layers(head.decoder, self.taps, "model")
        if mtp is None:
            mtp = getattr(model, _MTP_ATTRIBUTE, None)
        if mtp is None:
            from transformers.modeling_layers import MtpModel
            mtp = MtpModel.from_pretrained(model, device_map={"": head.weight.device})
            keep_mtp(model, mtp)
        _follow(mtp, model, head.weight)
        config = mtp.config
        if head.weight.is_cuda:
            why = uncapturable_experts(mtp.layers, "the MTP layer (`use_mtp`)")
            if why is not None:
                raise ValueError(why)
        for name in ("logits_mup_width_multiplier", "unpadded_vocab_size"):
            if getattr(config, name, None) is not None:
                raise ValueError(f"`use_mtp=True`: the MTP head's {name} is not supported")
        if mtp.rotary_emb is None:
            raise ValueError("`use_mtp=True`: MTP layers with learned position biases (no "
                             "rotary table) are not supported")
        self.mtp = mtp.eval()
        self.decoder = MtpDecoder(mtp)
        self.decoders = (self.decoder,)
        self.width = config.hidden_size
        self.weight = head.weight
        self._target = weakref.ref(head.decoder)
        fused_projections.fuse_where_compiled(self.decoder)
        self.key = ("mtp", id(mtp), tuple(p.data_ptr() for p in self.decoder.parameters()))

    def check_target(self, head) -> None:
        if head.decoder is not self._target():
            raise ValueError("`use_mtp=True`: the MTP layer belongs to another model")

    def combine(self, taps: torch.Tensor) -> torch.Tensor:
        return taps

    def draft(self, slot, hidden: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        edits = None if allowed is None else mask_edits(allowed[:, : self.weight.shape[0]])
        return slot.sampler(self.weight).argmax(hidden.to(self.weight.dtype), edits)

    def attach(self, slot) -> AttachedDrafter:
        return ChainSteps(self, slot)
