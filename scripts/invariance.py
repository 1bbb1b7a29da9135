"""Seeded tokens with and without drafts, alone and in a batch: how many rows match (issue 29).

For each shape (random weights at real shapes, bf16 on CUDA, LM head scaled so that Gumbel
races are close), `--rows` prompts of `--prompt` tokens whose second half repeats the first,
`--new-tokens` each, seeded sampling (T 1, no truncation) and greedy: the rows one per call
without drafts, self-drafted, drafted by an assistant of the family's smallest shape
(another random init), by prompt lookup, and all rows as one batch. Prints per way the rows
equal to the plain run, with the invariant decoder kernels and (`--compare-off`) without
them; `--speed` shapes: plain and assistant tok/s (128-token prompt, 256 new tokens) with
and without them. JSON to --out.

    PYTHONPATH=. python scripts/invariance.py --shapes qwen3-0.6b --speed qwen3-1.7b
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import flashspec
from flashspec.bench.cli import resolve_device
from flashspec.bench.cold_start import Call, steady_state
from flashspec.bench.invariance import (WAYS, equal_rows, invariance_runs, repeating_prompts,
                                        scaled_head)
from flashspec.bench.random_init import peak_weights, random_model
from flashspec.generation.engine import cached_engine

ASSISTANT_SHAPE = {"qwen3": "qwen3-0.6b", "llama": "llama-3.2-1b"}
SAMPLINGS = {"sampled": dict(do_sample=True, temperature=1.0, top_k=0),
             "greedy": dict(do_sample=False)}


def load(shape: str, device: str, head_scale: float | None):
    """(wrapped target, assistant): the LM head scaled by `head_scale`, or, without one, both
    models peaked (`peak_weights`: drafts then get accepted, as for tok/s)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target = flashspec.wrap(random_model(shape, device=device, dtype=dtype, seed=0).eval())
    assistant = random_model(ASSISTANT_SHAPE[shape.split("-")[0]], device=device, dtype=dtype,
                             seed=1).eval()
    if head_scale is None:
        peak_weights(target)
        peak_weights(assistant)
    else:
        scaled_head(target, head_scale)
    for model in (target, assistant):
        model.generation_config.eos_token_id = None     # every row runs its full length
    return target, assistant


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-0.6b,llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--speed", default="", help="shapes whose tok/s to compare")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--head-scale", type=float, default=3.0)
    parser.add_argument("--samplings", default="sampled,greedy", help="of: sampled, greedy")
    parser.add_argument("--ways", default=",".join(WAYS[1:]),
                        help=f"compared with plain, of: {', '.join(WAYS[1:])}")
    parser.add_argument("--compare-off", default="", help="shapes also run without the kernels")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out"))
    args = parser.parse_args(argv)
    for option, given, allowed in (("--samplings", args.samplings, SAMPLINGS),
                                   ("--ways", args.ways, WAYS[1:])):
        unknown = set(given.split(",")) - set(allowed)
        if unknown:
            parser.error(f"{option}: {sorted(unknown)} not among {sorted(allowed)}")
    device = resolve_device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "rows": args.rows, "prompt": args.prompt, "new_tokens": args.new_tokens,
              "head_scale": args.head_scale, "invariance": [], "speed": []}
    shapes = [s for s in args.shapes.split(",") if s]
    speed = [s for s in args.speed.split(",") if s]
    off = args.compare_off.split(",")
    jobs = [(shape, "invariance") for shape in shapes] + [(shape, "speed") for shape in speed]
    for shape, job in jobs:
        target, assistant = load(shape, device, args.head_scale if job == "invariance" else None)
        for on in [True, False] if job == "speed" or shape in off else [True]:
            if job == "invariance":
                ids = repeating_prompts(args.rows, args.prompt, target.config.vocab_size, device)
                for name in args.samplings.split(","):
                    runs = invariance_runs(target, assistant, ids, args.new_tokens,
                                           SAMPLINGS[name], ways=args.ways.split(","),
                                           invariant=on)
                    counts = equal_rows(runs["tokens"])
                    row = {"shape": shape, "invariant": on, "sampling": name, "equal": counts,
                           "seconds": runs["seconds"]}
                    report["invariance"].append(row)
                    (args.out / "invariance.json").write_text(json.dumps(report, indent=1))
                    print(f"{shape:14s} {'invariant' if on else 'off':9s} {name:7s} " + "  ".join(
                        f"{way} {counts[way]['equal']}/{counts[way]['rows']}" for way in counts),
                        flush=True)
            else:
                calls = [Call("plain", 1, 128, invariant=on),
                         Call("assistant 5", 1, 128, "assistant", invariant=on)]
                for row in steady_state(target, assistant, calls):
                    kernels = {slot.target.runner.invariant
                               for slot in cached_engine(target.model).slots.values()}
                    report["speed"].append({"shape": shape, "invariant": on, **row,
                                            "slots_invariant": sorted(kernels)})
                    (args.out / "invariance.json").write_text(json.dumps(report, indent=1))
                    print(f"{shape:14s} {'invariant' if on else 'off':9s} {row['name']:12s} "
                          f"{row['tok_s']:7.1f} tok/s", flush=True)
        del target, assistant
        if device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
