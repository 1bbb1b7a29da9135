"""Registers, spills, shared memory and programs per SM of stage 1, compiled offline.

Stage 1 of the fused kernels is compiled for Hopper (sm_90a) by Triton and its ptxas for each
tile configuration, on any machine: no GPU and no device time.

Whether a configuration's epilogue fits in registers, and how many programs share an SM
(so that one program's epilogue can overlap another's main loop), decide much of its speed
at large B; this answers both before a device is lent:

    PYTHONPATH=. python probes/kernel_registers.py --kernel sample \
        --configs "128,128,128,8,3,2 128,64,64,8,4"

Prints one line per configuration; writes kernel_registers.json to --out, and with --sass
each configuration's disassembly (nvdisasm -c) beside it, for counting what an epilogue
executes per logit (BENCHMARKS.md, thirteenth session). Configurations
are "bv,br,bd,warps,stages[,parts][,ws][,screen][,race]" as in probes/sweep_tiles.py; "ws"
compiles the
warp-specialized Gluon stage 1 (`flashspec/kernels/lm_head_ws.py`) and also reports the
setmaxnreg values in its PTX (what the load warp, the MMA warpgroup and the epilogue warps set
for themselves, with the steps in between; for the default table the load warp works with 24,
the MMA warpgroup with 160, the epilogue warps with 256 (4 warps) or 160 (8, after 232 briefly)).
Assumes bf16 inputs, V a multiple of the vocab tile and D of the reduction step (the shipped
shapes), TMA loads.
The runtime compile also knows which integer arguments are multiples of 16 (and may count a
few registers differently); the shared memory and the tile's epilogue are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_tiles import parse_configs  # noqa: E402 - a sibling script, not a package

from flashspec.kernels import lm_head, lm_head_ws  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SM_SHARED_BYTES = 228 * 1024  # H100 / H200: per SM; each resident program also reserves 1 KB
SM_REGISTERS = 65536
SM_THREADS = 2048
REGISTER_UNIT = 8  # registers are allocated per thread in multiples of 8 (256 per warp)
# (SAMPLE, LSE, truncation, DRAFT) of each kernel as ops._launch sets them for the
# benchmarks' settings (T 0.7 untruncated; qwen = top-k 20 + top-p 0.95, every row with a
# top-k: no log-sum-exp); truncation keeps the configuration's candidates per tile.
KERNELS = {"argmax": (False, False, False, False), "sample": (True, True, False, False),
           "qwen": (True, False, True, False), "verify": (True, True, False, True),
           "verify-qwen": (True, False, True, True)}


def signature(config, cand: int, draft: bool) -> dict[str, str]:
    if cand:  # interleaved tiles: the weight viewed as [BV / 16, NUM_VT, 16, D]
        weight_box = f"{config.block_v // 16}, 1, 16, {config.block_d}"
    else:
        weight_box = f"{config.block_v}, {config.block_d}"
    return {"hidden_ptr": "*bf16", "weight_ptr": "*bf16",
            "hidden_desc": f"tensordesc<bf16[{config.block_r}, {config.block_d}]>",
            "weight_desc": f"tensordesc<bf16[{weight_box}]>",
            "do_sample_ptr": "*i1", "temperature_ptr": "*fp64", "seed_ptr": "*i64",
            "position_ptr": "*i64", "best_ptr": "*fp32", "best_id_ptr": "*i32",
            "best_s_ptr": "*fp32", "max_ptr": "*fp32", "sumexp_ptr": "*fp32", "bad_ptr": "*i32",
            "cand_ptr": "*i64" if cand else "*i32", "draft_ptr": "*i64" if draft else "*i32",
            "draft_s_ptr": "*fp32", "bound_ptr": "*i32", "R": "i32", "V": "i32", "D": "i32",
            "stride_hidden": "i32",
            "stride_weight": "i32", "NUM_VT": "i32", "ROWS_PER_PARAM": "i32"}


def compile_report(kernel: str, config, sass_dir: str | None = None) -> dict:
    """ptxas's registers and spill bytes, Triton's shared memory, the programs per SM that
    registers and shared memory allow, and the SASS instruction count of stage 1 under
    `config`; with `sass_dir`, its disassembly written there (`sass_path`)."""
    sample, lse, truncation, draft = KERNELS[kernel]
    cand = config.candidates if truncation else 0
    if config.warp_specialized:
        report = _warp_specialized_report(kernel, config, sample, lse, cand, draft)
    else:
        report = _triton_report(kernel, config, sample, lse, cand, draft)
    sass = disassemble(report.pop("compiled"))
    report["sass_instructions"] = len(SASS_INSTRUCTION.findall(sass))
    if sass_dir is not None:
        c = config
        path = Path(sass_dir) / (f"{kernel}_{c.block_v}x{c.block_r}_d{c.block_d}_{c.num_warps}w_"
                                 f"{c.num_stages}s_{c.epilogue_parts}p"
                                 + "_ws" * c.warp_specialized + "_screen" * c.screen
                                 + "_race" * c.race + ".sass")
        path.write_text(sass)
        report["sass_path"] = str(path)
    return report


def _triton_report(kernel: str, config, sample: bool, lse: bool, cand: int,
                   draft: bool) -> dict:
    """The Triton stage 1 under `config` (`compile_report`'s numbers, and the compiled
    kernel)."""
    constants = dict(SAMPLE=sample, LSE=lse, CAND=cand, DRAFT=draft, IEEE_DOT=False,
                     INTERLEAVE=cand > 0, EVEN_V=True, EVEN_D=True, TMA=True,
                     PARTS=config.epilogue_parts, SCREEN=config.screen,
                     RACE=config.race and sample, BLOCK_V=config.block_v,
                     BLOCK_R=config.block_r, BLOCK_D=config.block_d,
                     NUM_STAGES=config.num_stages, PDL=True)
    sig = signature(config, cand, draft) | {name: "constexpr" for name in constants}
    compiled = triton.compile(ASTSource(lm_head.lm_head_tiles_kernel, sig, constants),
                              target=TARGET, options=dict(num_warps=config.num_warps,
                                                          num_stages=config.num_stages))
    registers, spill_stores, spill_loads = _ptxas_report(compiled)
    shared = compiled.metadata.shared
    threads = 32 * config.num_warps
    allocated = -(-registers // REGISTER_UNIT) * REGISTER_UNIT
    per_sm = min(SM_SHARED_BYTES // (shared + 1024), SM_REGISTERS // (allocated * threads),
                 SM_THREADS // threads)
    return dict(kernel=kernel, config=config.__dict__, registers=registers,
                spill_store_bytes=spill_stores, spill_load_bytes=spill_loads,
                shared_bytes=shared, programs_per_sm=per_sm, compiled=compiled)


def _warp_specialized_report(kernel: str, config, sample: bool, lse: bool, cand: int,
                             draft: bool) -> dict:
    """The Gluon stage 1 under `config`: registers at launch (every warp's share), the
    setmaxnreg values of its partitions, spills, shared memory; one program per SM."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    weight_box = [16 if cand else config.block_v, config.block_d]
    layouts = [gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)
               for box in ([config.block_r, config.block_d], weight_box)]
    sig = {"h_desc": f"tensordesc<bf16[{config.block_r}, {config.block_d}],{layouts[0]!r}>",
           "w_desc": f"tensordesc<bf16[{weight_box[0]}, {weight_box[1]}],{layouts[1]!r}>",
           "do_sample_ptr": "*i1", "temperature_ptr": "*fp64", "seed_ptr": "*i64",
           "position_ptr": "*i64", "best_ptr": "*fp32", "best_id_ptr": "*i32",
           "best_s_ptr": "*fp32", "max_ptr": "*fp32", "sumexp_ptr": "*fp32", "bad_ptr": "*i32",
           "draft_ptr": "*i64" if draft else "*i32", "draft_s_ptr": "*fp32",
           "cand_ptr": "*i64" if cand else "*i32", "bound_ptr": "*i32", "R": "i32", "V": "i32",
           "D": "i32", "NUM_VT": "i32", "ROWS_PER_PARAM": "i32"}
    constants = dict(SAMPLE=sample, LSE=lse, DRAFT=draft, CAND=cand, INTERLEAVE=cand > 0,
                     EVEN_V=True, SCREEN=config.screen, RACE=config.race and sample,
                     BLOCK_V=config.block_v, NUM_STAGES=config.num_stages,
                     CHUNK_R=8 * config.num_warps)
    sig |= {name: "constexpr" for name in constants}
    compiled = triton.compile(
        GluonASTSource(lm_head_ws.lm_head_tiles_ws_kernel, sig, constants), target=TARGET,
        options=dict(num_warps=config.num_warps,
                     maxnreg=lm_head_ws.max_registers(config.num_warps)))
    registers, spill_stores, spill_loads = _ptxas_report(compiled)
    partitions = sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                    compiled.asm["ptx"])})
    return dict(kernel=kernel, config=config.__dict__, registers=registers,
                partition_registers=partitions, spill_store_bytes=spill_stores,
                spill_load_bytes=spill_loads, shared_bytes=compiled.metadata.shared,
                programs_per_sm=1, compiled=compiled)


