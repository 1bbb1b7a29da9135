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
* ``min_length`` / ``min_new_tokens``: the EOS ids BAN while the row's length is short;
* ``no_repeat_ngram_size`` n: BAN each token that would complete an n-gram of the context
  (transformers' `NoRepeatNGramLogitsProcessor`: each window of n tokens of stock's
  ``input_ids`` whose first n - 1 are its last n - 1 bans its last token; the slot keeps each
  row's whole context for that, in `EditState`); n = 1 bans the context's tokens;
* ``forced_bos_token_id`` / ``forced_eos_token_id`` (one id): every other token BAN where
  transformers' length is 1 / ``max_length - 1``. Transformers sets every score to -inf and
  the forced token's to 0, which undoes the processors before it (the token keeps its code
  from those after it: ``suppress_tokens``, ``begin_suppress_tokens``); with a single token
  left, its score does not matter. Several forced EOS ids draw uniformly among them in
  transformers, which codes cannot say: those calls stay on the materialized path.

Transformers counts lengths as ``input_ids.shape[-1]``: the padded prompt's width plus the
tokens generated, the same for every row of a stock batch. Here each row counts its own
generated tokens t, and a rule "length L" is "t = L - prompt width" (`EditRules`).

The slot keeps each row's base codes ``[B, V]`` (`EditState`): the bans that hold at every
position, and PENALIZE for the context, updated with each step's emitted tokens (a
scatter of ``max``: a ban stays a ban). A sampling step's codes are the base codes plus the
position's bans; a verification step's position j adds the drafts before j (its context)
and the bans at t + j, so every position is edited as plain decoding would edit it, and
seeded tokens stay the same with and without speculation.

Additive edits ride with the codes (`LogitEdits.bias`, `.counts`): single-token
``sequence_bias`` and flashspec's ``logit_bias`` as one float32 bias per (row, token), vLLM's
presence and frequency penalties (`additive`) from each row's count of every generated token,
which the slot keeps; a verification position adds the drafts before it to the counts in the
kernel, so plain and speculative steps compute the same float32 logits.

Multi-token ``sequence_bias`` entries add their bias per position, where the position's
context (drafts included) ends with the entry's prefix, in transformers' order; an entry of
-inf is a ban (a single token, or a bad word), as in transformers.

Still on the materialized path (`processing`): every other processor (`plan`).

