"""Tokens per second of generate() for a model pair: stock transformers vs flashspec's engine.

For each pair, batch size B and variant, one untimed warm-up call (it also compiles and
captures CUDA graphs), then --reps timed calls of B random prompts of --prompt-length
tokens, each generating exactly --new-tokens tokens (EOS disabled); tok/s = B * new_tokens
/ median seconds (the device synchronized around each call). Greedy unless --sample
(T=0.6, top-k 20, top-p 0.95, seed 0).

Pairs (target + draft, same vocabulary):

* ``tiny``: flashspec's built-in tiny pair (trained weights, flashspec/assets/tiny_pair);
* ``qwen3``: Qwen3-1.7B + Qwen3-0.6B shapes, random weights (scripts/configs);
* ``llama``: Llama-3.1-8B + Llama-3.2-1B shapes, random weights.

Prompts are random token ids, so acceptance is whatever the pair does on noise: the
random-weight drafts accept almost nothing and self-speculation (the target as its own
assistant) accepts almost everything; the expected tok/s at acceptance 1 (below) is the
upper bound that speculation can reach with this engine.

Variants:

* ``hf``: stock generate (dynamic cache);
* ``hf_static_compile``: stock generate with ``cache_implementation="static"``, which
  transformers compiles; CUDA only (on CPU transformers does not compile it, so it is
  skipped: an uncompiled static cache is not what is measured);
* ``hf_assisted_self`` / ``hf_assisted``: stock assisted generation with the target itself /
  the draft as assistant, G drafts per round (B=1 only: stock refuses larger batches);
* ``flash_plain``: ``sampler="flash"`` without drafts, on the static engine
  (``engine="static"``, which is what "auto" picks on CUDA; on CPU it runs the same steps
  eagerly, so that the fused and materialized rows compare one engine);
* ``flash_self`` / ``flash_draft``: ``sampler="flash"`` with the target itself / the draft as
  assistant, G drafts per round, constant schedule;
* ``flash_self_materialized`` / ``flash_draft_materialized``: the same with
  ``sampler="materialized"`` (same engine, logits materialized and sampled by torch ops).

Every assistant gets ``num_assistant_tokens=G``, the "constant" schedule and
``assistant_confidence_threshold=0`` in its generation config, so stock drafts G tokens
every round as flashspec does (stock's default 0.4 would stop drafting early).

On CUDA the flash rows also give the engine's captured step graphs' GPU time (median of
3 x 20 replays after the timed calls; the state they mutate is the finished run's):
the plain step, or one round of drafts (draft_first + (G-1) draft_next) and the
verification of G drafts; and the tok/s those imply: B tokens per plain step, B * (1 -
a^(G+1)) / (1 - a) tokens per round at an i.i.d. per-position acceptance a (reported at
a = 1 and at the run's measured tokens per round). Plain rows (hf, hf_static_compile,
flash_plain) give the weight bytes read per second (target weights once per forward, one
forward per B tokens) as a fraction of the copy bandwidth measured at start (read +
written bytes of a 1 GiB device copy; 64 MiB on CPU). With greedy decoding every row
records whether its tokens equal the hf row's (bf16 near-ties may legitimately differ).
A variant that fails is recorded with its error and the run goes on.

Run (from the repository root):

    PYTHONPATH=. python scripts/tok_per_s.py --pair tiny,qwen3,llama          # on a GPU
    PYTHONPATH=. python scripts/tok_per_s.py --pair tiny --batch-sizes 1,2 --new-tokens 16 \\
        --prompt-length 16 --reps 1 --dtype fp32 --device cpu --out /tmp/x   # CPU smoke test

Writes ``tok_per_s.json`` and ``tok_per_s.png`` (with matplotlib) to --out and prints a
table last; progress goes to stderr. Offline: no downloads.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
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
from transformers import AutoConfig, AutoModelForCausalLM

import flashspec
from flashspec.assets import tiny_pair_path
from flashspec.generation.heads import output_head
from flashspec.generation.static import cached_engine

CONFIGS = Path(__file__).resolve().parent / "configs"
# pair -> (target, draft): config names under scripts/configs (random weights), or None for
# the built-in tiny pair's trained weights.
PAIRS = {"tiny": None,
         "qwen3": ("qwen3-1.7b", "qwen3-0.6b"),
         "llama": ("llama-3.1-8b", "llama-3.2-1b")}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SAMPLING = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
SEED = 0
PAD_TOKEN_ID = 0
GRAPH_REPLAYS = 20
GRAPH_TRIALS = 3
COPY_REPS = 5
GPU_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 64 << 20
STOCK_ASSISTED_MAX_BATCH = 1

PLAIN_VARIANTS = ("hf", "hf_static_compile", "flash_plain")
STOCK_TWIN = {"flash_self": "hf_assisted_self", "flash_self_materialized": "hf_assisted_self",
              "flash_draft": "hf_assisted", "flash_draft_materialized": "hf_assisted"}
MATERIALIZED_TWIN = {"flash_self": "flash_self_materialized",
                     "flash_draft": "flash_draft_materialized"}


class Skipped(Exception):
    """A variant that cannot run in this setting; its message is the row's status."""


