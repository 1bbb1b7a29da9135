"""Tokens per second of generate() for a model pair: stock transformers vs flashspec's engine.

For each pair, batch size B, decoding, draft length G and variant: a first call (it also
compiles and captures CUDA graphs; its seconds are reported apart, ``first_call_seconds``),
then --reps timed calls of B prompts,
each generating exactly --new-tokens tokens (EOS disabled); tok/s = B * new_tokens /
median seconds (the device synchronized around each call). Plain variants run once per
(B, decoding), speculative ones once per G of --num-drafts. Decodings (--decoding):
``greedy``, and ``sample`` (T=0.6, top-k 20, top-p 0.95, seed 0).

Pairs (target + draft, same vocabulary), from one of:

* ``--pair`` presets: ``tiny``, flashspec's built-in tiny pair (trained weights,
  flashspec/assets/tiny_pair; the default); ``qwen3``, random weights at the shapes of
  Qwen3-1.7B + Qwen3-0.6B (the same as ``--random-init qwen3-1.7b,qwen3-0.6b``);
  ``llama``, Llama-3.1-8B + Llama-3.2-1B shapes (``--random-init llama-3.1-8b,llama-3.2-1b``);
* ``--target`` and ``--draft``: hub ids or local folders with trained weights;
* ``--random-init TARGET_SHAPE[,DRAFT_SHAPE]``: random weights at real shapes, offline; a
  SHAPE is the name of a config shipped in flashspec/assets/configs or the path of a
  config.json (see flashspec.bench.random_init).

Without a draft model (``--target`` alone, ``--random-init`` with one shape) the draft
variants are skipped; self-speculation and prompt lookup still run.

Prompts (--prompts): ``random`` token ids (from 1: 0 is the pad token), exactly
--prompt-length per row; or a prompt set shipped with flashspec (code_edit, summarize, chat;
see flashspec.bench.prompt_sets): row i of a batch gets the set's prompt i mod n, in file order,
through the target's tokenizer (its chat template if it has one), left padded, at most
--prompt-length tokens (a longer prompt keeps its end). Random-init models have no tokenizer,
so they take random prompts only.

On random prompts acceptance is whatever the pair does on noise: the random-weight drafts
accept almost nothing, prompt lookup finds almost no match, and self-speculation (the
target as its own assistant) accepts most drafts, losing some at near-ties of the nearly
flat random models (bf16 rounding differs between one-token and many-token forwards).
``--weights peaked`` makes the random models decisive (`flashspec.bench.random_init.peak_weights`),
so that self-speculation accepts every draft at the same cost per forward. The expected
tok/s at acceptance 1 (below) is the upper bound that speculation can reach with this engine.

Variants:

* ``hf``: stock generate (dynamic cache);
* ``hf_static_compile``: stock generate with ``cache_implementation="static"``, which
  transformers compiles; CUDA only (on CPU transformers does not compile it, so it is
  skipped: an uncompiled static cache is not what is measured);
* ``hf_assisted_self`` / ``hf_assisted``: stock assisted generation with the target itself /
  the draft as assistant, G drafts per round;
* ``hf_lookup``: stock prompt lookup (``prompt_lookup_num_tokens=G``); the stock rows with
  drafts run at B=1 only (stock refuses larger batches);
* ``flash_plain``: ``sampler="flash"`` without drafts (on CPU the engine runs the same steps
  eagerly, so that the fused and materialized rows compare one engine);
* ``flash_self`` / ``flash_draft`` / ``flash_lookup``: ``sampler="flash"`` with the target
  itself / the draft as assistant / prompt lookup, G drafts per round, constant schedule;
* ``flash_self_materialized`` / ``flash_draft_materialized`` / ``flash_lookup_materialized``:
  the same with ``sampler="materialized"`` (same engine, logits materialized and sampled by
  torch ops).

Stock assisted generation reads the draft length only from the assistant's generation
config, so before each stock call the assistant gets ``num_assistant_tokens=G``, the
"constant" schedule and ``assistant_confidence_threshold=0`` there: stock then drafts G
tokens every round as flashspec does (stock's default threshold 0.4 would stop drafting
early). flashspec takes them as generate() arguments. Prompt lookup matches n-grams of up
to 2 tokens (transformers' default) in both.

Ratios compare rows of one (pair, B, decoding): x_hf and x_stc against the plain stock
rows; a flash row's stock twin (hf_assisted_self, hf_assisted, hf_lookup) and a fused
row's materialized twin are the rows of the same G.

On CUDA the flash rows also give the engine's captured step graphs' GPU time (median of
3 x 20 replays after the timed calls; the state they mutate is the finished run's): the
plain step, or one round of drafts (draft_first + (G-1) draft_next; none for prompt lookup,
which drafts inside the verification step) and the verification of G drafts; and the tok/s
those imply: B tokens per plain step, B * (1 - a^(G+1)) / (1 - a) tokens per round at an
i.i.d. per-position acceptance a (reported at a = 1 and at the run's measured tokens per
round). Plain rows (hf, hf_static_compile, flash_plain) give the weight bytes read per second
(target weights once per forward, one forward per B tokens) as a fraction of the copy
bandwidth measured at start (read + written bytes of a 1 GiB device copy; 64 MiB on CPU).
With greedy decoding every row records whether its tokens equal the hf row's of the same
(B, decoding) (bf16 near-ties may legitimately differ). A variant that fails is recorded
with its error and the run goes on.

Defaults depend on the device. On CUDA: B 1,4,16, prompt 128 + 256 new tokens, 3 timed
calls, bf16. On CPU: B 1,4, prompt 64 + 64 new tokens, 1 timed call, fp32, so that the
default run (tiny pair, every variant, greedy, G=5) takes about 30 s on 2 idle cores.

Run (from the repository root):

    PYTHONPATH=. python scripts/tok_per_s.py                 # tiny pair, CPU-sized on CPU
    PYTHONPATH=. python scripts/tok_per_s.py --pair tiny,qwen3,llama --decoding greedy,sample
    PYTHONPATH=. python scripts/tok_per_s.py --random-init qwen3-1.7b,qwen3-0.6b \\
        --weights peaked --batch-sizes 1 --num-drafts 2,4,8               # on a GPU
    PYTHONPATH=. python scripts/tok_per_s.py --target Qwen/Qwen3-8B --draft Qwen/Qwen3-0.6B \\
        --prompts code_edit --decoding greedy,sample                      # downloads

Writes to --out ``tok_per_s.json`` (device, versions, date, args with the defaults
resolved, decodings, prompts, copy bandwidth, pairs, and one row per pair, B, decoding, G
and variant) and ``tok_per_s.png`` (with matplotlib: a panel per pair, bars of tok/s grouped
by (B, decoding)), and prints a table last. Progress goes to stderr: a bar over all runs
(tqdm, on a terminal; else a line as each run starts), and each row's figures as one JSON
line as soon as it is measured (a run cut short keeps them). Offline unless --target/--draft
name hub models that are not cached.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import flashspec
from flashspec.bench.cli import (Progress, model_name, names, package_version, positive_int,
                                 positive_ints, pyplot_or_note, random_init_shapes,
                                 resolve_device)
from flashspec.assets import tiny_pair_path
from flashspec.generation.heads import output_head
from flashspec.generation.engine import cached_engine
from flashspec.bench.prompt_sets import PROMPT_SETS, encode_prompts, load_prompts
from flashspec.bench.random_init import WEIGHTS, config_names, peak_weights, random_model


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
SAMPLING = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
DECODINGS = {"greedy": {"do_sample": False}, "sample": SAMPLING}
RANDOM_PROMPTS = "random"
SEED = 0
PAD_TOKEN_ID = 0
# Defaults that depend on the device: the CPU ones keep the default run (tiny pair, every
# variant) near 30 s on 2 idle cores.
DEVICE_DEFAULTS = {
    "cuda": {"batch_sizes": [1, 4, 16], "prompt_length": 128, "new_tokens": 256, "reps": 3,
             "dtype": "bf16"},
    "cpu": {"batch_sizes": [1, 4], "prompt_length": 64, "new_tokens": 64, "reps": 1,
            "dtype": "fp32"},
}
GRAPH_REPLAYS = 20
GRAPH_TRIALS = 3
COPY_REPS = 5
GPU_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 64 << 20
STOCK_ASSISTED_MAX_BATCH = 1

PLAIN_VARIANTS = ("hf", "hf_static_compile", "flash_plain")
STOCK_TWIN = {"flash_self": "hf_assisted_self", "flash_self_materialized": "hf_assisted_self",
              "flash_draft": "hf_assisted", "flash_draft_materialized": "hf_assisted",
              "flash_lookup": "hf_lookup", "flash_lookup_materialized": "hf_lookup"}
MATERIALIZED_TWIN = {"flash_self": "flash_self_materialized",
                     "flash_draft": "flash_draft_materialized",
                     "flash_lookup": "flash_lookup_materialized"}


class Skipped(Exception):
    """A variant that cannot run in this setting; its message is the row's status."""


