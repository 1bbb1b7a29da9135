"""Vocab-parallel LM-head operations over `torch.distributed`: each rank holds a contiguous
shard of the LM head's rows, only per-row summaries cross ranks, and every rank returns the
tokens one process would (`flashspec.sampling`'s results, from its full weight).

* `sampling.py`: the door, `argmax`, `sample`, `verify`;
* `layout.py`: `VocabShards`, which rows each rank holds (transformers' split, or any);
* `shard.py`: a rank's work on its shard in torch ops (logits, per-row summary); on GPUs the
  fused kernels write the same summaries (`flashspec.kernels.fused_shard_summaries`);
* `summary.py`: the summary's words and bytes per row (`summary_layout`);
* `exchange.py`: the collectives and their byte counters (`stats`);
* `merge.py`: summaries merged into each row's result, truncation certified;
* `acceptance.py`: verification's acceptance chain from the merged positions (on GPUs,
  `flashspec.kernels.merge_shard_summaries` does both in one kernel).

Example (each rank of a gloo or NCCL group):
    >>> shards = VocabShards.chunked(lm_head_weight.shape[0])
    >>> out = flashspec.parallel.sample(hidden, shards.local(lm_head_weight), params,
    ...                                 positions, shards=shards)
"""

from .exchange import ExchangeStats, reset_stats, stats
from .layout import VocabShards
from .sampling import argmax, sample, verify
from .summary import SummaryLayout, summary_layout

__all__ = ["ExchangeStats", "SummaryLayout", "VocabShards", "argmax", "reset_stats", "sample",
           "stats", "summary_layout", "verify"]
