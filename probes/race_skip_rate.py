"""How often the race bound (`TileConfig.race`) lets stage 1 skip a tile's search (GPU).

Runs stage 1 alone (`flashspec.kernels.ops.stage1_best_scores`) with the race on and the
log-sum-exp, as sampling always computes it, every row sampled without truncation, on the
benchmarks' random problem (probes/sweep_tiles.py's weight; hidden states scaled by
--hidden-scale), and reports the share of (row, vocab tile)
summaries that the race left out (their best is -inf: the whole chunk of rows was beaten, or,
since the leaders' path, the row had no column the bound could not rule out in a chunk where
no row had two), over all tiles, the first 200 and the last 500 (programs that start later
see stronger bounds).
On a GPU the share depends on which programs run at once, so it varies a little between runs.

    PYTHONPATH=. python probes/race_skip_rate.py --rows 256 --out $OUT
    PYTHONPATH=. TRITON_INTERPRET=1 python probes/race_skip_rate.py --quick   # CPU smoke run

Before the leaders' path (H100, T 0.7, whole chunks beaten): seventeenth session, hidden
scale 1, 0.860 / 0.456 / 0.963 at R = 256 and 0.789 / 0.345 / 0.929 at R = 512 (the 8-warp
entry with the race forced on); eighteenth session, the default scale, 0.858 / 0.452 / 0.964
and 0.790 / 0.336 / 0.927. Since, rows of the leaders' chunks count too (a review measured
0.94 at R = 256). All of these without the log-sum-exp (the race's other form of its test).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep_tiles  # noqa: E402 - a sibling script, not a package


def skip_rates(rows: int, dim: int, vocab: int, temperature: float, hidden_scale: float,
               device: str) -> dict:
    from flashspec import SamplingParams
    from flashspec.kernels import default_config, ops

    weight = sweep_tiles.make_weight(vocab, dim, device)
    hidden = torch.randn(rows, dim, generator=torch.Generator().manual_seed(2)).mul_(hidden_scale)
    hidden = hidden.to(device, weight.dtype)
    params = SamplingParams.create(rows, do_sample=True, temperature=temperature, top_k=0, seed=0,
                                   device=device)
    positions = torch.arange(rows, device=device)
    warp_specialized = ops.warp_specialized_ready(hidden, weight)
    config = dataclasses.replace(
        default_config(rows, hidden.element_size(), warp_specialized=warp_specialized),
        race=True)
    if device == "cpu":  # the interpreter: small tiles, several per row
        config = dataclasses.replace(config, block_v=32, block_r=16, block_d=16)
    best, _ = ops.stage1_best_scores(hidden, weight, params, positions, config, want_lse=True)
    beaten = (best == float("-inf")).float()
    return dict(rows=rows, config=dataclasses.asdict(config), tiles=best.shape[1],
                beaten=float(beaten.mean()), beaten_first_200=float(beaten[:, :200].mean()),
                beaten_last_500=float(beaten[:, -500:].mean()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="256", help="comma-separated row counts")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--hidden-scale", type=float, default=sweep_tiles.bk.HIDDEN_SCALE,
                        help="hidden states ~ N(0, scale^2): logits ~ N(0, scale^2) "
                             "(default: the benchmarks')")
    parser.add_argument("--quick", action="store_true", help="tiny shape, CPU interpreter too")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.dim, args.vocab = "5", 32, 640
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.quick:
        print("race_skip_rate.py runs stage 1 at full size: use a CUDA machine, or --quick with "
              "TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    results = [skip_rates(int(r), args.dim, args.vocab, args.temperature, args.hidden_scale,
                          device) for r in args.rows.split(",")]
    for r in results:
        print(f"R={r['rows']:5d} tiles {r['tiles']}: beaten {r['beaten']:.3f}; first 200 tiles "
              f"{r['beaten_first_200']:.3f}; last 500 {r['beaten_last_500']:.3f}")
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "race_skip_rate.json").write_text(json.dumps(
        dict(device=name, dim=args.dim, vocab=args.vocab, temperature=args.temperature,
             hidden_scale=args.hidden_scale, results=results), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
