"""From `generate(...)` arguments to a `GenerationPlan`, with transformers' semantics.

The generation config is merged by transformers itself (call kwargs > `generation_config`
> `model.generation_config` > global defaults), and inputs, special tokens, attention
mask and lengths go through transformers' own preparation helpers, so a flash run starts
from exactly what stock `generate` would.

Every option stock `generate` accepts in greedy or sampling mode runs on flashspec's
engine: temperature, top-k, top-p and min-p in the fused kernels, and with them the model's
LM-head bias and softcap (`heads.OutputHead`), the logit edits of `edits.FUSED_OPTIONS`
(repetition_penalty, suppress_tokens, begin_suppress_tokens, bad_words_ids, min_length,
min_new_tokens, no_repeat_ngram_size, forced_bos_token_id, forced_eos_token_id,
sequence_bias: `edits.EditRules`, made from transformers' own processors for the call),
flashspec's vLLM-style `logit_bias`, `presence_penalty` and `frequency_penalty`
(`additive.AdditiveEdits`) and the allowed-token masks of `prefix_allowed_tokens_fn` and
flashspec's `allowed_tokens_fn` (`allowed.AllowedTokens`) while nothing else needs the
materialized path;
everything else that edits the logits (transformers' processors, the unfused warpers, a
user's `logits_processor`, watermarking, a softcap after a logit scale, `output_scores` /
`output_logits`), and `output_attentions` / `output_hidden_states` (`recording`), on the
engine's exact materialized path (`processing`), with one warning naming what forced it.
What selects another decoding method (beam search, contrastive search, DoLa, constrained
beams, guidance, SynthID watermarking, ...) is `StockDelegation`: `generate` defers to stock
transformers with a warning. What neither can run is refused with a
ValueError naming the option, where its value came from and the override that works.

What a decoder-only model's forward takes besides the ids runs on the engine as stock feeds
it: `inputs_embeds` (the prefill takes them; ``sequences`` then start with the given
`input_ids`, none without), any 0/1 `attention_mask` with a live token in every row (holes
included: live tokens at positions ``mask.cumsum(-1) - 1``, the rest dead in the cache; right
padding as stock runs it, `_stock_positions`), `position_ids` equal to those positions,
`token_type_ids` of a decoder that takes them, and
`past_key_values` (`past`: a transformers Cache holding the prompt's first columns is read
into the engine's cache; with `return_dict_in_generate` the output holds the cache stock's
would, and a cache passed in is updated in place, as stock's is). Other `position_ids`, and
holes or right padding under a sliding window that the call's columns exceed, run on stock:
`_mask_deferral` and `_inputs_deferral` say why.

Deliberate differences: `num_assistant_tokens` and `assistant_confidence_threshold` passed
to `generate` are honoured (stock transformers reads only the assistant's generation
config); batches work with an assistant or prompt lookup; a row ended by a stop string is
padded even without an EOS token (stock transformers keeps generating that row); a prompt
ending with an EOS token is continued with an assistant or prompt lookup as without them
(stock assisted generation returns it unchanged); with `inputs_embeds`, an assistant and
prompt lookup draft from the ids given beside them (if any) and the new tokens, and the
tokens are those without drafts (transformers 5.17's assisted generation fails there with an
assistant, and its prompt lookup over embeddings alone returns other tokens than its greedy
search); with an assistant or prompt lookup, `attentions` and `hidden_states` hold each
token's own, as greedy search's (stock's assisted generation returns the prompt's first rows
for the tokens its first verification emits after the first: `recording`), and with sdpa
attention a tuple per token with no layer's attentions, as stock's greedy search returns
(its assisted generation fails).

(About 700 lines: one function's decisions, each option read once in transformers' merged
config, with the tables of what runs where beside them.)
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import time
import warnings

import torch
import torch.distributed as dist
from transformers import GenerationConfig, LogitsProcessorList, SynthIDTextWatermarkingConfig
from transformers.cache_utils import DynamicCache
from transformers.generation.configuration_utils import (ALL_STATIC_CACHE_IMPLEMENTATIONS,
                                                          GenerationMode)
from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria,
                                                       MaxTimeCriteria, StoppingCriteriaList,
                                                       StopStringCriteria)

from .. import rng
from ..params import SamplingParams
from .additive import AdditiveEdits, with_additive
from .allowed import AllowedTokens
from .arguments import (Sources, check_eval_mode, check_options, checked_input_ids,
                        merged_values)
from .drafters import AssistantDrafter, Drafter, PromptLookupDrafter
from .mtp import Mtp, mtp_layers
from .edits import FUSED_OPTIONS, EditRules
from .grammar import StructuredOutput
from .heads import (OutputHead, check_decoder, check_logits, model_hooks, output_head,
                    uncapturable_experts)
from .inputs import takes
from .kv_cache import layer_kinds, takes_padding_mask
from .past import check_past
from .processing import LogitsProcessing
from .recording import ForwardOutputs, key_layouts

SCHEDULES = ("constant", "heuristic", "heuristic_transient")
DRAFTER_DEFAULT_DRAFTS = 4     # drafts per step of a caller's `drafter` without num_assistant_tokens
_ENGINE_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE,
                 GenerationMode.ASSISTED_GENERATION)

# Options transformers applies as logits processors (whatever the mode): set, the call runs
# on the materialized path, but for `edits.FUSED_OPTIONS` when nothing else needs that path.
# name -> is_off(value).
PROCESSOR_OPTIONS = {
    "repetition_penalty": lambda v: v is None or v == 1.0,
    "encoder_repetition_penalty": lambda v: v is None or v == 1.0,
    "no_repeat_ngram_size": lambda v: not v,
    "encoder_no_repeat_ngram_size": lambda v: not v,
    "bad_words_ids": lambda v: v is None,
    "suppress_tokens": lambda v: v is None,
    "begin_suppress_tokens": lambda v: v is None,
    "sequence_bias": lambda v: v is None,
    "forced_bos_token_id": lambda v: v is None,
    "forced_eos_token_id": lambda v: v is None,
    "min_length": lambda v: not v,
    "min_new_tokens": lambda v: not v,
    "exponential_decay_length_penalty": lambda v: v is None,
    "remove_invalid_values": lambda v: not v,
    "renormalize_logits": lambda v: not v,
    "watermarking_config": lambda v: v is None,
    "output_scores": lambda v: not v,
    "output_logits": lambda v: not v,
    # Not edits: the per-token outputs the materialized path's eager forwards collect.
    "output_attentions": lambda v: not v,
    "output_hidden_states": lambda v: not v,
}
# Warpers transformers applies only when sampling, which the fused kernels do not make.
UNFUSED_WARPERS = {
    "typical_p": lambda v: v is None or v >= 1.0,
    "epsilon_cutoff": lambda v: v is None or not 0.0 < v < 1.0,
    "eta_cutoff": lambda v: v is None or not 0.0 < v < 1.0,
    "top_h": lambda v: v is None,
}
# Options for which generate() defers to stock transformers: name -> (is_off(value), why).
STOCK_OPTIONS = {
    "guidance_scale": (lambda v: v is None or v == 1.0,
                       "classifier-free guidance runs the model again inside a logits processor "
                       "that keeps state from step to step"),
    "assistant_ensemble_weight": (lambda v: v is None, "it mixes the assistant's distribution "
                                                       "into the target's"),
    "token_healing": (lambda v: not v, "it rewrites the prompt with a tokenizer"),
    "assistant_early_exit": (lambda v: v is None, "self-speculation by early exit is not "
                                                  "implemented"),
    "speculation_type": (lambda v: v is None, "only assistant-model and prompt-lookup drafts "
                                              "are implemented"),
    "cache_implementation": (lambda v: v in (None, "dynamic", "hybrid", "static"),
                             "flashspec keeps its own full-precision KV caches"),
}
# Arguments of generate() for which it defers to stock transformers: name -> why.
STOCK_HOOKS = {
    "negative_prompt_ids": "classifier-free guidance keeps state from step to step",
    "negative_prompt_attention_mask": "classifier-free guidance keeps state from step to step",
    "custom_generate": "it replaces the decoding loop that sampler='flash' provides",
    "synced_gpus": "multi-GPU synchronised generation is not implemented",
    "assistant_tokenizer": "an assistant with another tokenizer (universal assisted decoding) "
                           "needs the target's vocabulary translated",
}
# transformers keeps the output_* options in the model's kwargs too (read from the config here).
_MODEL_KWARGS = ("attention_mask", "input_ids", "use_cache", "logits_to_keep", "output_attentions",
                 "output_hidden_states")
# Inputs of the model's forward the engine takes where its decoder does (`_inputs_deferral`).
_ENGINE_INPUTS = ("inputs_embeds", "position_ids", "token_type_ids", "past_key_values")


@dataclasses.dataclass
class GenerationPlan:
    """Everything the decode loop needs, resolved and validated."""

    input_ids: torch.Tensor            # [B, L_s] stock's input_ids (rows already expanded):
                                       # the prompts' last L_s columns (L_s = L, but 0 with
                                       # inputs_embeds alone, L - N with past_key_values
                                       # holding N columns and only the new ids passed)
    attention_mask: torch.Tensor       # [B, L] the prompts' columns, 0/1, a live token per row
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
    custom_stops: StoppingCriteriaList | None   # the caller's `stopping_criteria`, if any
    max_time: float | None            # seconds left of the call's max_time when planned
    streamer: object
    output_logprobs: bool
    return_dict_in_generate: bool
    processing: LogitsProcessing | None = None   # the materialized path's edits, if any
    edits: EditRules | None = None     # the fused path's logit edits, if any
    additive: AdditiveEdits | None = None   # the fused path's logit_bias and vLLM penalties
    allowed: AllowedTokens | None = None   # the fused path's allowed-token masks, if any
    inputs_embeds: torch.Tensor | None = None   # [B, L, D]: the prefill's input, for the ids
    token_type_ids: torch.Tensor | None = None  # [B, L], of a decoder that takes them
    past_key_values: object = None     # the caller's transformers Cache, updated in place
    past_length: int = 0               # the prompt's first columns it holds
    return_cache: bool = False         # the output holds past_key_values (return_dict, use_cache)
    cache_implementation: str | None = None   # of the returned cache ("static": stock's StaticCache)
    max_cache_length: int = 0          # a static cache's columns, as stock sizes it
    # [B, L] the position ids stock feeds the prompt's columns (`_stock_positions`); None where
    # the model's forward takes none (its decoder derives positions from the 2-D mask)
    prompt_positions: torch.Tensor | None = None

    @property
    def wants_kv(self) -> bool:
        """Whether the call ends by gathering the target's keys and values (to return them,
        or to update the caller's cache)."""
        return self.return_cache or self.past_key_values is not None


