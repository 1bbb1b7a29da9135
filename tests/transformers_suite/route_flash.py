"""pytest plugin: every `generate` call routed to ``sampler="flash"``, one outcome recorded per call.

Loaded with ``-p route_flash`` (its folder on PYTHONPATH; `run_suite.py` does this). Inert unless
``FLASHSPEC_ROUTE=1``. Then `transformers.GenerationMixin.generate` is replaced, at the class,
by `routed`: a call that does not already come from flashspec runs as
``FlashGenerationMixin.generate(model, ..., sampler="flash")`` with the same arguments, the
model wrapped as `flashspec.wrap` does for the duration of the call (its class is restored
after, so the test sees its own model). flashspec's stock path (``super().generate``) and
whatever stock runs inside it (an assistant's `generate`, ...) reach `routed` again with the
thread-local flag set, and run transformers' own `generate`.

One JSON line per call is appended to ``$FLASHSPEC_ROUTE_LOG`` (xdist workers share the file,
under a lock), with the test's node id and one outcome:

    RAN               the engine ran it on the fused path (no flashspec warning)
    RAN_MATERIALIZED  the engine ran it on its exact materialized path ("runs this call on its
                      exact materialized path ... because of: <reasons>")
    DEFERRED          flashspec handed it to stock ("defers this call to stock transformers
                      generate(): <reason>"); `reason` is the option named first
    REFUSED           a ValueError / TypeError raised by flashspec before its engine ran
                      (planning, `wrap`): re-raised, as a user would see it
    CRASHED           any other exception from flashspec: re-raised

Outcomes come from the warnings flashspec emits (seen through a pass-through wrapper of
`warnings.warn`, so the test still gets every warning) and from the exception, so a later
flashspec that runs more of these calls is recorded as it behaves. With
``FLASHSPEC_ROUTE_COMPARE=1``, a greedy call (do_sample False, num_beams 1) that ran on the
engine is run again by stock `generate` with the torch RNG state of the call's start
(restored after, and the assistant's generation config too), and `tokens_equal` says
whether the sequences are the same.
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import re
import threading
import time
import traceback
import warnings

import pytest

_STATE = threading.local()
_CURRENT = {"test": None}
_HOOKS = {}
_DEFER = "defers this call to stock transformers generate(): "
_MATERIALIZED = "runs this call on its exact materialized path"


def pytest_configure(config):
    if os.environ.get("FLASHSPEC_ROUTE") == "1":
        install()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    _CURRENT["test"] = item.nodeid


def install() -> None:
    """Replace `GenerationMixin.generate` (and make the recording `warnings.warn`)."""
    from transformers import GenerationMixin

    if getattr(GenerationMixin.generate, "_flash_routed", False):
        return
    original = GenerationMixin.generate
    real_warn = warnings.warn

    def warn(message, category=None, stacklevel=1, *args, **kwargs):
        seen = getattr(_STATE, "seen", None)
        if seen is not None:
            seen.append(str(message))
        return real_warn(message, category, stacklevel + 1, *args, **kwargs)

    def routed(self, *args, **kwargs):
        from flashspec.generation.mixin import FlashGenerationMixin
        if getattr(_STATE, "inside", False) or isinstance(self, FlashGenerationMixin):
            return original(self, *args, **kwargs)
        return _route(self, original, args, kwargs)

    routed._flash_routed = True
    routed.__wrapped__ = original
    GenerationMixin.generate = routed
    _HOOKS["warn"] = warn


def _route(model, original, args, kwargs):
    """One routed call (see the module docstring), recorded. `warnings.warn` is the recording
    wrapper only during the call (TorchScript compiles only the real one)."""
    import torch
    import flashspec
    from flashspec.generation.mixin import FlashGenerationMixin

    record = {"test": _CURRENT["test"], "model": type(model).__name__,
              **_decoding(model, args, kwargs)}
    rng = torch.get_rng_state()
    compare = os.environ.get("FLASHSPEC_ROUTE_COMPARE") == "1"
    # A passed cache is updated in place by the call (as stock's is): the comparison gets
    # its own copy of the cache as the test passed it, and the test never sees stock's.
    before = {name: copy.deepcopy(value) for name, value in kwargs.items()
              if name == "past_key_values" and value is not None} if compare else {}
    assistant = kwargs.get("assistant_model")
    assistant_config = copy.deepcopy(getattr(assistant, "generation_config", None))
    cls, real_warn = model.__class__, warnings.warn
    _STATE.inside, _STATE.seen = True, []
    warnings.warn = _HOOKS["warn"]
    started = time.perf_counter()
    try:
        try:
            flashspec.wrap(model)
        except (ValueError, TypeError) as error:
            record.update(outcome="REFUSED", reason="wrap", error=_first_line(error))
            raise
        output = FlashGenerationMixin.generate(model, *args, sampler="flash", **kwargs)
        record.update(_success(_STATE.seen))
    except BaseException as error:
        if "outcome" not in record:
            record.update(_failure(error, _STATE.seen))
        _write({**record, "seconds": round(time.perf_counter() - started, 3)})
        raise
    finally:
        model.__class__, warnings.warn = cls, real_warn
        _STATE.inside, _STATE.seen = False, None
    record["seconds"] = round(time.perf_counter() - started, 3)
    if record["outcome"].startswith("RAN") and record["greedy"] and compare:
        record.update(_compare(model, original, args, {**kwargs, **before}, output, rng,
                               assistant, assistant_config))
    _write(record)
    return output


def _decoding(model, args, kwargs) -> dict:
    """do_sample and num_beams as the call resolves them (call > generation_config > model's)."""
    config = kwargs.get("generation_config", args[1] if len(args) > 1 else None)

    def value(name, default):
        for source in (kwargs, getattr(config, "__dict__", {}),
                       getattr(model.generation_config, "__dict__", {})):
            if source.get(name) is not None:
                return source[name]
        return default

    do_sample, num_beams = bool(value("do_sample", False)), int(value("num_beams", 1) or 1)
    return {"do_sample": do_sample, "num_beams": num_beams,
            "greedy": not do_sample and num_beams == 1,
            "assisted": kwargs.get("assistant_model") is not None
            or kwargs.get("prompt_lookup_num_tokens") is not None}


def _success(seen: list[str]) -> dict:
    deferred = next((m for m in seen if _DEFER in m), None)
    if deferred is not None:
        reason = deferred.split(_DEFER, 1)[1]
        return {"outcome": "DEFERRED", "reason": option_of(reason), "detail": reason[:300]}
    materialized = next((m for m in seen if _MATERIALIZED in m), None)
    if materialized is not None:
        why = materialized.split("because of: ", 1)[-1]
        return {"outcome": "RAN_MATERIALIZED",
                "reason": ",".join(dict.fromkeys(re.findall(r"`(\w+)`", why))) or why[:80],
                "detail": why[:300]}
    return {"outcome": "RAN"}


def _failure(error: BaseException, seen: list[str]) -> dict:
    """DEFERRED (stock raised it), REFUSED (flashspec's planning raised a ValueError or
    TypeError) or CRASHED (anything else from flashspec)."""
    out = _success(seen)
    if out["outcome"] == "DEFERRED":
        return {**out, "error": _first_line(error)}
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if f"{os.sep}flashspec{os.sep}" in f.filename]
    in_engine = any(f.filename.endswith(("engine.py", "slot.py", "compiled.py", "samplers.py"))
                    or f"{os.sep}kernels{os.sep}" in f.filename for f in ours)
    planning = any(f.name in ("plan_generation", "generate") for f in ours)
    tail = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[-6:]]
    if isinstance(error, (ValueError, TypeError)) and planning and not in_engine:
        return {"outcome": "REFUSED", "reason": option_of(str(error)),
                "error": _first_line(error), "where": tail[-1]}
    return {"outcome": "CRASHED", "reason": type(error).__name__, "error": _first_line(error),
            "traceback": tail}


