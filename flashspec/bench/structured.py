"""What a grammar costs: tok/s of the same calls with and without ``structured_output``.

A random-init model at a real shape, the tiny pair's tokenizer (the only one offline: its
8,192 tokens, the model's LM head wider; a real tokenizer's masks take longer to fill), and
`GRAMMAR`, JSON lines that never end, so that both calls of a pair emit the same tokens per
row. Each call runs once to compile and capture, then `reps` timed calls; the engine's
captured steps and events say whether the masked steps ran as graphs.
"""

from __future__ import annotations

import statistics

import torch

from flashspec.assets import tiny_pair_path
from flashspec.generation.engine import cached_engine

from .random_init import random_model
from .timing import timed_calls

# One JSON object per line, forever: no row completes it, every step is masked.
GRAMMAR = ('root ::= "{\\"id\\": " [1-9] [0-9]* ", \\"name\\": \\"" [a-z]+ "\\"}\\n" root')
EOS = 0               # the tiny tokenizer's, which the grammar never allows


def load(shape: str, device: str):
    """(bf16 model of `shape` with random weights on `device`, the tiny pair's tokenizer)."""
    from transformers import AutoTokenizer

    import flashspec

    model = flashspec.wrap(random_model(shape, device, torch.bfloat16))
    return model, AutoTokenizer.from_pretrained(tiny_pair_path() / "target")


def measure(model, tokenizer, batch: int, drafts: str, new_tokens: int, prompt_length: int,
            reps: int) -> dict:
    """tok/s of one call shape without and with the grammar (median of `reps`), their
    ratio, and the masked call's captured steps."""
    device = model.get_output_embeddings().weight.device
    torch.manual_seed(batch)
    ids = torch.randint(1, len(tokenizer), (batch, prompt_length), device=device)
    common = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  sampler="flash", eos_token_id=EOS, pad_token_id=EOS, tokenizer=tokenizer)
    if drafts == "lookup":
        common["prompt_lookup_num_tokens"] = 4
    row = {"batch": batch, "drafts": drafts, "new_tokens": new_tokens}
    for name, extra in (("free", {}), ("grammar", {"structured_output": {"grammar": GRAMMAR}})):
        first, seconds, out = timed_calls(lambda: model.generate(ids, **common, **extra), reps,
                                          device.type == "cuda")
        emitted = int((out[:, prompt_length:] != EOS).sum())
        row[f"{name}_tok_s"] = emitted / statistics.median(seconds)
        row[f"{name}_first_s"] = first
        row[f"{name}_tokens"] = emitted
        engine = cached_engine(model.model)
        if name == "grammar" and engine is not None:    # on CUDA: the captured steps
            row["grammar_steps"] = sorted(map(str, engine.last_call_steps))
            row["graphs"] = len(engine.graphs)
    row["ratio"] = row["grammar_tok_s"] / row["free_tok_s"]
    return row
