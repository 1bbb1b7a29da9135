"""Acceptance of speculative decoding with flashspec: per position, per verification, and
against what the target's probabilities predict.

For each drafter (an assistant model, the target itself, or prompt lookup), prompt set and
draft length G,
every prompt of the set is completed by ``generate(sampler="flash")`` in batches (G drafts
per verification, constant schedule), greedily or sampled, and the engine's per-step
statistics (``out.flash_stats``) are summarised:

* alpha_i (i = 1..G): the probability that the i-th draft of a verification is accepted
  given that the drafts before it were (accepted drafts at i / verifications that reached
  position i with a draft there); the JSON also has the unconditional fraction of drafts
  proposed at i that were accepted (``SpeculationStats.per_position_acceptance``);
* accepted drafts per verification, tokens emitted per verification and per target
  forward (a forward without drafts, e.g. prompt lookup without a match, emits one token),
  and the distribution of accepted lengths 0..G over verifications;
* expected acceptance: under flashspec's strict rule a draft x at position i, once reached,
  is accepted with probability exactly p(x), its probability under the target's
  transformed distribution (temperature, top-k, top-p, min-p applied; greedy: 1 if x is the
  target's argmax, else 0). The expected alpha_i is the mean p(x) over the verifications
  that reached i, with standard error sqrt(sum p(1 - p)) / n (that of the unconditional
  fraction is the mean of p_1 ... p_i over the proposals). The expected total of accepted
  drafts and its standard deviation come from the p(x) of every verification
  (``SpeculationStats.expected_accepted``), and so does the expected distribution of
  accepted lengths. z = (realised - expected) / standard deviation; a configuration
  "agrees" when the z of its total is within +-3 (greedy: p(x) is 0 or 1, so realised must
  equal expected exactly). Per-position z are reported too; among the many positions of a
  sweep an occasional |z_i| > 3 happens by chance (3 in 1,000 each; more often where few
  verifications reached the position, as z is then far from normal). A clear disagreement
  means the engine does not accept drafts with the probability it reports.

Drafters (--drafter): ``assistant``, greedy drafts from a draft model; ``self``, the
target as its own assistant (greedy drafts from the target itself: greedily every draft is
its argmax, accepted unless a near-tie rounds differently in the verification forward; with
sampling p(x) is the target's probability of its own argmax, a non-trivial p(x) from any
target, trained or random); ``lookup``, prompt lookup (n-gram matches in the prompt and the
text so far).

Prompts come from flashspec's shipped sets (``flashspec/assets/prompts``, see
``flashspec.bench.prompt_sets``): code_edit (the answer copies most of the prompt: where prompt
lookup shines), summarize (a text to summarise is in the prompt), chat (open questions and
code completion). Each prompt is one user turn of the chat template of the tokenizer
(--tokenizer, default the target's own), or "### Instruction: ... ### Response:" text
without one; left-padded; a prompt longer than --max-prompt-tokens keeps its last tokens.
Row i of a set is seeded --seed + i, so every configuration sees the same noise.

Models, from one of:

* the default: flashspec's built-in tiny code pair, which runs offline (it only knows
  Python, so its chat and summaries are nonsense, but its acceptance statistics are real);
* ``--target`` (and ``--draft``): hub ids or local folders with trained weights;
* ``--random-init TARGET_SHAPE[,DRAFT_SHAPE]``: random weights at real shapes, offline (no
  download: the way to run at real model shapes on a machine without the hub); a SHAPE is
  the name of a config shipped in flashspec/assets/configs (qwen3-1.7b, qwen3-0.6b,
  llama-3.1-8b, llama-3.2-1b) or the path of a config.json (see flashspec.bench.random_init).
  Random models have no tokenizer: the tiny pair's (8192 tokens) encodes the prompts unless
  --tokenizer names another, no larger than the target's vocabulary. ``--weights peaked``
  makes them decisive (``flashspec.bench.random_init.peak_weights``). Their acceptance says
  nothing about real models (a random draft accepts almost nothing); what it tests is that
  the engine accepts drafts with the probability p(x) it reports, at real shapes.

Generation stops at the target's EOS unless --ignore-eos; rows end at --new-tokens.
--random-init models have EOS off (theirs means nothing): every row generates exactly
--new-tokens.

Run (from the repository root):

    PYTHONPATH=. python scripts/acceptance_rate.py            # tiny pair, about 1 min on CPU
    PYTHONPATH=. python scripts/acceptance_rate.py --sample --num-drafts 2,4
    PYTHONPATH=. python scripts/acceptance_rate.py --random-init qwen3-1.7b,qwen3-0.6b \\
        --drafter self,assistant,lookup --sample --num-drafts 2,4,8 --batch-size 16 \\
        --new-tokens 128                                     # on a GPU, offline
    PYTHONPATH=. python scripts/acceptance_rate.py --target Qwen/Qwen3-8B \\
        --draft Qwen/Qwen3-0.6B --sample --new-tokens 256 --batch-size 16      # downloads

Also recorded: wall seconds of the generate calls (not a benchmark: see
scripts/tok_per_s.py for speed). On CUDA the engine compiles each step kind once per model
and captures a graph for each new (batch bucket, G, KV view): the first calls pay for that.

Writes ``acceptance_rate.json`` (everything), ``acceptance_rate.csv`` (one line per
configuration) and ``acceptance_rate.png`` (with matplotlib) to --out and prints a table
last; progress goes to stderr (a tqdm bar on a terminal when tqdm is installed, else a line per
batch).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import flashspec
from flashspec.bench.cli import (Progress, model_name, names, package_version, positive_int,
                                 positive_ints, pyplot_or_note, random_init_shapes,
                                 resolve_device)
from flashspec.assets import tiny_pair_path
from flashspec.generation.outputs import SpeculationStats
from flashspec.bench.prompt_sets import PROMPT_SETS, encode_prompts, load_prompts
from flashspec.bench.random_init import (WEIGHTS, config_names, peak_weights, random_config,
                                         random_model)

# In table order.
DRAFTERS = {"assistant": "greedy drafts from the draft model (--draft, or DRAFT_SHAPE of "
                         "--random-init)",
            "self": "the target as its own assistant (greedy drafts from the target itself, "
                    "any target; sampled, p(x) is its probability of its own argmax)",
            "lookup": "prompt lookup: n-gram matches in the prompt and the text so far"}
# Self-drafting is opt-in: it measures the engine (p(x) of the target's own argmax), not a
# pair, and the default run keeps its configurations.
DEFAULT_DRAFTERS = ["assistant", "lookup"]
# --random-init: the weights are seeded with this, whatever --seed (which seeds sampling).
WEIGHTS_SEED = 0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# --sample without explicit values: the usual "thinking model" setting (as in tok_per_s.py).
SAMPLE_DEFAULTS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0}
# |z| above this is a disagreement: about 3 in 1,000 false alarms per comparison.
Z_LIMIT = 3.0
# CSV: a row's own fields, then its expected_accepted check's, then alpha_i, alpha_expected_i.
CSV_ROW_COLUMNS = ("drafter", "prompt_set", "num_drafts", "prompts", "seconds",
                   "generated_tokens", "forwards", "verifications", "drafted", "accepted",
                   "acceptance_rate", "accepted_per_verification", "tokens_per_verification",
                   "tokens_per_forward")
CSV_CHECK_COLUMNS = {"expected_accepted": "mean", "expected_accepted_std": "std", "z": "z",
                     "agrees": "agrees"}


# ---------------------------------------------------------------- statistics


def _fit(values: torch.Tensor, width: int) -> torch.Tensor:
    """`values` along its last dim cut or zero-padded to `width`."""
    values = values[..., :width]
    return torch.nn.functional.pad(values, (0, width - values.shape[-1]))


def _number(value: float) -> float | None:
    """JSON-safe float: None for NaN and infinities."""
    return float(value) if math.isfinite(value) else None


def merge_stats(parts: list[SpeculationStats]) -> SpeculationStats:
    """One `SpeculationStats` for several generate calls: rows side by side, shorter runs
    padded with idle steps (all zero, which every statistic skips)."""
    steps = max(part.num_steps for part in parts)
    merged = {}
    for field in dataclasses.fields(SpeculationStats):
        values = [getattr(part, field.name) for part in parts]
        # [steps, B, ...]: every part zero-padded to the most steps (and the widest draft dim).
        tail = [max(value.shape[d] for value in values) for d in range(2, values[0].dim())]
        padded = []
        for value in values:
            zeros = value.new_zeros(steps, value.shape[1], *tail)
            zeros[tuple(slice(0, size) for size in value.shape)] = value
            padded.append(zeros)
        merged[field.name] = torch.cat(padded, dim=1)
    return SpeculationStats(**merged)


def agreement(realised: float, mean: float, std: float) -> tuple[float | None, bool]:
    """(z, agrees): z = (realised - mean) / std (None when std is 0), agrees when |z| <=
    Z_LIMIT, or, with std 0 (greedy), when realised equals mean up to rounding."""
    if std > 0:
        z = (realised - mean) / std
        return z, abs(z) <= Z_LIMIT
    return None, abs(realised - mean) <= 1e-6 * max(1.0, abs(mean))


def position_statistics(stats: SpeculationStats, num_drafts: int) -> dict:
    """Per draft position i = 1..G (lists of length G): verifications that proposed a
    draft there and that reached it (the drafts before it accepted); realised alpha_i
    (accepted / reached), its expectation (mean p(x) over reached) with standard error, z
    and agreement; and accepted / proposed with its expectation (mean p_1 ... p_i over
    proposed, `SpeculationStats.expected_per_position_acceptance`). None where no
    verification reached (or proposed) i."""
    positions = torch.arange(num_drafts)
    proposed = stats.drafted[..., None] > positions                  # [steps, B, G]
    reached = proposed & (stats.accepted[..., None] >= positions)
    passed = stats.accepted[..., None] > positions
    probs = _fit(stats.accept_probs.double(), num_drafts) * reached
    num_proposed = proposed.sum(dim=(0, 1)).tolist()
    num_reached = reached.sum(dim=(0, 1)).tolist()
    num_passed = passed.sum(dim=(0, 1)).tolist()
    prob_sums = probs.sum(dim=(0, 1)).tolist()
    spread = (probs * (1 - probs)).sum(dim=(0, 1)).sqrt().tolist()
    alpha = [k / n if n else None for k, n in zip(num_passed, num_reached)]
    expected = [total / n if n else None for total, n in zip(prob_sums, num_reached)]
    stderr = [sd / n if n else None for sd, n in zip(spread, num_reached)]
    checks = [agreement(*values) if n else (None, None)
              for *values, n in zip(alpha, expected, stderr, num_reached)]
    expected_of_proposed = _fit(stats.expected_per_position_acceptance.double(), num_drafts)
    return {"proposed": num_proposed, "reached": num_reached, "alpha": alpha,
            "alpha_expected": expected, "alpha_stderr": stderr,
            "alpha_z": [z for z, _ in checks], "alpha_agrees": [agrees for _, agrees in checks],
            "accepted_of_proposed": [k / n if n else None
                                     for k, n in zip(num_passed, num_proposed)],
            "accepted_of_proposed_expected": [float(e) if n else None for e, n in
                                              zip(expected_of_proposed, num_proposed)]}


def accepted_length_distribution(stats: SpeculationStats, num_drafts: int) -> dict:
    """Over verifications (steps with drafts): how many accepted k = 0..G drafts, realised
    counts and expected counts. A verification accepts at least k drafts with probability
    q_k = p_1 ... p_k (q_0 = 1), so exactly k with q_k - q_{k+1}; p is 0 past its drafts."""
    verifying = stats.drafted > 0
    counts = torch.bincount(stats.accepted[verifying], minlength=num_drafts + 1)
    probs = _fit(stats.accept_probs.double(), num_drafts)[verifying]          # [V, G]
    at_least = torch.cat([torch.ones(len(probs), 1, dtype=torch.float64), probs.cumprod(dim=1),
                          torch.zeros(len(probs), 1, dtype=torch.float64)], dim=1)
    expected = (at_least[:, :-1] - at_least[:, 1:]).sum(dim=0)
    return {"counts": counts[:num_drafts + 1].tolist(), "expected": expected.tolist()}


def acceptance_summary(stats: SpeculationStats, num_drafts: int) -> dict:
    """Everything the report says about one configuration's `stats` (G = `num_drafts`)."""
    verifying = stats.drafted > 0
    verifications = int(verifying.sum())
    realised = int(stats.accepted.sum())
    mean, std = stats.expected_accepted()
    z, agrees = agreement(realised, float(mean), float(std))
    per_verification = max(verifications, 1)
    return {
        "forwards": int((stats.emitted > 0).sum()),
        "verifications": verifications,
        "drafted": int(stats.drafted.sum()),
        "accepted": realised,
        "acceptance_rate": _number(stats.acceptance_rate),
        "accepted_per_verification": realised / per_verification,
        "tokens_per_verification": int(stats.emitted[verifying].sum()) / per_verification,
        "tokens_per_forward": stats.mean_accepted_length,
        "expected_accepted": {"realised": realised, "mean": float(mean), "std": float(std),
                              "z": z, "agrees": agrees},
        "positions": position_statistics(stats, num_drafts),
        "accepted_length": accepted_length_distribution(stats, num_drafts),
    }


