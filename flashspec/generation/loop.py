"""The decode loop: plain fused sampling, or draft-then-verify speculative decoding.

Every step feeds the target the tokens its cache lacks (the whole prompt on the first
step), plus the drafts if any, takes the final hidden states and calls
`flashspec.lm_head_sample` (no drafts) or `flashspec.lm_head_verify` (drafts). The LM head
is never run. Row b's token at sequence index i is keyed by (seed[b], i), so plain and
speculative runs emit the same tokens.

The running `Batch` is right-aligned (padding on the left only). After a step, row b
appends its ``emitted[b]`` tokens and is shifted right by ``max(emitted) - emitted[b]``
columns so that all rows end in the last column again; the caches follow the same shift
(`CachedDecoder.realign`). Finished rows leave the batch.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .. import api
from .cache import CachedDecoder
from .outputs import SpeculationStats


@dataclasses.dataclass
class Batch:
    """The unfinished rows: ``tokens``/``valid`` ``[B, L]`` right-aligned, ``rows[b]`` the
    output row that batch row b belongs to."""

    tokens: torch.Tensor
    valid: torch.Tensor
    rows: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        """Real tokens per row, i.e. the sequence index of the row's next token."""
        return self.valid.sum(dim=1)

    @property
    def positions(self) -> torch.Tensor:
        """Sequence index of every column (0 on padding), as transformers computes it."""
        return (self.valid.cumsum(dim=1) - 1).clamp_min(0)


@dataclasses.dataclass
class Generated:
    """What the loop produced: ``tokens[b, :count[b]]`` are row b's new tokens (the rest is
    padding), ``logprobs`` the same shape (or None), and the speculation statistics."""

    tokens: torch.Tensor
    count: torch.Tensor
    logprobs: torch.Tensor | None
    stats: SpeculationStats


def decode(plan) -> Generated:
    """Run `plan` (a `flashspec.generation.setup.GenerationPlan`) to the end."""
    device = plan.input_ids.device
    num_rows = plan.input_ids.shape[0]
    out_tokens = torch.full((num_rows, plan.max_new_tokens), plan.pad_token_id, dtype=torch.long,
                            device=device)
    out_logprobs = torch.zeros(num_rows, plan.max_new_tokens, device=device) if plan.output_logprobs else None
    out_count = torch.zeros(num_rows, dtype=torch.long, device=device)
    num_drafts = torch.full((num_rows,), plan.num_drafts, dtype=torch.long, device=device)
    steps = []                      # (rows, drafted, accepted, emitted, accept_probs)

    batch = Batch(plan.input_ids, plan.attention_mask.bool(), torch.arange(num_rows, device=device))
    target = CachedDecoder(plan.head.decoder, "model")
    caches = [target] + (plan.drafter.caches if plan.drafter is not None else [])
    started = time.monotonic()
    while len(batch.rows):
        params = plan.params.select(batch.rows, validate=False)
        budget = plan.max_new_tokens - out_count[batch.rows]
        drafts = None
        if plan.drafter is not None:
            max_drafts = torch.minimum(num_drafts[batch.rows], budget - 1)
            if int(max_drafts.max()) > 0:
                drafts = _trim(plan.drafter.propose(batch, max_drafts))
        if drafts is None:
            new_tokens, new_logprobs = _sample_step(plan, target, batch, params)
            accepted = torch.zeros_like(batch.rows)
            accept_probs = new_logprobs.new_zeros(len(batch.rows), 0)
        else:
            new_tokens, new_logprobs, accepted, accept_probs = _verify_step(plan, target, batch,
                                                                            params, drafts)
        emitted, finished = _stop(plan, batch, new_tokens, accepted + 1, budget)
        timed_out = plan.max_time is not None and time.monotonic() - started > plan.max_time
        finished |= timed_out

        columns = torch.arange(new_tokens.shape[1], device=device)
        write = columns[None, :] < emitted[:, None]
        out_rows = batch.rows[:, None].expand_as(write)[write]
        out_columns = (out_count[batch.rows][:, None] + columns[None, :])[write]
        out_tokens[out_rows, out_columns] = new_tokens[write]
        if out_logprobs is not None:
            out_logprobs[out_rows, out_columns] = new_logprobs[write].float()
        out_count[batch.rows] += emitted
        if plan.streamer is not None:
            plan.streamer.put(new_tokens[0, : int(emitted[0])].cpu())

        num_real = (drafts >= 0).sum(dim=1) if drafts is not None else torch.zeros_like(accepted)
        steps.append((batch.rows, num_real, accepted, emitted, accept_probs))
        if plan.schedule == "heuristic" and drafts is not None:
            num_drafts[batch.rows] = heuristic_draft_counts(num_drafts[batch.rows], accepted,
                                                            num_real)
        batch = _advance(batch, caches, new_tokens, emitted, ~finished, plan.pad_token_id)
    if plan.streamer is not None:
        plan.streamer.end()
    if plan.persist_schedule is not None:
        plan.persist_schedule(num_drafts)
    return Generated(out_tokens, out_count, out_logprobs, SpeculationStats.from_steps(steps, num_rows))