class Case(NamedTuple):
    """One (pair, B, G) setting, as the variants see it; `num_drafts` None for plain rows
    and `draft` None for a pair without a draft model."""

    target: torch.nn.Module
    draft: torch.nn.Module | None
    batch_size: int
    num_drafts: int | None
    cuda: bool


class Variant(NamedTuple):
    """Generate kwargs for a case (raises Skipped), and the engine sampler of a flash variant
    ("fused" / "materialized"; None for stock)."""

    kwargs: Callable[[Case], dict]
    engine_sampler: str | None


# ---------------------------------------------------------------- variants


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
}


# ---------------------------------------------------------------- models


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


# ---------------------------------------------------------------- prompts


class Prompts(NamedTuple):
    """One batch's prompts, as generate() takes them."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    description: dict        # the row's "prompts"


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


# ---------------------------------------------------------------- timing


def _synchronize(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def timed_calls(generate: Callable, reps: int, cuda: bool) -> tuple[float, list[float], object]:
    """Seconds of a first call (the engine's compilation and graph captures happen
    there) and of each of `reps` calls after it, and the last output."""
    seconds = []
    for _ in range(reps + 1):
        _synchronize(cuda)
        start = time.perf_counter()
        output = generate()
        _synchronize(cuda)
        seconds.append(time.perf_counter() - start)
    return seconds[0], seconds[1:], output


def copy_bandwidth_gbps(device: str) -> float:
    """GB/s (read + written bytes) of a large device-to-device copy, median of COPY_REPS."""
    cuda = device == "cuda"
    nbytes = GPU_COPY_BYTES if cuda else CPU_COPY_BYTES
    # ones, not empty: untouched CPU pages would read as the shared zero page, too fast.
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    destination = torch.empty_like(source)
    _, seconds, _ = timed_calls(partial(destination.copy_, source), COPY_REPS, cuda)
    return 2 * nbytes / statistics.median(seconds) / 1e9


def replay_ms(graphs: list) -> float:
    """GPU milliseconds of one replay of `graphs` in order (median of GRAPH_TRIALS runs of
    GRAPH_REPLAYS)."""
    trials = []
    for _ in range(GRAPH_TRIALS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(GRAPH_REPLAYS):
            for graph in graphs:
                graph.replay()
        torch.cuda.synchronize()
        trials.append((time.perf_counter() - start) * 1e3 / GRAPH_REPLAYS)
    return statistics.median(trials)


def step_ms(target, engine_sampler: str, verify_width: int) -> dict | None:
    """GPU time of the engine's captured steps for the call just made, None without graphs."""
    engine = cached_engine(output_head(target, "model").decoder)
    if engine is None or not engine.graphs_enabled or engine.sampler_kind != engine_sampler:
        return None
    graphs = engine.last_call_graphs
    if ("verify", verify_width) not in graphs:
        return {"plain": replay_ms([graphs["plain"]])} if "plain" in graphs else None
    verify = graphs[("verify", verify_width)]
    lookup = graphs.get(("lookup", verify_width))
    if lookup is not None:
        return {"draft_first": None, "draft_next": None, "draft_round": replay_ms([lookup]),
                "verify": replay_ms([verify])}
    if "draft_first" not in graphs or (verify_width > 1 and "draft_next" not in graphs):
        return None
    # draft_next alone would write past the draft buffer (its column count only grows);
    # draft_first resets it, so a whole round is replayed and draft_next derived from it.
    first = replay_ms([graphs["draft_first"]])
    later = [graphs["draft_next"]] * (verify_width - 1) if verify_width > 1 else []
    round_ms = replay_ms([graphs["draft_first"]] + later)
    return {"draft_first": first,
            "draft_next": (round_ms - first) / (verify_width - 1) if verify_width > 1 else None,
            "draft_round": round_ms, "verify": replay_ms([verify])}


