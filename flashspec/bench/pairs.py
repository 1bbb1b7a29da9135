"""The model pairs (target + draft, same vocabulary) that scripts/tok_per_s.py times: the
presets, and loading one with trained weights (hub id or folder) or random weights at real
shapes (`flashspec.bench.random_init`), prepared for exact-length generations (no EOS)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import AutoModelForCausalLM

import flashspec
from flashspec.assets import tiny_pair_path
from flashspec.bench.cli import model_name
from flashspec.bench.random_init import WEIGHTS, peak_weights, random_model


class PairSpec(NamedTuple):
    """A pair's name in the report, and where its models come from: hub ids or folders with
    trained weights, or (with `random_init`) shipped config names or config.json paths
    (flashspec.bench.random_init). `draft` None: no draft model."""

    label: str
    target: str
    draft: str | None
    random_init: bool


# --pair presets: what --target/--draft (tiny) or --random-init (the others) would give.
PAIRS = {"tiny": PairSpec("tiny", str(tiny_pair_path() / "target"),
                          str(tiny_pair_path() / "draft"), random_init=False),
         "qwen3": PairSpec("qwen3", "qwen3-1.7b", "qwen3-0.6b", random_init=True),
         "llama": PairSpec("llama", "llama-3.1-8b", "llama-3.2-1b", random_init=True)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


SEED = 0
PAD_TOKEN_ID = 0


def _prepare(model):
    """Exact-length generations: no EOS."""
    model.eval()
    config = model.generation_config
    config.eos_token_id = None
    config.pad_token_id = PAD_TOKEN_ID
    return model


def _load_model(name: str, random_init: bool, device: str, dtype: torch.dtype):
    if random_init:
        return random_model(name, device, dtype, seed=SEED)
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)


def load_pair(spec: PairSpec, device: str, dtype: torch.dtype, weights: str = "random"):
    """(flashspec-wrapped target, draft or None, description); `weights` "peaked" applies
    `peak_weights` to random-init models."""
    if weights not in WEIGHTS:
        raise ValueError(f"`weights`={weights!r} is not allowed: use one of "
                         f"{', '.join(WEIGHTS)}")
    if not spec.random_init and weights != "random":
        raise ValueError(f"`weights`={weights!r} applies to random-init pairs; {spec.label!r} "
                         "has trained weights")
    models = [_prepare(_load_model(name, spec.random_init, device, dtype))
              for name in (spec.target, spec.draft) if name is not None]
    if weights == "peaked":
        models = [peak_weights(model) for model in models]
    target, draft = flashspec.wrap(models[0]), models[1] if len(models) > 1 else None
    description = {"target": model_name(spec.target),
                   "draft": None if draft is None else model_name(spec.draft),
                   "weights": WEIGHTS[weights] if spec.random_init else "trained",
                   "vocab_size": target.config.vocab_size,
                   "target_weight_bytes": weight_bytes(target),
                   "draft_weight_bytes": None if draft is None else weight_bytes(draft)}
    return target, draft, description


def weight_bytes(model) -> int:
    """Bytes of the parameters; `parameters()` yields a tied embedding once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
