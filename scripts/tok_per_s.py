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
  torch ops);
* ``flash_eagle3``: ``sampler="flash"`` with the EAGLE-3 head of --eagle3 (a published
  head's shape with random weights, or a trained head), G drafts per round (stock
  transformers has no EAGLE-3: no stock twin);
* ``flash_mtp``: ``sampler="flash"`` with ``use_mtp=True`` and G drafts per round, for a target
  whose config has ``num_mtp_layers`` (its checkpoint's MTP layers; random ones for a
  random-init target), skipped otherwise (stock's ``use_mtp`` runs at B = 1 with one draft
  per MTP layer: no stock twin at other G).

Stock assisted generation reads the draft length only from the assistant's generation
config, so before each stock call the assistant gets ``num_assistant_tokens=G``, the
"constant" schedule and ``assistant_confidence_threshold=0`` there: stock then drafts G
tokens every round as flashspec does (stock's default threshold 0.4 would stop drafting
early). flashspec takes them as generate() arguments. Prompt lookup matches n-grams of up
to 2 tokens (transformers' default) in both.

Ratios compare rows of one (pair, B, decoding): x_hf and x_stc against the plain stock
rows; a flash row's stock twin (hf_assisted_self, hf_assisted, hf_lookup) and a fused
row's materialized twin are the rows of the same G.

On CUDA the flash rows also give the engine's captured steps' GPU time (one more call after
the timed ones, CUDA events around each step it replays, the median per step): the plain
step, or one round of drafts (draft_first + (G-1) draft_next, EAGLE-3's eagle3_first +
(G-1) eagle3_next, or prompt lookup's one step) and the verification of G drafts; and the
tok/s those imply: B tokens per plain step, B * (1 - a^(G+1)) / (1 - a) tokens per round at
an i.i.d. per-position acceptance a (reported at a = 1 and at the run's measured tokens per
round), and with --assumed-acceptance-length L, B * L tokens per round (computed from the
measured steps, for a head whose published acceptance length is L). Plain rows (hf, hf_static_compile, flash_plain) give the weight bytes read per second
(target weights once per forward, one forward per B tokens) as a fraction of the copy
bandwidth measured at start (read + written bytes of a 1 GiB device copy; 64 MiB on CPU).
With greedy decoding every row records whether its tokens equal the hf row's of the same
(B, decoding) (bf16 near-ties may legitimately differ). A variant that fails is recorded
with its error and the run goes on.

Under torchrun (WORLD_SIZE > 1), the target is tensor-parallel: loaded with
``DistributedConfig(tp_plan="auto")`` over the default process group (initialized here if
needed: gloo on CPU, NCCL on CUDA with the device of LOCAL_RANK), the draft whole on every
rank (replicated); random-init models are built once by rank 0 and loaded from a temporary
folder (flashspec.bench.pairs). Every rank runs every call; rank 0 alone prints and writes.
The stock variants run transformers' own tensor-parallel generate (``hf_static_compile``
excepted: not measured there), the flash ones ``sampler="flash"`` on the split target
(``flash_self``: as its own assistant; ``flash_draft``: with the replicated draft);
flashspec refuses the materialized sampler with a tensor-parallel model, so those variants
are skipped, saying so. A variant that fails on one rank alone leaves the others waiting
in a collective (until the group's 30-minute timeout). Each flash row then reports what
flashspec's vocab-parallel LM head sent between ranks in its last call
(``flashspec.parallel.stats()``, reset before each call): the bytes each rank contributed,
per step (one exchange: an LM-head call of the target, or of the split target drafting for
itself) and per row and step (a verification counts each verified position as a row),
beside the summary layout's bytes per row of each operation (argmax, sample, verify) at the
row's decoding; the pair gives what all-gathering the logits would send per row instead. The
layers' own all-reduces (transformers') are not counted. The weight bandwidth (bw) counts
the weights one rank reads.

    PYTHONPATH=. torchrun --nproc_per_node 2 scripts/tok_per_s.py \\
        --random-init llama-3.1-8b,llama-3.2-1b --decoding greedy,sample  # on 2 GPUs

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

Writes to --out ``tok_per_s.json`` (device, world size and backend, versions, date, args
with the defaults resolved, decodings, prompts, copy bandwidth, pairs, and one row per pair,
B, decoding, G and variant) and ``tok_per_s.png`` (with matplotlib: a panel per pair, bars
of tok/s grouped by (B, decoding)), and prints a table last. Progress goes to stderr: a bar
over all runs (tqdm, on a terminal; else a line as each run starts), and each row's figures
as one JSON line as soon as it is measured (a run cut short keeps them). Offline unless
--target/--draft name hub models that are not cached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from flashspec.bench.cli import (Progress, names, positive_int, positive_ints,
                                 random_init_shapes, resolve_device)
from flashspec.bench.pairs import (DTYPES, PAIRS, PairSpec, init_tensor_parallel,
                                   torchrun_world_size)
from flashspec.bench.prompt_sets import PROMPT_SETS
from flashspec.bench.random_init import WEIGHTS, config_names, eagle3_shapes
from flashspec.bench.timing import copy_bandwidth_gbps
from flashspec.bench.tok_per_s import (DECODINGS, RANDOM_PROMPTS, VARIANTS, build_report,
                                       plan_runs, run_pair)
from flashspec.bench.tok_per_s_report import print_table, write_plot


# Defaults that depend on the device: the CPU ones keep the default run (tiny pair, every
# variant) near 30 s on 2 idle cores.
DEVICE_DEFAULTS = {
    "cuda": {"batch_sizes": [1, 4, 16], "prompt_length": 128, "new_tokens": 256, "reps": 3,
             "dtype": "bf16"},
    "cpu": {"batch_sizes": [1, 4], "prompt_length": 64, "new_tokens": 64, "reps": 1,
            "dtype": "fp32"},
}


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
    parser.add_argument("--gpus", type=positive_int, default=1,
                        help="spread the target over this many GPUs in one process, as "
                             "device_map='balanced' places it (accelerate; its layers run one "
                             "GPU after another), the draft on its LM head's GPU; default 1")
    parser.add_argument("--weights", choices=WEIGHTS, default="random",
                        help="random-init models only: plain random init (random), or peaked "
                             "(residual branches scaled down and the LM head equal to the "
                             "embedding, so that greedy self-speculation accepts every draft; "
                             "same cost per forward); default random")
    parser.add_argument("--eagle3", default=None,
                        help="EAGLE-3 head for the flash_eagle3 variant: the shape of a published "
                             "head shipped in flashspec/assets/eagle3 (" + ", ".join(eagle3_shapes())
                             + "; random weights for the target), or a trained head's folder or "
                               "hub id; default none (flash_eagle3 is skipped)")
    parser.add_argument("--assumed-acceptance-length", type=float, default=None,
                        help="tokens per round (accepted drafts + 1) at which speculative rows "
                             "also report the tok/s their step times give (computed, labelled "
                             "at_assumed_acceptance), e.g. a checkpoint's published acceptance "
                             "length; default none")
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
    if args.device == "cpu" and torch.cuda.is_available() and torchrun_world_size() > 1:
        parser.error("--device cpu under torchrun: transformers puts a tensor-parallel model on "
                     "the GPU of LOCAL_RANK when there is one; leave --device auto")
    args.device = resolve_device(args.device)
    if args.gpus > 1 and (args.device != "cuda" or torchrun_world_size() > 1):
        parser.error(f"--gpus {args.gpus} spreads the target over GPUs in one process: it "
                     "needs CUDA and no torchrun (torchrun runs tensor parallelism)")
    if args.gpus > torch.cuda.device_count() > 0:
        parser.error(f"--gpus {args.gpus}: only {torch.cuda.device_count()} CUDA devices here")
    for field, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, field) is None:
            setattr(args, field, value)
    return args


