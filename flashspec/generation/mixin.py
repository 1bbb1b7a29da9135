"""`generate(..., sampler="flash")` on any transformers causal LM.

    model = flashspec.from_pretrained("Qwen/Qwen3-8B", dtype=torch.bfloat16, device_map="cuda")
    model = flashspec.wrap(AutoModelForCausalLM.from_pretrained(...))   # same, in place
    out = model.generate(**inputs, sampler="flash", assistant_model=draft, do_sample=True)

Without ``sampler=`` the call is transformers' own `generate`, untouched.
"""

from __future__ import annotations

import time
import warnings

import torch
from transformers import AutoModelForCausalLM, GenerationMixin

from .engine import engine_for
from .heads import device_map_places, tensor_parallel_head
from .invariant import check_device, check_supported
from .outputs import FlashGenerateOutput
from .past import returned_cache
from .plan import StockDelegation, plan_generation

SAMPLERS = ("flash", "materialized")
_FLASH_OPTIONS = ("seed", "output_logprobs", "drafter", "invariant", "allowed_tokens_fn",
                  "logit_bias", "presence_penalty", "frequency_penalty", "structured_output")


class FlashGenerationMixin(GenerationMixin):
    """Adds ``sampler="flash"`` to `generate`: fused exact sampling, optionally speculative.

    Extra arguments of `generate`:
        sampler: None (stock transformers) or ``"flash"``.
        seed: int (row b uses seed + b), a sequence or tensor with one seed per row (after
            ``num_return_sequences`` expansion), or None (seeds drawn from torch's default
            generator, so ``torch.manual_seed`` makes runs repeatable). Row b's token at
            sequence index i depends only on (seed, i, the logits): the same with or
            without an assistant or prompt lookup, alone or in any batch (but for logit
            edits that read the padded context, as in stock: README, "Exact and
            speculation invariant").
        output_logprobs: with ``return_dict_in_generate=True``, return per-token logprobs.
        drafter: a `flashspec.generation.drafters.Drafter` of your own as the source of
            drafts (``num_assistant_tokens`` per step, default 4, constant schedule), instead
            of an assistant or prompt lookup.
        invariant: run the target's and the assistant's forwards with flashspec's
            batch-invariant decoder kernels (`flashspec.generation.invariant`), so that each
            row's hidden states, and so its seeded tokens, are bitwise the same with or
            without drafts and alone or in any batch, in bf16 on CUDA too (sampled and
            greedy). Costs tok/s (Llama-3.1-8B shape: -29%, BENCHMARKS.md). Not covered: a
            call with ``max_time`` that runs uncompiled (its LM head is then a cuBLAS
            matmul). Without it the kernels are cuBLAS's and PyTorch's: the fused sampling
            is still exact, but in bf16 a verification forward can round a hidden state
            differently from a one-token forward, and a close race can then go the other
            way (README, "Exact and speculation invariant").
        allowed_tokens_fn: structured output's primitive, ``(rows, input_ids) -> mask``:
            for contexts ``input_ids`` ``[N, L]`` (stock's: the left-padded prompt and the
            tokens so far, a drafted position's drafts included) of the call's rows `rows`
            ``[N]``, the tokens allowed next, as bool ``[N, V]`` or xgrammar's / vLLM's
            int32 bitmask ``[N, ceil(V / 32)]`` (bit ``v % 32`` of word ``v // 32``). Applied
            where transformers applies ``prefix_allowed_tokens_fn`` (before temperature and
            the warpers), in the fused kernels as edit codes; it must be a function of its
            arguments (speculation asks it for drafted contexts). The host asks it before
            each step; the steps stay captured.
        logit_bias: vLLM's and OpenAI's ``{token id: bias}`` (finite floats), for every row,
            or a list with one such dict (or None) per row: added to the model's logits
            before every other edit (with transformers' ``sequence_bias``).
        structured_output: constrain each row to a JSON schema, a regex or a grammar
            (xgrammar, ``pip install "flashspec[structured]"``; the tokenizer from
            ``tokenizer=``): ``{"json": schema}``, ``{"regex": pattern}``, ``{"grammar":
            ebnf}``, ``{"choice": [...]}``, ``{"json_object": True}`` (vLLM's structured
            outputs), OpenAI's ``{"type": "json_schema", "json_schema": {"schema": ...}}``
            or ``{"type": "json_object"}``, an xgrammar ``Grammar`` or ``CompiledGrammar``,
            or a list with one per prompt (None: free). Greedy tokens are stock's with
            xgrammar's logits processor; a row that completes its grammar ends with EOS;
            works with every drafter (`flashspec.generation.grammar`).
        presence_penalty, frequency_penalty: vLLM's penalties (a float, or one per row):
            ``logit - frequency_penalty * c - presence_penalty * (c > 0)``, c the token's
            count among the row's generated tokens (not the prompt, as vLLM counts), after
            transformers' repetition penalty and before the bans, temperature and warpers.

    ``sampler="materialized"`` runs the same engine with the ``[B, V]`` logits computed
    in the model's dtype and sampled by torch ops: the baseline the fused kernels are
    measured against (same tokens up to the rounding of bf16 logits).

    Speculative modes: ``assistant_model=`` (greedy drafts, ``num_assistant_tokens`` and
    ``num_assistant_tokens_schedule`` honoured from the call, else from the assistant's
    generation config) or ``prompt_lookup_num_tokens=`` (with ``max_matching_ngram_size``).
    Batches of any size, with left padding, in every mode.

    Inputs as stock takes them: ``inputs_embeds``, any 0/1 ``attention_mask`` whose rows end
    with a live token, the ``position_ids`` stock derives from it, ``token_type_ids`` (GPT-2),
    and ``past_key_values``: with ``return_dict_in_generate=True`` the output holds the
    transformers cache stock's would (``DynamicCache``; ``StaticCache`` with
    ``cache_implementation="static"``), and a cache passed in is read instead of the
    prompt's first columns and updated in place (`flashspec.generation.past`).

    ``max_time`` counts from the call's start, compilation and graph capture included. A
    call with it never compiles or captures: where its steps would (a first call, a new
    batch bucket, drafter, sampling flags or draft width; `Engine.needs_compiling`), it runs
    uncompiled, said once in the log (logger ``"flashspec"``): eager forwards, no CUDA
    graphs, the LM head by torch ops on logits in the model's dtype, exact as
    ``"materialized"`` is. `flashspec.warmup` with the call's settings (without drafts, also
    an earlier call without ``max_time``) makes later calls with it run compiled. Each
    step's drafts are cut to the time left: the call overruns by at most about one forward.
    (With ``invariant=True`` the invariant kernels, Triton's, still compile at first use.)

    Options that edit the logits beyond temperature / top-k / top-p / min-p run on the
    engine's exact materialized path (`flashspec.generation.processing`, one warning); a
    call that selects another decoding method (beam search, ...) runs stock `generate`,
    with a warning (README, "Every GenerationConfig option").
    """

    def generate(self, inputs=None, generation_config=None, *args, sampler=None, seed=None,
                 output_logprobs=False, drafter=None, invariant=False, allowed_tokens_fn=None,
                 logit_bias=None, presence_penalty=None, frequency_penalty=None,
                 structured_output=None, **kwargs):
        started = time.monotonic()            # max_time counts from here
        additive = dict(logit_bias=logit_bias, presence_penalty=presence_penalty,
                        frequency_penalty=frequency_penalty)
        given = _flash_options_given(seed=seed, output_logprobs=output_logprobs, drafter=drafter,
                                     invariant=invariant, allowed_tokens_fn=allowed_tokens_fn,
                                     structured_output=structured_output, **additive)
        if sampler is None:
            name = next(iter(given), None)
            if name is not None:
                seeding = " (stock generate() is seeded with torch.manual_seed)" if name == "seed" else ""
                raise ValueError(f"`{name}` is a flashspec option: pass sampler='flash' with it"
                                 f"{seeding}")
            return super().generate(inputs, generation_config, *args, **kwargs)
        if sampler not in SAMPLERS:
            raise ValueError(f"`sampler`={sampler!r} is not allowed: use None (stock transformers) "
                             f"or one of {SAMPLERS}")
        if args:
            raise ValueError("with sampler='flash', pass generate()'s arguments after "
                             "`generation_config` by keyword")
        if not isinstance(invariant, bool):
            raise TypeError(f"`invariant` must be True or False, got {invariant!r}")
        if invariant:
            check_device(self)
        if allowed_tokens_fn is not None and not callable(allowed_tokens_fn):
            raise TypeError(f"`allowed_tokens_fn` must be a callable (rows, input_ids) -> mask, "
                            f"got {type(allowed_tokens_fn).__name__}")
        # Refused before planning, which runs the model's forward (collectives on every rank).
        if (invariant or sampler == "materialized") and tensor_parallel_head(self):
            raise ValueError(
                f"{'`invariant=True`' if invariant else 'sampler=' + repr(sampler)} is not "
                "supported with a tensor-parallel model (its LM head split over the ranks): "
                "use sampler='flash' without invariant")
        placed, placed_kwargs, inputs_device = _on_head_device(self, inputs, kwargs)
        with torch.no_grad():
            plan = plan_generation(self, placed, generation_config, seed=seed,
                                   output_logprobs=output_logprobs, drafter=drafter,
                                   allowed_tokens_fn=allowed_tokens_fn,
                                   structured_output=structured_output, started=started,
                                   **additive, **placed_kwargs)
            if isinstance(plan, StockDelegation):
                _check_stock_call(plan, seed, given)
                warnings.warn(f"sampler='{sampler}' defers this call to stock transformers "
                              f"generate(): {plan.reason}", UserWarning, stacklevel=2)
            else:
                kind = "fused" if sampler == "flash" else "materialized"
                if invariant:
                    check_supported([plan.head.decoder, *getattr(plan.drafter, "decoders", ())])
                    _check_invariant_outputs(plan)
                generated = engine_for(plan, kind, invariant).run(plan)
                # The cache stock returns, or the caller's updated in place as stock updates it.
                cache = (returned_cache(self, plan, generated.kv) if generated.kv is not None
                         else None)
        if isinstance(plan, StockDelegation):
            return super().generate(inputs, generation_config, **kwargs)
        width = int(generated.count.max())
        sequences = torch.cat([plan.input_ids, generated.tokens[:, :width]], dim=1)
        device = inputs_device or sequences.device
        sequences = sequences.to(device)
        if not plan.return_dict_in_generate:
            return sequences
        logprobs = generated.logprobs[:, :width] if generated.logprobs is not None else None
        scores, logits = plan.processing.outputs() if plan.processing is not None else (None, None)
        logprobs, scores, logits = _moved((logprobs, scores, logits), device)
        forwards = plan.processing.forwards if plan.processing is not None else None
        attentions, hidden_states = forwards.outputs() if forwards is not None else (None, None)
        return FlashGenerateOutput(sequences=sequences, scores=scores, logits=logits,
                                   attentions=attentions, hidden_states=hidden_states,
                                   past_key_values=cache if plan.return_cache else None,
                                   logprobs=logprobs, flash_stats=generated.stats)


