"""EAGLE-3 drafts: a one-layer head fed the target's own hidden states.

    head = flashspec.Eagle3.from_pretrained("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", model)
    out = model.generate(ids, sampler="flash", drafter=head, num_assistant_tokens=4)

`Eagle3.from_pretrained` reads a published head (a folder or a Hub id; the format is
`eagle3_model`'s) for one target model and refuses, naming the part, a head that does not
fit it. The head reads three of the target's hidden states (`flashspec.generation.taps`:
the engine's target steps copy them into the slot) and drafts as `chain.ChainSteps` says
(``eagle3_first`` over the positions the last target step accepted, then ``eagle3_next`` per
further draft), on the engine's own steps through the `Drafter` interface.

Drafts are the argmax over the head's draft vocabulary (the fused tiled argmax on CUDA),
mapped to target ids by ``d2t``; no ``[B, V]`` tensor is formed. The strict verification rule
makes the tokens those of the call without drafts, whatever the head proposes.
"""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path

import torch
from transformers import LlamaConfig

from . import fused_projections
from .allowed import mask_edits
from .chain import ChainHead, ChainSteps
from .drafters import AttachedDrafter, Drafter
from .eagle3_model import (Eagle3Model, check_config, config_taps, read_config, read_weights,
                           resolve)
from .heads import output_head
from .taps import tap_layers


