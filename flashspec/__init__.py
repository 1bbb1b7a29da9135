"""flashspec: exact fused sampling and speculative decoding for Hugging Face transformers.

The `[batch, vocab]` logits are never materialized on the fast path: `flashspec.sampling`
(argmax, sample, verify) sends the final hidden state into fused LM-head kernels
(`flashspec.kernels`) on CUDA; `flashspec.reference` is the materialized torch oracle and
CPU path.
"""

from . import reference, rng, sampling
from .checks import NonFiniteLogitsError
from .generation import (Eagle3, FlashGenerateOutput, FlashGenerationMixin, SpeculationStats,
                         from_pretrained, warmup, wrap)
from .outputs import ArgmaxOutput, SampleOutput, VerifyOutput
from .params import SamplingParams

__version__ = "0.1.0"

__all__ = ["ArgmaxOutput", "Eagle3", "FlashGenerateOutput", "FlashGenerationMixin", "NonFiniteLogitsError",
           "SampleOutput", "SamplingParams", "SpeculationStats", "VerifyOutput", "from_pretrained",
           "reference", "rng", "sampling", "warmup", "wrap"]
