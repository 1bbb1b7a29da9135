"""vLLM's additive logit edits as flashspec options of `generate`: a per-row `logit_bias` and
the `presence_penalty` / `frequency_penalty` of the tokens a row has generated.

Transformers has none of them (its one additive edit is `sequence_bias`). They run where vLLM
runs them, placed in transformers' processor order:

1. `logit_bias` (and transformers' `sequence_bias`, its first processor): added to the
   model's logits before every other edit;
2. transformers' repetition penalty;
3. vLLM's penalties, in float32 as vLLM computes them: ``l -= frequency_penalty * c``, then
   ``l -= presence_penalty * (c > 0)``, c the token's count among the row's generated
   tokens (vLLM's output tokens: the prompt does not count);
4. the bans and the other processors, then temperature and the warpers.

The fused kernels apply them in stage 1's epilogue (`params.LogitEdits`, loaded by
`edits.EditState`); the materialized path runs `LogitBias` and `OutputPenalties`, processors
of transformers' kind, at those places in transformers' list (`with_additive`). Values are
rounded to float32 once (`as_float32`), which both paths use. One difference remains: the
fused path sums ``sequence_bias`` and ``logit_bias`` into one float32 bias before adding it,
the materialized path adds one after the other, so with both set the last bit can differ
and a near-tie go another way.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation import logits_process as lp

OPTIONS = ("logit_bias", "presence_penalty", "frequency_penalty")
# Processors that come before vLLM's penalties: the additive ones, then the repetition
# penalties (transformers' order puts these first).
_BEFORE_PENALTIES = (lp.SequenceBiasLogitsProcessor, lp.EncoderRepetitionPenaltyLogitsProcessor,
                     lp.RepetitionPenaltyLogitsProcessor)


@dataclasses.dataclass(frozen=True)
class AdditiveEdits:
    """A call's additive edits, one entry per row (after ``num_return_sequences``): `bias`,
    each row's ``((token, bias), ...)`` in increasing token order; `presence` / `frequency`,
    each row's penalty (0.0: none)."""

    bias: tuple[tuple[tuple[int, float], ...], ...]
    presence: tuple[float, ...]
    frequency: tuple[float, ...]

    @property
    def has_bias(self) -> bool:
        return any(self.bias)

    @property
    def has_penalties(self) -> bool:
        return any(self.presence) or any(self.frequency)

    @classmethod
    def of_call(cls, logit_bias, presence_penalty, frequency_penalty, batch_size: int,
                vocab_size: int) -> "AdditiveEdits | None":
        """The options as given to `generate`, checked (values rounded to float32); None when
        none changes a logit (unset, zero penalties, empty biases).

        `logit_bias`: ``{token: bias}`` for every row, or a list of one such dict (or None)
        per row; `presence_penalty` / `frequency_penalty`: a float for every row, or one per
        row (a sequence or tensor). Every value must be finite."""
        if logit_bias is None and presence_penalty is None and frequency_penalty is None:
            return None
        bias = _row_values("logit_bias", logit_bias, batch_size, dict,
                           lambda value: _checked_bias(value, vocab_size))
        presence = _row_values("presence_penalty", presence_penalty, batch_size, numbers.Real,
                               lambda value: _checked_penalty("presence_penalty", value))
        frequency = _row_values("frequency_penalty", frequency_penalty, batch_size, numbers.Real,
                                lambda value: _checked_penalty("frequency_penalty", value))
        edits = cls(bias=tuple(row or () for row in bias),
                    presence=tuple(row or 0.0 for row in presence),
                    frequency=tuple(row or 0.0 for row in frequency))
        return edits if edits.has_bias or edits.has_penalties else None

    def bias_rows(self, rows: int, vocab_size: int, device) -> torch.Tensor:
        """float32 ``[rows, V]``: each row's bias (zeros past the call's rows)."""
        bias = torch.zeros(rows, vocab_size, dtype=torch.float32)
        for row, entries in enumerate(self.bias):
            if entries:
                tokens, values = zip(*entries)
                bias[row, list(tokens)] = torch.tensor(values, dtype=torch.float32)
        return bias.to(device)


