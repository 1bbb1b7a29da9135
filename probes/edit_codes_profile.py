"""(issue 30) Where a verification step's edit codes spend their time, and whether one Triton
pass (`flashspec.kernels.edit_codes.verify_codes`) removes it.

For each batch size: CUDA-graph medians of the codes made with torch ops
(`EditState.verify_edits`), of the one-pass kernel, of `fused_verify` with and without edits,
and the step ratios (kernel + codes) / plain verify for both ways; a torch.profiler table of
the torch ops' kernels at the largest batch. Two edit sets: the bar's (penalty over a 4,096
context + 64 banned ids) and the same with EOS banned below a minimum length (position
bans). Checks that both ways give equal codes.

    PYTHONPATH=. python probes/edit_codes_profile.py --batch-sizes 1,4,16,64
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial
from pathlib import Path

import torch

from flashspec.bench.edit_cost import QWEN25_INSTRUCT, edit_state, time_ms
from flashspec.generation.edits import NEVER
from flashspec.kernels.edit_codes import verify_codes

TILES = [dict(block=2048, num_warps=4), dict(block=4096, num_warps=8),
         dict(block=8192, num_warps=8), dict(block=16384, num_warps=16)]


def kernel_codes(state, table, generated, drafts, **tiles):
    """`state.verify_edits`'s ``[B, G+1, V]`` codes made by the one-pass kernel."""
    bans = (state.ban_rows, table, generated) if state.position_bans else ()
    return verify_codes(state.base, drafts, state.context_code, *bans, **tiles)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--drafts", type=int, default=4)
    args = parser.parse_args()
    from flashspec import SamplingParams
    from flashspec.kernels import fused_verify

    dim, vocab, context = 4096, 151936, 4096
    out = Path(os.environ.get("OUT") or "probe_out")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        g = torch.Generator().manual_seed(batch)
        weight = (torch.randn(vocab, dim, generator=g) * dim**-0.5).to("cuda", torch.bfloat16)
        hidden = (2.0 * torch.randn(batch, args.drafts + 1, dim, generator=g)).to("cuda", torch.bfloat16)
        params = SamplingParams.create(batch, seed=0, device="cuda", **QWEN25_INSTRUCT)
        positions = torch.full((batch,), context, dtype=torch.long, device="cuda")
        drafts = torch.randint(0, vocab, (batch, args.drafts), generator=g).cuda()
        drafts[0, 2:] = -1
        generated = torch.arange(batch, device="cuda") % 3
        for bans in (False, True):
            state = edit_state(batch, vocab, context, 64, "cuda", g)
            if bans:
                state.position_bans = True
                state.min_count.fill_(2)
                state.begin_count.fill_(NEVER)
                state.ban_rows[1, 7] = 2
                state.ban_rows[3, 7] = 2
                state.ban_rows[2, 9] = 2
            counts = torch.arange(4, device="cuda")
            table = (counts < state.min_count).long() + 2 * (counts == state.begin_count).long()
            torch_codes = state.verify_edits(generated, drafts).codes
            for tiles in TILES:
                assert torch.equal(torch_codes, kernel_codes(state, table, generated, drafts, **tiles))
            edits = state.verify_edits(generated, drafts)
            ms = {
                "verify": time_ms(partial(fused_verify, hidden, weight, drafts, params, positions), True, 100),
                "verify_edits": time_ms(partial(fused_verify, hidden, weight, drafts, params, positions,
                                                edits=edits), True, 100),
                "codes_torch": time_ms(partial(state.verify_edits, generated, drafts), True, 100),
                "copy_floor": time_ms(partial(torch_codes.copy_, torch_codes.clone()), True, 100),
            }
            for tiles in TILES:
                ms[f"codes_triton_{tiles['block']}_{tiles['num_warps']}"] = time_ms(
                    partial(kernel_codes, state, table, generated, drafts, **tiles), True, 100)
            ms["codes_triton"] = min(v for k, v in ms.items() if k.startswith("codes_triton_"))
            row = {"B": batch, "G": args.drafts, "position_bans": bans, "ms": ms,
                   "x_step_torch": (ms["verify_edits"] + ms["codes_torch"]) / ms["verify"],
                   "x_step_triton": (ms["verify_edits"] + ms["codes_triton"]) / ms["verify"]}
            rows.append(row)
            print(f"B={batch:3d} bans={bans!s:5} verify {ms['verify']:.4f} +edits {ms['verify_edits']:.4f} "
                  f"codes torch {ms['codes_torch']:.4f} triton {ms['codes_triton']:.4f} "
                  f"(floor {ms['copy_floor']:.4f}; " + " ".join(f"{k[13:]} {v:.4f}" for k, v in ms.items()
                                                           if k.startswith("codes_triton_")) + ")  "
                  f"step x torch {row['x_step_torch']:.3f} triton {row['x_step_triton']:.3f}", flush=True)
            if batch == max(int(b) for b in args.batch_sizes.split(",")):
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        state.verify_edits(generated, drafts)
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    (out / "edit_codes_profile.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
