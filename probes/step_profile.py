"""Where a warm plain step's time goes: B=1, Qwen3-1.7B shape, bf16, CUDA.

Per prompt length: wall time per token of a warm 256-token call against one replay of its
plain-step graph (the difference is host work the GPU waits for); then a 64-token call under
torch.profiler: kernels per token and the kernels that take the time.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "scripts")
from cold_start import load_pair  # noqa: E402

from flashspec.bench.cold_start import prompt_ids  # noqa: E402
from flashspec.generation.engine import cached_engine  # noqa: E402
from flashspec.generation.heads import output_head  # noqa: E402


def seconds(run) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    out = Path(os.environ.get("OUT", "."))
    target, _ = load_pair("qwen3", "cuda")
    decoder = output_head(target, "model").decoder
    report = {}
    for length in (128, 2000):
        ids = prompt_ids(1, length, target.config.vocab_size, "cuda")
        kwargs = dict(sampler="flash", max_new_tokens=256, do_sample=False,
                      attention_mask=torch.ones_like(ids))
        for _ in range(2):
            target.generate(ids, **kwargs)
        wall = seconds(lambda: target.generate(ids, **kwargs))
        graph = cached_engine(decoder).last_call_graphs["plain"]
        replay = seconds(lambda: [graph.replay() for _ in range(100)]) / 100
        report[length] = {"ms_per_token": wall / 256 * 1e3, "graph_replay_ms": replay * 1e3}
        print(f"prompt {length}: {report[length]}")
    ids = prompt_ids(1, 128, target.config.vocab_size, "cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        target.generate(ids, sampler="flash", max_new_tokens=64, do_sample=False,
                        attention_mask=torch.ones_like(ids))
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"kernels per token: {len(kernels) / 64:.0f}, kernel ms per token: "
          f"{sum(e.device_time for e in kernels) / 1e3 / 64:.3f}")
    (out / "step_profile.txt").write_text(table + "\n" + json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
