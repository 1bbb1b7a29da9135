"""Generation engine: `generate(..., sampler="flash")`, in the order a call goes through it.

mixin.py     FlashGenerationMixin, wrap, from_pretrained (the user-facing entry points)
plan.py      generate() arguments -> GenerationPlan, with transformers' semantics and errors
heads.py     a model's decoder and LM-head weight as the kernels see them (or a refusal)
engine.py    the engine of a target model: slots, graphs, memory, the step loop of a call
slot.py      one batch bucket's device state and its fixed-shape steps (prefill, plain,
             verify, commit)
drafters.py  the Drafter interface; assistant-model and prompt-lookup drafters
chain.py     the steps of drafters fed the target's hidden states (EAGLE-3, MTP)
eagle3.py    EAGLE-3 drafts (Eagle3: a published head for a target model)
eagle3_model.py  the EAGLE-3 head module and its checkpoint format
mtp.py       MTP drafts (generate(use_mtp=True): the model's own MTP layer)
taps.py      target hidden states that a drafter reads (hooks on the decoder's layers)
compiled.py  decoder forwards, eager or compiled once per decoder; the on-disk cache
kv_cache.py  the position-addressed KV cache (rollback by position, views, growth)
samplers.py  the LM-head operations a step runs (fused kernels or materialized logits)
outputs.py   FlashGenerateOutput, SpeculationStats
warmup.py    flashspec.warmup: pay compilation and capture before the first call
"""

from .eagle3 import Eagle3
from .engine import cached_engine
from .mixin import FlashGenerationMixin, from_pretrained, wrap
from .outputs import FlashGenerateOutput, SpeculationStats
from .warmup import warmup

__all__ = ["Eagle3", "FlashGenerateOutput", "FlashGenerationMixin", "SpeculationStats", "cached_engine",
           "from_pretrained", "warmup", "wrap"]