def _on_head_device(model, inputs, kwargs: dict):
    """``(inputs, kwargs, their device)`` for a model that accelerate spread over devices
    with its LM head on a GPU: its callers pass inputs on its first device (``model.device``,
    its embedding's), where stock takes them; the engine runs on the LM head's GPU, so the
    call's CUDA tensors move there, and the sequences, logprobs, scores and logits go back to
    the inputs' device, where stock returns them. The device is None (nothing moved) for
    any other model."""
    if len(device_map_places(model)) < 2:
        return inputs, kwargs, None
    head = model.get_output_embeddings()
    device = getattr(getattr(head, "weight", None), "device", None)
    given = inputs if torch.is_tensor(inputs) else kwargs.get("input_ids",
                                                              kwargs.get("inputs_embeds"))
    if device is None or device.type != "cuda" or not torch.is_tensor(given):
        return inputs, kwargs, None

    def moved(value):
        return value.to(device) if torch.is_tensor(value) and value.is_cuda else value

    return moved(inputs), {name: moved(value) for name, value in kwargs.items()}, given.device


def _moved(values, device: torch.device):
    """`values` (tensors, tuples of them, None) on `device`."""
    if torch.is_tensor(values):
        return values.to(device)
    if isinstance(values, tuple):
        return tuple(_moved(value, device) for value in values)
    return values


