"""What compiling and capturing a device_map model's steps could give, measured on one GPU
(issue 50): a random Llama-3.1-8B (bf16) with accelerate's hooks on every layer, as a
device_map puts them, all on GPU 0. Greedy, B = 1, a 128-token prompt and 64 new tokens, three
ways on the same model: stock generate; the engine's eager steps (as a model spread over
devices runs them: taken for one here); the engine's steps with the layers compiled inside
the hooks and captured (the path of a model on one GPU). A first call, then the median of 3.
The tokens differ between the ways where the random model's top logits tie within bf16
rounding (eager and compiled kernels round differently).

    python probes/hooked_layers.py [--out hooked_layers.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from accelerate.hooks import AlignDevicesHook, add_hook_to_module

import flashspec
from flashspec.bench.random_init import random_model
from flashspec.generation import engine, heads

WAYS = ("stock", "eager", "compiled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = random_model("llama-3.1-8b", "cuda", torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    for layer in model.model.layers:
        add_hook_to_module(layer, AlignDevicesHook(execution_device=0, io_same_device=True))
    flashspec.wrap(model)
    ids = torch.randint(1, model.config.vocab_size, (1, 128),
                        generator=torch.Generator().manual_seed(0)).cuda()
    rows = {}
    for way in WAYS:
        engine.drop_engine(model.model)
        places = heads.device_map_places
        if way == "eager":        # the model taken for one spread over devices
            heads.device_map_places = lambda model: {"cuda:0", "disk"}
        extra = {} if way == "stock" else {"sampler": "flash"}
        seconds = []
        try:
            for _ in range(4):
                torch.cuda.synchronize()
                started = time.perf_counter()
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64,
                               min_new_tokens=64, do_sample=False, **extra)
                torch.cuda.synchronize()
                seconds.append(time.perf_counter() - started)
        finally:
            heads.device_map_places = places
        live = engine.cached_engine(model.model)
        rows[way] = {"first_call_s": round(seconds[0], 2),
                     "tok_per_s": round(64 / statistics.median(seconds[1:]), 1),
                     "graphs": None if way == "stock" else len(live.graphs)}
        print(way, rows[way], flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
