"""Allowed-token masks: each (row, position)'s set of tokens a call may emit there, the
primitive that structured output (grammars, JSON schemas) is made of.

A mask is xgrammar's and vLLM's token bitmask: int32 ``[..., ceil(V / 32)]``, token v allowed
iff bit ``v % 32`` of word ``v // 32`` is set. The LM-head kernels see it as `BAN` codes,
which `flashspec.kernels.edit_codes.verify_codes` writes in the step's one pass over its
codes (with the call's other fused edits), so the logits still never exist.

A call gives its masks as a function of each position's context (`AllowedTokens`), the one
contract that stays exact under speculation: a drafted position is asked with the drafts
before it, and a rejected draft's answer is dropped with it. Three ways in:

* transformers' ``prefix_allowed_tokens_fn(batch_id, input_ids) -> list[int]``, called per
  row as transformers' `PrefixConstrainedLogitsProcessor` calls it (stock's ``input_ids``
  row: the left-padded prompt and the generated tokens; an empty list is an error there and
  here);
* flashspec's ``allowed_tokens_fn(rows, input_ids) -> mask``, batched: `rows` int64 ``[N]``
  (the call's row of each context), ``input_ids`` ``[N, L]`` (as above, one length per call),
  and the mask either bool ``[N, V]`` or the int32 bitmask ``[N, ceil(V / 32)]``;
* flashspec's ``structured_output`` (`grammar.StructuredOutput`): xgrammar's matchers.

All are applied where transformers applies its processors: before temperature and the
warpers (a top-k keeps the k most likely allowed tokens). The host asks them before each
step (`Slot.fill_allowed`: it reads the step's drafts) and copies the masks into a buffer the
step reads, so that the steps stay captured in CUDA graphs. Such a call does not decode a
whole step ahead of the host; where the masks come from the host's reports alone
(grammars), its steps run split and only the forward runs ahead: the host fills a step's
masks while the step's forward runs (`Engine._decode_masked`).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from ..params import BAN, LogitEdits
from .processing import position_contexts


@functools.lru_cache(maxsize=None)
def _bits(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """0..31 on `device`: made once per device, so that a CUDA graph's capture, which a
    warm-up run of the same step precedes, copies nothing from the host."""
    return torch.arange(32, dtype=dtype, device=device)


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., ceil(V / 32)]``: the bitmask of bool ``[..., V]`` `allowed`."""
    vocab = allowed.shape[-1]
    words = -(-vocab // 32)
    padded = torch.nn.functional.pad(allowed.to(torch.int64), (0, 32 * words - vocab))
    bits = padded.view(*allowed.shape[:-1], words, 32) << _bits(allowed.device, torch.int64)
    values = bits.sum(dim=-1)
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)  # bit 31: sign


