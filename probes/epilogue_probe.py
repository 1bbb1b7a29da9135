"""How much of the Gluon stage 1's time its epilogue takes by itself, at locked base clocks.

At R >= 256 on an H100, sampling and verification take 1.20-1.34x the cuBLAS matmul at locked
clocks while argmax, the same main loop with a light epilogue, takes 1.02-1.06x
(BENCHMARKS.md). Two explanations predict different next changes:

* the epilogue is slow on its own (its chains' latency, one warp per scheduler): then it
  takes about as long without the MMA as with it, and more epilogue warps in flight (two
  consumer warpgroups in ping-pong, each with its own registers) is the lever;
* the epilogue and the MMA slow each other down (issue, dispatch or register-file
  contention on the SM they share): then the epilogue alone is much faster than the whole
  kernel, more warps will not help, and fewer instructions per logit is the lever.

This script times variants of `lm_head_ws.lm_head_tiles_ws_kernel` built by swapping its
partitions. The partitions are module globals that the kernel reads when it compiles, so
the shipped kernel is not edited. Each variant runs in a fresh process:

* ``full``: as shipped;
* ``no-mma``: the MMA warpgroup waits for each stage and frees it, but issues no wgmma. The
  epilogue summarises tiles of zeros and does the same work per logit;
* ``no-load``: the load warp marks each stage full without copying. ``no-load+no-mma``
  leaves the epilogue alone, paced only by its own hand-over. With the MMA on, no-load
  multiplies whatever the stages hold: meant for argmax, whose epilogue does the same work
  whatever the values (a sampling epilogue sends chunks with non-finite values to its exact
  path);
* ``cheap-bits``: the epilogue's Philox words come from a multiply and a xor of row and
  column instead. This measures the words' share of the time. It is for timing only: the
  tokens are not the shipped sampler's.
* ``pad-8``, ``pad-16``: the words as shipped, then 8 or 16 more instructions per logit
  (xorshifts; timing only, as cheap-bits). The added time per added instruction separates
  the two explanations directly: about 3-4 cycles per instruction per scheduler if the
  epilogue is late on its own (it issues 0.25-0.33 a cycle), 0.6-1.1 if it contends with the
  MMA, none if it is hidden.

Measured (H100, 2026-11-23, BENCHMARKS.md "Fourteenth session"): 3.0-3.7 cycles per added
instruction and 5.2-7.7 per removed Philox instruction, the epilogue alone at 0.46-0.56x the
full kernel: the epilogue sets the time, and runs about half as fast beside the main loop as
alone.

For argmax, whose epilogue is light, ``no-load`` and ``no-mma`` bound the main loop from its
two sides. no-load is the MMA without the TMA writes and without the HBM stream (at least the
tensor peak, ~0.42 ms at R = 256). no-mma is the stream alone (at least the HBM floor,
~0.415 ms). If the full kernel (0.51 ms) sits well above both, the two slow each other inside
the SM, and shared memory is the likely place: a 128x128 tile moves 4.1-5.1 MiB through it at
D = 4096, which is 608-755k cycles per SM at R = 256 against argmax's 725k. These variants do
not isolate shared memory; a variant that keeps the TMA writes from an L2-resident tile would.

Each point runs under ``ncu --clock-control base`` (probes/locked_clock_times.py's method:
three calls after three untimed ones, every kernel at the base clock with L2 flushed).
matmul and argmax at the same rows are timed as the references:

    PYTHONPATH=. python probes/epilogue_probe.py --kernels sample,verify --rows 256 \\
        --configs "128,128,64,4,5,ws,screen 128,128,64,8,4,ws,screen" \\
        --variants full,no-mma,no-load+no-mma,cheap-bits,pad-16 --out $OUT   # ~20 s a point
    python probes/epilogue_probe.py --summarize $OUT/epilogue_probe.json

The table gives, per point, stage 1's median, its ratio to the matmul at the same rows, and
its ratio to the same configuration's ``full`` variant.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import locked_clock_times as lct  # noqa: E402 - a sibling script, not a package

from flashspec.bench import cli  # noqa: E402
from flashspec.kernels import lm_head_ws  # noqa: E402

FLAGS = ("no-load", "no-mma", "cheap-bits", "pad-8", "pad-16")
KERNELS = ("argmax", "sample", "verify", "qwen", "verify-qwen")
STAGE1 = "lm_head_tiles_ws_kernel"
# Instructions per logit that a variant adds to the epilogue's main path (cheap-bits: removes),
# from the offline sm_90a SASS per 32-logit chunk and thread: pad-8 +224 and pad-16 +481 on
# the 4- and 8-warp entries, cheap-bits -254 on the 4-warp one.
ADDED_PER_LOGIT = {"pad-8": 224 / 32, "pad-16": 481 / 32, "cheap-bits": -254 / 32}
BASE_CLOCK_HZ = 1.413e9  # an H100 under ncu --clock-control base (cycles / time, twelfth session)
SCHEDULERS = 132 * 4  # H100 and H200: 132 SMs of 4 schedulers
VOCAB = 151_936  # the probe's problem (probes/sweep_tiles.py at D = 4096)

if lm_head_ws.gluon is not None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    @gluon.jit
    def _load_partition_no_copy(h_desc, w_desc, h_bufs, w_bufs, ready, empty, acc_smem,
                                acc_ready, acc_empty, D, NUM_VT, num_tiles, num_rt,
                                INTERLEAVE: gl.constexpr):
        """`lm_head_ws._load_partition`'s stages, each marked full without a copy."""
        BD: gl.constexpr = h_desc.block_type.shape[1]
        STAGES: gl.constexpr = h_bufs.type.shape[0]
        step = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            for k in range(0, D, BD):
                stage = step % STAGES
                mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
                mbarrier.arrive(ready.index(stage))
                step += 1

    @gluon.jit
    def _mma_partition_idle(h_desc, w_desc, h_bufs, w_bufs, ready, empty, acc_smem, acc_ready,
                            acc_empty, D, NUM_VT, num_tiles, num_rt, INTERLEAVE: gl.constexpr):
        """`lm_head_ws._mma_partition`'s waits and hand-overs, with no wgmma: each tile is
        zeros."""
        BR: gl.constexpr = h_desc.block_type.shape[0]
        BD: gl.constexpr = h_desc.block_type.shape[1]
        BV: gl.constexpr = w_bufs.type.shape[1]
        STAGES: gl.constexpr = h_bufs.type.shape[0]
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
        step = 0
        tile_count = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            for k in range(0, D, BD):
                stage = step % STAGES
                mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
                mbarrier.arrive(empty.index(stage))
                step += 1
            acc = gl.zeros([BR, BV], gl.float32, layout)
            mbarrier.wait(acc_empty, (tile_count & 1) ^ 1)
            acc_smem.store(acc)
            mbarrier.arrive(acc_ready)
            tile_count += 1

    @gluon.jit
    def _cheap_tile_bits(seed, position, pid_v, NUM_VT, CR: gl.constexpr, BV: gl.constexpr,
                         INTERLEAVE: gl.constexpr, layout: gl.constexpr):
        """Stand-in for `lm_head_ws._tile_bits`: a multiply and a xor per word, not Philox."""
        columns = gl.arange(0, BV, layout=gl.SliceLayout(0, layout)) + pid_v * BV
        rows = (seed * 31 + position).to(gl.int32)
        return ((columns[None, :] * -1640531535) ^ (rows[:, None] * 40503)).to(gl.uint32)

    _shipped_tile_bits = lm_head_ws._tile_bits

    @gluon.jit
    def _xorshifts(bits, ROUNDS: gl.constexpr):
        """ROUNDS xorshifts of each word: 2 instructions (a shift and a xor) per round and
        word, which the compiler cannot fold; each is a bijection, so the words stay uniform."""
        for i in gl.static_range(ROUNDS):
            bits = bits ^ (bits >> (13 if i % 2 == 0 else 7))
        return bits

    @gluon.jit
    def _tile_bits_pad8(seed, position, pid_v, NUM_VT, CR: gl.constexpr, BV: gl.constexpr,
                        INTERLEAVE: gl.constexpr, layout: gl.constexpr):
        """`lm_head_ws._tile_bits` and 8 more instructions per word."""
        return _xorshifts(_shipped_tile_bits(seed, position, pid_v, NUM_VT, CR, BV, INTERLEAVE,
                                             layout), 4)

    @gluon.jit
    def _tile_bits_pad16(seed, position, pid_v, NUM_VT, CR: gl.constexpr, BV: gl.constexpr,
                         INTERLEAVE: gl.constexpr, layout: gl.constexpr):
        """`lm_head_ws._tile_bits` and 16 more instructions per word."""
        return _xorshifts(_shipped_tile_bits(seed, position, pid_v, NUM_VT, CR, BV, INTERLEAVE,
                                             layout), 8)

    REPLACEMENTS = {"no-load": ("_load_partition", _load_partition_no_copy),
                    "no-mma": ("_mma_partition", _mma_partition_idle),
                    "cheap-bits": ("_tile_bits", _cheap_tile_bits),
                    "pad-8": ("_tile_bits", _tile_bits_pad8),
                    "pad-16": ("_tile_bits", _tile_bits_pad16)}