@dataclasses.dataclass
class StockDelegation:
    """The call selects what flashspec's engine does not do: stock `generate` runs it.
    `reason` names the option and why; `samples`: stock would sample (from torch's
    generator, which flashspec's `seed` cannot key)."""

    reason: str
    samples: bool


def plan_generation(model, inputs, generation_config, *, logits_processor=None,
                    stopping_criteria=None, prefix_allowed_tokens_fn=None, synced_gpus=None,
                    assistant_model=None, streamer=None, negative_prompt_ids=None,
                    negative_prompt_attention_mask=None, custom_generate=None, seed=None,
                    output_logprobs=False, drafter=None, allowed_tokens_fn=None, logit_bias=None,
                    presence_penalty=None, frequency_penalty=None, structured_output=None,
                    started=None, **kwargs) -> GenerationPlan | StockDelegation:
    """`generate()`'s arguments as a `GenerationPlan`, a `StockDelegation`, or a ValueError
    or TypeError naming what cannot run. `drafter`: a `Drafter` of the caller's own (instead
    of an assistant or prompt lookup), with `num_assistant_tokens` drafts per step.
    `logit_bias`, `presence_penalty`, `frequency_penalty`: vLLM's additive edits
    (`additive.AdditiveEdits.of_call`). `structured_output`: a grammar per row
    (`grammar.StructuredOutput.of_call`).
    `started`: the call's `time.monotonic()` (`max_time` counts from it; default: now)."""
    started = time.monotonic() if started is None else started
    if not isinstance(output_logprobs, bool):
        raise TypeError(f"`output_logprobs` must be a bool, got {output_logprobs!r}")
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(f"`generation_config` must be a transformers GenerationConfig, got "
                        f"{type(generation_config).__name__} (for a dict d, pass "
                        "GenerationConfig(**d), or its entries as keyword arguments)")
    kwargs.pop("trust_remote_code", None)       # only matters for hub decoding methods
    tokenizer = kwargs.pop("tokenizer", None)
    hooks = dict(negative_prompt_ids=negative_prompt_ids,
                 negative_prompt_attention_mask=negative_prompt_attention_mask,
                 custom_generate=custom_generate, synced_gpus=synced_gpus or None,
                 assistant_tokenizer=kwargs.pop("assistant_tokenizer", None))
    requested = {**(generation_config.to_dict() if generation_config is not None else {}), **kwargs}
    source = Sources(model, generation_config, kwargs)
    options = check_options(merged_values(model, generation_config, kwargs), source)
    has_default_max_length = (kwargs.get("max_length") is None
                              and (generation_config is None or generation_config.max_length is None)
                              and model.generation_config.max_length is None)
    has_default_min_length = (kwargs.get("min_length") is None
                              and (generation_config is None or generation_config.min_length is None)
                              and model.generation_config.min_length is None)
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    if stopping_criteria is not None and not (
            isinstance(stopping_criteria, (list, tuple)) and all(map(callable, stopping_criteria))):
        raise TypeError(f"`stopping_criteria` must be a StoppingCriteriaList (or a list of "
                        f"StoppingCriteria), got {type(stopping_criteria).__name__}")
    drafted = (assistant_model is not None or drafter is not None
               or config.prompt_lookup_num_tokens is not None or bool(config.use_mtp))
    delegation = (_stock_delegation(model, config, model_kwargs, hooks, source, drafted)
                  or _replaced_criteria(config, stopping_criteria))
    if delegation is not None:
        return delegation

    if output_logprobs and not config.return_dict_in_generate:
        raise ValueError("`output_logprobs=True` needs `return_dict_in_generate=True` (the "
                         "logprobs are returned in the output object)")

    check_eval_mode(model)
    head = output_head(model, "model")
    check_decoder(head.decoder, "model")
    if head.shards is not None:
        _check_tensor_parallel(config, source)
    if head.weight.is_cuda and not head.spread:          # its steps are captured
        why = (off_current_device(head.weight.device, torch.cuda.current_device())
               or uncapturable_experts(head.decoder, "model"))
        if why is not None:
            raise ValueError(why)
    sampling = options.sampling["do_sample"]
    # The values as given (transformers later derives min_length from min_new_tokens).
    reasons = _materialized_reasons(config, head, sampling, logits_processor, source)
    inputs_tensor, input_name, model_kwargs = model._prepare_model_inputs(
        inputs, config.bos_token_id, model_kwargs)
    embeds = inputs_tensor if input_name == "inputs_embeds" else None
    # Stock's input_ids: the ids given (none beside inputs_embeds: [B, 0]).
    ids = checked_input_ids(model, model_kwargs["input_ids"] if embeds is not None else inputs_tensor,
                            "input_ids" if embeds is not None else input_name,
                            empty=embeds is not None)
    if embeds is not None:
        _check_embeds(model, embeds, ids)
    deferral = _inputs_deferral(head, model_kwargs)
    if deferral is not None:
        return StockDelegation(deferral, sampling)
    device = ids.device
    past = model_kwargs.get("past_key_values")
    has_mask = model_kwargs.get("attention_mask") is not None
    attention_mask = model_kwargs["attention_mask"] if has_mask else None
    # The prompts' columns: the embeddings', or the mask's (which, with a cache, may cover
    # more columns than the ids: stock then feeds the ids as the columns after the cache's).
    width = (embeds.shape[1] if embeds is not None
             else attention_mask.shape[-1] if has_mask and past is not None and attention_mask.dim() == 2
             else ids.shape[1])
    if has_mask:
        _check_mask(attention_mask, ids.shape[0], width)
    # Embeddings alone give no ids: a token on the embedding's device stands in.
    check_logits(model, head, ids if ids.numel() else torch.zeros(
        1, 1, dtype=torch.long, device=model.get_input_embeddings().weight.device))
    model._prepare_special_tokens(config, has_mask, device=device, batch_size=ids.shape[0])
    if not has_mask:
        attention_mask = model._prepare_attention_mask_for_generation(inputs_tensor, config,
                                                                      model_kwargs)
    attention_mask = attention_mask.long()
    rows = ids.shape[0] * options.num_return_sequences
    past_length = 0
    if past is not None:
        if config.cache_implementation is not None:
            raise ValueError(f"pass either `past_key_values` or `cache_implementation`="
                             f"{config.cache_implementation!r} "
                             f"({source('cache_implementation')}), not both (as transformers)")
        if config.use_cache is False:
            raise ValueError("`past_key_values` needs `use_cache` (the call continues the cache "
                             "and updates it); drop use_cache=False")
        past_length = check_past(past, head.decoder, rows, width, sharded=head.shards is not None)
    if ids.shape[1] not in (0, width) and ids.shape[1] + past_length != width:
        raise ValueError(f"`input_ids` has {ids.shape[1]} columns, the attention_mask {width}: with "
                         f"`past_key_values` holding {past_length} tokens, pass the ids of all "
                         f"{width} columns, or of the {width - past_length} after the cached ones")
    deferral = _positions_deferral(model_kwargs.get("position_ids"), attention_mask, past_length)
    if deferral is not None:
        return StockDelegation(deferral, sampling)
    token_type_ids = model_kwargs.get("token_type_ids")
    if token_type_ids is not None and (not torch.is_tensor(token_type_ids)
                                       or tuple(token_type_ids.shape) != tuple(attention_mask.shape)):
        shape = tuple(token_type_ids.shape) if torch.is_tensor(token_type_ids) else None
        return StockDelegation(f"`token_type_ids` of shape {shape} is not [batch, prompt columns] "
                               f"{tuple(attention_mask.shape)}, which the engine takes", sampling)

    def expanded(tensor):
        return None if tensor is None else tensor.repeat_interleave(options.num_return_sequences, dim=0)

    input_ids = expanded(ids)
    prompt_positions = expanded(_stock_positions(model, model_kwargs.get("position_ids"),
                                                 attention_mask))
    attention_mask = expanded(attention_mask)
    batch_size, input_length = input_ids.shape

    config = model._prepare_generated_length(
        generation_config=config, has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length, model_input_name=input_name,
        input_ids_length=input_length, inputs_tensor=inputs_tensor)
    model._validate_generated_length(config, input_length, has_default_max_length)
    # Transformers stops once the length reaches max_length, which may be a float; no
    # sequence index past the noise's last position can be generated.
    max_new_tokens = min(math.ceil(config.max_length - input_length),
                         rng.MAX_POSITION + 1 - width)
    deferral = _mask_deferral(attention_mask, head.decoder.config, max_new_tokens,
                              prompt_positions is not None or takes_padding_mask(head.decoder))
    if deferral is not None:
        return StockDelegation(deferral, sampling)
    if streamer is not None:
        if batch_size != 1:
            raise ValueError(f"`streamer` needs a single sequence with sampler='flash' (batch "
                             f"{batch_size} after num_return_sequences): rows advance by different "
                             "numbers of tokens per step")
        streamer.put(input_ids.cpu())
    # Stock sizes a static cache max_length - 1, plus the embeddings' columns without ids.
    max_cache_length = math.ceil(config.max_length) - 1 + (width if input_length != width
                                                           and embeds is not None else 0)

    if torch.is_tensor(seed):          # one seed per row, wherever the user built it
        seed = seed.to(device)
    eos = config._eos_token_tensor
    pad = config._pad_token_tensor
    pad_token_id = int(pad.reshape(-1)[0]) if pad is not None else 0
    processing = edits = None
    structured = StructuredOutput.of_call(
        structured_output, tokenizer, ids.shape[0], options.num_return_sequences,
        input_ids.shape[1], [] if eos is None else eos.reshape(-1).tolist(), head.vocab_size)
    allowed = AllowedTokens.of_call(prefix_allowed_tokens_fn, allowed_tokens_fn, input_ids,
                                    pad_token_id, head.vocab_size, structured)
    additive = AdditiveEdits.of_call(logit_bias, presence_penalty, frequency_penalty, batch_size,
                                     head.vocab_size)

    def processors_with(prefix_fn):
        return model._get_logits_processor(
            generation_config=config, input_ids_seq_length=input_length,
            encoder_input_ids=inputs_tensor, prefix_allowed_tokens_fn=prefix_fn,
            logits_processor=logits_processor if logits_processor is not None else LogitsProcessorList(),
            device=device, model_kwargs=model_kwargs)

    if reasons:
        processors = processors_with(None)
        if all(name in FUSED_OPTIONS for name, _ in reasons):
            edits = EditRules.from_processors(processors, input_length, head.vocab_size,
                                              max_new_tokens)
            if edits is not None:
                reasons = []
                edits = None if edits == EditRules() else edits   # e.g. min_length without EOS
    if reasons:
        reasons = [reason for _, reason in reasons]
        if allowed is not None:     # where transformers applies `prefix_allowed_tokens_fn`
            processors = processors_with(allowed.prefix_fn if len(allowed.sources) > 1
                                         or prefix_allowed_tokens_fn is None
                                         else prefix_allowed_tokens_fn)
            allowed = None
        params = SamplingParams.create(batch_size, do_sample=sampling, seed=seed, device=device)
        processors = with_additive(processors, additive, input_length)
        additive = None
        processing = LogitsProcessing(processors, head, input_ids, pad_token_id, tuple(reasons),
                                      keep_scores=bool(config.output_scores),
                                      keep_logits=bool(config.output_logits),
                                      forwards=_forward_outputs(model, config, attention_mask, past,
                                                                past_length, embeds is not None,
                                                                expanded(token_type_ids),
                                                                max_cache_length))
        warnings.warn(f"sampler='flash' runs this call on its exact materialized path (the "
                      f"logits formed per step, transformers' processors applied as stock "
                      f"generate applies them), slower than the fused kernels, because of: "
                      f"{'; '.join(reasons)}", UserWarning, stacklevel=3)
    else:
        params = SamplingParams.create(batch_size, **options.sampling, seed=seed, device=device)
        if head.logit_scale != 1.0:
            params = dataclasses.replace(params, temperature=params.temperature / head.logit_scale)
        if (allowed is not None or additive is not None) and edits is None:
            edits = EditRules()   # the masks are codes and the additive edits ride with them
        if allowed is not None:
            allowed.forced = frozenset((count, token) for count, token, banned in edits.forced
                                       if not banned)
        if edits is not None and (edits.bans_tokens() or allowed is not None) and sampling:
            _check_banning_temperature(params, source("temperature"))

    if head.shards is not None and seed is None:
        _same_seeds_on_every_rank(params, head)

    stop_criteria = None
    if config.stop_strings:
        if tokenizer is None:
            raise ValueError("`stop_strings` needs the tokenizer: pass `tokenizer=` to generate()")
        stop_criteria = StopStringCriteria(stop_strings=config.stop_strings, tokenizer=tokenizer)

    if config.use_mtp:
        if (drafter is not None or assistant_model is not None
                or config.prompt_lookup_num_tokens is not None):
            raise ValueError("pass one source of drafts: `use_mtp`, `drafter`, "
                             "`assistant_model` or `prompt_lookup_num_tokens`")
        drafter = Mtp(model)
        if requested.get("num_assistant_tokens") is None:  # stock's count: one per MTP layer
            requested = {**requested, "num_assistant_tokens": mtp_layers(model)}
    if drafter is not None:
        if assistant_model is not None or config.prompt_lookup_num_tokens is not None:
            raise ValueError("pass one source of drafts: `drafter`, `assistant_model` or "
                             "`prompt_lookup_num_tokens`")
        if not isinstance(drafter, Drafter):
            raise ValueError(f"`drafter` must be a flashspec.generation.drafters.Drafter, got "
                             f"{type(drafter).__name__}")
        drafter.check_target(head)
        num_drafts = requested.get("num_assistant_tokens")
        num_drafts = DRAFTER_DEFAULT_DRAFTS if num_drafts is None else num_drafts
        _check_count("num_assistant_tokens", num_drafts)
        if requested.get("num_assistant_tokens_schedule") not in (None, "constant"):
            raise ValueError("`num_assistant_tokens_schedule`: a `drafter` (and `use_mtp`) drafts "
                             "`num_assistant_tokens` per step (schedule 'constant')")
        schedule, persist = "constant", None
    else:
        drafter, num_drafts, schedule, persist = _drafter(head, assistant_model, config, requested,
                                                          source)
    return GenerationPlan(
        input_ids=input_ids, attention_mask=attention_mask, params=params, head=head,
        drafter=drafter, num_drafts=num_drafts, schedule=schedule, persist_schedule=persist,
        max_new_tokens=max_new_tokens,
        eos_token_ids=None if eos is None else eos.reshape(-1).to(device),
        pad_token_id=pad_token_id, stop_criteria=stop_criteria,
        custom_stops=StoppingCriteriaList(stopping_criteria) if stopping_criteria else None,
        max_time=_time_left(config.max_time, started),
        streamer=streamer, output_logprobs=output_logprobs,
        return_dict_in_generate=bool(config.return_dict_in_generate), processing=processing,
        edits=edits, additive=additive, allowed=allowed, inputs_embeds=expanded(embeds),
        token_type_ids=expanded(token_type_ids), past_key_values=past, past_length=past_length,
        prompt_positions=prompt_positions,
        # Stock feeds inputs_embeds with a cache whatever use_cache says.
        return_cache=bool(config.return_dict_in_generate) and (config.use_cache is not False
                                                               or embeds is not None),
        cache_implementation=config.cache_implementation, max_cache_length=max_cache_length)


