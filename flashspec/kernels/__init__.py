"""Fused Triton LM-head kernels (argmax, Gumbel-max sampling, verification) and their noise.

Named `flashspec.kernels`, never top-level `kernels`, which is Hugging Face's own package.
Importing this package imports Triton; `flashspec` itself does not.
"""

from .ops import (KernelStats, SampleOutput, TileConfig, VerifyKernelOutput, argmax_unchecked,
                  default_config, lm_head_argmax, lm_head_sample, lm_head_verify, reset_stats,
                  sample_unchecked, stats, verify_unchecked)

__all__ = ["KernelStats", "SampleOutput", "TileConfig", "VerifyKernelOutput", "argmax_unchecked",
           "default_config", "lm_head_argmax", "lm_head_sample", "lm_head_verify", "reset_stats",
           "sample_unchecked", "stats", "verify_unchecked"]
