"""Where stage 1's warps stall, per block of SASS addresses (Nsight Compute source counters).

A warp-specialized kernel lays each partition's code out in its own address range (the load
warp's TMA issue, the MMA warpgroup's HGMMA loop, the epilogue), so stall samples summed by
address block say which partition waits, and on what. This is how the eleventh session found
the Gluon main loop short of bytes in flight (BENCHMARKS.md, docs/bench/h100/stages/
ncu_stalls_r256.txt):

    PYTHONPATH=. python probes/stall_profile.py --kernel sample --rows 256 \
        --config 128,128,64,4,5,ws,screen,race --out $OUT  # a CUDA machine with ncu, ~1 min
    python probes/stall_profile.py --summarize $OUT/source.csv    # any machine

The first form runs this script again under `ncu` (stage 1's third launch, sections
WarpStateStats and SourceCounters), exports the source page with SASS to source.csv in --out
and prints the summary: per block of --block bytes of addresses (from the kernel's first
instruction), the stall samples, their share, the instructions executed, which marker
instructions the block holds (HGMMA: the MMA loop; UTMALDG: TMA loads; TRYWAIT: an mbarrier
wait; BAR: a named barrier; MUFU, LDS, STS, LDG, STG, LDL/STL: spills) and its three main
stall reasons; then the single instructions with the most samples. The kernels (--kernel)
and their problem are probes/sweep_tiles.py's, at D = 4096, V = 151,936. --config is
"bv,br,bd,warps,stages[,parts][,ws][,screen][,race]" as in probes/sweep_tiles.py (default: the
default table's).
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

# As probes/sweep_tiles.py's (not imported: --summarize runs without torch).
KERNELS = ("argmax", "sample", "qwen", "topp", "verify", "verify-qwen", "verify-topp")
MARKERS = ("HGMMA", "UTMALDG", "TRYWAIT", "BAR", "MUFU", "LDS", "STS", "LDG", "STG", "LDL", "STL")
SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _number(text: str) -> float:
    text = text.replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return 0.0


def read_source_csv(path) -> list[dict]:
    """Rows of `ncu --page source --print-source sass --csv`: address (int), SASS text,
    stall samples, instructions executed and the samples of each stall reason."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, row in enumerate(rows) if row and row[0] == "Address")
    header = rows[header_at]
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    index = {name: i for i, name in enumerate(header)}
    instructions = []
    for row in rows[header_at + 1:]:
        if len(row) < len(header) or not row[0].strip():
            continue
        instructions.append(dict(
            address=int(row[index["Address"]], 0), sass=row[index["Source"]].strip(),
            samples=_number(row[index[SAMPLES]]), executed=_number(row[index[EXECUTED]]),
            reasons={name[len("stall_"):]: _number(row[index[name]]) for name in reasons}))
    return instructions


def summarize(instructions: list[dict], block: int = 0x400, top: int = 15,
              min_share: float = 0.003) -> str:
    """The per-block and per-instruction tables described in the module docstring; blocks
    with less than `min_share` of the samples are left out."""
    base = min(i["address"] for i in instructions)
    total = sum(i["samples"] for i in instructions) or 1.0
    blocks = collections.OrderedDict()
    for ins in sorted(instructions, key=lambda i: i["address"]):
        entry = blocks.setdefault((ins["address"] - base) // block,
                                  dict(samples=0.0, executed=0.0, reasons=collections.Counter(),
                                       markers=set()))
        entry["samples"] += ins["samples"]
        entry["executed"] += ins["executed"]
        entry["reasons"].update(ins["reasons"])
        opcode = ins["sass"].split()
        opcode = opcode[1] if opcode and opcode[0].startswith("@") and len(opcode) > 1 else (
            opcode[0] if opcode else "")
        entry["markers"].update(m for m in MARKERS if m in opcode)
    lines = [f"{total:.0f} stall samples, {len(instructions)} instructions; "
             f"blocks of {block:#x} bytes",
             "   block  samples  share     executed  markers; main stall reasons"]
    for number, entry in blocks.items():
        if entry["samples"] < min_share * total:
            continue
        reasons = ", ".join(f"{name}={count:.0f}" for name, count in entry["reasons"].most_common(3)
                            if count)
        share = entry["samples"] / total
        lines.append(f"{number * block:#8x} {entry['samples']:8.0f} {share:6.1%} "
                     f"{entry['executed']:12.0f}  {' '.join(sorted(entry['markers'])) or '-'}; "
                     f"{reasons}")
    lines.append(f"the {top} instructions with the most samples:")
    for ins in sorted(instructions, key=lambda i: -i["samples"])[:top]:
        reasons = ", ".join(f"{name}={count:.0f}" for name, count in
                            sorted(ins["reasons"].items(), key=lambda kv: -kv[1])[:2] if count)
        lines.append(f"{ins['address'] - base:#8x} {ins['samples']:8.0f} "
                     f"{ins['samples'] / total:6.1%} {ins['executed']:12.0f}  "
                     f"{ins['sass'][:56]}; {reasons}")
    return "\n".join(lines)