def _forward_outputs(model, config: GenerationConfig, attention_mask: torch.Tensor, past,
                     past_length: int, embeds: bool, token_type_ids,
                     max_cache_length: int) -> ForwardOutputs | None:
    """What collects `output_attentions` / `output_hidden_states` (stock returns them with
    `return_dict_in_generate` only), or None. Stock runs without a cache where `use_cache`
    is False (but with `inputs_embeds`), each forward feeding the whole sequence."""
    attentions, hidden = bool(config.output_attentions), bool(config.output_hidden_states)
    if not config.return_dict_in_generate or not (attentions or hidden):
        return None
    layouts = key_layouts(model.config.get_text_config(decoder=True), past,
                          config.cache_implementation, max_cache_length,
                          use_cache=config.use_cache is not False or embeds)
    return ForwardOutputs(attention_mask, past_length, token_type_ids, attentions, hidden, layouts)


def _check_tensor_parallel(config: GenerationConfig, source: Sources) -> None:
    """Refuse what ranks could decide differently: every rank must take the same steps."""
    if config.max_time is not None:
        raise ValueError(f"`max_time`={config.max_time!r} ({source('max_time')}) is not supported "
                         "with a tensor-parallel model: each rank would read its own clock and "
                         "stop at another step; pass max_time=None, or bound the call with "
                         "max_new_tokens")


