"""Where a masked call's host time goes: cProfile of scripts/bench_structured.py's calls
(Qwen3-1.7B shape, the endless JSON-lines grammar), warm, at B = 1 and 32."""

import cProfile
import pstats
import sys

import torch

from flashspec.bench.structured import EOS, GRAMMAR, load

model, tokenizer = load("qwen3-1.7b", "cuda")
for batch in (1, 32):
    ids = torch.randint(1, len(tokenizer), (batch, 128), device="cuda")
    common = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, sampler="flash",
                  eos_token_id=EOS, pad_token_id=EOS, tokenizer=tokenizer,
                  structured_output={"grammar": GRAMMAR})
    model.generate(ids, **common)
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    model.generate(ids, **common)
    torch.cuda.synchronize()
    profile.disable()
    print(f"==== B = {batch}")
    pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(18)