def mask_edits(allowed: torch.Tensor) -> LogitEdits:
    """The `LogitEdits` that ban the tokens bool `allowed` ``[B, V]`` leaves out, and
    nothing else: a drafter's argmax among a grammar's tokens."""
    codes = (~allowed).to(torch.uint8).mul_(BAN)      # KEEP is 0; uint8 throughout
    return LogitEdits(codes, torch.ones(len(allowed), dtype=torch.float64, device=allowed.device))


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[..., V]``: the tokens int32 `bitmask` ``[..., ceil(V / 32)]`` allows."""
    bits = (bitmask[..., None] >> _bits(bitmask.device, torch.int32)) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


class AllowedTokens:
    """A call's allowed tokens, asked per step for the positions it decides.

    Args:
        sources: ``(masks_of, name)`` pairs, a token allowed where all allow it: `masks_of`
            ``(rows [N], input_ids [N, L]) -> bool [N, V] or int32 [N, ceil(V/32)]``,
            `name` the argument it came from (named in errors).
        prompt_ids: ``[B, L]`` the call's rows as stock's ``input_ids`` start.
        pad_token_id: what stock feeds a row past its end (never a listed row's context).
        vocab_size: V.
    """

    def __init__(self, sources: list[tuple[Callable, str]], prompt_ids: torch.Tensor,
                 pad_token_id: int, vocab_size: int):
        self.sources = sources
        self.prompt_ids = prompt_ids
        self.pad_token_id = pad_token_id
        self.vocab_size = vocab_size
        # (generated count, token) where a forced token overrides the masks (`edits`).
        self.forced: frozenset[tuple[int, int]] = frozenset()
        # The call's grammars when they are its only source (`grammar.StructuredOutput`):
        # they answer from the host's reports alone (`host_masks`).
        self.structured = None

    @property
    def from_host(self) -> bool:
        """Whether the masks come from the host's reports alone (`advance`, `host_masks`):
        grammars only, no forced token that could override them."""
        return self.structured is not None and not self.forced

    def advance(self, report) -> None:
        """After each step: its report (the rows' emitted tokens) to the grammars."""
        if self.from_host:
            self.structured.advance(report)

    def host_masks(self, drafts: list[list[int]] | None, width: int, out: torch.Tensor,
                   resume: bool = False) -> None:
        """`bitmask`'s masks of `width` positions into host `out` ``[S, >= width, words]``
        from the host's reports and `drafts` (-1 padded lists): `from_host` calls only.
        `resume`: the positions `draft_masks` filled this step stay."""
        self.structured.fill(drafts, width, out, resume)

    def draft_masks(self, column: int, previous: list[int] | None, out: torch.Tensor) -> None:
        """Before the drafter's step writing draft `column`: the masks of that position into
        `out[:, column]`, after each row's draft `previous[row]` at the column before (None
        for column 0): `from_host` calls whose drafter reads them."""
        if column == 0:
            self.structured.start(out)
        else:
            self.structured.extend(previous)

    @classmethod
    def of_call(cls, prefix_allowed_tokens_fn, allowed_tokens_fn, prompt_ids: torch.Tensor,
                pad_token_id: int, vocab_size: int,
                structured=None) -> "AllowedTokens | None":
        """The masks of a call's ``prefix_allowed_tokens_fn``, ``allowed_tokens_fn`` and
        ``structured_output`` (`structured`: a `grammar.StructuredOutput`; any may be
        None), or None without any."""
        sources = []
        if structured is not None:
            sources.append((structured.masks_of, "structured_output"))
        if prefix_allowed_tokens_fn is not None:
            sources.append((_masks_of_prefix_fn(prefix_allowed_tokens_fn, vocab_size),
                            "prefix_allowed_tokens_fn"))
        if allowed_tokens_fn is not None:
            sources.append((allowed_tokens_fn, "allowed_tokens_fn"))
        made = cls(sources, prompt_ids, pad_token_id, vocab_size) if sources else None
        if made is not None and len(sources) == 1:
            made.structured = structured
        return made

    def masks(self, rows: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """int32 ``[N, ceil(V / 32)]``: the tokens every source allows after the contexts
        `input_ids` ``[N, L]`` of the call's rows `rows` ``[N]``; a ValueError where none."""
        out = None
        for masks_of, name in self.sources:
            masks = self._checked(masks_of(rows, input_ids), len(rows), name)
            out = masks if out is None else out & masks.to(out.device)
        words = torch.arange(out.shape[1], device=out.device)
        # Bits past V in the last word allow nothing.
        last = torch.where(words == out.shape[1] - 1, low_bits(self.vocab_size % 32), -1)
        empty = ((out & last.to(torch.int32)) == 0).all(dim=1)
        if bool(empty.any()):
            row = int(rows[int(empty.nonzero()[0, 0])])
            names = " and ".join(f"`{name}`" for _, name in self.sources)
            raise ValueError(f"{names} allow{'s' if len(self.sources) == 1 else ''} no token "
                             f"for row {row} after its {input_ids.shape[1]}-token context: the "
                             "constraint is unsatisfiable there")
        return out

    def prefix_fn(self, batch_id: int, sent: torch.Tensor) -> list[int]:
        """transformers' ``prefix_allowed_tokens_fn`` of these masks: the materialized path
        hands it to transformers' own processor, which applies it in its place."""
        masks = self.masks(torch.tensor([batch_id]), sent[None])
        return unpack(masks, self.vocab_size)[0].nonzero().flatten().tolist()

    def bitmask(self, slot, drafts: torch.Tensor | None, width: int) -> torch.Tensor:
        """int32 ``[S, W, ceil(V / 32)]`` (S: the slot's rows): each position's allowed
        tokens. Every token at the positions nothing reads: those a row does not use, those
        after a draft its position's mask leaves out (never accepted, so never reached: a
        grammar need not answer for such a context), and on rows finished or past the
        call's."""
        words = -(-self.vocab_size // 32)
        device = slot.seq.device
        out = torch.full((slot.seq.shape[0], width, words), -1, dtype=torch.int32, device=device)
        generated = (slot.length - slot.prompt_length).tolist()
        drafted = drafts.tolist() if drafts is not None else None
        unreached = {}                                    # row -> its first unreached position
        for group, positions, input_ids in position_contexts(self.prompt_ids, self.pad_token_id,
                                                             slot, drafts, width):
            pairs = [(b, j) for b, j in zip(group.tolist(), positions.tolist())
                     if j < unreached.get(b, width)]
            if not pairs:
                continue
            which = torch.tensor([b for b, _ in pairs])
            masks = self.masks(which, input_ids[which.to(input_ids.device)])
            at = torch.tensor([j for _, j in pairs], device=device)
            out[which.to(device), at] = masks.to(device)
            if drafted is None:
                continue
            for (b, j), mask in zip(pairs, masks.cpu()):
                draft = drafted[b][j] if j < len(drafted[b]) else -1
                if draft >= 0 and not (int(mask[draft // 32]) >> (draft % 32)) & 1 \
                        and (generated[b] + j, draft) not in self.forced:
                    unreached[b] = j + 1
        return out

    def _checked(self, masks, count: int, name: str) -> torch.Tensor:
        words = -(-self.vocab_size // 32)
        if isinstance(masks, torch.Tensor) and masks.dim() == 2 and masks.shape[0] == count:
            if masks.dtype == torch.bool and masks.shape[1] == self.vocab_size:
                return pack(masks)
            if masks.dtype == torch.int32 and masks.shape[1] == words:
                return masks
        shown = (f"a {masks.dtype} tensor of shape {tuple(masks.shape)}"
                 if isinstance(masks, torch.Tensor) else f"{type(masks).__name__}")
        raise TypeError(f"`{name}` returned {shown} for {count} contexts; allowed: a "
                        f"bool tensor [{count}, {self.vocab_size}] or an int32 bitmask "
                        f"[{count}, {words}] (bit v % 32 of word v // 32 allows token v)")


def low_bits(count: int) -> int:
    """The int32 word whose `count` low bits are set (all 32 for 0)."""
    return -1 if count == 0 else (1 << count) - 1


def _masks_of_prefix_fn(fn: Callable, vocab_size: int) -> Callable:
    """transformers' ``prefix_allowed_tokens_fn(batch_id, input_ids) -> list[int]`` as a
    ``masks_of``: one call per row, as transformers' `PrefixConstrainedLogitsProcessor`."""
    def masks_of(rows: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        allowed = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
        for i, (row, sent) in enumerate(zip(rows.tolist(), input_ids)):
            ids = fn(row, sent)
            if len(ids) == 0:
                raise ValueError(f"`prefix_allowed_tokens_fn` returned an empty list for "
                                 f"batch ID {row}: the constraint is unsatisfiable there "
                                 "(transformers refuses it too)")
            index = torch.as_tensor(ids, dtype=torch.long).flatten().cpu()
            if bool(((index < -vocab_size) | (index >= vocab_size)).any()):
                raise ValueError(f"`prefix_allowed_tokens_fn` returned token ids outside "
                                 f"the vocabulary [0, {vocab_size}) for batch ID {row}: "
                                 f"{sorted(set(index.tolist()))[:8]}")
            allowed[i, index] = True      # negative ids count from the end, as in stock
        return allowed
    return masks_of
