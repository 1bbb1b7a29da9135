"""Where flash's time to first token goes at prompt 2000, against stock: a one-token
generate() of each under torch.profiler (Qwen3-1.7B shape, bf16, CUDA), kernel totals
printed, tables (by GPU time and by CPU time) written to $OUT."""

import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "scripts")
from cold_start import load_pair  # noqa: E402

from flashspec.bench.cold_start import prompt_ids  # noqa: E402


def main() -> None:
    out = Path(os.environ.get("OUT", "."))
    target, _ = load_pair("qwen3", "cuda")
    ids = prompt_ids(1, 2000, target.config.vocab_size, "cuda")
    for name, extra in (("stock", {}), ("flash", {"sampler": "flash"})):
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, **extra)
        for _ in range(3):
            target.generate(ids, **kwargs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            target.generate(ids, **kwargs)
            torch.cuda.synchronize()
        averages = prof.key_averages()
        (out / f"ttft_{name}.txt").write_text(
            averages.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60) + "\n"
            + averages.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        print(f"{name}: {len(kernels)} kernels, {sum(e.device_time for e in kernels) / 1e3:.1f} ms")


if __name__ == "__main__":
    main()