def parse_variant(text: str) -> tuple[str, ...]:
    """("no-load", "no-mma") from "no-mma+no-load"; () from "full"."""
    if text == "full":
        return ()
    flags = tuple(sorted(set(text.split("+"))))
    unknown = [flag for flag in flags if flag not in FLAGS]
    if not flags or unknown:
        raise argparse.ArgumentTypeError(
            f"variant {text!r}: 'full' or '+'-joined flags from {', '.join(FLAGS)}")
    words = [flag for flag in flags if flag in ("cheap-bits", "pad-8", "pad-16")]
    if len(words) > 1:
        raise argparse.ArgumentTypeError(
            f"variant {text!r}: {' and '.join(words)} each replace the epilogue's noise; one "
            f"of them")
    return flags


def variant_name(flags: tuple[str, ...]) -> str:
    return "+".join(flags) or "full"


def _forget_compiled_hashes() -> None:
    """Triton caches each JIT function's hash, its callees' included: after a swap, the
    kernel and the partitions that call a swapped function must hash again."""
    from triton.runtime.jit import JITFunction

    if lm_head_ws.gluon is None:  # no Gluon kernel to swap anything in
        return
    for value in vars(lm_head_ws).values():
        if isinstance(value, JITFunction):  # (interpreted functions never compile)
            value.hash = None
    # Kernels compiled in this process are cached by their arguments alone, not the hash.
    lm_head_ws.lm_head_tiles_ws_kernel.device_caches.clear()