class Silent:
    """`Progress` of the ranks other than 0: nothing printed."""

    def _nothing(self, *args) -> None:
        pass

    write = start = finish = close = _nothing


def main(argv: list[str] | None = None) -> int:
    """Runs the comparison; returns the exit code (argparse exits with 2 on bad arguments)."""
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    group_given = dist.is_available() and dist.is_initialized()
    tensor_parallel = init_tensor_parallel(args.device)
    try:
        report = run(args, tensor_parallel)
    finally:
        if tensor_parallel is not None and not group_given:
            dist.destroy_process_group()
    if report is None:                                   # not rank 0
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tok_per_s.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out / 'tok_per_s.json'}")
    write_plot(report, args.out / "tok_per_s.png")
    print_table(report)
    return 0


def run(args: argparse.Namespace, tensor_parallel) -> dict | None:
    """The report, on rank 0 (the only one); None on the other ranks."""
    rank = 0 if tensor_parallel is None else tensor_parallel.rank
    copy_gbps = copy_bandwidth_gbps(args.device)
    specs = pair_specs(args)
    progress = Progress(len(specs) * len(plan_runs(args))) if rank == 0 else Silent()
    pairs, rows = {}, []
    for spec in specs:
        pairs[spec.label], pair_rows = run_pair(spec, args, args.device, copy_gbps, progress,
                                                tensor_parallel)
        rows += pair_rows
    progress.close()
    if rank != 0:
        return None
    return build_report(args, args.device, copy_gbps, pairs, rows, tensor_parallel)


if __name__ == "__main__":
    sys.exit(main())
