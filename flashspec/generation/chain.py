"""Drafters fed the target's own hidden states: EAGLE-3 heads (`eagle3`), MTP layers (`mtp`).

Both are one decoder layer over a KV cache of their own, taking at each position a hidden
state and a token, and both draft the same way (`ChainSteps`):

* after the prefill (`prefilled`, eager), the layer reads every prompt position but the last:
  target position q pairs the target's hidden state at q (its `Drafter.taps`, through the
  head's `combine`) with the token at q + 1;
* each speculative step's first draft step (``first``, captured) feeds the positions the last
  target step verified and accepted (from the first it fed, ``slot.tap_position``, to the one
  before the row's last token), with the target's states there, and drafts from the last of
  them; its entries replace those the previous chain wrote there (rollback by position, as
  vLLM's first pass rewrites them);
* each further draft (``next``) feeds the previous draft with the layer's previous output as
  its hidden state (chain drafts).

A head gives: its decoder (the module the engine's runner drives: ``forward(input_ids,
<input_name>=hidden, ...)`` returning the layer output), `combine` (the tapped target states
to the layer's hidden input), `draft` (layer outputs to target token ids, -1 where it
failed), and `shift` (the model position of the layer's entry for target position q: q, or
q + 1 where the model's own code feeds MTP layers one position on; the cache keeps the entry
at position q either way, `WindowCache.position_shift`).
"""

from __future__ import annotations

import torch

from .drafters import AttachedDrafter, Step


class ChainHead:
    """What `ChainSteps` needs of a head (`Eagle3`, `Mtp`)."""

    decoder: torch.nn.Module
    input_name: str
    role: str
    shift: int = 0
    width: int                    # the layer's hidden size

    def combine(self, taps: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def draft(self, slot, hidden: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """Target token ids ``[B]`` drafted from the layer outputs `hidden` ``[B, H]`` (-1
        where the head's logits were not finite), among the target ids bool `allowed`
        ``[B, V]`` allows (None: all)."""
        raise NotImplementedError


class ChainSteps(AttachedDrafter):
    """A `ChainHead`'s KV cache in the slot, the previous draft's layer output, and the
    steps (module docstring)."""

    reads_masks = True

    def __init__(self, head: ChainHead, slot):
        self.head = head
        self.slot = slot
        # `_first` feeds again from the position of the last target step's first column: at
        # least the row's last two.
        self.runner, self.cache = slot.add_cache(head.decoder, head.role, refeed=2)
        self.cache.position_shift = head.shift
        self.count = torch.zeros((), dtype=torch.long, device=slot.device)
        self.first_column = torch.zeros(1, dtype=torch.long, device=slot.device)
        dtype = next(head.decoder.parameters()).dtype
        self.hidden = torch.zeros(slot.batch_size, head.width, dtype=dtype, device=slot.device)

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.count, self.hidden]

    def start(self, prompt) -> None:
        """With a shift, a right-padded row's model positions move on (`Slot.load`) from the
        entry of the position before its first new token."""
        if self.head.shift:
            cache = self.cache
            cache.set_offsets(cache.offset.clone(), self.slot.prompt_length - self.head.shift)

    def prefilled(self, prompt, taps: torch.Tensor) -> None:
        """Prompt positions q <= P - 2 of each row (P: its prompt length), with the token at
        q + 1; the last one comes with the first step (`_first`)."""
        ids, positions, live = prompt
        slot = self.slot
        # Columns a passed cache held have zero taps (the prefill did not feed them): their
        # entries are fed all the same, since the attention by position reads every position
        # up to a query's.
        live = live & (positions <= (slot.prompt_length - 2)[:, None])
        following = slot.seq.gather(1, (positions + 1).clamp_max(slot.seq.shape[1] - 1))
        slot.forward_prompt(self.runner, self.cache, following, positions, live,
                            inputs={self.head.input_name: self.head.combine(taps)})

    def columns(self, width: int) -> int:
        # The first step's columns for every tap column, then one per further draft (a
        # dead column each step reuses) and one dead.
        return self.slot.taps.shape[1] + width + 1

    def steps(self, width: int) -> list[Step]:
        role = self.head.role
        return [(f"{role}_first", self._first)] + [(f"{role}_next", self._next)] * (width - 1)

    def _first(self) -> None:
        slot = self.slot
        taps = slot.taps
        columns = torch.arange(taps.shape[1], device=slot.device)
        start = slot.tap_position
        last = slot.length - 2             # the pair that drafts the token after the last
        positions = start[:, None] + columns
        live = positions <= last[:, None]
        following = slot.seq.gather(1, (positions + 1).clamp(0, slot.seq.shape[1] - 1))
        # Dead columns stay inside the row's budget (a learned position table could end).
        fed = torch.minimum(positions, (slot.end - 1)[:, None]).clamp_min(0)
        hidden = self.runner.step(self.cache, following, fed, live,
                                  inputs={self.head.input_name: self.head.combine(taps)})
        pick = (last - start).clamp(0, taps.shape[1] - 1)
        hidden = hidden.gather(1, pick[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
        self._draft(self.first_column, hidden)
        self.count.fill_(1)

    def _next(self) -> None:
        slot = self.slot
        count = self.count.view(1)
        # A compiled step takes two tokens or more: the previous draft and a dead copy.
        fed = 2 if self.runner.compile and not self.runner.eager else 1
        previous = slot.drafts.index_select(1, count - 1).clamp_min(0).repeat(1, fed)
        positions = torch.minimum(slot.length[:, None] + count - 2, (slot.end - 1)[:, None])
        hidden = self.runner.step(
            self.cache, previous, positions.repeat(1, fed), slot.one_live[:, :fed],
            inputs={self.head.input_name: self.hidden[:, None].repeat(1, fed, 1)})
        self._draft(count, hidden[:, 0])
        self.count.add_(1)

    def _draft(self, column: torch.Tensor, hidden: torch.Tensor) -> None:
        """Draft from the layer outputs `hidden` ``[B, H]`` into ``drafts[:, column]``."""
        self.hidden.copy_(hidden)
        tokens = self.head.draft(self.slot, hidden, self.slot.draft_allowed(column))
        self.slot.drafts.index_copy_(1, column, tokens[:, None])
        self.slot.draft_failed.index_copy_(1, column, (tokens < 0)[:, None])