@contextlib.contextmanager
def variant_installed(flags: tuple[str, ...]):
    """`lm_head_ws` with the partitions of variant `flags` swapped in, restored on exit."""
    if flags and lm_head_ws.gluon is None:
        raise SystemExit("epilogue_probe.py: the Gluon kernel needs Triton "
                         f"{lm_head_ws.TESTED_TRITON}x")
    saved = {}
    try:
        for flag in flags:
            name, replacement = REPLACEMENTS[flag]
            saved[name] = getattr(lm_head_ws, name)
            setattr(lm_head_ws, name, replacement)
        _forget_compiled_hashes()
        yield
    finally:
        for name, original in saved.items():
            setattr(lm_head_ws, name, original)
        _forget_compiled_hashes()


def _launch(kernel: str, rows: int, config_text: str, flags: tuple[str, ...], drafts: int) -> None:
    """locked_clock_times.time_calls of one configuration of the Gluon kernel under one
    variant."""
    from sweep_tiles import make_launch, make_weight, parse_configs

    config = parse_configs(config_text)[0]
    with variant_installed(flags):
        launch, _ = make_launch(kernel, rows, drafts, make_weight(151_936, 4096, "cuda"))
        lct.time_calls(lambda: launch(config))


def measure_point(kernel: str, rows: int, config_text: str, flags: tuple[str, ...],
                  drafts: int) -> dict:
    target = [sys.executable, __file__, "--launch", "--kernels", kernel, "--rows", str(rows),
              "--configs", config_text, "--variants", variant_name(flags), "--drafts",
              str(drafts)]
    launches = lct.profile_launches(target, f"{kernel}, {rows} rows, {config_text}, "
                                            f"{variant_name(flags)} (epilogue_probe.py)")
    return dict(kernel=kernel, rows=rows, config=config_text, variant=variant_name(flags),
                drafts=drafts, **lct.summarize_point(launches))


def stage1_ms(point: dict) -> float:
    """The median of the point's stage-1 launches (the call's total for the references)."""
    stage1 = [k["median_ms"] for name, k in point["kernels"].items() if STAGE1 in name]
    return stage1[0] if stage1 else point["call_ms"]


def format_table(points: list[dict]) -> str:
    """One line per point: kernel, rows, configuration, variant, stage 1's median, its ratio
    to the matmul at the same rows and to the same configuration's full variant (or why the
    point failed)."""
    measured = [p for p in points if "error" not in p]
    matmul = {p["rows"]: p["call_ms"] for p in measured if p["kernel"] == "matmul"}
    full = {(p["kernel"], p["rows"], p["config"]): stage1_ms(p)
            for p in measured if p.get("variant") == "full"}
    lines = ["locked base clocks (ncu); stage 1's median ms; xM = / matmul at the same rows; "
             "xfull = / the full variant of the same configuration"]
    for p in points:
        head = (f"{p['kernel']:12s} R={p['rows']:4d} {p.get('config') or '(default)':28s} "
                f"{p.get('variant') or '':26s}")
        if "error" in p:
            lines.append(f"{head} failed: {p['error'].splitlines()[0][:80]}")
            continue
        ms = stage1_ms(p)
        to_matmul = f"x{ms / matmul[p['rows']]:.3f}" if p["rows"] in matmul else "-"
        reference = full.get((p["kernel"], p["rows"], p.get("config")))
        to_full = f"x{ms / reference:.3f}" if reference else "-"
        lines.append(f"{head} {ms:8.4f} {to_matmul:>7s} {to_full:>7s}")
    return "\n".join(lines + cycles_per_instruction(measured, full))