def _row_values(name: str, value, batch_size: int, kind, check) -> list:
    """`value` for every row (one `kind`, or None) or one per row, each checked."""
    if torch.is_tensor(value):
        value = value.tolist()
    if value is None or isinstance(value, kind):
        return [None if value is None else check(value)] * batch_size
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TypeError(f"`{name}` must be one value for every row or a sequence of one per row, "
                        f"got {type(value).__name__}")
    if len(value) != batch_size:
        raise ValueError(f"`{name}` has {len(value)} entries but the call has {batch_size} rows "
                         "(after num_return_sequences): pass one value, or one per row")
    return [None if entry is None else check(entry) if isinstance(entry, kind) else
            _wrong_entry(name, entry, kind) for entry in value]


def _wrong_entry(name: str, entry, kind):
    what = "a dict {token id: bias}" if kind is dict else "a real number"
    raise TypeError(f"each entry of `{name}` must be {what} or None, got "
                    f"{type(entry).__name__} {entry!r}")


def as_float32(value) -> float:
    """`value` rounded to float32, as vLLM holds its penalties and biases and the kernels
    apply them (inf where float32 overflows): both of flashspec's paths use this value."""
    return float(torch.tensor(float(value), dtype=torch.float32))


def _checked_penalty(name: str, value) -> float:
    if isinstance(value, bool) or not math.isfinite(float(value)) \
            or not math.isfinite(as_float32(value)):
        raise ValueError(f"`{name}`={value!r} is not allowed: it must be a number finite in "
                         "float32 (vLLM's range is [-2, 2]; 0 leaves the logits as they are)")
    return as_float32(value)


def _checked_bias(bias: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    entries = []
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) \
                or not 0 <= token < vocab_size:
            raise ValueError(f"`logit_bias` has token {token!r}: token ids must be ints in "
                             f"[0, {vocab_size}) (the model's vocabulary)")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not math.isfinite(value) or not math.isfinite(as_float32(value)):
            raise ValueError(f"`logit_bias`[{token}]={value!r} is not allowed: a bias must be a "
                             "number finite in float32 (to exclude a token use suppress_tokens "
                             "or bad_words_ids)")
        entries.append((int(token), as_float32(value)))
    return tuple(sorted(entries))


class LogitBias(LogitsProcessor):
    """``scores + bias``: each row's `logit_bias`, for the materialized path (a processor of
    transformers' kind: the rows of ``input_ids`` are the call's)."""

    def __init__(self, edits: AdditiveEdits):
        self.edits = edits
        self._bias = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._bias is None or self._bias.device != scores.device:
            self._bias = self.edits.bias_rows(scores.shape[0], scores.shape[-1], scores.device)
        return scores + self._bias.to(scores.dtype)


class OutputPenalties(LogitsProcessor):
    """vLLM's presence and frequency penalties over the tokens after the first `prompt_width`
    of ``input_ids`` (the rows' generated tokens), for the materialized path."""

    def __init__(self, edits: AdditiveEdits, prompt_width: int):
        self.presence = torch.tensor(edits.presence, dtype=torch.float32)
        self.frequency = torch.tensor(edits.frequency, dtype=torch.float32)
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_width:]
        counts = torch.zeros(scores.shape, dtype=torch.int32, device=scores.device)
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=torch.int32))
        dtype = torch.promote_types(scores.dtype, torch.float32)
        frequency = self.frequency.to(scores.device, dtype)[:, None]
        presence = self.presence.to(scores.device, dtype)[:, None]
        scores = scores - frequency * counts.to(dtype)
        return scores - presence * (counts > 0).to(dtype)


def with_additive(processors: LogitsProcessorList, edits: AdditiveEdits | None,
                  prompt_width: int) -> LogitsProcessorList:
    """`processors` (transformers' list for the call) with `LogitBias` after transformers'
    `sequence_bias` (else first) and `OutputPenalties` after the repetition penalties (else
    after the biases)."""
    if edits is None:
        return processors
    processors = LogitsProcessorList(processors)
    # Exact types: transformers' NoBadWordsLogitsProcessor, which comes after the repetition
    # penalty, is a SequenceBiasLogitsProcessor.
    if edits.has_bias:
        at = next((i + 1 for i, p in enumerate(processors)
                   if type(p) is lp.SequenceBiasLogitsProcessor), 0)
        processors.insert(at, LogitBias(edits))
    if edits.has_penalties:
        before = [i for i, p in enumerate(processors)
                  if type(p) in (*_BEFORE_PENALTIES, LogitBias)]
        processors.insert(before[-1] + 1 if before else 0, OutputPenalties(edits, prompt_width))
    return processors
