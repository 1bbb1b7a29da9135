"""Fused logit edits: transformers' processors that the LM-head kernels apply themselves.

A call whose processors are all of the kinds below runs on the fused path: each step hands
the kernels one uint8 code per (row, token) (`flashspec.params.LogitEdits`), made on the
device with torch ops only (no host read: the steps stay capturable in CUDA graphs):

* ``repetition_penalty``: every token of the row's context is PENALIZE (transformers'
  `RepetitionPenaltyLogitsProcessor` reads stock's ``input_ids``: the left-padded prompt,
  pad tokens included, and the generated tokens);
* ``suppress_tokens``, single-token ``bad_words_ids``: BAN everywhere;
* ``begin_suppress_tokens``: BAN at the first generated position;
* ``min_length`` / ``min_new_tokens``: the EOS ids BAN while the row's length is short.

Transformers counts lengths as ``input_ids.shape[-1]``: the padded prompt's width plus the
tokens generated, the same for every row of a stock batch. Here each row counts its own
generated tokens t, and a rule "length L" is "t = L - prompt width" (`EditRules`).

The slot keeps each row's base codes ``[B, V]`` (`EditState`): the bans that hold at every
position, and PENALIZE for the context, updated with each step's emitted tokens (a
scatter of ``max``: a ban stays a ban). A sampling step's codes are the base codes plus the
position's bans; a verification step's position j adds the drafts before j (its context)
and the bans at t + j, so every position is edited as plain decoding would edit it, and
seeded tokens stay the same with and without speculation.

Still on the materialized path (`processing`): multi-token ``bad_words_ids``,
``no_repeat_ngram_size`` and every other processor (`plan`).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.generation import logits_process as lp

from ..params import BAN, KEEP, PENALIZE, LogitEdits

# The warpers that `SamplingParams` makes (the kernels' temperature and truncation).
_FUSED_WARPERS = (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper,
                  lp.MinPLogitsWarper)
# The options whose processors `EditRules` takes, when their values are fusable.
FUSED_OPTIONS = ("repetition_penalty", "bad_words_ids", "suppress_tokens",
                 "begin_suppress_tokens", "min_length", "min_new_tokens")
NEVER = -1    # a generated count no position has


@dataclasses.dataclass(frozen=True)
class EditRules:
    """A call's fused edits (host values, from transformers' processors): `penalty` (1.0:
    none), `banned` (every position), `begin_banned` (the position after `begin_count`
    generated tokens, or none: `NEVER`), `eos` (banned while fewer than `min_count` tokens
    are generated). Token ids outside the vocabulary are dropped, as ``torch.isin`` in
    transformers' processors ignores them."""

    penalty: float = 1.0
    banned: tuple[int, ...] = ()
    begin_banned: tuple[int, ...] = ()
    begin_count: int = NEVER
    eos: tuple[int, ...] = ()
    min_count: int = 0

    @classmethod
    def from_processors(cls, processors, prompt_width: int, vocab_size: int) -> "EditRules | None":
        """The rules of `processors` (transformers' list for the call, whose inputs are
        ``prompt_width`` wide), or None if one of them is not fused (a multi-token bad word,
        a repetition penalty that ignores the prompt, any other processor)."""
        rules = cls()
        for processor in processors:
            if isinstance(processor, _FUSED_WARPERS):
                continue
            rule = _rule_of(processor, prompt_width, vocab_size)
            if rule is None:
                return None
            rules = rules._merged(**rule)
        return rules

    def _merged(self, penalty=None, banned=(), begin_banned=(), begin_count=NEVER, eos=(),
                min_count=0) -> "EditRules":
        return EditRules(
            penalty=self.penalty if penalty is None else penalty,
            banned=tuple(sorted({*self.banned, *banned})),
            begin_banned=tuple(sorted({*self.begin_banned, *begin_banned})),
            begin_count=begin_count if begin_banned else self.begin_count,
            eos=tuple(sorted({*self.eos, *eos})), min_count=max(self.min_count, min_count))


def _ids(values, vocab_size: int) -> tuple[int, ...]:
    ids = values.tolist() if torch.is_tensor(values) else list(values)
    return tuple(int(i) for i in ids if 0 <= int(i) < vocab_size)


def _rule_of(processor, prompt_width: int, vocab_size: int) -> dict | None:
    """`EditRules._merged`'s keywords for one of transformers' processors (each rule as its
    ``__call__`` reads it, in transformers 5.x), or None if it is not fused."""
    if type(processor) is lp.RepetitionPenaltyLogitsProcessor:
        if processor.prompt_ignore_length:
            return None
        return dict(penalty=float(processor.penalty))
    if type(processor) is lp.SuppressTokensLogitsProcessor:
        return dict(banned=_ids(processor.suppress_tokens, vocab_size))
    if type(processor) is lp.SuppressTokensAtBeginLogitsProcessor:
        # Banned where input_ids.shape[-1] == begin_index.
        count = processor.begin_index - prompt_width
        return dict(begin_banned=_ids(processor.begin_suppress_tokens, vocab_size),
                    begin_count=count if count >= 0 else NEVER)
    if type(processor) is lp.MinLengthLogitsProcessor:
        # EOS banned while input_ids.shape[-1] < min_length.
        return dict(eos=_ids(processor.eos_token_id, vocab_size),
                    min_count=processor.min_length - prompt_width)
    if type(processor) is lp.MinNewTokensLengthLogitsProcessor:
        # EOS banned while input_ids.shape[-1] - prompt_length_to_skip < min_new_tokens.
        return dict(eos=_ids(processor.eos_token_id, vocab_size),
                    min_count=processor.min_new_tokens + processor.prompt_length_to_skip
                    - prompt_width)
    if type(processor) is lp.NoBadWordsLogitsProcessor:
        words = list(processor.sequence_bias)
        if any(len(word) != 1 for word in words):
            return None
        ids = [word[0] for word in words]
        if any(not 0 <= i < vocab_size for i in ids):
            return None       # transformers raises on them: its processor's path says so
        return dict(banned=tuple(ids))
    return None


