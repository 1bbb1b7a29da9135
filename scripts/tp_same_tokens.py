"""Tokens of a tensor-parallel target (tp_plan="auto") against the same model on one GPU,
greedy and seeded, plain and speculative (flashspec.bench.parallel_tokens), under torchrun:

    torchrun --nproc-per-node 2 scripts/tp_same_tokens.py --pair llama --out tokens.json

The pair: a --pair preset, or --random-init TARGET_SHAPE[,DRAFT_SHAPE] (shipped config names
or config.json paths, as scripts/tok_per_s.py takes them). --device cpu runs on gloo (the
tests' way). Rank 0 prints one line per case and writes the JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from flashspec.bench import pairs, parallel_tokens
from flashspec.bench.cli import model_name, positive_int, random_init_shapes
from flashspec.bench.random_init import WEIGHTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(pairs.PAIRS), default="llama")
    parser.add_argument("--random-init", type=random_init_shapes,
                        help="TARGET_SHAPE[,DRAFT_SHAPE] instead of --pair")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=sorted(pairs.DTYPES), default="bf16")
    parser.add_argument("--weights", choices=sorted(WEIGHTS), default="peaked")
    parser.add_argument("--batch-size", type=positive_int, default=4)
    parser.add_argument("--prompt-length", type=positive_int, default=64)
    parser.add_argument("--new-tokens", type=positive_int, default=64)
    parser.add_argument("--out", help="JSON file written by rank 0")
    args = parser.parse_args()
    if pairs.torchrun_world_size() < 2:
        parser.error("run it under torchrun with 2 processes or more (one GPU each on CUDA)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; pass --device cpu")
    spec = pairs.PAIRS[args.pair]
    if args.random_init is not None:
        target, *draft = args.random_init
        spec = pairs.PairSpec(model_name(target), target, draft[0] if draft else None, True)
    with pairs.tensor_parallel_run(args.device):
        report = parallel_tokens.compare(spec, pairs.DTYPES[args.dtype], args.weights,
                                         args.batch_size, args.prompt_length, args.new_tokens,
                                         args.device)
        if dist.get_rank() == 0:
            report.update(device=(torch.cuda.get_device_name() if args.device == "cuda"
                                  else "cpu"), ranks=dist.get_world_size())
            print(f"{report['ranks']} x {report['device']}: {spec.label}, {args.dtype}, "
                  f"{args.weights} weights, B {args.batch_size}, {args.new_tokens} tokens")
            for name, result in [*report["cases"].items(), ("stock greedy",
                                                             report["stock greedy"])]:
                print(f"{name:>24}: {'same' if result['same'] else 'differ'} "
                      f"(first difference per row: {result['first_difference']})")
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