# ---------------------------------------------------------------- generation


def sampling_kwargs(args: argparse.Namespace) -> dict:
    if not args.sample:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k,
            "top_p": args.top_p, "min_p": args.min_p}


def drafter_kwargs(drafter: str, num_drafts: int, target, draft,
                   args: argparse.Namespace) -> dict:
    if drafter == "lookup":
        return {"prompt_lookup_num_tokens": num_drafts,
                "max_matching_ngram_size": args.max_matching_ngram_size}
    return {"assistant_model": target if drafter == "self" else draft,
            "num_assistant_tokens": num_drafts, "num_assistant_tokens_schedule": "constant"}


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
                      label: str) -> dict:
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
            **drafter_kwargs(drafter, num_drafts, target, draft, args), **sampling_kwargs(args))
        seconds += time.perf_counter() - begin
        parts.append(output.flash_stats)
        generated += int(output.flash_stats.emitted.sum())
        progress.finish()
    return {"seconds": seconds, "generated_tokens": generated,
            **acceptance_summary(merge_stats(parts), num_drafts)}


# ---------------------------------------------------------------- models


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


# ---------------------------------------------------------------- output


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


def write_csv(report: dict, path: Path) -> None:
    """One line per configuration: CSV_ROW_COLUMNS, CSV_CHECK_COLUMNS, then alpha_i and
    alpha_expected_i for i up to the largest G (empty past a configuration's own G or where
    i was never reached)."""
    widest = max(report["args"]["num_drafts"])
    columns = [*CSV_ROW_COLUMNS, *CSV_CHECK_COLUMNS,
               *(f"alpha_{i}" for i in range(1, widest + 1)),
               *(f"alpha_expected_{i}" for i in range(1, widest + 1))]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in report["rows"]:
            line = {key: row[key] for key in CSV_ROW_COLUMNS}
            line.update({column: row["expected_accepted"][key]
                         for column, key in CSV_CHECK_COLUMNS.items()})
            for i, (alpha, expected) in enumerate(zip(row["positions"]["alpha"],
                                                      row["positions"]["alpha_expected"]), 1):
                line[f"alpha_{i}"], line[f"alpha_expected_{i}"] = alpha, expected
            writer.writerow(line)
    print(f"wrote {path}")