class EditState:
    """A slot's fused edits on the device, one row per slot row, in fixed buffers (loaded
    anew per call, so that captured graphs stay valid).

    Attributes:
        base: uint8 ``[B, V]``: each row's codes at every position (bans, context).
        penalty: float64 ``[B]``: the call's repetition penalty (1.0 without one).
        context_code: uint8 ``[1]``: PENALIZE with a penalty, else KEEP (what a context
            token's code becomes).
        ban_rows: uint8 ``[4, V]``: the position-dependent bans, row 1 * (EOS banned) +
            2 * (the begin position): nothing, EOS ids, begin-suppressed ids, both. One
            gather and one max per step then make them, with no [B, V] pass per kind.
        begin_count / min_count: int64 ``[1]``: the generated count of the begin position
            (`NEVER`: none); EOS is banned below `min_count`.
    """

    def __init__(self, batch_size: int, vocab_size: int, device: torch.device):
        uint8 = dict(dtype=torch.uint8, device=device)
        self.base = torch.zeros(batch_size, vocab_size, **uint8)
        self.penalty = torch.ones(batch_size, dtype=torch.float64, device=device)
        self.context_code = torch.zeros(1, **uint8)
        self.ban_rows = torch.zeros(4, vocab_size, **uint8)
        self.begin_count = torch.full((1,), NEVER, dtype=torch.long, device=device)
        self.min_count = torch.zeros(1, dtype=torch.long, device=device)

    def load(self, rules: EditRules, input_ids: torch.Tensor) -> None:
        """The call's `rules` for rows whose left-padded prompts are `input_ids` ``[B, L]``
        (padding tokens are context too, as in stock's ``input_ids``)."""
        device = self.base.device
        self.penalty.fill_(rules.penalty)
        self.context_code.fill_(KEEP if rules.penalty == 1.0 else PENALIZE)
        self.ban_rows.zero_()
        for rows, ids in (([1, 3], rules.eos), ([2, 3], rules.begin_banned)):
            index = torch.tensor(ids, dtype=torch.long, device=device)
            self.ban_rows[torch.tensor(rows, device=device)[:, None], index[None, :]] = BAN
        self.begin_count.fill_(rules.begin_count)
        self.min_count.fill_(rules.min_count)
        self.base.zero_()
        self.base[:, torch.tensor(rules.banned, dtype=torch.long, device=device)] = BAN
        self.absorb(input_ids, torch.ones_like(input_ids, dtype=torch.bool))

    def absorb(self, tokens: torch.Tensor, written: torch.Tensor) -> None:
        """Tokens ``[B, W]`` where `written` joined the rows' contexts."""
        codes = written.to(torch.uint8) * self.context_code
        self.base.scatter_reduce_(1, tokens.clamp_min(0), codes, reduce="amax")

    def sample_edits(self, generated: torch.Tensor) -> LogitEdits:
        """The edits of each row's next token, after `generated` ``[B]`` tokens."""
        return LogitEdits(self._with_position_bans(self.base, generated), self.penalty)

    def verify_edits(self, generated: torch.Tensor, drafts: torch.Tensor) -> LogitEdits:
        """The edits ``[B, G+1, V]`` of the positions that verify `drafts` ``[B, G]`` (-1
        padded; drafts end at a row's first -1): position j's context holds the drafts
        before it, and its bans are those after ``generated + j`` tokens."""
        batch, num_drafts = drafts.shape
        positions = torch.arange(num_drafts + 1, device=drafts.device)
        is_draft = (drafts >= 0).long().cumprod(dim=1).bool()
        before = positions[:, None] > positions[None, :num_drafts]          # [G+1, G]: i < j
        in_context = (before[None] & is_draft[:, None, :]).to(torch.uint8) * self.context_code
        codes = self._with_position_bans(self.base[:, None, :], generated[:, None] + positions)
        index = drafts.clamp_min(0)[:, None, :].expand(batch, num_drafts + 1, num_drafts)
        return LogitEdits(codes.scatter_reduce_(2, index, in_context, reduce="amax"),
                          self.penalty)

    def _with_position_bans(self, codes: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
        """`codes` ``[..., V]`` (broadcast to ``[*generated.shape, V]``) with EOS banned
        where `generated` is below the minimum and the begin-suppressed tokens where it is
        the begin position."""
        which = (generated < self.min_count).long() + 2 * (generated == self.begin_count).long()
        return torch.maximum(codes, self.ban_rows[which])

    def tensors(self) -> list[torch.Tensor]:
        """What a step writes (a graph capture's warm-up must restore it)."""
        return [self.base]

    def nbytes(self) -> int:
        return self.base.numel() + self.ban_rows.numel()
