"""Structured output: JSON schemas, regexes and grammars as allowed-token masks (xgrammar).

``generate(..., sampler="flash", structured_output=spec, tokenizer=tokenizer)`` constrains
each row to a language. `spec` takes the shapes users know from vLLM's structured outputs
and OpenAI's ``response_format``:

* ``{"json": schema}`` (a dict or a JSON string; with ``"disable_any_whitespace": True``
  no whitespace between the JSON's tokens), ``{"regex": pattern}``, ``{"grammar": ebnf}``
  (xgrammar's EBNF, GBNF-like: ``root ::= ...``), ``{"choice": [str, ...]}``,
  ``{"json_object": True}`` (any JSON, xgrammar's built-in grammar): vLLM's
  `StructuredOutputsParams` fields;
* ``{"type": "json_schema", "json_schema": {"schema": schema, ...}}`` and ``{"type":
  "json_object"}``: OpenAI's ``response_format``;
* an ``xgrammar.Grammar``, or an ``xgrammar.CompiledGrammar`` (compiled for the model's
  tokenizer, with ``vocab_size`` up to the LM head's rows; then no tokenizer is needed);
* a list of those with one entry per prompt (None: that row is free).

Grammars are compiled for the tokenizer's own ids (``len(tokenizer)``); the LM head's rows
past them (a padded vocabulary) are never allowed, as xgrammar treats them. Each row gets
xgrammar's `GrammarMatcher`, whose stop tokens are the call's EOS ids: a row
whose text completes the grammar may only end, and ends as at EOS. The masks reach the fused
kernels through `allowed.AllowedTokens`, which asks them per position with the position's
context, drafts included. A row's matcher follows the contexts it is asked about: it rolls
back to the longest prefix it shares with the new context and accepts the rest, so that a
step's drafted positions advance it along the drafts, a rejected draft rolls it back, and
the accepted drafts and the corrected token advance it for good. Nothing is asked after a
draft its position's mask leaves out (`AllowedTokens.bitmask`), so the drafts a matcher
accepts are those the grammar allows. With the grammars alone the masks come from the host's
reports (`advance`, `start`, `extend`), and drafters that read them (`AttachedDrafter.
reads_masks`: assistants, EAGLE-3 heads, MTP layers) draft among each position's allowed
tokens, the host filling a position's masks before the step that drafts it.

xgrammar is an optional dependency: ``pip install "flashspec[structured]"``.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import torch

from .allowed import low_bits

PARAMETER = "structured_output"
EXTRA = "flashspec[structured]"
# vLLM's `StructuredOutputsParams` fields this takes, one per spec.
VLLM_FIELDS = ("json", "regex", "grammar", "choice", "json_object")
WHITESPACE_OPTION = "disable_any_whitespace"     # vLLM's name, beside "json"
FORMS = ("{'json': schema}, {'regex': pattern}, {'grammar': ebnf}, {'choice': [...]}, "
         "{'json_object': True}, OpenAI's {'type': 'json_schema', 'json_schema': {'schema': "
         "...}} or {'type': 'json_object'}, an xgrammar Grammar or CompiledGrammar, or a list "
         "with one of those (or None) per prompt")

_COMPILERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ImportError(f"`{PARAMETER}` needs xgrammar: pip install \"{EXTRA}\"") from None
    return xgrammar


def _compiler(tokenizer):
    """xgrammar's compiler for `tokenizer`'s ids, made once per tokenizer (it reads the
    whole vocabulary, and caches the grammars it compiles)."""
    if tokenizer not in _COMPILERS:
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        _COMPILERS[tokenizer] = xgr.GrammarCompiler(info)
    return _COMPILERS[tokenizer]


class StructuredOutput:
    """A call's grammars as an `AllowedTokens` source: ``masks_of(rows, input_ids)``.

    Args:
        grammars: one ``xgrammar.CompiledGrammar`` or None per row of the call (after
            ``num_return_sequences`` expansion), all for one vocabulary of at most V ids.
        prompt_width: the width of the call's left-padded prompts (a context's tokens after
            it are the row's generated tokens and drafts).
        stop_token_ids: the call's EOS ids: the matchers' stop tokens.
        vocab_size: V, the model's LM-head rows.
    """

    def __init__(self, grammars: list, prompt_width: int, stop_token_ids: list[int],
                 vocab_size: int):
        xgr = _xgrammar()
        self.prompt_width = prompt_width
        self.stop_token_ids = frozenset(stop_token_ids)
        self.matchers = [None if g is None
                         else xgr.GrammarMatcher(g, override_stop_tokens=stop_token_ids)
                         for g in grammars]
        self.paths: list[list[int]] = [[] for _ in grammars]    # tokens each matcher accepted
        # Of them, the row's own (emitted) tokens, and whether the row is finished: the
        # engine's reports say (`advance`).
        self.committed = [0] * len(grammars)
        self.finished = [False] * len(grammars)
        # The grammars' vocabulary: masks cover its words, the LM head's others are banned.
        self.grammar_vocab = next(g for g in grammars if g is not None).tokenizer_info.vocab_size
        self.words = -(-vocab_size // 32)
        self._bitmask = torch.zeros(len(grammars), -(-self.grammar_vocab // 32),
                                    dtype=torch.int32)
        self._check_start()

    @classmethod
    def of_call(cls, spec, tokenizer, batch_size: int, expand: int, prompt_width: int,
                eos_token_ids: list[int], vocab_size: int) -> "StructuredOutput | None":
        """The call's `spec` (module docstring) for its `batch_size` prompts, each row
        repeated `expand` times (``num_return_sequences``); None without a spec. Refuses,
        naming what and why, a spec of another shape, one xgrammar cannot compile, a
        tokenizer that is not the model's, a call without EOS ids, and a grammar that no
        token can start."""
        if spec is None:
            return None
        specs = spec if isinstance(spec, list) else [spec] * batch_size
        if len(specs) != batch_size:
            raise ValueError(f"`{PARAMETER}` is a list of {len(specs)} entries for {batch_size} "
                             "prompts: give one spec, or one per prompt")
        if all(s is None for s in specs):
            return None
        if not eos_token_ids:
            raise ValueError(f"`{PARAMETER}` needs an `eos_token_id`: a row whose text completes "
                             "its grammar ends with one (the call and the model's generation "
                             "config have none)")
        compiled: dict[int, Any] = {}                   # one compilation per distinct spec
        grammars = []
        for row, entry in enumerate(specs):
            if id(entry) not in compiled:
                compiled[id(entry)] = _compiled(entry, tokenizer, vocab_size, row, eos_token_ids)
            grammars.extend([compiled[id(entry)]] * expand)
        sizes = sorted({g.tokenizer_info.vocab_size for g in grammars if g is not None})
        if len(sizes) > 1:
            raise ValueError(f"`{PARAMETER}`'s grammars are compiled for vocabularies of {sizes} "
                             "tokens: give one call grammars of one tokenizer")
        return cls(grammars, prompt_width, list(eos_token_ids), vocab_size)

    def masks_of(self, rows: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """int32 ``[N, ceil(V / 32)]``: each row's tokens allowed after its context (every
        token on a row without a grammar)."""
        generated = input_ids[:, self.prompt_width:].tolist()
        out = torch.full((len(rows), self.words), -1, dtype=torch.int32)
        indices = []
        for i, (row, tokens) in enumerate(zip(rows.tolist(), generated)):
            if self.matchers[row] is None:
                continue
            # Past a row's EOS (transformers' processors ask for its padding too) nothing
            # is read: every token stays allowed.
            end = next((k for k, token in enumerate(tokens) if token in self.stop_token_ids),
                       None)
            self._follow(row, tokens if end is None else tokens[: end + 1])
            if end is not None:
                continue
            self.matchers[row].fill_next_token_bitmask(self._bitmask, i)
            indices.append(i)
        self._place(out, indices, self._bitmask[indices])
        return out

    def _place(self, out: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
        """`masks` ``[N, grammar words]`` as rows `rows` of `out` ``[S, words]`` (the LM
        head's ids past the grammar's vocabulary banned)."""
        out[rows, : masks.shape[1]] = masks
        out[rows, masks.shape[1]:] = 0

    def advance(self, report) -> None:
        """After a step: each row's emitted tokens (its `slot.Report`'s) join its text."""
        for row, matcher in enumerate(self.matchers):
            count = report.emitted[row]
            self.finished[row] = bool(report.finished[row])
            if matcher is None or count == 0:
                continue
            emitted = [report.tokens[k][row] for k in range(count)]
            self._follow(row, emitted, start=self.committed[row])
            self.committed[row] += count

    def fill(self, drafts: list[list[int]] | None, width: int, out: torch.Tensor,
             resume: bool = False) -> None:
        """The masks of a step's `width` positions from the rows' texts and `drafts` (the
        step's, -1 padded; None: none) into `out` int32 ``[S, width, words]``, host memory
        (S >= the call's rows): `masks_of`'s for each position's context, without reading
        the device. A row's matcher fills position j, then accepts its draft there; a draft
        its mask leaves out ends the row's positions (never reached). Every token where
        nothing reads: rows finished or free, and unreached positions. `resume`: the
        positions `start` and `extend` filled this step stay (masked drafts)."""
        if not resume:
            self.start(out)
        while self._next < width:
            self.extend([row[self._next - 1] for row in drafts])

    def start(self, out: torch.Tensor) -> None:
        """Begin a step's masks in `out` (`fill`): the rows' matchers back at their texts,
        position 0 filled."""
        self._out = out
        self._active = [row for row, matcher in enumerate(self.matchers)
                        if matcher is not None and not self.finished[row]]
        for row in self._active:
            self._follow(row, [], start=self.committed[row])   # the last step's drafts off
        self._next = 0
        self._fill_next()

    def extend(self, drafts: list[int]) -> None:
        """The next position's masks after each row's draft `drafts[row]` at the position
        before (-1: none), for the rows that reach it (not past a draft the grammar leaves
        out, nor past an EOS)."""
        reached = []
        for row in self._active:
            draft, matcher = drafts[row], self.matchers[row]
            if draft >= 0 and matcher.accept_token(draft):
                self.paths[row].append(draft)
                if not matcher.is_terminated():        # after an EOS draft nothing is read
                    reached.append(row)
        self._active = reached
        self._fill_next()

    def _fill_next(self) -> None:
        # One matcher at a time: xgrammar's batched fill costs milliseconds a call on a
        # 16-core host (its threads), a matcher's microseconds.
        for row in self._active:
            self.matchers[row].fill_next_token_bitmask(self._bitmask, row)
        column = self._out[:, self._next]
        column.fill_(-1)
        if self._active:
            self._place(column, self._active, self._bitmask[self._active])
        self._next += 1

    def _follow(self, row: int, tokens: list[int], start: int = 0) -> None:
        """Bring row `row`'s matcher to the context whose generated tokens are the first
        `start` it accepted, then `tokens`: roll back to the longest prefix they share with
        what it accepted, accept the rest."""
        matcher, path = self.matchers[row], self.paths[row]
        shared = start
        for a, b in zip(path[start:], tokens):
            if a != b:
                break
            shared += 1
        if shared < len(path):
            matcher.rollback(len(path) - shared)
            del path[shared:]
        tokens = tokens[shared - start:]
        for token in tokens:
            if not matcher.accept_token(token):
                raise ValueError(f"`{PARAMETER}`: row {row}'s grammar does not allow token "
                                 f"{token} after its {len(path)} generated tokens, which a "
                                 "logit edit forced there (`forced_eos_token_id`, "
                                 "`forced_bos_token_id`): the two cannot both hold")
            path.append(token)

    def _check_start(self) -> None:
        """Refuse a grammar that allows no token (not even the end) before any text."""
        for row, matcher in enumerate(self.matchers):
            if matcher is None:
                continue
            bitmask = self._bitmask[row: row + 1]
            matcher.fill_next_token_bitmask(bitmask)
            words = bitmask[0].clone()
            words[-1] &= low_bits(self.grammar_vocab % 32)
            if not bool((words != 0).any()):
                raise ValueError(f"`{PARAMETER}` for row {row} allows no token to start with: "
                                 "its grammar matches no text this tokenizer can write")


def _compiled(entry, tokenizer, vocab_size: int, row: int, eos_token_ids: list[int]):
    """The xgrammar `CompiledGrammar` of one spec (None: a free row)."""
    if entry is None:
        return None
    xgr = _xgrammar()
    where = f"`{PARAMETER}` (row {row})"
    if isinstance(entry, xgr.CompiledGrammar):
        _check_vocabulary(f"{where} is an xgrammar CompiledGrammar for a vocabulary of",
                          entry.tokenizer_info.vocab_size, vocab_size, eos_token_ids)
        return entry
    kind, source, any_whitespace = _kind(entry, where)
    compiler = _compiler(_checked_tokenizer(tokenizer, vocab_size, eos_token_ids))
    try:
        if kind == "grammar_object":
            return compiler.compile_grammar(source)
        if kind == "json":
            text = source if isinstance(source, str) else json.dumps(source)
            return compiler.compile_json_schema(text, any_whitespace=any_whitespace)
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(source)
        if kind == "choice":
            return compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(choice) for choice in source))
        return compiler.compile_grammar(source)
    except (RuntimeError, ValueError, TypeError) as error:
        reason = str(error).strip().splitlines()[-1]
        raise ValueError(f"{where}: xgrammar cannot compile its {kind}: {reason}") from None


def _kind(entry, where: str) -> tuple[str, Any, bool]:
    """(kind, source, any whitespace in JSON) of a spec that is not compiled; TypeError or
    ValueError otherwise."""
    xgr = _xgrammar()
    if isinstance(entry, xgr.Grammar):
        return "grammar_object", entry, True
    if not isinstance(entry, dict):
        raise TypeError(f"{where} is a {type(entry).__name__}; allowed: {FORMS}")
    if "type" in entry:                                   # OpenAI's response_format
        if entry["type"] == "json_object" and set(entry) == {"type"}:
            return "json_object", None, True
        if entry["type"] == "json_schema" and isinstance(entry.get("json_schema"), dict) \
                and "schema" in entry["json_schema"]:
            return "json", _schema(entry["json_schema"]["schema"], where), True
        raise ValueError(f"{where} = {_shown(entry)} is not one of OpenAI's structured "
                         "response formats flashspec takes: {'type': 'json_schema', "
                         "'json_schema': {'schema': ...}} or {'type': 'json_object'}")
    fields = [key for key in entry if key in VLLM_FIELDS]
    unknown = [key for key in entry if key not in VLLM_FIELDS and key != WHITESPACE_OPTION]
    if len(fields) != 1 or unknown:
        raise ValueError(f"{where} = {_shown(entry)} must have exactly one of the keys "
                         f"{VLLM_FIELDS} (and for 'json', optionally {WHITESPACE_OPTION!r}); "
                         f"allowed: {FORMS}")
    kind, source = fields[0], entry[fields[0]]
    if WHITESPACE_OPTION in entry:
        if kind != "json" or not isinstance(entry[WHITESPACE_OPTION], bool):
            raise ValueError(f"{where}: {WHITESPACE_OPTION!r} goes with 'json' and is True or "
                             f"False, got {_shown(entry)}")
    if kind == "json":
        return kind, _schema(source, where), not entry.get(WHITESPACE_OPTION, False)
    if kind == "json_object":
        if source is not True:
            raise ValueError(f"{where}: 'json_object' must be True, got {source!r}")
        return kind, None, True
    if kind == "choice":
        if not (isinstance(source, (list, tuple)) and source
                and all(isinstance(c, str) for c in source)):
            raise ValueError(f"{where}: 'choice' must be a non-empty list of strings, got "
                             f"{_shown(source)}")
        return kind, list(source), True
    if not isinstance(source, str):
        raise ValueError(f"{where}: '{kind}' must be a string, got {type(source).__name__}")
    return kind, source, True


def _schema(schema, where: str):
    if isinstance(schema, (dict, bool)):
        return schema
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except ValueError as error:
            raise ValueError(f"{where}: the JSON schema is not valid JSON: {error}") from None
        return schema
    raise ValueError(f"{where}: a JSON schema must be a dict or a JSON string, got "
                     f"{type(schema).__name__}")


def _checked_tokenizer(tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """`tokenizer`, refused where it cannot be the model's: more tokens than the LM head's
    rows, or an EOS id of the call it does not have."""
    if tokenizer is None:
        raise ValueError(f"`{PARAMETER}` needs the model's tokenizer: pass `tokenizer=` to "
                         "generate() (as for stop strings), or an xgrammar CompiledGrammar")
    _check_vocabulary("`tokenizer` has", len(tokenizer), vocab_size, eos_token_ids)
    return tokenizer


def _check_vocabulary(what: str, size: int, vocab_size: int, eos_token_ids: list[int]) -> None:
    """Refuse a grammar's vocabulary of `size` ids (`what` names it) that cannot be the
    model's: more ids than the LM head's rows, or without an EOS id of the call."""
    if size > vocab_size:
        raise ValueError(f"{what} {size} tokens and the model's LM head {vocab_size} rows: it "
                         f"is not this model's tokenizer (`{PARAMETER}` masks tokens by its ids)")
    unknown = [token for token in eos_token_ids if token >= size]
    if unknown:
        raise ValueError(f"{what} {size} tokens but the call's `eos_token_id` includes "
                         f"{unknown}: it is not this model's tokenizer")


def _shown(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
