"""Differential fuzzing of `generate(sampler="flash")` against stock transformers (issue 36).

Each example draws one `generate` call and runs it twice on the same tiny float32 model:
stock transformers (`torch.manual_seed(0)`) and `sampler="flash"`. What it draws:

* a model family: Llama, Qwen3, Mistral (sliding window), GPT-2, Cohere (logit scale),
  Gemma-2 (softcap);
* prompts: batch 1-3, lengths 1-6, left padding, often a right-padded mask or one with a
  hole (a dead column amid a row's tokens), now and then no mask, int32 ids, an empty
  prompt, ids outside the vocabulary;
* inputs the decoder's forward takes: `inputs_embeds` (the model's embeddings of the ids,
  alone or beside the ids), `position_ids` as stock derives them from the mask (a padding
  column's 0 or 1), now and then other ones (stock runs those), GPT-2's `token_type_ids`;
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
* outputs: `return_dict_in_generate` with `output_logprobs`, now and then with
  `output_attentions` (on an eager-attention copy of the model) and/or
  `output_hidden_states`; a streamer (batch 1).

What it asserts, per example (`outcome`):

* both run: greedy sequences are equal token for token (only the common prefix of each
  row when `max_time` stops the runs); sampled sequences hold the prompt, valid token ids,
  nothing but padding after a row's EOS, and the lengths the limits allow; a streamer
  received exactly the returned new tokens;
* attentions / hidden states: one entry per new token, a tuple over layers (and the
  embeddings) of [rows, heads, queries, keys] / [rows, queries, hidden] tensors; the shapes
  of stock's where stock ran the same call to the same tokens; where stock ran it greedily
  without drafts and gave flashspec's tokens, stock's values (`torch.testing.assert_close`,
  float32) for each row up to its EOS, and NaN after it;
* flashspec raises a ValueError or TypeError whose message names a drawn parameter, where
  stock also fails or the refusal is one README documents (`DOCUMENTED_REFUSALS`);
* never another exception type from flashspec, never a run where stock fails except the
  documented extensions (`DOCUMENTED_EXTENSIONS`), never a silent difference (where stock's
  assisted generation differs from its plain generation, `DOCUMENTED_DIFFERENCES`, flashspec
  is compared with the plain one).

``-s`` also prints, per drawn input (holes, right padding, `inputs_embeds`, ...), how many
calls flashspec ran on its engine and how many it deferred to stock generate (its
warning), and why.

Two more tests draw sequences of calls (greedy or seeded: `temperature`, `top_k`, `top_p`;
now and then an EOS; drafts none, an assistant or prompt lookup), each call on the engine
(a deferral to stock fails them):

* `test_two_calls_continuing_a_passed_cache_are_one_call`: a left-padded prompt (batch
  1-3, lengths 1-8, now and then a hole where no sliding window counts it), a first call
  that returns its cache (`return_dict_in_generate`) or fills an empty `DynamicCache`
  passed in, then a second call on its sequences and 1-4 more ids per row, continuing that
  cache, its prompt given as every column's ids, the ids after the cache's columns, or
  every column's embeddings, now and then with `position_ids` as stock derives them (every
  column's, or those after the cache's), GPT-2 now and then with token types. Greedy: each
  call's tokens are stock's (stock continuing its own cache); both: the second call's
  tokens are those of one flashspec call on the concatenated prompt (seeded: the noise is
  keyed by sequence position), and the cache is updated in place to every column but the
  last.
* `test_calls_in_a_row_on_one_model_cross_slot_capacities`: 2-5 calls in a row on one
  model, whose engine keeps its slots from call to call (created anew per example), with
  batch sizes 1-3 (often the previous call's) and prompts short (1-16), crossing the 256
  KV columns of a first slot while they generate (233-255) or past them (257-300), left
  padded (now and then a hole). Greedy: stock's tokens; seeded: the tokens of the same call
  on a copy of the model whose engine is created for it. ``-s`` counts the calls that made
  a new slot, kept one, and grew one past its KV columns (the engine's log).

Seeded and bounded for CI: hypothesis seed FLASHSPEC_FUZZ_SEED (default 0),
FLASHSPEC_FUZZ_EXAMPLES examples of the single calls (default 300), half as many passed
caches and a sixth as many sequences (about 30 s in all on one core). The large profile
runs by hand, e.g. ``FLASHSPEC_FUZZ_EXAMPLES=2600 FLASHSPEC_FUZZ_SEED=1 python -m pytest
-q tests/test_fuzz_generate.py -s`` (each seed draws other examples; ``-s`` prints the
count of each outcome).

The CUDA profile (`test_cuda_bf16_matches_stock_or_refuses_clearly`, marked gpu, run by
scripts/gpu_check.sh's part ``fuzz``) draws the same single calls and runs them as users do: the
same tiny models in bfloat16 on CUDA, stock's generate against the fast engine (compiled
forwards, CUDA graphs, the fused kernels; a first call with `max_time` runs uncompiled).
FLASHSPEC_FUZZ_CUDA_EXAMPLES examples (default 300); once FLASHSPEC_FUZZ_CUDA_SECONDS (default
240) have passed, the remaining examples are counted as skipped, not run. It compares what
bf16 leaves meaningful:

* refusals and errors exactly as above (the argument checks do not depend on the device);
* runs: valid token ids, nothing after EOS, lengths within the limits, streamer tokens equal
  to the returned ones, attentions' and hidden states' structure (not their bf16 values),
  as above;
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
import contextlib
import functools
import logging
import math
import os
import time
import warnings

import pytest
import torch
import transformers
from hypothesis import HealthCheck, Phase, given, seed, settings, strategies as st
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from flashspec.bench.statistics import is_near_tie
from flashspec.generation.engine import drop_engine

from _models import PAD, VOCAB, tiny_draft, tiny_model
from test_generate import tiny_tokenizer

FUZZ_EXAMPLES = int(os.environ.get("FLASHSPEC_FUZZ_EXAMPLES", "300"))
CACHE_EXAMPLES = max(1, FUZZ_EXAMPLES // 2)         # two calls continuing a passed cache
SEQUENCE_EXAMPLES = max(1, FUZZ_EXAMPLES // 6)      # 2-5 calls in a row on one model
FUZZ_SEED = int(os.environ.get("FLASHSPEC_FUZZ_SEED", "0"))
CUDA_EXAMPLES = int(os.environ.get("FLASHSPEC_FUZZ_CUDA_EXAMPLES", "300"))
CUDA_SECONDS = float(os.environ.get("FLASHSPEC_FUZZ_CUDA_SECONDS", "240"))
BF16_TOL = 3e-2             # relative: a near-tie of bf16 logits (test_generate_gpu.py's)
FAMILIES = ("llama", "qwen3", "mistral", "gpt2", "cohere", "gemma2")
WINDOWED = ("mistral", "gemma2")    # sliding windows: holes under them run on stock (README)
GPT2_POSITIONS = 256                # the tiny GPT-2's position embeddings (n_positions)
DEFERS = "defers this call to stock transformers"
OUTCOMES: collections.Counter = collections.Counter()
# Calls flashspec ran, by the inputs they drew: "<input>: engine" or "<input>: stock" (the
# call deferred to stock generate, with its warning), and why calls deferred.
ENGINE: collections.Counter = collections.Counter()
DEFERRALS: collections.Counter = collections.Counter()
# Attentions / hidden states checked: "<name>: structure", "... stock's shapes", "... values".
FORWARD_OUTPUTS: collections.Counter = collections.Counter()

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
    # stock's assisted generation does not feed the target `inputs_embeds` as its plain
    # generation does: beside ids it feeds the ids, alone its assistant fails (a reshape of
    # an empty prompt) and prompt lookup samples other tokens; flashspec's prefill takes the
    # embeddings with or without drafts (tests/test_cache_and_inputs.py)
    "inputs_embeds, with drafts": lambda kw, ids: _drafts(kw) and "inputs_embeds" in kw,
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
    # the target's token types, which stock also hands the assistant (and refuses where it
    # takes none); flashspec's assistant drafts without them (README)
    "token types with an assistant": lambda kw, rows: "token_type_ids" in kw and "assistant_model" in kw,
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
def _model(family: str, device: str = "cpu", eager: bool = False):
    """The tiny model of `family`; `eager`: with eager attention (stock returns attention
    weights only there; sdpa gives an empty tuple per token)."""
    model = tiny_model(family)
    if eager:
        model.set_attn_implementation("eager")
    return _on(model, device)


@functools.lru_cache(maxsize=None)
def _twin(family: str):
    """A second copy of `_model(family)` (the same weights): each call on it runs on an
    engine created for it (`drop_engine` before), the reference for seeded calls on the
    model whose engine keeps its slots from call to call."""
    return tiny_model(family)


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
    odd_inputs = ["none", "int32", "empty"]
    inputs = _pick(draw, ["left", "left", "left", "right", "hole"],
                   odd_inputs + (["out of range"] if device == "cpu" else []))
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
    # What a decoder's forward takes, as stock feeds it: the model's embeddings of the ids
    # (`_arguments` makes them) alone or beside the ids; position ids as stock derives them
    # from the mask (a padding column's either 0, stock's, or 1: a right-padded row's first
    # token is fed at its last column's), now and then others (stock runs those); GPT-2's
    # token types.
    if inputs != "out of range" and draw(st.integers(0, 7)) == 0:
        kwargs["inputs_embeds"] = draw(st.sampled_from(["only", "with ids"]))
    if inputs not in ("none", "empty") and draw(st.integers(0, 7)) == 0:
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, draw(st.sampled_from([0, 1])))
        kwargs["position_ids"] = positions + 3 if draw(st.integers(0, 9)) == 0 else positions
    if family == "gpt2" and draw(st.integers(0, 3)) == 0:
        kwargs["token_type_ids"] = torch.tensor(
            [[draw(st.integers(0, 2)) for _ in range(ids.shape[1])] for _ in range(rows)])

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
        if draw(st.booleans()):                 # (attention weights: `_model(eager=True)`)
            for name in draw(st.sampled_from([("output_attentions",), ("output_hidden_states",),
                                              ("output_attentions", "output_hidden_states")])):
                kwargs[name] = True
    seed = _pick(draw, [None, 0, 12345], [2**63 - 1])
    return family, ids, kwargs, output, seed


_BATCHED = ("attention_mask", "position_ids", "token_type_ids")    # drawn [batch, columns]


def _arguments(model, ids, kwargs):
    """generate()'s input ids (None: embeddings alone) and keyword arguments for `model`:
    the drawn tensors on its device, a drawn `inputs_embeds` ("only" or "with ids") as the
    model's embeddings of `ids`."""
    kwargs = dict(kwargs)
    ids = ids.to(model.device)
    for name in _BATCHED:
        if torch.is_tensor(kwargs.get(name)):
            kwargs[name] = kwargs[name].to(model.device)
    embeds = kwargs.pop("inputs_embeds", None)
    if embeds is None:
        return ids, kwargs
    with torch.no_grad():
        kwargs["inputs_embeds"] = model.get_input_embeddings()(ids)
    return (None if embeds == "only" else ids), kwargs


