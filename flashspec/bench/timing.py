"""Timing for the benchmarks: seconds of calls with the device synchronized around each,
the device's copy bandwidth, the GPU time of the engine's captured steps as a call replays
them, and the tok/s those step times allow."""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Callable

import torch

from flashspec.generation.engine import cached_engine
from flashspec.generation.heads import output_head


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


class StepTimer:
    """GPU time of each captured step a call replays: the engine (`Engine.step_timer`)
    replays every graph between two CUDA events, so the times are those of the call's own
    steps, in the state the engine prepared for each (a graph replayed after its call could
    find no room for its writes). Recording adds a few microseconds of host work per step."""

    def __init__(self):
        self.events: dict = {}            # step key -> [(start, end)]

    def replay(self, key, graph: "torch.cuda.CUDAGraph") -> None:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        self.events.setdefault(key, []).append((start, end))

    def median_ms(self) -> dict:
        """Median GPU milliseconds of each step key's replays."""
        torch.cuda.synchronize()
        return {key: statistics.median(start.elapsed_time(end) for start, end in pairs)
                for key, pairs in self.events.items()}


def step_ms(target, generate: Callable, engine_sampler: str, verify_width: int) -> dict | None:
    """GPU time of the engine's captured steps in one more call of `generate` (warm: its
    graphs exist), each step the median of its replays (`StepTimer`); None without graphs.
    Plain decoding gives ``plain``; drafts give ``draft_round`` (the drafter's steps for
    `verify_width` drafts, in order: an assistant's ``draft_first`` and ``verify_width - 1``
    of its ``draft_next``, an EAGLE-3 head's ``eagle3_first`` and ``eagle3_next``, prompt
    lookup's one step), its first step and one of the later ones (``draft_first``,
    ``draft_next``), and ``verify``."""
    engine = cached_engine(output_head(target, "model").decoder)
    if engine is None or not engine.graphs_enabled or engine.sampler_kind != engine_sampler:
        return None
    engine.step_timer = timer = StepTimer()
    try:
        generate()
    finally:
        engine.step_timer = None
    times = timer.median_ms()
    verify = times.get(("verify", verify_width))
    if verify is None:
        return {"plain": times["plain"]} if "plain" in times else None
    for slot in engine.slots.values():
        for attached in slot.drafters.values():
            keys = [key for key, _ in attached.steps(verify_width)]
            if keys and all(key in times for key in keys):
                return {"draft_first": times[keys[0]],
                        "draft_next": times[keys[1]] if len(keys) > 1 else None,
                        "draft_round": sum(times[key] for key in keys), "verify": verify}
    return None


def expected_tokens_per_round(acceptance: float, num_drafts: int) -> float:
    """Tokens a row emits per verification of `num_drafts` drafts when each draft is accepted
    with probability `acceptance` given the ones before it: sum of a^i for i = 0..G."""
    if acceptance == 1.0:
        return num_drafts + 1.0
    return (1.0 - acceptance ** (num_drafts + 1)) / (1.0 - acceptance)


def expected_tok_s(steps: dict, batch_size: int, verify_width: int,
                   measured_tokens_per_round: float,
                   assumed_tokens_per_round: float | None = None) -> dict:
    """tok/s the step graphs allow: at acceptance 1, at the run's tokens per round, and
    (computed, not measured) at `assumed_tokens_per_round` (a published acceptance length)."""
    if "plain" in steps:
        per_second = batch_size * 1e3 / steps["plain"]
        return {"all_accepted": per_second, "at_measured_acceptance": per_second,
                "at_assumed_acceptance": None}
    rounds_per_second = 1e3 / (steps["draft_round"] + steps["verify"])
    assumed = (None if assumed_tokens_per_round is None
               else batch_size * rounds_per_second * min(assumed_tokens_per_round,
                                                         verify_width + 1.0))
    return {"all_accepted": batch_size * rounds_per_second
            * expected_tokens_per_round(1.0, verify_width),
            "at_measured_acceptance": batch_size * rounds_per_second * measured_tokens_per_round,
            "at_assumed_acceptance": assumed}
