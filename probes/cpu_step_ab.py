"""Is `generate(sampler="flash")` at least as fast as stock `generate` on CPU (issue 31)?

Times stock against flash, greedy, plain decoding and prompt lookup, on a 32k-vocabulary
Llama (hidden 256, 4 layers, random init, fp32) and on the demo's built-in tiny pair (its
three prompts), one thread, interleaved in one process: each repeat runs stock then flash,
and the table gives each one's median tok/s and flash's ratio to stock. Tokens must be
equal (greedy, fp32: the exactness contract). ``--profile`` adds a cProfile of flash's
calls (top functions by own time).

    PYTHONPATH=. python probes/cpu_step_ab.py [--repeats 3] [--tokens 128] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import flashspec
from flashspec.bench.demo import PROMPTS, TINY_PAIR


def llama_32k() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=1024,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=2048, pad_token_id=0, eos_token_id=None,
                         bos_token_id=None)
    return flashspec.wrap(LlamaForCausalLM(config).float().eval())


def cases(tokens: int):
    """(model name, prompt name, model, inputs dict, pad id) of each timed prompt."""
    model = llama_32k()
    generator = torch.Generator().manual_seed(1)
    phrase = torch.randint(1, 32000, (24,), generator=generator)
    ids = torch.cat([phrase, phrase[:12], torch.randint(1, 32000, (8,), generator=generator),
                     phrase])[None]
    yield "llama-32k", "repeated phrase", model, dict(input_ids=ids,
                                                     attention_mask=torch.ones_like(ids)), 0
    tokenizer = AutoTokenizer.from_pretrained(TINY_PAIR / "target", padding_side="left")
    target = flashspec.from_pretrained(TINY_PAIR / "target", dtype=torch.float32).eval()
    for name, prompt in PROMPTS.items():
        yield "tiny pair", name, target, dict(tokenizer(prompt, return_tensors="pt")), \
            tokenizer.pad_token_id


MODES = {"plain": {}, "lookup": dict(prompt_lookup_num_tokens=4)}


def timed(model, inputs, **kwargs):
    start = time.perf_counter()
    out = model.generate(**inputs, **kwargs)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    rows = []
    profiler = cProfile.Profile() if args.profile else None
    for model_name, prompt_name, model, inputs, pad in cases(args.tokens):
        for mode, extra in MODES.items():
            common = dict(max_new_tokens=args.tokens, do_sample=False, pad_token_id=pad, **extra)
            for kwargs in ({}, dict(sampler="flash")):      # warm-up
                timed(model, inputs, **common, **kwargs)
            times = {"stock": [], "flash": []}
            same = True
            for _ in range(args.repeats):
                stock, seconds = timed(model, inputs, **common)
                times["stock"].append(seconds)
                if profiler:
                    profiler.enable()
                flash, seconds = timed(model, inputs, sampler="flash", **common)
                if profiler:
                    profiler.disable()
                times["flash"].append(seconds)
                same &= torch.equal(stock, flash)
            new = stock.shape[1] - inputs["input_ids"].shape[1]
            rate = {k: new / statistics.median(v) for k, v in times.items()}
            rows.append(dict(model=model_name, prompt=prompt_name, mode=mode, tokens=new,
                             stock=rate["stock"], flash=rate["flash"],
                             ratio=rate["flash"] / rate["stock"], same=same))
            print(f"{model_name:10s} {prompt_name:24s} {mode:7s} {new:4d} tok  stock "
                  f"{rate['stock']:7.1f}  flash {rate['flash']:7.1f} tok/s  "
                  f"x{rate['flash'] / rate['stock']:.3f}  same={same}", flush=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.threads} thread(s), median of {args.repeats}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "cpu_step_ab.json"), "w") as f:
            json.dump(rows, f, indent=1)
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(35)


if __name__ == "__main__":
    main()