def write_plot(report: dict, path: Path) -> None:
    """Per drafter: alpha_i at the largest G (realised with +-2 standard errors, expected
    dashed), tokens per target forward against G, and the accepted-length distribution at
    the largest G (bars realised, dots expected)."""
    plt = pyplot_or_note(path)
    if plt is None:
        return
    args = report["args"]
    widest = max(args["num_drafts"])
    fig, axes = plt.subplots(len(args["drafter"]), 3, figsize=(16, 4.5 * len(args["drafter"])),
                             squeeze=False)
    bar_width = 0.8 / len(args["prompt_set"])
    for (ax_alpha, ax_tokens, ax_lengths), drafter in zip(axes, args["drafter"]):
        for index, name in enumerate(args["prompt_set"]):
            rows = [row for row in report["rows"]
                    if row["drafter"] == drafter and row["prompt_set"] == name]
            color = f"C{index}"
            ax_tokens.plot([row["num_drafts"] for row in rows],
                           [row["tokens_per_forward"] for row in rows], "o-", color=color,
                           label=name)
            widest_row = next(row for row in rows if row["num_drafts"] == widest)
            positions, lengths = widest_row["positions"], widest_row["accepted_length"]
            reached = [i for i, alpha in enumerate(positions["alpha"]) if alpha is not None]
            ax_alpha.errorbar([i + 1 for i in reached], [positions["alpha"][i] for i in reached],
                              yerr=[2 * positions["alpha_stderr"][i] for i in reached],
                              fmt="o-", color=color, capsize=3, label=f"{name} realised")
            ax_alpha.plot([i + 1 for i in reached],
                          [positions["alpha_expected"][i] for i in reached], "--", color=color,
                          label=f"{name} expected")
            total = max(sum(lengths["counts"]), 1)
            offsets = [k + (index - (len(args["prompt_set"]) - 1) / 2) * bar_width
                       for k in range(widest + 1)]
            ax_lengths.bar(offsets, [c / total for c in lengths["counts"]], width=bar_width,
                           color=color, label=name)
            ax_lengths.plot(offsets, [e / total for e in lengths["expected"]], "k.")
        ax_alpha.set(xlabel="draft position i", ylabel="alpha_i", ylim=(0, 1.05),
                     title=f"{drafter}: acceptance by position, G={widest} (+-2 s.e.)")
        ax_tokens.set(xlabel="drafts per verification G", ylabel="tokens per target forward",
                      xticks=args["num_drafts"], title=f"{drafter}: tokens per forward")
        ax_lengths.set(xlabel="accepted drafts", ylabel="fraction of verifications",
                       title=f"{drafter}: accepted lengths, G={widest} (dots: expected)")
        for ax in (ax_alpha, ax_tokens, ax_lengths):
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"{_models_text(report)}, {report['device']}, {_decoding_text(report)}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


