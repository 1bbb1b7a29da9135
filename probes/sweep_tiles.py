"""Time flashspec's fused kernels under several tile configurations per row count (GPU).

How the fixed tile tables in `flashspec/kernels/tile_config.py::default_config` are chosen:

    PYTHONPATH=. python probes/sweep_tiles.py --kernel sample --rows 1,16,64
    PYTHONPATH=. python probes/sweep_tiles.py --kernel verify --drafts 3 --rows 64,128,256 \
        --configs "128,64,64,8,4 128,128,128,8,3,2"
    PYTHONPATH=. TRITON_INTERPRET=1 python probes/sweep_tiles.py --quick   # CPU smoke run

--kernel: argmax; sample (T 0.7); qwen (T 0.6, top-k 20, top-p 0.95); topp (T 0.8, top-p 0.9
with no top-k, as vLLM's defaults leave it); verify, verify-qwen and verify-topp (the same
settings, random drafts; rows = B * (G + 1) with G = --drafts).
Each configuration, the default table's and cuBLAS matmul of the same rows are timed in one
run and the same way as scripts/bench_kernels.py (CUDA-graph replay, do_bench median, L2
flushed), so their ratios are what a choice can rest on: the same verification timed by two
harnesses differed by up to 13% (H100, R = 96-256, 2026-11-21).

Prints, per row count, the default's and the three fastest configurations' times against
matmul; writes sweep_tiles.json (device, every timing) to --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from functools import partial
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_kernels as bk  # noqa: E402 - a user script (scripts/), not a package

KERNELS = ("argmax", "sample", "qwen", "topp", "verify", "verify-qwen", "verify-topp")
SETTINGS = {"sample": dict(temperature=0.7), "qwen": dict(temperature=0.6, top_k=20, top_p=0.95),
            "topp": dict(temperature=0.8, top_p=0.9)}
QUICK_SHAPE = (32, 200)


def setting_of(kernel: str) -> str:
    """The SETTINGS entry of a sampling or verification kernel ("verify-qwen" -> "qwen")."""
    return kernel.removeprefix("verify").removeprefix("-") or "sample"


FLAGS = ("ws", "screen", "race")


def parse_configs(text: str):
    """TileConfigs from "bv,br,bd,warps,stages[,parts][,ws][,screen][,race]" items separated by
    spaces or ';' ("ws": the warp-specialized Gluon stage 1, Hopper only; "screen": the noise
    screen, TileConfig.screen; "race": the race bound, TileConfig.race)."""
    from flashspec.kernels import TileConfig

    configs = []
    for item in text.replace(";", " ").split():
        try:
            words = item.split(",")
            flags = set()
            while words and words[-1] in FLAGS:
                flags.add(words.pop())
            fields = [int(x) for x in words]
            if len(fields) not in (5, 6):
                raise ValueError("expected 5 or 6 integers")
            names = ("block_v", "block_r", "block_d", "num_warps", "num_stages", "epilogue_parts")
            configs.append(TileConfig(**dict(zip(names, fields)), warp_specialized="ws" in flags,
                                      screen="screen" in flags, race="race" in flags))
        except (ValueError, TypeError) as error:
            raise argparse.ArgumentTypeError(
                f"--configs item {item!r}: {error} "
                "(bv,br,bd,warps,stages[,parts][,ws][,screen][,race])"
            ) from None
    return configs


def default_grid(rows: int):
    """The grid swept when --configs is not given: row tiles that fit `rows`, two vocab
    widths, two reduction steps, 4 or 8 warps, 2-4 stages (two stages leave room for two
    programs per SM, so one's epilogue can overlap another's main loop)."""
    from flashspec.kernels import TileConfig

    block_rs = ([16] if rows <= 16 else [16, 32] if rows <= 32 else [32, 64] if rows <= 64
                else [64, 128])
    grid = itertools.product([64, 128], block_rs, [64, 128], [4, 8], [2, 3, 4])
    return [TileConfig(block_v=bv, block_r=br, block_d=bd, num_warps=w, num_stages=s)
            for bv, br, bd, w, s in grid]


def default_config_of(kernel: str, rows: int, hidden: torch.Tensor, weight: torch.Tensor):
    """The tile configuration flashspec picks for `rows` rows of this kernel and operands."""
    from flashspec.kernels import default_config, ops

    truncates = bool(SETTINGS.get(setting_of(kernel), {}).keys() & {"top_k", "top_p"})
    return default_config(rows, 2, truncation=truncates,
                          verification=kernel.startswith("verify"),
                          warp_specialized=ops.warp_specialized_ready(hidden, weight))


def make_weight(vocab: int, dim: int, device) -> torch.Tensor:
    """The sweep's bf16 LM-head weight ``[vocab, dim]`` (seeded, unit-variance logits)."""
    return (torch.randn(vocab, dim, generator=torch.Generator().manual_seed(1)) / dim**0.5
            ).to(device, torch.bfloat16)


