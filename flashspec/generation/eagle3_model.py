"""EAGLE-3 draft heads: the module, and checkpoints in the published format.

The format is EAGLE's and SpecForge's, which vLLM and SGLang read alike
(``docs/notes/eagle3_mtp.md`` has the sources). ``config.json`` is a Llama config of the
draft (``architectures: ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``) with
``draft_vocab_size``, an optional ``target_hidden_size``, ``norm_before_residual`` and
``eagle_config.eagle_aux_hidden_state_layer_ids``; the weights are

* ``fc.weight`` ``[H, 3 Ht]``: the three target hidden states, side by side, to the draft's width;
* ``midlayer.*``: one Llama decoder layer whose attention reads ``2 H`` (the normed token
  embedding, then the normed hidden input: ``input_layernorm``, ``hidden_norm``);
* ``norm.weight``, ``lm_head.weight`` ``[Vd, H]`` over the draft vocabulary;
* ``d2t`` ``[Vd]`` (target id = draft id + ``d2t[draft id]``), ``t2d`` ``[V]`` (unused);
* ``embed_tokens.weight`` ``[V, H]`` only where the head does not share the target's.

One draft-layer forward at position q, from hidden input g (``fc`` of the target's states
for the positions the target verified, the previous draft's output for later drafts) and
token t (the token at q + 1)::

    x  = [input_layernorm(embed(t)), hidden_norm(g)]          # 2 H
    h1 = (hidden_norm(g) if norm_before_residual else g) + o_proj(attention(x at q))
    h2 = h1 + mlp(post_attention_layernorm(h1))               # the layer's output
    draft logits = lm_head(norm(h2))                          # Vd

Which target layers feed ``fc``: ids under ``eagle_config`` name layer outputs (SGLang's
convention, which SpecForge writes) and are read as the input of the next layer; top-level
``eagle_aux_hidden_state_layer_ids`` (vLLM's) name layer inputs; without ids, the inputs of
layers 2, N // 2 and N - 3 of an N-layer target, as EAGLE, vLLM and SGLang take them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaPreTrainedModel,
                                                      LlamaRMSNorm, LlamaRotaryEmbedding)

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# SpecForge and speculators options that change the forward and are not implemented here.
UNSUPPORTED = {"fc_norm": True, "norm_before_fc": True, "norm_output": False}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class Eagle3Layer(LlamaDecoderLayer):
    """The draft's decoder layer: a Llama layer whose attention projections read the normed
    token embedding and the normed hidden input side by side."""

    def __init__(self, config: LlamaConfig):
        super().__init__(config, layer_idx=0)
        attention = self.self_attn
        width, bias = 2 * config.hidden_size, config.attention_bias
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        attention.q_proj = nn.Linear(width, heads * attention.head_dim, bias=bias)
        attention.k_proj = nn.Linear(width, kv_heads * attention.head_dim, bias=bias)
        attention.v_proj = nn.Linear(width, kv_heads * attention.head_dim, bias=bias)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, hidden_states: torch.Tensor, embeds: torch.Tensor, attention_mask=None,
                position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs) -> torch.Tensor:
        normed = self.hidden_norm(hidden_states)
        residual = normed if self.norm_before_residual else hidden_states
        attended, _ = self.self_attn(
            hidden_states=torch.cat([self.input_layernorm(embeds), normed], dim=-1),
            attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, use_cache=use_cache,
            position_embeddings=position_embeddings, **kwargs)
        hidden = residual + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Model(LlamaPreTrainedModel):
    """An EAGLE-3 head. As a decoder (what flashspec's engine runs over its KV cache) its
    forward takes token ids and ``eagle_hidden`` ``[B, n, H]`` and returns the layer's output
    ``h2`` (before `norm`); `combine` maps the target's states to ``H``, `draft_logits` and
    `target_ids` make the drafts.

    ``config.vocab_size`` is the target's vocabulary, ``config.draft_vocab_size`` the
    head's. Without its own embedding (`share_embeddings`), the target's is used, outside
    this module's parameters."""

    _no_split_modules = ["Eagle3Layer"]

    def __init__(self, config: LlamaConfig, own_embeddings: bool = True):
        super().__init__(config)
        width = config.hidden_size
        target_width = getattr(config, "target_hidden_size", None) or width
        draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.embed_tokens = (nn.Embedding(config.vocab_size, width, config.pad_token_id)
                             if own_embeddings else None)
        self._shared_embeddings = None
        self.fc = nn.Linear(3 * target_width, width, bias=bool(getattr(config, "fc_bias", False)))
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(width, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(width, draft_vocab, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.post_init()

    def placed(self, device, dtype: torch.dtype) -> "Eagle3Model":
        """The head on `device` in `dtype`, its rotary table recomputed there in float32 (a
        cast would round the frequencies to `dtype`: in bf16 the angles drift by a radian
        over a thousand positions)."""
        self.to(device=device, dtype=dtype)
        self.rotary_emb = LlamaRotaryEmbedding(config=self.config, device=device)
        return self

    def share_embeddings(self, embeddings: nn.Embedding) -> None:
        """Embed tokens with the target's table (kept out of this module's parameters, so
        that moving or saving the head leaves it alone)."""
        object.__setattr__(self, "_shared_embeddings", embeddings)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens if self.embed_tokens is not None else self._shared_embeddings

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``fc``: the target's tapped states ``[..., 3 Ht]`` to the draft's hidden input."""
        return self.fc(target_hidden.to(self.fc.weight.dtype))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary of the layer outputs `hidden`."""
        return self.lm_head(self.norm(hidden))

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft ids (negative ids, "none", stay as they are)."""
        return torch.where(draft_ids >= 0, draft_ids + self.d2t[draft_ids.clamp_min(0)],
                           draft_ids)

    def forward(self, input_ids: torch.Tensor, eagle_hidden: torch.Tensor, attention_mask=None,
                position_ids=None, past_key_values=None, use_cache=None,
                **kwargs) -> BaseModelOutputWithPast:
        embeds = self.get_input_embeddings()(input_ids).to(self.fc.weight.dtype)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
        mask = create_causal_mask(config=self.config, inputs_embeds=embeds,
                                  attention_mask=attention_mask, past_key_values=past_key_values,
                                  position_ids=position_ids)
        hidden = self.midlayer(eagle_hidden.to(embeds.dtype), embeds, attention_mask=mask,
                               position_ids=position_ids, past_key_values=past_key_values,
                               use_cache=use_cache,
                               position_embeddings=self.rotary_emb(embeds, position_ids),
                               **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=past_key_values)


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """The target layers (input convention) EAGLE-3 reads when its config names none."""
    return (2, num_layers // 2, num_layers - 3)


def config_taps(config: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers (input convention: ``k`` is the input of ``layers[k]``) a head's
    config names (module docstring)."""
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested is not None:       # side by side in layer order, as the peers' layer loops append
        return tuple(sorted(int(k) + 1 for k in nested))
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if top is not None:
        return tuple(sorted(int(k) for k in top))
    return default_taps(num_layers)


def read_config(source: Path) -> dict:
    path = source / "config.json"
    if not path.is_file():
        raise ValueError(f"EAGLE-3 head {source}: no config.json")
    return json.loads(path.read_text())


def check_config(config: dict, where: str) -> None:
    """Refuse, naming the field, a config this module does not implement."""
    if "speculators_model_type" in config:
        raise ValueError(f"EAGLE-3 head {where}: the speculators format "
                         f"(speculators_model_type={config['speculators_model_type']!r}) is not "
                         "supported; convert it to the EAGLE / SpecForge layout")
    architectures = config.get("architectures") or []
    if not set(architectures) & set(ARCHITECTURES) and architectures != ["LlamaForCausalLM"]:
        raise ValueError(f"EAGLE-3 head {where}: architectures={architectures} is none of "
                         f"{list(ARCHITECTURES)}")
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"EAGLE-3 head {where}: num_hidden_layers="
                         f"{config['num_hidden_layers']}; an EAGLE-3 head has one layer")
    for name, unsupported in UNSUPPORTED.items():
        if name in config and bool(config[name]) == unsupported:
            raise ValueError(f"EAGLE-3 head {where}: {name}={config[name]!r} is not supported")
    if (config.get("eagle_config") or {}).get("use_aux_hidden_state", True) is False:
        raise ValueError(f"EAGLE-3 head {where}: eagle_config.use_aux_hidden_state=false "
                         "(a head fed the target's last hidden state only) is not supported")


def read_weights(source: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by name (safetensors or PyTorch files, sharded or not)."""
    for index_name in INDEX_FILES:
        index = source / index_name
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            break
    else:
        files = [name for name in WEIGHT_FILES if (source / name).is_file()][:1]
    if not files:
        raise ValueError(f"EAGLE-3 head {source}: no weights ({' or '.join(WEIGHT_FILES)})")
    tensors = {}
    for name in files:
        path = source / name
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file
            tensors.update(load_file(str(path)))
        else:
            tensors.update(torch.load(path, map_location="cpu", weights_only=True))
    return {_local_name(name): tensor for name, tensor in tensors.items()}


def _local_name(name: str) -> str:
    """A checkpoint's key as this module names it (vLLM's ``layers.0.`` is ``midlayer.``)."""
    name = name.removeprefix("model.")
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def resolve(source: str | os.PathLike, revision: str | None = None, token=None) -> Path:
    """A folder holding the head: `source` itself, or a Hub repository's files (downloaded
    once into the Hub cache)."""
    path = Path(source)
    if path.is_dir():
        return path
    if path.exists() or str(source).count("/") != 1:
        raise ValueError(f"EAGLE-3 head {source!r} is neither a folder nor a Hub id (owner/name)")
    from huggingface_hub import snapshot_download
    return Path(snapshot_download(str(source), revision=revision, token=token,
                                  allow_patterns=["*.json", "*.safetensors", "*.bin"]))