def _first_row(kwargs) -> dict:
    return dict(kwargs, **{name: kwargs[name][:1] for name in _BATCHED
                           if torch.is_tensor(kwargs.get(name))})


# One call's result: `sequences` (on the CPU), the streamed new tokens (or None), the output
# object (or the tensor), and whether flashspec deferred it to stock generate (its warning).
Run = collections.namedtuple("Run", "sequences streamed output deferred")


def _deferral(caught) -> str | None:
    """The reason of a "defers this call to stock" warning among `caught`, else None."""
    for warning in caught:
        message = str(warning.message)
        if DEFERS in message:
            return message.split("generate(): ", 1)[-1]
    return None


def _run(model, ids, kwargs, output, **flash):
    """The `Run` of one call, or the exception it raised (its `deferred`: the reason where
    flashspec deferred the call to stock, which raised it)."""
    ids, kwargs = _arguments(model, ids, kwargs)
    streamer = None
    if output == "streamer":
        kwargs["streamer"] = streamer = _Streamer()
    if output == "dict" and flash:
        flash["output_logprobs"] = True
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model.generate(ids, **kwargs, **flash)
    except Exception as error:     # noqa: BLE001 -- the outcome under test
        error.deferred = _deferral(caught)
        return error
    sequences = (out if torch.is_tensor(out) else out.sequences).cpu()
    streamed = None
    if streamer is not None:
        assert streamer.chunks[-1] is None, "the streamer did not get end()"
        streamed = [t for chunk in streamer.chunks[1:-1] for t in chunk]
    return Run(sequences, streamed, out, _deferral(caught))


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
    may differ by rounding; None: greedy tokens must be equal. `ids`: the prompt's ids as
    `sequences` holds them (none for `inputs_embeds` alone)."""
    sequences, streamed = flash_result.sequences, flash_result.streamed
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
    stock_sequences = stock_result.sequences if not isinstance(stock_result, Exception) else None
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
        inputs, kwargs = _arguments(model, ids, kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.generate(inputs, **kwargs)
        scores = out.scores[k][row].double().cpu()
        return is_near_tie(scores, False, 1.0, 0, 1.0, 0.0, torch.zeros_like(scores), a, b,
                           tol=BF16_TOL)
    return near_tie


def check_call(family, ids, kwargs, output, seed, device: str = "cpu") -> str:
    """Run one drawn call both ways and return its outcome; fail on a crash or a difference."""
    model = _model(family, device, eager=bool(kwargs.get("output_attentions")))
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
        # (a call flashspec deferred to stock may fail as stock fails it: checked below)
        assert isinstance(flash_result, (ValueError, TypeError)) or flash_result.deferred, \
            f"flashspec crashed: {type(flash_result).__name__}: {flash_result}"
        if stock_kwargs != kwargs and not isinstance(stock_result, Exception):
            # stock's verdict on the draft options it was spared: the whole call (flashspec
            # may have handed it to stock), else its first row alone
            stock_result = _run(model, ids, kwargs, output)
            if not isinstance(stock_result, Exception):
                stock_result = _run(model, ids[:1], _first_row(kwargs), output)
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
    if flash_result.deferred and stock_kwargs != kwargs:
        # flashspec deferred the call to stock (README): stock's tokens with the drafts
        stock_kwargs = dict(kwargs)
        stock_result = _run(model, ids, kwargs, output)
    if isinstance(stock_result, Exception):
        extensions = [name for name, when in DOCUMENTED_EXTENSIONS.items() if when(kwargs, rows)]
        assert extensions, f"flashspec runs what stock refuses ({type(stock_result).__name__}: {stock_result})"
    sampling = bool(kwargs.get("do_sample"))
    near_tie = _bf16_near_tie(model, ids, stock_kwargs) if device != "cpu" else None
    shown = ids[:, :0] if kwargs.get("inputs_embeds") == "only" else ids   # `sequences`' prompt
    outcome = _check_runs(shown, kwargs, output, stock_result, flash_result, sampling, near_tie)
    _count_inputs(kwargs, flash_result.deferred)
    # stock's values where stock ran the call greedily without drafts and both gave the same
    # tokens (float32: the CPU profile)
    same_tokens = (device == "cpu" and outcome == "both run (greedy equal)"
                   and not _drafts(stock_kwargs))
    _check_forward_outputs(model, shown, kwargs, stock_kwargs, stock_result, flash_result,
                           same_tokens)
    return outcome


def _count_inputs(kwargs, deferred: str | None) -> None:
    """`ENGINE` and `DEFERRALS` for a call flashspec ran."""
    mask = kwargs.get("attention_mask")
    drawn = [name for name in ("inputs_embeds", "position_ids", "token_type_ids",
                               "output_attentions", "output_hidden_states") if name in kwargs]
    if torch.is_tensor(mask) and mask.shape[1] > 0:
        if bool((mask[:, -1] == 0).any()):
            drawn.append("right padding")
        elif bool((mask[:, 1:] < mask[:, :-1]).any()):
            drawn.append("holes")
    for name in drawn + ["every call"]:
        ENGINE[f"{name}: {'stock' if deferred else 'engine'}"] += 1
    if deferred:
        DEFERRALS[deferred[:90]] += 1


def _check_forward_outputs(model, ids, kwargs, stock_kwargs, stock_result, flash_result,
                           same_tokens: bool) -> None:
    """`output_attentions` / `output_hidden_states` (README: stock's per-token tuples over
    layers): one entry per new token, each a tuple of a [rows, heads, queries, keys] weight
    tensor per layer or a [rows, queries, hidden] state tensor per layer and the embeddings';
    the shapes of stock's where stock ran the same call to the same tokens; with
    `same_tokens`, stock's values (float32 tolerance) for each row up to its EOS, NaN after
    it (README)."""
    out = flash_result.output
    theirs = None if isinstance(stock_result, Exception) else stock_result.output
    config = model.config
    new = flash_result.sequences[:, ids.shape[1]:]
    eos = _eos_list(kwargs.get("eos_token_id"))
    ended = [next((k for k, token in enumerate(row) if token in eos), None) for row in new.tolist()]
    for name, layers in (("attentions", config.num_hidden_layers),
                         ("hidden_states", config.num_hidden_layers + 1)):
        if not kwargs.get(f"output_{name}"):
            continue
        ours = getattr(out, name)
        assert isinstance(ours, tuple) and len(ours) == new.shape[1], (name, type(ours), new.shape)
        for k, entry in enumerate(ours):
            assert isinstance(entry, tuple) and len(entry) == layers, (name, k, len(entry))
            for tensor in entry:
                rows, *inner = tensor.shape
                ok = (len(inner) == 3 and inner[0] == config.num_attention_heads
                      if name == "attentions" else len(inner) == 2 and inner[1] == config.hidden_size)
                assert rows == new.shape[0] and ok, (name, k, tensor.shape)
        if theirs is None or not (stock_kwargs == kwargs or same_tokens) \
                or not torch.equal(stock_result.sequences, flash_result.sequences):
            FORWARD_OUTPUTS[f"{name}: structure"] += 1
            continue
        stocks = getattr(theirs, name)
        assert len(stocks) == len(ours), (name, len(stocks), len(ours))
        for k, (entry, stock_entry) in enumerate(zip(ours, stocks)):
            assert [t.shape for t in entry] == [t.shape for t in stock_entry], \
                (name, k, [t.shape for t in entry], [t.shape for t in stock_entry])
            if not same_tokens:
                continue
            live = torch.tensor([end is None or k <= end for end in ended])
            for layer, (a, b) in enumerate(zip(entry, stock_entry)):
                a = a.cpu()
                assert bool(a[~live].isnan().all()), (name, k, layer, "a row after its EOS is not NaN")
                torch.testing.assert_close(a[live], b.cpu()[live],
                                           msg=lambda m: f"{name}[{k}][{layer}]: {m}")
        FORWARD_OUTPUTS[f"{name}: stock's {'values' if same_tokens else 'shapes'}"] += 1


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
    if ENGINE:
        print("flashspec ran, by input:", dict(sorted(ENGINE.items())))
    if DEFERRALS:
        print("deferred to stock, why:", dict(DEFERRALS.most_common()))
    if FORWARD_OUTPUTS:
        print("attentions / hidden states checked:", dict(sorted(FORWARD_OUTPUTS.items())))


@seed(FUZZ_SEED)
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck), print_blob=True,
          phases=[Phase.explicit, Phase.generate, Phase.shrink])
@given(call=calls())
def test_generate_matches_stock_or_refuses_clearly(call):
    OUTCOMES[check_call(*call)] += 1


# --------------------------------------------------------------------------------------
# A passed cache: two calls, the second continuing the first's cache, are one call
# --------------------------------------------------------------------------------------

def _left_padded(draw, lengths: list, alphabet: int = VOCAB - 1):
    """(ids, mask) of left-padded prompts of `lengths`, tokens from 1 to `alphabet` (a small
    alphabet repeats n-grams: prompt lookup's drafts hit)."""
    width = max(lengths)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    ids = torch.randint(1, alphabet + 1, (len(lengths), width), generator=generator)
    mask = torch.tensor([[int(j >= width - n) for j in range(width)] for n in lengths])
    return torch.where(mask.bool(), ids, PAD), mask


def _draft_options(draw) -> dict:
    drafts = draw(st.sampled_from(["none", "assistant", "lookup"]))
    if drafts == "assistant":
        return dict(assistant_model=_assistant(), num_assistant_tokens=draw(st.integers(1, 5)))
    if drafts == "lookup":
        return dict(prompt_lookup_num_tokens=draw(st.integers(1, 5)))
    return {}


def _sampling(draw) -> tuple[dict, int | None]:
    """(greedy or sampling options, flashspec's seed: None for greedy), now and then an EOS."""
    kwargs = dict(do_sample=draw(st.booleans()))
    if kwargs["do_sample"]:
        for name, values in (("temperature", [0.7, 1.5]), ("top_k", [5, 50]), ("top_p", [0.9])):
            if draw(st.integers(0, 3)) == 0:
                kwargs[name] = draw(st.sampled_from(values))
    if draw(st.integers(0, 3)) == 0:
        kwargs["eos_token_id"] = draw(st.integers(1, VOCAB - 1))
    return kwargs, (draw(st.sampled_from([0, 7, 2**63 - 1])) if kwargs["do_sample"] else None)


@st.composite
def continuations(draw):
    """(family, ids, mask, the next turn's ids, options of both calls, seed, the first and the
    second call's drafts and max_new_tokens, how the first hands its cache over, how the
    second gives its prompt, its `position_ids` (None, or stock's of "all" columns or of
    those "after" the cache's), GPT-2's token types (None, or those of the prompt's and of
    the next turn's columns))."""
    family = draw(st.sampled_from(FAMILIES))
    rows = draw(st.integers(1, 3))
    ids, mask = _left_padded(draw, [draw(st.integers(1, 8)) for _ in range(rows)])
    if family not in WINDOWED and ids.shape[1] > 2 and draw(st.integers(0, 3)) == 0:
        mask[:, ids.shape[1] // 2] = 0
    more = torch.randint(1, VOCAB, (rows, draw(st.integers(1, 4))),
                         generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16))))
    kwargs, seed_ = _sampling(draw)
    first = dict(max_new_tokens=draw(st.integers(1, 6)), **_draft_options(draw))
    second = dict(max_new_tokens=draw(st.integers(1, 6)), **_draft_options(draw))
    # "returned": return_dict_in_generate's past_key_values; "filled": an empty DynamicCache
    # passed to the first call, filled in place
    handed = draw(st.sampled_from(["returned", "returned", "filled"]))
    # the second call's prompt: every column's ids, the ids after the cache's columns (the
    # mask covering all), or every column's embeddings
    form = draw(st.sampled_from(["ids", "ids", "new ids", "embeds"]))
    positions = draw(st.sampled_from([None, None, "all", "after"]))
    types = None
    if family == "gpt2" and draw(st.booleans()):
        types = tuple(torch.tensor([[draw(st.integers(0, 2)) for _ in range(t.shape[1])]
                                    for _ in range(rows)]) for t in (ids, more))
    return family, ids, mask, more, kwargs, seed_, first, second, handed, form, positions, types


