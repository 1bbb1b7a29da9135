"""Cold start: what each call of a new user's session costs, compiled and captured or not.

Runs issue 28's call sequence (`flashspec.bench.cold_start.CALLS`) in one process on a
target/draft pair (random weights at real shapes, peaked so the draft is accepted), each call
as it comes and then again warm; then the steady tok/s (prompt 128 and 2000), the time to
first token against stock transformers, a plain call in a grown slot against a fresh one,
and the first call of a second process (model loading excluded) with the disk cache warm.
Prints a table (call, shape, wall seconds, seconds over warm, steady tok/s, compiled?,
captures) and where compilation time went; writes cold_start.json and cold_start.png to
--out.

    PYTHONPATH=. python scripts/cold_start.py                       # Qwen3-1.7B + 0.6B shapes
    PYTHONPATH=. python scripts/cold_start.py --pair tiny --new-tokens 16 --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

import flashspec
from flashspec.bench.cli import Progress, package_version, positive_int, pyplot_or_note, resolve_device
from flashspec.bench.cold_start import (CALLS, capacity_cost, first_of_its_kind, run_sequence,
                                        steady_state, time_to_first_token, timed_call)
from flashspec.bench.random_init import peak_weights, random_model
from flashspec.generation.engine import batch_bucket

PAIRS = {"qwen3": ("qwen3-1.7b", "qwen3-0.6b"), "llama": ("llama-3.1-8b", "llama-3.2-1b"),
         "tiny": (None, None)}


def load_pair(pair: str, device: str):
    """(wrapped target, draft) at the pair's shapes, bf16 on CUDA, peaked weights; `tiny`:
    the package's built-in pair."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if pair == "tiny":
        from transformers import AutoModelForCausalLM

        from flashspec.assets import tiny_pair_path
        target = flashspec.from_pretrained(tiny_pair_path() / "target", dtype=dtype).to(device)
        draft = AutoModelForCausalLM.from_pretrained(tiny_pair_path() / "draft", dtype=dtype).to(device)
    else:
        target_shape, draft_shape = PAIRS[pair]
        target = flashspec.wrap(peak_weights(random_model(target_shape, device, dtype)))
        draft = peak_weights(random_model(draft_shape, device, dtype, seed=1))
    for model in (target, draft):
        model.generation_config.eos_token_id = None     # every call runs its full length
    return target.eval(), draft.eval()


def second_process(args, environment: dict) -> dict:
    """The first call of a new process (this script with --first-call-only), started with
    `environment`: this one's as it started, before compilers set cache variables
    (TRITON_CACHE_DIR...) for their own process."""
    command = [sys.executable, __file__, "--first-call-only", "--pair", args.pair, "--device",
               args.device, "--new-tokens", str(args.new_tokens)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=environment)
    if done.returncode != 0:
        raise RuntimeError(f"the second process failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_seconds"] = time.perf_counter() - started
    return result


