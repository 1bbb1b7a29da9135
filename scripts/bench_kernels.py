"""Latency of the decode-time LM-head + sampling step: flashspec's fused kernels vs baselines.

What is measured, for each shape (hidden size D, vocabulary V) and batch size B: the time to
turn a bf16 hidden state ``[B, D]`` and a bf16 LM-head weight ``[V, D]`` into one token per
row. Every variant includes the LM-head matmul, so the numbers are comparable end to end:

* ``floor_ms``: the HBM floor, (V*D + B*D) * 2 bytes / bandwidth, where the bandwidth is
  measured once at start from a large device-to-device copy (bytes read + written / time).
* ``matmul``: cuBLAS ``torch.mm(hidden, weight.T)`` alone (bf16 logits), no sampling.
* ``matmul_argmax``: greedy from materialized logits.
* ``matmul_softmax_multinomial``: logits, then a ``torch.compile``d softmax + multinomial.
* ``matmul_exponential_race``: vLLM's sampler, softmax then probs / Exp(1) noise, argmax.
* ``matmul_sort_topk_topp``: vLLM's native top-k=20 + top-p=0.95 (full sort), then the race.
* ``matmul_topk50``: vLLM's top-k-only path (``torch.topk`` threshold, k=50), then the race.
* ``flashinfer_sample`` / ``flashinfer_topk_topp``: FlashInfer's samplers on the logits.
* ``flashspec_argmax`` / ``flashspec_sample`` (T=0.7, untruncated) /
  ``flashspec_sample_topk50`` (T=0.7, k=50) / ``flashspec_sample_qwen`` (T=0.6, k=20,
  p=0.95): flashspec's fused kernels (``flashspec.kernels.fused_argmax`` / ``fused_sample``,
  what ``flashspec.sampling`` runs with ``check=False``; sampling with its logprobs and
  log-sum-exp), which never write the logits.

Timing (CUDA): ``triton.testing.do_bench`` medians (CUDA events, L2 flushed before every
call), at least 100 timed calls after 25 ms of warm-up, of each variant captured in a CUDA
graph (`graph_replay`: the GPU time, not Python's launch work; eager where capture fails,
noted per row), the same method for every variant.
A variant that fails (flashspec's kernels are work in progress) is recorded as an error
string and the run goes on.

Run (from the repository root):

    PYTHONPATH=. python scripts/bench_kernels.py                       # everything, on a GPU
    PYTHONPATH=. python scripts/bench_kernels.py --shapes 4096x151936 --batch-sizes 1,64
    PYTHONPATH=. python scripts/bench_kernels.py --quick               # smoke test, CPU too

Writes ``bench_kernels.json`` and ``bench_kernels.png`` to ``--out`` and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from flashspec.bench.cli import package_version, pyplot_or_note

FULL_SHAPES = ((4096, 151936), (8192, 128256))
FULL_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUICK_SHAPES = ((64, 1000),)
QUICK_BATCH_SIZES = (1, 4)
FULL_REP_MS = 100.0
QUICK_REP_MS = 10.0
WARMUP_MS = 25
CUDA_MIN_ITERS = 100
# The CPU path is only a smoke test (and flashspec's kernels run interpreted, ~seconds a call).
CPU_MIN_ITERS = 1
CPU_MAX_ITERS = 100
GPU_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 64 << 20
# logits = hidden @ weight.T ~ N(0, HIDDEN_SCALE^2), max near 10 over ~150k tokens: O(1-10)
# like a real LM head's, not the near-uniform softmax of small random logits.
HIDDEN_SCALE = 2.0

TEMPERATURE = 0.7
TOP_K_SMALL = 50
QWEN = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}

TRUNCATION_BASELINES = ("matmul_sort_topk_topp", "matmul_topk50", "flashinfer_topk_topp")
TRUNCATED_FLASHSPEC = ("flashspec_sample_topk50", "flashspec_sample_qwen")

REFERENCE_QUOTED = {
    "source": "quoted, NOT measured here: peer FlashSampling fused Triton kernel, H100",
    "shape": "4096x151936",
    "x_floor": {"1": 1.03, "16": 1.07, "64": 1.11},
    "x_matmul": {"128": 1.21, "256": 1.98},
    "ms": {"256": 1.04},
}


class Skipped(Exception):
    """A variant that cannot run here; its message is recorded as the row's status."""


class Case(NamedTuple):
    hidden: torch.Tensor
    weight: torch.Tensor
    cuda: bool


