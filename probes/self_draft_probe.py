"""Why does a model drafting for itself (assistant_model=model) emit other tokens than the
plain run (issue 29)? Llama-3.2-1B shape, bf16, CUDA, greedy, 3 prompts: stock transformers'
greedy against flash plain and flash self-drafting (FLASHSPEC_INVARIANT as set)."""

import os

import torch

import flashspec
from flashspec.bench.invariance import repeating_prompts, scaled_head
from flashspec.bench.random_init import random_model

target = flashspec.wrap(random_model("llama-3.2-1b", device="cuda", dtype=torch.bfloat16))
scaled_head(target, 3.0)
target.generation_config.eos_token_id = None
ids = repeating_prompts(3, 64, target.config.vocab_size, "cuda")
print("FLASHSPEC_INVARIANT", os.environ.get("FLASHSPEC_INVARIANT"))
for row in range(3):
    prompt = ids[row:row + 1]
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    stock = target.generate(prompt, **kwargs)[0, 64:].tolist()
    plain = target.generate(prompt, sampler="flash", **kwargs)[0, 64:].tolist()
    self_ = target.generate(prompt, sampler="flash", assistant_model=target,
                            num_assistant_tokens=4, **kwargs)[0, 64:].tolist()
    print(f"row {row}\n  stock {stock}\n  plain {plain}\n  self  {self_}")