def expected_tokens_per_round(acceptance: float, num_drafts: int) -> float:
    """Tokens a row emits per verification of `num_drafts` drafts when each draft is accepted
    with probability `acceptance` given the ones before it: sum of a^i for i = 0..G."""
    if acceptance == 1.0:
        return num_drafts + 1.0
    return (1.0 - acceptance ** (num_drafts + 1)) / (1.0 - acceptance)


def expected_tok_s(steps: dict, batch_size: int, verify_width: int,
                   measured_tokens_per_round: float) -> dict:
    """tok/s the step graphs allow: at acceptance 1, and at the run's tokens per round."""
    if "plain" in steps:
        per_second = batch_size * 1e3 / steps["plain"]
        return {"all_accepted": per_second, "at_measured_acceptance": per_second}
    rounds_per_second = 1e3 / (steps["draft_round"] + steps["verify"])
    return {"all_accepted": batch_size * rounds_per_second
            * expected_tokens_per_round(1.0, verify_width),
            "at_measured_acceptance": batch_size * rounds_per_second * measured_tokens_per_round}


# ---------------------------------------------------------------- one row


def _status_of(error: Exception) -> str:
    message = str(error).strip().splitlines()
    return f"error: {type(error).__name__}: {message[0] if message else ''}"[:300]


