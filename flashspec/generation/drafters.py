"""Drafters: where the tokens that the target verifies come from.

The engine knows drafters only through `Drafter`: it attaches a drafter to a batch's
running state (`flashspec.generation.slot.Slot`) once, then, each speculative step, asks the
attached drafter for the fixed-shape device steps that write the step's drafts into
``slot.drafts``. The engine captures each of those steps as a CUDA graph and replays it, so a
drafter step must not read the device from the host. Drafts are greedy (one-hot), which is
what the strict verification rule needs for exact speculative sampling; ``-1`` means no
draft.

Rollback is by position: a drafter that keeps a KV cache registers it with the slot
(`Slot.add_cache`), whose entries at positions a later forward re-feeds are dropped then;
rejected drafts cost nothing to undo.

* `AssistantDrafter`: a small causal LM with the target's vocabulary, greedy through the
  tiled argmax, on its own KV cache.
* `PromptLookupDrafter`: n-gram matching over each row's prompt and generated tokens, on
  the device and batched, with transformers' rule (longest n-gram first, first match from
  the left, up to G following tokens).

A new drafter (EAGLE-3 heads: `eagle3`; MTP layers: `mtp`, both on `chain`'s steps; a fixed
continuation in a test) subclasses `Drafter` and `AttachedDrafter`; the engine does not
change.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

from .. import reference
from ..params import BANNED_LOGIT
from . import fused_projections
from .allowed import mask_edits
from .heads import OutputHead

Step = tuple[Hashable, Callable[[], None]]


class AttachedDrafter:
    """A drafter bound to one slot: the state it keeps there and its steps."""

    # Whether the steps draft among a call's allowed tokens (grammars): the host then fills
    # each drafted position's masks into ``slot.allowed_masks[:, column]`` before the step
    # writing that column (`Slot.fill_draft_masks`), where `Slot.masks_drafts`.
    reads_masks = False

    def use(self, drafter: "Drafter") -> None:
        """This call's `drafter` (a key equal to the attachment's), with its per-call
        settings."""

    def start(self, prompt) -> None:
        """A new call's prompts are in the slot (``prompt``: input ids, positions and live
        flags ``[B, L]``, left-aligned, as the target's prefill reads them); the target
        samples each row's first token after it, and the first `steps` draft the next
        ones. Eager."""

    def prefilled(self, prompt, taps: torch.Tensor | None) -> None:
        """The target read the prompts (`prompt` as in `start`); `taps`: the hidden states
        the drafter's `Drafter.taps` name at each prompt column, ``[B, L, n * D]`` (None
        without taps). Eager."""

    def columns(self, width: int) -> int:
        """KV columns the steps of `width` drafts write past what the drafter's cache keeps
        (the engine makes room for them before the steps run)."""
        return width + 2

    def steps(self, width: int) -> list[Step]:
        """The device steps that fill ``slot.drafts[:, :width]`` and
        ``slot.draft_failed[:, :width]`` (True where the drafter could not draft, e.g. the
        assistant's logits were not finite: the engine reports it), each ``(graph key, fn)``
        of fixed shapes."""
        raise NotImplementedError

    def state_tensors(self) -> list[torch.Tensor]:
        """Device tensors the steps write besides the slot's (restored after a capture's
        warm-up run)."""
        return []


class Drafter:
    """A source of drafts. `key` identifies the state it keeps: drafters with equal keys
    share their attachment (and its captured graphs) in a slot; `decoders` are the models
    whose KV caches it keeps there (for the engine's memory budget); `taps`: the target
    layers whose input hidden states it reads (`flashspec.generation.taps`: the engine's
    target steps copy them into ``slot.taps``, the prefill's into `AttachedDrafter.prefilled`'s
    argument)."""

    key: Hashable
    decoders: tuple = ()
    taps: tuple[int, ...] = ()
    name = "the drafter"            # in messages (the drafter's logits were not finite)

    def check_target(self, head) -> None:
        """Refuse (ValueError, naming why) a target it cannot draft for (`head`: the
        target's `OutputHead`), before the call runs."""

    def attach(self, slot) -> AttachedDrafter:
        raise NotImplementedError


class AssistantDrafter(Drafter):
    """Greedy drafts from an assistant model that shares the target's vocabulary.

    `confidence_threshold` (transformers' ``assistant_confidence_threshold``; 0: none): a row
    stops drafting after a draft whose probability under the assistant is below it, as
    stock's assistant does, where steps run eagerly (the CPU's), which read the
    probabilities for free and save the later drafts' and their verification's forwards.
    Captured steps and tensor-parallel heads draft their fixed count (a verification's width
    is fixed there; the tokens are the same either way)."""

    name = "assistant_model"

    def __init__(self, head: OutputHead, confidence_threshold: float = 0.0):
        self.head = head
        self.confidence_threshold = confidence_threshold
        self.decoders = (head.decoder,)
        fused_projections.fuse_where_compiled(head.decoder)
        # Captured graphs read the assistant's parameters where they are now.
        self.key = ("assistant", id(head.decoder), head.weight.data_ptr(),
                    tuple(p.data_ptr() for p in head.decoder.parameters()))

    def attach(self, slot) -> AttachedDrafter:
        return _AttachedAssistant(self.head, slot)


class _AttachedAssistant(AttachedDrafter):
    """The assistant's KV cache in the slot, and its two step kinds: ``draft_first`` feeds a
    row's last two tokens (the one before the last may be an accepted draft the assistant
    never saw) and drafts one token; ``draft_next`` feeds the previous draft and drafts the
    next. `start` reads the prompts into the cache."""

    # Greedy drafts among the grammar's tokens agree with the target's constrained tokens
    # far more often than free ones (the tiny pair, a JSON schema: 90% of positions, against
    # 11%).
    reads_masks = True

    def __init__(self, head: OutputHead, slot):
        self.head = head
        self.slot = slot
        self.runner, self.cache = slot.add_cache(head.decoder, "assistant_model", refeed=2)
        self.count = torch.zeros((), dtype=torch.long, device=slot.device)
        self.confidence_threshold = 0.0
        # Eager CPU steps with a threshold: rows done drafting this step (host-read).
        self.stopped: torch.Tensor | None = None

    def use(self, drafter: AssistantDrafter) -> None:
        self.confidence_threshold = drafter.confidence_threshold

    @property
    def _stops_unconfident(self) -> bool:
        """Whether this call's rows stop drafting below the threshold: eager steps of a whole
        LM head (a tensor-parallel rank holds a shard: its ranks draft alike through the
        sampler's exchange, the full count)."""
        return (self.confidence_threshold > 0 and self.slot.device.type == "cpu"
                and not self.runner.compile and self.head.shards is None)

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.count]

    @property
    def sampler(self):
        """The LM-head operations of this call's sampler kind (its argmax)."""
        return self.slot.sampler(self.head.weight, self.head.shards)

    def start(self, prompt) -> None:
        self.slot.forward_prompt(self.runner, self.cache, *prompt)

    def steps(self, width: int) -> list[Step]:
        return [("draft_first", self._draft_first)] + [("draft_next", self._draft_next)] * (width - 1)

    def _draft_first(self) -> None:
        slot = self.slot
        positions = (slot.length - 2)[:, None] + torch.arange(2, device=slot.device)
        # A row of one token (a finished row padding the batch) has no token before its last.
        live = positions >= 0
        positions = positions.clamp_min(0)
        hidden = self.runner.step(self.cache, slot.seq.gather(1, positions), positions, live)[:, -1]
        # Finished rows (padding a batch) draft nothing.
        self.stopped = slot.finished.clone() if self._stops_unconfident else None
        self._write(0, *self._argmax(hidden, self.count.new_zeros(1)))
        self.count.fill_(1)

    def _draft_next(self) -> None:
        slot = self.slot
        count = self.count.view(1)
        if self.stopped is not None and bool(self.stopped.all()):
            no_draft = torch.full_like(slot.length, -1)
            self._write(int(count), no_draft, torch.zeros_like(self.stopped))  # no forward
            self.count.add_(1)
            return
        # A compiled step takes two tokens or more: the previous draft and a dead copy. An
        # eager one takes the draft alone (on CPU a second row of every matmul costs 1.7x
        # the first).
        fed = 2 if self.runner.compile and not self.runner.eager else 1
        previous = slot.drafts.index_select(1, count - 1).clamp_min(0).repeat(1, fed)
        # Rows that take fewer drafts keep drafting (unused), inside their budget's positions:
        # past it, a learned position table could end.
        positions = torch.minimum(slot.length[:, None] + count - 1, (slot.end - 1)[:, None])
        hidden = self.runner.step(self.cache, previous, positions.repeat(1, fed),
                                  slot.one_live[:, :fed])[:, 0]
        tokens, failed = self._argmax(hidden, count)
        self.slot.drafts.index_copy_(1, count, tokens[:, None])
        self.slot.draft_failed.index_copy_(1, count, failed[:, None])
        self.count.add_(1)

    def _argmax(self, hidden: torch.Tensor,
                column: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The assistant's greedy draft of each row (-1 where its logits are not finite),
        and where it failed so: among the call's allowed tokens at draft `column` ``[1]``
        where `Slot.masks_drafts`. With `stopped`: -1 and not failed for the rows that
        stopped drafting, which then take in those whose draft's probability is below the
        threshold (the draft itself is kept, as stock's stopping criterion keeps it)."""
        hidden = hidden.to(self.head.weight.dtype)
        allowed = self.slot.draft_allowed(column)
        if allowed is not None:       # the assistant's vocabulary (on a tensor-parallel one:
            allowed = allowed[:, : self.head.vocab_size]   # all of it, each rank its shard's)
        if self.stopped is None:
            tokens = self.sampler.argmax(hidden, None if allowed is None else mask_edits(allowed))
            return tokens, tokens < 0
        logits = reference.compute_logits(hidden, self.head.weight)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, BANNED_LOGIT)
        tokens = reference.argmax_logits(logits).tokens
        failed = (tokens < 0) & ~self.stopped
        # The draft's own logit, not a second pass for the maximum (a failed row's is moot:
        # the call stops on it).
        top = logits.gather(-1, tokens.clamp_min(0)[:, None])[:, 0]
        tokens = torch.where(self.stopped, -1, tokens)
        probability = (top - logits.logsumexp(dim=-1)).exp()
        self.stopped |= probability < self.confidence_threshold
        return tokens, failed

    def _write(self, column: int, tokens: torch.Tensor, failed: torch.Tensor) -> None:
        self.slot.drafts[:, column] = tokens
        self.slot.draft_failed[:, column] = failed


class PromptLookupDrafter(Drafter):
    """n-gram drafts copied from earlier in each row (prompt lookup decoding)."""

    def __init__(self, max_ngram_size: int):
        self.max_ngram_size = max_ngram_size
        self.key = ("lookup", max_ngram_size)

    def attach(self, slot) -> AttachedDrafter:
        return _AttachedLookup(self.max_ngram_size, slot)


class _AttachedLookup(AttachedDrafter):
    def __init__(self, max_ngram_size: int, slot):
        self.max_ngram_size = max_ngram_size
        self.slot = slot

    def steps(self, width: int) -> list[Step]:
        return [(("lookup", width), lambda: self._lookup(width))]

    def _lookup(self, width: int) -> None:
        """Drafts from each row's tokens so far (right-aligned for the search), those the
        call knows: not a prompt given as embeddings or by a passed cache only (as stock's
        prompt lookup searches its input_ids)."""
        slot = self.slot
        columns = slot.seq.shape[1]
        source = torch.arange(columns, device=slot.device)[None, :] - columns + slot.length[:, None]
        valid = source >= slot.known_from[:, None]
        tokens = torch.where(valid, slot.seq.gather(1, source.clamp_min(0)), 0)
        allowed = torch.full_like(slot.length, width)
        slot.drafts[:, :width] = prompt_lookup_drafts(tokens, valid, allowed, self.max_ngram_size,
                                                      num_drafts=width)
        slot.draft_failed[:, :width] = False


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
