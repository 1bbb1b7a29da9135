"""The model pairs (target + draft, same vocabulary) that scripts/tok_per_s.py times: the
presets, and loading one with trained weights (hub id or folder) or random weights at real
shapes (`flashspec.bench.random_init`), prepared for exact-length generations (no EOS).

Under torchrun (`init_tensor_parallel`), `load_pair` loads the target tensor-parallel
(``DistributedConfig(tp_plan="auto")``: transformers splits attention heads and MLP columns
over the ranks, the LM head over the vocabulary) and the draft whole on every rank. That path
reads a folder, so random-init models are built once, by rank 0 (seeded, in the target
dtype, peaked if asked), saved into a temporary folder that every rank loads, and deleted
once loaded.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import tempfile
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

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
# Collectives of a tensor-parallel run give up after this long (a rank that failed alone).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


class TensorParallel(NamedTuple):
    """The process group a torchrun run loads its targets over (the default group)."""

    world_size: int
    rank: int
    backend: str


def torchrun_world_size() -> int:
    """WORLD_SIZE as torchrun sets it; 1 outside torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_tensor_parallel(device: str) -> TensorParallel | None:
    """Under torchrun (WORLD_SIZE > 1): the default process group, initialized here unless
    it already is (gloo on CPU; NCCL on CUDA, this process's device set from LOCAL_RANK
    first). None outside torchrun."""
    if torchrun_world_size() <= 1:
        return None
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo",
                                timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(dist.get_world_size(), dist.get_rank(), dist.get_backend())


@contextlib.contextmanager
def tensor_parallel_run(device: str):
    """A torchrun script's process group (`init_tensor_parallel`), destroyed when the block
    ends, however it ends."""
    group = init_tensor_parallel(device)
    try:
        yield group
    finally:
        dist.destroy_process_group()


def _prepare(model):
    """Exact-length generations: no EOS."""
    model.eval()
    config = model.generation_config
    config.eos_token_id = None
    config.pad_token_id = PAD_TOKEN_ID
    return model


def _random_model(name: str, device: str, dtype: torch.dtype, weights: str):
    model = random_model(name, device, dtype, seed=SEED)
    return peak_weights(model) if weights == "peaked" else model


def _load_one_process(spec: PairSpec, device: str, dtype: torch.dtype, weights: str) -> list:
    if spec.random_init:
        return [_random_model(name, device, dtype, weights) for name in _names(spec)]
    return [AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)
            for name in _names(spec)]


def _load_tensor_parallel(spec: PairSpec, device: str, dtype: torch.dtype, weights: str) -> list:
    """The target split over the default group's ranks, the draft whole on each; random-init
    models through a temporary folder that rank 0 writes (a collective: every rank calls)."""
    folder = [None, None]                # the folder, or rank 0's error
    if spec.random_init:
        if dist.get_rank() == 0:
            folder[0] = tempfile.mkdtemp(prefix="flashspec_tok_per_s_")
            try:
                for role, name in zip(("target", "draft"), _names(spec)):
                    model = _random_model(name, device, dtype, weights)
                    model.save_pretrained(os.path.join(folder[0], role))
                    del model
            except Exception as error:
                shutil.rmtree(folder[0], ignore_errors=True)
                folder[1] = f"{type(error).__name__}: {error}"
                dist.broadcast_object_list(folder, src=0)   # the other ranks stop too
                raise
        dist.broadcast_object_list(folder, src=0)
        if folder[1] is not None:
            raise RuntimeError(f"rank 0 could not build the random-init models: {folder[1]}")
    paths = ([os.path.join(folder[0], role) for role in ("target", "draft")[:len(_names(spec))]]
             if spec.random_init else _names(spec))
    try:
        models = [AutoModelForCausalLM.from_pretrained(
            paths[0], dtype=dtype, distributed_config=DistributedConfig(tp_plan="auto"))]
        models += [AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
                   for path in paths[1:]]
    finally:
        if spec.random_init:
            dist.barrier()               # every rank has read the folder
            if dist.get_rank() == 0:
                shutil.rmtree(folder[0], ignore_errors=True)
    return models


