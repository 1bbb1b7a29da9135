"""Latency of the target side of speculative decoding: verifying G greedy drafted tokens per row.

What is measured, for an LM head of hidden size D and vocabulary V (default 4096 x 151,936,
bf16), each batch size B and draft length G: the time to turn the target's bf16 hidden states
``[B, G+1, D]`` (R = B*(G+1) rows), the bf16 LM-head weight ``[V, D]`` and the drafts
``[B, G]`` into the number of accepted drafts and the emitted tokens per row. Every variant
includes the LM-head matmul of all R rows, so the numbers compare end to end:

* ``matmul``: cuBLAS ``hidden.view(R, D) @ weight.T`` alone (bf16 logits), no verification.
* ``materialized`` (T=0.7, untruncated) / ``materialized_qwen`` (T=0.6, top-k 20, top-p 0.95):
  what stock stacks do (vLLM's rejection sampler): the matmul, then logits -> float32 ->
  / T -> (qwen: vLLM's sort-based top-k + top-p masking) -> softmax -> p(draft) -> accept
  iff u < p(draft), u = torch.rand -> accepted count = leading run of accepts -> one
  replacement token per position by the exponential race argmax(probs / Exp(1)): from the
  residual, the probs with the draft's token zeroed (a greedy drafter's one-hot q makes
  max(p - q, 0) exactly that), and from the plain probs at the bonus position G. As in vLLM
  the residual is not renormalised (the race's argmax does not depend on the scale) and one
  Exp(1) draw per (row, token) serves all G+1 positions (only one replacement per row is
  emitted). The logprobs of the emitted tokens are gathered too (the fused kernel returns
  them). No host sync anywhere. On CUDA (not with --quick) everything after the matmul is
  one ``torch.compile(dynamic=False)`` graph per (B, G), like bench_kernels.py's
  softmax + multinomial baseline; eager otherwise. Where inductor fails to compile the
  sorted top-k/top-p (torch 2.11 on an H200 did for R <= 256), that part runs eagerly, as
  in vLLM, between compiled graphs; the row's ``notes`` say so.
* ``flashspec_verify`` / ``flashspec_verify_qwen``: ``flashspec.kernels.fused_verify``
  with the same parameters (``--acceptance``, default "strict"), which never writes the
  logits. ``rows_not_ok`` counts the rows it returned with status != 0 (1: needs an exact
  completion that this timing excludes, 2: non-finite).

Drafts are uniform random ids, so nearly all are rejected; no variant's work depends on it.

Derived per point: ``x_matmul`` (variant ms / matmul ms) and ``speedup`` (materialized ms /
flashspec ms), untruncated and qwen, checked against the acceptance bars: verify <= 1.05x
matmul at every point, and >= 1.3x faster than materialized wherever R >= 32.

Timing: bench_kernels.py's own functions. CUDA: ``triton.testing.do_bench`` medians (CUDA
events, L2 flushed before every call), >= 100 timed calls after 25 ms of warm-up, of each
variant's CUDA-graph replay (``bench_kernels.graph_replay``), the same for every variant. CPU (``--quick``, a smoke test): ``time.perf_counter`` medians. A variant that
fails (e.g. the kernel does not exist yet) is recorded as an error string and the run goes on.

Run (from the repository root):

    PYTHONPATH=. python scripts/bench_verify.py                          # everything, on a GPU
    PYTHONPATH=. python scripts/bench_verify.py --batch-sizes 1,64 --draft-lengths 3
    PYTHONPATH=. TRITON_INTERPRET=1 python scripts/bench_verify.py --quick   # CPU smoke test

Writes ``bench_verify.json`` to ``--out`` and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from flashspec.bench.cli import package_version


def _load_bench_kernels():
    path = Path(__file__).resolve().with_name("bench_kernels.py")
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bk = _load_bench_kernels()

FULL_SHAPE = (4096, 151936)
FULL_BATCH_SIZES = (1, 4, 16, 64)
FULL_DRAFT_LENGTHS = (1, 3, 5, 7)
QUICK_SHAPE = (64, 256)
QUICK_BATCH_SIZES = (1, 2)
QUICK_DRAFT_LENGTHS = (1, 3)
FULL_REP_MS = bk.FULL_REP_MS
QUICK_REP_MS = bk.QUICK_REP_MS
CPU_MAX_ITERS = 20

UNTRUNCATED = {"temperature": 0.7}
QWEN = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
ACCEPTANCE_MODES = ("strict", "probabilistic")

# Acceptance bars (from the issue).
BAR_X_MATMUL = 1.05
BAR_SPEEDUP = 1.3
BAR_SPEEDUP_MIN_ROWS = 32

VARIANTS = ("matmul", "materialized", "materialized_qwen", "flashspec_verify",
            "flashspec_verify_qwen")
# (flashspec variant, its materialized baseline) per sampling setting.
PAIRS = {"untruncated": ("flashspec_verify", "materialized"),
         "qwen": ("flashspec_verify_qwen", "materialized_qwen")}


class Case(NamedTuple):
    hidden: torch.Tensor        # [B, G+1, D] bf16
    weight: torch.Tensor        # [V, D] bf16
    draft_tokens: torch.Tensor  # [B, G] int64
    positions: torch.Tensor     # [B] int64
    cuda: bool
    compile: bool
    acceptance: str


# ---------------------------------------------------------------- materialized baseline


def lm_head_rows(case: Case) -> torch.Tensor:
    return torch.mm(case.hidden.view(-1, case.hidden.shape[-1]), case.weight.T)


# Outside the graph when inductor cannot compile it (see _materialized).
sort_top_k_top_p_eager = torch.compiler.disable(bk.sort_top_k_top_p)


def materialized_verify(logits: torch.Tensor, draft_tokens: torch.Tensor, temperature: float,
                        top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                        truncate: Callable = bk.sort_top_k_top_p):
    """Rejection sampling of greedy drafts from materialized logits [B*(G+1), V], vLLM style.

    Returns (num_accepted [B], tokens [B, G+1] (-1 after the emitted ones), accept_probs
    [B, G], logprobs [B, G+1]); data-independent, no host sync.
    """
    batch, num_drafts = draft_tokens.shape
    vocab = logits.shape[-1]
    scores = logits.float() / temperature
    if top_k is not None:
        scores = truncate(scores, top_k, top_p)
    probs = scores.softmax(dim=-1).view(batch, num_drafts + 1, vocab)
    accept_probs = probs[:, :num_drafts].gather(-1, draft_tokens[..., None]).squeeze(-1)
    accepted = torch.rand_like(accept_probs) < accept_probs
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    # No draft at the bonus position G: its replacement comes from the plain probs.
    drafts = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)
    vocab_ids = torch.arange(vocab, device=logits.device)
    residual = torch.where(vocab_ids == drafts[..., None], 0.0, probs)
    race = torch.empty(batch, 1, vocab, device=logits.device).exponential_()
    replacement = residual.div(race).argmax(dim=-1)
    offsets = torch.arange(num_drafts + 1, device=logits.device)
    stop = num_accepted[:, None]
    tokens = torch.where(offsets < stop, drafts, torch.where(offsets == stop, replacement, -1))
    emitted = offsets <= stop
    logprobs = probs.gather(-1, tokens.clamp_min(0)[..., None]).squeeze(-1).log()
    return num_accepted, tokens, accept_probs, torch.where(emitted, logprobs, 0.0)


def _materialized(case: Case, sampling: dict) -> Callable:
    extra = ()
    if "top_k" in sampling:
        rows, device = case.hidden.shape[0] * case.hidden.shape[1], case.hidden.device
        extra = (torch.full((rows,), sampling["top_k"], dtype=torch.long, device=device),
                 torch.full((rows,), sampling["top_p"], dtype=torch.float32, device=device))
    temperature = sampling["temperature"]
    if not case.compile:
        return lambda: materialized_verify(lm_head_rows(case), case.draft_tokens, temperature,
                                           *extra)

    def compiled(truncate: Callable) -> Callable:
        # One static graph per (B, G); the reset keeps dynamo's per-function recompile limit
        # from silently falling back to eager after 8 shapes.
        torch._dynamo.reset()
        verify = torch.compile(partial(materialized_verify, truncate=truncate), dynamic=False)
        return lambda: verify(lm_head_rows(case), case.draft_tokens, temperature, *extra)

    fn = compiled(bk.sort_top_k_top_p)
    try:
        fn()  # compiles
        fn.note = "compiled"
    except Exception as error:  # noqa: BLE001
        if not extra:
            raise
        # Inductor (seen: torch 2.11, H200, R <= 256) can fail on the sorted truncation:
        # run that part eagerly, as vLLM does, and compile the rest.
        fn = compiled(sort_top_k_top_p_eager)
        fn.note = f"compiled, top-k/top-p eager ({bk._status_of(error)})"
    return fn


def _matmul(case: Case) -> Callable:
    return partial(lm_head_rows, case)


# ---------------------------------------------------------------- flashspec (imported lazily)


def _flashspec_verify(case: Case, sampling: dict) -> Callable:
    bk._require_triton(case)
    import flashspec
    from flashspec.kernels import fused_verify

    batch, device = case.hidden.shape[0], case.hidden.device
    params = flashspec.SamplingParams.create(batch, seed=0, device=device, **sampling)
    return partial(fused_verify, case.hidden, case.weight, case.draft_tokens, params,
                   case.positions, acceptance=case.acceptance)


BUILDERS: dict[str, Callable[[Case], Callable]] = {
    "matmul": _matmul,
    "materialized": partial(_materialized, sampling=UNTRUNCATED),
    "materialized_qwen": partial(_materialized, sampling=QWEN),
    "flashspec_verify": partial(_flashspec_verify, sampling=UNTRUNCATED),
    "flashspec_verify_qwen": partial(_flashspec_verify, sampling=QWEN),
}


# ---------------------------------------------------------------- timing


def time_cpu_ms(fn: Callable, rep_ms: float) -> float:
    """perf_counter median; no warm-up call, time_variant's first call was one."""
    times: list[float] = []
    while not times or (sum(times) < rep_ms and len(times) < CPU_MAX_ITERS):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class Timed(NamedTuple):
    ms: float | None
    status: str                # "ok", a skip reason or "error: ..."
    rows_not_ok: int | None    # flashspec: rows with status != 0
    note: str | None           # materialized on CUDA: how it was compiled
    timing: str | None = None  # "graph", "eager: <why capture failed>" or "eager" (CPU)


