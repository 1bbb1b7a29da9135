"""Fused Triton LM-head kernels (argmax, Gumbel-max sampling, verification) and their noise.

Named `flashspec.kernels`, never top-level `kernels`, which is Hugging Face's own package.
Importing this package imports Triton; `flashspec` itself does not.
"""

from .ops import (KernelStats, SampleOutput, TileConfig, argmax_unchecked, default_config,
                  lm_head_argmax, lm_head_sample, reset_stats, sample_unchecked, stats)

__all__ = ["KernelStats", "SampleOutput", "TileConfig", "argmax_unchecked", "default_config",
           "lm_head_argmax", "lm_head_sample", "reset_stats", "sample_unchecked", "stats"]