class Eagle3(Drafter, ChainHead):
    """An EAGLE-3 head bound to the target model it drafts for (`from_pretrained`)."""

    input_name = "eagle_hidden"
    role = "eagle3"
    name = "the EAGLE-3 head (`drafter`)"

    def __init__(self, model: Eagle3Model, target, taps: tuple[int, ...]):
        head = output_head(target, "model")
        if head.shards is not None:
            raise ValueError("EAGLE-3 heads do not run beside a tensor-parallel model yet; load "
                             "the model whole (without tp_plan)")
        decoder = head.decoder
        stack = tap_layers(decoder, taps, "model")
        target_config = decoder.config.get_text_config()
        expected = 3 * target_config.hidden_size
        if model.fc.in_features != expected:
            raise ValueError(
                f"the EAGLE-3 head's fc.weight reads {model.fc.in_features} features but the "
                f"model's hidden size is {target_config.hidden_size} (3 x = {expected}): the "
                "head was trained for another model (its target_hidden_size)")
        if len(taps) != 3:
            raise ValueError(f"`taps`={tuple(taps)}: an EAGLE-3 head reads three target layers "
                             "(its fc takes 3 x the hidden size)")
        vocab = head.vocab_size
        if model.config.vocab_size != vocab:
            raise ValueError(f"the EAGLE-3 head's vocab_size is {model.config.vocab_size} but "
                             f"the model's vocabulary has {vocab} tokens")
        targets = torch.arange(model.d2t.shape[0], device=model.d2t.device) + model.d2t
        if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab
                                or bool((targets[1:] <= targets[:-1]).any())):
            raise ValueError("the EAGLE-3 head's d2t does not map its draft vocabulary to "
                             f"increasing ids in [0, {vocab})")
        if model.embed_tokens is None:
            embeddings = decoder.get_input_embeddings()
            if embeddings.weight.shape != (vocab, model.config.hidden_size):
                raise ValueError(
                    "the EAGLE-3 head has no embed_tokens and the model's embedding table "
                    f"{tuple(embeddings.weight.shape)} is not [{vocab}, "
                    f"{model.config.hidden_size}] to share")
            model.share_embeddings(embeddings)
        self.model = model.eval()
        self.decoder = model
        self.width = model.config.hidden_size
        self.taps = tuple(taps)
        self.num_target_layers = len(stack)
        self._target = weakref.ref(decoder)
        self.decoders = (model,)
        self._check_device(head)
        fused_projections.fuse_where_compiled(model)

    @property
    def key(self):
        """Captured graphs read the head's parameters where they are now (a head moved or
        cast later gets new graphs)."""
        return ("eagle3", id(self.model), self.taps,
                tuple(p.data_ptr() for p in self.model.parameters()))

    def _check_device(self, head) -> None:
        if self.model.fc.weight.device != head.weight.device:
            raise ValueError(f"the EAGLE-3 head is on {self.model.fc.weight.device} but the "
                             f"model's LM head is on {head.weight.device}")

    @classmethod
    def from_pretrained(cls, source: str | os.PathLike, model, *, dtype: torch.dtype | None = None,
                        taps: tuple[int, ...] | None = None, revision: str | None = None,
                        token=None) -> "Eagle3":
        """The EAGLE-3 head in `source` (a folder, or a Hub id whose files are downloaded)
        for the causal LM `model`, on its LM head's device, in `dtype` (default: the
        model's). `taps`: the target layers to read (input convention), overriding the
        config's. Refuses, naming it, a checkpoint with a part missing, unexpected or of
        another shape than its config and the model say."""
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"`dtype`={dtype!r}: give a floating torch dtype (or None: the "
                             "model's)")
        folder = resolve(source, revision, token)
        where = str(source)
        config = read_config(folder)
        check_config(config, where)
        weights = read_weights(folder)
        draft = _from_weights(config, weights, where)
        head = output_head(model, "model")
        draft = draft.placed(head.weight.device, dtype or head.weight.dtype)
        num_layers = model.config.get_text_config().num_hidden_layers
        return cls(draft, model, taps if taps is not None else config_taps(config, num_layers))

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write the head in the published format: config.json (the taps as
        ``eagle_config.eagle_aux_hidden_state_layer_ids``, layer outputs) and
        model.safetensors (no embedding table when the model's is shared)."""
        if min(self.taps) < 1:
            raise ValueError(f"taps {self.taps} include the embedding output (0), which the "
                             "published format cannot name")
        from safetensors.torch import save_file
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = self.model.config.to_dict()
        config.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                      draft_vocab_size=self.model.lm_head.out_features,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": [k - 1 for k in self.taps],
                                    "use_aux_hidden_state": True})
        config.pop("eagle_aux_hidden_state_layer_ids", None)      # the taps say which
        rope = config.get("rope_parameters") or {}
        if "rope_theta" in rope:            # for readers of the older field too
            config["rope_theta"] = rope["rope_theta"]
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        state = {name: tensor.detach().contiguous().cpu()
                 for name, tensor in self.model.state_dict().items()}
        save_file(state, str(folder / "model.safetensors"))

    def check_target(self, head) -> None:
        if head.decoder is not self._target():
            raise ValueError("`drafter`: this EAGLE-3 head was loaded for another model; load it "
                             "with Eagle3.from_pretrained(source, model) for the model that "
                             "generates")
        self._check_device(head)

    def attach(self, slot) -> AttachedDrafter:
        return ChainSteps(self, slot)

    def combine(self, taps: torch.Tensor) -> torch.Tensor:
        return self.model.combine(taps)

    def draft(self, slot, hidden: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """The argmax over the draft vocabulary (the fused kernel on CUDA), as target ids;
        among the draft ids whose target ids `allowed` allows."""
        weight = self.model.lm_head.weight
        normed = self.model.norm(hidden).to(weight.dtype)
        edits = None
        if allowed is not None:
            targets = self.model.target_ids(torch.arange(weight.shape[0], device=weight.device))
            edits = mask_edits(allowed[:, targets])
        return self.model.target_ids(slot.sampler(weight).argmax(normed, edits))


def _from_weights(config: dict, weights: dict[str, torch.Tensor], where: str) -> Eagle3Model:
    """The head of `config` holding `weights`, each checked against the config's shapes."""
    fields = {k: v for k, v in config.items() if k not in ("architectures", "auto_map")}
    fields["fc_bias"] = "fc.bias" in weights
    draft = Eagle3Model(LlamaConfig(**fields), own_embeddings="embed_tokens.weight" in weights)
    expected = draft.state_dict()
    optional = {"t2d"} | ({"d2t"} if draft.lm_head.out_features == draft.config.vocab_size else set())
    missing = sorted(set(expected) - set(weights) - optional)
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f"EAGLE-3 head {where}: "
                         + "; ".join(part for part in (
                             f"missing {missing}" if missing else "",
                             f"unexpected {unexpected}" if unexpected else "") if part))
    for name, tensor in weights.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"EAGLE-3 head {where}: {name} has shape {tuple(tensor.shape)}, its "
                             f"config says {tuple(expected[name].shape)}")
    with torch.no_grad():
        for name, tensor in weights.items():
            expected[name].copy_(tensor)
    return draft