class Case(NamedTuple):
    """One (pair, B) setting, as the variants see it."""

    target: torch.nn.Module
    draft: torch.nn.Module
    batch_size: int
    num_drafts: int
    cuda: bool


class Variant(NamedTuple):
    """Generate kwargs for a case (raises Skipped), and the engine sampler of a flash variant
    ("fused" / "materialized"; None for stock)."""

    kwargs: Callable[[Case], dict]
    engine_sampler: str | None


# ---------------------------------------------------------------- variants


def _stock(case: Case) -> dict:
    return {}


def _stock_static_compile(case: Case) -> dict:
    if not case.cuda:
        raise Skipped("skipped: transformers compiles the static-cache forward on CUDA only; "
                      "uncompiled on CPU it is not what is measured")
    return {"cache_implementation": "static"}


def _stock_assisted(case: Case, assistant: str) -> dict:
    if case.batch_size > STOCK_ASSISTED_MAX_BATCH:
        raise Skipped("skipped: stock assisted generation refuses batch_size > 1")
    return {"assistant_model": case.target if assistant == "self" else case.draft}


def _flash(case: Case, sampler: str, assistant: str | None = None) -> dict:
    # engine="static", not "auto": a setting the static engine cannot run fails loudly instead
    # of silently timing the eager loop (and on CPU both samplers run the same engine).
    kwargs = {"sampler": sampler, "engine": "static", "seed": SEED,
              "return_dict_in_generate": True}
    if assistant is not None:
        kwargs.update(assistant_model=case.target if assistant == "self" else case.draft,
                      num_assistant_tokens=case.num_drafts,
                      num_assistant_tokens_schedule="constant")
    return kwargs


VARIANTS: dict[str, Variant] = {
    "hf": Variant(_stock, None),
    "hf_static_compile": Variant(_stock_static_compile, None),
    "hf_assisted_self": Variant(partial(_stock_assisted, assistant="self"), None),
    "hf_assisted": Variant(partial(_stock_assisted, assistant="draft"), None),
    "flash_plain": Variant(partial(_flash, sampler="flash"), "fused"),
    "flash_self": Variant(partial(_flash, sampler="flash", assistant="self"), "fused"),
    "flash_self_materialized": Variant(
        partial(_flash, sampler="materialized", assistant="self"), "materialized"),
    "flash_draft": Variant(partial(_flash, sampler="flash", assistant="draft"), "fused"),
    "flash_draft_materialized": Variant(
        partial(_flash, sampler="materialized", assistant="draft"), "materialized"),
}


# ---------------------------------------------------------------- models


def _prepare(model, num_drafts: int):
    """Exact-length generations (no EOS), and G constant drafts when used as an assistant."""
    model.eval()
    config = model.generation_config
    config.eos_token_id = None
    config.pad_token_id = PAD_TOKEN_ID
    config.num_assistant_tokens = num_drafts
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0
    return model


