"""`flashspec.warmup`: pay compilation and graph capture before the first real call.

The engine compiles each decoder once and captures a CUDA graph the first time a (batch
bucket, step, KV view, kernel flags) meets it; a server or a benchmark would rather pay that
at start-up than inside its first requests. `warmup` runs short `generate` calls that meet
every batch bucket of `batch_sizes`, every KV view up to `max_length` (the largest first,
so that the slot is grown once and the smaller views' graphs are captured over its final
buffers) and every step of the chosen drafter, with a progress bar. With drafts, each call's
first steps take each width a call with `max_time` can meet (`Engine.timed_widths`: powers of
two up to the draft count): such a call compiles and captures nothing, and runs uncompiled
where its steps were never compiled and captured (`Engine.needs_compiling`).
"""

from __future__ import annotations

import time

import torch

from .engine import cached_engine, set_memory_budget, warming
from .heads import output_head
from .slot import bucket

_MIN_NEW_TOKENS = 8      # a few steps of every kind after the prefill


def warmup(model, *, assistant_model=None, prompt_lookup_num_tokens: int | None = None,
           batch_sizes=(1,), max_length: int = 2048, memory_budget: int | None = None,
           progress: bool = True, **generate_kwargs) -> dict:
    """Compile and capture what `model.generate(sampler="flash", ...)` will need.

    Args:
        model: a model wrapped by `flashspec.wrap` / `flashspec.from_pretrained`.
        assistant_model, prompt_lookup_num_tokens: the drafter the later calls use (or
            neither); ``num_assistant_tokens`` and sampling options go in `generate_kwargs`,
            as for `generate` (sampling options pick kernel variants: pass the ones you use).
        batch_sizes: batch sizes the later calls use (each is served by its bucket).
        max_length: the longest prompt + new tokens the later calls reach: every KV view up
            to it is captured.
        memory_budget: bytes the engine may hold (KV caches and graphs; default half the
            free device memory when the engine is created).
        progress: show a progress bar (tqdm, if installed) on stderr.

    Returns:
        ``{"seconds", "compilations", "captures", "memory"}``: wall time, the events of
        this warm-up (`flashspec.generation.compiled.Event`), and `Engine.memory()`.
    """
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
        raise ValueError(f"`max_length` must be an int >= 2, got {max_length!r}")
    sizes = list(batch_sizes)
    if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
        raise ValueError(f"`batch_sizes` must be ints >= 1, got {batch_sizes!r}")
    head = output_head(model, "model")
    device = head.weight.device
    if memory_budget is not None:
        set_memory_budget(head.decoder, memory_budget)
    engine = cached_engine(head.decoder)
    events_before = len(engine.events) if engine is not None else 0
    views, view = [], bucket(1)
    while view <= bucket(max_length):
        views.append(view)
        view *= 2
    calls = [(batch, view) for batch in sorted(set(sizes)) for view in reversed(views)]
    num_drafts = prompt_lookup_num_tokens or (
        generate_kwargs.get("num_assistant_tokens")
        or (assistant_model.generation_config.num_assistant_tokens or 20
            if assistant_model is not None else 0))
    # Room for a step at each timed width (1, 2, 4, ... up to G: under 2G + log2(G) tokens
    # if every draft is accepted), then a full-width verification.
    new_tokens = max(_MIN_NEW_TOKENS, 3 * num_drafts + 2)
    bar = _bar(len(calls)) if progress else None
    started = time.perf_counter()
    drafter = dict(assistant_model=assistant_model,
                   prompt_lookup_num_tokens=prompt_lookup_num_tokens)
    drafter = {name: value for name, value in drafter.items() if value is not None}
    with warming(head.decoder):
        for batch, view in calls:
            # A prompt past half the view: the steps after it attend over exactly this view.
            length = min(view // 2 + 1, max(max_length - new_tokens, 1))
            ids = torch.arange(length, device=device).remainder(97).add(3).repeat(batch, 1)
            model.generate(ids, attention_mask=torch.ones_like(ids), sampler="flash",
                           max_new_tokens=new_tokens, **drafter, **generate_kwargs)
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    engine = cached_engine(head.decoder)
    events = engine.events[events_before:]
    return {"seconds": time.perf_counter() - started,
            "compilations": [e for e in events if e.kind == "compile"],
            "captures": [e for e in events if e.kind == "capture"],
            "memory": engine.memory()}


def _bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="flashspec warm-up", unit="call")
