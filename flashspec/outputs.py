"""What the LM-head operations return: one typed result per operation, and the per-row status
codes those results carry.

Every implementation (the fused kernels, the torch reference, the materialized baseline)
returns these types, with the same fields whatever the arguments, so that a caller never
asks which one ran. The status codes are defined here once; the Triton kernels turn them into
their constexprs (`flashspec.kernels.merge`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Row status, int32 in every result's `status` field.
OK = 0
NEEDS_COMPLETION = 1  # a truncated support overflowed the fused kernels' candidate budget
NON_FINITE = 2        # NaN or infinite logits (or logits / temperature)
NO_TOKEN_LEFT = 3     # a sampled row's logit edits ban every token (the engine's steps only)


class ArgmaxOutput(NamedTuple):
    """Greedy tokens of `flashspec.sampling.argmax`.

    Attributes:
        tokens: int64 ``[B]``, ``argmax(hidden @ weight.T)`` per row, lowest id on ties; -1
            where status is not `OK`.
        status: int32 ``[B]``: `OK` or `NON_FINITE`.
    """

    tokens: torch.Tensor
    status: torch.Tensor


class SampleOutput(NamedTuple):
    """One sampled token per row, from `flashspec.sampling.sample`.

    Attributes:
        tokens: int64 ``[B]``; -1 where status is not `OK`.
        logprobs: float32 ``[B]`` (float64 for float64 inputs on the reference), each token's
            log-probability under the row's transformed distribution (the raw softmax for
            greedy rows).
        lse: same dtype ``[B]``, log-sum-exp of the transformed logits over the support (of
            the raw logits for greedy rows): logprob = transformed logit - lse.
        status: int32 ``[B]``: `OK`, `NEEDS_COMPLETION` or `NON_FINITE`. logprobs and lse
            of a row that is not `OK` are meaningless (NaN on the reference).
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    lse: torch.Tensor
    status: torch.Tensor


class VerifyOutput(NamedTuple):
    """Result of verifying G drafted tokens per row, from `flashspec.sampling.verify`.

    Attributes:
        num_accepted: int64 ``[B]``, accepted drafts per row; -1 where status is not `OK`.
        tokens: int64 ``[B, G+1]``; ``tokens[b, :num_accepted[b] + 1]`` are emitted (the
            accepted drafts, then one recovered or bonus token), the rest is -1 (all of it
            where status is not `OK`).
        accept_probs: float32 ``[B, G]`` (float64 for float64 inputs on the reference),
            probability that each draft is accepted: p(x) under the transformed target
            distribution for sampled rows, 1 or 0 (draft == argmax) for greedy rows, 0 for
            padded drafts.
        logprobs: same dtype ``[B, G+1]``, log-probability of each emitted token under the
            row's transformed distribution (the raw softmax for greedy rows); 0 where
            nothing was emitted.
        status: int32 ``[B]``: `OK`, `NEEDS_COMPLETION` or `NON_FINITE`, over the positions
            the row can emit (its drafts and the one after them).
    """

    num_accepted: torch.Tensor
    tokens: torch.Tensor
    accept_probs: torch.Tensor
    logprobs: torch.Tensor
    status: torch.Tensor
