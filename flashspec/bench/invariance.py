"""Are seeded tokens the same with and without drafts, alone and in a batch? (issue 29)

`invariance_runs` generates the same rows, each with its own seed, six ways: one row per
call without drafts (the reference), drafted by the target itself (a constant and the
heuristic schedule), by an assistant, by prompt lookup, and all rows as one batch without
drafts. `equal_rows` counts, per way, the
rows whose tokens equal the reference's. With the invariant decoder kernels
(`flashspec.generation.invariant`) every count is the number of rows; with cuBLAS and
PyTorch's reductions a near race goes the other way wherever a forward's shape changed the
last bits of a hidden state.

`scaled_head` makes such races common on random weights: it rescales the LM head so that
the top logits are a fraction of a unit apart.
"""

from __future__ import annotations

import time

import torch

WAYS = ("plain", "self", "self heuristic", "assistant", "lookup", "batch")


def repeating_prompts(rows: int, length: int, vocab_size: int, device, seed: int = 1) -> torch.Tensor:
    """``[rows, length]`` token ids whose second half repeats the first (prompt lookup then
    finds drafts), ids in ``[3, vocab_size)``."""
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(3, vocab_size, (rows, (length + 1) // 2), generator=g)
    return torch.cat([half, half], dim=1)[:, :length].to(device)


def scaled_head(model, scale: float) -> None:
    """Multiply `model`'s LM-head weight by `scale`, in place."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)


def invariance_runs(model, assistant, ids: torch.Tensor, new_tokens: int, sampling: dict,
                    num_drafts: int = 4, ways=WAYS, invariant: bool = True) -> dict:
    """Tokens ``[rows, new_tokens]`` of each of `ways` (of `WAYS`; "plain" always), and each
    way's wall seconds. Row r uses seed r; `sampling`: generate's sampling options;
    `invariant`: generate's (the invariant decoder kernels or cuBLAS and PyTorch's)."""
    rows = ids.shape[0]
    seeds = torch.arange(rows)
    kwargs = dict(sampler="flash", max_new_tokens=new_tokens, invariant=invariant, **sampling)
    # No confidence threshold: every step drafts its count, every verification is as wide.
    constant = dict(num_assistant_tokens=num_drafts, num_assistant_tokens_schedule="constant",
                    assistant_confidence_threshold=0.0)
    drafters = {"plain": {}, "self": dict(assistant_model=model, **constant),
                # Draft counts grow while drafts are accepted: wider verifications.
                "self heuristic": dict(assistant_model=model, num_assistant_tokens=num_drafts,
                                       num_assistant_tokens_schedule="heuristic",
                                       assistant_confidence_threshold=0.0),
                "assistant": dict(assistant_model=assistant, **constant),
                "lookup": dict(prompt_lookup_num_tokens=num_drafts)}
    tokens, seconds = {}, {}
    for name, drafter in drafters.items():
        if name != "plain" and name not in ways:
            continue
        started = time.perf_counter()
        tokens[name] = torch.cat([
            model.generate(ids[r:r + 1], attention_mask=torch.ones_like(ids[r:r + 1]),
                           seed=seeds[r:r + 1], **drafter, **kwargs)[:, ids.shape[1]:]
            for r in range(rows)])
        seconds[name] = time.perf_counter() - started
    if "batch" not in ways:
        return {"tokens": tokens, "seconds": seconds}
    started = time.perf_counter()
    tokens["batch"] = model.generate(ids, attention_mask=torch.ones_like(ids), seed=seeds,
                                     **kwargs)[:, ids.shape[1]:]
    seconds["batch"] = time.perf_counter() - started
    return {"tokens": tokens, "seconds": seconds}


def equal_rows(tokens: dict) -> dict:
    """Per way, the rows whose tokens equal the plain run's, and the first new token where
    each other row differs."""
    reference = tokens["plain"]
    out = {}
    for name, run in tokens.items():
        same = (run == reference).all(dim=1)
        first = [int((run[r] != reference[r]).nonzero()[0]) for r in range(run.shape[0])
                 if not same[r]]
        out[name] = {"equal": int(same.sum()), "rows": run.shape[0], "first_differences": first}
    return out