def main(argv=None) -> int:
    environment = os.environ.copy()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="qwen3")
    parser.add_argument("--new-tokens", type=positive_int, default=128)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out"))
    parser.add_argument("--ttft-prompt", type=positive_int, default=2000,
                        help="prompt length of the time-to-first-token comparison and of the "
                        "call that grows the slot for the capacity check")
    parser.add_argument("--no-second-process", action="store_true",
                        help="skip the fresh process's first call")
    parser.add_argument("--first-call-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.device = resolve_device(args.device)
    transformers.logging.set_verbosity_error()

    load_started = time.perf_counter()
    target, draft = load_pair(args.pair, args.device)
    load_seconds = time.perf_counter() - load_started
    if args.first_call_only:
        row = timed_call(target, draft, CALLS[0], args.new_tokens)
        print(json.dumps({**row, "load_seconds": load_seconds}))
        return 0

    progress = Progress(len(CALLS), unit="call")
    rows = run_sequence(target, draft, args.new_tokens, progress=progress)
    progress.close()
    graphs = args.device == "cuda"
    firsts = first_of_its_kind(rows, lambda rows_: batch_bucket(rows_, graphs))
    for row, first in zip(rows, firsts):
        row["first_of_kind"] = first
    steady = steady_state(target, draft)
    ttft = time_to_first_token(target, args.ttft_prompt)
    capacity = capacity_cost(target, long_prompt=args.ttft_prompt)
    second = None if args.no_second_process else second_process(args, environment)
    report = {
        "device": torch.cuda.get_device_name() if graphs else "cpu", "pair": args.pair,
        "new_tokens": args.new_tokens, "date": time.strftime("%Y-%m-%d"),
        "versions": {name: package_version(name) for name in ("torch", "triton", "transformers")},
        "load_seconds": load_seconds, "calls": rows, "steady": steady, "second_process": second,
        "time_to_first_token": ttft, "capacity_cost": capacity,
        "total_compile_seconds": sum(r["first"]["compile_seconds"] + r["warm"]["compile_seconds"]
                                     for r in rows),
        "total_capture_seconds": sum(r["first"]["capture_seconds"] + r["warm"]["capture_seconds"]
                                     for r in rows),
        # Where compilation time went (dynamo's tracing, AOT autograd, inductor), per phase.
        "compile_phases": torch._dynamo.utils.compile_times(repr="str"),
        "worst_extra_after_first_of_kind": max(
            (r["extra_seconds"] for r, first in zip(rows, firsts) if not first), default=0.0),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cold_start.json").write_text(json.dumps(report, indent=1))
    print(f"{report['device']}, pair {args.pair}, {args.new_tokens} new tokens per row")
    print(f"{'call':22} {'B':>2} {'prompt':>6} {'first s':>8} {'over warm':>9} {'tok/s':>7} "
          f"{'compiled':>8} {'captures':>8}")
    for row in rows:
        first = row["first"]
        print(f"{row['name']:22} {row['batch_size']:>2} {row['prompt_length']:>6} "
              f"{first['seconds']:8.2f} {row['extra_seconds']:9.2f} {row['steady_tok_s']:7.1f} "
              f"{first['compile_seconds']:7.1f}s {first['captures']:8d}")
    print(f"compile {report['total_compile_seconds']:.1f} s, capture "
          f"{report['total_capture_seconds']:.1f} s in all; worst call over warm after the first "
          f"of its kind: {report['worst_extra_after_first_of_kind']:.2f} s")
    for row in steady:
        print(f"{row['name']}: {row['tok_s']:.1f} tok/s (prompt {row['prompt_length']} + "
              f"{row['new_tokens']} new tokens, median of 3)")
    print(f"time to first token, prompt {ttft['prompt_length']}: flash {ttft['flash'] * 1e3:.1f} ms, "
          f"stock {ttft['stock'] * 1e3:.1f} ms ({ttft['ratio']:.2f}x)")
    print(f"plain call in a slot of {capacity['large']['capacity']} KV columns against "
          f"{capacity['small']['capacity']}: {capacity['ratio']:.3f}x "
          f"({capacity['large']['seconds']:.3f} s / {capacity['small']['seconds']:.3f} s)")
    print(report["compile_phases"])
    if second is not None:
        print(f"second process: first call {second['seconds']:.2f} s (compile "
              f"{second['compile_seconds']:.1f} s), model load {second['load_seconds']:.1f} s")
    plt = pyplot_or_note(args.out / "cold_start.png")
    if plt is not None:
        figure, axis = plt.subplots(figsize=(10, 4))
        names = [row["name"] for row in rows]
        axis.bar(names, [row["first"]["seconds"] for row in rows], label="as it comes")
        axis.bar(names, [row["warm"]["seconds"] for row in rows], label="warm")
        axis.set_ylabel("seconds per generate() call")
        axis.set_yscale("log")
        axis.set_title(f"cold start, {report['device']}, {args.pair}")
        axis.tick_params(axis="x", rotation=45)
        axis.legend()
        figure.tight_layout()
        figure.savefig(args.out / "cold_start.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
