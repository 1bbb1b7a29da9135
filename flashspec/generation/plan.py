"""From `generate(...)` arguments to a `GenerationPlan`, with transformers' semantics.

The generation config is merged by transformers itself (call kwargs > `generation_config`
> `model.generation_config` > global defaults), and inputs, special tokens, attention
mask and lengths go through transformers' own preparation helpers, so a flash run starts
from exactly what stock `generate` would. Everything flashspec cannot do exactly is
refused here, with the option's name and how to run it instead.

Deliberate differences: `num_assistant_tokens` passed to `generate` is honoured (stock
transformers reads only the assistant's generation config); batches work with an
assistant or prompt lookup; a row ended by a stop string is padded even without an EOS
token (stock transformers keeps generating that row).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import StopStringCriteria

from ..params import SamplingParams
from .drafters import AssistantDrafter, Drafter, PromptLookupDrafter
from .heads import OutputHead, check_decoder, check_logits, output_head

HOW_TO_RUN = "run generate() without sampler='flash'"
SCHEDULES = ("constant", "heuristic", "heuristic_transient")
DRAFTER_DEFAULT_DRAFTS = 4     # drafts per step of a caller's `drafter` without num_assistant_tokens

# Options that rewrite or read the full logits (logits processors): name -> is_off(value).
_LOGITS_OPTIONS = {
    "repetition_penalty": lambda v: v is None or v == 1.0,
    "encoder_repetition_penalty": lambda v: v is None or v == 1.0,
    "no_repeat_ngram_size": lambda v: not v,
    "encoder_no_repeat_ngram_size": lambda v: not v,
    "bad_words_ids": lambda v: v is None,
    "suppress_tokens": lambda v: not v,
    "begin_suppress_tokens": lambda v: not v,
    "sequence_bias": lambda v: not v,
    "forced_bos_token_id": lambda v: v is None,
    "forced_eos_token_id": lambda v: v is None,
    "min_length": lambda v: not v,
    "min_new_tokens": lambda v: not v,
    "exponential_decay_length_penalty": lambda v: v is None,
    "guidance_scale": lambda v: v is None or v == 1.0,
    "watermarking_config": lambda v: v is None,
    "diversity_penalty": lambda v: not v,
    "penalty_alpha": lambda v: v is None,
    "dola_layers": lambda v: v is None,
    "output_scores": lambda v: not v,
    "output_logits": lambda v: not v,
    "assistant_ensemble_weight": lambda v: v is None,
}
# Every refused option: name -> (is_off(value), why it is refused).
_NEEDS_LOGITS = "it needs the full logits, which flashspec never materializes"
_REFUSED_OPTIONS = {
    **{name: (is_off, _NEEDS_LOGITS) for name, is_off in _LOGITS_OPTIONS.items()},
    "token_healing": (lambda v: not v, "it rewrites the prompt with a tokenizer"),
    "output_attentions": (lambda v: not v, "per-step attentions are not collected"),
    "output_hidden_states": (lambda v: not v, "per-step hidden states are not collected"),
    "assistant_early_exit": (lambda v: v is None, "self-speculation by early exit is not "
                                                  "implemented; pass an assistant_model"),
    "use_mtp": (lambda v: not v, "multi-token-prediction drafts are not implemented"),
    "speculation_type": (lambda v: v is None, "only assistant-model and prompt-lookup drafts "
                                              "are implemented"),
    "cache_implementation": (lambda v: v in (None, "dynamic", "hybrid", "static"),
                             "flashspec keeps its own full-precision KV caches"),
}
_MODEL_KWARGS = ("attention_mask", "input_ids", "use_cache", "logits_to_keep")


@dataclasses.dataclass
class GenerationPlan:
    """Everything the decode loop needs, resolved and validated."""

    input_ids: torch.Tensor            # [B, L] left-padded prompts (rows already expanded)
    attention_mask: torch.Tensor       # [B, L]
    params: SamplingParams             # per row, logit scale folded into temperature
    head: OutputHead                   # target decoder and LM-head weight
    drafter: Drafter | None
    num_drafts: int                    # initial drafts per step (G)
    schedule: str                      # "constant" or "heuristic"
    persist_schedule: object           # None, or called with the final per-row draft counts
    max_new_tokens: int
    eos_token_ids: torch.Tensor | None
    pad_token_id: int
    stop_criteria: StopStringCriteria | None
    max_time: float | None
    streamer: object
    output_logprobs: bool
    return_dict_in_generate: bool


def plan_generation(model, inputs, generation_config, *, logits_processor=None,
                    stopping_criteria=None, prefix_allowed_tokens_fn=None, synced_gpus=None,
                    assistant_model=None, streamer=None, negative_prompt_ids=None,
                    negative_prompt_attention_mask=None, custom_generate=None, seed=None,
                    output_logprobs=False, drafter=None, **kwargs) -> GenerationPlan:
    """`generate()`'s arguments as a `GenerationPlan`, or a ValueError naming what cannot
    run. `drafter`: a `Drafter` of the caller's own (instead of an assistant or prompt
    lookup), with `num_assistant_tokens` drafts per step."""
    _refuse_hooks(logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                  prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
                  negative_prompt_ids=negative_prompt_ids,
                  negative_prompt_attention_mask=negative_prompt_attention_mask,
                  custom_generate=custom_generate, synced_gpus=synced_gpus)
    if not isinstance(output_logprobs, bool):
        raise ValueError(f"`output_logprobs` must be a bool, got {output_logprobs!r}")
    kwargs.pop("trust_remote_code", None)       # only matters for hub decoding methods
    tokenizer = kwargs.pop("tokenizer", None)
    if kwargs.pop("assistant_tokenizer", None) is not None:
        raise ValueError("`assistant_tokenizer`: an assistant with a different tokenizer is not "
                         f"supported by sampler='flash' (it needs the target's vocabulary); {HOW_TO_RUN}")
    requested = {**(generation_config.to_dict() if generation_config is not None else {}), **kwargs}
    has_default_max_length = (kwargs.get("max_length") is None
                              and (generation_config is None or generation_config.max_length is None)
                              and model.generation_config.max_length is None)
    has_default_min_length = (kwargs.get("min_length") is None
                              and (generation_config is None or generation_config.min_length is None)
                              and model.generation_config.min_length is None)
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    _refuse_options(config, model_kwargs)

    if output_logprobs and not config.return_dict_in_generate:
        raise ValueError("`output_logprobs=True` needs `return_dict_in_generate=True` (the "
                         "logprobs are returned in the output object)")

    head = output_head(model, "model")
    check_decoder(head.decoder, "model")
    inputs_tensor, input_name, model_kwargs = model._prepare_model_inputs(
        inputs, config.bos_token_id, model_kwargs)
    if input_name != "input_ids" or inputs_tensor.dim() != 2 or inputs_tensor.dtype != torch.long:
        raise ValueError(f"sampler='flash' needs token ids `input_ids` [batch, length] (int64), got "
                         f"`{input_name}` of shape {tuple(inputs_tensor.shape)}; {HOW_TO_RUN}")
    check_logits(model, head, inputs_tensor)
    device = inputs_tensor.device
    has_mask = model_kwargs.get("attention_mask") is not None
    model._prepare_special_tokens(config, has_mask, device=device, batch_size=inputs_tensor.shape[0])
    attention_mask = (model_kwargs["attention_mask"] if has_mask else
                      model._prepare_attention_mask_for_generation(inputs_tensor, config, model_kwargs))
    attention_mask = _check_left_padded(attention_mask, inputs_tensor)

    num_return = config.num_return_sequences or 1
    input_ids = inputs_tensor.repeat_interleave(num_return, dim=0)
    attention_mask = attention_mask.repeat_interleave(num_return, dim=0)
    batch_size, input_length = input_ids.shape
    if streamer is not None:
        if batch_size != 1:
            raise ValueError(f"`streamer` needs a single sequence with sampler='flash' (batch "
                             f"{batch_size} after num_return_sequences): rows advance by different "
                             "numbers of tokens per step")
        streamer.put(input_ids.cpu())

    config = model._prepare_generated_length(
        generation_config=config, has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length, model_input_name=input_name,
        input_ids_length=input_length, inputs_tensor=inputs_tensor)
    model._validate_generated_length(config, input_length, has_default_max_length)

    if torch.is_tensor(seed):          # one seed per row, wherever the user built it
        seed = seed.to(device)
    params = SamplingParams.from_generation_config(config, batch_size, seed=seed, device=device)
    if head.logit_scale != 1.0:
        params = dataclasses.replace(params, temperature=params.temperature / head.logit_scale)

    eos = config._eos_token_tensor
    pad = config._pad_token_tensor
    stop_criteria = None
    if config.stop_strings:
        if tokenizer is None:
            raise ValueError("`stop_strings` needs the tokenizer: pass `tokenizer=` to generate()")
        stop_criteria = StopStringCriteria(stop_strings=config.stop_strings, tokenizer=tokenizer)

    if drafter is not None:
        if assistant_model is not None or config.prompt_lookup_num_tokens is not None:
            raise ValueError("pass one source of drafts: `drafter`, `assistant_model` or "
                             "`prompt_lookup_num_tokens`")
        if not isinstance(drafter, Drafter):
            raise ValueError(f"`drafter` must be a flashspec.generation.drafters.Drafter, got "
                             f"{type(drafter).__name__}")
        num_drafts = requested.get("num_assistant_tokens")
        num_drafts = DRAFTER_DEFAULT_DRAFTS if num_drafts is None else num_drafts
        _check_count("num_assistant_tokens", num_drafts)
        if requested.get("num_assistant_tokens_schedule") not in (None, "constant"):
            raise ValueError("`num_assistant_tokens_schedule`: a `drafter` of your own drafts "
                             "`num_assistant_tokens` per step (schedule 'constant')")
        schedule, persist = "constant", None
    else:
        drafter, num_drafts, schedule, persist = _drafter(head, assistant_model, config, requested)
    return GenerationPlan(
        input_ids=input_ids, attention_mask=attention_mask, params=params, head=head,
        drafter=drafter, num_drafts=num_drafts, schedule=schedule, persist_schedule=persist,
        max_new_tokens=config.max_length - input_length,
        eos_token_ids=None if eos is None else eos.reshape(-1).to(device),
        pad_token_id=int(pad.reshape(-1)[0]) if pad is not None else 0,
        stop_criteria=stop_criteria, max_time=config.max_time, streamer=streamer,
        output_logprobs=output_logprobs, return_dict_in_generate=bool(config.return_dict_in_generate))


def _refuse_hooks(**hooks) -> None:
    for name, value in hooks.items():
        if name == "synced_gpus" and not value:
            continue
        if value is None or (name in ("logits_processor", "stopping_criteria") and len(value) == 0):
            continue
        what = {
            "logits_processor": "custom logits processors need the full [batch, vocab] logits, "
                                "which flashspec never materializes",
            "stopping_criteria": "custom stopping criteria are not supported (EOS, max_new_tokens, "
                                 "max_length, max_time and stop_strings are)",
            "prefix_allowed_tokens_fn": "constrained decoding is a logits processor",
            "negative_prompt_ids": "classifier-free guidance is a logits processor",
            "negative_prompt_attention_mask": "classifier-free guidance is a logits processor",
            "custom_generate": "it replaces the decoding loop that sampler='flash' provides",
            "synced_gpus": "multi-GPU synchronised generation is not supported",
        }[name]
        raise ValueError(f"`{name}` is not supported with sampler='flash': {what}; {HOW_TO_RUN}")


def _refuse_options(config: GenerationConfig, model_kwargs: dict) -> None:
    if (config.num_beams or 1) > 1:
        raise ValueError(f"`num_beams`={config.num_beams}: beam search is not supported with "
                         f"sampler='flash'; use num_beams=1, or {HOW_TO_RUN}")
    for name, (is_off, why) in _REFUSED_OPTIONS.items():
        value = getattr(config, name, None)
        if not is_off(value):
            raise ValueError(f"`{name}`={value!r} is not supported with sampler='flash' ({why}); "
                             f"{HOW_TO_RUN}")
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE,
                    GenerationMode.ASSISTED_GENERATION):
        raise ValueError(f"this configuration selects transformers' {mode.value!r} decoding "
                         "(e.g. through `constraints` or `force_words_ids`), which sampler='flash' "
                         f"does not implement; {HOW_TO_RUN}")
    for name in model_kwargs:
        if name not in _MODEL_KWARGS and model_kwargs[name] is not None:
            raise ValueError(f"`{name}` is not supported with sampler='flash' (supported model "
                             f"inputs: input_ids, attention_mask); {HOW_TO_RUN}")


def _check_left_padded(attention_mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"`attention_mask` must have the shape of `input_ids` "
                         f"{tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}")
    mask = attention_mask.long()
    if bool(((mask != 0) & (mask != 1)).any()) or bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("`attention_mask` must be 0/1 with padding on the left only (tokenizer "
                         "padding_side='left'), as transformers requires for batched generation")
    if bool((mask[:, -1] == 0).any()):
        raise ValueError("every prompt needs at least one token: a row of `attention_mask` is all 0")
    return mask


def _drafter(head: OutputHead, assistant_model, config, requested: dict):
    lookup = config.prompt_lookup_num_tokens
    if assistant_model is not None and lookup is not None:
        raise ValueError("pass either `assistant_model` or `prompt_lookup_num_tokens` to "
                         "generate(), not both")
    if lookup is not None:
        _check_count("prompt_lookup_num_tokens", lookup)
        ngram = config.max_matching_ngram_size or 2
        _check_count("max_matching_ngram_size", ngram)
        return PromptLookupDrafter(ngram), lookup, "constant", None
    if assistant_model is None:
        return None, 0, "constant", None

    draft = output_head(assistant_model, "assistant_model", greedy_only=True)
    check_decoder(draft.decoder, "assistant_model")
    if draft.vocab_size != head.vocab_size:
        raise ValueError(
            f"`assistant_model` has a vocabulary of {draft.vocab_size} tokens but the model has "
            f"{head.vocab_size}: sampler='flash' needs an assistant with the same tokenizer and "
            f"vocabulary (different tokenizers are transformers' Universal Assisted Decoding); "
            f"{HOW_TO_RUN}")
    if draft.weight.device != head.weight.device:
        raise ValueError(f"`assistant_model` is on {draft.weight.device} but the model is on "
                         f"{head.weight.device}; put both on the same device")
    # The call's value wins, then the assistant's own generation config (where
    # transformers reads it), then transformers' default.
    assistant_config = assistant_model.generation_config

    def setting(name, default):
        for value in (requested.get(name), getattr(assistant_config, name, None)):
            if value is not None:
                return value
        return default

    num_drafts = setting("num_assistant_tokens", 20)
    _check_count("num_assistant_tokens", num_drafts)
    schedule = setting("num_assistant_tokens_schedule", "constant")
    if schedule not in SCHEDULES:
        raise ValueError(f"`num_assistant_tokens_schedule`={schedule!r} is not supported with "
                         f"sampler='flash'; use one of {SCHEDULES}")
    # "heuristic" (not "heuristic_transient"), like transformers, leaves the final draft
    # count on the assistant for its next call (the mean over rows, for a batch).
    persist = _persist_draft_count(assistant_config) if schedule == "heuristic" else None
    schedule = "constant" if schedule == "constant" else "heuristic"
    return AssistantDrafter(draft), int(num_drafts), schedule, persist


def _persist_draft_count(assistant_config):
    def persist(final_counts: torch.Tensor) -> None:
        assistant_config.num_assistant_tokens = int(final_counts.float().mean().round())
    return persist


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1, got {value!r}")