TABLE_LEGEND = """\
verifs = target forwards with drafts; acc/v = accepted drafts per verification; tok/f = tokens
per target forward; accepted, expected = total accepted drafts, and the total that p(x)
predicts +- its standard deviation; z = (accepted - expected) / sd, ok = |z| <= 3 (greedy: sd
is 0 and ok means exactly equal); max|z_i| = the largest per-position z (alpha_i against its
expectation); alpha_i = P(draft i accepted | the drafts before it accepted)."""


def _models_text(report: dict) -> str:
    models = report["models"]
    parts = [f"target {models['target']}, draft {models['draft'] or '-'}"]
    if models["weights"] != "trained":
        parts.append(models["weights"])
    if models["tokenizer"] != models["target"]:
        parts.append(f"prompts by the tokenizer {models['tokenizer']}")
    return "; ".join(parts)


def _decoding_text(report: dict) -> str:
    if not report["args"]["sample"]:
        return "greedy"
    return "sampled (T={temperature}, top-k {top_k}, top-p {top_p}, min-p {min_p})".format(
        **report["sampling"])


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def print_table(report: dict) -> None:
    print(f"\n{_models_text(report)} on {report['device']} ({report['dtype']}), "
          f"{_decoding_text(report)}, up to {report['args']['new_tokens']} new tokens")
    print(TABLE_LEGEND)
    print(f"{'drafter':9} {'prompt_set':10} {'G':>2} {'verifs':>6} {'acc/v':>5} {'tok/f':>5} "
          f"{'accepted':>8} {'expected':>17} {'z':>6} {'ok':>3} {'max|z_i|':>8}  alpha_1..G")
    for row in report["rows"]:
        check = row["expected_accepted"]
        alphas = " ".join("  -  " if a is None else f"{a:.3f}" for a in row["positions"]["alpha"])
        position_z = [abs(z) for z in row["positions"]["alpha_z"] if z is not None]
        worst = f"{max(position_z):.2f}" if position_z else "-"
        print(f"{row['drafter']:9} {row['prompt_set']:10} {row['num_drafts']:2d} "
              f"{row['verifications']:6d} {row['accepted_per_verification']:5.2f} "
              f"{row['tokens_per_forward']:5.2f} {row['accepted']:8d} "
              f"{check['mean']:9.1f} +-{check['std']:6.1f} {_signed(check['z']):>6} "
              f"{'yes' if check['agrees'] else 'NO':>3} "
              f"{worst:>8}  {alphas}")