# One instruction of `nvdisasm -c`'s listing: its address comment, then the (predicated)
# opcode.
SASS_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?[A-Z][A-Z0-9_.]*")


def disassemble(compiled) -> str:
    """The SASS of a compiled kernel (nvdisasm as shipped with Triton)."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "stage1.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        return subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True,
                              text=True, check=True).stdout


def _ptxas_report(compiled) -> tuple[int, int, int]:
    """ptxas's registers per thread and spill store and load bytes of a compiled kernel."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "stage1.ptx"
        ptx.write_text(compiled.asm["ptx"])
        log = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spill_stores, spill_loads = map(int, re.search(
        r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups())
    return registers, spill_stores, spill_loads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=tuple(KERNELS), default="sample")
    parser.add_argument("--configs", type=parse_configs, required=True,
                        help='"bv,br,bd,warps,stages[,parts][,ws][,screen][,race] ..."')
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sass", action="store_true",
                        help="also write each configuration's disassembly (nvdisasm) to --out")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("kernel_registers.py compiles the kernels: unset TRITON_INTERPRET (interpreted "
              "kernels cannot be compiled)", file=sys.stderr)
        return 2
    reports = []
    for config in args.configs:
        report = compile_report(args.kernel, config, args.out if args.sass else None)
        reports.append(report)
        c = config
        kind = (f"ws, partitions {report['partition_registers']}" if c.warp_specialized
                else f"parts {c.epilogue_parts}")
        print(f"{args.kernel} {c.block_v}x{c.block_r} d{c.block_d} {c.num_warps}w {c.num_stages}s "
              f"{kind}: {report['registers']} registers, spills "
              f"{report['spill_store_bytes']}/{report['spill_load_bytes']} B, shared "
              f"{report['shared_bytes'] // 1024} KB, {report['programs_per_sm']} per SM, "
              f"{report['sass_instructions']} SASS instructions", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kernel_registers.json"), "w") as f:
        json.dump(dict(target="sm_90a", triton=triton.__version__, reports=reports), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
