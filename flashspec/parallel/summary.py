"""What each rank sends per row: the summary of its vocabulary shard, as 32-bit words.

A row (a batch row of `sample` and `argmax`, one verified position of `verify`) is summarised
in a few fields, then, when some row of the call is truncated (top-k, top-p, min-p), in the
shard's top candidates:

====== ===== ============================================================================
field  op    value (float32 unless said)
====== ===== ============================================================================
BEST   all   the shard's best score: the raw logit's max (greedy rows, `argmax`) or the
             largest Gumbel-perturbed transformed logit (sampled rows); with `verify` the
             draft is left out. NaN in `argmax`: the shard's logits are not finite.
TOKEN  all   its global token id (int32 bits); lowest id on ties
SCORE  s, v  its transformed logit (the raw one for greedy rows): the logprob's numerator
LSE    s, v  log-sum-exp of the shard's transformed logits; NaN: the shard's logits (or
             logits / temperature) are not finite, as `flashspec.reference` judges a row
DRAFT  v     the draft's transformed logit where this shard holds the draft, else -inf
keys   s, v  ``num_candidates`` int64 candidate keys (two words each), the shard's largest
             first: ``(order_key(raw logit) << 32) | (2**31 - 1 - id)``, the format of the
             fused kernels' candidates (`flashspec.kernels.keys`); `PAD_KEY` pads a list
             shorter than the budget
floor  s, v  one int64 key: every token of the shard missing from the keys has a key below
             it; `PAD_KEY` where none is missing. The torch summary lists the shard's top
             keys exactly (its floor is its last key); the fused one merges its tiles'
             candidates, exact only down to the largest of their tiles' last keys, its
             last key written and the bound of the tiles it left out of the merge
====== ===== ============================================================================

So a row costs 8 bytes in `argmax`, 16 in `sample`, 20 per position in `verify`, plus 8 per
candidate and 8 for the floor where the call truncates. The layout is the same for every
row of a call (fixed shapes: a CUDA graph can hold the exchange).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..params import SamplingParams
from .layout import VocabShards

BEST, TOKEN, SCORE, LSE, DRAFT = range(5)
FIELDS = {"argmax": 2, "sample": 4, "verify": 5}

# Candidate keys each rank sends per truncated row, unless a larger top-k asks for more.
DEFAULT_CANDIDATES = 32
# A top-k up to this many sends k + 1 candidates per rank: its support is then certified
# whatever its split over the ranks (beyond it, `DEFAULT_CANDIDATES` and completion).
MAX_TOP_K_CANDIDATES = 1024

# The second exchange's budget, in multiples of the first's: 512 keys, 4 KB per row and
# rank at the default, against the ~300 KB of a 76k-token shard's float32 logits.
RETRY_FACTOR = 16

_MASK31 = 0x7FFFFFFF


class SummaryLayout(NamedTuple):
    """The words of one row's summary: `fields` (`FIELDS[op]`), then, where
    `num_candidates` > 0, that many int64 keys and the floor key."""

    fields: int
    num_candidates: int

    @property
    def words(self) -> int:
        return self.fields + (2 * self.num_candidates + 2 if self.num_candidates else 0)

    @property
    def bytes_per_row(self) -> int:
        """Bytes each rank contributes per row (per verified position) to the exchange;
        it receives ``world_size - 1`` times as many."""
        return 4 * self.words


def summary_layout(op: str, shards: VocabShards, params: SamplingParams | None = None,
                   candidates: int = DEFAULT_CANDIDATES) -> SummaryLayout:
    """The layout of a call of `op` ("argmax", "sample" or "verify") with `params` (from
    their host flags, no device read): candidates only where some sampled row truncates,
    `candidates` of them, or the largest top-k + 1 where that is at most
    `MAX_TOP_K_CANDIDATES`; never more than the largest shard holds."""
    if op == "argmax" or params is None or not params.any_truncation:
        return SummaryLayout(FIELDS[op], 0)
    wanted = candidates
    if params.any_top_k and params.max_top_k <= MAX_TOP_K_CANDIDATES:
        wanted = max(wanted, params.max_top_k + 1)
    return SummaryLayout(FIELDS[op], min(wanted, max(shards.sizes)))


def retry_layout(layout: SummaryLayout, shards: VocabShards) -> SummaryLayout | None:
    """The layout of the second exchange, for the rows whose support `layout`'s candidates
    did not certify: `RETRY_FACTOR` times the candidates, up to the largest shard; None
    where that is no more (or the call has no candidates)."""
    budget = min(RETRY_FACTOR * layout.num_candidates, max(shards.sizes))
    return layout._replace(num_candidates=budget) if budget > layout.num_candidates else None


def pack(fields: list[torch.Tensor], keys: torch.Tensor | None = None,
         floor: torch.Tensor | None = None) -> torch.Tensor:
    """int32 words ``[R, words]`` from the row fields in layout order (float32 ``[R]``, the
    TOKEN field int ``[R]``) and, where the layout has candidates, the keys (int64
    ``[R, C]``) and the floor (int64 ``[R]``)."""
    words = [field.to(torch.int32) if index == TOKEN else field.float().view(torch.int32)
             for index, field in enumerate(fields)]
    words = torch.stack(words, dim=1)
    if keys is None:
        return words
    keys = torch.cat([keys, floor[:, None]], dim=1)
    return torch.cat([words, keys.view(torch.int32).reshape(keys.shape[0], -1)], dim=1)


class Unpacked(NamedTuple):
    """Gathered summaries ``[n, R]`` per field (TOKEN as int64), keys ``[n, R, C]`` and
    floors ``[n, R]``."""

    best: torch.Tensor
    token: torch.Tensor
    score: torch.Tensor | None
    lse: torch.Tensor | None
    draft: torch.Tensor | None
    keys: torch.Tensor | None
    floor: torch.Tensor | None


def unpack(words: torch.Tensor, layout: SummaryLayout) -> Unpacked:
    """The fields of gathered words ``[n, R, words]`` (every rank's summaries)."""
    fields = words[..., :layout.fields].contiguous().view(torch.float32)
    token = words[..., TOKEN].long()

    def field(index):
        return fields[..., index] if index < layout.fields else None

    keys = floor = None
    if layout.num_candidates:
        # A copy at offset 0 (`contiguous` would keep a one-row slice at an odd offset).
        listed = words[..., layout.fields:].clone(memory_format=torch.contiguous_format)
        listed = listed.view(torch.int64)
        keys, floor = listed[..., :-1], listed[..., -1]
    return Unpacked(field(BEST), token, field(SCORE), field(LSE), field(DRAFT), keys, floor)


def order_keys(values: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 whose signed order is the float order (-0.0 below +0.0: fold -0.0
    first where they must tie)."""
    bits = values.contiguous().view(torch.int32)
    return bits ^ ((bits >> 31) & _MASK31)


def from_order_keys(keys: torch.Tensor) -> torch.Tensor:
    return (keys ^ ((keys >> 31) & _MASK31)).contiguous().view(torch.float32)


def pack_candidates(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys of float32 `values` and their token `ids` (< 2**31): a larger key is a
    larger value, then a lower id."""
    return (order_keys(values).long() << 32) | (_MASK31 - ids.long())


def unpack_candidates(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values and int64 ids of `pack_candidates`' keys."""
    return from_order_keys((keys >> 32).to(torch.int32)), _MASK31 - (keys & _MASK31)


# pack(-inf, id 2**31 - 1): below every real candidate, decodes to -inf; the same value as
# the fused kernels' `flashspec.kernels.keys.PAD_KEY`.
PAD_KEY = int(pack_candidates(torch.tensor([float("-inf")]), torch.tensor([_MASK31]))[0])


def truncated_rows(params: SamplingParams, vocab_size: int) -> torch.Tensor:
    """bool ``[R]``: sampled rows whose support the candidates decide, those with a top-k
    below `vocab_size`, a top-p below 1 or a min-p above 0 (`flashspec.reference`'s rules:
    a top-k of V or more keeps every token)."""
    if not params.any_truncation:
        return torch.zeros_like(params.do_sample)
    top_k = (params.top_k > 0) & (params.top_k < vocab_size)
    return ~params.is_greedy & (top_k | (params.top_p < 1.0) | (params.min_p > 0.0))