(About 600 lines: `EditRules`, what transformers' processors ask, and `EditState`, how a
step's codes are made from it on the device, change together with each fused option.)
"""

from __future__ import annotations

import dataclasses
import math

import torch
from transformers.generation import logits_process as lp

from ..params import BAN, KEEP, PENALIZE, LogitEdits
from .additive import AdditiveEdits, as_float32
from .allowed import unpack

# The warpers that `SamplingParams` makes (the kernels' temperature and truncation).
_FUSED_WARPERS = (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper,
                  lp.MinPLogitsWarper)
# The options whose processors `EditRules` takes, when their values are fusable.
FUSED_OPTIONS = ("repetition_penalty", "bad_words_ids", "suppress_tokens",
                 "begin_suppress_tokens", "min_length", "min_new_tokens", "no_repeat_ngram_size",
                 "forced_bos_token_id", "forced_eos_token_id", "sequence_bias")
_FORCING = (lp.ForcedBOSTokenLogitsProcessor, lp.ForcedEOSTokenLogitsProcessor)
MAX_FORCED = 2    # forced tokens a call holds (transformers makes one BOS and one EOS rule)
FORCED_ROW = 4    # `EditState.ban_rows`' row that bans every token
MIN_CONTEXT = 256  # columns of the smallest n-gram context buffer (fewer sizes, fewer recaptures)
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
    are generated), `words` (multi-token bad words: the last token banned after the others),
    `ngram` (no_repeat_ngram_size, 0: none) with `context_columns` (the most tokens a row's
    context holds: the padded prompt and the new tokens), `forced` ((generated count, token,
    banned) in the order transformers applies them: every other token banned at that count,
    the token itself too where `banned`, because a processor after the forcing one bans it;
    at the same count the later one wins), `bias` (single-token ``sequence_bias``: (token,
    bias) pairs), `bias_words` (longer ``sequence_bias`` entries, (tokens, bias), in
    transformers' order: the last token's bias where the context ends with the others).
    Token ids outside the vocabulary are dropped, as ``torch.isin`` in transformers'
    processors ignores them."""

    penalty: float = 1.0
    banned: tuple[int, ...] = ()
    begin_banned: tuple[int, ...] = ()
    begin_count: int = NEVER
    eos: tuple[int, ...] = ()
    min_count: int = 0
    words: tuple[tuple[int, ...], ...] = ()
    ngram: int = 0
    context_columns: int = 0
    forced: tuple[tuple[int, int, bool], ...] = ()
    bias: tuple[tuple[int, float], ...] = ()
    bias_words: tuple[tuple[tuple[int, ...], float], ...] = ()

    def bans_tokens(self) -> bool:
        """Whether some position bans some token (not only a repetition penalty)."""
        return bool(self.banned or self.begin_banned or self.eos or self.words or self.ngram
                    or self.forced)

    @classmethod
    def from_processors(cls, processors, prompt_width: int, vocab_size: int,
                        max_new_tokens: int) -> "EditRules | None":
        """The rules of `processors` (transformers' list for the call, whose inputs are
        ``prompt_width`` wide, which generates at most `max_new_tokens`), or None if one of
        them is not fused (a bad word with an id outside the vocabulary, a repetition penalty
        that ignores the prompt, several forced EOS ids, a forced token that a later processor
        bans depending on the context, any other processor)."""
        rules = cls()
        processors = list(processors)
        for index, processor in enumerate(processors):
            if isinstance(processor, _FUSED_WARPERS):
                continue
            if type(processor) in _FORCING:
                rule = _forced_rule(processor, processors[index + 1:], prompt_width, vocab_size)
            else:
                rule = _rule_of(processor, prompt_width, vocab_size, max_new_tokens)
            if rule is None or rules.ngram not in (0, rule.get("ngram", rules.ngram)):
                return None     # (two n-gram sizes: one buffer of windows holds one size)
            rules = rules._merged(**rule)
        return rules if len(rules.forced) <= MAX_FORCED else None

    def _merged(self, penalty=None, banned=(), begin_banned=(), begin_count=NEVER, eos=(),
                min_count=0, words=(), ngram=0, context_columns=0, forced=(),
                bias=(), bias_words=()) -> "EditRules":
        return EditRules(
            penalty=self.penalty if penalty is None else penalty,
            banned=tuple(sorted({*self.banned, *banned})),
            begin_banned=tuple(sorted({*self.begin_banned, *begin_banned})),
            begin_count=begin_count if begin_banned else self.begin_count,
            eos=tuple(sorted({*self.eos, *eos})), min_count=max(self.min_count, min_count),
            words=tuple(sorted({*self.words, *words})), ngram=ngram or self.ngram,
            context_columns=max(self.context_columns, context_columns),
            forced=self.forced + tuple(forced), bias=self.bias + tuple(bias),
            bias_words=self.bias_words + tuple(bias_words))


def _ids(values, vocab_size: int) -> tuple[int, ...]:
    ids = values.tolist() if torch.is_tensor(values) else list(values)
    return tuple(int(i) for i in ids if 0 <= int(i) < vocab_size)


def _rule_of(processor, prompt_width: int, vocab_size: int, max_new_tokens: int) -> dict | None:
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
    if type(processor) is lp.NoRepeatNGramLogitsProcessor:
        return dict(ngram=processor.ngram_size,
                    context_columns=prompt_width + max_new_tokens)
    if type(processor) is lp.SequenceBiasLogitsProcessor:
        # Ids outside the vocabulary make transformers' processor raise, and a bias of +inf,
        # NaN or beyond float32 makes non-finite scores: its path says so. A bias of -inf is
        # transformers' own way to ban (what its bad words are): a ban here.
        entries = [(tuple(int(i) for i in ids), float(value))
                   for ids, value in processor.sequence_bias.items()]
        if any(not 0 <= i < vocab_size for ids, _ in entries for i in ids):
            return None
        if any(not (value == float("-inf") or math.isfinite(as_float32(value)))
               for _, value in entries):
            return None
        added = [(ids, value) for ids, value in entries if value != float("-inf")]
        banned = [ids for ids, value in entries if value == float("-inf")]
        return dict(bias=tuple(sorted((ids[0], value) for ids, value in added if len(ids) == 1)),
                    bias_words=tuple(entry for entry in added if len(entry[0]) > 1),
                    banned=tuple(ids[0] for ids in banned if len(ids) == 1),
                    words=tuple(ids for ids in banned if len(ids) > 1))
    return None


def _forced_rule(processor, later, prompt_width: int, vocab_size: int) -> dict | None:
    """`EditRules._merged`'s keywords for a forcing processor followed by the processors
    `later`, or None if it is not fused. Transformers forces where input_ids.shape[-1] is 1
    (BOS: a one-token prompt) or ``max_length - 1`` (EOS), indexes the scores with the ids
    (an id outside the vocabulary fails there) and sets them to 0: with several ids it draws
    uniformly among them."""
    if type(processor) is lp.ForcedBOSTokenLogitsProcessor:
        ids, length = processor.bos_token_id, 1
    else:
        ids, length = processor.eos_token_id, processor.max_length - 1
    try:
        ids = {*torch.as_tensor(ids).reshape(-1).tolist()}
    except (TypeError, ValueError, RuntimeError):
        return None                     # transformers fails on them too
    if len(ids) != 1 or type(min(ids)) is not int or not 0 <= min(ids) < vocab_size:
        return None
    token = min(ids)
    count = length - prompt_width
    if count < 0 or not float(count).is_integer():
        return {}                       # a length no row has
    count, banned = int(count), False
    for processor in later:
        if isinstance(processor, _FUSED_WARPERS) or type(processor) in _FORCING:
            continue
        rule = _rule_of(processor, prompt_width, vocab_size, 0)
        if rule is None or rule.get("words") or rule.get("ngram"):
            return None
        banned |= (token in rule.get("banned", ())
                   or (token in rule.get("begin_banned", ()) and count == rule["begin_count"])
                   or (token in rule.get("eos", ()) and count < rule["min_count"]))
    return dict(forced=((count, token, banned),))


class EditState:
    """A slot's fused edits on the device, one row per slot row, in fixed buffers (loaded
    anew per call, so that captured graphs stay valid).

    Attributes:
        base: uint8 ``[B, V]``: each row's codes at every position (bans, context).
        penalty: float64 ``[B]``: the call's repetition penalty (1.0 without one).
        context_code: uint8 ``[1]``: what a context token's code becomes: BAN with
            ``no_repeat_ngram_size`` 1, else PENALIZE with a penalty, else KEEP.
        ban_rows: uint8 ``[5, V]``: the position-dependent bans, row 1 * (EOS banned) +
            2 * (the begin position): nothing, EOS ids, begin-suppressed ids, both; and row
            `FORCED_ROW`, every token (a forced position). One gather and one max per step
            then make them, with no [B, V] pass per kind.
        begin_count / min_count: int64 ``[1]``: the generated count of the begin position
            (`NEVER`: none); EOS is banned below `min_count`.
        forced_count / forced_token / forced_code: int64, int64, uint8 ``[MAX_FORCED]``: the
            forced positions (`NEVER`: none), their token and its code there, in
            transformers' order (the later one wins at the same count).
        forces: bool (host): some position is forced (the steps then look for it).
        position_bans: bool (host): some ban depends on the position. Without one, without
            words and without n-grams, a sampling step's codes are `base` itself (no pass
            over ``[B, V]``: Qwen2.5-Instruct's repetition penalty costs no step of its own).
        words / word_ends: int64 ``[K, M+1]`` / ``[K]``: the multi-token bad words, then the
            multi-token ``sequence_bias`` entries (in transformers' order), each one's tokens
            but the last right-aligned after `SOME_TOKEN` and `ANY_TOKEN`s, and the last
            tokens (M: the longest such prefix; K = 0 without words); `word_bias`: float32
            ``[K]``, the entries' biases (0 for bad words); `word_bans`: bool ``[K]``, the bad
            words; `biased_words` (host): the indices of the bias entries.
        tail: int64 ``[B, M+1]``: each row's last M+1 context tokens (`NO_TOKEN` before its
            padded prompt), which the words are matched against.
        ngram: int (host): ``no_repeat_ngram_size`` where it needs matching (n >= 2), else 0.
        context / context_length: int64 ``[B, C]`` / ``[B]``: with `ngram`, each row's
            context as transformers' input_ids hold it (the padded prompt, pad tokens
            included, then the emitted tokens; `NO_TOKEN` after), C the power of two (at
            least `MIN_CONTEXT`) that holds the call's prompt and new tokens; else ``[B, 1]``.
        bias: float32 ``[B, V]`` or None: single-token ``sequence_bias`` plus the row's
            ``logit_bias`` (`additive`), made at the first call that has one and kept (captured
            graphs read it); `biased` (host): the call has one.
        counts: int32 ``[B, V]`` or None: each token's count among the row's generated
            tokens, for vLLM's penalties `presence` / `frequency` (float64 ``[B]``), kept as
            `bias` is; `penalized` (host): the call has them.
    """

    def __init__(self, batch_size: int, vocab_size: int, device: torch.device):
        uint8 = dict(dtype=torch.uint8, device=device)
        long = dict(dtype=torch.long, device=device)
        self.base = torch.zeros(batch_size, vocab_size, **uint8)
        self.penalty = torch.ones(batch_size, dtype=torch.float64, device=device)
        self.context_code = torch.zeros(1, **uint8)
        self.ban_rows = torch.zeros(FORCED_ROW + 1, vocab_size, **uint8)
        self.begin_count = torch.full((1,), NEVER, **long)
        self.min_count = torch.zeros(1, **long)
        self.forced_count = torch.full((MAX_FORCED,), NEVER, **long)
        self.forced_token = torch.zeros(MAX_FORCED, **long)
        self.forced_code = torch.zeros(MAX_FORCED, **uint8)
        self.position_bans = False
        self.forces = False
        self.words = torch.zeros(0, 1, **long)
        self.word_ends = torch.zeros(0, **long)
        self.word_bias = torch.zeros(0, dtype=torch.float32, device=device)
        self.word_bans = torch.zeros(0, dtype=torch.bool, device=device)
        self.biased_words: list[int] = []
        self.tail = torch.zeros(batch_size, 1, **long)
        self.ngram = 0
        self.context = torch.full((batch_size, 1), NO_TOKEN, **long)
        self.context_length = torch.zeros(batch_size, **long)
        self.bias = self.counts = None
        self.biased = self.penalized = False
        self.presence = torch.zeros(batch_size, dtype=torch.float64, device=device)
        self.frequency = torch.zeros(batch_size, dtype=torch.float64, device=device)

    def load(self, rules: EditRules, input_ids: torch.Tensor,
             additive: AdditiveEdits | None = None, new_columns: int | None = None) -> bool:
        """The call's `rules` and `additive` edits for rows whose left-padded prompts are
        `input_ids` ``[B, L]`` (padding tokens are context too, as in stock's ``input_ids``).
        `new_columns`: the most tokens a row can hold after its prompt now (the slot's
        columns; `grow_context` when they grow), else the call's limit.
        Returns whether the steps' buffers changed: other buffers for the words or the
        n-gram context (steps captured before do not read them)."""
        device = self.base.device
        position_bans = rules.min_count > 0 or rules.begin_count != NEVER or bool(rules.forced)
        replaced = self._load_words(rules.words, rules.bias_words)
        width = input_ids.shape[1]
        needed = rules.context_columns if new_columns is None else min(
            rules.context_columns, width + new_columns)
        replaced = self._load_context(rules.ngram, max(needed, width)) or replaced
        self.position_bans = position_bans
        self.forces = bool(rules.forced)
        self.penalty.fill_(rules.penalty)
        self.context_code.fill_(BAN if rules.ngram == 1 else
                                KEEP if rules.penalty == 1.0 else PENALIZE)
        self.ban_rows.zero_()
        for rows, ids in (([1, 3], rules.eos), ([2, 3], rules.begin_banned)):
            index = torch.tensor(ids, dtype=torch.long, device=device)
            self.ban_rows[torch.tensor(rows, device=device)[:, None], index[None, :]] = BAN
        self.ban_rows[FORCED_ROW] = BAN
        self.begin_count.fill_(rules.begin_count)
        self.min_count.fill_(rules.min_count)
        forced = list(rules.forced) + [(NEVER, 0, False)] * (MAX_FORCED - len(rules.forced))
        counts, tokens, banned = zip(*forced)
        self.forced_count.copy_(torch.tensor(counts))
        self.forced_token.copy_(torch.tensor(tokens))
        self.forced_code.copy_(torch.tensor(banned, dtype=torch.uint8) * BAN)
        self.base.zero_()
        self.base[:, torch.tensor(rules.banned, dtype=torch.long, device=device)] = BAN
        self.tail.fill_(NO_TOKEN)
        self.context.fill_(NO_TOKEN)
        self.context_length.zero_()
        self._load_additive(rules, additive)
        self.absorb(input_ids, torch.ones_like(input_ids, dtype=torch.bool), generated=False)
        return replaced

    def _load_additive(self, rules: EditRules, additive: AdditiveEdits | None) -> None:
        """The call's biases and vLLM penalties; `additive` holds the call's rows, the first
        of the slot's (the rest pad a batch bucket: their values are never used)."""
        batch, vocab = self.base.shape
        rows = len(additive.presence) if additive is not None else 0
        self.biased = (bool(rules.bias or rules.bias_words)
                       or (additive is not None and additive.has_bias))
        if self.biased:
            bias = torch.zeros(batch, vocab, dtype=torch.float32)
            if rules.bias:
                tokens, values = zip(*rules.bias)
                bias[:, list(tokens)] = torch.tensor(values, dtype=torch.float32)
            if additive is not None and additive.has_bias:
                bias[:rows] += additive.bias_rows(rows, vocab, "cpu")
            if self.bias is None:
                self.bias = torch.empty(batch, vocab, dtype=torch.float32, device=self.base.device)
            self.bias.copy_(bias)
        self.penalized = additive is not None and additive.has_penalties
        if self.penalized:
            if self.counts is None:
                self.counts = torch.zeros(batch, vocab, dtype=torch.int32, device=self.base.device)
            self.counts.zero_()
            self.presence.zero_()[:rows] = torch.tensor(additive.presence, dtype=torch.float64)
            self.frequency.zero_()[:rows] = torch.tensor(additive.frequency, dtype=torch.float64)

    def _load_words(self, words: tuple[tuple[int, ...], ...],
                    bias_words: tuple[tuple[tuple[int, ...], float], ...]) -> bool:
        self.biased_words = list(range(len(words), len(words) + len(bias_words)))
        biases = [0.0] * len(words) + [value for _, value in bias_words]
        words = tuple(words) + tuple(ids for ids, _ in bias_words)
        longest = max((len(word) - 1 for word in words), default=0)
        rows = [[ANY_TOKEN] * (longest - len(word) + 1) + [SOME_TOKEN, *word[:-1]]
                for word in words]
        device = self.base.device
        prefixes = torch.tensor(rows, dtype=torch.long, device=device).view(len(words), longest + 1)
        ends = torch.tensor([word[-1] for word in words], dtype=torch.long, device=device)
        biases = torch.tensor(biases, dtype=torch.float32, device=device)
        bans = torch.arange(len(words), device=device) < len(words) - len(bias_words)
        if prefixes.shape == self.words.shape:
            self.words.copy_(prefixes)
            self.word_ends.copy_(ends)
            self.word_bias.copy_(biases)
            self.word_bans.copy_(bans)
            return False
        self.words, self.word_ends, self.word_bias, self.word_bans = prefixes, ends, biases, bans
        self.tail = self.tail.new_empty(self.tail.shape[0], longest + 1)
        return True

    def _load_context(self, ngram: int, needed: int) -> bool:
        self.ngram = ngram if ngram > 1 else 0
        return self.grow_context(needed)

    def grow_context(self, needed: int) -> bool:
        """Room for `needed` context tokens per row (with n-grams), the tokens kept; whether
        the buffer was replaced. Sized by what a row can hold, not by the call's limit
        (``max_new_tokens=10**12`` with `max_time`): the slot grows it with its columns."""
        if not self.ngram:
            return False
        columns = max(MIN_CONTEXT, 1 << (needed - 1).bit_length())
        # The buffer only grows: a replaced buffer invalidates every graph of the slot, and
        # calls without n-grams never read it.
        if self.context.shape[1] >= columns:
            return False
        grown = self.context.new_full((self.context.shape[0], columns), NO_TOKEN)
        grown[:, :self.context.shape[1]] = self.context
        self.context = grown
        return True

    def key(self) -> tuple:
        """What the steps' captured work depends on beyond the buffers' values (for the
        engine's graph key): position bans, forced positions, the n-gram size, the words' and
        (with n-grams) the context's buffer shapes."""
        return (self.position_bans, self.forces, self.ngram, tuple(self.words.shape),
                tuple(self.context.shape) if self.ngram else None, self.biased,
                tuple(self.biased_words), self.penalized)

    def kernel_inputs(self) -> tuple[str, ...]:
        """The inputs of the steps' `LogitEdits` beyond the codes, which select the fused
        kernels' variants (`samplers.compile_variants`)."""
        bias = ("position bias" if self.biased_words else "bias",) if self.biased else ()
        return ("codes", *bias, *(("counts",) if self.penalized else ()))

    def absorb(self, tokens: torch.Tensor, written: torch.Tensor, generated: bool = True) -> None:
        """Tokens ``[B, W]`` where `written` (the first few of each row) joined the rows'
        contexts: `generated` ones, or the prompts (which vLLM's penalties do not count)."""
        codes = written.to(torch.uint8) * self.context_code
        self.base.scatter_reduce_(1, tokens.clamp_min(0), codes, reduce="amax")
        if self.penalized and generated:
            self.counts.scatter_add_(1, tokens.clamp_min(0), written.to(torch.int32))
        if self.word_ends.numel():
            joined = torch.cat([self.tail, tokens], dim=1)
            kept = written.sum(dim=1, keepdim=True) + torch.arange(self.tail.shape[1],
                                                                    device=tokens.device)
            self.tail.copy_(joined.gather(1, kept))
        if self.ngram:
            # Columns past the context hold NO_TOKEN, which every token id exceeds.
            columns = torch.arange(tokens.shape[1], device=tokens.device)
            index = (self.context_length[:, None] + columns).clamp_max(self.context.shape[1] - 1)
            self.context.scatter_reduce_(1, index, torch.where(written, tokens, NO_TOKEN),
                                         reduce="amax")
            self.context_length += written.sum(dim=1)

    def sample_edits(self, generated: torch.Tensor,
                     allowed: torch.Tensor | None = None) -> LogitEdits:
        """The edits of each row's next token, after `generated` ``[B]`` tokens; `allowed`:
        int32 ``[B, 1, ceil(V / 32)]``, each row's allowed tokens (`allowed.py`), or None."""
        if allowed is None and not (self.position_bans or self.word_ends.numel() or self.ngram):
            return self._edits(self.base)
        no_drafts = generated.new_empty(generated.shape[0], 0)
        edits = self.verify_edits(generated, no_drafts, allowed)
        bias = edits.bias[:, 0] if edits.bias is not None and edits.bias.dim() == 3 else edits.bias
        return edits._replace(codes=edits.codes[:, 0], bias=bias)

    def verify_edits(self, generated: torch.Tensor, drafts: torch.Tensor,
                     allowed: torch.Tensor | None = None) -> LogitEdits:
        """The edits ``[B, G+1, V]`` of the positions that verify `drafts` ``[B, G]`` (-1
        padded; drafts end at a row's first -1): position j's context holds the drafts
        before it, and its bans are those after ``generated + j`` tokens; `allowed`: int32
        ``[B, G+1, ceil(V / 32)]``, each position's allowed tokens, or None. On CUDA one
        Triton pass writes the codes (`kernels.edit_codes`: the torch ops take several
        passes over ``[B, G+1, V]`` bytes, up to a quarter of a verification step); the
        context-dependent bans are then scattered in."""
        num_drafts = drafts.shape[1]
        counts = None
        if not self.base.is_cuda or self.forces:
            counts = generated[:, None] + torch.arange(num_drafts + 1, device=drafts.device)
        if self.base.is_cuda:
            from ..kernels.edit_codes import verify_codes   # Triton: imported on CUDA only
            bans = None
            if self.position_bans:
                bans = (self.ban_rows, generated, self.min_count, self.begin_count,
                        self.forced_count if self.forces else None)
            codes = verify_codes(self.base, drafts, self.context_code, bans=bans,
                                 forced_row=FORCED_ROW, allowed=allowed)
        else:
            codes = self._context_codes(drafts, counts, allowed)
        bias = self.bias if self.biased else None
        if self.word_ends.numel() or self.ngram:
            # Position j's last context tokens: the row's, then its first j drafts.
            is_draft = (drafts >= 0).long().cumprod(dim=1).bool()
            drafted = torch.where(is_draft, drafts, NO_TOKEN)
            windows = torch.cat([self.tail, drafted], dim=1).unfold(1, self.tail.shape[1], 1)
            matches = self._word_matches(windows)
            codes = self._with_ngram_bans(self._with_word_bans(codes, matches), drafted)
            if self.biased_words:
                bias = self._position_bias(matches)
        return self._edits(self._with_forced_tokens(codes, counts), bias)

    def _edits(self, codes: torch.Tensor, bias: torch.Tensor | None = None) -> LogitEdits:
        """`LogitEdits` of `codes` with the call's penalty and additive edits: `bias`, or the
        rows' own (a verification's counts are those before its first position: the
        kernels add the drafts)."""
        if bias is None and self.biased:
            bias = self.bias
        return LogitEdits(codes, self.penalty, bias=bias,
                          counts=self.counts if self.penalized else None,
                          presence=self.presence if self.penalized else None,
                          frequency=self.frequency if self.penalized else None)

    def _context_codes(self, drafts: torch.Tensor, counts: torch.Tensor,
                       allowed: torch.Tensor | None) -> torch.Tensor:
        """`kernels.edit_codes.verify_codes` by torch ops (the CPU path and its reference):
        the base codes with each position's ban row, its drafts before it as context and
        `BAN` where `allowed` leaves a token out."""
        batch, num_drafts = drafts.shape
        positions = torch.arange(num_drafts + 1, device=drafts.device)
        is_draft = (drafts >= 0).long().cumprod(dim=1).bool()
        before = positions[:, None] > positions[None, :num_drafts]          # [G+1, G]: i < j
        in_context = (before[None] & is_draft[:, None, :]).to(torch.uint8) * self.context_code
        codes = self._with_position_bans(self.base[:, None, :], counts)
        index = drafts.clamp_min(0)[:, None, :].expand(batch, num_drafts + 1, num_drafts)
        codes.scatter_reduce_(2, index, in_context, reduce="amax")
        if allowed is not None:
            codes.masked_fill_(~unpack(allowed, codes.shape[-1]), BAN)
        return codes

    def _word_matches(self, windows: torch.Tensor) -> torch.Tensor:
        """Bool ``[..., K]``: where the context's last tokens `windows` ``[..., M+1]`` end
        with the rest of word k (a word longer than the context never matches, as in
        transformers)."""
        context = windows[..., None, :]
        return ((context == self.words) | (self.words == ANY_TOKEN)
                | ((self.words == SOME_TOKEN) & (context >= 0))).all(dim=-1)

    def _with_word_bans(self, codes: torch.Tensor, matches: torch.Tensor) -> torch.Tensor:
        """`codes` ``[..., V]`` with each multi-token bad word's last token banned where it
        matches (`_word_matches`)."""
        if len(self.biased_words) == self.word_ends.numel():
            return codes
        # A mask on the device, not the host's indices: a captured step reads no host tensor.
        banned = (matches & self.word_bans).to(torch.uint8) * BAN
        ends = self.word_ends.expand(matches.shape)
        return codes.scatter_reduce_(-1, ends, banned, reduce="amax")

    def _position_bias(self, matches: torch.Tensor) -> torch.Tensor:
        """float32 ``[B, G+1, V]``: the rows' bias plus, entry by entry in transformers'
        order, each multi-token ``sequence_bias`` entry's bias on its last token where it
        matches (`_word_matches` ``[B, G+1, K]``), as transformers adds them."""
        batch, positions = matches.shape[:2]
        bias = self.bias[:, None, :].expand(batch, positions, -1).clone()
        for k in self.biased_words:     # one entry per add: the same sums in the same order
            added = torch.where(matches[..., k], self.word_bias[k], 0.0)
            bias.index_add_(-1, self.word_ends[k:k + 1], added[..., None])
        return bias

    def _with_ngram_bans(self, codes: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """`codes` ``[B, G+1, V]`` with the tokens banned that would complete an n-gram of
        position j's context (the row's, then its first j of `drafts` ``[B, G]``, `NO_TOKEN`
        after a row's last): each window of n tokens whose first n - 1 are the context's
        last n - 1 bans its last. The windows in the row's context are matched against every
        position's last tokens (n - 1 comparisons of ``[B, G+1, C]``); those that end on a
        draft before j share their first n - 1 tokens with that draft's position."""
        if not self.ngram:
            return codes
        n, context = self.ngram, self.context
        num_drafts = drafts.shape[1]
        back = self.context_length[:, None] - (n - 1) + torch.arange(n - 1, device=drafts.device)
        tail = torch.where(back >= 0, context.gather(1, back.clamp_min(0)), NO_TOKEN)
        prefixes = torch.cat([tail, drafts], dim=1).unfold(1, n - 1, 1)       # [B, G+1, n-1]
        # Transformers bans nothing while its input_ids hold fewer than n tokens: then the
        # last n - 1 begin with NO_TOKEN, which a window of the context holds only at its
        # end, and a draft's position before j with more of them.
        count = context.shape[1] - n + 1
        last = context[:, n - 1:]                   # window p's last token; NO_TOKEN: unwritten
        match = (last >= 0)[:, None, :]
        for k in range(n - 1):
            match = match & (context[:, None, k:k + count] == prefixes[:, :, k, None])
        if num_drafts:
            positions = torch.arange(num_drafts + 1, device=drafts.device)
            before = positions[:, None] > positions[None, :num_drafts]      # [G+1, G]: i < j
            on_drafts = ((prefixes[:, :, None, :] == prefixes[:, None, :num_drafts, :]).all(dim=-1)
                         & before & (drafts >= 0)[:, None, :])
            match = torch.cat([match, on_drafts], dim=2)                     # [B, G+1, C-n+1+G]
            last = torch.cat([last, drafts], dim=1)
        index = last.clamp_min(0)[:, None, :].expand(match.shape)
        return codes.scatter_reduce_(-1, index, match.to(torch.uint8) * BAN, reduce="amax")

    def _with_position_bans(self, codes: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
        """A new tensor: `codes` ``[..., V]`` (broadcast to ``[*generated.shape, V]``) with
        EOS banned where `generated` is below the minimum, the begin-suppressed tokens where
        it is the begin position, and every token where it is a forced position."""
        if not self.position_bans:
            return codes.expand(*generated.shape, codes.shape[-1]).clone()
        which = (generated < self.min_count).long() + 2 * (generated == self.begin_count).long()
        if self.forces:
            forced = (generated[..., None] == self.forced_count).any(dim=-1)
            which = torch.where(forced, FORCED_ROW, which)
        return torch.maximum(codes, self.ban_rows[which])

    def _with_forced_tokens(self, codes: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
        """`codes` ``[..., V]`` with the forced token's code at a forced position (after
        `generated` ``[...]`` tokens), whatever the bans before made of it: transformers'
        forcing processor undoes them."""
        if not self.forces:
            return codes
        token = torch.zeros_like(generated)
        code = torch.zeros_like(generated, dtype=torch.uint8)
        forced = torch.zeros_like(generated, dtype=torch.bool)
        for k in range(MAX_FORCED):                 # in transformers' order: the later wins
            here = generated == self.forced_count[k]
            token = torch.where(here, self.forced_token[k], token)
            code = torch.where(here, self.forced_code[k], code)
            forced |= here
        index = token[..., None]
        return codes.scatter_(-1, index, torch.where(forced[..., None], code[..., None],
                                                     codes.gather(-1, index)))

    def tensors(self) -> list[torch.Tensor]:
        """What a step writes (a graph capture's warm-up must restore it)."""
        return [self.base, self.tail, self.context, self.context_length,
                *([self.counts] if self.counts is not None else [])]

    def nbytes(self) -> int:
        return (self.base.numel() + self.ban_rows.numel()
                + 8 * (self.tail.numel() + self.words.numel() + self.word_ends.numel()
                       + self.context.numel())
                + sum(4 * t.numel() for t in (self.bias, self.counts) if t is not None))


def bans_every_token(edits: LogitEdits, tokens: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """Bool ``[B]``: sampled rows (`sampled` ``[B]``) whose token `tokens` (``[B]``, or ``[B, W]``
    with -1 past a row's last) is banned at its position by `edits` (codes ``[B, V]`` or
    ``[B, W, V]``). The Gumbel race only picks a banned token when every token is banned:
    transformers' sampling fails there (torch.multinomial of a row of -inf), greedy decoding
    takes token 0, as the kernels' argmax does."""
    codes = edits.codes.gather(-1, tokens.clamp_min(0)[..., None])[..., 0]
    banned = (codes == BAN) & (tokens >= 0)
    return (banned.view(tokens.shape[0], -1).any(dim=1)) & sampled
