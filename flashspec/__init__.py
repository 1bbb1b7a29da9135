"""flashspec: exact fused sampling and speculative decoding for Hugging Face transformers.

The `[batch, vocab]` logits are never materialized on the fast path: the final hidden
state goes into fused LM-head kernels (`flashspec.kernels`); `flashspec.reference` is the
materialized torch oracle and CPU path with the same signatures.
"""

from . import reference, rng
from .api import lm_head_argmax, lm_head_sample, lm_head_verify
from .checks import NonFiniteLogitsError
from .generation import (FlashGenerateOutput, FlashGenerationMixin, SpeculationStats,
                         from_pretrained, wrap)
from .params import SamplingParams
from .reference import VerifyOutput

__version__ = "0.1.0"

__all__ = ["FlashGenerateOutput", "FlashGenerationMixin", "NonFiniteLogitsError", "SamplingParams",
           "SpeculationStats", "VerifyOutput", "from_pretrained", "lm_head_argmax", "lm_head_sample",
           "lm_head_verify", "reference", "rng", "wrap"]
