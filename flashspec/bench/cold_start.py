"""What a new user's first calls cost: compilation and capture against the same call warm.

`CALLS` is issue 28's sequence, in one process: each call is timed once as it comes (what a
user waits for), then again at once (the same call warm); the difference is what that call
paid for compiling and capturing, next to the engine's own account of it (its `Event`s).
`second_process_first_call` times the first call of a fresh process whose disk cache
(`flashspec.generation.compiled.cache_dir`) is warm, model loading excluded.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..generation.engine import cached_engine
from ..generation.heads import output_head

QWEN3_SAMPLING = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95)


@dataclasses.dataclass(frozen=True)
class Call:
    name: str
    batch_size: int
    prompt_length: int
    drafter: str = "none"              # "none", "lookup" (4 drafts) or "assistant" (5 drafts)
    sampled: bool = False


CALLS = (
    Call("B=1 prompt 128", 1, 128),
    Call("the same again", 1, 128),
    Call("prompt 140", 1, 140),
    Call("prompt 300", 1, 300),
    Call("prompt 2000", 1, 2000),
    Call("B=2", 2, 128),
    Call("B=1 again", 1, 128),
    Call("B=7", 7, 128),
    Call("sampled", 1, 128, sampled=True),
    Call("prompt lookup 4", 1, 128, drafter="lookup"),
    Call("assistant 5 drafts", 1, 128, drafter="assistant"),
    Call("B=1 prompt 128 again", 1, 128),
)


# Steady state at issue 28's shape: prompt 128, 256 new tokens, plain and 0.6B-draft.
STEADY_CALLS = (Call("steady plain", 1, 128), Call("steady assistant 5", 1, 128, drafter="assistant"))
STEADY_TOKENS = 256


def prompt_ids(batch_size: int, length: int, vocab_size: int, device) -> torch.Tensor:
    """Deterministic prompts whose second half repeats the first (prompt lookup finds
    n-grams), a different one per row."""
    g = torch.Generator().manual_seed(length)
    half = torch.randint(3, vocab_size, (batch_size, (length + 1) // 2), generator=g)
    return torch.cat([half, half], dim=1)[:, :length].to(device)


def call_kwargs(call: Call, draft, new_tokens: int) -> dict:
    kwargs = dict(sampler="flash", max_new_tokens=new_tokens, seed=0)
    kwargs.update(QWEN3_SAMPLING if call.sampled else dict(do_sample=False))
    if call.drafter == "lookup":
        kwargs["prompt_lookup_num_tokens"] = 4
    elif call.drafter == "assistant":
        kwargs.update(assistant_model=draft, num_assistant_tokens=5,
                      num_assistant_tokens_schedule="constant")
    return kwargs


def timed_call(model, draft, call: Call, new_tokens: int) -> dict:
    """One generate() call: wall seconds, tokens generated, and the engine's compilations
    and captures during it."""
    decoder = output_head(model, "model").decoder
    engine = cached_engine(decoder)
    before = len(engine.events) if engine is not None else 0
    ids = prompt_ids(call.batch_size, call.prompt_length, model.config.vocab_size,
                     model.device)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **call_kwargs(call, draft, new_tokens))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    events = cached_engine(decoder).events[before:]
    return {"seconds": seconds, "tokens": int(out.shape[0] * (out.shape[1] - ids.shape[1])),
            "compile_seconds": sum(e.seconds for e in events if e.kind == "compile"),
            "capture_seconds": sum(e.seconds for e in events if e.kind == "capture"),
            "compiled": [e.what for e in events if e.kind == "compile"],
            "captures": sum(e.kind == "capture" for e in events)}


def run_sequence(model, draft, new_tokens: int, calls=CALLS, progress=None) -> list[dict]:
    """Each call of `calls` as it comes, then again warm; one row per call."""
    rows = []
    for call in calls:
        if progress is not None:
            progress.start(call.name)
        first = timed_call(model, draft, call, new_tokens)
        warm = timed_call(model, draft, call, new_tokens)
        rows.append({**dataclasses.asdict(call), "first": first, "warm": warm,
                     "extra_seconds": first["seconds"] - warm["seconds"],
                     "steady_tok_s": warm["tokens"] / warm["seconds"]})
        if progress is not None:
            progress.finish()
    return rows


def steady_state(model, draft, calls=STEADY_CALLS, new_tokens: int = STEADY_TOKENS,
                 repeats: int = 3) -> list[dict]:
    """tok/s of each call once warm: a call to warm it, then the median of `repeats`."""
    rows = []
    for call in calls:
        timed_call(model, draft, call, new_tokens)
        runs = sorted(timed_call(model, draft, call, new_tokens)["seconds"] for _ in range(repeats))
        seconds = runs[len(runs) // 2]
        rows.append({**dataclasses.asdict(call), "new_tokens": new_tokens, "seconds": seconds,
                     "tok_s": call.batch_size * new_tokens / seconds})
    return rows


def first_of_its_kind(rows: list[dict], bucket_of) -> list[bool]:
    """Whether each row is the first of its drafter kind and batch bucket (`bucket_of`:
    batch size -> bucket), which issue 28 lets pay for compilation."""
    seen, first = set(), []
    for row in rows:
        key = (row["drafter"], bucket_of(row["batch_size"]))
        first.append(key not in seen)
        seen.add(key)
    return first
