"""The tok/s sweep of scripts/tok_per_s.py: its variants (stock and flashspec generate()
settings), the runs of a pair, one row per (B, decoding, G, variant) with the ratios between
rows, and the JSON report. The script's docstring describes what each variant and figure is.

Under torchrun every rank runs every call (the target's layers and flashspec's LM-head
exchange are collectives); rank 0's rows are the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import transformers
from transformers import AutoTokenizer, GenerationConfig

import flashspec
from flashspec import parallel
from flashspec.bench.cli import Progress, package_version
from flashspec.bench.pairs import (DTYPES, PAD_TOKEN_ID, SEED, PairSpec, TensorParallel,
                                   load_pair)
from flashspec.bench.prompt_sets import PROMPT_SETS, encode_prompts, load_prompts
from flashspec.bench.random_init import eagle3_shapes, random_eagle3, random_mtp
from flashspec.generation.mtp import mtp_layers
from flashspec.bench.timing import expected_tok_s, step_ms, timed_calls


SAMPLING = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
DECODINGS = {"greedy": {"do_sample": False}, "sample": SAMPLING}
RANDOM_PROMPTS = "random"


STOCK_ASSISTED_MAX_BATCH = 1

PLAIN_VARIANTS = ("hf", "hf_static_compile", "flash_plain")
STOCK_TWIN = {"flash_self": "hf_assisted_self", "flash_self_materialized": "hf_assisted_self",
              "flash_draft": "hf_assisted", "flash_draft_materialized": "hf_assisted",
              "flash_lookup": "hf_lookup", "flash_lookup_materialized": "hf_lookup"}
MATERIALIZED_TWIN = {"flash_self": "flash_self_materialized",
                     "flash_draft": "flash_draft_materialized",
                     "flash_lookup": "flash_lookup_materialized"}

# What a tensor-parallel target (under torchrun) does not run, and why. Stock assisted
# generation and prompt lookup run there (at B=1, as everywhere), giving the flash rows
# their stock twins.
_MATERIALIZED_REFUSED = ("skipped: flashspec refuses sampler='materialized' with a "
                         "tensor-parallel target (it would gather the logits)")
TENSOR_PARALLEL_SKIPS = {
    "hf_static_compile": "skipped: not measured with a tensor-parallel target (transformers' "
                         "compiled static-cache generate over DTensor layers)",
    "flash_self_materialized": _MATERIALIZED_REFUSED,
    "flash_draft_materialized": _MATERIALIZED_REFUSED,
    "flash_lookup_materialized": _MATERIALIZED_REFUSED,
}


class Skipped(Exception):
    """A variant that cannot run in this setting; its message is the row's status."""


class Case(NamedTuple):
    """One (pair, B, G) setting, as the variants see it; `num_drafts` None for plain rows
    and `draft` None for a pair without a draft model; `tensor_parallel` when the target is
    split over torchrun's ranks."""

    target: torch.nn.Module
    draft: torch.nn.Module | None
    batch_size: int
    num_drafts: int | None
    cuda: bool
    tensor_parallel: bool = False
    eagle3: flashspec.Eagle3 | None = None


class Variant(NamedTuple):
    """Generate kwargs for a case (raises Skipped), and the engine sampler of a flash variant
    ("fused" / "materialized"; None for stock)."""

    kwargs: Callable[[Case], dict]
    engine_sampler: str | None


def _assistant(case: Case, assistant: str) -> torch.nn.Module:
    if assistant == "self":
        return case.target
    if case.draft is None:
        raise Skipped("skipped: no draft model (give --draft, or --random-init TARGET,DRAFT)")
    return case.draft


def _stock(case: Case) -> dict:
    return {}


def _stock_static_compile(case: Case) -> dict:
    if not case.cuda:
        raise Skipped("skipped: transformers compiles the static-cache forward on CUDA only; "
                      "uncompiled on CPU it is not what is measured")
    return {"cache_implementation": "static"}


def _check_stock_batch(case: Case) -> None:
    if case.batch_size > STOCK_ASSISTED_MAX_BATCH:
        raise Skipped("skipped: stock assisted generation (prompt lookup too) refuses "
                      "batch_size > 1")