def _launch(kernel: str, rows: int, config_text: str | None, drafts: int) -> None:
    """Stage 1 (and stage 2) three times on probes/sweep_tiles.py's problem at D = 4096,
    V = 151,936: ncu profiles the third launch of stage 1."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sweep_tiles import make_launch, make_weight, parse_configs

    config = parse_configs(config_text)[0] if config_text else None
    launch, _ = make_launch(kernel, rows, drafts, make_weight(151_936, 4096, "cuda"))
    for _ in range(3):
        launch(config)
    torch.cuda.synchronize()


def _ncu() -> str:
    found = shutil.which("ncu") or next(iter(sorted(Path("/usr/local").glob("cuda*/bin/ncu"))),
                                         None)
    if not found:
        raise SystemExit("stall_profile.py: Nsight Compute's `ncu` is not on PATH or under "
                         "/usr/local/cuda*/bin")
    return str(found)


def _profile(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ncu = _ncu()
    report = out / "stall_profile"
    target = [sys.executable, __file__, "--launch", "--kernel", args.kernel, "--rows",
              str(args.rows), "--drafts", str(args.drafts)]
    if args.config:
        target += ["--config", args.config]
    subprocess.run([ncu, "--kernel-name", "regex:lm_head_tiles", "--launch-skip", "2",
                    "--launch-count", "1", "--section", "WarpStateStats", "--section",
                    "SourceCounters", "--import-source", "no", "-f", "-o", str(report), *target],
                   check=True)
    source = out / "source.csv"
    with open(source, "w") as f:
        subprocess.run([ncu, "--import", f"{report}.ncu-rep", "--page", "source",
                        "--print-source", "sass", "--csv"], stdout=f, check=True)
    print(summarize(read_source_csv(source), args.block, args.top))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=KERNELS, default="sample")
    parser.add_argument("--rows", type=int, default=256,
                        help="rows of stage 1 (verify: B * (G + 1), G = --drafts)")
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--config", default=None,
                        help='"bv,br,bd,warps,stages[,parts][,ws][,screen][,race]" '
                             "(default: the table's)")
    parser.add_argument("--block", type=lambda text: int(text, 0), default=0x400,
                        help="bytes of SASS addresses per block of the summary")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--summarize", metavar="CSV", default=None,
                        help="summarize an exported source page instead of profiling")
    parser.add_argument("--launch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rows < 1 or (args.kernel.startswith("verify") and args.rows % (args.drafts + 1)):
        parser.error(f"--rows={args.rows}: at least 1 (verify: a multiple of --drafts + 1 = "
                     f"{args.drafts + 1})")
    if args.summarize:
        print(summarize(read_source_csv(args.summarize), args.block, args.top))
        return 0
    if args.launch:
        _launch(args.kernel, args.rows, args.config, args.drafts)
        return 0
    return _profile(args)


if __name__ == "__main__":
    raise SystemExit(main())