def time_variant(name: str, case: Case, timer: Callable) -> Timed:
    try:
        fn = BUILDERS[name](case)
        not_ok = bk._rows_not_ok(fn())  # also the warm-up (and the compile)
        timed, how = bk.graph_replay(fn) if case.cuda else (fn, "eager")
        return Timed(timer(timed), "ok", not_ok, getattr(fn, "note", None), how)
    except bk.Skipped as skipped:
        return Timed(None, str(skipped), None, None)
    except Exception as error:  # noqa: BLE001 - a broken variant must not stop the others
        if case.cuda:
            torch.cuda.empty_cache()
        return Timed(None, bk._status_of(error), None, None)


# ---------------------------------------------------------------- one row


def derive(row: dict) -> None:
    """Adds x_matmul, speedup and the bars (True / False, None where unmeasured or n/a)."""
    ms = row["ms"]
    row["x_matmul"] = {name: bk._ratio(t, ms.get("matmul")) for name, t in ms.items()}
    row["speedup"] = {key: bk._ratio(ms.get(base), ms.get(fused))
                      for key, (fused, base) in PAIRS.items()}
    x_ok, spd_ok = {}, {}
    for key, (fused, _) in PAIRS.items():
        x = row["x_matmul"].get(fused)
        x_ok[key] = None if x is None else x <= BAR_X_MATMUL
        speedup = row["speedup"][key]
        applies = row["R"] >= BAR_SPEEDUP_MIN_ROWS and speedup is not None
        spd_ok[key] = speedup >= BAR_SPEEDUP if applies else None
    row["meets_bar"] = {"x_matmul": x_ok, "speedup": spd_ok}


