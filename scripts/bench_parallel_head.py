"""The vocab-parallel LM-head step (flashspec.parallel, fused kernels per shard) against
all-gathering the logits and sampling them, on one GPU per rank:

    torchrun --nproc-per-node 2 scripts/bench_parallel_head.py --out head.json

Defaults: Llama-3.1-8B's head (D 4096, V 128,256) in bf16, B = 1, 4, 16, 64; the modes and
the timing are flashspec.bench.parallel_head's. Rank 0 prints the table and writes the JSON;
``read`` is the shard's cuBLAS product alone, ``past`` flash's time past it over the
gathered step's.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from flashspec.bench import pairs, parallel_head
from flashspec.bench.cli import positive_int, positive_ints


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=lambda text: positive_ints(text, "1,4,16,64"),
                        default=[1, 4, 16, 64])
    parser.add_argument("--dim", type=positive_int, default=4096)
    parser.add_argument("--vocab-size", type=positive_int, default=128_256)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--out", help="JSON file written by rank 0")
    args = parser.parse_args()
    if pairs.torchrun_world_size() < 2 or not torch.cuda.is_available():
        parser.error("run it under torchrun with 2 processes or more, one GPU each")
    with pairs.tensor_parallel_run("cuda"):
        rows = parallel_head.run(args.batch_sizes, args.dim, args.vocab_size,
                                 getattr(torch, args.dtype))
        if dist.get_rank() == 0:
            report = {"device": torch.cuda.get_device_name(), "ranks": dist.get_world_size(),
                      "dim": args.dim, "vocab_size": args.vocab_size, "dtype": args.dtype,
                      "torch": torch.__version__, "rows": rows}
            print(f"{report['ranks']} x {report['device']}, D {args.dim}, V {args.vocab_size}, "
                  f"{args.dtype}; microseconds per step")
            print(f"{'mode':>9} {'B':>3} {'read':>6} {'flash':>8} {'gathered':>9} "
                  f"{'speedup':>7} {'past':>5} {'eager':>7} {'B/row':>6} {'flagged':>7}  timing")
            for row in rows:
                print(f"{row['mode']:>9} {row['batch_size']:>3} {row['read_us']:>6.1f} "
                      f"{row['flash_us']:>8.1f} {row['gathered_us']:>9.1f} {row['speedup']:>7.2f} "
                      f"{row['past_read_ratio']:>5.2f} "
                      f"{row['eager_speedup']:>7.2f} {row['summary_bytes_per_row']:>6} "
                      f"{row['flagged_rows']:>7.2f}  "
                      f"{row['flash_timing'][:40]} / {row['gathered_timing'][:40]}")
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
