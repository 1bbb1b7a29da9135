"""Differential fuzzing of `generate(sampler="flash")` against stock transformers (issue 36).

Each example draws one `generate` call and runs it twice on the same tiny float32 model:
stock transformers (`torch.manual_seed(0)`) and `sampler="flash"`. What it draws:

* a model family: Llama, Qwen3, Mistral (sliding window), GPT-2, Cohere (logit scale),
  Gemma-2 (softcap);
* prompts: batch 1-3, lengths 1-6, left padding, and now and then a right-padded or holed
  mask, no mask, int32 ids, an empty prompt, ids outside the vocabulary;
* sampling: `do_sample` (bools, and now and then 1 or a string), `temperature`, `top_k`,
  `top_p`, `min_p`, each from in-range values, edges (0, 1, 2**63, negatives, NaN, inf)
  and wrong types (strings, lists); flashspec's `seed` (None, small, 2**63 - 1);
* lengths and stop rules: `max_new_tokens` (ints, fractions, 0, negatives, strings,
  10**12 and inf with a `max_time`), `max_length`, `eos_token_id` (int, list, every
  token, empty list, a string), `pad_token_id` (0, 7, -3), `max_time`, `stop_strings`
  (batch 1, with `tokenizer=`);
* `num_return_sequences` (ints, 0, -1, a float);
* drafts: none, an assistant (`num_assistant_tokens` in or out of range), prompt lookup
  (`prompt_lookup_num_tokens`, `max_matching_ngram_size`);
* logit edits: `repetition_penalty`, `no_repeat_ngram_size`, `min_new_tokens`,
  `suppress_tokens` (fused), `remove_invalid_values` (the materialized path);
* outputs: `return_dict_in_generate` with `output_logprobs`, a streamer (batch 1).

What it asserts, per example (`outcome`):

* both run: greedy sequences are equal token for token (only the common prefix of each
  row when `max_time` stops the runs); sampled sequences hold the prompt, valid token ids,
  nothing but padding after a row's EOS, and the lengths the limits allow; a streamer
  received exactly the returned new tokens;
* flashspec raises a ValueError or TypeError whose message names a drawn parameter, where
  stock also fails or the refusal is one README documents (`DOCUMENTED_REFUSALS`);
* never another exception type from flashspec, never a run where stock fails except the
  documented extensions (`DOCUMENTED_EXTENSIONS`), never a silent difference (where stock's
  assisted generation differs from its plain generation, `DOCUMENTED_DIFFERENCES`, flashspec
  is compared with the plain one).

Seeded and bounded for CI: hypothesis seed FLASHSPEC_FUZZ_SEED (default 0),
FLASHSPEC_FUZZ_EXAMPLES examples (default 300, about 15 s on one core). The large profile
runs by hand, e.g. ``FLASHSPEC_FUZZ_EXAMPLES=2600 FLASHSPEC_FUZZ_SEED=1 python -m pytest
-q tests/test_fuzz_generate.py -s`` (each seed draws other examples; ``-s`` prints the
count of each outcome).

The CUDA profile (`test_cuda_bf16_matches_stock_or_refuses_clearly`, marked gpu, run by
scripts/gpu_check.sh's part ``fuzz``) draws the same calls and runs them as users do: the
same tiny models in bfloat16 on CUDA, stock's generate against the fast engine (compiled
forwards, CUDA graphs, the fused kernels; a first call with `max_time` runs uncompiled).
FLASHSPEC_FUZZ_CUDA_EXAMPLES examples (default 300); once FLASHSPEC_FUZZ_CUDA_SECONDS (default
240) have passed, the remaining examples are counted as skipped, not run. It compares what
bf16 leaves meaningful:

* refusals and errors exactly as above (the argument checks do not depend on the device);
* runs: valid token ids, nothing after EOS, lengths within the limits, streamer tokens equal
  to the returned ones, as above;
* greedy tokens: equal to stock's, or at a row's first difference the two tokens are a
  near-tie of stock's own scores for that position (`output_scores`, within 3e-2 relative,
  the bf16 tolerance of test_generate_gpu.py): flashspec computes logits with float32
  accumulation and stock rounds them to bf16, and their decoder forwards round differently,
  so a near-tie may go either way; any other difference fails.

Not drawn on CUDA: ids outside the vocabulary and a negative `pad_token_id`, which stock
embeds, and every token as an EOS id, with which stock's minimum length leaves a row nothing
to sample (torch.multinomial's check): each ends the process with a device-side assert in
stock; the CPU profile covers all three.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import time
import warnings

import pytest
import torch
import transformers
from hypothesis import HealthCheck, Phase, given, seed, settings, strategies as st
from transformers.generation.streamers import BaseStreamer

from flashspec.bench.statistics import is_near_tie

from _models import PAD, VOCAB, tiny_draft, tiny_model
from test_generate import tiny_tokenizer

FUZZ_EXAMPLES = int(os.environ.get("FLASHSPEC_FUZZ_EXAMPLES", "300"))
FUZZ_SEED = int(os.environ.get("FLASHSPEC_FUZZ_SEED", "0"))
CUDA_EXAMPLES = int(os.environ.get("FLASHSPEC_FUZZ_CUDA_EXAMPLES", "300"))
CUDA_SECONDS = float(os.environ.get("FLASHSPEC_FUZZ_CUDA_SECONDS", "240"))
BF16_TOL = 3e-2             # relative: a near-tie of bf16 logits (test_generate_gpu.py's)
FAMILIES = ("llama", "qwen3", "mistral", "gpt2", "cohere", "gemma2")
OUTCOMES: collections.Counter = collections.Counter()

# Refusals of calls stock runs, as README documents them: parameter -> when.
DOCUMENTED_REFUSALS = {
    "do_sample": lambda kw: not isinstance(kw.get("do_sample", False), (bool, type(None))),
    "temperature": lambda kw: kw.get("temperature") in (math.inf,),
    "max_new_tokens": lambda kw: _not_finite(kw.get("max_new_tokens")),
    # flashspec honours num_assistant_tokens from the call; stock reads only the assistant's.
    "num_assistant_tokens": lambda kw: "assistant_model" in kw,
    # invalid draft counts, refused even where stock makes no draft (README: "Refused")
    "prompt_lookup_num_tokens": lambda kw: not _count(kw.get("prompt_lookup_num_tokens")),
    "max_matching_ngram_size": lambda kw: not _count(kw.get("max_matching_ngram_size") or 2),
    # stock generate runs the call (right padding, say) and flashspec's seed
    # cannot key its sampling.
    "seed": lambda kw: kw.get("seed") is not None,
    # rows of a batch advance unevenly
    "streamer": lambda kw: kw["streamer"],
    # flashspec's logprobs, asked for where stock runs the call (as for `seed`)
    "output_logprobs": lambda kw: kw.get("output_logprobs", False),
}
# Calls where stock's result with drafts is not its result without them, which flashspec
# gives (speculation invariance): name -> when (kwargs, input_ids). Compared with stock
# without the drafts.
DOCUMENTED_DIFFERENCES = {
    # stock's assisted generation returns a prompt that already meets a stopping rule (ends
    # with an EOS token or a stop string) unchanged
    "prompt ending in EOS, with drafts": lambda kw, ids: _drafts(kw) and ids.shape[1] > 0 and bool(
        set(ids[:, -1].tolist()) & set(_eos_list(kw.get("eos_token_id")))),
    "prompt ending in a stop string, with drafts": lambda kw, ids: _drafts(kw) and any(
        _tokenizer().decode(row).endswith(tuple(kw.get("stop_strings") or ()))
        for row in ids.tolist()),
}
_DRAFT_OPTIONS = ("assistant_model", "num_assistant_tokens", "prompt_lookup_num_tokens",
                  "max_matching_ngram_size")
# Runs where stock refuses, as README documents them: name -> when.
DOCUMENTED_EXTENSIONS = {
    "drafts with a batch": lambda kw, rows: rows > 1 and _drafts(kw),
    # stock's assistant loses the tokenizer its stop strings need
    "stop strings with an assistant": lambda kw, rows: "stop_strings" in kw and "assistant_model" in kw,
    # stock's assisted generation derives a fractional min_length from a fractional limit
    # and then refuses it
    "fractional limit with drafts": lambda kw, rows: _drafts(kw) and any(
        isinstance(kw.get(name), float) for name in ("max_new_tokens", "min_new_tokens")),
}


def _eos_list(eos) -> list:
    if isinstance(eos, int):
        return [eos]
    return list(eos) if isinstance(eos, (list, tuple)) else []


def _count(value) -> bool:
    return isinstance(value, int) and value >= 1


def _not_finite(value) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _drafts(kwargs) -> bool:
    return "assistant_model" in kwargs or "prompt_lookup_num_tokens" in kwargs


def _on(model, device: str):
    """`model` as the profile runs it: float32 on the CPU, bfloat16 on CUDA."""
    return model if device == "cpu" else model.to(device=device, dtype=torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _model(family: str, device: str = "cpu"):
    return _on(tiny_model(family), device)


@functools.lru_cache(maxsize=None)
def _assistant(device: str = "cpu"):
    return _on(tiny_draft("llama"), device)


@functools.lru_cache(maxsize=None)
def _tokenizer():
    return tiny_tokenizer()


class _Streamer(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.chunks.append(None)


def _pick(draw, common, odd):
    """Mostly a value of `common`, now and then one of `odd`."""
    return draw(st.sampled_from(odd)) if draw(st.integers(0, 9)) == 0 else draw(st.sampled_from(common))


@st.composite
def calls(draw, device: str = "cpu"):
    """(family, input_ids, kwargs of generate without `sampler` / `seed`, flashspec's seed),
    ids and masks on the CPU (`_run` moves them), the assistant on `device`."""
    family = draw(st.sampled_from(FAMILIES))
    rows = draw(st.integers(1, 3))
    lengths = [draw(st.integers(1, 6)) for _ in range(rows)]
    width = max(lengths)
    ids = torch.tensor([[draw(st.integers(1, VOCAB - 1)) for _ in range(width)] for _ in range(rows)])
    mask = torch.tensor([[int(j >= width - n) for j in range(width)] for n in lengths])
    ids = torch.where(mask.bool(), ids, PAD)
    kwargs = {}
    odd_inputs = ["right", "hole", "none", "int32", "empty"]
    inputs = _pick(draw, ["left"], odd_inputs + (["out of range"] if device == "cpu" else []))
    if inputs == "right":
        mask = mask.flip(1)
        ids = ids.flip(1)
    elif inputs == "hole" and width > 2:
        mask[:, width // 2] = 0
    elif inputs == "int32":
        ids = ids.int()
    elif inputs == "empty":
        ids, mask = ids[:, :0], mask[:, :0]
    elif inputs == "out of range":
        ids = ids + VOCAB
    if inputs != "none":
        kwargs["attention_mask"] = mask

    sample = _pick(draw, [None, False, True, True], ["yes", 1])
    if sample is not None:
        kwargs["do_sample"] = sample
    for name, common, odd in (
            ("temperature", [0.7, 1.0, 1.5, 1], [0, 0.0, 2, -1.0, math.inf, math.nan, "0.5", [0.5, 1.0]]),
            ("top_k", [0, 1, 5, 50, 1000], [2**63, -1, 5.0, None, "5", True]),
            ("top_p", [0.5, 0.9, 1.0], [0.0, 1.5, -0.1, math.nan, "0.9", 1]),
            ("min_p", [0.0, 0.1, 0.5], [1.0, 1.5, math.nan, "0.1"])):
        if draw(st.booleans()):
            kwargs[name] = _pick(draw, common, odd)
    limit = _pick(draw, [1, 2, 3, 5, 8], [0, -1, 1.5, 2.5, "3", None, math.inf, 10**12])
    kwargs["max_new_tokens"] = limit
    if limit is None:
        kwargs["max_length"] = width + draw(st.integers(1, 6))
    endless = limit == 10**12 or limit == math.inf        # stock stops these by time only
    if endless or _pick(draw, [False], [True]):
        kwargs["max_time"] = _pick(draw, [0.02], [0.0, -1.0])
    eos = _pick(draw, [None, None, draw(st.integers(1, VOCAB - 1))],
                ([list(range(VOCAB))] if device == "cpu" else []) + [[], [3, 4, 5], "3"])
    if eos is not None:
        kwargs["eos_token_id"] = eos
    if draw(st.integers(0, 9)) == 0:
        kwargs["pad_token_id"] = draw(st.sampled_from([PAD, 7] + ([-3] if device == "cpu" else [])))
    if draw(st.integers(0, 4)) == 0:
        kwargs["num_return_sequences"] = _pick(draw, [2, 3], [0, -1, 2.0])

    drafts = draw(st.sampled_from(["none", "none", "assistant", "lookup"]))
    if drafts == "assistant":
        kwargs["assistant_model"] = _assistant(device)
        if draw(st.booleans()):
            kwargs["num_assistant_tokens"] = _pick(draw, [1, 3, 5], [0, -2, 2.5])
    elif drafts == "lookup":
        kwargs["prompt_lookup_num_tokens"] = _pick(draw, [1, 3, 5], [0, -1, 2.5, True])
        if draw(st.booleans()):
            kwargs["max_matching_ngram_size"] = _pick(draw, [1, 2, 3], [0, -1])
    for name, values in (("repetition_penalty", [1.3, 0.8, 0, "1.2"]),
                         ("no_repeat_ngram_size", [2, 3]),
                         ("min_new_tokens", [1, 2, 1.5]),
                         ("suppress_tokens", [[3, 4, 5]]),
                         ("remove_invalid_values", [True])):
        if draw(st.integers(0, 11)) == 0:
            kwargs[name] = draw(st.sampled_from(values))
    if rows == 1 and draw(st.integers(0, 7)) == 0:
        kwargs["stop_strings"] = [draw(st.sampled_from(["a", "e", "ba", "o"]))]
        kwargs["tokenizer"] = _tokenizer()
    output = draw(st.sampled_from(["tensor", "tensor", "dict", "streamer"]))
    if output == "dict":
        kwargs["return_dict_in_generate"] = True
    seed = _pick(draw, [None, 0, 12345], [2**63 - 1])
    return family, ids, kwargs, output, seed


def _run(model, ids, kwargs, output, **flash):
    """(sequences, streamed new tokens or None) of one call, or the exception it raised."""
    kwargs = dict(kwargs)
    ids = ids.to(model.device)
    if kwargs.get("attention_mask") is not None:
        kwargs["attention_mask"] = kwargs["attention_mask"].to(model.device)
    streamer = None
    if output == "streamer":
        kwargs["streamer"] = streamer = _Streamer()
    if output == "dict" and flash:
        flash["output_logprobs"] = True
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.generate(ids, **kwargs, **flash)
    except Exception as error:     # noqa: BLE001 -- the outcome under test
        return error
    sequences = (out if torch.is_tensor(out) else out.sequences).cpu()
    streamed = None
    if streamer is not None:
        assert streamer.chunks[-1] is None, "the streamer did not get end()"
        streamed = [t for chunk in streamer.chunks[1:-1] for t in chunk]
    return sequences, streamed


def _names_a_parameter(error: Exception, kwargs: dict) -> bool:
    names = set(kwargs) | {"input_ids", "attention_mask", "model", "eos_token_id", "seed",
                           "streamer", "output_logprobs"}
    message = str(error)
    return any(f"`{name}`" in message for name in names)


def _without_trailing(tokens: list, pad) -> list:
    while tokens and tokens[-1] == pad:
        tokens = tokens[:-1]
    return tokens


def _stopped_by_time(kwargs) -> bool:
    return kwargs.get("max_time") is not None


def _check_runs(ids, kwargs, output, stock_result, flash_result, sampling: bool,
                near_tie=None) -> str:
    """Assert what two runs must share; return the outcome's name. `near_tie(row, k, a, b)`
    (bf16 on CUDA): whether tokens a (flashspec's) and b (stock's) at new token k of `row`
    may differ by rounding; None: greedy tokens must be equal."""
    sequences, streamed = flash_result
    rows = ids.shape[0] * max(1, kwargs.get("num_return_sequences") or 1)
    width = ids.shape[1]
    pad = kwargs.get("pad_token_id", PAD)
    assert sequences.dtype == torch.long and sequences.shape[0] == rows, sequences.shape
    assert torch.equal(sequences[:, :width], ids.long().repeat_interleave(rows // ids.shape[0], 0))
    new = sequences[:, width:]
    assert bool((((new >= 0) & (new < VOCAB)) | (new == pad)).all()), ("invalid tokens", new)
    if streamed is not None and rows == 1:     # (stock streams a batch's rows interleaved)
        assert streamed == new[0].tolist(), (streamed, new[0].tolist())
    eos = _eos_list(kwargs.get("eos_token_id"))
    for row in new.tolist():
        ends = [j for j, token in enumerate(row) if token in eos]
        if ends:
            assert all(token == pad for token in row[ends[0] + 1:]), ("tokens after EOS", row)
    stock_sequences = stock_result[0] if not isinstance(stock_result, Exception) else None
    if sampling or stock_sequences is None:
        limit = kwargs.get("max_new_tokens")
        if isinstance(limit, (int, float)) and limit < 10**12:
            assert new.shape[1] <= math.ceil(limit)
        return "both run (sampled)" if sampling else "flash runs (documented extension)"
    stock_new = stock_sequences[:, width:]
    timed = _stopped_by_time(kwargs)
    if near_tie is None and not timed:
        assert torch.equal(sequences, stock_sequences), ("greedy differs", sequences, stock_sequences)
        return "both run (greedy equal)"
    ties = 0
    for row, (ours, theirs) in enumerate(zip(new.tolist(), stock_new.tolist())):
        if timed:   # rows the clock stopped are padded: compare what both emitted
            ours, theirs = _without_trailing(ours, pad), _without_trailing(theirs, pad)
        common = min(len(ours), len(theirs))
        first = next((k for k in range(common) if ours[k] != theirs[k]), None)
        if first is None:
            continue
        assert near_tie is not None, ("greedy prefix", ours, theirs)
        assert near_tie(row, first, ours[first], theirs[first]), \
            ("greedy differs, not a near-tie", row, first, ours, theirs)
        ties += 1
    if timed:
        return "both run (greedy, time-limited prefix equal)" if not ties else \
            "both run (greedy, time-limited, a near-tie)"
    if not ties:
        assert new.shape == stock_new.shape, ("greedy lengths differ", new, stock_new)
        return "both run (greedy equal)"
    return "both run (greedy, a near-tie)"


def _bf16_near_tie(model, ids, stock_kwargs):
    """`_check_runs`'s `near_tie` for a bf16 model: stock's scores at new token k of `row`
    (its greedy run again, to k + 1 new tokens, with `output_scores`) hold tokens a and b
    within `BF16_TOL` of each other."""
    def near_tie(row, k, a, b):
        kwargs = {name: value for name, value in stock_kwargs.items()
                  if name not in ("max_time", "max_length", "streamer")}
        kwargs.update(max_new_tokens=k + 1, output_scores=True, return_dict_in_generate=True)
        mask = kwargs.get("attention_mask")
        if mask is not None:
            kwargs["attention_mask"] = mask.to(model.device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.generate(ids.to(model.device), **kwargs)
        scores = out.scores[k][row].double().cpu()
        return is_near_tie(scores, False, 1.0, 0, 1.0, 0.0, torch.zeros_like(scores), a, b,
                           tol=BF16_TOL)
    return near_tie


def check_call(family, ids, kwargs, output, seed, device: str = "cpu") -> str:
    """Run one drawn call both ways and return its outcome; fail on a crash or a difference."""
    model = _model(family, device)
    count = kwargs.get("num_return_sequences", 1)
    rows = ids.shape[0] * (count if isinstance(count, int) and count > 1 else 1)
    stock_kwargs = dict(kwargs)
    if any(when(kwargs, rows) for when in DOCUMENTED_EXTENSIONS.values()) or any(
            when(kwargs, ids) for when in DOCUMENTED_DIFFERENCES.values()):
        for name in _DRAFT_OPTIONS:     # stock refuses these drafts: same tokens without them
            stock_kwargs.pop(name, None)
    stock_result = _run(model, ids, stock_kwargs, output)
    flash_result = _run(model, ids, kwargs, output, sampler="flash", seed=seed)
    flash_options = dict(kwargs, seed=seed, output_logprobs=output == "dict",
                         streamer=output == "streamer")
    if isinstance(flash_result, Exception):
        assert isinstance(flash_result, (ValueError, TypeError)), \
            f"flashspec crashed: {type(flash_result).__name__}: {flash_result}"
        if stock_kwargs != kwargs and not isinstance(stock_result, Exception):
            # stock's verdict on the draft options it was spared: the whole call (flashspec
            # may have handed it to stock), else its first row alone
            stock_result = _run(model, ids, kwargs, output)
            if not isinstance(stock_result, Exception):
                first = dict(kwargs, **({"attention_mask": kwargs["attention_mask"][:1]}
                                        if "attention_mask" in kwargs else {}))
                stock_result = _run(model, ids[:1], first, output)
        same_as_stock = (isinstance(stock_result, Exception) and type(stock_result) is type(flash_result)
                         and str(stock_result) == str(flash_result))
        assert same_as_stock or _names_a_parameter(flash_result, flash_options), \
            f"flashspec's error names no parameter: {flash_result}"
        if isinstance(stock_result, Exception):
            return "both refuse"
        documented = [name for name, when in DOCUMENTED_REFUSALS.items()
                      if when(flash_options) and f"`{name}`" in str(flash_result)]
        assert documented, f"flashspec refuses what stock runs: {flash_result}"
        return f"documented refusal ({documented[0]})"
    if isinstance(stock_result, Exception):
        extensions = [name for name, when in DOCUMENTED_EXTENSIONS.items() if when(kwargs, rows)]
        assert extensions, f"flashspec runs what stock refuses ({type(stock_result).__name__}: {stock_result})"
    sampling = bool(kwargs.get("do_sample"))
    near_tie = _bf16_near_tie(model, ids, stock_kwargs) if device != "cpu" else None
    return _check_runs(ids, kwargs, output, stock_result, flash_result, sampling, near_tie)


@pytest.fixture(scope="module", autouse=True)
def _quiet_single_threaded():
    threads, verbosity = torch.get_num_threads(), transformers.logging.get_verbosity()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    yield
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity(verbosity)
    if OUTCOMES:
        print("\nfuzz outcomes:", dict(sorted(OUTCOMES.items())))


@seed(FUZZ_SEED)
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck), print_blob=True,
          phases=[Phase.explicit, Phase.generate, Phase.shrink])
@given(call=calls())
def test_generate_matches_stock_or_refuses_clearly(call):
    OUTCOMES[check_call(*call)] += 1


_CUDA_STARTED: list[float] = []


@pytest.mark.gpu
@seed(FUZZ_SEED)
# No shrinking: a failure on CUDA can leave process-wide state behind (a CUDA graph capture
# aborted midway, say), and every example shrinking then tries would fail for that reason,
# hiding the one that broke it. The first failing example is reported as drawn.
@settings(max_examples=CUDA_EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck), print_blob=True,
          phases=[Phase.explicit, Phase.generate])
@given(call=calls(device="cuda"))
def test_cuda_bf16_matches_stock_or_refuses_clearly(call):
    """The CUDA profile (module docstring): bf16, the fast engine, stock on the same GPU."""
    if not _CUDA_STARTED:
        _CUDA_STARTED.append(time.monotonic())
    if time.monotonic() - _CUDA_STARTED[0] > CUDA_SECONDS:
        OUTCOMES["skipped (time budget)"] += 1
        return
    OUTCOMES[check_call(*call, device="cuda")] += 1
