"""What crosses ranks, and how much: the summaries' all-gather, the rare completion's
all-gather of whole logit rows, and counters of both (`stats`).

Each call of `flashspec.parallel` runs one all-gather of its summaries (``[R, words]``
int32 per rank); only where some truncated row was not certified, a second one of those
rows' summaries with more candidates, and, for rows still uncertified, a third one of their
logits (padded to the largest shard). Every rank takes part in each: the merges that decide
them run on the same gathered words on every rank.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .layout import VocabShards

# torch 2.13 renamed it; earlier versions have only the old name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclasses.dataclass
class ExchangeStats:
    """This rank's exchanges since the last `reset_stats()`; bytes are what it contributed
    (it receives ``world_size - 1`` times as many). Counted by the host as calls run: a CUDA
    graph's replays of captured calls are not."""

    calls: int = 0             # summary exchanges (one per call, one more per retry)
    rows: int = 0              # rows summarised (verification: one per position)
    summary_bytes: int = 0
    rows_retried: int = 0      # rows (verification: batch rows) summarised again, with more
    #                            candidates, their support uncertified
    rows_completed: int = 0    # of those, rows finished from their gathered logits
    completion_bytes: int = 0


_stats = ExchangeStats()


def stats() -> ExchangeStats:
    return dataclasses.replace(_stats)


def reset_stats() -> None:
    global _stats
    _stats = ExchangeStats()


def all_gather_summaries(words: torch.Tensor, shards: VocabShards) -> torch.Tensor:
    """Every rank's summary words ``[n, R, words]`` (rank order) from this rank's
    ``[R, words]``: one collective over `shards.group`."""
    gathered = words.new_empty(shards.world_size * words.shape[0], words.shape[1])
    _all_gather(gathered, words.contiguous(), group=shards.group)
    _stats.calls += 1
    _stats.rows += words.shape[0]
    _stats.summary_bytes += words.numel() * words.element_size()
    return gathered.view(shards.world_size, *words.shape)


def count_retried(batch_rows: int) -> None:
    _stats.rows_retried += batch_rows


def all_gather_logits(logits: torch.Tensor, shards: VocabShards, batch_rows: int) -> torch.Tensor:
    """The whole vocabulary's logits ``[k, V]`` from each rank's shard of them ``[k, V_r]``
    (`all_gather_vocab`); `batch_rows` of the caller's rows are counted as completed."""
    _stats.rows_completed += batch_rows
    _stats.completion_bytes += logits.shape[0] * max(shards.sizes) * logits.element_size()
    return all_gather_vocab(logits, shards)


def all_gather_vocab(part: torch.Tensor, shards: VocabShards) -> torch.Tensor:
    """``[..., V]``: each rank's ``[..., V_r]`` side by side in rank order (one all-gather,
    shards padded to the largest). Not counted: what the materialized path of `generate`
    gathers goes through here too."""
    widest = max(shards.sizes)
    padded = torch.nn.functional.pad(part, (0, widest - part.shape[-1])).contiguous()
    gathered = padded.new_empty(shards.world_size, *padded.shape)
    # gloo takes the output as the parts concatenated along the first dimension.
    _all_gather(gathered.view(-1, *padded.shape[1:]), padded, group=shards.group)
    return torch.cat([gathered[r, ..., :size] for r, size in enumerate(shards.sizes)], dim=-1)