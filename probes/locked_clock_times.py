"""Kernel durations at locked base clocks (Nsight Compute), for A/B decisions at large R.

Graph-timed medians at R >= 256 move by up to 18% between calls on an H100: there the GPU runs
at its power cap (nvidia-smi's throttle reason: the software power cap), and its SM clock
follows the load (1.31-1.55 GHz on average while cuBLAS, argmax, sampling and verification
replayed back to back at R = 256, against 1.82-1.98 GHz at R = 64;
docs/bench/h100/deep_steps/probe_clock.json). Under `ncu --clock-control base` every kernel
runs at the base clock with L2 flushed before it, and the same kernel repeats within 2%, so
a change of a few percent shows in a few repeats (the twelfth session's verification
epilogue: -1.7% at R = 256 and -4.5% at R = 512, not resolved by graph timing):

    PYTHONPATH=. python probes/locked_clock_times.py --kernels matmul,sample,verify \
        --rows 256,512 --out $OUT                    # a CUDA machine with ncu, ~20 s a point
    python probes/locked_clock_times.py --summarize $OUT/locked_clock_times.json

Each point (kernel, rows) runs this script again under ncu, which profiles every kernel
launched inside an NVTX range around three calls after three untimed ones: for `matmul` the
cuBLAS GEMM of the R rows, for flashspec's kernels (probes/sweep_tiles.py's, at D = 4096,
V = 151,936; verify rows are B * (G + 1), G = --drafts) stage 1, stage 2, the finaliser and
any padding copy. The table gives each kernel's median duration, the call's total (the sum of
its kernels' times, each run alone by ncu: no launch gaps, no overlap) and its ratio to
matmul at the same rows; the times are slower than the boosted clock's, the ratios are what
to compare.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stall_profile import KERNELS, _ncu  # noqa: E402

from flashspec.bench import cli  # noqa: E402

POINT_KERNELS = ("matmul",) + KERNELS
RANGE = "timed"
TIMED_CALLS = 3
UNTIMED_CALLS = 3
METRIC = "gpu__time_duration.sum"


def read_durations(text: str) -> list[tuple[str, float]]:
    """(kernel name, duration in ms) of each profiled launch, in launch order, from
    `ncu --metrics gpu__time_duration.sum --csv --print-units base` (nanoseconds)."""
    rows = [row for row in csv.reader(io.StringIO(text)) if row]
    header_at = next(i for i, row in enumerate(rows) if "Kernel Name" in row and "Metric Value" in row)
    header = rows[header_at]
    name, metric, value, launch = (header.index(column) for column in
                                   ("Kernel Name", "Metric Name", "Metric Value", "ID"))
    launches = []
    for row in rows[header_at + 1:]:
        if len(row) == len(header) and row[metric] == METRIC:
            launches.append((int(row[launch]), row[name], float(row[value].replace(",", "")) / 1e6))
    return [(kernel, ms) for _, kernel, ms in sorted(launches)]


def summarize_point(launches: list[tuple[str, float]], calls: int = TIMED_CALLS) -> dict:
    """Per kernel name the median of its launches and the launches per call; the call's
    total (every launch's time over `calls`)."""
    if not launches or len(launches) % calls:
        raise ValueError(f"{len(launches)} launches profiled for {calls} calls: the calls "
                         f"must launch the same kernels")
    per_kernel = collections.OrderedDict()
    for kernel, ms in launches:
        per_kernel.setdefault(kernel, []).append(ms)
    return dict(kernels={kernel: dict(median_ms=statistics.median(times),
                                      per_call=len(times) // calls)
                         for kernel, times in per_kernel.items()},
                call_ms=sum(ms for _, ms in launches) / calls)


def format_table(points: list[dict]) -> str:
    """One line per point: kernel, rows, call total, ratio to matmul at those rows, and the
    kernels' medians."""
    matmul = {p["rows"]: p["call_ms"] for p in points if p["kernel"] == "matmul"}
    lines = ["locked base clocks (ncu); ms per call = sum of its kernels; "
             "xM = / matmul at the same rows"]
    for p in points:
        ratio = p["call_ms"] / matmul[p["rows"]] if p["rows"] in matmul else None
        kernels = ", ".join(f"{name} {k['median_ms']:.4f}" + (f" x{k['per_call']}"
                                                               if k["per_call"] > 1 else "")
                            for name, k in p["kernels"].items())
        lines.append(f"{p['kernel']:12s} R={p['rows']:4d} {p['call_ms']:8.4f}  "
                     f"{'-' if ratio is None else f'x{ratio:.3f}':>6s}  {kernels}")
    return "\n".join(lines)


def time_calls(call) -> None:
    """UNTIMED_CALLS calls, then TIMED_CALLS inside the NVTX range ncu profiles."""
    import torch

    for _ in range(UNTIMED_CALLS):
        call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(RANGE)
    for _ in range(TIMED_CALLS):
        call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def profile_launches(target: list[str], what: str, timeout_s: float = 300.0
                     ) -> list[tuple[str, float]]:
    """(kernel name, ms) of each launch inside the NVTX range of `target` (a command whose
    calls go through `time_calls`), run under ncu at locked base clocks. SystemExit if ncu
    fails or takes longer than `timeout_s`."""
    try:
        result = subprocess.run(
            [_ncu(), "--clock-control", "base", "--nvtx", "--nvtx-include", f"{RANGE}/",
             "--metrics", METRIC, "--csv", "--print-units", "base", *target],
            capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"ncu took more than {timeout_s:.0f} s for {what}") from None
    if result.returncode:
        raise SystemExit(f"ncu failed for {what} (exit {result.returncode}):\n"
                         f"{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return read_durations(result.stdout)


def _launch(kernel: str, rows: int, drafts: int) -> None:
    from sweep_tiles import make_launch, make_weight

    weight = make_weight(151_936, 4096, "cuda")
    launch, hidden = make_launch("argmax" if kernel == "matmul" else kernel, rows, drafts, weight)
    time_calls((lambda: hidden @ weight.T) if kernel == "matmul" else (lambda: launch(None)))


def measure_point(kernel: str, rows: int, drafts: int) -> dict:
    target = [sys.executable, __file__, "--launch", "--kernels", kernel, "--rows", str(rows),
              "--drafts", str(drafts)]
    launches = profile_launches(target, f"{kernel} at {rows} rows (locked_clock_times.py)")
    return dict(kernel=kernel, rows=rows, drafts=drafts, **summarize_point(launches))


def positive_ints(text: str) -> list[int]:
    """--rows: `flashspec.bench.cli.positive_ints`."""
    return cli.positive_ints(text, "256,512")


def _kernel_names(text: str) -> list[str]:
    return cli.names(text, POINT_KERNELS)


def write_report(points: list[dict], path: Path, table=None) -> None:
    """The points as JSON at `path`, with the device and the method; with `table`, prints the
    device and the table of the points."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    report = dict(device=torch.cuda.get_device_name(), method="ncu --clock-control base, "
                  f"{METRIC}, {TIMED_CALLS} calls after {UNTIMED_CALLS}", points=points)
    path.write_text(json.dumps(report, indent=1))
    if table is not None:
        print(report["device"])
        print(table(points))


def parse_point_arguments(parser, argv, report: str, table):
    """Adds the arguments the locked-clock scripts share to `parser` (which has --kernels and
    --rows): --drafts, --out, --summarize and the hidden --launch. Then parses `argv` and
    checks it. With --summarize, prints `table` of that `report` file's points and returns
    None."""
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--summarize", metavar="JSON", default=None,
                        help=f"print the table of a {report} instead")
    parser.add_argument("--launch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.drafts < 1:
        parser.error(f"--drafts={args.drafts}: at least 1")
    if args.summarize:
        print(table(json.loads(Path(args.summarize).read_text())["points"]))
        return None
    for kernel in args.kernels:
        bad = [rows for rows in args.rows if kernel.startswith("verify") and rows % (args.drafts + 1)]
        if bad:
            parser.error(f"--rows {bad} for {kernel}: multiples of --drafts + 1 = {args.drafts + 1}")
    return args


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=_kernel_names, default=["matmul", "sample", "verify"],
                        help=f"comma-separated, from {', '.join(POINT_KERNELS)}")
    parser.add_argument("--rows", type=positive_ints, default=[256],
                        help="comma-separated row counts (verify: B * (G + 1), G = --drafts)")
    args = parse_point_arguments(parser, argv, "locked_clock_times.json", format_table)
    if args is None:
        return 0
    if args.launch:
        _launch(args.kernels[0], args.rows[0], args.drafts)
        return 0
    points = [measure_point(kernel, rows, args.drafts)
              for rows in args.rows for kernel in args.kernels]
    write_report(points, Path(args.out) / "locked_clock_times.json", format_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
