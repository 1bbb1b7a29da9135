"""Drafters: propose up to G tokens per row for the target to verify in one forward.

Both are greedy (one-hot) drafters, which is what the strict verification rule needs for
exact speculative sampling. A drafter returns int64 ``[B, G]`` drafts, -1 padded: row b
gets at most ``max_drafts[b]`` tokens (fewer when prompt lookup finds a shorter match).

* `AssistantDrafter`: a small causal LM with the same vocabulary, run greedily through the
  tiled argmax kernel (`flashspec.lm_head_argmax`) on its own KV cache.
* `PromptLookupDrafter`: n-gram matching over each row's prompt and generated tokens, on
  the device and batched, with transformers' rule (longest n-gram first, first match from
  the left, up to G following tokens).
"""

from __future__ import annotations

import torch

from .. import api
from ..checks import NonFiniteLogitsError
from .cache import CachedDecoder
from .heads import OutputHead


class AssistantDrafter:
    """Greedy drafts from an assistant model that shares the target's vocabulary."""

    def __init__(self, head: OutputHead):
        self.head = head
        self.decoder = CachedDecoder(head.decoder, "assistant_model")

    @property
    def caches(self) -> list[CachedDecoder]:
        return [self.decoder]

    def propose(self, batch, max_drafts: torch.Tensor) -> torch.Tensor:
        num_steps = int(max_drafts.max())
        weight = self.head.weight
        input_ids = batch.tokens[:, self.decoder.cached:]
        position_ids = batch.positions[:, self.decoder.cached:]
        attention_mask = batch.valid
        # Rows with fewer drafts than others keep drafting (discarded), at positions inside
        # their budget: past it, a learned position table could end.
        last_position = (batch.lengths + max_drafts)[:, None]
        drafts = []
        for step in range(num_steps):
            hidden = self.decoder.forward(input_ids, attention_mask, position_ids)[:, -1]
            drafts.append(api.lm_head_argmax(hidden.to(weight.dtype), weight))
            if step + 1 < num_steps:          # the last draft is fed next round, if accepted
                input_ids = drafts[-1][:, None].clamp_min(0)
                position_ids = torch.minimum(position_ids[:, -1:] + 1, last_position)
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(hidden), 1)], 1)
        drafts = torch.stack(drafts, dim=1)
        # The argmax is -1 where the assistant's logits are not finite: report, don't draft.
        within_budget = torch.arange(num_steps, device=drafts.device)[None, :] < max_drafts[:, None]
        broken = ((drafts < 0) & within_budget).any(dim=1)
        if bool(broken.any()):
            raise NonFiniteLogitsError(broken.nonzero().flatten().tolist(), source="assistant_model")
        return torch.where(within_budget, drafts, -1)


class PromptLookupDrafter:
    """n-gram drafts copied from earlier in each row (prompt lookup decoding)."""

    def __init__(self, max_ngram_size: int):
        self.max_ngram_size = max_ngram_size

    @property
    def caches(self) -> list[CachedDecoder]:
        return []

    def propose(self, batch, max_drafts: torch.Tensor) -> torch.Tensor:
        return prompt_lookup_drafts(batch.tokens, batch.valid, max_drafts, self.max_ngram_size)


def prompt_lookup_drafts(tokens: torch.Tensor, valid: torch.Tensor, max_drafts: torch.Tensor,
                         max_ngram_size: int, num_drafts: int | None = None) -> torch.Tensor:
    """Drafts ``[B, num_drafts]`` (-1 padded; default width ``max(max_drafts)``, read from
    the device) by prompt lookup, per row.

    `tokens`/`valid` ``[B, L]`` hold right-aligned rows (padding on the left). For n from
    ``min(max_ngram_size, length - 1)`` down to 1, the row's last n tokens are searched
    among its earlier windows; the leftmost window that has at least one token after it
    gives the drafts: the up to ``max_drafts[b]`` tokens that follow it. Rows without a
    match get no drafts.
    """
    batch_size, length = tokens.shape
    if num_drafts is None:
        num_drafts = int(max_drafts.max()) if batch_size else 0
    drafts = tokens.new_full((batch_size, num_drafts), -1)
    if num_drafts == 0:
        return drafts
    row_length = valid.sum(dim=1)
    columns = torch.arange(length, device=tokens.device)
    found = torch.zeros(batch_size, dtype=torch.bool, device=tokens.device)
    start = torch.zeros(batch_size, dtype=torch.long, device=tokens.device)
    for n in range(min(max_ngram_size, length - 1), 0, -1):
        windows = tokens.unfold(1, n, 1)                               # [B, L-n+1, n]
        first = columns[: length - n + 1]                              # window start column
        matches = (windows == tokens[:, None, length - n:]).all(dim=2)
        # The window lies inside the row and is not the row's last n tokens themselves;
        # the row must be longer than n so that the n-gram has a predecessor window.
        matches &= (first[None, :] >= length - row_length[:, None]) & (first[None, :] < length - n)
        matches &= (row_length > n)[:, None]
        hit = matches.any(dim=1) & ~found
        start = torch.where(hit, matches.int().argmax(dim=1) + n, start)
        found |= hit
    offsets = start[:, None] + torch.arange(num_drafts, device=tokens.device)[None, :]
    copied = tokens.gather(1, offsets.clamp_max(length - 1))
    usable = found[:, None] & (offsets < length) & (offsets - start[:, None] < max_drafts[:, None])
    return torch.where(usable, copied, -1)