def _summary(stats) -> dict:
    """`SpeculationStats.summary()` with NaN (no drafts) as None, which JSON can hold."""
    return {key: None if isinstance(value, float) and math.isnan(value) else value
            for key, value in stats.summary().items()}


def _sequences(output) -> torch.Tensor:
    return output if torch.is_tensor(output) else output.sequences


def run_variant(name: str, case: Case, inputs: dict, args: argparse.Namespace) -> tuple[dict, torch.Tensor | None]:
    """The row of `name` (without ratios), and its last call's sequences (None if it did not run)."""
    row = {"variant": name, "status": "ok", "first_call_seconds": None, "seconds": None,
           "tok_s": None, "flash_stats": None, "step_ms": None, "expected_tok_s": None}
    variant = VARIANTS[name]
    try:
        kwargs = variant.kwargs(case)

        def generate():
            torch.manual_seed(SEED)          # stock sampling draws from torch's generator
            return case.target.generate(**inputs, **kwargs)

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
        verify_width = 0 if case.num_drafts is None else min(case.num_drafts, args.new_tokens - 1)
        if case.cuda:
            row["step_ms"] = step_ms(case.target, variant.engine_sampler, verify_width)
        if row["step_ms"] is not None:
            row["expected_tok_s"] = expected_tok_s(row["step_ms"], case.batch_size, verify_width,
                                                   row["flash_stats"]["mean_accepted_length"])
    return row, sequences


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def add_ratios(rows: list[dict], target_bytes: int, copy_gbps: float) -> None:
    """Ratios between the rows of one (pair, B, decoding), twins matched on G, and the plain
    rows' weight bandwidth."""
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


