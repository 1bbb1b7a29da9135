"""The acceptance chain of verification, from each position's merged result: which drafts
are accepted, the recovered or bonus token, the logprobs. The rules of
`flashspec.reference.verify_logits` (and of the fused kernels' finaliser), applied to
per-position results instead of materialized logits.
"""

from __future__ import annotations

import torch

from .. import rng
from ..outputs import NON_FINITE, OK, VerifyOutput
from ..params import SamplingParams
from .merge import MergedRows

INVALID_TOKEN = -1


def flat_drafts(draft_tokens: torch.Tensor) -> torch.Tensor:
    """int64 ``[B * (G+1)]``: each position's draft, -1 after a row's first padding and at
    its last position."""
    is_draft = (draft_tokens >= 0).cumprod(dim=1).bool()
    drafts = torch.where(is_draft, draft_tokens, INVALID_TOKEN)
    return torch.cat([drafts, drafts.new_full((drafts.shape[0], 1), INVALID_TOKEN)], 1).flatten()


def accept(rows: MergedRows, draft_tokens: torch.Tensor, params: SamplingParams,
           positions: torch.Tensor, acceptance: str) -> VerifyOutput:
    """`VerifyOutput` of ``draft_tokens [B, G]`` from `rows` ``[B * (G+1)]`` (position j of
    batch row b at b * (G+1) + j), `acceptance` "strict" or "probabilistic"."""
    batch_size, num_drafts = draft_tokens.shape
    num_positions = num_drafts + 1
    shape = (batch_size, num_positions)
    offsets = torch.arange(num_positions, device=draft_tokens.device)
    drafts = flat_drafts(draft_tokens).view(shape)
    has_draft = drafts >= 0
    used = offsets[None, :] <= has_draft.sum(dim=1, keepdim=True)
    finite = (rows.finite.view(shape) | ~used).all(dim=1)
    target = rows.tokens.view(shape)
    greedy = params.is_greedy[:, None]
    accept_probs = torch.where(greedy, (drafts == target).to(rows.logprobs.dtype),
                               rows.draft_probs.view(shape))
    accept_probs = torch.where(has_draft, accept_probs, 0.0)

    if acceptance == "strict":
        accepted = has_draft & (drafts == target)
        replacement, replacement_logprob = target, rows.logprobs.view(shape)
    else:
        u = rng.uniform(params.seed[:, None], positions[:, None] + offsets[None, :], 0,
                        stream=rng.ACCEPT_STREAM, validate=False)
        accepted = has_draft & torch.where(greedy, drafts == target, u < accept_probs.double())
        replacement = torch.where(has_draft, rows.masked.view(shape), target)
        replacement_logprob = torch.where(has_draft, rows.masked_logprobs.view(shape),
                                          rows.logprobs.view(shape))

    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    emitted = offsets[None, :] <= num_accepted[:, None]
    at_stop = offsets[None, :] == num_accepted[:, None]
    tokens = torch.where(at_stop, replacement, drafts)
    logprobs = torch.where(at_stop, replacement_logprob, rows.draft_logprobs.view(shape))
    tokens = torch.where(emitted & finite[:, None], tokens, INVALID_TOKEN)
    logprobs = torch.where(emitted & finite[:, None], logprobs, 0.0)
    return VerifyOutput(torch.where(finite, num_accepted, -1), tokens,
                        accept_probs[:, :num_drafts], logprobs,
                        torch.where(finite, OK, NON_FINITE).to(torch.int32))
