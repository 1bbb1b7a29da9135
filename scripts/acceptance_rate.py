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
text so far); ``eagle3``, an EAGLE-3 head fed the target's hidden states (--eagle3; the
tiny pair ships one, trained by scripts/train_tiny_eagle3.py).

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
  llama-3.1-8b, llama-3.2-1b, qwen3.5-9b-mtp) or the path of a config.json (see
  flashspec.bench.random_init).
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
import json
import math
import os
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig

from flashspec.assets import tiny_pair_path
from flashspec.bench.acceptance_report import print_table, write_csv, write_plot
from flashspec.bench.acceptance_runs import (DTYPES, build_report, describe_models, encode_set,
                                             load_eagle3, load_models, load_tokenizer,
                                             loading_text,
                                             pad_token_id_of, resolve_dtype, run_configuration)
from flashspec.bench.cli import (Progress, names, positive_int, positive_ints,
                                 random_init_shapes, resolve_device)
from flashspec.bench.prompt_sets import PROMPT_SETS
from flashspec.bench.random_init import WEIGHTS, config_names, random_config


# In table order.
DRAFTERS = {"assistant": "greedy drafts from the draft model (--draft, or DRAFT_SHAPE of "
                         "--random-init)",
            "self": "the target as its own assistant (greedy drafts from the target itself, "
                    "any target; sampled, p(x) is its probability of its own argmax)",
            "lookup": "prompt lookup: n-gram matches in the prompt and the text so far",
            "eagle3": "an EAGLE-3 head (--eagle3; the tiny pair's own by default)"}
# Self-drafting is opt-in: it measures the engine (p(x) of the target's own argmax), not a
# pair, and the default run keeps its configurations. The tiny pair's EAGLE-3 head joins
# them with the tiny pair (other targets need their own head, --eagle3).
DEFAULT_DRAFTERS = ["assistant", "lookup"]
TINY_PAIR_DRAFTERS = ["assistant", "lookup", "eagle3"]
# --sample without explicit values: the usual "thinking model" setting (as in tok_per_s.py).
SAMPLE_DEFAULTS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0}


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
    parser.add_argument("--drafter", type=parse_drafters, default=None,
                        help="comma-separated drafters: " + "; ".join(
                            f"{name}: {what}" for name, what in DRAFTERS.items())
                        + "; default " + ",".join(TINY_PAIR_DRAFTERS) + " with the tiny pair, "
                        + ",".join(DEFAULT_DRAFTERS) + " otherwise")
    parser.add_argument("--eagle3", default=None, metavar="NAME_OR_PATH",
                        help="EAGLE-3 head for --drafter eagle3 (a folder or hub id, trained "
                             "for --target); default the tiny pair's head "
                             "(flashspec/assets/tiny_pair/eagle3) with the tiny pair")
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
    if args.drafter is None:
        tiny = args.target is None and args.random_init is None
        args.drafter = list(TINY_PAIR_DRAFTERS if tiny else DEFAULT_DRAFTERS)
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
    if "eagle3" in args.drafter and args.eagle3 is None:
        if args.target != str(tiny_pair_path() / "target"):
            parser.error("--drafter eagle3 with --target: pass --eagle3 (the head trained for "
                         "that target: a folder or hub id)")
        args.eagle3 = str(tiny_pair_path() / "eagle3")


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
    if "eagle3" in args.drafter:
        parser.error("--drafter eagle3 runs trained heads; --random-init models have none "
                     "(scripts/tok_per_s.py --eagle3 measures random heads' speed)")
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
    eagle3 = load_eagle3(args, target)
    pad_token_id = pad_token_id_of(tokenizer, target)
    sets = {name: encode_set(tokenizer, name, args, device) for name in args.prompt_set}
    configurations = [(drafter, name, num_drafts) for drafter in args.drafter
                      for name in args.prompt_set for num_drafts in args.num_drafts]
    progress = Progress(sum(len(sets[name][0]) for _, name, _ in configurations), unit="batch")
    rows = []
    for drafter, name, num_drafts in configurations:
        summary = run_configuration(target, draft, sets[name][0], drafter, num_drafts, args,
                                    pad_token_id, progress, f"{drafter} {name} G={num_drafts}",
                                    eagle3)
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