def _random_model(name: str, device: str, dtype: torch.dtype):
    fields = json.loads((CONFIGS / f"{name}.json").read_text())
    fields.pop("_source")
    config = AutoConfig.for_model(**fields)
    torch.manual_seed(SEED)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def load_pair(name: str, device: str, dtype: torch.dtype, num_drafts: int):
    """(flashspec-wrapped target, draft, description)."""
    if PAIRS[name] is None:
        folder = tiny_pair_path()
        target, draft = (AutoModelForCausalLM.from_pretrained(folder / role, dtype=dtype).to(device)
                         for role in ("target", "draft"))
        names = ("tiny_pair/target", "tiny_pair/draft", "trained (built-in)")
    else:
        target, draft = (_random_model(config, device, dtype) for config in PAIRS[name])
        names = (*PAIRS[name], "random init")
    target = flashspec.wrap(_prepare(target, num_drafts))
    draft = _prepare(draft, num_drafts)
    description = {"target": names[0], "draft": names[1], "weights": names[2],
                   "vocab_size": target.config.vocab_size,
                   "target_weight_bytes": weight_bytes(target),
                   "draft_weight_bytes": weight_bytes(draft)}
    return target, draft, description


def weight_bytes(model) -> int:
    """Bytes of the parameters; `parameters()` yields a tied embedding once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def random_prompts(batch_size: int, length: int, vocab_size: int, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED)
    # From 1: 0 is the pad token (and the tiny pair's EOS).
    return torch.randint(1, vocab_size, (batch_size, length), generator=generator).to(device)


# ---------------------------------------------------------------- timing


def _synchronize(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def timed_calls(generate: Callable, reps: int, cuda: bool) -> tuple[list[float], object]:
    """Seconds of each of `reps` calls after one untimed warm-up, and the last output."""
    output = generate()
    seconds = []
    for _ in range(reps):
        _synchronize(cuda)
        start = time.perf_counter()
        output = generate()
        _synchronize(cuda)
        seconds.append(time.perf_counter() - start)
    return seconds, output


def copy_bandwidth_gbps(device: str) -> float:
    """GB/s (read + written bytes) of a large device-to-device copy, median of COPY_REPS."""
    cuda = device == "cuda"
    nbytes = GPU_COPY_BYTES if cuda else CPU_COPY_BYTES
    # ones, not empty: untouched CPU pages would read as the shared zero page, too fast.
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    destination = torch.empty_like(source)
    seconds, _ = timed_calls(partial(destination.copy_, source), COPY_REPS, cuda)
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
    if engine is None or not engine.shape.graphs or engine.shape.sampler != engine_sampler:
        return None
    graphs = {key: graph for key, (graph, _) in engine.graphs.items()}
    if engine.shape.drafter == "none":
        return {"plain": replay_ms([graphs["plain"]])} if "plain" in graphs else None
    verify = graphs.get(("verify", verify_width))
    if verify is None or "draft_first" not in graphs or (verify_width > 1
                                                         and "draft_next" not in graphs):
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
    row = {"variant": name, "status": "ok", "seconds": None, "tok_s": None, "flash_stats": None,
           "step_ms": None, "expected_tok_s": None}
    variant = VARIANTS[name]
    try:
        kwargs = variant.kwargs(case)

        def generate():
            torch.manual_seed(SEED)          # stock sampling draws from torch's generator
            return case.target.generate(**inputs, **kwargs)

        seconds, output = timed_calls(generate, args.reps, case.cuda)
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
    row["seconds"] = seconds
    row["tok_s"] = case.batch_size * args.new_tokens / statistics.median(seconds)
    if variant.engine_sampler is not None:
        row["flash_stats"] = _summary(output.flash_stats)
        verify_width = min(case.num_drafts, args.new_tokens - 1)
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
    """Ratios between the rows of one (pair, B), and the plain rows' weight bandwidth."""
    tok_s = {row["variant"]: row["tok_s"] for row in rows}
    for row in rows:
        name, batch = row["variant"], row["batch_size"]
        row["ratio"] = {
            "vs_hf_static_compile": _ratio(row["tok_s"], tok_s.get("hf_static_compile")),
            "vs_hf": _ratio(row["tok_s"], tok_s.get("hf")),
            "vs_stock_assisted": _ratio(row["tok_s"], tok_s.get(STOCK_TWIN.get(name))),
            "vs_materialized": _ratio(row["tok_s"], tok_s.get(MATERIALIZED_TWIN.get(name))),
        }
        # At batch B one forward reads the weights once and yields B tokens.
        row["weight_bandwidth_fraction"] = (
            target_bytes * row["tok_s"] / batch / (copy_gbps * 1e9)
            if name in PLAIN_VARIANTS and row["tok_s"] is not None else None)