def option_of(reason: str) -> str:
    """A flashspec reason reduced to the option that caused it."""
    if reason.startswith("`attention_mask`"):
        return "attention_mask not left padding"
    if "encoder-decoder" in reason:
        return "encoder-decoder"
    if "the engine never runs the model's own forward" in reason:
        return "model hooks"
    named = re.match(r"[^`]*`(\w+)`(?: \([^)]*\))?\s*(.*)", reason)
    if named is None:
        return reason[:60]
    if named.group(1) in ("model", "assistant_model"):      # a refusal of the model itself
        return f"{named.group(1)}: {named.group(2)[:60]}"
    return named.group(1)


def _compare(model, original, args, kwargs, output, rng, assistant, assistant_config) -> dict:
    """Stock `generate` on the same call, from the call's RNG state; the state after the
    flash call, the assistant's config and the model's attributes (stock sets some, such as
    `_compiled_call` or a static `_cache`, which tests look for) are put back."""
    import torch
    after, attributes = torch.get_rng_state(), dict(model.__dict__)
    config_after = copy.deepcopy(getattr(assistant, "generation_config", None))
    _STATE.inside = True
    try:
        torch.set_rng_state(rng)
        if assistant is not None and assistant_config is not None:
            assistant.generation_config = copy.deepcopy(assistant_config)
        # With its scores (greedy tokens do not depend on what is returned), to tell a tie.
        stock = original(model, *args, **{**kwargs, "output_scores": True,
                                          "return_dict_in_generate": True})
        ours, theirs = _sequences(output), _sequences(stock)
        equal = ours.shape == theirs.shape and bool((ours == theirs).all())
        result = {"tokens_equal": equal}
        if not equal:
            result["tokens_flash"], result["tokens_stock"] = ours.tolist(), theirs.tolist()
            result.update(_divergence(ours, theirs, stock.scores))
        return result
    except Exception as error:          # the comparison never fails the test
        return {"tokens_equal": None, "compare_error": _first_line(error)}
    finally:
        _STATE.inside = False
        torch.set_rng_state(after)
        for name in [name for name in model.__dict__ if name not in attributes]:
            del model.__dict__[name]
        model.__dict__.update(attributes)
        if assistant is not None and config_after is not None:
            assistant.generation_config = config_after


