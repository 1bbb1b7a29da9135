"""Generation engine: `generate(..., sampler="flash")`, the speculative loop and the drafters.

mixin.py    FlashGenerationMixin, wrap, from_pretrained (the user-facing entry points)
setup.py    generate() arguments -> GenerationPlan, with transformers' semantics and errors
loop.py     the decode loop (plain or draft-then-verify), right-aligned batch, stopping
drafters.py assistant-model and prompt-lookup drafters
cache.py    a decoder with its own KV cache, realigned as rows advance unevenly
heads.py    the LM-head weight and logit transforms the kernels reproduce (or refuse)
outputs.py  FlashGenerateOutput, SpeculationStats
"""

from .mixin import FlashGenerationMixin, from_pretrained, wrap
from .outputs import FlashGenerateOutput, SpeculationStats

__all__ = ["FlashGenerateOutput", "FlashGenerationMixin", "SpeculationStats", "from_pretrained", "wrap"]