def _generate(model, ids, mask, kwargs, **flash):
    """`model.generate` of `ids` (or of keyword `inputs_embeds`) under `mask`, quietly; fails
    where flashspec defers the call to stock."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(ids, attention_mask=mask, **kwargs, **flash)
    deferred = _deferral(caught)
    assert deferred is None, f"flashspec deferred the call to stock: {deferred}"
    return out


def _first_turn(model, ids, mask, kwargs, handed: str, **flash):
    """(sequences, cache) of a first call that returns its cache or fills the one passed."""
    if handed == "filled":
        cache = DynamicCache()
        return _generate(model, ids, mask, dict(kwargs, past_key_values=cache), **flash), cache
    out = _generate(model, ids, mask, dict(kwargs, return_dict_in_generate=True), **flash)
    return out.sequences, out.past_key_values


def _next_turn(model, ids, mask, cache, form: str, kwargs, positions=None, **flash):
    """The new tokens of a call on `ids` continuing `cache` (None: one call without a
    cache), its prompt given as `form`, with stock's `position_ids` of `positions` ("all"
    columns or those "after" the cache's; None: none)."""
    if positions is not None:
        held = cache.get_seq_length() if cache is not None and positions == "after" else 0
        kwargs = dict(kwargs, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)[:, held:])
    if cache is None:
        return _generate(model, ids, mask, kwargs, **flash)[:, ids.shape[1]:]
    kwargs = dict(kwargs, past_key_values=cache)
    if form == "embeds":
        with torch.no_grad():
            embeds = model.get_input_embeddings()(ids)
        return _generate(model, None, mask, dict(kwargs, inputs_embeds=embeds), **flash)
    held = cache.get_seq_length() if form == "new ids" else 0
    out = _generate(model, ids[:, held:], mask, kwargs, **flash)
    assert torch.equal(out[:, :ids.shape[1] - held], ids[:, held:])
    return out[:, ids.shape[1] - held:]


