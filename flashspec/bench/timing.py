"""Timing for the benchmarks: seconds of calls with the device synchronized around each,
the device's copy bandwidth, the GPU time of the engine's captured step graphs, and the
tok/s those step times allow."""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Callable

import torch

from flashspec.generation.engine import cached_engine
from flashspec.generation.heads import output_head


GRAPH_REPLAYS = 20
GRAPH_TRIALS = 3
COPY_REPS = 5
GPU_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 64 << 20


def _synchronize(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def timed_calls(generate: Callable, reps: int, cuda: bool) -> tuple[float, list[float], object]:
    """Seconds of a first call (the engine's compilation and graph captures happen
    there) and of each of `reps` calls after it, and the last output."""
    seconds = []
    for _ in range(reps + 1):
        _synchronize(cuda)
        start = time.perf_counter()
        output = generate()
        _synchronize(cuda)
        seconds.append(time.perf_counter() - start)
    return seconds[0], seconds[1:], output


def copy_bandwidth_gbps(device: str) -> float:
    """GB/s (read + written bytes) of a large device-to-device copy, median of COPY_REPS."""
    cuda = device == "cuda"
    nbytes = GPU_COPY_BYTES if cuda else CPU_COPY_BYTES
    # ones, not empty: untouched CPU pages would read as the shared zero page, too fast.
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    destination = torch.empty_like(source)
    _, seconds, _ = timed_calls(partial(destination.copy_, source), COPY_REPS, cuda)
    return 2 * nbytes / statistics.median(seconds) / 1e9


def replay_ms(graphs: list) -> float:
    """GPU milliseconds of one replay of `graphs` in order (median of GRAPH_TRIALS runs of
    GRAPH_REPLAYS)."""
    trials = []
    for _ in range(GRAPH_TRIALS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(GRAPH_REPLAYS):
            for graph in graphs:
                graph.replay()
        torch.cuda.synchronize()
        trials.append((time.perf_counter() - start) * 1e3 / GRAPH_REPLAYS)
    return statistics.median(trials)


def step_ms(target, engine_sampler: str, verify_width: int) -> dict | None:
    """GPU time of the engine's captured steps for the call just made, None without graphs."""
    engine = cached_engine(output_head(target, "model").decoder)
    if engine is None or not engine.graphs_enabled or engine.sampler_kind != engine_sampler:
        return None
    graphs = engine.last_call_graphs
    if ("verify", verify_width) not in graphs:
        return {"plain": replay_ms([graphs["plain"]])} if "plain" in graphs else None
    verify = graphs[("verify", verify_width)]
    lookup = graphs.get(("lookup", verify_width))
    if lookup is not None:
        return {"draft_first": None, "draft_next": None, "draft_round": replay_ms([lookup]),
                "verify": replay_ms([verify])}
    if "draft_first" not in graphs or (verify_width > 1 and "draft_next" not in graphs):
        return None
    # draft_next alone would write past the draft buffer (its column count only grows);
    # draft_first resets it, so a whole round is replayed and draft_next derived from it.
    first = replay_ms([graphs["draft_first"]])
    later = [graphs["draft_next"]] * (verify_width - 1) if verify_width > 1 else []
    round_ms = replay_ms([graphs["draft_first"]] + later)
    return {"draft_first": first,
            "draft_next": (round_ms - first) / (verify_width - 1) if verify_width > 1 else None,
            "draft_round": round_ms, "verify": replay_ms([verify])}


def expected_tokens_per_round(acceptance: float, num_drafts: int) -> float:
    """Tokens a row emits per verification of `num_drafts` drafts when each draft is accepted
    with probability `acceptance` given the ones before it: sum of a^i for i = 0..G."""
    if acceptance == 1.0:
        return num_drafts + 1.0
    return (1.0 - acceptance ** (num_drafts + 1)) / (1.0 - acceptance)


def expected_tok_s(steps: dict, batch_size: int, verify_width: int,
                   measured_tokens_per_round: float) -> dict:
    """tok/s the step graphs allow: at acceptance 1, and at the run's tokens per round."""
    if "plain" in steps:
        per_second = batch_size * 1e3 / steps["plain"]
        return {"all_accepted": per_second, "at_measured_acceptance": per_second}
    rounds_per_second = 1e3 / (steps["draft_round"] + steps["verify"])
    return {"all_accepted": batch_size * rounds_per_second
            * expected_tokens_per_round(1.0, verify_width),
            "at_measured_acceptance": batch_size * rounds_per_second * measured_tokens_per_round}
