"""Tokens of a tensor-parallel target against the same model on one GPU (issue 32), under
torchrun: every rank loads the pair's target split over the ranks (``tp_plan="auto"``) and
the same target whole on its own GPU (the same seeded random weights: `pairs.load_pair`),
runs each case on both with ``sampler="flash"`` and compares the tokens, row by row.

Where the tokens differ, the first differing position is reported. The decoder's rounding
differs between the two (each rank's matmuls over its heads and columns, then all-reduces,
against one GPU's whole matmuls), so bf16 logits can differ by a rounding step and flip a
near-tie; stock transformers' greedy tokens, tensor-parallel against one GPU, are reported
beside as the yardstick for how often that happens.
"""

from __future__ import annotations

import torch

from flashspec.bench import pairs
from flashspec.bench.tok_per_s import random_prompts

# Llama's own sampling settings (its generation_config.json: T 0.6, top-p 0.9).
SEEDED = dict(do_sample=True, temperature=0.6, top_p=0.9, top_k=0, seed=0)
GREEDY = dict(do_sample=False)


def cases(draft) -> dict[str, dict]:
    """Greedy and seeded, each plain, with prompt lookup and with the draft (replicated on
    every rank) as assistant."""
    speculation = {"plain": {}, "prompt lookup": dict(prompt_lookup_num_tokens=4),
                   "assistant": dict(assistant_model=draft, num_assistant_tokens=4)}
    return {f"{decoding}, {how}": dict(settings, **extra)
            for decoding, settings in (("greedy", GREEDY), ("seeded", SEEDED))
            for how, extra in speculation.items() if draft is not None or how != "assistant"}


def first_difference(a: torch.Tensor, b: torch.Tensor) -> list[int | None]:
    """Per row, the first position where `a` and `b` ``[B, T]`` differ (None: equal)."""
    differ = a != b
    return [int(row.nonzero()[0]) if row.any() else None for row in differ]


def compare(spec: pairs.PairSpec, dtype: torch.dtype, weights: str, batch_size: int,
            prompt_length: int, new_tokens: int, device: str = "cuda") -> dict:
    """The comparison's report (every rank computes it; each the same tokens), on `device`
    ("cuda": each rank's own GPU; "cpu" with gloo, as the tests run it)."""
    split, draft, description = pairs.load_pair(spec, device, dtype, weights,
                                                tensor_parallel=True)
    whole, _, _ = pairs.load_pair(pairs.PairSpec(spec.label, spec.target, None,
                                                 spec.random_init),
                                  device, dtype, weights)
    prompts = random_prompts(batch_size, prompt_length, split.config.vocab_size, device)
    report = {"model": description, "batch_size": batch_size, "prompt_length": prompt_length,
              "new_tokens": new_tokens, "cases": {}}

    def tokens(model, **kwargs):
        out = model.generate(prompts, max_new_tokens=new_tokens, **kwargs)
        return out[:, prompt_length:]

    for name, kwargs in cases(draft).items():
        differences = first_difference(tokens(split, sampler="flash", **kwargs),
                                       tokens(whole, sampler="flash", **kwargs))
        report["cases"][name] = {"same": all(d is None for d in differences),
                                 "first_difference": differences}
    stock = first_difference(tokens(split, **GREEDY), tokens(whole, **GREEDY))
    report["stock greedy"] = {"same": all(d is None for d in stock), "first_difference": stock}
    return report
