"""EAGLE-3 drafts: a one-layer head fed the target's own hidden states.

    head = flashspec.Eagle3.from_pretrained("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", model)
    out = model.generate(ids, sampler="flash", drafter=head, num_assistant_tokens=4)

`Eagle3.from_pretrained` reads a published head (a folder or a Hub id; the format is
`eagle3_model`'s) for one target model and refuses, naming the part, a head that does not
fit it. The head reads three of the target's hidden states (`flashspec.generation.taps`:
the engine's target steps copy them into the slot), so it runs on the engine's own steps
through the `Drafter` interface:

* after the prefill (`prefilled`, eager), the head reads every prompt position but the last
  into its KV cache: position q takes ``fc`` of the target's states at q and the token at
  q + 1;
* each speculative step's first draft step (``eagle_first``, captured) feeds the positions
  the last target step verified and accepted, from the first the step fed to the one before
  the row's last token, with the target's states there, and drafts from the last of them;
  these entries replace the ones the previous chain wrote at those positions (rollback by
  position, as vLLM's first pass rewrites them);
* each further draft (``eagle_next``) feeds the previous draft at the next position with the
  previous step's layer output as its hidden input (chain drafts).

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

from .drafters import AttachedDrafter, Drafter, Step
from .eagle3_model import (Eagle3Model, check_config, config_taps, read_config, read_weights,
                           resolve)
from .heads import output_head
from .taps import tap_layers


class Eagle3(Drafter):
    """An EAGLE-3 head bound to the target model it drafts for (`from_pretrained`)."""

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
        if model.fc.weight.device != head.weight.device:
            raise ValueError(f"the EAGLE-3 head is on {model.fc.weight.device} but the model's "
                             f"LM head is on {head.weight.device}")
        self.model = model.eval()
        self.taps = tuple(taps)
        self.num_target_layers = len(stack)
        self._target = weakref.ref(decoder)
        self.decoders = (model,)
        # Captured graphs read the head's parameters where they are now.
        self.key = ("eagle3", id(model), self.taps,
                    tuple(p.data_ptr() for p in model.parameters()))

    @classmethod
    def from_pretrained(cls, source: str | os.PathLike, model, *, dtype: torch.dtype | None = None,
                        taps: tuple[int, ...] | None = None, revision: str | None = None,
                        token=None) -> "Eagle3":
        """The EAGLE-3 head in `source` (a folder, or a Hub id whose files are downloaded)
        for the causal LM `model`, on its LM head's device, in `dtype` (default: the
        model's). `taps`: the target layers to read (input convention), overriding the
        config's. Refuses, naming it, a checkpoint with a part missing, unexpected or of
        another shape than its config and the model say."""
        folder = resolve(source, revision, token)
        where = str(source)
        config = read_config(folder)
        check_config(config, where)
        weights = read_weights(folder)
        draft = _from_weights(config, weights, where)
        head = output_head(model, "model")
        draft = draft.to(device=head.weight.device, dtype=dtype or head.weight.dtype)
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
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        state = {name: tensor.detach().contiguous().cpu()
                 for name, tensor in self.model.state_dict().items()}
        save_file(state, str(folder / "model.safetensors"))

    def check_target(self, head) -> None:
        if head.decoder is not self._target():
            raise ValueError("`drafter`: this EAGLE-3 head was loaded for another model; load it "
                             "with Eagle3.from_pretrained(source, model) for the model that "
                             "generates")

    def attach(self, slot) -> AttachedDrafter:
        return _AttachedEagle3(self.model, slot)


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


class _AttachedEagle3(AttachedDrafter):
    """The head's KV cache in the slot, the previous draft's layer output, and the steps."""

    def __init__(self, model: Eagle3Model, slot):
        self.model = model
        self.slot = slot
        self.runner, self.cache = slot.add_cache(model, "eagle3", refeed=2)
        self.count = torch.zeros((), dtype=torch.long, device=slot.device)
        self.hidden = torch.zeros(slot.batch_size, model.config.hidden_size,
                                  dtype=model.fc.weight.dtype, device=slot.device)

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.count, self.hidden]

    def prefilled(self, prompt, taps: torch.Tensor) -> None:
        """Prompt positions q <= P - 2 of each row (P: its prompt length), with the token at
        q + 1; the last one comes with the first step (`_first`)."""
        ids, positions, live = prompt
        slot = self.slot
        last = (slot.prompt_length - 2)[:, None]
        live = live & (positions <= last)
        following = slot.seq.gather(1, (positions + 1).clamp_max(slot.seq.shape[1] - 1))
        slot.forward_prompt(self.runner, self.cache, following, positions, live,
                            inputs={"eagle_hidden": self.model.combine(taps)})

    def columns(self, width: int) -> int:
        # The first step's columns for every tap column, then one per further draft (a
        # dead column each step reuses) and one dead.
        return self.slot.taps.shape[1] + width + 1

    def steps(self, width: int) -> list[Step]:
        return [("eagle_first", self._first)] + [("eagle_next", self._next)] * (width - 1)

    def _first(self) -> None:
        slot = self.slot
        taps = slot.taps
        columns = torch.arange(taps.shape[1], device=slot.device)
        start = slot.tap_position
        last = slot.length - 2             # the pair that drafts the token after the last
        positions = start[:, None] + columns
        live = positions <= last[:, None]
        # Dead columns stay inside the row's budget (a learned position table could end).
        positions = torch.minimum(positions, (slot.end - 1)[:, None]).clamp_min(0)
        following = slot.seq.gather(1, (positions + 1).clamp_max(slot.seq.shape[1] - 1))
        hidden = self.runner.step(self.cache, following, positions, live,
                                  inputs={"eagle_hidden": self.model.combine(taps)})
        pick = (last - start).clamp(0, taps.shape[1] - 1)
        hidden = hidden.gather(1, pick[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
        self._draft(0, hidden)
        self.count.fill_(1)

    def _next(self) -> None:
        slot = self.slot
        count = self.count.view(1)
        # A compiled step takes two tokens or more: the previous draft and a dead copy.
        fed = 2 if self.runner.compile and not self.runner.eager else 1
        previous = slot.drafts.index_select(1, count - 1).clamp_min(0).repeat(1, fed)
        positions = torch.minimum(slot.length[:, None] + count - 2, (slot.end - 1)[:, None])
        hidden = self.runner.step(self.cache, previous, positions.repeat(1, fed),
                                  slot.one_live[:, :fed],
                                  inputs={"eagle_hidden": self.hidden[:, None].repeat(1, fed, 1)})
        self._draft(count, hidden[:, 0])
        self.count.add_(1)

    def _draft(self, column, hidden: torch.Tensor) -> None:
        """Draft from the layer outputs `hidden` ``[B, H]`` into ``drafts[:, column]``."""
        slot = self.slot
        self.hidden.copy_(hidden)
        weight = self.model.lm_head.weight
        draft_ids = slot.sampler(weight).argmax(self.model.norm(hidden).to(weight.dtype))
        tokens = self.model.target_ids(draft_ids)
        if isinstance(column, int):
            slot.drafts[:, column] = tokens
            slot.draft_failed[:, column] = draft_ids < 0
        else:
            slot.drafts.index_copy_(1, column, tokens[:, None])
            slot.draft_failed.index_copy_(1, column, (draft_ids < 0)[:, None])