def _names(spec: PairSpec) -> list[str]:
    return [name for name in (spec.target, spec.draft) if name is not None]


def load_pair(spec: PairSpec, device: str, dtype: torch.dtype, weights: str = "random",
              tensor_parallel: bool = False, gpus: int = 1):
    """(flashspec-wrapped target, draft or None, description); `weights` "peaked" applies
    `peak_weights` to random-init models. With `tensor_parallel` (under torchrun, after
    `init_tensor_parallel`; a collective), the target is split over the default group's
    ranks and the draft replicated (see the module docstring). With `gpus` > 1 (one
    process), the target is spread over that many GPUs (`spread_over_gpus`) and the draft
    sits on its LM head's GPU."""
    if gpus > 1 and (tensor_parallel or device != "cuda"):
        raise ValueError(f"`gpus`={gpus} spreads the target over GPUs in one process: it "
                         "needs device 'cuda' and no tensor parallelism")
    if weights not in WEIGHTS:
        raise ValueError(f"`weights`={weights!r} is not allowed: use one of "
                         f"{', '.join(WEIGHTS)}")
    if not spec.random_init and weights != "random":
        raise ValueError(f"`weights`={weights!r} applies to random-init pairs; {spec.label!r} "
                         "has trained weights")
    load = _load_tensor_parallel if tensor_parallel else _load_one_process
    models = [_prepare(model) for model in load(spec, device, dtype, weights)]
    if gpus > 1:
        spread_over_gpus(models[0], gpus)
        models[1:] = [draft.to(models[0].get_output_embeddings().weight.device)
                      for draft in models[1:]]
    target, draft = flashspec.wrap(models[0]), models[1] if len(models) > 1 else None
    vocab_size = target.config.vocab_size
    world_size = dist.get_world_size() if tensor_parallel else 1
    description = {"target": model_name(spec.target),
                   "draft": None if draft is None else model_name(spec.draft),
                   "weights": WEIGHTS[weights] if spec.random_init else "trained",
                   "vocab_size": vocab_size,
                   "gpus": world_size if tensor_parallel else gpus,
                   "device_map": getattr(target, "hf_device_map", None) if gpus > 1 else None,
                   "target_weight_bytes": weight_bytes(target),
                   "draft_weight_bytes": None if draft is None else weight_bytes(draft),
                   "target_weight_bytes_per_rank": weight_bytes(target, local=True),
                   # What all-gathering the logits (stock's colwise_gather_output LM head)
                   # sends per row and step from each rank: its vocabulary shard's logits.
                   "logits_gather_bytes_per_row": (
                       -(-vocab_size // world_size) * dtype.itemsize if tensor_parallel
                       else None)}
    return target, draft, description


def spread_over_gpus(model, gpus: int):
    """Spread `model` (on one GPU) over GPUs 0 to `gpus` - 1 with accelerate, in place, as
    ``from_pretrained(..., device_map="balanced")`` places it: its layers in runs of about
    equal bytes, one GPU after another (the embedding on the first). Returns `model`."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    if torch.cuda.device_count() < gpus:
        raise ValueError(f"`gpus`={gpus}: only {torch.cuda.device_count()} CUDA devices here")
    keep = model._no_split_modules
    budget = get_balanced_memory(model, max_memory={index: torch.cuda.mem_get_info(index)[1]
                                                   for index in range(gpus)},
                                 no_split_module_classes=keep)
    device_map = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=keep)
    return dispatch_model(model, device_map)


def weight_bytes(model, local: bool = False) -> int:
    """Bytes of the parameters (`local`: this rank's shards of a tensor-parallel model's);
    `parameters()` yields a tied embedding once."""
    return sum(p.to_local().nbytes if local and isinstance(p, DTensor)
               else p.numel() * p.element_size() for p in model.parameters())