# ---------------------------------------------------------------- command line


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return value


def _float_in(text: str, low: float, high: float, low_open: bool, allowed: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > low if low_open else value >= low) and value <= high):
        raise argparse.ArgumentTypeError(f"expected a number in {allowed}, got {text!r}")
    return value


def temperature(text: str) -> float:
    return _float_in(text, 0.0, math.inf, True, "(0, inf)")


def probability_open(text: str) -> float:
    return _float_in(text, 0.0, 1.0, True, "(0, 1]")


def probability(text: str) -> float:
    return _float_in(text, 0.0, 1.0, False, "[0, 1]")


def parse_num_drafts(text: str) -> list[int]:
    return sorted(set(positive_ints(text, "1,2,4,8")))


def parse_drafters(text: str) -> list[str]:
    return names(text, DRAFTERS)


def parse_prompt_sets(text: str) -> list[str]:
    return names(text, PROMPT_SETS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    models = parser.add_mutually_exclusive_group()
    models.add_argument("--target", default=None,
                        help="target model with trained weights: hub id or local folder; "
                             "default the built-in tiny pair's target")
    models.add_argument("--random-init", type=random_init_shapes, default=None,
                        metavar="TARGET_SHAPE[,DRAFT_SHAPE]",
                        help="instead of --target: random-weight target (and draft) at real "
                             "shapes, offline; a SHAPE is the name of a config shipped in "
                             "flashspec/assets/configs (" + ", ".join(config_names())
                             + ") or the path of a config.json; without DRAFT_SHAPE there is no "
                               "draft model (use --drafter self and/or lookup); EOS is off, so "
                               "every row generates exactly --new-tokens; no default")
    parser.add_argument("--draft", default=None,
                        help="assistant model for --drafter assistant (not with --random-init, "
                             "which takes DRAFT_SHAPE): hub id or local folder with trained "
                             "weights, same vocabulary as the target; default the tiny pair's "
                             "draft (only with the default target)")
    parser.add_argument("--weights", choices=tuple(WEIGHTS), default="random",
                        help="--random-init only: random (plain random init) or peaked "
                             "(residual branches scaled down and the LM head equal to the "
                             "embedding: decisive models, whose greedy self-drafts are all "
                             "accepted; flashspec.bench.random_init.peak_weights); default random")
    parser.add_argument("--tokenizer", default=None, metavar="NAME_OR_PATH",
                        help="tokenizer that encodes the prompt sets: hub id or local folder, "
                             "at most as many tokens as the target's vocab_size; default the "
                             "target's own, with --random-init (random models have none) the "
                             "built-in tiny pair's (8192 tokens)")
    parser.add_argument("--drafter", type=parse_drafters, default=list(DEFAULT_DRAFTERS),
                        help="comma-separated drafters: " + "; ".join(
                            f"{name}: {what}" for name, what in DRAFTERS.items())
                        + "; default " + ",".join(DEFAULT_DRAFTERS))
    parser.add_argument("--num-drafts", type=parse_num_drafts, default=[1, 2, 4, 8],
                        help="comma-separated draft lengths G to sweep (drafts per "
                             "verification, constant schedule); default 1,2,4,8")
    parser.add_argument("--prompt-set", type=parse_prompt_sets, default=list(PROMPT_SETS),
                        help="comma-separated prompt sets: " + "; ".join(
                            f"{name}: {what}" for name, what in PROMPT_SETS.items())
                        + "; default all")
    parser.add_argument("--prompts", type=positive_int, default=None,
                        help="use only the first N prompts of each set; default all of them "
                             "(16-20 per set)")
    parser.add_argument("--batch-size", type=positive_int, default=32,
                        help="prompts per generate call; default 32")
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=512,
                        help="longer prompts keep their last N tokens; default 512")
    parser.add_argument("--new-tokens", type=positive_int, default=64,
                        help="max new tokens per prompt; default 64")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate --new-tokens for every prompt, past EOS (default: a "
                             "row stops at the target's EOS; --random-init models have EOS off)")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="always use the plain '### Instruction/### Response' layout, "
                             "even when the tokenizer has a chat template")
    parser.add_argument("--max-matching-ngram-size", type=positive_int, default=2,
                        help="prompt lookup: longest n-gram matched; default 2 (as transformers)")
    parser.add_argument("--sample", action="store_true",
                        help="sample (default T={temperature}, top-k {top_k}, top-p {top_p}, "
                             "min-p {min_p}) instead of greedy decoding".format(**SAMPLE_DEFAULTS))
    parser.add_argument("--temperature", type=temperature, default=None,
                        help="with --sample: temperature > 0; default "
                             f"{SAMPLE_DEFAULTS['temperature']}")
    parser.add_argument("--top-k", type=non_negative_int, default=None,
                        help=f"with --sample: top-k, 0 = off; default {SAMPLE_DEFAULTS['top_k']}")
    parser.add_argument("--top-p", type=probability_open, default=None,
                        help="with --sample: top-p in (0, 1], 1 = off; default "
                             f"{SAMPLE_DEFAULTS['top_p']}")
    parser.add_argument("--min-p", type=probability, default=None,
                        help="with --sample: min-p in [0, 1], 0 = off; default "
                             f"{SAMPLE_DEFAULTS['min_p']}")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="row i of a prompt set is seeded seed + i; default 0")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="default auto: cuda if available")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                        help="model dtype; default auto: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out"),
                        help="directory for acceptance_rate.json, .csv and .png; default $OUT "
                             "if set, else ./bench_out")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.random_init is None:
        resolve_trained_models(parser, args)
    else:
        resolve_random_models(parser, args)
    for name, default in SAMPLE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
        elif not args.sample:
            parser.error(f"--{name.replace('_', '-')} applies to sampling: add --sample")
    # Last: it loads the tokenizer and the target's config.
    check_tokenizer(parser, args)
    return args


