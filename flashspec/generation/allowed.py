"""Allowed-token masks: each (row, position)'s set of tokens a call may emit there, the
primitive that structured output (grammars, JSON schemas) is made of.

A mask is xgrammar's and vLLM's token bitmask: int32 ``[..., ceil(V / 32)]``, token v allowed
iff bit ``v % 32`` of word ``v // 32`` is set. The LM-head kernels see it as `BAN` codes,
which `flashspec.kernels.edit_codes.verify_codes` writes in the step's one pass over its
codes (with the call's other fused edits), so the logits still never exist.

A call gives its masks as a function of each position's context (`AllowedTokens`), the one
contract that stays exact under speculation: a drafted position is asked with the drafts
before it, and a rejected draft's answer is dropped with it. Two ways in:

* transformers' ``prefix_allowed_tokens_fn(batch_id, input_ids) -> list[int]``, called per
  row as transformers' `PrefixConstrainedLogitsProcessor` calls it (stock's ``input_ids``
  row: the left-padded prompt and the generated tokens; an empty list is an error there and
  here);
* flashspec's ``allowed_tokens_fn(rows, input_ids) -> mask``, batched: `rows` int64 ``[N]``
  (the call's row of each context), ``input_ids`` ``[N, L]`` (as above, one length per call),
  and the mask either bool ``[N, V]`` or the int32 bitmask ``[N, ceil(V / 32)]``.

Both are applied where transformers applies its processors: before temperature and the
warpers (a top-k keeps the k most likely allowed tokens). Each step that asks them reads the
host, so such a call runs its steps eagerly (no CUDA graphs).
"""

from __future__ import annotations

from typing import Callable

import torch

from .processing import position_contexts

_BITS = torch.arange(32, dtype=torch.int32)


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., ceil(V / 32)]``: the bitmask of bool ``[..., V]`` `allowed`."""
    vocab = allowed.shape[-1]
    words = -(-vocab // 32)
    padded = torch.nn.functional.pad(allowed.to(torch.int64), (0, 32 * words - vocab))
    bits = padded.view(*allowed.shape[:-1], words, 32) << _BITS.to(allowed.device, torch.int64)
    values = bits.sum(dim=-1)
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)  # bit 31: sign


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[..., V]``: the tokens int32 `bitmask` ``[..., ceil(V / 32)]`` allows."""
    bits = (bitmask[..., None] >> _BITS.to(bitmask.device)) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


class AllowedTokens:
    """A call's allowed tokens, asked per step for the positions it decides.

    Args:
        masks_of: ``(rows [N], input_ids [N, L]) -> bool [N, V] or int32 [N, ceil(V/32)]``.
        name: the argument it came from, named in errors.
        prompt_ids: ``[B, L]`` the call's rows as stock's ``input_ids`` start.
        pad_token_id: what stock feeds a row past its end (never a listed row's context).
        vocab_size: V.
    """

    def __init__(self, masks_of: Callable, name: str, prompt_ids: torch.Tensor,
                 pad_token_id: int, vocab_size: int):
        self.masks_of = masks_of
        self.name = name
        self.prompt_ids = prompt_ids
        self.pad_token_id = pad_token_id
        self.vocab_size = vocab_size

    @classmethod
    def from_prefix_fn(cls, fn: Callable, prompt_ids: torch.Tensor, pad_token_id: int,
                       vocab_size: int) -> "AllowedTokens":
        """transformers' ``prefix_allowed_tokens_fn``, one call per row and position."""
        def masks_of(rows: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
            allowed = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
            for i, (row, sent) in enumerate(zip(rows.tolist(), input_ids)):
                ids = fn(row, sent)
                if len(ids) == 0:
                    raise ValueError(f"`prefix_allowed_tokens_fn` returned an empty list for "
                                     f"batch ID {row}: the constraint is unsatisfiable there "
                                     "(transformers refuses it too)")
                index = torch.as_tensor(ids, dtype=torch.long).flatten()
                if bool(((index < -vocab_size) | (index >= vocab_size)).any()):
                    raise ValueError(f"`prefix_allowed_tokens_fn` returned token ids outside "
                                     f"the vocabulary [0, {vocab_size}) for batch ID {row}: "
                                     f"{sorted(set(index.tolist()))[:8]}")
                allowed[i, index] = True      # negative ids count from the end, as in stock
            return allowed
        return cls(masks_of, "prefix_allowed_tokens_fn", prompt_ids, pad_token_id, vocab_size)

    def bitmask(self, slot, drafts: torch.Tensor | None, width: int) -> torch.Tensor:
        """int32 ``[S, W, ceil(V / 32)]`` (S: the slot's rows): each position's allowed
        tokens; every token at positions a row does not use, and on rows finished or past
        the call's."""
        words = -(-self.vocab_size // 32)
        device = slot.seq.device
        out = torch.full((slot.seq.shape[0], width, words), -1, dtype=torch.int32, device=device)
        for rows, positions, input_ids in position_contexts(self.prompt_ids, self.pad_token_id,
                                                            slot, drafts, width):
            masks = self.masks_of(rows, input_ids[rows])
            out[rows, positions] = self._checked(masks, len(rows)).to(device)
        return out

    def _checked(self, masks, count: int) -> torch.Tensor:
        words = -(-self.vocab_size // 32)
        if isinstance(masks, torch.Tensor) and masks.dim() == 2 and masks.shape[0] == count:
            if masks.dtype == torch.bool and masks.shape[1] == self.vocab_size:
                return pack(masks)
            if masks.dtype == torch.int32 and masks.shape[1] == words:
                return masks
        shown = (f"a {masks.dtype} tensor of shape {tuple(masks.shape)}"
                 if isinstance(masks, torch.Tensor) else f"{type(masks).__name__}")
        raise TypeError(f"`{self.name}` returned {shown} for {count} contexts; allowed: a "
                        f"bool tensor [{count}, {self.vocab_size}] or an int32 bitmask "
                        f"[{count}, {words}] (bit v % 32 of word v // 32 allows token v)")
