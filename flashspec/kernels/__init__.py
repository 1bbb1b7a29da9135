"""Fused Triton LM-head kernels (argmax, Gumbel-max sampling, verification) and their noise.

An implementation detail behind `flashspec.sampling`, which validates, dispatches and
completes; the launchers here (`fused_argmax`, `fused_sample`, `fused_verify`) are unchecked,
for that door, the benchmarks and the kernel tests.

Named `flashspec.kernels`, never top-level `kernels`, which is Hugging Face's own package.
Importing this package imports Triton; `flashspec` itself does not.
"""

from .ops import (KernelStats, TileConfig, default_config, fused_argmax, fused_sample,
                  fused_verify, reset_stats, stats)

__all__ = ["KernelStats", "TileConfig", "default_config", "fused_argmax", "fused_sample",
           "fused_verify", "reset_stats", "stats"]