def off_current_device(device: torch.device, current: int) -> str | None:
    """Why a model on `device` cannot run while GPU `current` is the current device, or
    None. The engine captures its steps' CUDA graphs on a capture stream of the current
    device, so a model on another GPU would record nothing (not yet handled, not tested on
    a GPU)."""
    if device.index is None or device.index == current:
        return None
    return (f"the model is on {device} but the current CUDA device is cuda:{current}; "
            f"sampler='flash' runs on the current device: call "
            f"torch.cuda.set_device('{device}') (or run inside "
            f"`with torch.cuda.device('{device}'):`) before generate()")


def _same_seeds_on_every_rank(params: SamplingParams, head: OutputHead) -> None:
    """Seeds drawn from each rank's torch generator (no `seed` given) become rank 0's: the
    ranks sample together."""
    group = head.shards.group
    dist.broadcast(params.seed, src=dist.get_global_rank(group, 0) if group is not None else 0,
                   group=group)


def _time_left(max_time, started: float) -> float | None:
    """Seconds of `max_time` left since `started`; None for no limit, or for one beyond the
    floats' range (stock compares it with the clock and never stops either)."""
    if max_time is None:
        return None
    try:
        return float(max_time) - (time.monotonic() - started)
    except OverflowError:
        return None


# The largest temperature at which a banned token (`params.BANNED_LOGIT`, finite) still loses
# every race and weighs 0 in every probability: its score / T stays below -2**24.
MAX_BANNING_TEMPERATURE = 2.0**40