# ---------------------------------------------------------------- materialized baselines


def lm_head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(hidden, weight.T)


def softmax_multinomial(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1)


def exponential_race(scores: torch.Tensor) -> torch.Tensor:
    """vLLM's `random_sample`: argmax of probs / Exp(1) draws a token with probability probs."""
    probs = torch.softmax(scores, dim=-1)
    return probs.div_(torch.empty_like(probs).exponential_()).argmax(-1)


def sort_top_k_top_p(scores: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """vLLM's native `apply_top_k_top_p` (per-row k and p, one full sort), in place."""
    ordered, order = scores.sort(dim=-1, descending=True)
    kth = ordered.gather(1, (k - 1).unsqueeze(1))
    ordered.masked_fill_(ordered < kth, float("-inf"))
    probs = ordered.softmax(dim=-1)
    # Drop a token once the mass strictly before it reaches p (the top token always stays).
    ordered.masked_fill_(probs.cumsum(dim=-1) - probs > p.unsqueeze(1), float("-inf"))
    return scores.scatter_(1, order, ordered)


def top_k_only(scores: torch.Tensor, k: int) -> torch.Tensor:
    """vLLM's `apply_top_k_only`: a `torch.topk` threshold instead of a full sort."""
    threshold = scores.topk(k, dim=-1).values[:, -1:]
    return scores.masked_fill_(scores < threshold, float("-inf"))


def _scores(case: Case, temperature: float) -> torch.Tensor:
    return lm_head(case.hidden, case.weight).float() / temperature


def _matmul(case: Case) -> Callable:
    return partial(lm_head, case.hidden, case.weight)


def _matmul_argmax(case: Case) -> Callable:
    return lambda: lm_head(case.hidden, case.weight).argmax(-1)


def _matmul_softmax_multinomial(case: Case) -> Callable:
    if not case.cuda:
        raise Skipped("skipped: torch.compile variants are timed on CUDA only")
    # One static graph per (shape, B); the reset keeps dynamo's per-function recompile limit
    # from silently falling back to eager after 8 shapes.
    torch._dynamo.reset()
    sample = torch.compile(softmax_multinomial, dynamic=False)
    return lambda: sample(lm_head(case.hidden, case.weight), TEMPERATURE)


def _matmul_exponential_race(case: Case) -> Callable:
    return lambda: exponential_race(_scores(case, TEMPERATURE))


def _matmul_sort_topk_topp(case: Case) -> Callable:
    batch, device = case.hidden.shape[0], case.hidden.device
    k = torch.full((batch,), QWEN["top_k"], dtype=torch.long, device=device)
    p = torch.full((batch,), QWEN["top_p"], dtype=torch.float32, device=device)
    return lambda: exponential_race(sort_top_k_top_p(_scores(case, QWEN["temperature"]), k, p))


def _matmul_topk50(case: Case) -> Callable:
    return lambda: exponential_race(top_k_only(_scores(case, TEMPERATURE), TOP_K_SMALL))


def _flashinfer_sampling(case: Case):
    if not case.cuda:
        raise Skipped("skipped: FlashInfer needs CUDA")
    try:
        import flashinfer.sampling
    except ImportError:
        raise Skipped("not installed") from None
    return flashinfer.sampling


def _flashinfer_sample(case: Case) -> Callable:
    sampling = _flashinfer_sampling(case)
    return lambda: sampling.sampling_from_logits(_scores(case, TEMPERATURE))


def _flashinfer_topk_topp(case: Case) -> Callable:
    sampling = _flashinfer_sampling(case)
    return lambda: sampling.top_k_top_p_sampling_from_logits(
        _scores(case, QWEN["temperature"]), QWEN["top_k"], QWEN["top_p"])


# ---------------------------------------------------------------- flashspec (imported lazily)


def _require_triton(case: Case) -> None:
    if not case.cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise Skipped("skipped: no CUDA; set TRITON_INTERPRET=1 to run flashspec's kernels "
                      "in Triton's interpreter")


def _flashspec_argmax(case: Case) -> Callable:
    _require_triton(case)
    from flashspec.kernels import fused_argmax

    return partial(fused_argmax, case.hidden, case.weight)


def _flashspec_sample(case: Case, **sampling) -> Callable:
    _require_triton(case)
    import flashspec
    from flashspec.kernels import fused_sample

    batch, device = case.hidden.shape[0], case.hidden.device
    params = flashspec.SamplingParams.create(batch, seed=0, device=device, **sampling)
    positions = torch.zeros(batch, dtype=torch.long, device=device)
    return partial(fused_sample, case.hidden, case.weight, params, positions)


VARIANTS: dict[str, Callable[[Case], Callable]] = {
    "matmul": _matmul,
    "matmul_argmax": _matmul_argmax,
    "matmul_softmax_multinomial": _matmul_softmax_multinomial,
    "matmul_exponential_race": _matmul_exponential_race,
    "matmul_sort_topk_topp": _matmul_sort_topk_topp,
    "matmul_topk50": _matmul_topk50,
    "flashinfer_sample": _flashinfer_sample,
    "flashinfer_topk_topp": _flashinfer_topk_topp,
    "flashspec_argmax": _flashspec_argmax,
    "flashspec_sample": partial(_flashspec_sample, temperature=TEMPERATURE, top_k=0, top_p=1.0),
    "flashspec_sample_topk50": partial(_flashspec_sample, temperature=TEMPERATURE,
                                       top_k=TOP_K_SMALL),
    "flashspec_sample_qwen": partial(_flashspec_sample, **QWEN),
}


# ---------------------------------------------------------------- timing


def _cuda_estimate_ms(fn: Callable) -> float:
    """Mean of 5 calls with the L2 flush in between: what do_bench divides `rep` by."""
    import triton

    driver = triton.runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        driver.clear_cache(cache)
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 5


def time_cuda_ms(fn: Callable, rep_ms: float) -> float:
    import triton.testing

    # do_bench runs rep / estimate calls; stretch rep so that slow variants get >= 100 too.
    rep = max(rep_ms, 1.25 * CUDA_MIN_ITERS * _cuda_estimate_ms(fn))
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=rep, return_mode="median")