def run_batch(pair: str, case: Case, args: argparse.Namespace, target_bytes: int,
              copy_gbps: float) -> list[dict]:
    device = "cuda" if case.cuda else "cpu"
    prompts = random_prompts(case.batch_size, args.prompt_length, case.target.config.vocab_size,
                             device)
    inputs = {"input_ids": prompts, "attention_mask": torch.ones_like(prompts),
              "max_new_tokens": args.new_tokens, "pad_token_id": PAD_TOKEN_ID,
              "eos_token_id": None, **(SAMPLING if args.sample else {"do_sample": False})}
    rows, hf_sequences = [], None
    for name in args.variants:
        print(f"{pair} B={case.batch_size} {name} ...", file=sys.stderr, flush=True)
        row, sequences = run_variant(name, case, inputs, args)
        row = {"pair": pair, "batch_size": case.batch_size, **row, "same_tokens_as_hf": None}
        if name == "hf":
            hf_sequences = sequences
        elif not args.sample and sequences is not None and hf_sequences is not None:
            row["same_tokens_as_hf"] = bool(torch.equal(sequences, hf_sequences))
        rows.append(row)
        # The result as soon as it is known: a run cut short still leaves its figures.
        print(f"    {json.dumps({k: row[k] for k in ('status', 'tok_s', 'step_ms', 'flash_stats', 'same_tokens_as_hf')})}",
              file=sys.stderr, flush=True)
    add_ratios(rows, target_bytes, copy_gbps)
    return rows


def run_pair(pair: str, args: argparse.Namespace, device: str, copy_gbps: float):
    print(f"loading pair {pair} ...", file=sys.stderr, flush=True)
    target, draft, description = load_pair(pair, device, DTYPES[args.dtype], args.num_drafts)
    rows = [row for batch in args.batch_sizes
            for row in run_batch(pair, Case(target, draft, batch, args.num_drafts,
                                            device == "cuda"),
                                 args, description["target_weight_bytes"], copy_gbps)]
    del target, draft
    gc.collect()         # the engine cached on the decoder refers back to it: a cycle
    if device == "cuda":
        torch.cuda.empty_cache()
    return description, rows


# ---------------------------------------------------------------- output


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def build_report(args: argparse.Namespace, device: str, copy_gbps: float, pairs: dict,
                 rows: list[dict]) -> dict:
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "triton": _version("triton"),
                     "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": {key: str(value) if isinstance(value, Path) else value
                 for key, value in vars(args).items()},
        "sampling": SAMPLING if args.sample else "greedy",
        "prompts": "random token ids in [1, vocab), torch.Generator seeded 0",
        "copy_gbps": copy_gbps,
        "pairs": pairs,
        "rows": rows,
    }


