"""flashspec.bench.prompt_sets: the shipped prompt files and their encoding for a tokenizer."""

import copy
import json

import pytest
import torch
from transformers import AutoTokenizer

from flashspec.bench import prompt_sets
from flashspec.assets import tiny_pair_path
from flashspec.bench.prompt_sets import (PLAIN_LAYOUT, PROMPT_SETS, encode_prompts,
                                         format_prompt, load_prompts)

# A minimal chat template in the usual shape: role markers, then the generation prompt.
CHAT_TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_pair_path() / "target")


@pytest.fixture
def chat_tokenizer(tokenizer):
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = CHAT_TEMPLATE
    return templated


@pytest.mark.parametrize("name", PROMPT_SETS)
def test_each_set_has_16_to_24_modest_prompts_with_ids(name):
    prompts = load_prompts(name)
    assert 16 <= len(prompts) <= 24
    for record in prompts:
        assert isinstance(record["id"], str) and record["id"].startswith(f"{name}-")
        assert isinstance(record["kind"], str) and record["kind"]
        assert 0 < len(record["prompt"]) < 1500


def test_ids_are_unique_across_sets():
    ids = [record["id"] for name in PROMPT_SETS for record in load_prompts(name)]
    assert len(ids) == len(set(ids))


def test_code_edit_prompts_hold_the_code_to_edit():
    for record in load_prompts("code_edit"):
        instruction, code = record["prompt"].split("```python\n")
        assert instruction.strip() and code.endswith("\n```")
        assert "def " in code or "class " in code


def test_unknown_set_is_refused_naming_the_sets():
    with pytest.raises(ValueError, match="code_edit, summarize, chat"):
        load_prompts("poetry")


def test_a_line_without_a_prompt_is_refused_with_its_place(tmp_path, monkeypatch):
    (tmp_path / "chat.jsonl").write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n\n"
                                         + json.dumps({"id": "b"}) + "\n")
    monkeypatch.setattr(prompt_sets, "PROMPTS_DIR", tmp_path)
    with pytest.raises(ValueError, match=r"chat.jsonl:3: .*'prompt'"):
        load_prompts("chat")


def test_plain_layout_without_a_chat_template(tokenizer):
    assert not tokenizer.chat_template
    assert format_prompt(tokenizer, "Fix it.") == "### Instruction:\nFix it.\n\n### Response:\n"


def test_chat_template_when_there_is_one_unless_turned_off(chat_tokenizer):
    assert format_prompt(chat_tokenizer, "Fix it.") == "<|endoftext|>user: Fix it.\nassistant:"
    plain = PLAIN_LAYOUT.format(prompt="Fix it.")
    assert format_prompt(chat_tokenizer, "Fix it.", chat_template=False) == plain


def test_encoding_is_left_padded_and_decodes_to_the_formatted_prompts(tokenizer):
    prompts = ["short", "a much longer prompt than the first one, by several tokens"]
    padding_side = tokenizer.padding_side
    batch = encode_prompts(tokenizer, prompts, max_length=512)
    assert tokenizer.padding_side == padding_side
    assert batch.input_ids.dtype == batch.attention_mask.dtype == torch.long
    assert batch.input_ids.shape == batch.attention_mask.shape
    assert batch.truncated.tolist() == [False, False]
    lengths = batch.attention_mask.sum(dim=1)
    assert lengths[0] < lengths[1] == batch.input_ids.shape[1]
    for row, prompt in enumerate(prompts):
        mask = batch.attention_mask[row]
        first = len(mask) - lengths[row]
        assert mask[:first].eq(0).all() and mask[first:].eq(1).all()
        ids = batch.input_ids[row, first:].tolist()
        assert tokenizer.decode(ids) == PLAIN_LAYOUT.format(prompt=prompt)


def test_long_prompts_keep_their_last_tokens(tokenizer):
    prompts = ["x = 1\n" * 200, "y"]
    full = tokenizer([PLAIN_LAYOUT.format(prompt=p) for p in prompts])["input_ids"]
    batch = encode_prompts(tokenizer, prompts, max_length=20)
    assert batch.truncated.tolist() == [True, len(full[1]) > 20]
    assert batch.input_ids.shape[1] == 20
    assert batch.input_ids[0].tolist() == full[0][-20:]


def test_chat_template_encoding_adds_no_special_tokens_of_its_own(chat_tokenizer):
    batch = encode_prompts(chat_tokenizer, ["Fix it."], max_length=64)
    expected = chat_tokenizer(format_prompt(chat_tokenizer, "Fix it."), add_special_tokens=False)
    assert batch.input_ids[0].tolist() == expected["input_ids"]
    assert batch.input_ids[0, 0] == chat_tokenizer.convert_tokens_to_ids("<|endoftext|>")


@pytest.mark.parametrize("prompts, max_length, message", [
    (["a"], 0, "max_length"),
    ([], 8, "prompts"),
])
def test_bad_encoding_arguments_are_refused(tokenizer, prompts, max_length, message):
    with pytest.raises(ValueError, match=message):
        encode_prompts(tokenizer, prompts, max_length)
