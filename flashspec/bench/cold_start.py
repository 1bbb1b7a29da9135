"""What a new user's first calls cost: compilation and capture against the same call warm.

`CALLS` is issue 28's sequence, in one process: each call is timed once as it comes (what a
user waits for), then again at once (the same call warm); the difference is what that call
paid for compiling and capturing, next to the engine's own account of it (its `Event`s).
The script (`scripts/cold_start.py`) also times the first call of a fresh process whose disk
cache (`flashspec.generation.compiled.cache_dir`) is warm, model loading excluded.
`capacity_cost` checks that decoding follows the live length, not the KV capacity;
`time_to_first_token` compares the prompt's forward with stock transformers'.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from ..generation.engine import cached_engine, drop_engine
from ..generation.heads import output_head

QWEN3_SAMPLING = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95)


@dataclasses.dataclass(frozen=True)
class Call:
    name: str
    batch_size: int
    prompt_length: int
    drafter: str = "none"              # "none", "lookup" (4 drafts) or "assistant" (5 drafts)
    sampled: bool = False
    invariant: bool = False            # generate's `invariant`: the invariant decoder kernels


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


# Steady state at issue 28's shape: prompt 128, 256 new tokens, plain and 0.6B-draft; and
# the same at prompt 2000.
STEADY_CALLS = (Call("steady plain", 1, 128), Call("steady assistant 5", 1, 128, drafter="assistant"),
                Call("steady plain, prompt 2000", 1, 2000),
                Call("steady assistant 5, prompt 2000", 1, 2000, drafter="assistant"))
STEADY_TOKENS = 256


def prompt_ids(batch_size: int, length: int, vocab_size: int, device) -> torch.Tensor:
    """Deterministic prompts whose second half repeats the first (prompt lookup finds
    n-grams), a different one per row."""
    g = torch.Generator().manual_seed(length)
    half = torch.randint(3, vocab_size, (batch_size, (length + 1) // 2), generator=g)
    return torch.cat([half, half], dim=1)[:, :length].to(device)


def call_kwargs(call: Call, draft, new_tokens: int) -> dict:
    kwargs = dict(sampler="flash", max_new_tokens=new_tokens, seed=0, invariant=call.invariant)
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
        ids = prompt_ids(call.batch_size, call.prompt_length, model.config.vocab_size, model.device)
        kwargs = call_kwargs(call, draft, new_tokens)
        seconds = _median_seconds(
            lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs), repeats)
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


def _median_seconds(run, repeats: int) -> float:
    """Median wall seconds of `run()` over `repeats` calls, after one untimed call."""
    run()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def capacity_cost(model, prompt_length: int = 128, new_tokens: int = 100,
                  long_prompt: int = 2000, repeats: int = 5) -> dict:
    """Seconds of one plain call (B=1, `prompt_length` + `new_tokens`, inside the smallest
    KV view) in a fresh engine's slot and again after a `long_prompt` call grew the slot to
    thousands of columns: attention reads the view, so the two should match. (The fresh
    engine reuses the compiled code; it captures its graphs again.)"""
    decoder = output_head(model, "model").decoder
    drop_engine(decoder)
    ids = prompt_ids(1, prompt_length, model.config.vocab_size, model.device)
    kwargs = dict(sampler="flash", max_new_tokens=new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids))

    def call():
        model.generate(ids, **kwargs)

    def capacity():
        return max(slot.capacity for slot in cached_engine(decoder).slots.values())

    small = _median_seconds(call, repeats)
    small_capacity = capacity()
    long = prompt_ids(1, long_prompt, model.config.vocab_size, model.device)
    model.generate(long, attention_mask=torch.ones_like(long), sampler="flash", max_new_tokens=8,
                   do_sample=False)
    large = _median_seconds(call, repeats)
    return {"prompt_length": prompt_length, "new_tokens": new_tokens,
            "small": {"capacity": small_capacity, "seconds": small},
            "large": {"capacity": capacity(), "seconds": large}, "ratio": large / small}


def time_to_first_token(model, prompt_length: int = 2000, repeats: int = 5) -> dict:
    """Median seconds of a one-token ``generate`` (B=1, greedy): flash and stock."""
    ids = prompt_ids(1, prompt_length, model.config.vocab_size, model.device)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
    stock = _median_seconds(lambda: model.generate(ids, **kwargs), repeats)
    flash = _median_seconds(lambda: model.generate(ids, sampler="flash", **kwargs), repeats)
    return {"prompt_length": prompt_length, "stock": stock, "flash": flash, "ratio": flash / stock}
