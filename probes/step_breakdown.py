"""Where a captured decode step's GPU time goes, by kernel class (issue 46).

For each pair (Qwen3-1.7B + 0.6B, Llama-3.1-8B + 3.2-1B shapes; random peaked bf16 weights),
or a random-init shape with MTP layers (``mtp:<shape>``, e.g. ``mtp:qwen3.5-9b-mtp``; issue 47),
B rows, a random 128-token prompt, 128 new tokens: a warm plain call and a warm drafted call
(G drafts, an assistant or the model's MTP layer). For each captured step of those calls (plain, draft_first,
draft_next, verify): its GPU time (CUDA events around each of the call's replays, median),
and, in one more call with each replay alone on the GPU inside a profiler range, the time
of every kernel inside it, summed by class (GEMMs, attention, the fused LM head,
KV writes, the compiled layers' fused elementwise kernels, eager ATen kernels: the mask,
index and commit work around the layers). Also the wall time per token of the plain call
against one plain replay (host work the GPU waits for), and the floor: the step's weight
bytes over the copy bandwidth measured in the same run.

    PYTHONPATH=. python probes/step_breakdown.py --pairs qwen3,llama --out $OUT
    PYTHONPATH=. python probes/step_breakdown.py --pairs mtp:qwen3.5-9b-mtp --drafts 4 --out $OUT

Prints one table per pair; writes step_breakdown.json under --out.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import re
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import flashspec
from flashspec.bench.pairs import PAIRS, load_pair, weight_bytes
from flashspec.bench.random_init import random_model, random_mtp
from flashspec.bench.timing import StepTimer, copy_bandwidth_gbps
from flashspec.generation.engine import cached_engine
from flashspec.generation.heads import output_head

# First match wins: kernel-name patterns of each class.
CLASSES = [
    ("lm_head", r"lm_head_|verify_finalize|shard_summary"),
    ("gemm", r"gemm|gemv|nvjet|cutlass|xmma|splitK|cublas|triton_tem|_mm_|matmul"),
    ("attention", r"flash|fmha|attention|sdpa|cudnn"),
    ("kv_write", r"index_copy|indexFuncLargeIndex|index_put|scatter|indexing_backward"),
    ("layer_fused", r"^triton_(poi|red|per)_"),
    ("eager_aten", r"elementwise|reduce_kernel|Reduce|index|gather|copy|fill|cat|arange|"
                   r"compare|where|cumsum|scan|sort|radix"),
]

def kernel_class(name: str) -> str:
    for label, pattern in CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def step_name(key) -> str:
    return key if isinstance(key, str) else "_".join(map(str, key))


class SyncedSteps(StepTimer):
    """Each replay alone on the GPU (synchronized before and after) inside a profiler range
    named for its step, so that every kernel of the profile falls in its step's range."""

    def replay(self, key, graph) -> None:
        torch.cuda.synchronize()
        with record_function(f"step:{step_name(key)}"):
            graph.replay()
            torch.cuda.synchronize()


def kernels_by_step(generate) -> dict:
    """One call of `generate` under torch.profiler with `SyncedSteps`: per step, GPU ms per
    replay and kernels per replay by class, and its top kernels."""
    engine_steps = collections.Counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate(SyncedSteps())
    events = prof.events()
    cpu = torch.autograd.DeviceType.CPU
    ranges = sorted((e.time_range.start, e.time_range.end, e.name[5:]) for e in events
                    if e.name.startswith("step:") and e.device_type == cpu)
    for _, _, name in ranges:
        engine_steps[name] += 1
    starts = [start for start, _, _ in ranges]
    by_class = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0]))
    by_name = collections.defaultdict(lambda: collections.defaultdict(float))
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CUDA or event.name.startswith("step:"):
            continue                      # the ranges' own annotations on the GPU timeline
        at = bisect.bisect_right(starts, event.time_range.start) - 1
        if at < 0 or event.time_range.start > ranges[at][1]:
            continue                      # the prefill's and the host's eager work
        step = ranges[at][2]
        lowered = event.name.lower()
        label = "eager_aten" if "memcpy" in lowered or "memset" in lowered else kernel_class(event.name)
        by_class[step][label][0] += event.device_time / 1e3
        by_class[step][label][1] += 1
        by_name[step][event.name[:90]] += event.device_time / 1e3
    result = {}
    for step, count in engine_steps.items():
        classes = {label: {"ms": round(v[0] / count, 4), "kernels": round(v[1] / count, 1)}
                   for label, v in sorted(by_class[step].items(), key=lambda kv: -kv[1][0])}
        top = sorted(by_name[step].items(), key=lambda kv: -kv[1])[:12]
        result[step] = {"replays": count, "kernel_ms": round(sum(c["ms"] for c in classes.values()), 4),
                        "classes": classes, "top": [(n, round(ms / count, 4)) for n, ms in top]}
    return result


