"""`generate`'s arguments checked by transformers' rules, before any tensor is built.

Each option is read as transformers merges it (the call, else the `generation_config`
argument, else the model's generation config, else transformers' defaults:
`merged_values`), and a bad value is a ValueError or TypeError naming the option, the value,
what is allowed and where it came from (`Sources`). `plan` builds the generation plan
from what these checks return.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch
from transformers import GenerationConfig

from ..params import generation_sampling

def _finite(value) -> bool:
    """`math.isfinite` for any real number: an int beyond the floats' range is finite."""
    return isinstance(value, numbers.Integral) or math.isfinite(value)


class Sources:
    """Where an option's value came from, for messages: the call, the `generation_config`
    argument, or the model's own generation config (generation_config.json)."""

    def __init__(self, model, generation_config, call_kwargs: dict):
        self.model_config = model.generation_config
        self.argument = generation_config
        self.call = call_kwargs

    def __call__(self, name: str) -> str:
        if name in self.call:
            return "set in the call"
        default = getattr(GenerationConfig(), name, None)
        if self.argument is not None and getattr(self.argument, name, default) != default:
            return "from the `generation_config` argument"
        if getattr(self.model_config, name, default) != default:
            return "from the model's generation_config (generation_config.json)"
        return "transformers' default"


@dataclasses.dataclass(frozen=True)
class Options:
    """The options the engine reads itself, checked (`check_options`)."""

    sampling: dict                     # SamplingParams.create's do_sample, temperature, ...
    num_return_sequences: int


def merged_values(model, generation_config, call_kwargs: dict):
    """`value_of(name)`: an option's value as transformers' `_prepare_generation_config` merges
    it (the call, else the `generation_config` argument, else the model's generation config,
    else transformers' global default; None when unset), read without building the config,
    whose own validation compares some values before they are checked here."""
    defaults = GenerationConfig._get_default_generation_params()

    def value_of(name: str):
        if name in call_kwargs:
            return call_kwargs[name]
        for config in (generation_config, model.generation_config):
            if config is not None and getattr(config, name, None) is not None:
                return getattr(config, name)
        return defaults.get(name)
    return value_of


def check_options(value_of, source) -> Options:
    """Check the options the engine reads itself (sampling, lengths, counts, special tokens,
    the time limit), each where and as transformers' `generate` reads it, before anything is
    built: a ValueError (a value out of range) or TypeError (a value of the wrong type)
    names the option, its value, what is allowed and `source(name)`, where it came from.
    Options only transformers' processors read are checked by those processors, as in stock.

    Transformers' rules, and what flashspec adds (README, "Arguments"):
    * sampling options: `params.generation_sampling` (read only when sampling);
    * `max_new_tokens` a real number > 0 (a fraction rounds up: transformers stops once the
      length reaches prompt + max_new_tokens), else `max_length` a real number; infinite or
      NaN limits are refused (transformers would run forever without EOS);
    * `num_return_sequences` an int (below 1 means 1); `max_time` a real number (NaN never
      stops); `min_length`, `min_new_tokens` real numbers;
    * `eos_token_id` an int or a list of ints, `pad_token_id` and `bos_token_id` ints (real
      numbers, as transformers converts them; negative ones are never generated);
    * with sampling, `typical_p`, `epsilon_cutoff`, `eta_cutoff` real numbers.
    """
    def refuse(error, name: str, allowed: str):
        value = value_of(name)
        shown = repr(value) if isinstance(value, (bool, int, float)) else \
            f"{value!r} ({type(value).__name__})"
        return error(f"`{name}`={shown} ({source(name)}) is not allowed: {allowed}")

    def real(name: str, allowed: str = "must be a real number") -> None:
        value = value_of(name)
        if value is not None and not isinstance(value, numbers.Real):
            raise refuse(TypeError, name, allowed)

    sampling = generation_sampling(value_of, source)
    limit = "max_new_tokens" if value_of("max_new_tokens") is not None else "max_length"
    real(limit, "must be a number of tokens")
    if not _finite(value_of(limit)):
        raise refuse(ValueError, limit, "must be finite (end runs with eos_token_id or max_time)")
    if limit == "max_new_tokens" and not value_of(limit) > 0:
        raise refuse(ValueError, limit, "must be > 0")
    for name in ("max_time", "min_length", "min_new_tokens"):
        real(name)
    count = value_of("num_return_sequences")
    if count is not None and not isinstance(count, int):
        raise refuse(TypeError, "num_return_sequences", "must be an int")
    for name in ("pad_token_id", "bos_token_id"):
        real(name, "must be a token id (an int)")
    eos = value_of("eos_token_id")
    if not (eos is None or isinstance(eos, numbers.Real) or _token_ids(eos)):
        raise refuse(TypeError, "eos_token_id", "must be a token id (an int) or a list of them")
    if sampling["do_sample"]:
        for name in ("typical_p", "epsilon_cutoff", "eta_cutoff"):
            real(name)
    return Options(sampling=sampling, num_return_sequences=max(1, count or 1))


def _token_ids(value) -> bool:
    if torch.is_tensor(value):
        return not value.dtype.is_floating_point and not value.dtype.is_complex
    return isinstance(value, (list, tuple)) and all(isinstance(v, numbers.Real) for v in value)


def check_eval_mode(model) -> None:
    """Refuse a model in training mode: its dropout makes every forward random, and the
    engine samples from the model as it is in eval mode."""
    training = [name or "the model" for name, module in model.named_modules() if module.training]
    if training:
        raise ValueError(f"`model` ({type(model).__name__}) is in training mode ({training[0]} "
                         "has training=True, so dropout is active): call model.eval() before "
                         "generate(sampler='flash'), or run generate() without sampler='flash'")


def checked_input_ids(model, input_ids: torch.Tensor, input_name: str,
                      empty: bool = False) -> torch.Tensor:
    """The prompts as int64 ``[B, L]``, or a ValueError naming what is wrong with them;
    `empty`: ``[B, 0]`` is allowed (the ids beside `inputs_embeds`, none given)."""
    if empty and torch.is_tensor(input_ids) and input_ids.dim() == 2 and input_ids.shape[1] == 0:
        return input_ids.long()
    if input_name != "input_ids":
        raise ValueError(f"sampler='flash' needs token ids `input_ids` [batch, length], got "
                         f"`{input_name}`; run generate() without sampler='flash'")
    if not torch.is_tensor(input_ids) or input_ids.dtype not in (torch.int32, torch.int64):
        kind = input_ids.dtype if torch.is_tensor(input_ids) else type(input_ids).__name__
        raise ValueError(f"`input_ids` must be an int64 or int32 tensor (as the model's embedding "
                         f"takes), got {kind}")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"`input_ids` must have shape [batch, length] with at least one row and "
                         f"one token, got {tuple(input_ids.shape)}")
    vocab = model.get_input_embeddings().num_embeddings
    low, high = torch.aminmax(input_ids)
    if not (0 <= int(low) and int(high) < vocab):
        raise ValueError(f"`input_ids` must be token ids in [0, {vocab}) (the model's embedding), "
                         f"got values in [{int(low)}, {int(high)}]")
    return input_ids.long()
