"""Fused Triton LM-head kernels (argmax, Gumbel-max sampling, verification) and their noise.

An implementation detail behind `flashspec.sampling`, which validates, dispatches and
completes; the launchers here (`fused_argmax`, `fused_sample`, `fused_verify`) are unchecked
but for the device, for that door, the benchmarks and the kernel tests.

The logits never reach GPU memory. Each launch runs, in order:

* stage 1, one program per (vocab tile, row tile): the logits tile on chip, edited where
  the call has logit edits (`flashspec.params.LogitEdits`), summarised per (row, tile):
  best score and id, log-sum-exp terms, candidates (`lm_head.py`, the Triton kernel;
  `lm_head_ws.py`, the warp-specialized Gluon kernel for many rows on Hopper; both run
  the epilogue of `epilogue.py` and the race bound of `race.py`);
* stage 2, one program per row: the tiles merged into the row's token, logprob, log-sum-exp
  and status; truncation's candidates merged and certified (`merge.py`);
* verification's finaliser, one program per batch row: the acceptance chain
  (`verify_finalize.py`).

Over a rank's vocabulary shard (`flashspec.parallel`), `fused_shard_summaries` runs stage 1
with the noise keyed by global token ids and, instead of stage 2, a per-row summary of the
shard for the ranks' exchange (`shard_summary.py`).

Shared device helpers: `noise.py` (Philox words and Gumbel noise, as `flashspec.rng`),
`keys.py` (order keys, packed candidate keys), `rows.py` (a row's parameters and a tile's
tokens). Host side: `ops.py` (the launchers), `tile_config.py` (`TileConfig`, the fixed tile
table). `invariant.py` holds the batch-invariant decoder kernels (`generate(invariant=True)`).

Named `flashspec.kernels`, never top-level `kernels`, which is Hugging Face's own package.
"""

from .ops import (KernelStats, TileConfig, default_config, fused_argmax, fused_sample,
                  fused_verify, reset_stats, stats)
from .shard_merge import merge_shard_summaries
from .shard_summary import fused_shard_summaries

__all__ = ["KernelStats", "TileConfig", "default_config", "fused_argmax", "fused_sample",
           "fused_shard_summaries", "fused_verify", "merge_shard_summaries", "reset_stats",
           "stats"]
