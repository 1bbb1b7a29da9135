"""Tiny random causal LMs for the generation-engine tests (no downloads).

Every factory builds a float32 model in eval mode from a fixed `torch.manual_seed`, so each
call with the same arguments gives the same weights. Vocabulary `VOCAB`, pad id `PAD`,
no EOS (rows run to `max_new_tokens` unless a test sets `eos_token_id`).

`initializer_range` is raised above the transformers default and the LM head is scaled up
after init, so that the random models' next-token distributions are peaked: top-k / top-p /
min-p then cut something, a model drafting for itself gets sampled drafts accepted, and
greedy decoding falls into the repetitive loops that prompt lookup can draft from.
"""

from __future__ import annotations

import torch
from transformers import (CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM,
                          GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM)

import flashspec

VOCAB = 128
PAD = 0
INIT = 0.1
HEAD_SCALE = 6.0            # LM-head weights scaled up after init: peaked distributions
SLIDING_WINDOW = 6          # smaller than every prompt + new tokens used with Mistral
ARCHS = ("llama", "qwen3", "mistral", "gpt2")


def _special(**overrides) -> dict:
    return {"pad_token_id": PAD, "bos_token_id": None, "eos_token_id": None, **overrides}


def _config(arch: str, size: str, vocab_size: int, **overrides):
    """Config of `arch`; `size` "target" (2 layers, hidden 48) or "draft" (1 layer, hidden 32)."""
    hidden, layers = (48, 2) if size == "target" else (32, 1)
    common = dict(vocab_size=vocab_size, initializer_range=INIT, **_special())
    decoder = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                   max_position_embeddings=256, tie_word_embeddings=False)
    if arch == "llama":
        config = LlamaConfig(**common, **decoder)
    elif arch == "qwen3":
        config = Qwen3Config(**common, **decoder)
    elif arch == "mistral":
        config = MistralConfig(**common, **decoder, sliding_window=SLIDING_WINDOW)
    elif arch == "gpt2":
        config = GPT2Config(**common, n_embd=hidden, n_layer=layers, n_head=4, n_positions=256,
                            tie_word_embeddings=False)
    elif arch == "cohere":
        config = CohereConfig(**common, **decoder, logit_scale=0.5)
    elif arch == "gemma2":
        config = Gemma2Config(**common, **decoder, final_logit_softcapping=30.0,
                              sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=hidden // 4)
    else:
        raise ValueError(arch)
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


_CLASSES = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM, "mistral": MistralForCausalLM,
            "gpt2": GPT2LMHeadModel, "cohere": CohereForCausalLM, "gemma2": Gemma2ForCausalLM}


def tiny_model(arch: str = "llama", size: str = "target", *, seed: int = 0,
               vocab_size: int = VOCAB, wrap: bool = True, **overrides):
    """A float32 random `arch` causal LM in eval mode, wrapped with `flashspec.wrap` unless
    `wrap=False`. `overrides` are set on the config."""
    torch.manual_seed(seed)
    model = _CLASSES[arch](_config(arch, size, vocab_size, **overrides)).float().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_SCALE)
    return flashspec.wrap(model) if wrap else model


def tiny_draft(arch: str = "llama", *, seed: int = 1, **overrides):
    """A smaller random model of `arch` with the target's vocabulary (an assistant)."""
    return tiny_model(arch, "draft", seed=seed, **overrides)
