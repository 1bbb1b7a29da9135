"""Issue 50's first question: why did capturing a tensor-parallel model's steps hang (the
2-rank test unfinished in 420 s, 2026-11-26)? docs/notes/tp_capture.md ranks the
explanations; this tells them apart. Under torchrun, one GPU per rank:

    torchrun --nproc-per-node 2 probes/tp_capture.py [--release]

Each rank loads the tests' tiny Llama with tp_plan="auto" and the same model whole, turns the
engine's graphs on for the tensor-parallel one (as ace36e2 did: the steps compiled and
captured, in the thread-local capture mode), and runs calls (greedy, sampled, truncated, prompt
lookup), each timed and checked against the whole model's tokens. Then it destroys the
process group with the engines alive, or with `--release` after dropping them. Each phase
prints when it ends; faulthandler dumps every rank's stacks if the run outlasts --deadline.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from transformers.distributed import DistributedConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import flashspec  # noqa: E402
from flashspec.generation import engine as engine_module  # noqa: E402
from test_tensor_parallel import CASES, MASK, PROMPTS, _save_tiny  # noqa: E402


def graphs_on(monkey_engine) -> None:
    """Engines made from now on capture tensor-parallel steps (ace36e2's change)."""
    init, capture = monkey_engine.__init__, torch.cuda.graph

    def with_graphs(self, head):
        init(self, head)
        if self.device.type == "cuda" and not head.spread and not self.graphs_enabled:
            self.graphs_enabled = True
            self.pool = torch.cuda.graph_pool_handle()
            self._pool_anchor = engine_module._anchor(self.pool, self.device)

    def thread_local(graph, pool=None, **kwargs):
        return capture(graph, pool=pool, capture_error_mode="thread_local")

    monkey_engine.__init__ = with_graphs
    engine_module.torch.cuda.graph = thread_local


def say(rank: int, *parts) -> None:
    print(f"[rank {rank} {time.strftime('%H:%M:%S')}]", *parts, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", action="store_true",
                        help="drop the engines (and collect) before destroying the group")
    parser.add_argument("--deadline", type=float, default=240.0,
                        help="seconds after which every rank dumps its stacks")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    faulthandler.dump_traceback_later(args.deadline, exit=True)
    dist.init_process_group("nccl")
    folder = os.path.join(tempfile.gettempdir(), "tp_capture_probe")
    if rank == 0:
        _save_tiny(f"{folder}/target", 0, 2)
    dist.barrier()
    split = flashspec.from_pretrained(f"{folder}/target", dtype=torch.float32,
                                      distributed_config=DistributedConfig(tp_plan="auto"))
    whole = flashspec.from_pretrained(f"{folder}/target", dtype=torch.float32,
                                      device_map=f"cuda:{rank}")
    graphs_on(engine_module.Engine)
    ids, mask = PROMPTS.cuda(), MASK.cuda()
    for name in ("greedy", "sampled", "truncated", "prompt lookup", "greedy", "sampled"):
        kwargs = dict(CASES[name], sampler="flash", seed=7, max_new_tokens=12,
                      attention_mask=mask)
        started = time.monotonic()
        out = split.generate(ids, **kwargs)
        seconds = time.monotonic() - started
        same = torch.equal(out, whole.generate(ids, **kwargs))
        engine = engine_module.cached_engine(split.get_decoder())
        say(rank, f"{name}: {seconds:.2f} s, same tokens as one GPU: {same}, graphs "
                  f"{len(engine.graphs)}, events {[e.kind for e in engine.events][-6:]}")
    if args.release:
        engine_module.drop_engine(split.get_decoder())
        gc.collect()
        torch.cuda.synchronize()
        say(rank, "engines dropped")
    say(rank, "destroying the process group")
    dist.destroy_process_group()
    say(rank, "destroyed")


if __name__ == "__main__":
    main()
