"""Time flashspec's fused sampler for several tile configurations per batch size (GPU).

How the fixed tile table in `flashspec/kernels/ops.py::default_config` was chosen:

    PYTHONPATH=. python scripts/sweep_tiles.py [--dim 4096 --vocab 151936] [--out DIR]

Prints, per B, each configuration's median time and ratio to the HBM floor; writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton

import flashspec
from flashspec.kernels import TileConfig, argmax_unchecked, sample_unchecked


def measure_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--batch-sizes", default="1,16,32,64,128,256")
    parser.add_argument("--truncation", action="store_true", help="time top_k=20, top_p=0.95")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)

    bandwidth = measure_bandwidth()
    weight = torch.randn(args.vocab, args.dim, device="cuda", dtype=torch.bfloat16) / args.dim**0.5
    results = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        hidden = torch.randn(batch, args.dim, device="cuda", dtype=torch.bfloat16) * 3
        truncation = dict(top_k=20, top_p=0.95) if args.truncation else {}
        params = flashspec.SamplingParams.create(batch, temperature=0.7, seed=0, device="cuda",
                                                 **truncation)
        positions = torch.zeros(batch, dtype=torch.long, device="cuda")
        floor_ms = (args.vocab * args.dim + batch * args.dim) * 2 / bandwidth * 1e3
        matmul_ms = triton.testing.do_bench(lambda: hidden @ weight.T, return_mode="median")
        block_rs = ([16] if batch <= 16 else [16, 32] if batch <= 32 else [32, 64] if batch <= 64
                    else [64, 128])
        # Two stages leave room for two resident programs per SM, so one program's
        # sampling epilogue can overlap another's main loop.
        for block_v, block_r, block_d, warps, stages in itertools.product(
                [64, 128], block_rs, [64, 128], [4, 8], [2, 3, 4]):
            config = TileConfig(block_v=block_v, block_r=block_r, block_d=block_d,
                                num_warps=warps, num_stages=stages)
            try:
                ms = triton.testing.do_bench(
                    lambda: sample_unchecked(hidden, weight, params, positions, config=config),
                    return_mode="median")
            except Exception as error:  # out of shared memory etc.: skip the config
                print(f"B={batch} {config}: {type(error).__name__}")
                continue
            results.append(dict(batch=batch, config=config.__dict__, ms=ms, floor_ms=floor_ms,
                                matmul_ms=matmul_ms))
        best = sorted((r for r in results if r["batch"] == batch), key=lambda r: r["ms"])[:3]
        for r in best:
            print(f"B={batch:4d} {r['ms']:.4f} ms  x{r['ms'] / floor_ms:.3f} floor  "
                  f"x{r['ms'] / matmul_ms:.3f} matmul  {r['config']}")
        default_ms = triton.testing.do_bench(
            lambda: sample_unchecked(hidden, weight, params, positions), return_mode="median")
        argmax_ms = triton.testing.do_bench(lambda: argmax_unchecked(hidden, weight),
                                            return_mode="median")
        print(f"B={batch:4d} default {default_ms:.4f} ms x{default_ms / floor_ms:.3f} floor; "
              f"argmax {argmax_ms:.4f}; matmul {matmul_ms:.4f}; floor {floor_ms:.4f}")
    with open(os.path.join(args.out, "sweep_tiles.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), bandwidth=bandwidth, dim=args.dim,
                       vocab=args.vocab, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
