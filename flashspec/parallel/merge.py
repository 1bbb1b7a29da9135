"""Every rank's summaries merged into each row's result, identically on every rank.

Rows the race decides (greedy rows, sampled rows without truncation): the winner is the
best of the ranks' best scores (ties: the lower id), the log-sum-exp that of the ranks'
log-sum-exps. In verification each rank left the draft out of its race and sent the draft's
logit: the target's own sample is the draft iff the draft's perturbed score (its noise
recomputed here by `flashspec.rng`, in float32, which the fused kernels' noise can differ
from in the last bits: a near-tie) beats the best other token, as in the fused kernels.

Truncated rows (`summary.truncated_rows`) are decided by the candidates: the ranks' top keys
merged and sorted, transformers' top-k, top-p and min-p applied to them in its order, the
token drawn among the survivors with their own noise. The merged list holds every token
that ranks above each rank's floor (`summary.py`: every token a rank left out has a key
below its floor); the survivors are *certified* to be the whole support when the first
token they drop ranks above every floor (for top-k, the first token after its tie class
too). Other rows are marked incomplete and finished by `sampling.py` from their gathered
logits. Masses are summed in float64: the survivors can differ from the float32 reference's
only where a cumulative mass or a probability ratio lies within rounding of its threshold.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import rng
from ..outputs import NON_FINITE, OK, ArgmaxOutput
from ..params import SamplingParams
from . import summary
from .layout import VocabShards
from .summary import Unpacked

_NO_ID = 2**62  # above every token id: loses every tie


class MergedRows(NamedTuple):
    """Per row (verified position) ``[R]``: the target's own sample and its logprob, the
    log-sum-exp, finiteness, and whether the row needs completion; for verification also
    the best token other than the draft (`masked`) and its logprob, and the draft's
    probability and logprob (-inf where there is no draft or it is outside the support)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    lse: torch.Tensor
    finite: torch.Tensor
    incomplete: torch.Tensor
    masked: torch.Tensor | None = None
    masked_logprobs: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None
    draft_logprobs: torch.Tensor | None = None


def merge_argmax(parts: Unpacked) -> ArgmaxOutput:
    """Greedy tokens from the ranks' (max, id) ``[n, R]``; NaN marks a non-finite shard."""
    finite = ~parts.best.isnan().any(dim=0)
    _, token, _ = _race(parts.best, parts.token)
    return ArgmaxOutput(torch.where(finite, token, -1), _status(finite))


def merge_rows(parts: Unpacked, shards: VocabShards, params: SamplingParams,
               positions: torch.Tensor, drafts: torch.Tensor | None = None) -> MergedRows:
    """Rows ``[R]`` from every rank's summaries (`summary.unpack`); row r has parameters
    ``params[r]``, noise position ``positions[r]`` and, with `drafts` (int64 ``[R]``, -1
    where none), the draft to verify."""
    finite = ~parts.lse.isnan().any(dim=0)
    lse = torch.logsumexp(parts.lse, dim=0)
    best, token, rank = _race(parts.best, parts.token)
    logprob = parts.score.gather(0, rank[None]).squeeze(0) - lse
    incomplete = torch.zeros_like(finite)
    if drafts is None:
        out = MergedRows(token, logprob, lse, finite, incomplete)
    else:
        # `token` is the best other token; the draft's score is on its own rank only.
        draft_s = parts.draft.amax(dim=0)
        has_draft = drafts >= 0
        noise = rng.gumbel(params.seed, positions, drafts.clamp_min(0), dtype=draft_s.dtype,
                           validate=False)
        draft_score = torch.where(params.is_greedy, draft_s, draft_s + noise)
        draft_wins = has_draft & ((draft_score > best)
                                  | ((draft_score == best) & (drafts < token)))
        draft_logprob = torch.where(has_draft, draft_s - lse, float("-inf"))
        out = MergedRows(torch.where(draft_wins, drafts, token),
                         torch.where(draft_wins, draft_logprob, logprob), lse, finite, incomplete,
                         token, logprob, draft_logprob.exp(), draft_logprob)
    if parts.keys is None:
        return out
    # Every row through the candidates too, the truncated ones' results kept: no host read
    # of which rows those are (the call may be captured in a CUDA graph).
    truncated = summary.truncated_rows(params, shards.vocab_size)
    merged = _merge_candidates(parts.keys, parts.floor, parts.lse, shards, params, positions,
                               drafts)
    return MergedRows(*(field if part is None else torch.where(truncated, part, field)
                        for field, part in zip(out, merged)))


def _race(best: torch.Tensor, token: torch.Tensor):
    """The ranks' best ``[n, R]`` merged: the largest score, ties to the lowest id; and the
    rank that holds it."""
    top = best.amax(dim=0)
    ids = torch.where(best == top, token, _NO_ID)
    rank = ids.argmin(dim=0)
    return top, ids.gather(0, rank[None]).squeeze(0), rank