def _check_banning_temperature(params: SamplingParams, source: str) -> None:
    hottest = float(params.temperature.max())
    if hottest > MAX_BANNING_TEMPERATURE:
        raise ValueError(
            f"`temperature`={hottest!r} ({source}) is not allowed with banned tokens "
            f"(suppress_tokens, bad_words_ids, min_new_tokens, ...): flashspec bans a token "
            f"with a finite logit, which stays below every other token only up to "
            f"temperature {MAX_BANNING_TEMPERATURE:.0f} (2**40); use a temperature at most that "
            "(sampling is then uniform over the allowed tokens to within 1e-9)")


def _materialized_reasons(config: GenerationConfig, head: OutputHead, sampling: bool,
                          logits_processor, source: Sources) -> list[tuple[str | None, str]]:
    """What makes the call run on the materialized path, as (option name or None, reason);
    empty: the fused path. Reasons of `edits.FUSED_OPTIONS` alone keep the fused path where
    transformers' processors for them are all fused (`edits.EditRules.from_processors`)."""
    reasons = []
    options = dict(PROCESSOR_OPTIONS)
    if sampling:
        options.update(UNFUSED_WARPERS)
    for name, is_off in options.items():
        value = getattr(config, name, None)
        if not is_off(value):
            reasons.append((name, f"`{name}`={value!r} ({source(name)})"))
    if logits_processor:
        names = ", ".join(type(p).__name__ for p in logits_processor)
        reasons.append((None, f"`logits_processor` ({names})"))
    reasons += [(None, why) for why in head.unfused_transforms()]
    reasons += [(None, f"the {hook}") for hook in head.hooks]
    return reasons