# ---------------------------------------------------------------- the sweep


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


ROW_LINE_KEYS = ("pair", "batch_size", "decoding", "num_drafts", "variant", "status", "tok_s",
                 "step_ms", "flash_stats", "same_tokens_as_hf")


def run_group(pair: str, runs: list[Run], target, draft, prompts: Prompts,
              args: argparse.Namespace, cuda: bool, progress: Progress) -> list[dict]:
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
        case = Case(target, draft, batch, run.num_drafts, cuda)
        row, sequences = run_variant(run.variant, case, inputs, args)
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
             progress: Progress) -> tuple[dict, list[dict]]:
    progress.write(f"loading pair {spec.label} ...")
    target, draft, description = load_pair(spec, device, DTYPES[args.dtype], args.weights)
    tokenizer = (None if args.prompts == RANDOM_PROMPTS
                 else AutoTokenizer.from_pretrained(spec.target))
    runs, rows = plan_runs(args), []
    for batch in args.batch_sizes:
        prompts = build_prompts(args.prompts, batch, args.prompt_length,
                                target.config.vocab_size, tokenizer, device)
        for decoding in args.decoding:
            group_runs = [run for run in runs
                          if run.batch_size == batch and run.decoding == decoding]
            group = run_group(spec.label, group_runs, target, draft, prompts, args,
                              device == "cuda", progress)
            add_ratios(group, description["target_weight_bytes"], copy_gbps)
            rows += group
    del target, draft
    gc.collect()         # the engine cached on the decoder refers back to it: a cycle
    if device == "cuda":
        torch.cuda.empty_cache()
    return description, rows


# ---------------------------------------------------------------- output


def build_report(args: argparse.Namespace, device: str, copy_gbps: float, pairs: dict,
                 rows: list[dict]) -> dict:
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
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


# Bar colours (tab20 indices): stock in greys and muted hues, each flash drafter one hue, its
# materialized twin the lighter shade of it.
VARIANT_COLORS = {"hf": 15, "hf_static_compile": 14, "hf_assisted_self": 11, "hf_assisted": 17,
                  "hf_lookup": 13, "flash_plain": 0, "flash_self": 2, "flash_self_materialized": 3,
                  "flash_draft": 4, "flash_draft_materialized": 5, "flash_lookup": 6,
                  "flash_lookup_materialized": 7}
G_HATCHES = ("", "//", "..", "xx", "\\\\", "++")


def _plot_series(report: dict, pair: str) -> dict:
    """(variant, G) -> {(B, decoding): tok/s} for the rows of `pair` that ran, in table order."""
    series = {}
    for row in report["rows"]:
        if row["pair"] == pair and row["tok_s"] is not None:
            bars = series.setdefault((row["variant"], row["num_drafts"]), {})
            bars[row["batch_size"], row["decoding"]] = row["tok_s"]
    return dict(sorted(series.items(),
                       key=lambda item: (list(VARIANTS).index(item[0][0]), item[0][1] or 0)))


def _minor_tick_label(value: float, every: bool) -> str:
    """`value` written plainly (not 2x10^2), where `every` minor tick is labelled or `value`
    is 2 or 5 times a power of ten (all of them would crowd an axis over a decade tall)."""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if every or round(mantissa) in (2, 5) else ""