def make_launch(kernel: str, rows: int, drafts: int, weight: torch.Tensor):
    """(launch(config) -> outputs, hidden rows [R, D] for the matmul) for `rows` rows."""
    import flashspec
    from flashspec.kernels import fused_argmax, fused_sample, fused_verify

    vocab, dim = weight.shape
    device = weight.device
    verify = kernel.startswith("verify")
    positions_per_row = drafts + 1 if verify else 1
    batch = rows // positions_per_row
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(rows, dim, generator=gen, device=device).mul_(bk.HIDDEN_SCALE)
    hidden = hidden.to(weight.dtype)
    positions = torch.zeros(batch, dtype=torch.long, device=device)
    if kernel == "argmax":
        return (lambda config: fused_argmax(hidden, weight, config=config)), hidden
    setting = SETTINGS[setting_of(kernel)]
    params = flashspec.SamplingParams.create(batch, seed=0, device=device, **setting)
    if not verify:
        return (lambda config: fused_sample(hidden, weight, params, positions,
                                            config=config)), hidden
    draft_tokens = torch.randint(0, vocab, (batch, drafts), generator=gen, device=device)
    hidden3 = hidden.view(batch, positions_per_row, dim)
    return (lambda config: fused_verify(hidden3, weight, draft_tokens, params, positions,
                                        config=config)), hidden


def time_config(launch: Callable, config, timer: Callable, cuda: bool) -> dict:
    """{"ms", "timing", "error"} of `launch(config)`, timed as bench_kernels times its
    variants ("graph" replay, or "eager: <why>" where capture failed; "eager" on the CPU).
    A configuration that fails (out of shared memory, say) gives ms None and its error."""
    try:
        fn = partial(launch, config)
        fn()  # the compile
        timed, how = bk.graph_replay(fn) if cuda else (fn, "eager")
        return dict(ms=timer(timed), timing=how, error=None)
    except Exception as error:  # noqa: BLE001
        if cuda:
            torch.cuda.empty_cache()
        return dict(ms=None, timing=None, error=bk._status_of(error))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=KERNELS, default="sample")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--rows", default="1,16,32,64,128,256",
                        help="row counts (verify: B * (G + 1))")
    parser.add_argument("--drafts", type=int, default=3, help="G, for verify kernels")
    parser.add_argument("--configs", type=parse_configs, default=None,
                        help='"bv,br,bd,warps,stages[,parts][,ws][,screen][,race] ..." '
                             "(default: a grid per row count)")
    parser.add_argument("--quick", action="store_true", help="tiny shape, CPU interpreter too")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    try:
        args.rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows {args.rows!r}: expected comma-separated positive integers")
    if min(args.rows) < 1 or args.drafts < 1:
        parser.error(f"--rows {args.rows} and --drafts {args.drafts} must be positive")
    if args.kernel.startswith("verify") and any(r % (args.drafts + 1) for r in args.rows):
        parser.error(f"--rows {args.rows}: each must be a multiple of --drafts + 1 = "
                     f"{args.drafts + 1} for --kernel {args.kernel}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not (args.quick and os.environ.get("TRITON_INTERPRET") == "1"):
        print("sweep_tiles.py times GPU kernels: run it on a CUDA machine, or with --quick and "
              "TRITON_INTERPRET=1 (Triton's interpreter on the CPU)", file=sys.stderr)
        return 2
    dim, vocab = QUICK_SHAPE if args.quick else (args.dim, args.vocab)
    timer = (partial(bk.time_cuda_ms, rep_ms=bk.QUICK_REP_MS if args.quick else bk.FULL_REP_MS)
             if cuda else partial(bk.time_cpu_ms, rep_ms=bk.QUICK_REP_MS))
    device = "cuda" if cuda else "cpu"
    weight = make_weight(vocab, dim, device)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    results = []
    for rows in args.rows:
        launch, hidden = make_launch(args.kernel, rows, args.drafts, weight)
        matmul_ms = time_config(lambda _: hidden @ weight.T, None, timer, cuda)["ms"]
        configs = args.configs or default_grid(rows)
        if args.quick and args.configs is None:
            configs = configs[:2]
        default_config = default_config_of(args.kernel, rows, hidden, weight)
        these = []
        for config in [None] + configs:
            these.append(dict(rows=rows, default=config is None,
                              config=(config or default_config).__dict__, matmul_ms=matmul_ms,
                              **time_config(launch, config, timer, cuda)))
        results += these
        fastest = sorted((r for r in these[1:] if r["ms"] is not None), key=lambda r: r["ms"])
        for r in these[:1] + fastest[:3]:
            ms = "error" if r["ms"] is None else f"{r['ms']:.4f} ms"
            if r["ms"] is not None and matmul_ms is not None:
                ms += f" x{r['ms'] / matmul_ms:.3f} matmul"
            label = "default" if r["default"] else "       "
            print(f"{args.kernel} R={rows:4d} {label} {ms}  {r['error'] or r['config']}",
                  flush=True)
        # After every row count: what a run cut off by its time limit timed is kept.
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sweep_tiles.json"), "w") as f:
            json.dump(dict(device=name, kernel=args.kernel, dim=dim, vocab=vocab,
                           drafts=args.drafts, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