def resolve_trained_models(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--target / --draft / --tokenizer with their defaults (the tiny pair, the target's own
    tokenizer), or a parser error."""
    if args.weights != "random":
        parser.error(f"--weights {args.weights} applies to --random-init models; the target "
                     f"{args.target or '(the tiny pair)'} has trained weights")
    if args.target is not None and args.draft is None and "assistant" in args.drafter:
        parser.error("--target without --draft: the default draft is the tiny pair's, which "
                     "shares no vocabulary with other targets; pass --draft, or --drafter "
                     "self and/or lookup")
    if args.target is None:
        pair = tiny_pair_path()
        args.target, args.draft = str(pair / "target"), args.draft or str(pair / "draft")
    args.tokenizer = args.tokenizer or args.target


def resolve_random_models(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--random-init's shapes as args.target and args.draft (None without DRAFT_SHAPE), the
    tiny pair's tokenizer by default and EOS off, or a parser error."""
    if args.draft is not None:
        parser.error("--draft goes with --target; --random-init takes the draft's shape as "
                     "DRAFT_SHAPE (--random-init TARGET_SHAPE,DRAFT_SHAPE)")
    args.target, args.draft = [*args.random_init, None][:2]
    if args.draft is None and "assistant" in args.drafter:
        parser.error(f"--drafter assistant needs a draft model and --random-init {args.target} "
                     f"has none: give --random-init {args.target},DRAFT_SHAPE, or --drafter "
                     "self and/or lookup (the default --drafter is "
                     + ",".join(DEFAULT_DRAFTERS) + ")")
    args.tokenizer = args.tokenizer or str(tiny_pair_path() / "target")
    # A random model's EOS is a token like any other: rows generate exactly --new-tokens.
    args.ignore_eos = True


def target_vocab_size(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """From the target's config, without loading its weights."""
    if args.random_init is not None:
        return random_config(args.target).vocab_size
    try:
        return AutoConfig.from_pretrained(args.target).vocab_size
    except (OSError, ValueError) as error:
        parser.error(f"--target {args.target}: cannot load its config: {error}")


def check_tokenizer(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The tokenizer must load, and its ids must be token ids of the target: at most
    vocab_size tokens. The target's config first: an unreadable target is named as such,
    not as its default tokenizer."""
    vocab_size = target_vocab_size(parser, args)
    try:
        size = len(load_tokenizer(args.tokenizer))
    except (OSError, ValueError) as error:
        parser.error(f"--tokenizer {args.tokenizer}: cannot load it: {error}")
    if size > vocab_size:
        parser.error(f"--tokenizer {args.tokenizer}: its {size} tokens do not fit the target "
                     f"{args.target}, whose vocab_size is {vocab_size} (larger ids have no "
                     f"embedding); use a tokenizer of at most {vocab_size} tokens")


def main(argv: list[str] | None = None) -> int:
    """Runs the sweep; returns the exit code (argparse exits with 2 on bad arguments)."""
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    print(loading_text(args, device, dtype), file=sys.stderr, flush=True)
    tokenizer = load_tokenizer(args.tokenizer)
    target, draft = load_models(args, device, dtype)
    pad_token_id = pad_token_id_of(tokenizer, target)
    sets = {name: encode_set(tokenizer, name, args, device) for name in args.prompt_set}
    configurations = [(drafter, name, num_drafts) for drafter in args.drafter
                      for name in args.prompt_set for num_drafts in args.num_drafts]
    progress = Progress(sum(len(sets[name][0]) for _, name, _ in configurations), unit="batch")
    rows = []
    for drafter, name, num_drafts in configurations:
        summary = run_configuration(target, draft, sets[name][0], drafter, num_drafts, args,
                                    pad_token_id, progress, f"{drafter} {name} G={num_drafts}")
        rows.append({"drafter": drafter, "prompt_set": name, "num_drafts": num_drafts,
                     "prompts": sets[name][1]["prompts"], **summary})
    progress.close()
    report = build_report(args, device, dtype, describe_models(args, target, tokenizer),
                          {name: sets[name][1] for name in sets}, rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "acceptance_rate.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out / 'acceptance_rate.json'}")
    write_csv(report, args.out / "acceptance_rate.csv")
    write_plot(report, args.out / "acceptance_rate.png")
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