def check_continuation(family, ids, mask, more, kwargs, seed_, first, second, handed, form,
                       positions, types) -> str:
    """A first call and a second on its sequences and `more` ids continuing its cache
    (README, `past_key_values`): greedy, each call's tokens are stock's (stock continuing
    its own cache, without drafts) and the second's those of one flashspec call on the
    concatenated prompt; seeded, the second's tokens are that one call's (the noise is keyed
    by sequence position). The cache is updated in place to every column but the last."""
    model = _model(family)
    flash = dict(sampler="flash", seed=seed_)
    greedy = not kwargs["do_sample"]
    kwargs1 = dict(kwargs, token_type_ids=types[0]) if types is not None else kwargs
    ours, cache = _first_turn(model, ids, mask, dict(kwargs1, **first), handed, **flash)
    assert cache.get_seq_length() == ours.shape[1] - 1
    if greedy:
        theirs, stock_cache = _first_turn(model, ids, mask, dict(
            kwargs1, max_new_tokens=first["max_new_tokens"]), handed)
        assert torch.equal(ours, theirs), ("first call", ours, theirs)
    ids2 = torch.cat([ours, more], dim=1)
    mask2 = torch.nn.functional.pad(mask, (0, ids2.shape[1] - mask.shape[1]), value=1)
    kwargs2 = kwargs
    if types is not None:       # the first call's new tokens took its prompt's last type
        generated = ours.shape[1] - ids.shape[1]
        kwargs2 = dict(kwargs, token_type_ids=torch.cat(
            [types[0], types[0][:, -1:].expand(-1, generated), types[1]], dim=1))
    once = _next_turn(model, ids2, mask2, None, "ids", dict(kwargs2, **second), **flash)
    continued = _next_turn(model, ids2, mask2, cache, form, dict(kwargs2, **second), positions,
                           **flash)
    assert torch.equal(continued, once), ("two calls are not one", continued, once)
    assert cache.get_seq_length() == ids2.shape[1] + continued.shape[1] - 1
    if greedy:
        theirs = _next_turn(model, ids2, mask2, stock_cache, form, dict(
            kwargs2, max_new_tokens=second["max_new_tokens"]), positions)
        assert torch.equal(continued, theirs), ("second call", continued, theirs)
        assert stock_cache.get_seq_length() == cache.get_seq_length()
    if positions is not None:
        ENGINE[f"passed cache, position_ids of {positions} columns: engine"] += 1
    if types is not None:
        ENGINE["passed cache, token_type_ids: engine"] += 1
    return f"passed cache ({'greedy' if greedy else 'seeded'}, {handed}, {form})"