def _flash_options_given(seed, output_logprobs, drafter, invariant, **others) -> list[str]:
    """The flashspec options (`_FLASH_OPTIONS`, in that order) a call sets; `others`: those
    that are set when not None."""
    given = dict(seed=seed is not None, output_logprobs=bool(output_logprobs),
                 drafter=drafter is not None, invariant=invariant is not False,
                 **{name: value is not None for name, value in others.items()})
    return [name for name in _FLASH_OPTIONS if given[name]]


def _check_invariant_outputs(plan) -> None:
    """`invariant=True` runs the decoder through flashspec's own kernels, which form no
    attention probabilities and read a padding column's query by position: refuse
    `output_attentions` / `output_hidden_states` there."""
    forwards = plan.processing.forwards if plan.processing is not None else None
    if forwards is not None:
        name = "output_attentions" if forwards.attentions else "output_hidden_states"
        raise ValueError(f"`{name}=True` is not supported with `invariant=True`: the invariant "
                         "kernels form no attention probabilities and compute padding columns "
                         "otherwise than stock; drop invariant=True")


def _check_stock_call(plan: StockDelegation, seed, given: list[str]) -> None:
    """flashspec's own options have no meaning in stock `generate`: refuse them there
    (`given`: those the call sets, `_flash_options_given`; a seed only where stock samples)."""
    name = next((name for name in given if name != "seed"), None)
    if name is not None:
        raise ValueError(f"`{name}` needs flashspec's engine, but this call runs stock "
                         f"generate() ({plan.reason}); drop `{name}` or that option")
    if seed is not None and plan.samples:
        raise ValueError(f"`seed` keys flashspec's noise, but this call samples in stock "
                         f"generate() ({plan.reason}); drop `seed` and seed stock sampling "
                         "with torch.manual_seed")


_WRAPPED: dict[type, type] = {}


def wrap(model):
    """Give `model` (a transformers causal LM) `FlashGenerationMixin`'s `generate`, in place,
    and return it. Idempotent; the class keeps its name with a ``Flash`` prefix."""
    cls = type(model)
    if isinstance(model, FlashGenerationMixin):
        return model
    if not isinstance(model, GenerationMixin) or model.get_output_embeddings() is None:
        raise ValueError(f"`model` must be a transformers causal LM with an LM head "
                         f"(e.g. from AutoModelForCausalLM), got {cls.__name__}")
    if cls not in _WRAPPED:
        _WRAPPED[cls] = type(f"Flash{cls.__name__}", (FlashGenerationMixin, cls), {})
    model.__class__ = _WRAPPED[cls]
    return model


def from_pretrained(pretrained_model_name_or_path, *args, **kwargs):
    """``AutoModelForCausalLM.from_pretrained(...)`` (hub id or local folder, same arguments),
    wrapped with `wrap`."""
    return wrap(AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *args, **kwargs))
