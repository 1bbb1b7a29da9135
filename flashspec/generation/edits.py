"""Fused logit edits: transformers' processors that the LM-head kernels apply themselves.

A call whose processors are all of the kinds below runs on the fused path: each step hands
the kernels one uint8 code per (row, token) (`flashspec.params.LogitEdits`), made on the
device with torch ops only (no host read: the steps stay capturable in CUDA graphs):

* ``repetition_penalty``: every token of the row's context is PENALIZE (transformers'
  `RepetitionPenaltyLogitsProcessor` reads stock's ``input_ids``: the left-padded prompt,
  pad tokens included, and the generated tokens);
* ``suppress_tokens``, single-token ``bad_words_ids``: BAN everywhere;
* multi-token ``bad_words_ids``: a word's last token BAN where the context ends with the
  rest of the word (transformers' `NoBadWordsLogitsProcessor`, matched on the device against
  each row's last tokens, which the slot keeps);
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

Still on the materialized path (`processing`): ``no_repeat_ngram_size``, ``sequence_bias``
and every other processor (`plan`).
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
NO_TOKEN = -1     # a context position before the padded prompt (or past the drafts)
ANY_TOKEN = -2    # a word's unused leading slot: matches anything
SOME_TOKEN = -3   # the slot before a word's prefix: matches a token, not NO_TOKEN (transformers
                  # skips a word longer than the context)


@dataclasses.dataclass(frozen=True)
class EditRules:
    """A call's fused edits (host values, from transformers' processors): `penalty` (1.0:
    none), `banned` (every position), `begin_banned` (the position after `begin_count`
    generated tokens, or none: `NEVER`), `eos` (banned while fewer than `min_count` tokens
    are generated), `words` (multi-token bad words: the last token banned after the others).
    Token ids outside the vocabulary are dropped, as ``torch.isin`` in transformers'
    processors ignores them."""

    penalty: float = 1.0
    banned: tuple[int, ...] = ()
    begin_banned: tuple[int, ...] = ()
    begin_count: int = NEVER
    eos: tuple[int, ...] = ()
    min_count: int = 0
    words: tuple[tuple[int, ...], ...] = ()

    def bans_tokens(self) -> bool:
        """Whether some position bans some token (not only a repetition penalty)."""
        return bool(self.banned or self.begin_banned or self.eos or self.words)

    @classmethod
    def from_processors(cls, processors, prompt_width: int, vocab_size: int) -> "EditRules | None":
        """The rules of `processors` (transformers' list for the call, whose inputs are
        ``prompt_width`` wide), or None if one of them is not fused (a bad word with an id
        outside the vocabulary, a repetition penalty that ignores the prompt, any other
        processor)."""
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
                min_count=0, words=()) -> "EditRules":
        return EditRules(
            penalty=self.penalty if penalty is None else penalty,
            banned=tuple(sorted({*self.banned, *banned})),
            begin_banned=tuple(sorted({*self.begin_banned, *begin_banned})),
            begin_count=begin_count if begin_banned else self.begin_count,
            eos=tuple(sorted({*self.eos, *eos})), min_count=max(self.min_count, min_count),
            words=tuple(sorted({*self.words, *words})))


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
        words = [tuple(int(i) for i in word) for word in processor.sequence_bias]
        if any(not 0 <= i < vocab_size for word in words for i in word):
            return None       # transformers raises on them: its processor's path says so
        return dict(banned=tuple(word[0] for word in words if len(word) == 1),
                    words=tuple(word for word in words if len(word) > 1))
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
        position_bans: bool (host): some ban depends on the position. Without one and
            without words, a sampling step's codes are `base` itself (no pass over
            ``[B, V]``: Qwen2.5-Instruct's repetition penalty costs no step of its own).
        words / word_ends: int64 ``[K, M+1]`` / ``[K]``: the multi-token bad words, each
            one's tokens but the last right-aligned after `SOME_TOKEN` and `ANY_TOKEN`s, and
            the last tokens (M: the longest such prefix; K = 0 without words).
        tail: int64 ``[B, M+1]``: each row's last M+1 context tokens (`NO_TOKEN` before its
            padded prompt), which the words are matched against.
    """

    def __init__(self, batch_size: int, vocab_size: int, device: torch.device):
        uint8 = dict(dtype=torch.uint8, device=device)
        self.base = torch.zeros(batch_size, vocab_size, **uint8)
        self.penalty = torch.ones(batch_size, dtype=torch.float64, device=device)
        self.context_code = torch.zeros(1, **uint8)
        self.ban_rows = torch.zeros(4, vocab_size, **uint8)
        self.begin_count = torch.full((1,), NEVER, dtype=torch.long, device=device)
        self.min_count = torch.zeros(1, dtype=torch.long, device=device)
        self.position_bans = False
        self.words = torch.zeros(0, 1, dtype=torch.long, device=device)
        self.word_ends = torch.zeros(0, dtype=torch.long, device=device)
        self.tail = torch.zeros(batch_size, 1, dtype=torch.long, device=device)

    def load(self, rules: EditRules, input_ids: torch.Tensor) -> bool:
        """The call's `rules` for rows whose left-padded prompts are `input_ids` ``[B, L]``
        (padding tokens are context too, as in stock's ``input_ids``). Returns whether the
        steps' buffers changed: other buffers for the words (steps captured before do not
        read them)."""
        device = self.base.device
        position_bans = rules.min_count > 0 or rules.begin_count != NEVER
        replaced = self._load_words(rules.words)
        self.position_bans = position_bans
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
        self.tail.fill_(NO_TOKEN)
        self.absorb(input_ids, torch.ones_like(input_ids, dtype=torch.bool))
        return replaced

    def _load_words(self, words: tuple[tuple[int, ...], ...]) -> bool:
        longest = max((len(word) - 1 for word in words), default=0)
        rows = [[ANY_TOKEN] * (longest - len(word) + 1) + [SOME_TOKEN, *word[:-1]]
                for word in words]
        device = self.base.device
        prefixes = torch.tensor(rows, dtype=torch.long, device=device).view(len(words), longest + 1)
        ends = torch.tensor([word[-1] for word in words], dtype=torch.long, device=device)
        if prefixes.shape == self.words.shape:
            self.words.copy_(prefixes)
            self.word_ends.copy_(ends)
            return False
        self.words, self.word_ends = prefixes, ends
        self.tail = self.tail.new_empty(self.tail.shape[0], longest + 1)
        return True

    def absorb(self, tokens: torch.Tensor, written: torch.Tensor) -> None:
        """Tokens ``[B, W]`` where `written` (the first few of each row) joined the rows'
        contexts."""
        codes = written.to(torch.uint8) * self.context_code
        self.base.scatter_reduce_(1, tokens.clamp_min(0), codes, reduce="amax")
        if self.word_ends.numel():
            joined = torch.cat([self.tail, tokens], dim=1)
            kept = written.sum(dim=1, keepdim=True) + torch.arange(self.tail.shape[1],
                                                                    device=tokens.device)
            self.tail.copy_(joined.gather(1, kept))

    def sample_edits(self, generated: torch.Tensor) -> LogitEdits:
        """The edits of each row's next token, after `generated` ``[B]`` tokens."""
        if not (self.position_bans or self.word_ends.numel()):
            return LogitEdits(self.base, self.penalty)
        codes = self._with_position_bans(self.base, generated)
        return LogitEdits(self._with_word_bans(codes, self.tail), self.penalty)

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
        codes.scatter_reduce_(2, index, in_context, reduce="amax")
        # Position j's last context tokens: the row's, then its first j drafts.
        contexts = torch.cat([self.tail, torch.where(is_draft, drafts, NO_TOKEN)], dim=1)
        windows = contexts.unfold(1, self.tail.shape[1], 1)                  # [B, G+1, M+1]
        return LogitEdits(self._with_word_bans(codes, windows), self.penalty)

    def _with_word_bans(self, codes: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """`codes` ``[..., V]`` with each multi-token bad word's last token banned where the
        context's last tokens `windows` ``[..., M+1]`` end with the rest of the word."""
        if not self.word_ends.numel():
            return codes
        context = windows[..., None, :]
        match = ((context == self.words) | (self.words == ANY_TOKEN)
                 | ((self.words == SOME_TOKEN) & (context >= 0))).all(dim=-1)   # [..., K]
        ends = self.word_ends.expand(match.shape)
        return codes.scatter_reduce_(-1, ends, match.to(torch.uint8) * BAN, reduce="amax")

    def _with_position_bans(self, codes: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
        """A new tensor: `codes` ``[..., V]`` (broadcast to ``[*generated.shape, V]``) with
        EOS banned where `generated` is below the minimum and the begin-suppressed tokens
        where it is the begin position."""
        if not self.position_bans:
            return codes.expand(*generated.shape, codes.shape[-1]).clone()
        which = (generated < self.min_count).long() + 2 * (generated == self.begin_count).long()
        return torch.maximum(codes, self.ban_rows[which])

    def tensors(self) -> list[torch.Tensor]:
        """What a step writes (a graph capture's warm-up must restore it)."""
        return [self.base, self.tail]

    def nbytes(self) -> int:
        return (self.base.numel() + self.ban_rows.numel()
                + 8 * (self.tail.numel() + self.words.numel() + self.word_ends.numel()))


def bans_every_token(edits: LogitEdits, tokens: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """Bool ``[B]``: sampled rows (`sampled` ``[B]``) whose token `tokens` (``[B]``, or ``[B, W]``
    with -1 past a row's last) is banned at its position by `edits` (codes ``[B, V]`` or
    ``[B, W, V]``). The Gumbel race only picks a banned token when every token is banned:
    transformers' sampling fails there (torch.multinomial of a row of -inf), greedy decoding
    takes token 0, as the kernels' argmax does."""
    codes = edits.codes.gather(-1, tokens.clamp_min(0)[..., None])[..., 0]
    banned = (codes == BAN) & (tokens >= 0)
    return (banned.view(tokens.shape[0], -1).any(dim=1)) & sampled