def _stock_assisted(case: Case, assistant: str) -> dict:
    _check_stock_batch(case)
    model = _assistant(case, assistant)
    # Stock reads these from the assistant's generation config only, not from generate()'s
    # kwargs; written before each call since G changes along the sweep. Threshold 0: stock's
    # default 0.4 would stop drafting before G.
    config = model.generation_config
    config.num_assistant_tokens = case.num_drafts
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0
    return {"assistant_model": model}


def _stock_lookup(case: Case) -> dict:
    _check_stock_batch(case)
    return {"prompt_lookup_num_tokens": case.num_drafts}


def _flash(case: Case, sampler: str, drafter: str | None = None) -> dict:
    kwargs = {"sampler": sampler, "seed": SEED,
              "return_dict_in_generate": True}
    if drafter == "lookup":
        kwargs["prompt_lookup_num_tokens"] = case.num_drafts
    elif drafter == "mtp":
        if mtp_layers(case.target) is None:
            raise Skipped("skipped: the target has no MTP layers (its config has no "
                          "num_mtp_layers)")
        kwargs.update(use_mtp=True, num_assistant_tokens=case.num_drafts)
    elif drafter == "eagle3":
        if case.eagle3 is None:
            raise Skipped("skipped: no EAGLE-3 head (give --eagle3)")
        kwargs.update(drafter=case.eagle3, num_assistant_tokens=case.num_drafts)
    elif drafter is not None:
        kwargs.update(assistant_model=_assistant(case, drafter),
                      num_assistant_tokens=case.num_drafts,
                      num_assistant_tokens_schedule="constant")
    return kwargs


# In table order: hf first, so that later rows can compare their tokens to it.
VARIANTS: dict[str, Variant] = {
    "hf": Variant(_stock, None),
    "hf_static_compile": Variant(_stock_static_compile, None),
    "hf_assisted_self": Variant(partial(_stock_assisted, assistant="self"), None),
    "hf_assisted": Variant(partial(_stock_assisted, assistant="draft"), None),
    "hf_lookup": Variant(_stock_lookup, None),
    "flash_plain": Variant(partial(_flash, sampler="flash"), "fused"),
    "flash_self": Variant(partial(_flash, sampler="flash", drafter="self"), "fused"),
    "flash_self_materialized": Variant(
        partial(_flash, sampler="materialized", drafter="self"), "materialized"),
    "flash_draft": Variant(partial(_flash, sampler="flash", drafter="draft"), "fused"),
    "flash_draft_materialized": Variant(
        partial(_flash, sampler="materialized", drafter="draft"), "materialized"),
    "flash_lookup": Variant(partial(_flash, sampler="flash", drafter="lookup"), "fused"),
    "flash_lookup_materialized": Variant(
        partial(_flash, sampler="materialized", drafter="lookup"), "materialized"),
    "flash_eagle3": Variant(partial(_flash, sampler="flash", drafter="eagle3"), "fused"),
    "flash_mtp": Variant(partial(_flash, sampler="flash", drafter="mtp"), "fused"),
}


class Prompts(NamedTuple):
    """One batch's prompts, as generate() takes them."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    description: dict        # the row's "prompts"


def eagle3_head(source: str, target) -> "flashspec.Eagle3":
    """The EAGLE-3 head of --eagle3: random weights at a shipped published shape
    (`flashspec.bench.random_init.random_eagle3`), else a trained head's folder or Hub id."""
    if source in eagle3_shapes():
        return random_eagle3(target, source)
    return flashspec.Eagle3.from_pretrained(source, target)


def random_prompts(batch_size: int, length: int, vocab_size: int, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED)
    # From 1: 0 is the pad token (and the tiny pair's EOS).
    return torch.randint(1, vocab_size, (batch_size, length), generator=generator).to(device)