def _plot_pair(ax, report: dict, pair: str) -> None:
    """Bars of tok/s: x groups (B, decoding), a bar per (variant, G) that ran, coloured by
    variant and, when more than one G ran, hatched by G and labelled with it."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    args = report["args"]
    groups = [(batch, decoding) for batch in args["batch_sizes"] for decoding in args["decoding"]]
    series = _plot_series(report, pair)
    sweep = len(args["num_drafts"]) > 1
    palette = plt.get_cmap("tab20")
    width = 0.8 / max(len(series), 1)
    for index, ((name, num_drafts), tok_s) in enumerate(series.items()):
        bars = [(group + index * width, tok_s[key]) for group, key in enumerate(groups)
                if key in tok_s]
        hatch = "" if num_drafts is None or not sweep else G_HATCHES[
            args["num_drafts"].index(num_drafts) % len(G_HATCHES)]
        label = name if num_drafts is None or not sweep else f"{name} G={num_drafts}"
        ax.bar(*zip(*bars), width=width, color=palette(VARIANT_COLORS[name]), hatch=hatch,
               edgecolor="0.25", linewidth=0.3, label=label)
    ax.set_xticks([group + 0.4 - width / 2 for group in range(len(groups))],
                  [f"B={batch}, {decoding}" for batch, decoding in groups])
    described = report["pairs"][pair]
    ax.set(yscale="log", ylabel="tokens / s",
           title=f"{pair}: {described['target']} + {described['draft'] or 'no draft'} "
                 f"({described['weights']}); {report['device']}, "
                 f"{report['prompts']['source']} prompts")
    low, high = ax.get_ylim()
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))  # not 10^2
    ax.yaxis.set_minor_formatter(FuncFormatter(
        lambda value, _: _minor_tick_label(value, every=high / low < 10)))
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def write_plot(report: dict, path: Path) -> None:
    """One panel per pair (see _plot_pair), wide enough for its bars; log y axis."""
    plt = pyplot_or_note(path)
    if plt is None:
        return
    pairs = list(report["pairs"])
    groups = len(report["args"]["batch_sizes"]) * len(report["args"]["decoding"])
    bars = groups * max(len(_plot_series(report, pair)) for pair in pairs)
    fig, axes = plt.subplots(len(pairs), 1, figsize=(min(40.0, max(10.0, 3.0 + 0.15 * bars)),
                                                     4.5 * len(pairs)), squeeze=False)
    for ax, pair in zip(axes[:, 0], pairs):
        _plot_pair(ax, report, pair)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def _fmt(value, width: int, digits: int = 0) -> str:
    if value is None or isinstance(value, str):
        return f"{value or '-':>{width}}"
    return f"{value:{width}.{digits}f}"


def _steps_text(steps: dict | None) -> str:
    if steps is None:
        return "-"
    if "plain" in steps:
        return f"plain {steps['plain']:.3f}"
    return f"draft {steps['draft_round']:.3f} + verify {steps['verify']:.3f}"


TABLE_LEGEND = """\
tok/s = B * new tokens / median s; 1st s = seconds of the first call (compilation and graph
capture included); x_stc, x_hf = / hf_static_compile, / hf; x_stk = / the stock
twin (assisted or lookup, same G); x_mat = fused / materialized (same G); acc = accepted /
drafted; len = tokens per target forward; exp@1 = tok/s the step graphs allow at acceptance 1;
bw = weight bytes read per s / copy bandwidth; ms/step = GPU ms of the captured plain step, or
of a round of G drafts and the verification of G drafts."""


def print_table(report: dict) -> None:
    args = report["args"]
    decodings = "; ".join(
        "greedy" if name == "greedy" else "sample (T={temperature}, top-k {top_k}, top-p {top_p}, "
        "seed {seed})".format(**values) for name, values in report["decodings"].items())
    print(f"\n{report['device']}, copy bandwidth {report['copy_gbps']:.0f} GB/s, {args['dtype']}, "
          f"{decodings}; {report['prompts']['source']} prompts of {args['prompt_length']} "
          f"tokens{'' if args['prompts'] == RANDOM_PROMPTS else ' at most'} + "
          f"{args['new_tokens']} new tokens; G in {','.join(map(str, args['num_drafts']))}")
    print(TABLE_LEGEND)
    width = max([4] + [len(row["pair"]) for row in report["rows"]])
    print(f"{'pair':{width}} {'B':>3} {'dec':6} {'G':>2} {'variant':25} {'tok/s':>9} {'1st s':>6} "
          f"{'x_stc':>6} {'x_hf':>6} {'x_stk':>6} {'x_mat':>6} {'acc':>5} {'len':>5} "
          f"{'exp@1':>9} {'bw':>5}  ms/step")
    for row in report["rows"]:
        head = (f"{row['pair']:{width}} {row['batch_size']:3d} {row['decoding']:6} "
                f"{_fmt(row['num_drafts'], 2)} {row['variant']:25}")
        if row["status"] != "ok":
            print(f"{head} {row['status']}"[:160])
            continue
        ratio, stats = row["ratio"], row["flash_stats"] or {}
        expected = (row["expected_tok_s"] or {}).get("all_accepted")
        print(f"{head} {_fmt(row['tok_s'], 9, 1)} {_fmt(row['first_call_seconds'], 6, 1)} "
              f"{_fmt(ratio['vs_hf_static_compile'], 6, 2)} "
              f"{_fmt(ratio['vs_hf'], 6, 2)} {_fmt(ratio['vs_stock_assisted'], 6, 2)} "
              f"{_fmt(ratio['vs_materialized'], 6, 2)} {_fmt(stats.get('acceptance_rate'), 5, 2)} "
              f"{_fmt(stats.get('mean_accepted_length'), 5, 2)} {_fmt(expected, 9, 1)} "
              f"{_fmt(row['weight_bandwidth_fraction'], 5, 2)}  {_steps_text(row['step_ms'])}")


# ---------------------------------------------------------------- command line


def parse_batch_sizes(text: str) -> list[int]:
    return positive_ints(text, "1,4,16")


def parse_num_drafts(text: str) -> list[int]:
    """Sorted, each once: the table and the plot list G in increasing order."""
    return sorted(set(positive_ints(text, "2,4,8")))


def parse_pairs(text: str) -> list[str]:
    return names(text, PAIRS)


def parse_variants(text: str) -> list[str]:
    return names(text, VARIANTS)


def parse_decodings(text: str) -> list[str]:
    return names(text, DECODINGS)


def _label(name: str) -> str:
    """A short pair label from a model name: a hub id's or path's last part (a config
    file's folder)."""
    path = Path(name)
    return path.parent.name if path.suffix == ".json" and path.parent.name else path.name


def pair_specs(args: argparse.Namespace) -> list[PairSpec]:
    """The pairs to run: --target/--draft, --random-init, or the --pair presets."""
    if args.target is not None:
        return [PairSpec(_label(args.target), args.target, args.draft, random_init=False)]
    if args.random_init is not None:
        target, *draft = args.random_init
        return [PairSpec(_label(target), target, draft[0] if draft else None, random_init=True)]
    return [PAIRS[name] for name in args.pair]


def _default_help(field: str, text=str) -> str:
    return (f"default {text(DEVICE_DEFAULTS['cuda'][field])} on CUDA, "
            f"{text(DEVICE_DEFAULTS['cpu'][field])} on CPU")


def _comma(values: list) -> str:
    return ",".join(map(str, values))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    models = parser.add_mutually_exclusive_group()
    models.add_argument("--pair", type=parse_pairs, default=None,
                        help=f"comma-separated preset pairs: {', '.join(PAIRS)}; default tiny "
                             "(when neither --target nor --random-init is given)")
    models.add_argument("--target", default=None,
                        help="target model with trained weights: hub id or local folder "
                             "(loaded with AutoModelForCausalLM.from_pretrained; its tokenizer "
                             "encodes --prompts sets); no default")
    models.add_argument("--random-init", type=random_init_shapes, default=None,
                        metavar="TARGET_SHAPE[,DRAFT_SHAPE]",
                        help="random-weight target (and draft) at real shapes, offline: the "
                             "name of a config shipped in flashspec/assets/configs ("
                             + ", ".join(config_names()) + ") or the path of a config.json; "
                             "without DRAFT_SHAPE there is no draft and the draft variants are "
                             "skipped; no default")
    parser.add_argument("--draft", default=None,
                        help="with --target: draft model (same vocabulary), hub id or local "
                             "folder; default none (the draft variants are skipped)")
    parser.add_argument("--prompts", choices=(RANDOM_PROMPTS, *PROMPT_SETS),
                        default=RANDOM_PROMPTS,
                        help="random: random token ids of --prompt-length; or a prompt set of "
                             "flashspec.bench.prompt_sets (" + "; ".join(
                                 f"{name}: {what}" for name, what in PROMPT_SETS.items())
                             + "), needing the target's tokenizer (not with random-init "
                               "models); default random")
    parser.add_argument("--batch-sizes", type=parse_batch_sizes, default=None,
                        help="comma-separated batch sizes B; " + _default_help("batch_sizes",
                                                                              _comma))
    parser.add_argument("--prompt-length", type=positive_int, default=None,
                        help="prompt tokens per row (random prompts), or the most a set's "
                             "prompt keeps (its end); " + _default_help("prompt_length"))
    parser.add_argument("--new-tokens", type=positive_int, default=None,
                        help="tokens generated per row, exactly (EOS off); "
                             + _default_help("new_tokens"))
    parser.add_argument("--num-drafts", type=parse_num_drafts, default=[5],
                        help="comma-separated draft lengths G to sweep (drafts per "
                             "verification, constant schedule): every speculative variant runs "
                             "once per G; default 5")
    parser.add_argument("--decoding", type=parse_decodings, default=["greedy"],
                        help="comma-separated decodings: greedy, sample (T=0.6, top-k 20, "
                             "top-p 0.95, seed 0); default greedy")
    parser.add_argument("--reps", type=positive_int, default=None,
                        help="timed calls per row (median), after a first call (it compiles "
                             "and captures; timed apart); " + _default_help("reps"))
    parser.add_argument("--variants", type=parse_variants, default=list(VARIANTS),
                        help="comma-separated variants among " + ", ".join(VARIANTS)
                             + " (each (B, decoding) runs the plain ones, then the speculative "
                               "ones per G, in this order); default all")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="model dtype: " + ", ".join(DTYPES) + "; " + _default_help("dtype"))
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto, cpu or cuda; default auto: cuda if available")
    parser.add_argument("--weights", choices=WEIGHTS, default="random",
                        help="random-init models only: plain random init (random), or peaked "
                             "(residual branches scaled down and the LM head equal to the "
                             "embedding, so that greedy self-speculation accepts every draft; "
                             "same cost per forward); default random")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out"),
                        help="directory for tok_per_s.json and tok_per_s.png; default $OUT if "
                             "set, else ./bench_out")
    args = parser.parse_args(argv)
    if args.draft is not None and args.target is None:
        parser.error("--draft needs --target (presets of --pair and --random-init bring their "
                     "own draft)")
    if args.target is None and args.random_init is None and args.pair is None:
        args.pair = ["tiny"]
    specs = pair_specs(args)
    random_init = [spec.label for spec in specs if spec.random_init]
    if args.prompts != RANDOM_PROMPTS and random_init:
        parser.error(f"--prompts {args.prompts}: random-init models ({', '.join(random_init)}) "
                     "have no tokenizer; use --prompts random")
    trained = [spec.label for spec in specs if not spec.random_init]
    if args.weights != "random" and trained:
        parser.error(f"--weights {args.weights} applies to random-init models; "
                     f"{', '.join(trained)} has trained weights")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    args.device = resolve_device(args.device)
    for field, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, field) is None:
            setattr(args, field, value)
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the comparison; returns the exit code (argparse exits with 2 on bad arguments)."""
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    copy_gbps = copy_bandwidth_gbps(args.device)
    specs = pair_specs(args)
    progress = Progress(len(specs) * len(plan_runs(args)))
    pairs, rows = {}, []
    for spec in specs:
        pairs[spec.label], pair_rows = run_pair(spec, args, args.device, copy_gbps, progress)
        rows += pair_rows
    progress.close()
    report = build_report(args, args.device, copy_gbps, pairs, rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tok_per_s.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out / 'tok_per_s.json'}")
    write_plot(report, args.out / "tok_per_s.png")
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
