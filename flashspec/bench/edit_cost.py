"""Cost of the fused logit edits (and head transforms): the fused LM-head kernels with and
without edit codes.

Issue 30's GPU bar: sampling with a repetition penalty over a 4,096-token context plus a
bad-words list costs <= 1.05x the same call without edits at B <= 16 and <= 1.10x at B = 64
(D = 4096, V = 151,936, bf16); verification likewise against plain verification. For each
batch size B this times, as CUDA-graph replays (the engine's steps are replays), medians of
`triton.testing.do_bench` (L2 flushed before each call), the median of ``--rounds`` timings
taken in turn with the other calls':

* ``sample`` / ``sample_edits``: `kernels.fused_sample` with Qwen2.5-Instruct's warpers
  (T 0.7, top-k 20, top-p 0.8), without and with codes ``[B, V]``;
* ``verify`` / ``verify_edits``: `kernels.fused_verify` of G drafts per row, without and with
  codes ``[B, G+1, V]``;
* ``codes_sample`` / ``codes_verify``: making those codes on the device from the slot's
  state (`generation.edits.EditState`), which an engine step adds to the kernels;
* ``sample_mask`` / ``verify_mask`` and ``codes_sample_mask`` / ``codes_verify_mask``: the
  same edits with an allowed-token bitmask per position (`generation.allowed`, a random half
  of the vocabulary), and the making of their codes;
* ``sample_head`` / ``verify_head``: without codes, with a Gemma-2-style head (an LM-head
  bias and softcap 30, applied in the kernels' epilogue): what a model's head transforms cost;
* ``sample_vllm`` / ``verify_vllm``: the codes above plus vLLM's additive edits (a
  ``logit_bias`` of `--bad-words` random tokens, float32 ``[B, V]``, and presence / frequency
  penalties over the counts of `--context` // 8 random generated tokens, int32 ``[B, V]``):
  4 + 4 more bytes read per logit than codes alone, no bar of their own;
* ``sample_triton`` / ``verify_triton``: without codes, on the Triton stage 1 (on Hopper the
  default table gives every call, with codes or not, the warp-specialized Gluon stage 1 above
  32 truncated rows): the codes' cost in the Triton kernel.

The codes penalize a random context of `--context` tokens per row and ban `--bad-words`
random single tokens (no position-dependent ban: a sampling step's codes are then the slot's
base codes themselves, and ``codes_sample`` times that lookup). Ratios: ``sample_edits / sample``
(the kernels' bar), ``sample_edits / sample_triton`` (against the Triton kernel),
``(sample_edits + codes_sample) / sample`` (the step's), and the same for verification.

    python -m flashspec.bench.edit_cost --batch-sizes 1,16,64 --out bench_out   # GPU
    TRITON_INTERPRET=1 python -m flashspec.bench.edit_cost --quick               # CPU smoke

Writes ``edit_cost.json`` to ``--out`` (device, versions, shapes, date) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from flashspec.bench.cli import package_version, positive_int, positive_ints

QWEN25_INSTRUCT = dict(temperature=0.7, top_k=20, top_p=0.8)
PENALTY = 1.05
TIMINGS = ("sample", "sample_triton", "sample_edits", "codes_sample", "verify", "verify_triton",
           "verify_edits", "codes_verify", "sample_mask", "codes_sample_mask", "verify_mask",
           "codes_verify_mask", "sample_head", "verify_head", "sample_vllm", "verify_vllm")
SOFTCAP = 30.0   # Gemma-2's final_logit_softcapping


def edit_state(batch: int, vocab: int, context: int, bad_words: int, device,
               generator: torch.Generator, additive: bool = False):
    """An `EditState` of `batch` rows: a repetition penalty over a random context of
    `context` tokens and `bad_words` random banned tokens; with `additive`, also a
    ``logit_bias`` of `bad_words` other random tokens and presence / frequency penalties over
    `context` // 8 random generated tokens."""
    from flashspec.generation.additive import AdditiveEdits
    from flashspec.generation.edits import EditRules, EditState

    chosen = torch.randperm(vocab, generator=generator)[:2 * bad_words].tolist()
    rules = EditRules(penalty=PENALTY, banned=tuple(sorted(chosen[:bad_words])))
    vllm = None
    if additive:
        bias = {token: 1.0 + 0.01 * k for k, token in enumerate(chosen[bad_words:])}
        vllm = AdditiveEdits.of_call(bias, 0.5, 0.3, batch, vocab)
    state = EditState(batch, vocab, torch.device(device))
    state.load(rules, torch.randint(0, vocab, (batch, context), generator=generator).to(device),
               vllm)
    if additive:
        generated = torch.randint(0, vocab, (batch, max(context // 8, 1)), generator=generator)
        state.absorb(generated.to(device), torch.ones_like(generated, dtype=torch.bool).to(device))
    return state


def calls(dim: int, vocab: int, batch: int, num_drafts: int, context: int, bad_words: int,
          device: str) -> dict[str, Callable]:
    """The timed calls of one batch size (`TIMINGS`), on bf16 operands."""
    from flashspec import SamplingParams
    from flashspec.generation.allowed import pack
    from flashspec.kernels import default_config, fused_sample, fused_verify

    g = torch.Generator().manual_seed(batch)
    weight = (torch.randn(vocab, dim, generator=g) * dim**-0.5).to(device, torch.bfloat16)
    hidden = (2.0 * torch.randn(batch, num_drafts + 1, dim, generator=g)).to(device, torch.bfloat16)
    params = SamplingParams.create(batch, seed=0, device=device, **QWEN25_INSTRUCT)
    positions = torch.full((batch,), context, dtype=torch.long, device=device)
    drafts = torch.randint(0, vocab, (batch, num_drafts), generator=g).to(device)
    state = edit_state(batch, vocab, context, bad_words, device, g)
    generated = torch.ones(batch, dtype=torch.long, device=device)
    sample_edits, verify_edits = state.sample_edits(generated), state.verify_edits(generated, drafts)
    allowed = torch.rand(batch, num_drafts + 1, vocab, generator=g) < 0.5
    sample_mask = pack(allowed[:, :1]).to(device)
    verify_mask = pack(allowed).to(device)
    mask_sample_edits = state.sample_edits(generated, sample_mask)
    mask_verify_edits = state.verify_edits(generated, drafts, verify_mask)
    vllm = edit_state(batch, vocab, context, bad_words, device, g, additive=True)
    vllm_sample_edits, vllm_verify_edits = vllm.sample_edits(generated), vllm.verify_edits(generated, drafts)
    last = hidden[:, -1].contiguous()
    head = dict(bias=(torch.randn(vocab, generator=g) * 0.1).to(device, torch.bfloat16),
                softcap=SOFTCAP)
    sample_triton = default_config(batch, 2, truncation=True)
    verify_triton = default_config(batch * (num_drafts + 1), 2, truncation=True, verification=True)
    return {
        "sample": partial(fused_sample, last, weight, params, positions),
        "sample_triton": partial(fused_sample, last, weight, params, positions,
                                 config=sample_triton),
        "sample_edits": partial(fused_sample, last, weight, params, positions, edits=sample_edits),
        "codes_sample": partial(state.sample_edits, generated),
        "verify": partial(fused_verify, hidden, weight, drafts, params, positions),
        "verify_triton": partial(fused_verify, hidden, weight, drafts, params, positions,
                                 config=verify_triton),
        "verify_edits": partial(fused_verify, hidden, weight, drafts, params, positions,
                                edits=verify_edits),
        "codes_verify": partial(state.verify_edits, generated, drafts),
        "sample_mask": partial(fused_sample, last, weight, params, positions,
                               edits=mask_sample_edits),
        "codes_sample_mask": partial(state.sample_edits, generated, sample_mask),
        "verify_mask": partial(fused_verify, hidden, weight, drafts, params, positions,
                               edits=mask_verify_edits),
        "codes_verify_mask": partial(state.verify_edits, generated, drafts, verify_mask),
        "sample_head": partial(fused_sample, last, weight, params, positions, **head),
        "verify_head": partial(fused_verify, hidden, weight, drafts, params, positions, **head),
        "sample_vllm": partial(fused_sample, last, weight, params, positions,
                               edits=vllm_sample_edits),
        "verify_vllm": partial(fused_verify, hidden, weight, drafts, params, positions,
                               edits=vllm_verify_edits),
    }


def time_ms(fn: Callable, cuda: bool, rep_ms: float) -> float:
    """Median milliseconds of `fn`: on CUDA its CUDA-graph replay under do_bench, on CPU
    perf_counter around eager calls."""
    fn()  # compiles
    if not cuda:
        times = []
        while len(times) < 3 or sum(times) < rep_ms and len(times) < 50:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The CUDA Graph is empty")   # codes_sample: a lookup
        with torch.cuda.graph(graph):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=rep_ms, return_mode="median")


def run(dim: int, vocab: int, batch_sizes: list[int], num_drafts: int, context: int,
        bad_words: int, rep_ms: float, rounds: int) -> list[dict]:
    cuda = torch.cuda.is_available()
    rows = []
    for batch in batch_sizes:
        print(f"timing D={dim} V={vocab} B={batch} G={num_drafts} ...", file=sys.stderr, flush=True)
        fns = calls(dim, vocab, batch, num_drafts, context, bad_words, "cuda" if cuda else "cpu")
        # Rounds in turn: a call's median moves by about 2% from one timing to the next
        # (clocks), as much as the bars' margins.
        runs = {name: [] for name in TIMINGS}
        for _ in range(rounds):
            for name in TIMINGS:
                runs[name].append(time_ms(fns[name], cuda, rep_ms))
        ms = {name: statistics.median(times) for name, times in runs.items()}
        rows.append({
            "D": dim, "V": vocab, "B": batch, "G": num_drafts, "ms": ms,
            "x_sample": ms["sample_edits"] / ms["sample"],
            "x_sample_triton": ms["sample_edits"] / ms["sample_triton"],
            "x_sample_step": (ms["sample_edits"] + ms["codes_sample"]) / ms["sample"],
            "x_verify": ms["verify_edits"] / ms["verify"],
            "x_verify_triton": ms["verify_edits"] / ms["verify_triton"],
            "x_verify_step": (ms["verify_edits"] + ms["codes_verify"]) / ms["verify"],
            "x_sample_mask_step": (ms["sample_mask"] + ms["codes_sample_mask"]) / ms["sample"],
            "x_verify_mask_step": (ms["verify_mask"] + ms["codes_verify_mask"]) / ms["verify"],
            "x_sample_head": ms["sample_head"] / ms["sample"],
            "x_verify_head": ms["verify_head"] / ms["verify"],
            "x_sample_vllm": ms["sample_vllm"] / ms["sample"],
            "x_verify_vllm": ms["verify_vllm"] / ms["verify"],
        })
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'B':>4} {'G':>2} {'sample':>8} {'+edits':>8} {'x':>6} {'x tt':>6} {'x step':>7} "
          f"{'x mask':>7} {'x head':>7} {'x vllm':>7} {'verify':>8} {'+edits':>8} {'x':>6} "
          f"{'x tt':>6} {'x step':>7} {'x mask':>7} {'x head':>7} {'x vllm':>7}   (ms; x tt: "
          "against the Triton stage 1 without codes; x step: with the making of the codes; "
          "x mask: the step with an allowed-token bitmask too; x head: bias + softcap, no "
          "codes; x vllm: the kernel with codes, logit_bias and presence / frequency penalties)")
    for row in rows:
        ms = row["ms"]
        print(f"{row['B']:>4} {row['G']:>2} {ms['sample']:8.4f} {ms['sample_edits']:8.4f} "
              f"{row['x_sample']:6.3f} {row['x_sample_triton']:6.3f} {row['x_sample_step']:7.3f} "
              f"{row['x_sample_mask_step']:7.3f} {row['x_sample_head']:7.3f} "
              f"{row['x_sample_vllm']:7.3f} {ms['verify']:8.4f} "
              f"{ms['verify_edits']:8.4f} {row['x_verify']:6.3f} {row['x_verify_triton']:6.3f} "
              f"{row['x_verify_step']:7.3f} {row['x_verify_mask_step']:7.3f} "
              f"{row['x_verify_head']:7.3f} {row['x_verify_vllm']:7.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Time the fused kernels with and without logit "
                                                 "edit codes (issue 30's bar).")
    parser.add_argument("--dim", type=positive_int, default=None, help="hidden size (4096)")
    parser.add_argument("--vocab", type=positive_int, default=None, help="vocabulary (151936)")
    parser.add_argument("--batch-sizes", type=lambda t: positive_ints(t, "1,16,64"), default=None,
                        help="comma-separated batch sizes (1,4,16,64)")
    parser.add_argument("--drafts", type=positive_int, default=4, help="drafts per row verified")
    parser.add_argument("--context", type=positive_int, default=None,
                        help="penalized context tokens per row (4096)")
    parser.add_argument("--bad-words", type=positive_int, default=64, help="banned tokens")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="timed ms per call kind")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="timings of each call, in turn with the others (their median)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out"))
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: D=64, V=1000, B in {1, 4}, context 64 (CPU too, with "
                             "TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    quick = args.quick
    dim = args.dim or (64 if quick else 4096)
    vocab = args.vocab or (1000 if quick else 151936)
    batch_sizes = args.batch_sizes or ([1, 4] if quick else [1, 4, 16, 64])
    context = args.context or (64 if quick else 4096)
    rep_ms = 5.0 if quick else args.rep_ms
    if not torch.cuda.is_available() and not quick:
        print("error: no CUDA device (use --quick with TRITON_INTERPRET=1 for a CPU smoke test)",
              file=sys.stderr)
        return 2
    rows = run(dim, vocab, batch_sizes, args.drafts, context, args.bad_words, rep_ms,
               1 if quick else args.rounds)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": {name: package_version(name) for name in ("torch", "triton")},
        "dtype": "bfloat16", "sampling": QWEN25_INSTRUCT, "penalty": PENALTY,
        "context": context, "bad_words": args.bad_words, "rounds": 1 if quick else args.rounds,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "edit_cost.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out / 'edit_cost.json'}")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