def _replaced_criteria(config: GenerationConfig, custom) -> StockDelegation | None:
    """A `StockDelegation` when a custom stopping criterion has the type of one transformers
    makes for this config (max length, max time, EOS, stop strings): transformers then runs
    the custom one instead of its own, whereas the engine keeps its own rule for those."""
    made = {MaxLengthCriteria: True, MaxTimeCriteria: config.max_time is not None,
            EosTokenCriteria: config.eos_token_id is not None,
            StopStringCriteria: bool(config.stop_strings)}
    for criterion in custom or ():
        if made.get(type(criterion)):
            return StockDelegation(f"`stopping_criteria` holds a {type(criterion).__name__}, "
                                   "which replaces transformers' own for this config; the "
                                   "engine applies its own rule for it", bool(config.do_sample))
    return None


def _stock_delegation(model, config: GenerationConfig, model_kwargs: dict, hooks: dict,
                      source: Sources, drafted: bool = False) -> StockDelegation | None:
    """A `StockDelegation` when the call selects what the engine does not do, else None
    (`drafted`: the call has an assistant model, prompt lookup or a drafter of the caller's
    own)."""
    samples = bool(config.do_sample)

    def delegate(what: str) -> StockDelegation:
        return StockDelegation(what, samples)

    if getattr(model.config, "is_encoder_decoder", False):
        return delegate(f"the model ({type(model).__name__}) is an encoder-decoder; "
                        "sampler='flash' runs decoder-only causal LMs")
    mode = config.get_generation_mode()
    if mode not in _ENGINE_MODES:
        options = [name for name in ("num_beams", "num_beam_groups", "penalty_alpha", "dola_layers",
                                     "constraints", "force_words_ids")
                   if getattr(config, name, None) not in (None, 1, getattr(GenerationConfig(), name, None))]
        named = ", ".join(f"`{name}`={getattr(config, name)!r} ({source(name)})" for name in options)
        return delegate(f"{named or 'the configuration'} selects transformers' {mode.value!r} "
                        "decoding, which is not sampling or greedy search")
    for name, (is_off, why) in STOCK_OPTIONS.items():
        value = getattr(config, name, None)
        if not is_off(value):
            return delegate(f"`{name}`={value!r} ({source(name)}): {why}")
    if not drafted and _stock_compiles(model, config, model_kwargs.get("past_key_values")):
        return delegate(f"`compile_config` ({source('compile_config')}) with a static cache on "
                        f"{model.device}: stock compiles the model's forward with it, which the "
                        "engine never calls (it compiles its own layers once per model)")
    if isinstance(config.watermarking_config, SynthIDTextWatermarkingConfig):
        return delegate(f"`watermarking_config` ({source('watermarking_config')}) is SynthID, "
                        "whose processor keeps state from step to step")
    for name, value in hooks.items():
        if value is not None:
            return delegate(f"`{name}`: {STOCK_HOOKS[name]}")
    hooked = model_hooks(model)
    if hooked:
        return delegate(f"the {', '.join(hooked)}: the engine never runs the model's own forward")
    inputs = inspect.signature(model.forward).parameters
    for name in model_kwargs:
        if name in _MODEL_KWARGS or model_kwargs[name] is None:
            continue
        if name not in inputs:
            raise ValueError(f"`{name}` is not supported with sampler='flash': it is neither an "
                             f"option of generate() nor an input of {type(model).__name__}.forward")
        if name in _ENGINE_INPUTS:
            continue                        # `_inputs_deferral` and `_mask_deferral` decide
        return delegate(f"`{name}`: the engine feeds its decoder input_ids or inputs_embeds, "
                        "attention_mask, position_ids, token_type_ids and its KV cache only")
    return None