def build_prompts(source: str, batch_size: int, length: int, vocab_size: int, tokenizer,
                  device: str) -> Prompts:
    """B prompts: random ids of `length`, or set `source`'s prompts cycled in file order,
    left padded, at most `length` tokens each."""
    if source == RANDOM_PROMPTS:
        input_ids = random_prompts(batch_size, length, vocab_size, device)
        return Prompts(input_ids, torch.ones_like(input_ids),
                       {"source": source, "mean_tokens": float(length), "truncated": 0})
    records = load_prompts(source)
    texts = [records[row % len(records)]["prompt"] for row in range(batch_size)]
    encoded = encode_prompts(tokenizer, texts, max_length=length)
    description = {"source": source,
                   "mean_tokens": encoded.attention_mask.sum().item() / batch_size,
                   "truncated": int(encoded.truncated.sum())}
    return Prompts(encoded.input_ids.to(device), encoded.attention_mask.to(device), description)


def describe_prompts(args: argparse.Namespace) -> dict:
    if args.prompts == RANDOM_PROMPTS:
        return {"source": RANDOM_PROMPTS, "length": args.prompt_length,
                "what": f"random token ids in [1, vocab), torch.Generator seeded {SEED}"}
    return {"source": args.prompts, "max_length": args.prompt_length,
            "what": PROMPT_SETS[args.prompts],
            "encoding": "flashspec.bench.prompt_sets.encode_prompts with the target's "
                        "tokenizer; row i gets the set's prompt i mod n"}


def _status_of(error: Exception) -> str:
    message = str(error).strip().splitlines()
    return f"error: {type(error).__name__}: {message[0] if message else ''}"[:300]


def _summary(stats) -> dict:
    """`SpeculationStats.summary()` with NaN (no drafts) as None, which JSON can hold."""
    return {key: None if isinstance(value, float) and math.isnan(value) else value
            for key, value in stats.summary().items()}


def _sequences(output) -> torch.Tensor:
    return output if torch.is_tensor(output) else output.sequences


def summary_bytes_per_row(case: Case, decoding: str) -> dict:
    """Bytes each rank sends per row (per verified position) in `flashspec.parallel`'s
    exchange of each operation, at `decoding`'s parameters and the target's vocabulary
    split (`flashspec.parallel.summary_layout`; a retry or completion, rare, adds more)."""
    config = GenerationConfig(**DECODINGS[decoding])
    params = flashspec.SamplingParams.from_generation_config(config, case.batch_size)
    shards = parallel.VocabShards.chunked(case.target.config.vocab_size)
    return {op: parallel.summary_layout(op, shards, params).bytes_per_row
            for op in ("argmax", "sample", "verify")}


def exchange_figures(stats: parallel.ExchangeStats, case: Case, decoding: str) -> dict:
    """A call's `flashspec.parallel` counters (this rank's contribution; it receives
    world_size - 1 times as much), and per step (one exchange: an LM-head call of the
    target or of a tensor-parallel assistant; a retry counts as one more) and per row and
    step (a row of a sampling or drafting step, a verified position of a verification)."""
    sent = stats.summary_bytes + stats.completion_bytes
    return {**dataclasses.asdict(stats), "bytes": sent,
            "bytes_per_step": _ratio(sent, stats.calls),
            "bytes_per_row_per_step": _ratio(sent, stats.rows),
            "summary_bytes_per_row": summary_bytes_per_row(case, decoding)}