def make_case(batch: int, drafts: int, weight: torch.Tensor, args: argparse.Namespace,
              cuda: bool) -> Case:
    vocab, dim = weight.shape
    device = weight.device
    hidden = torch.randn(batch, drafts + 1, dim, dtype=torch.bfloat16, device=device)
    hidden.mul_(bk.HIDDEN_SCALE)
    draft_tokens = torch.randint(0, vocab, (batch, drafts), dtype=torch.long, device=device)
    positions = torch.zeros(batch, dtype=torch.long, device=device)
    return Case(hidden, weight, draft_tokens, positions, cuda, cuda and not args.quick,
                args.acceptance)


def run_point(case: Case, timer: Callable) -> dict:
    batch, positions, _ = case.hidden.shape
    row = {"B": batch, "G": positions - 1, "R": batch * positions, "ms": {}, "status": {},
           "rows_not_ok": {}, "notes": {}, "timing": {}}
    for name in VARIANTS:
        timed = time_variant(name, case, timer)
        row["ms"][name], row["status"][name] = timed.ms, timed.status
        if timed.timing is not None:
            row["timing"][name] = timed.timing
        if timed.rows_not_ok is not None:
            row["rows_not_ok"][name] = timed.rows_not_ok
        if timed.note is not None:
            row["notes"][name] = timed.note
    derive(row)
    return row