def _stock_compiles(model, config: GenerationConfig, past) -> bool:
    """Whether stock generate would compile the model's forward with the call's
    `compile_config` in greedy search or sampling (assisted generation never compiles it),
    by transformers' auto-compile criteria: a compilable cache, not a
    `DynamicCache`; a CUDA-like device or ``_compile_all_devices``; no `disable_compile`, no
    quantizer that cannot compile, no CPU or disk offload. Where it would not, the option
    changes nothing in stock either (stock warns and skips compilation) and the engine runs."""
    compile_config = getattr(config, "compile_config", None)
    if compile_config is None or config.disable_compile:
        return False
    if past is None and not config.use_cache:      # no cache (a passed one is kept)
        return False
    if not (model.device.type in ("cuda", "xpu", "neuron", "tpu")
            or getattr(compile_config, "_compile_all_devices", False)):
        return False
    if past is not None:
        compilable = bool(getattr(past, "is_compileable", False)) and type(past) is not DynamicCache
    else:
        compilable = config.cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        return False
    devices = set(getattr(model, "hf_device_map", {}).values())
    if "disk" in devices or ("cpu" in devices and len(devices) > 1):
        return False
    return compilable


def _check_mask(attention_mask, rows: int, width: int) -> None:
    """A ValueError unless `attention_mask` is a tensor ``[rows, width]``."""
    if not torch.is_tensor(attention_mask) or tuple(attention_mask.shape) != (rows, width):
        shape = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else None
        raise ValueError(f"`attention_mask` must be a tensor of the prompts' shape {(rows, width)}, "
                         f"got {type(attention_mask).__name__} of shape {shape}")


def _mask_deferral(mask: torch.Tensor, config, max_new_tokens: int,
                   positions_known: bool) -> str | None:
    """Why stock generate must run a mask the engine does not reproduce, else None. The
    engine takes any 0/1 mask with a live token in every row: live tokens at positions
    ``mask.cumsum(-1) - 1`` (as stock's), the others dead in its cache; a right-padded row
    as stock runs it (`_stock_positions`) where stock's positions are known:
    `positions_known`, the model takes position ids (stock's) or derives them from the 2-D
    mask (ALiBi: as the engine's `WindowCache.padding_mask`). Stock's sliding windows count
    columns, not positions, which holes (and right padding) set apart."""
    if bool(((mask != 0) & (mask != 1)).any()):
        return ("`attention_mask` holds values other than 0 and 1, which the engine's "
                "position-addressed cache does not take")
    if bool((mask == 0).all(dim=1).any()):
        return ("`attention_mask` has a row without a live token, whose first token stock "
                "samples from a query that sees no key")
    if bool((mask[:, -1] == 0).any()) and not positions_known:
        return ("`attention_mask` ends a row with padding (right padding) and the model's "
                "forward takes no position_ids: its decoder derives the positions of that "
                "row's tokens itself, which the engine does not reproduce; pad on the left")
    holes = bool((mask[:, 1:] < mask[:, :-1]).any())
    windows = [w for w in (layer_kinds(config) or {}).values() if w is not None]
    columns = mask.shape[1] + max_new_tokens - 1
    if holes and windows and columns > min(windows):
        return (f"`attention_mask` has padding between a row's tokens (or after them: right "
                f"padding), and the call's {columns} columns exceed the model's sliding window "
                f"({min(windows)}): stock's window counts columns, padding included, the "
                "engine's counts tokens")
    return None


def _stock_positions(model, position_ids, mask: torch.Tensor) -> torch.Tensor | None:
    """The position ids ``[B, L]`` stock generate (transformers 5.17) feeds the prompt's
    columns (`mask`'s): the call's `position_ids` (all columns', or the last columns' after
    a passed cache's), else, where the model's forward takes position ids, its own
    ``mask.cumsum(-1) - 1`` at live columns and 0 at padding
    (`_prepare_position_ids_for_generation`); None where the forward takes none (the decoder
    derives its positions: Bloom's ALiBi from the 2-D mask, which the engine hands it).

    What stock then does with a right-padded row (its last column padding; transformers'
    `CausalLMModelTester` builds such masks with `torch.tril`): the prefill feeds every
    column at these positions, causal by column with padding keys masked, and `_sample`
    takes the first token from the last column's logits: the padding column's id, at its
    position id p (0), attending to every live prompt token (its own key masked). Each new
    token is fed at the last position id plus one (`_update_model_kwargs_for_generation`:
    p + 1, p + 2, ..., positions the prompt's tokens also hold), sees the live prompt
    tokens and the new tokens before it (the mask grows by ones; the padding columns stay
    masked), and the returned cache holds the padding columns too. The engine reproduces
    this (`Slot.load`): the prefill feeds the model these position ids while the cache keeps
    its own positions (the row's live tokens at 0, 1, ..., k - 1, its new tokens from k on),
    each row's new tokens take their cache position plus ``p + 1 - k`` as their position ids
    (`WindowCache.model_positions`; 0 for a row ending live, whose p is k - 1), and the
    fused sampler's noise stays keyed by the row's sequence index (its token count)."""
    stock = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    if position_ids is not None:
        stock[:, mask.shape[1] - position_ids.shape[1]:] = position_ids.to(stock.device).long()
        return stock
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return None
    return stock


def _positions_deferral(position_ids, mask: torch.Tensor, past_length: int) -> str | None:
    """Why stock generate must run the call's `position_ids` (None if not given): the engine
    addresses its cache by the positions stock derives from the mask (``mask.cumsum(-1) - 1``
    of each live token; a padding column's are free: a right-padded row's new tokens
    continue from its last column's, as in stock, `_stock_positions`), and takes those
    alone, for all of the prompt's columns or for those after the cache's `past_length`."""
    if position_ids is None:
        return None
    expected = mask.cumsum(dim=1) - 1
    if torch.is_tensor(position_ids) and position_ids.dim() == 2 \
            and position_ids.shape[0] == mask.shape[0] \
            and position_ids.shape[1] in (mask.shape[1], mask.shape[1] - past_length):
        columns = position_ids.shape[1]
        live = mask[:, -columns:].bool()
        given = position_ids.to(mask.device).long()
        if bool(((given == expected[:, -columns:]) | ~live).all()):
            return None
    return ("`position_ids` are not the positions stock derives from the attention mask "
            "(mask.cumsum(-1) - 1 at each live token), by which the engine's KV cache addresses "
            "its entries")