def graph_replay(fn: Callable) -> tuple[Callable, str]:
    """(the replay of `fn` captured in a CUDA graph, "graph"), or (fn, "eager: <why>") where
    it cannot be captured.

    Timed eagerly, a Python entry point's host work can exceed the GPU time of a decode-size
    LM head and set the time instead: flashspec's unchecked launchers spend 0.2-0.3 ms of
    host time per call on the H200 (validation, three launches), as long as the 0.3 ms their
    kernels take at D=4096, V=151,936. A replay launches the same kernels with none of it,
    as the generation engine's captured steps do; every variant is timed the same way.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the capturing stream, as torch asks
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as error:  # noqa: BLE001 - e.g. a host sync inside fn
        torch.cuda.synchronize()
        return fn, f"eager: {_status_of(error)}"
    return graph.replay, "graph"


def time_cpu_ms(fn: Callable, rep_ms: float) -> float:
    fn()
    times: list[float] = []
    while len(times) < CPU_MIN_ITERS or (sum(times) < rep_ms and len(times) < CPU_MAX_ITERS):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure_bandwidth(cuda: bool, timer: Callable) -> float:
    """Bytes per millisecond of a large device-to-device copy (read + write)."""
    nbytes = GPU_COPY_BYTES if cuda else CPU_COPY_BYTES
    # ones, not empty: untouched CPU pages would read as the shared zero page, too fast.
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    dst = torch.empty_like(src)
    return 2 * nbytes / timer(partial(dst.copy_, src))


# ---------------------------------------------------------------- one row


def _status_of(error: Exception) -> str:
    message = str(error).strip().splitlines()
    return f"error: {type(error).__name__}: {message[0] if message else ''}"[:300]


def _rows_not_ok(out) -> int | None:
    """Rows a fused launch left unfinished (`status` != 0), None for outputs without one.

    The timing excludes the exact completion that `flashspec.sampling.sample` (check=True)
    would add for them, so a nonzero count means the flashspec time is optimistic there.
    """
    status = getattr(out, "status", None)
    return None if status is None else int((status != 0).sum())


def time_variant(name: str, case: Case,
                 timer: Callable) -> tuple[float | None, str, int | None, str | None]:
    """(median ms or None, "ok" / skip reason / "error: ...", rows_not_ok, how it was timed:
    "graph", "eager: <why capture failed>" or, on CPU, "eager")."""
    try:
        fn = VARIANTS[name](case)
        not_ok = _rows_not_ok(fn())  # also the warm-up (and the compile)
        timed, how = graph_replay(fn) if case.cuda else (fn, "eager")
        return timer(timed), "ok", not_ok, how
    except Skipped as skipped:
        return None, str(skipped), None, None
    except Exception as error:  # noqa: BLE001 - a broken variant must not stop the others
        if case.cuda:
            torch.cuda.empty_cache()
        return None, _status_of(error), None, None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def derive_ratios(row: dict) -> None:
    """Adds x_floor, x_matmul, speedup, truncation_cost and the best truncation baseline."""
    ms = row["ms"]
    row["x_floor"] = {name: _ratio(t, row["floor_ms"]) for name, t in ms.items()}
    row["x_matmul"] = {name: _ratio(t, ms.get("matmul")) for name, t in ms.items()}
    baselines = {name: ms[name] for name in TRUNCATION_BASELINES if ms.get(name) is not None}
    best = min(baselines, key=baselines.get) if baselines else None
    row["best_truncation_baseline"] = best
    speedup = {
        "flashspec_sample_vs_matmul_softmax_multinomial":
            _ratio(ms.get("matmul_softmax_multinomial"), ms.get("flashspec_sample")),
        "flashspec_sample_vs_matmul_exponential_race":
            _ratio(ms.get("matmul_exponential_race"), ms.get("flashspec_sample")),
        "flashspec_argmax_vs_matmul_argmax":
            _ratio(ms.get("matmul_argmax"), ms.get("flashspec_argmax")),
    }
    for name in TRUNCATED_FLASHSPEC:
        speedup[f"{name}_vs_best_truncation_baseline"] = _ratio(baselines.get(best), ms.get(name))
    row["speedup"] = speedup
    row["truncation_cost"] = {name: _ratio(ms.get(name), ms.get("flashspec_sample"))
                              for name in TRUNCATED_FLASHSPEC}


def run_row(case: Case, variants: list[str], timer: Callable, bandwidth: float) -> dict:
    batch, dim = case.hidden.shape
    vocab = case.weight.shape[0]
    row = {"D": dim, "V": vocab, "B": batch,
           "floor_ms": (vocab * dim + batch * dim) * 2 / bandwidth, "ms": {}, "status": {},
           "rows_not_ok": {}, "timing": {}}
    for name in variants:
        row["ms"][name], row["status"][name], not_ok, how = time_variant(name, case, timer)
        if not_ok is not None:
            row["rows_not_ok"][name] = not_ok
        if how is not None:
            row["timing"][name] = how
    derive_ratios(row)
    return row


def run_shape(dim: int, vocab: int, batch_sizes: list[int], variants: list[str], cuda: bool,
              timer: Callable, bandwidth: float) -> list[dict]:
    device = "cuda" if cuda else "cpu"
    weight = torch.randn(vocab, dim, dtype=torch.bfloat16, device=device).mul_(dim ** -0.5)
    hidden = torch.randn(max(batch_sizes), dim, dtype=torch.bfloat16, device=device)
    hidden.mul_(HIDDEN_SCALE)
    rows = []
    for batch in batch_sizes:
        print(f"timing D={dim} V={vocab} B={batch} ...", file=sys.stderr, flush=True)
        rows.append(run_row(Case(hidden[:batch], weight, cuda), variants, timer, bandwidth))
    return rows


# ---------------------------------------------------------------- output


def build_report(args: argparse.Namespace, cuda: bool, bandwidth: float, rows: list[dict]) -> dict:
    method = (f"triton.testing.do_bench median of each variant's CUDA-graph replay (eager "
              f"where capture failed: rows' `timing`), CUDA events, L2 flushed, "
              f"warmup={WARMUP_MS} ms, >= {CUDA_MIN_ITERS} calls and >= {args.rep_ms} ms" if cuda else
              f"time.perf_counter median of >= {CPU_MIN_ITERS} calls (CPU smoke test)")
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "cuda": cuda,
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "transformers": package_version("transformers"),
        "flashinfer": (package_version("flashinfer-python") or package_version("flashinfer")
                       or "not installed"),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "timing_method": method,
        "bandwidth_gb_per_s": bandwidth * 1e3 / 1e9,
        "shapes": [{"D": dim, "V": vocab} for dim, vocab in args.shapes],
        "batch_sizes": args.batch_sizes,
        "variants": args.variants,
        "sampling": {"temperature": TEMPERATURE, "topk50": {"temperature": TEMPERATURE,
                                                            "top_k": TOP_K_SMALL},
                     "qwen": QWEN},
        "reference_quoted": REFERENCE_QUOTED,
        "rows": rows,
    }


def write_plot(report: dict, path: Path) -> None:
    plt = pyplot_or_note(path)
    if plt is None:
        return
    shapes = report["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(7 * len(shapes), 5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in report["rows"] if (r["D"], r["V"]) == (shape["D"], shape["V"])]
        ax.plot([r["B"] for r in rows], [r["floor_ms"] for r in rows], "k--", label="HBM floor")
        for name in report["variants"]:
            points = [(r["B"], r["ms"][name]) for r in rows if r["ms"][name] is not None]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=name)
        ax.set(xscale="log", yscale="log", xlabel="batch size B", ylabel="latency (ms)",
               title=f"D={shape['D']} V={shape['V']} ({report['device']})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def print_reference() -> None:
    print("Reference (quoted from the peer FlashSampling report, NOT measured here): fused Triton "
          "kernel, H100,\n  D=4096 V=151936: 1.03x floor @B=1, 1.07x @B=16, 1.11x @B=64, "
          "1.21x cuBLAS matmul @B=128, 1.98x matmul (1.04 ms) @B=256")


def print_problems(rows: list[dict]) -> None:
    """One line per distinct (variant, status) that is not "ok", with its row count, and per
    flashspec variant that left rows unfinished."""
    counts: dict[tuple[str, str], int] = {}
    for row in rows:
        for name, status in row["status"].items():
            if status != "ok":
                counts[name, status] = counts.get((name, status), 0) + 1
    for (name, status), count in counts.items():
        print(f"{name} ({count} rows): {status}"[:120])
    unfinished: dict[str, int] = {}
    for row in rows:
        for name, count in row["rows_not_ok"].items():
            unfinished[name] = unfinished.get(name, 0) + count
    for name, count in unfinished.items():
        if count:
            print(f"warning: {name} left {count} rows with status != 0 (see rows_not_ok); its "
                  "time excludes their completion")


def _fmt(value: float | str | None, width: int, digits: int) -> str:
    """`digits` decimals, fewer for large values so that columns keep their width."""
    if value is None or isinstance(value, str):
        return f"{value or '-':>{width}}"
    digits = min(digits, max(0, width - 1 - len(str(int(abs(value))))))
    return f"{value:{width}.{digits}f}"


def _get(table: str, name: str) -> Callable[[dict], float | None]:
    return lambda row: row[table].get(name)


def _best_baseline_ms(row: dict) -> float | None:
    return row["ms"].get(row["best_truncation_baseline"])


SHORT_BASELINE = {"matmul_sort_topk_topp": "sort", "matmul_topk50": "topk50",
                  "flashinfer_topk_topp": "fi_kp"}
# (title, width, decimals, value of a row); "|" separates groups.
TABLE_COLUMNS = (
    ("B", 4, 0, lambda row: row["B"]),
    ("floor", 6, 3, lambda row: row["floor_ms"]),
    ("matmul", 6, 3, _get("ms", "matmul")),
    "|",
    ("argmax", 6, 3, _get("ms", "flashspec_argmax")),
    ("xF", 5, 2, _get("x_floor", "flashspec_argmax")),
    "|",
    ("sample", 6, 3, _get("ms", "flashspec_sample")),
    ("xF", 5, 2, _get("x_floor", "flashspec_sample")),
    ("xM", 5, 2, _get("x_matmul", "flashspec_sample")),
    ("multin", 6, 3, _get("ms", "matmul_softmax_multinomial")),
    ("spd", 5, 2, _get("speedup", "flashspec_sample_vs_matmul_softmax_multinomial")),
    "|",
    ("k50", 6, 3, _get("ms", "flashspec_sample_topk50")),
    ("spd", 5, 2, _get("speedup", "flashspec_sample_topk50_vs_best_truncation_baseline")),
    "|",
    ("qwen", 6, 3, _get("ms", "flashspec_sample_qwen")),
    ("xM", 5, 2, _get("x_matmul", "flashspec_sample_qwen")),
    ("spd", 5, 2, _get("speedup", "flashspec_sample_qwen_vs_best_truncation_baseline")),
    "|",
    ("base", 6, 0, lambda row: SHORT_BASELINE.get(row["best_truncation_baseline"])),
    ("ms", 6, 3, _best_baseline_ms),
)
TABLE_LEGEND = """\
ms = median latency; xF = / HBM floor; xM = / cuBLAS matmul; spd = baseline ms / flashspec ms.
flashspec fused: argmax; sample (T=0.7); k50 (T=0.7, top-k 50); qwen (T=0.6, k 20, p 0.95).
multin = matmul + compiled softmax + multinomial (the baseline of sample's spd); base = fastest
materialized truncation baseline (the one of k50's and qwen's spd): sort = vLLM sort top-k/top-p,
topk50 = torch.topk threshold, fi_kp = FlashInfer."""


def print_table(report: dict) -> None:
    print(f"\n{report['device']}, copy bandwidth {report['bandwidth_gb_per_s']:.0f} GB/s")
    print(TABLE_LEGEND)
    header = " ".join(c if c == "|" else _fmt(c[0], c[1], 0) for c in TABLE_COLUMNS)
    for shape in report["shapes"]:
        print(f"\nD={shape['D']} V={shape['V']}")
        print(header)
        for row in report["rows"]:
            if (row["D"], row["V"]) == (shape["D"], shape["V"]):
                print(" ".join(c if c == "|" else _fmt(c[3](row), c[1], c[2])
                               for c in TABLE_COLUMNS))


# ---------------------------------------------------------------- command line


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _split_shape(text: str) -> list[str]:
    parts = text.lower().split("x")
    if len(parts) != 2:
        raise ValueError(text)
    return parts


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(_positive_int(n) for n in _split_shape(s)) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated DxV with positive ints (e.g. 4096x151936), got {text!r}"
        ) from None


def parse_batch_sizes(text: str) -> list[int]:
    try:
        return [_positive_int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive ints (e.g. 1,16,256), got {text!r}") from None


def parse_variants(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(VARIANTS)}")
    return names


def parse_rep_ms(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of ms, got {text!r}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time the LM-head + sampling step (flashspec's fused kernels vs cuBLAS "
                    "matmul + torch/vLLM/FlashInfer samplers) against the HBM floor.",
        epilog="Run from the repository root: PYTHONPATH=. python scripts/bench_kernels.py")
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="comma-separated DxV (hidden size x vocabulary) LM heads; default "
                             "4096x151936,8192x128256 (64x1000 with --quick)")
    parser.add_argument("--batch-sizes", type=parse_batch_sizes, default=None,
                        help="comma-separated batch sizes B; default 1,2,4,...,256 "
                             "(1,4 with --quick)")
    parser.add_argument("--variants", type=parse_variants, default=list(VARIANTS),
                        help="comma-separated variants to time; default all: "
                             + ", ".join(VARIANTS))
    parser.add_argument("--rep-ms", type=parse_rep_ms, default=None,
                        help=f"timed milliseconds per variant and row (do_bench's rep; at least "
                             f"{CUDA_MIN_ITERS} calls on CUDA regardless); default "
                             f"{FULL_REP_MS:g} ({QUICK_REP_MS:g} with --quick)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out"),
                        help="directory for bench_kernels.json and bench_kernels.png; default "
                             "$OUT if set, else ./bench_out")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: tiny shape (D=64, V=1000), B in {1,4}, short reps; runs "
                             "on CPU too (perf_counter timing, no torch.compile or FlashInfer, "
                             "flashspec's kernels only with TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    args.shapes = args.shapes or list(QUICK_SHAPES if args.quick else FULL_SHAPES)
    args.batch_sizes = args.batch_sizes or list(QUICK_BATCH_SIZES if args.quick
                                                else FULL_BATCH_SIZES)
    args.rep_ms = args.rep_ms or (QUICK_REP_MS if args.quick else FULL_REP_MS)
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code (argparse exits with 2 on bad arguments)."""
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print("error: no CUDA device; the benchmark needs a GPU (use --quick for a CPU smoke "
              "test)", file=sys.stderr)
        return 2
    timer = partial(time_cuda_ms if cuda else time_cpu_ms, rep_ms=args.rep_ms)
    torch.manual_seed(0)
    bandwidth = measure_bandwidth(cuda, timer)
    rows = [row for dim, vocab in args.shapes
            for row in run_shape(dim, vocab, args.batch_sizes, args.variants, cuda, timer,
                                 bandwidth)]
    report = build_report(args, cuda, bandwidth, rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_kernels.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out / 'bench_kernels.json'}")
    write_plot(report, args.out / "bench_kernels.png")
    print_reference()
    print_problems(rows)
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