def timed_generate(target, decoder, ids, kwargs: dict, timer=None) -> float:
    """Milliseconds of ``target.generate(ids, **kwargs)``, its engine's replays through
    `timer` if given (the engine exists after the first call)."""
    if timer is not None:
        cached_engine(decoder).step_timer = timer
    try:
        torch.cuda.synchronize()
        started = time.perf_counter()
        target.generate(ids, **kwargs)
        torch.cuda.synchronize()
        return (time.perf_counter() - started) * 1e3
    finally:
        if cached_engine(decoder) is not None:
            cached_engine(decoder).step_timer = None


def load(pair: str, drafts: int) -> tuple:
    """The target, the drafted call's own arguments, and the bytes one draft step reads."""
    if pair.startswith("mtp:"):
        target = flashspec.wrap(random_model(pair[4:], "cuda", torch.bfloat16))
        mtp = random_mtp(target)
        head = target.get_output_embeddings().weight
        draft_bytes = weight_bytes(mtp.layers) + head.numel() * head.element_size()
        return target, dict(use_mtp=True, num_assistant_tokens=drafts), draft_bytes
    target, draft, _ = load_pair(PAIRS[pair], "cuda", torch.bfloat16, "peaked")
    return target, dict(assistant_model=draft, num_assistant_tokens=drafts), weight_bytes(draft)


def breakdown(pair: str, batch: int, drafts: int, prompt_length: int, gbps: float) -> dict:
    target, drafted, draft_bytes = load(pair, drafts)
    decoder = output_head(target, "model").decoder
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, target.config.vocab_size, (batch, prompt_length),
                        generator=generator).cuda()
    common = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None,
                  sampler="flash", max_new_tokens=128)
    drafted = dict(common, **drafted, num_assistant_tokens_schedule="constant")
    result = {"pair": pair, "batch": batch, "drafts": drafts,
              "target_weight_bytes": weight_bytes(target),
              "draft_weight_bytes": draft_bytes, "steps": {}}

    def call(kwargs, timer=None):
        return timed_generate(target, decoder, ids, kwargs, timer)

    for kwargs in (common, drafted):
        call(kwargs)                                      # compiles and captures
        wall = call(kwargs)
        timer = StepTimer()
        call(kwargs, timer)
        profiled = kernels_by_step(lambda synced: call(kwargs, synced))
        for key, ms in timer.median_ms().items():
            name = step_name(key)
            result["steps"][name] = {"gpu_ms": ms, **profiled.get(name, {})}
        if kwargs is common:
            result["plain_wall_ms_per_token"] = wall / common["max_new_tokens"]
    weights = {"plain": result["target_weight_bytes"],
               f"verify_{drafts}": result["target_weight_bytes"]}
    for name, step in result["steps"].items():
        # A drafter's steps: "<role>_first" and "<role>_next" (draft, eagle, mtp).
        read = weights.get(name, result["draft_weight_bytes"]
                           if name.endswith(("_first", "_next")) else None)
        if read is not None:
            step["floor_ms"] = read / (gbps * 1e9) * 1e3
            step["floor_ratio"] = step["gpu_ms"] / step["floor_ms"]
    if "plain" in result["steps"]:
        result["plain_host_ms_not_overlapped"] = (result["plain_wall_ms_per_token"]
                                                  - result["steps"]["plain"]["gpu_ms"])
    del target, drafted
    torch.cuda.empty_cache()
    return result


def print_table(result: dict) -> None:
    print(f"\n{result['pair']}, B={result['batch']}: plain wall {result['plain_wall_ms_per_token']:.3f} "
          f"ms/token, {result.get('plain_host_ms_not_overlapped', 0.0):.3f} ms of it host time "
          "not overlapped")
    labels = [label for label, _ in CLASSES] + ["other"]
    print(f"{'step':<14}{'gpu ms':>8}{'floor':>7}" + "".join(f"{label[:10]:>11}" for label in labels))
    for name, step in result["steps"].items():
        classes = step.get("classes", {})
        ratio = f"{step['floor_ratio']:.2f}x" if "floor_ratio" in step else "-"
        print(f"{name:<14}{step['gpu_ms']:>8.3f}{ratio:>7}" + "".join(
            f"{classes.get(label, {}).get('ms', 0.0):>11.3f}" for label in labels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="qwen3,llama")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--drafts", type=int, default=5)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    gbps = copy_bandwidth_gbps("cuda")
    report = {"device": torch.cuda.get_device_name(), "copy_gbps": gbps, "torch": torch.__version__,
              "pairs": [breakdown(p, args.batch, args.drafts, args.prompt_length, gbps)
                        for p in args.pairs.split(",")]}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "step_breakdown.json").write_text(json.dumps(report, indent=1))
    print(f"{report['device']}, copy {gbps:.0f} GB/s")
    for result in report["pairs"]:
        print_table(result)


if __name__ == "__main__":
    main()