@seed(FUZZ_SEED)
@settings(max_examples=CACHE_EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck), print_blob=True,
          phases=[Phase.explicit, Phase.generate, Phase.shrink])
@given(call=continuations())
def test_two_calls_continuing_a_passed_cache_are_one_call(call):
    OUTCOMES[check_continuation(*call)] += 1


# --------------------------------------------------------------------------------------
# Calls in a row on one model: slots kept, grown past their columns, shared by batches
# --------------------------------------------------------------------------------------

@st.composite
def call_sequences(draw):
    """(family, [(ids, mask, kwargs, seed, more)] of 2-5 calls): batch 1-3; prompts short
    (1-16, max_new_tokens 1-24), crossing the 256 KV columns of a first slot while they
    generate (233-255, max_new_tokens to past 256 columns, at most 24), or past them
    (257-300, max_new_tokens 1-24); drafts none, an assistant or prompt lookup; greedy or
    seeded; now and then returning the cache, and a next call (`more`: its 1-4 new ids per
    row; ids and mask None) continuing it on the returned sequences, greedy or seeded as
    that one; GPT-2's prompts and new tokens within its 256 positions."""
    family = draw(st.sampled_from(FAMILIES))
    sequence = []
    end = 0                         # the previous call's prompt and new tokens, at most
    for _ in range(draw(st.integers(2, 5))):
        kwargs, seed_ = _sampling(draw)
        limit = draw(st.integers(1, 24))
        more = None
        if sequence and sequence[-1][2].get("return_dict_in_generate") and draw(st.booleans()):
            more = torch.randint(1, VOCAB, (sequence[-1][4].shape[0] if sequence[-1][0] is None
                                            else sequence[-1][0].shape[0], draw(st.integers(1, 4))),
                                 generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16))))
            if family == "gpt2" and end + more.shape[1] + limit > GPT2_POSITIONS:
                more = None
        if more is not None:        # the previous call's cache, on its sequences and `more`
            kwargs, seed_ = dict(kwargs, do_sample=sequence[-1][2]["do_sample"]), sequence[-1][3]
            ids = mask = None
            end += more.shape[1] + limit
        else:
            # the previous call's batch size (its slot) or any
            rows = (len(sequence[-1][4] if sequence[-1][0] is None else sequence[-1][0])
                    if sequence and draw(st.booleans()) else draw(st.integers(1, 3)))
            size = draw(st.sampled_from(["short", "crossing", "past"]))
            width = (draw(st.integers(1, 16)) if size == "short" else
                     draw(st.integers(233, 255)) if size == "crossing" else
                     draw(st.integers(257, 300)))
            if size == "crossing":
                limit = max(limit, 257 - width)
            if family == "gpt2":
                width = min(width, GPT2_POSITIONS - limit)
            lengths = [width] + [draw(st.integers(1, width)) for _ in range(rows - 1)]
            ids, mask = _left_padded(draw, lengths, draw(st.sampled_from([3, 16, VOCAB - 1])))
            if family not in WINDOWED and width > 2 and draw(st.integers(0, 4)) == 0:
                mask[:, width // 2] = 0
            end = width + limit
        if draw(st.integers(0, 2)) == 0:
            kwargs["return_dict_in_generate"] = True
        kwargs.update(max_new_tokens=limit, **_draft_options(draw))
        sequence.append((ids, mask, kwargs, seed_, more))
    return family, sequence


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _engine_log():
    """Inside, the list of what flashspec's engine logs ("new slot: ...", "slot of 2 rows
    grown to 512 KV columns", ...)."""
    logger, handler = logging.getLogger("flashspec"), _Messages()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@seed(FUZZ_SEED)
@settings(max_examples=SEQUENCE_EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck), print_blob=True,
          phases=[Phase.explicit, Phase.generate, Phase.shrink])