def run_variant(name: str, case: Case, inputs: dict, args: argparse.Namespace,
                decoding: str) -> tuple[dict, torch.Tensor | None]:
    """The row of `name` (without ratios), and its last call's sequences (None if it did not
    run). With a tensor-parallel target, a flash row's "exchange" gives the bytes the ranks
    exchanged in its last call (`exchange_figures`)."""
    row = {"variant": name, "status": "ok", "first_call_seconds": None, "seconds": None,
           "tok_s": None, "flash_stats": None, "step_ms": None, "expected_tok_s": None,
           "exchange": None}
    variant = VARIANTS[name]
    exchanged = [None]
    try:
        if case.tensor_parallel and name in TENSOR_PARALLEL_SKIPS:
            raise Skipped(TENSOR_PARALLEL_SKIPS[name])
        kwargs = variant.kwargs(case)

        def generate():
            torch.manual_seed(SEED)          # stock sampling draws from torch's generator
            parallel.reset_stats()
            output = case.target.generate(**inputs, **kwargs)
            exchanged[0] = parallel.stats()
            return output

        first_call, seconds, output = timed_calls(generate, args.reps, case.cuda)
    except Skipped as skipped:
        row["status"] = str(skipped)
        return row, None
    except Exception as error:  # noqa: BLE001 - a broken variant must not stop the others
        if case.cuda:
            torch.cuda.empty_cache()
        row["status"] = _status_of(error)
        return row, None
    sequences = _sequences(output)
    generated = sequences.shape[1] - inputs["input_ids"].shape[1]
    if generated != args.new_tokens:
        row["status"] = f"error: generated {generated} tokens, expected {args.new_tokens}"
        return row, None
    row["first_call_seconds"] = first_call
    row["seconds"] = seconds
    row["tok_s"] = case.batch_size * args.new_tokens / statistics.median(seconds)
    if variant.engine_sampler is not None:
        row["flash_stats"] = _summary(output.flash_stats)
        if case.tensor_parallel:
            row["exchange"] = exchange_figures(exchanged[0], case, decoding)
        verify_width = 0 if case.num_drafts is None else min(case.num_drafts, args.new_tokens - 1)
        if case.cuda:
            row["step_ms"] = step_ms(case.target, generate, variant.engine_sampler, verify_width)
        if row["step_ms"] is not None:
            row["expected_tok_s"] = expected_tok_s(row["step_ms"], case.batch_size, verify_width,
                                                   row["flash_stats"]["mean_accepted_length"],
                                                   args.assumed_acceptance_length)
    return row, sequences


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def add_ratios(rows: list[dict], target_bytes: int, copy_gbps: float) -> None:
    """Ratios between the rows of one (pair, B, decoding), twins matched on G, and the plain
    rows' weight bandwidth (`target_bytes`: what one rank reads per forward)."""
    tok_s = {(row["variant"], row["num_drafts"]): row["tok_s"] for row in rows}
    for row in rows:
        name, num_drafts = row["variant"], row["num_drafts"]
        row["ratio"] = {
            "vs_hf_static_compile": _ratio(row["tok_s"], tok_s.get(("hf_static_compile", None))),
            "vs_hf": _ratio(row["tok_s"], tok_s.get(("hf", None))),
            "vs_stock_assisted": _ratio(row["tok_s"],
                                        tok_s.get((STOCK_TWIN.get(name), num_drafts))),
            "vs_materialized": _ratio(row["tok_s"],
                                      tok_s.get((MATERIALIZED_TWIN.get(name), num_drafts))),
        }
        # At batch B one forward reads the weights once and yields B tokens.
        row["weight_bandwidth_fraction"] = (
            target_bytes * row["tok_s"] / row["batch_size"] / (copy_gbps * 1e9)
            if name in PLAIN_VARIANTS and row["tok_s"] is not None else None)


class Run(NamedTuple):
    """One row to measure within a pair."""

    batch_size: int
    decoding: str
    num_drafts: int | None
    variant: str


def plan_runs(args: argparse.Namespace) -> list[Run]:
    """Per (B, decoding): the plain variants once, then the speculative ones once per G."""
    plain = [name for name in args.variants if name in PLAIN_VARIANTS]
    speculative = [name for name in args.variants if name not in PLAIN_VARIANTS]
    runs = []
    for batch in args.batch_sizes:
        for decoding in args.decoding:
            runs += [Run(batch, decoding, None, name) for name in plain]
            runs += [Run(batch, decoding, num_drafts, name)
                     for num_drafts in args.num_drafts for name in speculative]
    return runs


# The calls' seconds too: a run whose JSON does not come back still shows their spread.
ROW_LINE_KEYS = ("pair", "batch_size", "decoding", "num_drafts", "variant", "status", "tok_s",
                 "first_call_seconds", "seconds", "step_ms", "flash_stats", "exchange",
                 "same_tokens_as_hf")