def _merge_candidates(keys: torch.Tensor, floors: torch.Tensor, shard_lse: torch.Tensor,
                      shards: VocabShards, params: SamplingParams, positions: torch.Tensor,
                      drafts: torch.Tensor | None) -> MergedRows:
    """Truncated rows ``[T]`` from the ranks' candidate keys ``[n, T, C]``, their floors
    ``[n, T]`` and log-sum-exps ``[n, T]`` (of the transformed logits)."""
    num_ranks, num_rows, budget = keys.shape
    merged = keys.permute(1, 0, 2).reshape(num_rows, num_ranks * budget)
    raw, ids = summary.unpack_candidates(merged.sort(dim=-1, descending=True).values)
    temperature = params.temperature.float()[:, None]
    scores = torch.where(params.temperature[:, None] != 1.0, raw / temperature, raw)
    # transformers' preference: higher transformed logit, then lower id (the key order can
    # differ where two raw logits round to one transformed value).
    order = ids.argsort(dim=-1, stable=True)
    order = order.gather(-1, scores.gather(-1, order).argsort(dim=-1, descending=True,
                                                               stable=True))
    scores, ids = scores.gather(-1, order), ids.gather(-1, order)
    real = scores > float("-inf")

    # A token missing from the list has a key below its rank's floor: its raw logit equals
    # the floor's with a higher id, or is at most the next float below. An entry is
    # certified when it ranks before every such token, on every rank that could not list
    # its whole shard; certified entries are a prefix of the list.
    partial = floors != summary.PAD_KEY                             # [n, T]
    last_raw, last_id = summary.unpack_candidates(floors)
    scaled = (params.temperature != 1.0)[None, :, None]

    def transformed(raw):
        return torch.where(scaled, raw[..., None] / temperature[None], raw[..., None])

    last_s = transformed(last_raw)
    below_s = transformed(torch.nextafter(last_raw, torch.full_like(last_raw, float("-inf"))))
    entry_s, entry_id = scores[None], ids[None]
    before_missing = (entry_s > last_s) | ((entry_s == last_s) & (entry_id <= last_id[..., None])
                                           & (entry_s > below_s))
    certified_entry = (before_missing | ~partial[..., None]).all(dim=0) & real
    certified = certified_entry.sum(dim=-1)
    whole = ~partial.any(dim=0)             # every token is in the list

    top = scores[:, :1]
    gap = (scores.double() - top.double())
    keep = real.clone()
    vocab_size = shards.vocab_size
    use_top_k = (params.top_k > 0) & (params.top_k < vocab_size)
    listed = params.top_k <= scores.shape[-1]
    kth = scores.gather(-1, (params.top_k.clamp(1, scores.shape[-1]) - 1)[:, None])
    keep &= ~use_top_k[:, None] | (scores >= kth)
    top_k_support = keep.sum(dim=-1)
    mass = torch.where(keep, gap.exp(), 0.0)
    # Top-p: the mass from the token down (itself included) against 1 - top_p in float32,
    # over the top-k's support, or over the whole vocabulary (the ranks' log-sum-exp).
    total_lse = torch.logsumexp(shard_lse.double(), dim=0) - top[:, 0].double()
    total = torch.where(use_top_k, mass.sum(dim=-1), total_lse.exp())
    from_here = total[:, None] - (mass.cumsum(dim=-1) - mass)
    threshold = (1.0 - params.top_p).float().double()[:, None] * total[:, None]
    # The top entry is always kept (a mask, not an indexed store of a Python bool: that
    # would copy from the host).
    after_top = torch.arange(scores.shape[-1], device=scores.device) > 0
    keep &= ~((params.top_p < 1.0)[:, None] & (from_here <= threshold) & after_top)
    # Min-p: probability against min_p times the top one's.
    keep &= ~((params.min_p > 0.0)[:, None]
              & (gap.exp() < params.min_p.float().double()[:, None]) & after_top)
    incomplete = ~whole & ((keep.sum(dim=-1) >= certified)
                           | (use_top_k & (~listed | (top_k_support >= certified))))

    lse = (top[:, 0].double() + torch.where(keep, gap.exp(), 0.0).sum(dim=-1).log()).float()
    noise = rng.gumbel(params.seed[:, None], positions[:, None], ids, dtype=scores.dtype,
                       validate=False)
    perturbed = torch.where(keep, scores + noise, float("-inf"))

    def pick(among):
        """The Gumbel-max token of the kept entries in `among`, and its logprob."""
        race = torch.where(among, perturbed, float("-inf"))
        won = among & (race == race.amax(dim=-1, keepdim=True))
        at = torch.where(won, ids, _NO_ID).argmin(dim=-1, keepdim=True)
        return ids.gather(-1, at).squeeze(-1), scores.gather(-1, at).squeeze(-1) - lse

    token, logprob = pick(keep)
    if drafts is None:  # (finiteness: the LSE fields judged it, in merge_rows)
        return MergedRows(token, logprob, lse, None, incomplete)
    # The support is certified whole: a draft outside the kept entries has probability 0.
    is_draft = keep & (ids == drafts[:, None])
    draft_kept = is_draft.any(dim=-1)
    draft_s = torch.where(is_draft, scores, 0.0).sum(dim=-1)
    draft_logprob = torch.where(draft_kept, draft_s - lse, float("-inf"))
    others = keep & ~is_draft
    masked, masked_logprob = pick(others)
    # A support of the draft alone: it is accepted with probability 1, `masked` never emitted.
    alone = ~others.any(dim=-1)
    masked = torch.where(alone, token, masked)
    masked_logprob = torch.where(alone, logprob, masked_logprob)
    return MergedRows(token, logprob, lse, None, incomplete, masked, masked_logprob,
                      draft_logprob.exp(), draft_logprob)


def _status(finite: torch.Tensor) -> torch.Tensor:
    return torch.where(finite, OK, NON_FINITE).to(torch.int32)
