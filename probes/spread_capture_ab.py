"""What capturing and compiling a device_map model's steps gives (issue 50): a random
Llama-3.1-8B spread over two GPUs by accelerate (`flashspec.bench.pairs.spread_over_gpus`), one
process, greedy, B = 1, in four ways, each its own engine on the same model:

* ``stock``: transformers' generate (dynamic cache);
* ``eager``: the engine as before this change, its steps eager (no CUDA graph, uncompiled);
* ``captured``: steps captured across both GPUs, the layers uncompiled;
* ``compiled``: steps captured and the layers compiled (the engine's default).

Each: a first call (compilation and captures), then --reps timed calls (median); the tokens of
the engine's ways against ``compiled``'s.

    python probes/spread_capture_ab.py [--new-tokens 64] [--out spread_ab.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

import flashspec
from flashspec.bench.pairs import spread_over_gpus
from flashspec.bench.random_init import random_model
from flashspec.generation import compiled, engine, heads

WAYS = ("stock", "eager", "captured", "compiled")


@contextlib.contextmanager
def way(name: str):
    """The engine run the way `name` says, through patches undone on exit."""
    saved = []

    def patch(owner, attribute, value):
        saved.append((owner, attribute, getattr(owner, attribute)))
        setattr(owner, attribute, value)

    if name == "eager":                       # a spread model taken as an offloaded one
        patch(heads, "_spread_gpus", lambda places, device: ())
    if name == "captured":
        runner = compiled.DecoderRunner
        patch(engine, "DecoderRunner",
              lambda decoder, role, compile, events, invariant=False:
              runner(decoder, role, False, events, invariant))
    try:
        yield
    finally:
        for owner, attribute, value in reversed(saved):
            setattr(owner, attribute, value)


def timed_call(model, ids, name: str, new_tokens: int) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize(0), torch.cuda.synchronize(1)
    started = time.perf_counter()
    extra = {} if name == "stock" else {"sampler": "flash"}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, **extra)
    torch.cuda.synchronize(0), torch.cuda.synchronize(1)
    return time.perf_counter() - started, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = random_model("llama-3.1-8b", "cuda", torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    spread_over_gpus(model, 2)
    flashspec.wrap(model)
    places = sorted({str(place) for place in model.hf_device_map.values()})
    ids = torch.randint(1, model.config.vocab_size, (1, args.prompt_length),
                        generator=torch.Generator().manual_seed(0)).to(model.device)
    rows, tokens = [], {}
    for name in WAYS:
        engine.drop_engine(model.model)
        with way(name):
            first, _ = timed_call(model, ids, name, args.new_tokens)
            seconds = []
            for _ in range(args.reps):
                elapsed, out = timed_call(model, ids, name, args.new_tokens)
                seconds.append(elapsed)
        tokens[name] = out.cpu()
        live = engine.cached_engine(model.model)
        median = statistics.median(seconds)
        rows.append({"way": name, "first_call_s": round(first, 2), "median_s": round(median, 4),
                     "tok_per_s": round(args.new_tokens / median, 1),
                     "graphs": None if name == "stock" else len(live.graphs),
                     "events": None if name == "stock" else
                     [(e.kind, round(e.seconds, 2)) for e in live.events][:6]})
    for row in rows:
        row["same_tokens_as_compiled"] = bool(torch.equal(tokens[row["way"]], tokens["compiled"]))
    report = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
              "places": places, "new_tokens": args.new_tokens,
              "prompt_length": args.prompt_length, "rows": rows}
    print(f"{'way':>9} {'first s':>8} {'tok/s':>8} {'graphs':>6} same")
    for row in rows:
        print(f"{row['way']:>9} {row['first_call_s']:>8} {row['tok_per_s']:>8} "
              f"{str(row['graphs']):>6} {row['same_tokens_as_compiled']}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