def run_group(pair: str, runs: list[Run], target, draft, prompts: Prompts,
              args: argparse.Namespace, cuda: bool, progress: Progress,
              tensor_parallel: bool = False, eagle3=None) -> list[dict]:
    """The rows of one (pair, B, decoding), hf first, without ratios."""
    batch, decoding = runs[0].batch_size, runs[0].decoding
    inputs = {"input_ids": prompts.input_ids, "attention_mask": prompts.attention_mask,
              "max_new_tokens": args.new_tokens, "pad_token_id": PAD_TOKEN_ID,
              "eos_token_id": None, **DECODINGS[decoding]}
    greedy = not DECODINGS[decoding]["do_sample"]
    rows, hf_sequences = [], None
    for run in runs:
        progress.start(f"{pair} B={batch} {decoding} "
                       f"{'' if run.num_drafts is None else f'G={run.num_drafts} '}{run.variant}")
        case = Case(target, draft, batch, run.num_drafts, cuda, tensor_parallel, eagle3)
        row, sequences = run_variant(run.variant, case, inputs, args, decoding)
        row = {"pair": pair, "batch_size": batch, "decoding": decoding,
               "num_drafts": run.num_drafts, **row, "prompts": prompts.description,
               "same_tokens_as_hf": None}
        if run.variant == "hf":
            hf_sequences = sequences
        elif greedy and sequences is not None and hf_sequences is not None:
            row["same_tokens_as_hf"] = bool(torch.equal(sequences, hf_sequences))
        rows.append(row)
        # The result as soon as it is known: a run cut short still leaves its figures.
        progress.write(json.dumps({key: row[key] for key in ROW_LINE_KEYS}))
        progress.finish()
    return rows


def run_pair(spec: PairSpec, args: argparse.Namespace, device: str, copy_gbps: float,
             progress: Progress, tensor_parallel: TensorParallel | None = None
             ) -> tuple[dict, list[dict]]:
    """The pair's description and rows; with `tensor_parallel` (a collective: every rank
    calls it), the target split over its ranks (`flashspec.bench.pairs.load_pair`)."""
    progress.write(f"loading pair {spec.label} ...")
    target, draft, description = load_pair(spec, device, DTYPES[args.dtype], args.weights,
                                           tensor_parallel=tensor_parallel is not None,
                                           gpus=args.gpus)
    tokenizer = (None if args.prompts == RANDOM_PROMPTS
                 else AutoTokenizer.from_pretrained(spec.target))
    if spec.random_init and mtp_layers(target) is not None and "flash_mtp" in args.variants:
        random_mtp(target)           # a random-init target's MTP layers are random too
    eagle3 = None
    if args.eagle3 is not None and not tensor_parallel:
        eagle3 = eagle3_head(args.eagle3, target)
        description["eagle3"] = {"source": args.eagle3,
                                 "weight_bytes": sum(p.numel() * p.element_size()
                                                     for p in eagle3.model.parameters()),
                                 "taps": list(eagle3.taps)}
    runs, rows = plan_runs(args), []
    for batch in args.batch_sizes:
        prompts = build_prompts(args.prompts, batch, args.prompt_length,
                                target.config.vocab_size, tokenizer, device)
        for decoding in args.decoding:
            group_runs = [run for run in runs
                          if run.batch_size == batch and run.decoding == decoding]
            group = run_group(spec.label, group_runs, target, draft, prompts, args,
                              device == "cuda", progress, tensor_parallel is not None, eagle3)
            add_ratios(group, description["target_weight_bytes_per_rank"], copy_gbps)
            rows += group
    del target, draft, eagle3
    gc.collect()         # the engine cached on the decoder refers back to it: a cycle
    if device == "cuda":
        torch.cuda.empty_cache()
    return description, rows


def build_report(args: argparse.Namespace, device: str, copy_gbps: float, pairs: dict,
                 rows: list[dict], tensor_parallel: TensorParallel | None = None) -> dict:
    """The JSON report; `tensor_parallel` gives its "world_size" and "backend" (1 and None
    for one process)."""
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "world_size": 1 if tensor_parallel is None else tensor_parallel.world_size,
        "backend": None if tensor_parallel is None else tensor_parallel.backend,
        "versions": {"torch": torch.__version__, "triton": package_version("triton"),
                     "transformers": transformers.__version__,
                     "flashspec": flashspec.__version__, "python": sys.version.split()[0]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": {key: str(value) if isinstance(value, Path) else value
                 for key, value in vars(args).items()},
        "decodings": {name: {**DECODINGS[name], "seed": SEED} for name in args.decoding},
        "prompts": describe_prompts(args),
        "copy_gbps": copy_gbps,
        "pairs": pairs,
        "rows": rows,
    }