def _divergence(ours, theirs, scores) -> dict:
    """Where each row of two greedy outputs first differs (within the shorter's columns: a
    row may end earlier in one), and both tokens' scores there as stock computed them.
    `tie_in_stock`: at every such place the two scores are equal, a tie in stock's own
    rounding (its logits are rounded to the model's dtype; flashspec's are not, DESIGN
    section 3)."""
    width = min(ours.shape[1], theirs.shape[1])
    prompt = theirs.shape[1] - len(scores)
    places, ties = [], []
    for row in range(min(ours.shape[0], theirs.shape[0])):
        differs = (ours[row, :width] != theirs[row, :width]).nonzero()
        if len(differs) == 0:
            continue
        column = int(differs[0])
        step = column - prompt
        if not 0 <= step < len(scores):
            return {"divergence": [row, column]}        # before the new tokens: no scores
        row_scores = scores[step][row]
        pair = [row_scores[theirs[row, column]].item(), row_scores[ours[row, column]].item()]
        places.append({"row": row, "column": column, "stock_scores": pair})
        ties.append(pair[0] == pair[1])
    if ours.shape[0] != theirs.shape[0] or not places:
        return {"divergence": places}                   # other rows, or lengths alone differ
    return {"divergence": places, "scores_dtype": str(scores[0].dtype), "tie_in_stock": all(ties)}


def _sequences(output):
    return output if hasattr(output, "shape") else output.sequences


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


def _write(record: dict) -> None:
    path = os.environ.get("FLASHSPEC_ROUTE_LOG")
    if not path:
        return
    line = json.dumps(record, default=str) + "\n"
    with open(path, "a", encoding="utf-8") as log:
        fcntl.flock(log, fcntl.LOCK_EX)
        log.write(line)
        fcntl.flock(log, fcntl.LOCK_UN)
