"""The runs of scripts/acceptance_rate.py: its models (trained or random-init), the prompt
sets encoded in batches, one configuration (drafter, G) generated over a set with
flashspec's engine and summarised (`flashspec.bench.acceptance`), and the JSON report."""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import flashspec
from flashspec.bench.acceptance import Z_LIMIT, acceptance_summary, merge_stats
from flashspec.bench.cli import Progress, model_name, package_version
from flashspec.bench.prompt_sets import encode_prompts, load_prompts
from flashspec.bench.random_init import WEIGHTS, peak_weights, random_model


# --random-init: the weights are seeded with this, whatever --seed (which seeds sampling).
WEIGHTS_SEED = 0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def sampling_kwargs(args: argparse.Namespace) -> dict:
    if not args.sample:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k,
            "top_p": args.top_p, "min_p": args.min_p}


def drafter_kwargs(drafter: str, num_drafts: int, target, draft,
                   args: argparse.Namespace, eagle3=None) -> dict:
    if drafter == "lookup":
        return {"prompt_lookup_num_tokens": num_drafts,
                "max_matching_ngram_size": args.max_matching_ngram_size}
    if drafter == "eagle3":
        return {"drafter": eagle3, "num_assistant_tokens": num_drafts}
    # No confidence threshold: every step drafts its G, the positions' rates count them all.
    return {"assistant_model": target if drafter == "self" else draft,
            "num_assistant_tokens": num_drafts, "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0}


def encode_set(tokenizer, name: str, args: argparse.Namespace, device: str) -> tuple[list, dict]:
    """The set's batches, each (first prompt index, input_ids, attention_mask), and its
    description for the report."""
    prompts = load_prompts(name)[:args.prompts]
    batches, truncated, lengths = [], 0, []
    for start in range(0, len(prompts), args.batch_size):
        texts = [record["prompt"] for record in prompts[start:start + args.batch_size]]
        encoded = encode_prompts(tokenizer, texts, args.max_prompt_tokens,
                                 chat_template=not args.no_chat_template)
        batches.append((start, encoded.input_ids.to(device), encoded.attention_mask.to(device)))
        truncated += int(encoded.truncated.sum())
        lengths += encoded.attention_mask.sum(dim=1).tolist()
    description = {"prompts": len(prompts), "ids": [record["id"] for record in prompts],
                   "truncated": truncated, "mean_prompt_tokens": sum(lengths) / len(lengths),
                   "max_prompt_tokens": max(lengths)}
    return batches, description


def run_configuration(target, draft, batches: list, drafter: str, num_drafts: int,
                      args: argparse.Namespace, pad_token_id: int, progress: Progress,
                      label: str, eagle3=None) -> dict:
    """Generate every batch of a set with one drafter and G; the summary of all of them."""
    parts, seconds, generated = [], 0.0, 0
    for start, input_ids, attention_mask in batches:
        progress.start(label)
        begin = time.perf_counter()
        output = target.generate(
            input_ids=input_ids, attention_mask=attention_mask, sampler="flash",
            max_new_tokens=args.new_tokens, pad_token_id=pad_token_id,
            # Row i of the set gets seed + i whatever the batching.
            seed=args.seed + start, return_dict_in_generate=True,
            **drafter_kwargs(drafter, num_drafts, target, draft, args, eagle3),
            **sampling_kwargs(args))
        seconds += time.perf_counter() - begin
        parts.append(output.flash_stats)
        generated += int(output.flash_stats.emitted.sum())
        progress.finish()
    return {"seconds": seconds, "generated_tokens": generated,
            **acceptance_summary(merge_stats(parts), num_drafts)}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return DTYPES[name]


@functools.cache
def load_tokenizer(name: str):
    """Cached: parse_args loads the tokenizer to check its size, main to encode the prompts."""
    return AutoTokenizer.from_pretrained(name)


def load_model(name: str, args: argparse.Namespace, device: str, dtype: torch.dtype):
    """Hub id or folder `name` with its trained weights; with --random-init, a model of shape
    `name` with seeded random weights, peaked with --weights peaked."""
    if args.random_init is None:
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, device_map=device).eval()
    model = random_model(name, device, dtype, seed=WEIGHTS_SEED)
    return peak_weights(model) if args.weights == "peaked" else model


def load_models(args: argparse.Namespace, device: str, dtype: torch.dtype):
    """(flashspec-wrapped target, draft or None when no drafter needs it)."""
    target = flashspec.wrap(load_model(args.target, args, device, dtype))
    draft = load_model(args.draft, args, device, dtype) if "assistant" in args.drafter else None
    if args.ignore_eos:
        target.generation_config.eos_token_id = None
    return target, draft


def load_eagle3(args: argparse.Namespace, target):
    """The EAGLE-3 head of --eagle3 for `target` (None without the eagle3 drafter)."""
    return flashspec.Eagle3.from_pretrained(args.eagle3, target) if "eagle3" in args.drafter else None


def loading_text(args: argparse.Namespace, device: str, dtype: torch.dtype) -> str:
    models = args.target + (f" and {args.draft}" if "assistant" in args.drafter else "")
    if args.random_init is None:
        return f"loading {models} ({device}, {dtype}) ..."
    return f"building {models} ({WEIGHTS[args.weights]}, {device}, {dtype}) ..."


def describe_models(args: argparse.Namespace, target, tokenizer) -> dict:
    """The report's "models": the target, the draft (None without the assistant drafter),
    their weights, and the tokenizer that encoded the prompts, with their vocabulary sizes."""
    return {"target": model_name(args.target),
            "draft": model_name(args.draft) if "assistant" in args.drafter else None,
            "eagle3": model_name(args.eagle3) if "eagle3" in args.drafter else None,
            "weights": "trained" if args.random_init is None else WEIGHTS[args.weights],
            "vocab_size": target.config.vocab_size,
            "tokenizer": model_name(args.tokenizer), "tokenizer_size": len(tokenizer)}


def pad_token_id_of(tokenizer, target) -> int:
    """The pad id of the tokenizer or the generation config, else EOS (as transformers falls
    back to), else 0: it only fills rows that have finished."""
    for candidate in (tokenizer.pad_token_id, target.generation_config.pad_token_id,
                      tokenizer.eos_token_id):
        if candidate is not None:
            return candidate
    return 0


def build_report(args: argparse.Namespace, device: str, dtype: torch.dtype, models: dict,
                 prompt_sets: dict, rows: list[dict]) -> dict:
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "triton": package_version("triton"), "flashspec": package_version("flashspec"),
                     "python": sys.version.split()[0]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": {key: str(value) if isinstance(value, Path) else value
                 for key, value in vars(args).items()},
        "models": models,
        "dtype": str(dtype).removeprefix("torch."),
        "sampling": sampling_kwargs(args),
        "z_limit": Z_LIMIT,
        "prompt_sets": prompt_sets,
        "rows": rows,
    }