def run_all(args: argparse.Namespace, cuda: bool, timer: Callable) -> list[dict]:
    dim, vocab = args.shape
    device = "cuda" if cuda else "cpu"
    weight = torch.randn(vocab, dim, dtype=torch.bfloat16, device=device).mul_(dim ** -0.5)
    rows = []
    for batch in args.batch_sizes:
        for drafts in args.draft_lengths:
            print(f"timing D={dim} V={vocab} B={batch} G={drafts} ...", file=sys.stderr,
                  flush=True)
            rows.append(run_point(make_case(batch, drafts, weight, args, cuda), timer))
    return rows


# ---------------------------------------------------------------- output


def build_report(args: argparse.Namespace, cuda: bool, rows: list[dict]) -> dict:
    method = (f"triton.testing.do_bench median of each variant's CUDA-graph replay (eager "
              f"where capture failed: rows' `timing`), CUDA events, L2 flushed, "
              f"warmup={bk.WARMUP_MS} ms, >= {bk.CUDA_MIN_ITERS} calls and >= {args.rep_ms} ms"
              if cuda else
              f"time.perf_counter median of 1 to {CPU_MAX_ITERS} calls (CPU smoke test)")
    dim, vocab = args.shape
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "cuda": cuda,
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "transformers": package_version("transformers"),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "timing_method": method,
        "materialized_compiled": cuda and not args.quick,
        "shape": {"D": dim, "V": vocab},
        "batch_sizes": args.batch_sizes,
        "draft_lengths": args.draft_lengths,
        "variants": list(VARIANTS),
        "acceptance": args.acceptance,
        "drafts": "uniform random ids in [0, V); positions 0",
        "sampling": {"untruncated": UNTRUNCATED, "qwen": QWEN},
        "bars": {"x_matmul_max": BAR_X_MATMUL, "speedup_min": BAR_SPEEDUP,
                 "speedup_min_rows": BAR_SPEEDUP_MIN_ROWS},
        "rows": rows,
    }


def print_problems(rows: list[dict]) -> None:
    counts: dict[tuple[str, str], int] = {}
    for row in rows:
        for name, status in row["status"].items():
            if status != "ok":
                counts[name, status] = counts.get((name, status), 0) + 1
    for row in rows:
        for name, note in row["notes"].items():
            if note != "compiled":
                counts[name, note] = counts.get((name, note), 0) + 1
    for (name, status), count in counts.items():
        print(f"{name} ({count} points): {status}"[:120])
    for name in (fused for fused, _ in PAIRS.values()):
        count = sum(row["rows_not_ok"].get(name, 0) for row in rows)
        if count:
            print(f"warning: {name} left {count} rows with status != 0 (see rows_not_ok); its "
                  "time excludes their completion")


def bar_summary(rows: list[dict]) -> list[str]:
    lines = []
    for bar, text in (("x_matmul", f"verify <= {BAR_X_MATMUL}x matmul at every point"),
                      ("speedup", f">= {BAR_SPEEDUP}x faster than materialized where "
                                  f"R >= {BAR_SPEEDUP_MIN_ROWS}")):
        parts = []
        for key in PAIRS:
            verdicts = [row["meets_bar"][bar][key] for row in rows]
            checked = [v for v in verdicts if v is not None]
            parts.append(f"{key} {sum(checked)}/{len(checked)} met")
        lines.append(f"bar: {text}: {', '.join(parts)}")
    return lines


def _cell(value, width: int, digits: int, ok: bool | None = None) -> str:
    """bench_kernels' number format, plus '*' after a value that misses its bar."""
    return bk._fmt(value, width, digits) + ("*" if ok is False else " ")


def _not_ok(row: dict) -> str:
    counts = [row["rows_not_ok"].get(fused) for fused, _ in PAIRS.values()]
    return "/".join("-" if n is None else str(n) for n in counts)


HEADER = ("   B  G    R  matmul  verify    xM   mater    spd    qwen    xM  mqwen    spd "
          " notok")