@given(sequence=call_sequences())
def test_calls_in_a_row_on_one_model_cross_slot_capacities(sequence):
    """Each call on the one model, whose engine keeps its slots from call to call (created
    anew for each example: a failure shrinks and replays alone), gives, greedy, stock's
    tokens (without drafts), and seeded the tokens of the same call on an engine created for
    it (`_twin`); a call continuing the previous one's returned cache does so on each side
    (stock's own cache, the twin's), and the cache then holds every column but the last."""
    family, calls_ = sequence
    model = _model(family)
    drop_engine(model.get_decoder())
    before = None       # (sequences, mask, our cache, the reference's cache) of the last call
    for ids, mask, kwargs, seed_, more in calls_:
        kwargs = dict(kwargs)
        sides = [kwargs, {name: value for name, value in kwargs.items()
                          if name not in _DRAFT_OPTIONS or kwargs["do_sample"]}]
        if more is not None:
            ids = torch.cat([before[0], more], dim=1)
            mask = torch.nn.functional.pad(before[1], (0, ids.shape[1] - before[1].shape[1]),
                                           value=1)
            sides = [dict(sides[0], past_key_values=before[2]),
                     dict(sides[1], past_key_values=before[3])]
        with _engine_log() as log:
            ours = _generate(model, ids, mask, sides[0], sampler="flash", seed=seed_)
        slot = ("new slot" if any(m.startswith("new slot") for m in log) else "slot kept") + (
            ", grown past its KV columns" if any("grown to" in m for m in log) else "")
        OUTCOMES[f"call in a row: {slot}{', continuing a cache' if more is not None else ''}"] += 1
        if kwargs["do_sample"]:
            twin = _twin(family)
            drop_engine(twin.get_decoder())
            reference = _generate(twin, ids, mask, sides[1], sampler="flash", seed=seed_)
        else:
            reference = _generate(model, ids, mask, sides[1])
        caches = None
        if kwargs.get("return_dict_in_generate"):
            caches = (ours.past_key_values, reference.past_key_values)
            ours, reference = ours.sequences, reference.sequences
            assert caches[0].get_seq_length() == ours.shape[1] - 1
        assert torch.equal(ours, reference), (ids.shape, kwargs, ours[:, ids.shape[1]:],
                                              reference[:, ids.shape[1]:])
        before = (ours, mask, *caches) if caches is not None else None


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
