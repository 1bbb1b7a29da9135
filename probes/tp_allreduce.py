"""Where a tensor-parallel decode step's time goes, and what a one-shot all-reduce would save
(issue 50). Under torchrun, one process per GPU:

1. Collectives alone: CUDA graphs of 64 all-reduces of ``[rows, 4096]`` bf16 (a decode
   step's count for a 32-layer model: attention and MLP outputs), replayed; microseconds per
   all-reduce for NCCL (``dist.all_reduce``, what transformers' row-wise layers call), and
   torch's symmetric-memory one-shot and two-shot all-reduces (peer-to-peer loads over NVLink,
   no multicast); whether each gives every rank the same values, and NCCL's.
2. The LM head's exchange alone: CUDA graphs of 64 all-gathers of each rank's per-row
   summary words (``all_gather_into_tensor``, as `flashspec.parallel.exchange` sends them) at
   bytes per row from a plain row's to a truncated row's (top-k 50: 432) and half that (a
   two-round scheme's first round): what fewer bytes would save against a second round.
3. A tensor-parallel Llama-3.1-8B-shaped model's captured plain step (random bf16 weights,
   B = 1, flashspec's engine): its GPU time by kernel class, collectives apart
   (`step_breakdown.kernels_by_step` with each replay alone).

    torchrun --nproc-per-node 2 probes/tp_allreduce.py --out $OUT

Prints rank 0's tables; writes tp_allreduce.json under --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

import step_breakdown
from flashspec.bench.pairs import PairSpec, load_pair, tensor_parallel_run
from flashspec.generation.heads import output_head

HIDDEN = 4096
REDUCES = 64


def _graph_of(fn, reps: int = REDUCES) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(reps):
            fn()
    return graph


def _us_per_reduce(graph: torch.cuda.CUDAGraph, replays: int = 20) -> float:
    graph.replay()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * REDUCES)


def collectives(rows_list: list[int]) -> list[dict]:
    group = dist.group.WORLD
    name = group.group_name
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    most = max(rows_list) * HIDDEN
    buffer = symm_mem.empty(most, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(buffer, name)
    results = []
    for rows in rows_list:
        generator = torch.Generator(device).manual_seed(1000 + rank)
        x = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16, generator=generator)
        nccl_out = x.clone()
        shot = buffer[: rows * HIDDEN].view(rows, HIDDEN)

        def nccl():
            nccl_out.copy_(x)
            dist.all_reduce(nccl_out, group=group)

        one_out = torch.empty_like(x)

        def one_shot():
            # The symmetric buffer of the input's size (a view of the rendezvoused one).
            one_out.copy_(torch.ops.symm_mem.one_shot_all_reduce_copy(shot, x, "sum", name))

        def two_shot():
            shot.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_(shot, "sum", name)

        # Each includes one copy of x, as a row-wise layer's output would need.
        row = {"rows": rows, "bytes": x.nbytes}
        outputs = {}
        for label, fn, out in (("nccl", nccl, nccl_out), ("one_shot", one_shot, one_out),
                               ("two_shot", two_shot, shot)):
            try:
                graph = _graph_of(fn)
                row[f"{label}_us"] = round(_us_per_reduce(graph), 2)
                graph.replay()
                torch.cuda.synchronize()
                outputs[label] = out.clone()
            except Exception as error:  # report, and go on with the others
                row[f"{label}_error"] = f"{type(error).__name__}: {error}"[:300]
        for label, value in outputs.items():
            gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, value)
            row[f"{label}_same_on_ranks"] = all(torch.equal(g, gathered[0]) for g in gathered)
            if label != "nccl" and "nccl" in outputs:
                row[f"{label}_equals_nccl"] = bool(torch.equal(value, outputs["nccl"]))
        results.append(row)
    return results


def gathers(rows_list: list[int], row_bytes: list[int]) -> list[dict]:
    """Microseconds per all-gather of `row_bytes` int32 words per row from each rank."""
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    results = []
    for rows in rows_list:
        for size in row_bytes:
            words = torch.zeros(rows, size // 4, dtype=torch.int32, device=device)
            gathered = torch.empty(world * rows, size // 4, dtype=torch.int32, device=device)

            def gather():
                dist.all_gather_into_tensor(gathered, words)

            results.append({"rows": rows, "bytes_per_row": size,
                            "us": round(_us_per_reduce(_graph_of(gather)), 2)})
    return results


def tp_step(shape: str, batch: int) -> dict:
    step_breakdown.CLASSES.insert(0, ("collective", r"nccl|all_reduce|allreduce|one_shot|two_shot"))
    target, _, description = load_pair(PairSpec(shape, shape, None, True), "cuda",
                                       torch.bfloat16, "peaked", tensor_parallel=True)
    decoder = output_head(target, "model").decoder
    ids = torch.randint(1, target.config.vocab_size, (batch, 128),
                        generator=torch.Generator().manual_seed(0)).cuda()
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None,
                  sampler="flash", max_new_tokens=64)

    def call(timer=None):
        return step_breakdown.timed_generate(target, decoder, ids, kwargs, timer)

    call()
    wall = call()
    timer = step_breakdown.StepTimer()
    call(timer)
    profiled = step_breakdown.kernels_by_step(call)
    steps = {step_breakdown.step_name(k): {"gpu_ms": ms, **profiled.get(step_breakdown.step_name(k), {})}
             for k, ms in timer.median_ms().items()}
    return {"shape": shape, "batch": batch, "wall_ms_per_token": wall / 64,
            "weight_bytes_per_rank": description["target_weight_bytes_per_rank"], "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,40,1024")
    parser.add_argument("--gather-rows", default="1,8,64")
    parser.add_argument("--gather-bytes", default="32,216,432")
    parser.add_argument("--skip-step", action="store_true",
                        help="the collectives alone, not the model's step")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    with tensor_parallel_run("cuda"):
        rank = dist.get_rank()
        report = {"device": torch.cuda.get_device_name(), "world_size": dist.get_world_size(),
                  "collectives": collectives([int(r) for r in args.rows.split(",")])}
        report["gathers"] = gathers([int(r) for r in args.gather_rows.split(",")],
                                    [int(b) for b in args.gather_bytes.split(",")])
        if rank == 0:
            for row in report["collectives"] + report["gathers"]:
                print(json.dumps(row), flush=True)
        report["tp_step"] = None if args.skip_step else tp_step(args.shape, args.batch)
        if rank == 0 and args.skip_step:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "tp_allreduce.json").write_text(json.dumps(report, indent=1))
        elif rank == 0:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "tp_allreduce.json").write_text(json.dumps(report, indent=1))
            step = report["tp_step"]
            print(f"{step['shape']} B={step['batch']}: wall {step['wall_ms_per_token']:.3f} ms/token")
            for name, s in step["steps"].items():
                print(f"  {name}: {s['gpu_ms']:.3f} ms;", ", ".join(
                    f"{label} {c['ms']:.3f} ({c['kernels']:.0f})"
                    for label, c in s.get("classes", {}).items()))
                for kernel, ms in s.get("top", [])[:8]:
                    print(f"      {ms:.4f} {kernel}")


if __name__ == "__main__":
    main()