def format_row(row: dict) -> str:
    ms, x, spd, bar = row["ms"], row["x_matmul"], row["speedup"], row["meets_bar"]
    return " ".join([
        f"{row['B']:4d} {row['G']:2d} {row['R']:4d}",
        _cell(ms["matmul"], 6, 3),
        _cell(ms["flashspec_verify"], 6, 3),
        _cell(x["flashspec_verify"], 5, 2, bar["x_matmul"]["untruncated"]),
        _cell(ms["materialized"], 6, 3),
        _cell(spd["untruncated"], 5, 2, bar["speedup"]["untruncated"]),
        _cell(ms["flashspec_verify_qwen"], 6, 3),
        _cell(x["flashspec_verify_qwen"], 5, 2, bar["x_matmul"]["qwen"]),
        _cell(ms["materialized_qwen"], 6, 3),
        _cell(spd["qwen"], 5, 2, bar["speedup"]["qwen"]),
        f"{_not_ok(row):>5}",
    ])


TABLE_LEGEND = """\
ms = median latency; R = B*(G+1) rows; verify = flashspec_verify (T=0.7), qwen =
flashspec_verify_qwen (T=0.6, k 20, p 0.95); xM = / cuBLAS matmul of the R rows; mater / mqwen =
materialized baselines; spd = materialized ms / flashspec ms; * = misses its bar;
notok = rows with status != 0 (verify/qwen)."""


def print_table(report: dict) -> None:
    shape = report["shape"]
    print(f"\n{report['device']}, D={shape['D']} V={shape['V']}, acceptance="
          f"{report['acceptance']}, materialized "
          f"{'torch.compile' if report['materialized_compiled'] else 'eager'}")
    for line in bar_summary(report["rows"]):
        print(line)
    print(TABLE_LEGEND)
    print(HEADER)
    for row in report["rows"]:
        print(format_row(row))


# ---------------------------------------------------------------- command line


def parse_positive_ints(text: str) -> list[int]:
    try:
        return [bk._positive_int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive ints (e.g. 1,4,16), got {text!r}") from None


def parse_shape(text: str) -> tuple[int, int]:
    shapes = bk.parse_shapes(text)
    if len(shapes) != 1:
        raise argparse.ArgumentTypeError(f"expected one DxV, got {text!r}")
    return shapes[0]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time speculative-decoding verification of G drafts per row (flashspec's "
                    "fused_verify vs cuBLAS matmul and a materialized vLLM-style "
                    "rejection sampler).",
        epilog="Run from the repository root: PYTHONPATH=. python scripts/bench_verify.py")
    parser.add_argument("--shape", type=parse_shape, default=None,
                        help="DxV (hidden size x vocabulary) of the LM head; default "
                             "4096x151936 (64x256 with --quick)")
    parser.add_argument("--batch-sizes", type=parse_positive_ints, default=None,
                        help="comma-separated batch sizes B; default 1,4,16,64 (1,2 with "
                             "--quick)")
    parser.add_argument("--draft-lengths", type=parse_positive_ints, default=None,
                        help="comma-separated draft lengths G (>= 1); default 1,3,5,7 (1,3 with "
                             "--quick)")
    parser.add_argument("--acceptance", choices=ACCEPTANCE_MODES, default="strict",
                        help="fused_verify's acceptance mode; default strict")
    parser.add_argument("--rep-ms", type=bk.parse_rep_ms, default=None,
                        help=f"timed milliseconds per variant and point (do_bench's rep; at "
                             f"least {bk.CUDA_MIN_ITERS} calls on CUDA regardless); default "
                             f"{FULL_REP_MS:g} ({QUICK_REP_MS:g} with --quick)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "."),
                        help="directory for bench_verify.json; default $OUT if set, else .")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: tiny shape (D=64, V=256), B in {1,2}, G in {1,3}, "
                             "short reps, no torch.compile; runs on CPU too (flashspec's kernel "
                             "only with TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    args.shape = args.shape or (QUICK_SHAPE if args.quick else FULL_SHAPE)
    args.batch_sizes = args.batch_sizes or list(QUICK_BATCH_SIZES if args.quick
                                                else FULL_BATCH_SIZES)
    args.draft_lengths = args.draft_lengths or list(QUICK_DRAFT_LENGTHS if args.quick
                                                    else FULL_DRAFT_LENGTHS)
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
    timer = partial(bk.time_cuda_ms if cuda else time_cpu_ms, rep_ms=args.rep_ms)
    torch.manual_seed(0)
    rows = run_all(args, cuda, timer)
    report = build_report(args, cuda, rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_verify.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out / 'bench_verify.json'}")
    print_problems(rows)
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