def write_plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError as error:
        print(f"note: no plot ({error}); pip install matplotlib for {path.name}")
        return
    pairs = list(report["pairs"])
    batch_sizes = report["args"]["batch_sizes"]
    variants = report["args"]["variants"]
    width = 0.8 / len(variants)
    fig, axes = plt.subplots(1, len(pairs), figsize=(8 * len(pairs), 5), squeeze=False)
    for ax, pair in zip(axes[0], pairs):
        tok_s = {(row["batch_size"], row["variant"]): row["tok_s"]
                 for row in report["rows"] if row["pair"] == pair}
        for index, name in enumerate(variants):
            bars = [(group + index * width, tok_s[batch, name])
                    for group, batch in enumerate(batch_sizes) if tok_s[batch, name] is not None]
            if bars:
                ax.bar(*zip(*bars), width=width, label=name)
        ax.set_xticks([group + 0.4 - width / 2 for group in range(len(batch_sizes))],
                      [f"B={batch}" for batch in batch_sizes])
        ax.set(yscale="log", ylabel="tokens / s",
               title=f"{pair} ({report['pairs'][pair]['target']}, {report['device']})")
        plain_numbers = FuncFormatter(lambda value, _: f"{value:g}")   # not 2.5x10^2
        ax.yaxis.set_major_formatter(plain_numbers)
        ax.yaxis.set_minor_formatter(plain_numbers)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7)
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
tok/s = B * new tokens / median s; x_stc, x_hf = / hf_static_compile, / hf; x_stk = / the stock
assisted twin; x_mat = fused / materialized; acc = accepted / drafted; len = tokens per target
forward; exp@1 = tok/s the step graphs allow at acceptance 1; bw = weight bytes read per s /
copy bandwidth; ms/step = GPU ms of the captured plain step, or of a round of G drafts and the
verification of G drafts."""


def print_table(report: dict) -> None:
    args = report["args"]
    decoding = "sampled (T=0.6, top-k 20, top-p 0.95)" if args["sample"] else "greedy"
    print(f"\n{report['device']}, copy bandwidth {report['copy_gbps']:.0f} GB/s, {args['dtype']}, "
          f"{decoding}, prompt {args['prompt_length']} + {args['new_tokens']} new tokens, "
          f"G={args['num_drafts']}")
    print(TABLE_LEGEND)
    print(f"{'pair':6} {'B':>3} {'variant':24} {'tok/s':>9} {'x_stc':>6} {'x_hf':>6} "
          f"{'x_stk':>6} {'x_mat':>6} {'acc':>5} {'len':>5} {'exp@1':>9} {'bw':>5}  ms/step")
    for row in report["rows"]:
        head = f"{row['pair']:6} {row['batch_size']:3d} {row['variant']:24}"
        if row["status"] != "ok":
            print(f"{head} {row['status']}"[:150])
            continue
        ratio, stats = row["ratio"], row["flash_stats"] or {}
        expected = (row["expected_tok_s"] or {}).get("all_accepted")
        print(f"{head} {_fmt(row['tok_s'], 9, 1)} {_fmt(ratio['vs_hf_static_compile'], 6, 2)} "
              f"{_fmt(ratio['vs_hf'], 6, 2)} {_fmt(ratio['vs_stock_assisted'], 6, 2)} "
              f"{_fmt(ratio['vs_materialized'], 6, 2)} {_fmt(stats.get('acceptance_rate'), 5, 2)} "
              f"{_fmt(stats.get('mean_accepted_length'), 5, 2)} {_fmt(expected, 9, 1)} "
              f"{_fmt(row['weight_bandwidth_fraction'], 5, 2)}  {_steps_text(row['step_ms'])}")


# ---------------------------------------------------------------- command line


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def positive_int(text: str) -> int:
    try:
        return _positive_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None


def parse_batch_sizes(text: str) -> list[int]:
    try:
        return [_positive_int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive ints (e.g. 1,4,16), got {text!r}") from None


def _names(text: str, known) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    return names


def parse_pairs(text: str) -> list[str]:
    return _names(text, PAIRS)


def parse_variants(text: str) -> list[str]:
    chosen = set(_names(text, VARIANTS))
    # Run in the table's order: hf first, so that later rows can compare their tokens to it.
    return [name for name in VARIANTS if name in chosen]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", type=parse_pairs, default=["tiny"],
                        help=f"comma-separated pairs: {', '.join(PAIRS)}; default tiny")
    parser.add_argument("--batch-sizes", type=parse_batch_sizes, default=[1, 4, 16],
                        help="comma-separated batch sizes B; default 1,4,16")
    parser.add_argument("--prompt-length", type=positive_int, default=128,
                        help="prompt tokens per row; default 128")
    parser.add_argument("--new-tokens", type=positive_int, default=256,
                        help="tokens generated per row; default 256")
    parser.add_argument("--num-drafts", type=positive_int, default=5,
                        help="drafts per verification G (constant schedule); default 5")
    parser.add_argument("--reps", type=positive_int, default=3,
                        help="timed calls per row (median), after one untimed warm-up; default 3")
    parser.add_argument("--variants", type=parse_variants, default=list(VARIANTS),
                        help="comma-separated variants; default all: " + ", ".join(VARIANTS))
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16",
                        help="model dtype; default bf16")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="default auto: cuda if available")
    parser.add_argument("--sample", action="store_true",
                        help="sample (T=0.6, top-k 20, top-p 0.95, seed 0) instead of greedy")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out"),
                        help="directory for tok_per_s.json and tok_per_s.png; default $OUT if "
                             "set, else ./bench_out")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the comparison; returns the exit code (argparse exits with 2 on bad arguments)."""
    args = parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    copy_gbps = copy_bandwidth_gbps(device)
    pairs, rows = {}, []
    for pair in args.pair:
        pairs[pair], pair_rows = run_pair(pair, args, device, copy_gbps)
        rows += pair_rows
    report = build_report(args, device, copy_gbps, pairs, rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tok_per_s.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out / 'tok_per_s.json'}")
    write_plot(report, args.out / "tok_per_s.png")
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
