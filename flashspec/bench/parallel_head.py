"""The vocab-parallel LM-head step against all-gathering the logits (issue 32's bar), under
torchrun, one GPU per rank.

Each rank holds its contiguous shard ``[V_r, D]`` of a random LM head and the same hidden
states ``[B, D]``. Two ways to one token per row:

* ``flash``: `flashspec.parallel` with the fused kernels (stage 1 over the shard, a per-shard
  stage 2 writing each row's summary), one all-gather of the summaries, the merge on every
  rank; ``complete=False`` and no checks, the engine's arguments (uncertified truncated rows
  flagged, their share reported as ``flagged_rows``);
* ``gathered``: what a stock stack does (vLLM's tensor-parallel logits): the shard's logits
  in the model's dtype (cuBLAS), one all-gather of them, then sampling over the vocabulary
  with torch ops as vLLM's torch sampler does (float32, temperature, top-k by `topk`,
  softmax, the exponential race ``argmax(p / q)``; greedy rows `argmax`).

Both are timed the same way, eagerly and captured in a CUDA graph (NCCL collectives
captured with it) and replayed; where capture fails, the eager time stands for both
(reported as such). ``speedup`` = gathered / flash, captured (as the engine runs
tensor-parallel steps); ``eager_speedup`` the same eagerly.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.distributed as dist

from flashspec import parallel
from flashspec.params import SamplingParams

# The settings timed: greedy, plain sampling, and a top-k (whose k + 1 candidates per rank
# certify every row).
MODES = {"greedy": dict(do_sample=False), "sample": dict(temperature=1.0, top_k=0),
         "top-k 50": dict(temperature=0.7, top_k=50)}
REPLAYS, TRIALS, EAGER_REPS = 20, 5, 20


def gathered_step(hidden: torch.Tensor, weight: torch.Tensor, params: SamplingParams,
                  shards: parallel.VocabShards) -> Callable:
    """The all-gather baseline's step: a function of no arguments returning the tokens (its
    noise from torch's default generator, which a CUDA graph can hold)."""
    greedy = params.is_greedy
    temperature = torch.where(greedy, 1.0, params.temperature.float())[:, None]
    top_k = int(params.max_top_k) if params.any_top_k else 0
    sampled = not bool(greedy.all())
    noise = torch.empty(hidden.shape[0], shards.vocab_size, device=hidden.device)

    def step():
        logits = parallel.exchange.all_gather_vocab(hidden @ weight.T, shards)
        if not sampled:
            return logits.argmax(dim=-1)
        scores = logits.float() / temperature
        if top_k:
            kth = scores.topk(top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = scores.softmax(dim=-1)
        race = probs / noise.exponential_()
        return torch.where(greedy, logits.argmax(dim=-1), race.argmax(dim=-1))
    return step


def flash_step(hidden: torch.Tensor, weight: torch.Tensor, params: SamplingParams,
               shards: parallel.VocabShards) -> Callable:
    """flashspec's step, with the engine's arguments: a function of no arguments."""
    positions = torch.arange(hidden.shape[0], device=hidden.device) + 100
    if bool(params.all_greedy):
        return lambda: parallel.argmax(hidden, weight, shards=shards, check=False).tokens
    return lambda: parallel.sample(hidden, weight, params, positions, shards=shards, check=False,
                                   complete=False)


def time_step(step: Callable) -> dict:
    """Microseconds per step: replayed from a CUDA graph (``us``; eager where capture fails,
    said in ``timing``) and run eagerly (``eager_us``: what a step costs where nothing is
    captured), eager first (a failed capture can
    leave the device's state unlike a fresh process's)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    eager_us = _median_us(step, EAGER_REPS)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    except Exception as error:  # noqa: BLE001 (reported, then timed eagerly)
        torch.cuda.synchronize()
        how = f"eager ({type(error).__name__}: {error})"[:200]
        return {"us": eager_us, "eager_us": eager_us, "timing": how}
    return {"us": _median_us(graph.replay, REPLAYS), "eager_us": eager_us, "timing": "graph"}


def _median_us(run: Callable, reps: int) -> float:
    """The median over `TRIALS` of the microseconds per call of `reps` calls of `run`, every
    rank (in a process group) starting together."""
    trials = []
    for _ in range(TRIALS):
        if dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            run()
        end.record()
        torch.cuda.synchronize()
        trials.append(1e3 * start.elapsed_time(end) / reps)
    return statistics.median(trials)


def run(batch_sizes: list[int], dim: int, vocab_size: int, dtype: torch.dtype,
        modes: dict = MODES) -> list[dict]:
    """One row per (mode, batch size) with both steps' times, on this rank's GPU (every rank
    calls; each returns the same rows, timed on its own GPU)."""
    device = torch.device("cuda", torch.cuda.current_device())
    shards = parallel.VocabShards.chunked(vocab_size)
    generator = torch.Generator(device).manual_seed(1234 + shards.rank)
    weight = (torch.randn(shards.size, dim, generator=generator, device=device)
              / dim**0.5).to(dtype)
    rows = []
    for batch in batch_sizes:
        # The same hidden states on every rank (a tensor-parallel model's final norm output).
        hidden = torch.randn(batch, dim, generator=torch.Generator(device).manual_seed(batch),
                             device=device).to(dtype) * 2
        # What both steps must at least spend: the shard's logits by cuBLAS, the weight read.
        read_us = time_step(lambda: hidden @ weight.T)["us"]
        for mode, settings in modes.items():
            params = SamplingParams.create(batch, seed=0, device=device, **settings)
            layout = parallel.summary_layout("argmax" if params.all_greedy else "sample",
                                             shards, params)
            flash = flash_step(hidden, weight, params, shards)
            out = flash()
            flagged = (0.0 if params.all_greedy else
                       float((out.status != 0).float().mean()))
            row = {"mode": mode, "batch_size": batch, "summary_bytes_per_row":
                   layout.bytes_per_row, "gathered_bytes_per_row":
                   shards.size * torch.finfo(dtype).bits // 8, "flagged_rows": flagged}
            timed = {"flash": time_step(flash),
                     "gathered": time_step(gathered_step(hidden, weight, params, shards))}
            for name, result in timed.items():
                row[f"{name}_us"] = result["us"]
                row[f"{name}_eager_us"] = result["eager_us"]
                row[f"{name}_timing"] = result["timing"]
            row["read_us"] = read_us
            row["speedup"] = row["gathered_us"] / row["flash_us"]
            # What each adds past the read (issue 50's bar at small B: flash's at most half).
            row["past_read_ratio"] = ((row["flash_us"] - read_us)
                                      / max(row["gathered_us"] - read_us, 1e-9))
            row["eager_speedup"] = row["gathered_eager_us"] / row["flash_eager_us"]
            rows.append(row)
    return rows