def _trim(drafts: torch.Tensor) -> torch.Tensor | None:
    """Drop trailing columns without a draft in any row; None when no row has one, so
    that the step is a plain sampling step, not a verification of nothing."""
    width = int((drafts >= 0).sum(dim=1).max())
    return drafts[:, :width] if width else None


def _sample_step(plan, target: CachedDecoder, batch: Batch, params):
    hidden = target.forward(batch.tokens[:, target.cached:], batch.valid,
                            batch.positions[:, target.cached:])[:, -1]
    weight = plan.head.weight
    tokens, logprobs = api.lm_head_sample(hidden.to(weight.dtype), weight, params, batch.lengths,
                                          return_logprobs=True)
    return tokens[:, None], logprobs[:, None]


def _verify_step(plan, target: CachedDecoder, batch: Batch, params, drafts: torch.Tensor):
    num_drafts = drafts.shape[1]
    offsets = torch.arange(num_drafts, device=drafts.device)
    input_ids = torch.cat([batch.tokens[:, target.cached:], drafts.clamp_min(0)], dim=1)
    # A row's padding (other rows draft more) is fed at its bonus token's position, inside
    # its budget: past it, a learned position table could end. Causality goes by column.
    last = batch.lengths + (drafts >= 0).sum(dim=1)
    position_ids = torch.cat([batch.positions[:, target.cached:],
                              torch.minimum(batch.lengths[:, None] + offsets[None, :],
                                            last[:, None])], dim=1)
    attention_mask = torch.cat([batch.valid, batch.valid.new_ones(drafts.shape)], dim=1)
    hidden = target.forward(input_ids, attention_mask, position_ids)[:, -(num_drafts + 1):]
    weight = plan.head.weight
    out = api.lm_head_verify(hidden.to(weight.dtype).contiguous(), weight, drafts, params, batch.lengths)
    return out.tokens, out.logprobs, out.num_accepted, out.accept_probs


def _stop(plan, batch: Batch, new_tokens: torch.Tensor, proposed: torch.Tensor,
          budget: torch.Tensor):
    """How many of each row's proposed tokens are emitted, and which rows are finished:
    the row's budget, its first EOS and its first completed stop string end it."""
    emitted = torch.minimum(proposed, budget)
    ends = torch.zeros_like(new_tokens, dtype=torch.bool)
    if plan.eos_token_ids is not None:
        ends |= torch.isin(new_tokens, plan.eos_token_ids)
    if plan.stop_criteria is not None:
        context = torch.cat([batch.tokens, new_tokens.clamp_min(0)], dim=1)
        length = batch.tokens.shape[1]
        for j in range(int(emitted.max())):
            ends[:, j] |= plan.stop_criteria(context[:, : length + j + 1], None).to(ends.device)
    emitted, has_end = cut_at_first_end(emitted, ends)
    return emitted, has_end | (emitted == budget)