def _inputs_deferral(head: OutputHead, model_kwargs: dict) -> str | None:
    """Why stock generate must run an input of `_ENGINE_INPUTS` the target's decoder does
    not take (the engine runs the decoder, not the model's own forward), else None."""
    for name in ("inputs_embeds", "token_type_ids"):
        if model_kwargs.get(name) is not None and not takes(head.decoder, name):
            return (f"`{name}`: the model's decoder ({type(head.decoder).__name__}) does not take "
                    f"it (the model uses it outside the decoder), and the engine runs the decoder")
    return None


def _check_embeds(model, embeds, ids: torch.Tensor) -> None:
    """A ValueError unless `embeds` are ``[B, L, D]`` floats of the model's embedding width
    (L columns of ids too, when ids are given beside them)."""
    width = model.get_input_embeddings().embedding_dim
    if not torch.is_tensor(embeds) or not embeds.is_floating_point() or embeds.dim() != 3 \
            or embeds.shape[0] != ids.shape[0] or embeds.shape[1] == 0 or embeds.shape[2] != width:
        shape = tuple(embeds.shape) if torch.is_tensor(embeds) else type(embeds).__name__
        raise ValueError(f"`inputs_embeds` must be a float tensor [batch {ids.shape[0]}, length >= "
                         f"1, {width}] (the model's embedding width), got {shape}")
    if ids.shape[1] not in (0, embeds.shape[1]):
        raise ValueError(f"`input_ids` beside `inputs_embeds` must be the embeddings' tokens, one "
                         f"per column: got {ids.shape[1]} ids for {embeds.shape[1]} embeddings")


def _drafter(head: OutputHead, assistant_model, config, requested: dict, source: Sources):
    lookup = config.prompt_lookup_num_tokens
    if assistant_model is not None and lookup is not None:
        raise ValueError("pass either `assistant_model` or `prompt_lookup_num_tokens` to "
                         f"generate(), not both (`prompt_lookup_num_tokens`={lookup} "
                         f"{source('prompt_lookup_num_tokens')}; override it with "
                         "prompt_lookup_num_tokens=None)")
    if lookup is not None:
        _check_count("prompt_lookup_num_tokens", lookup, source("prompt_lookup_num_tokens"))
        ngram = config.max_matching_ngram_size or 2
        _check_count("max_matching_ngram_size", ngram, source("max_matching_ngram_size"))
        return PromptLookupDrafter(int(ngram)), int(lookup), "constant", None
    if assistant_model is None:
        return None, 0, "constant", None

    draft = output_head(assistant_model, "assistant_model", greedy_only=True)
    check_decoder(draft.decoder, "assistant_model")
    if draft.spread and not head.spread:
        raise ValueError("`assistant_model` is placed over several devices (its device_map) "
                         "but the model is not; load the assistant on the model's LM-head "
                         f"device ({head.weight.device})")
    if draft.shards is not None and head.shards is None:
        raise ValueError("`assistant_model` is tensor-parallel but the model is not; load the "
                         "assistant whole (without tp_plan)")
    if draft.vocab_size != head.vocab_size:
        raise ValueError(
            f"`assistant_model` has a vocabulary of {draft.vocab_size} tokens but the model has "
            f"{head.vocab_size}: sampler='flash' needs an assistant with the same tokenizer and "
            f"vocabulary; for an assistant with another tokenizer pass `tokenizer=` and "
            f"`assistant_tokenizer=` (transformers' universal assisted decoding, run by stock "
            f"generate)")
    if draft.weight.device != head.weight.device:
        raise ValueError(f"`assistant_model` is on {draft.weight.device} but the model is on "
                         f"{head.weight.device}; put both on the same device")
    # The call's value wins, then the assistant's own generation config (where
    # transformers reads it), then transformers' default.
    assistant_config = assistant_model.generation_config

    def setting(name, default):
        for value, where in ((requested.get(name), "set in the call"),
                             (getattr(assistant_config, name, None),
                              "from the assistant's generation_config")):
            if value is not None:
                return value, where
        return default, "transformers' default"

    num_drafts, where = setting("num_assistant_tokens", 20)
    _check_count("num_assistant_tokens", num_drafts, where)
    schedule, where = setting("num_assistant_tokens_schedule", "constant")
    if schedule not in SCHEDULES:
        raise ValueError(f"`num_assistant_tokens_schedule`={schedule!r} is not supported with "
                         f"sampler='flash' ({where}); pass num_assistant_tokens_schedule= one of "
                         f"{SCHEDULES}")
    # "heuristic" (not "heuristic_transient"), like transformers, leaves the final draft
    # count on the assistant for its next call (the mean over rows, for a batch).
    persist = _persist_draft_count(assistant_config) if schedule == "heuristic" else None
    schedule = "constant" if schedule == "constant" else "heuristic"
    threshold, where = setting("assistant_confidence_threshold", 0.4)
    if (isinstance(threshold, bool) or not isinstance(threshold, numbers.Real)
            or not 0.0 <= threshold <= 1.0):
        raise ValueError(f"`assistant_confidence_threshold` must be a number in [0, 1], got "
                         f"{threshold!r} ({where})")
    return AssistantDrafter(draft, float(threshold)), int(num_drafts), schedule, persist


def _persist_draft_count(assistant_config):
    def persist(final_counts: torch.Tensor) -> None:
        assistant_config.num_assistant_tokens = int(final_counts.float().mean().round())
    return persist


def _check_count(name: str, value, where: str = "set in the call") -> None:
    """A draft count: an int >= 1 (True counts as 1, as transformers takes it)."""
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1, got {value!r} ({where}); pass "
                         f"{name}= an int >= 1 to generate()")
