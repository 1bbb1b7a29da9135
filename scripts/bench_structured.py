"""Structured output's cost: tok/s with and without a grammar, plain and with prompt lookup.

    PYTHONPATH=. python scripts/bench_structured.py --shape qwen3-1.7b --batch-sizes 1,8,32 \\
        --out $OUT/structured

See flashspec/bench/structured.py for the setup (random weights, the tiny tokenizer, a
grammar of endless JSON lines). Writes structured.json under --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from flashspec.bench.structured import load, measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-1.7b")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--drafts", default="none,lookup", help="none, lookup, or both")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, tokenizer = load(args.shape, args.device)
    rows = [measure(model, tokenizer, int(b), drafts, args.new_tokens, args.prompt_length,
                    args.reps)
            for drafts in args.drafts.split(",") for b in args.batch_sizes.split(",")]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{args.shape}, {device}, {args.prompt_length} + {args.new_tokens} tokens, greedy")
    print(f"{'B':>3} {'drafts':>7} {'free tok/s':>11} {'grammar tok/s':>14} {'ratio':>6}  steps")
    for row in rows:
        steps = " ".join(row.get("grammar_steps", []))
        print(f"{row['batch']:>3} {row['drafts']:>7} {row['free_tok_s']:>11.1f} "
              f"{row['grammar_tok_s']:>14.1f} {row['ratio']:>6.3f}  {steps}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "structured.json").write_text(json.dumps(
            {"shape": args.shape, "device": device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