def cut_at_first_end(emitted: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's emitted count cut after its first end (``ends`` bool ``[B, W]``: EOS or a
    completed stop string) among the tokens it emits, and whether it had one."""
    columns = torch.arange(ends.shape[1], device=ends.device)
    ends = ends & (columns[None, :] < emitted[:, None])
    has_end = ends.any(dim=1)
    return torch.where(has_end, ends.int().argmax(dim=1) + 1, emitted), has_end


def heuristic_draft_counts(num_drafts: torch.Tensor, accepted: torch.Tensor,
                           drafted: torch.Tensor) -> torch.Tensor:
    """transformers' "heuristic" schedule: two more drafts after a step that accepted all
    of its drafts, one fewer (at least one) otherwise."""
    grow = (accepted == drafted) & (drafted > 0)
    return torch.where(grow, num_drafts + 2, (num_drafts - 1).clamp_min(1))


def _advance(batch: Batch, caches: list[CachedDecoder], new_tokens: torch.Tensor,
             emitted: torch.Tensor, keep: torch.Tensor, pad_token_id: int) -> Batch:
    """Append each kept row's emitted tokens, right-align the rows again, drop columns that
    are padding in every row, and move the caches the same way.

    The bookkeeping is a few ints per row, read to the host once."""
    length = batch.tokens.shape[1]
    emitted_of, keep_of, length_of = torch.stack([emitted, keep.long(), batch.lengths]).tolist()
    kept = [b for b, k in enumerate(keep_of) if k]
    if not kept:
        return Batch(batch.tokens[:0], batch.valid[:0], batch.rows[:0])
    widest = max(emitted_of[b] for b in kept)
    shift = [widest - emitted_of[b] for b in kept]                 # right shift of each row
    lead = min(s + length - length_of[b] for s, b in zip(shift, kept))   # all-padding columns
    new_length = length + widest - lead
    # Row b's cache is good up to its last accepted token (column length + emitted - 2 before
    # the shift; later columns hold rejected drafts) or up to what the model had cached.
    cache_keep = [min(min(min(length + emitted_of[b] - 1, cache.cached) + s - lead
                          for s, b in zip(shift, kept)), new_length - 1) for cache in caches]

    if len(kept) == len(keep_of) and lead == 0 and not any(shift):
        # Every row advanced by the same count (always so in plain decoding): append.
        tokens = torch.cat([batch.tokens, new_tokens[:, :widest]], dim=1)
        valid = torch.cat([batch.valid, batch.valid.new_ones(len(kept), widest)], dim=1)
        for cache, keep_columns in zip(caches, cache_keep):
            if keep_columns <= 0:
                cache.reset()
            elif keep_columns < cache.cached:
                cache.crop(keep_columns)
        return Batch(tokens, valid, batch.rows)

    device = batch.tokens.device
    rows = torch.tensor(kept, device=device)
    extended = torch.cat([batch.tokens, new_tokens.clamp_min(0)], dim=1)[rows]
    columns = torch.arange(new_tokens.shape[1], device=device)
    extended_valid = torch.cat([batch.valid, columns[None, :] < emitted[:, None]], dim=1)[rows]
    shift = torch.tensor(shift, device=device)
    source = torch.arange(new_length, device=device)[None, :] + lead - shift[:, None]
    inside = source >= 0
    source = source.clamp_min(0)
    valid = extended_valid.gather(1, source) & inside
    # New left padding holds pad ids, not copies: stop strings read these columns.
    tokens = torch.where(valid, extended.gather(1, source), pad_token_id)
    for cache, keep_columns in zip(caches, cache_keep):
        if keep_columns <= 0:
            cache.reset()
        else:
            cache.realign(rows, source, keep_columns)
    return Batch(tokens, valid, batch.rows[rows])
