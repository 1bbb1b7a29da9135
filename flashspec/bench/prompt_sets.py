"""Prompt sets shipped with flashspec for acceptance measurements (scripts/acceptance_rate.py).

Each set is a JSON-lines file under ``flashspec/assets/prompts``: one object per line with
at least ``id`` and ``prompt`` (and ``kind``, the task within the set). The text was written
for flashspec; no downloads.

    prompts = load_prompts("code_edit")         # [{"id": ..., "kind": ..., "prompt": ...}]
    batch = encode_prompts(tokenizer, [p["prompt"] for p in prompts], max_length=512)
    model.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask, ...)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch

PROMPTS_DIR = Path(__file__).resolve().parents[1] / "assets" / "prompts"
# name -> what the set holds (its file is PROMPTS_DIR / f"{name}.jsonl").
PROMPT_SETS = {
    "code_edit": "edit code given in the prompt (rename, add type hints, fix a bug, ...): the "
                 "answer copies most of the prompt, where prompt lookup shines",
    "summarize": "summarise a text given in the prompt (an answer reuses some of its phrases)",
    "chat": "open-ended questions and code completion: little to copy from the prompt",
}
# For tokenizers without a chat template (base models such as the built-in tiny pair).
PLAIN_LAYOUT = "### Instruction:\n{prompt}\n\n### Response:\n"


def load_prompts(name: str) -> list[dict]:
    """The prompts of set `name` (one of PROMPT_SETS), in file order."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}: use one of {', '.join(PROMPT_SETS)}")
    path = PROMPTS_DIR / f"{name}.jsonl"
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record.get("id"), str) or not isinstance(record.get("prompt"), str):
            raise ValueError(f"{path}:{number}: each line needs string fields 'id' and 'prompt'")
        prompts.append(record)
    return prompts


def format_prompt(tokenizer, prompt: str, chat_template: bool = True) -> str:
    """`prompt` as the model's input text: one user turn through the tokenizer's chat
    template (with the generation prompt) when it has one and `chat_template` is true, else
    PLAIN_LAYOUT."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             tokenize=False, add_generation_prompt=True)
    return PLAIN_LAYOUT.format(prompt=prompt)


class EncodedPrompts(NamedTuple):
    input_ids: torch.Tensor        # int64 [B, L], left-padded
    attention_mask: torch.Tensor   # int64 [B, L], 0 on padding
    truncated: torch.Tensor        # bool [B]: the prompt was longer than max_length tokens


def encode_prompts(tokenizer, prompts: list[str], max_length: int,
                   chat_template: bool = True) -> EncodedPrompts:
    """Token ids of `prompts` (formatted by `format_prompt`), left-padded to the longest.
    A prompt longer than `max_length` tokens keeps its last `max_length`: the end holds
    the generation prompt (and the text being answered about), which the answer needs.
    The tokenizer is not modified."""
    if max_length < 1:
        raise ValueError(f"`max_length` must be >= 1, got {max_length}")
    if not prompts:
        raise ValueError("`prompts` is empty")
    templated = chat_template and bool(getattr(tokenizer, "chat_template", None))
    texts = [format_prompt(tokenizer, prompt, chat_template) for prompt in prompts]
    # A chat template writes its own special tokens (BOS and role markers); plain text gets
    # what the tokenizer adds to any text.
    encoded = tokenizer(texts, add_special_tokens=not templated)["input_ids"]
    truncated = torch.tensor([len(ids) > max_length for ids in encoded])
    rows = [ids[-max_length:] for ids in encoded]
    width = max(len(ids) for ids in rows)
    # The pad id is never attended to; any valid id will do where the tokenizer names none.
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, ids in enumerate(rows):
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids):] = 1
    return EncodedPrompts(input_ids, attention_mask, truncated)