def cycles_per_instruction(measured: list[dict], full: dict) -> list[str]:
    """Per variant that adds or removes instructions (ADDED_PER_LOGIT), the cycles each one
    costs on its scheduler: stage 1's change at BASE_CLOCK_HZ over the change in warp
    instructions per scheduler (logits x instructions per logit / 32 lanes / SCHEDULERS).
    About 3-4 if the epilogue is late on its own, 0.6-1.1 if it contends with the MMA, about
    0 if it is hidden (BENCHMARKS.md, thirteenth session)."""
    lines = []
    for p in measured:
        reference = full.get((p["kernel"], p["rows"], p.get("config")))
        per_logit = ADDED_PER_LOGIT.get(p.get("variant"))
        if reference is None or per_logit is None:
            continue
        instructions = per_logit * p["rows"] * VOCAB / 32 / SCHEDULERS
        cycles = (stage1_ms(p) - reference) * 1e-3 * BASE_CLOCK_HZ
        lines.append(f"{p['variant']} against full, {p['kernel']} R={p['rows']} {p['config']}: "
                     f"{per_logit:+.1f} instructions per logit, {cycles / instructions:.2f} "
                     f"cycles each per scheduler")
    return lines


def _kernels(text: str) -> list[str]:
    return cli.names(text, KERNELS)


def _variants(text: str) -> list[tuple[str, ...]]:
    return [parse_variant(part.strip()) for part in text.split(",")]


def _ws_configs(text: str) -> list[str]:
    """The items of --configs, each a warp-specialized configuration ("...,ws")."""
    from sweep_tiles import parse_configs

    items = text.replace(";", " ").split()
    for item, config in zip(items, parse_configs(text)):
        if not config.warp_specialized:
            raise argparse.ArgumentTypeError(
                f"--configs item {item!r}: the probe swaps the Gluon kernel's partitions; "
                f"add ',ws'")
    if not items:
        raise argparse.ArgumentTypeError("--configs: at least one configuration")
    return items


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=_kernels, default=["sample", "verify"],
                        help=f"comma-separated, from {', '.join(KERNELS)}")
    parser.add_argument("--rows", type=lct.positive_ints, default=[256],
                        help="comma-separated row counts (verify: B * (G + 1), G = --drafts)")
    parser.add_argument("--configs", type=_ws_configs,
                        default=_ws_configs("128,128,64,4,5,ws,screen"),
                        help='"bv,br,bd,warps,stages,ws[,screen]" items (probes/sweep_tiles.py)')
    parser.add_argument("--variants", type=_variants,
                        default=[(), ("no-mma",), ("no-load", "no-mma"), ("cheap-bits",)],
                        help=f"comma-separated: full, or '+'-joined flags from {', '.join(FLAGS)}")
    args = lct.parse_point_arguments(parser, argv, "epilogue_probe.json", format_table)
    if args is None:
        return 0
    if args.launch:
        _launch(args.kernels[0], args.rows[0], args.configs[0], args.variants[0], args.drafts)
        return 0
    # A point that fails (or hangs: locked_clock_times.profile_launches' timeout) is kept as
    # its error, and the JSON is rewritten after every point: one bad variant costs one point.
    plan = [(lct.measure_point, (kernel, rows, args.drafts), dict(kernel=kernel, rows=rows))
            for rows in args.rows for kernel in ("matmul", "argmax")]
    plan += [(measure_point, (kernel, rows, config, flags, args.drafts),
              dict(kernel=kernel, rows=rows, config=config, variant=variant_name(flags)))
             for rows in args.rows for kernel in args.kernels for config in args.configs
             for flags in args.variants]
    path = Path(args.out) / "epilogue_probe.json"
    points = []
    for measure, measure_args, names in plan:
        try:
            points.append(measure(*measure_args))
        except SystemExit as failure:
            points.append(dict(names, error=str(failure)[-1000:]))
        lct.write_report(points, path)
    lct.write_report(points, path, format_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
