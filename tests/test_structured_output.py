"""Structured output, ``generate(sampler="flash", structured_output=...)``
(flashspec/generation/grammar.py): greedy tokens are stock's with xgrammar's own logits
processor on the same grammar; sampled outputs parse and validate; drafts (prompt lookup, an
assistant, an EAGLE-3 head) change no seeded token; bad specs are refused before generating.
GPU twin: tests/test_structured_output_gpu.py."""

from __future__ import annotations

import functools
import json
import re
import sys

import hypothesis
import jsonschema
import pytest
import torch
import xgrammar as xgr
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from xgrammar.contrib.hf import LogitsProcessor

import flashspec
from flashspec.assets import tiny_pair_path
from flashspec.bench.structured import GRAMMAR as ENDLESS_JSON_LINES
from flashspec.generation import grammar

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 8},
            "id": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["name", "id"]},
        "ok": {"type": "boolean"}}, "required": ["user", "ok"]},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
        "required": ["color", "size"]},
    "array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                 "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    "numbers": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10},
        "n": {"type": "integer", "minimum": -50, "maximum": 50}}, "required": ["x", "n"]},
}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
EBNF = 'root ::= "def " name "(" name "):" " return " name\nname ::= [a-z_] [a-z_0-9]?'
PROMPTS = ["def add(a, b):", "import os\n", "class Point:\n    def __init__(self"]


@functools.lru_cache(maxsize=None)
def pair():
    """The built-in tiny pair (fp32 CPU): target, draft, tokenizer."""
    path = tiny_pair_path()
    target = flashspec.wrap(AutoModelForCausalLM.from_pretrained(
        path / "target", dtype=torch.float32).eval())
    draft = AutoModelForCausalLM.from_pretrained(path / "draft", dtype=torch.float32).eval()
    return target, draft, AutoTokenizer.from_pretrained(path / "target")


@functools.lru_cache(maxsize=None)
def random_llama():
    """A random-init Llama over the tiny tokenizer's ids and more (a padded vocabulary)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         eos_token_id=0, pad_token_id=0, bos_token_id=None)
    return flashspec.wrap(LlamaForCausalLM(config).eval())


def encoded(texts=PROMPTS):
    tokenizer = pair()[2]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    return batch.input_ids, batch.attention_mask


def stock_processor(model, tokenizer, kind, source):
    """xgrammar's own transformers logits processor for the spec `{kind: source}`."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer,
                                              vocab_size=model.get_output_embeddings().out_features)
    compiler = xgr.GrammarCompiler(info)
    compiled = {"json": lambda: compiler.compile_json_schema(json.dumps(source)),
                "regex": lambda: compiler.compile_regex(source),
                "grammar": lambda: compiler.compile_grammar(source)}[kind]()
    return LogitsProcessor(compiled)


def generated_texts(tokenizer, sequences, prompt_width):
    """Each row's text up to its EOS, and whether it reached one."""
    out = []
    for row in sequences[:, prompt_width:].tolist():
        ended = tokenizer.eos_token_id in row
        out.append((tokenizer.decode(row[: row.index(tokenizer.eos_token_id)] if ended else row),
                    ended))
    return out


SPECS = [("json", SCHEMAS["nested"]), ("json", SCHEMAS["enums"]), ("json", SCHEMAS["array"]),
         ("json", SCHEMAS["numbers"]), ("regex", REGEX), ("grammar", EBNF)]


@pytest.mark.parametrize("which", ["tiny", "random"])
@pytest.mark.parametrize("kind, source", SPECS, ids=["nested", "enums", "array", "numbers",
                                                     "regex", "ebnf"])
def test_greedy_tokens_are_stocks_with_xgrammars_processor(which, kind, source):
    """A left-padded batch of three, greedy: the tokens of stock generate with xgrammar's
    `LogitsProcessor` (the matcher per row, the mask on the materialized logits)."""
    model = pair()[0] if which == "tiny" else random_llama()
    tokenizer = pair()[2]
    ids, mask = encoded()
    common = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    stock = model.generate(ids, logits_processor=[stock_processor(model, tokenizer, kind, source)],
                           **common)
    flash = model.generate(ids, sampler="flash", structured_output={kind: source},
                           tokenizer=tokenizer, **common)
    assert torch.equal(flash, stock)


@pytest.mark.parametrize("options", [dict(sampler="materialized"),
                                     dict(sampler="flash", typical_p=0.9, do_sample=True, seed=1)])
def test_the_materialized_path_takes_the_grammar_too(options):
    """The `[B, V]` logits path (sampler="materialized", or an option the kernels do not
    fuse: transformers' processors run, the masks among them) gives the same language."""
    model, _, tokenizer = pair()
    ids, mask = encoded()
    common = dict(attention_mask=mask, max_new_tokens=40, pad_token_id=0)
    out = model.generate(ids, tokenizer=tokenizer, structured_output={"regex": REGEX},
                         **common, **{"do_sample": False, **options})
    if options["sampler"] == "materialized":
        stock = model.generate(ids, do_sample=False, **common, logits_processor=[
            stock_processor(model, tokenizer, "regex", REGEX)])
        assert torch.equal(out, stock)
    for text, ended in generated_texts(tokenizer, out, ids.shape[1]):
        assert ended and re.fullmatch(REGEX, text), text


def test_a_completed_grammar_ends_the_row_with_eos():
    model, _, tokenizer = pair()
    ids, mask = encoded()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                         sampler="flash", structured_output={"choice": ["yes", "no"]},
                         tokenizer=tokenizer, pad_token_id=0)
    for text, ended in generated_texts(tokenizer, out, ids.shape[1]):
        assert ended and text in ("yes", "no")
    assert out.shape[1] - ids.shape[1] < 40      # every row stopped: nothing past its EOS


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_a_hundred_sampled_outputs_parse_and_validate(name):
    """100 rows of one call (seeds 0..99 by row), temperature 1, no whitespace between
    JSON tokens: every output ends with EOS, parses and validates against its schema."""
    model, _, tokenizer = pair()
    ids, mask = encoded(["{"] * 100)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=96, do_sample=True,
                         top_k=0, seed=0, sampler="flash", tokenizer=tokenizer, pad_token_id=0,
                         structured_output={"json": SCHEMAS[name], "disable_any_whitespace": True})
    texts = generated_texts(tokenizer, out, ids.shape[1])
    assert all(ended for _, ended in texts), [text for text, ended in texts if not ended][:3]
    for text, _ in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert len({text for text, _ in texts}) >= 5     # sampled (enums has 9 outputs in all)


@pytest.mark.parametrize("drafts", ["lookup", "assistant", "eagle3"])
def test_seeded_tokens_with_drafts_are_the_tokens_without(drafts):
    """Sampled (top-p, temperature) and greedy, a ragged batch: drafts advance each row's
    matcher along them and roll it back when rejected; the tokens never change."""
    model, draft, tokenizer = pair()
    ids, mask = encoded()
    by_drafter = {"lookup": dict(prompt_lookup_num_tokens=4),
                  "assistant": dict(assistant_model=draft, num_assistant_tokens=4),
                  "eagle3": dict(drafter=flashspec.Eagle3.from_pretrained(
                      tiny_pair_path() / "eagle3", model), num_assistant_tokens=4)}[drafts]
    for kind, source in (("json", SCHEMAS["nested"]), ("regex", REGEX)):
        for sampling in (dict(do_sample=False), dict(do_sample=True, top_p=0.9,
                                                     temperature=1.2, seed=5)):
            common = dict(attention_mask=mask, max_new_tokens=48, sampler="flash",
                          structured_output={kind: source}, tokenizer=tokenizer,
                          pad_token_id=0, return_dict_in_generate=True, **sampling)
            plain = model.generate(ids, **common)
            drafted = model.generate(ids, **common, **by_drafter)
            assert torch.equal(drafted.sequences, plain.sequences), (kind, sampling)
            assert int(drafted.flash_stats.drafted.sum()) > 0


@pytest.mark.parametrize("drafts", [{}, dict(prompt_lookup_num_tokens=4)])
def test_masks_from_the_reports_equal_masks_from_the_contexts(drafts, monkeypatch):
    """A grammar alone fills its masks from the host's reports (`StructuredOutput.fill`),
    its steps split (forward, then head); beside an `allowed_tokens_fn` that allows every
    token, from each position's context (`masks_of`), its steps whole: the same tokens,
    greedy and sampled, with and without drafts."""
    model, _, tokenizer = pair()
    ids, mask = encoded()

    def everything(rows, input_ids):
        return torch.ones(len(rows), 8192, dtype=torch.bool)

    fills = []
    fill = grammar.StructuredOutput.fill
    monkeypatch.setattr(grammar.StructuredOutput, "fill",
                        lambda self, *args: fills.append(1) or fill(self, *args))
    for sampling in (dict(do_sample=False), dict(do_sample=True, seed=9, temperature=1.5)):
        common = dict(attention_mask=mask, max_new_tokens=48, sampler="flash", pad_token_id=0,
                      tokenizer=tokenizer, structured_output={"json": SCHEMAS["array"]},
                      **sampling, **drafts)
        del fills[:]
        alone = model.generate(ids, **common)
        assert len(fills) > 10
        del fills[:]
        assert torch.equal(model.generate(ids, allowed_tokens_fn=everything, **common), alone)
        assert not fills


@pytest.mark.parametrize("drafter", ["assistant", "eagle3"])
def test_drafts_among_the_grammars_tokens(drafter):
    """The assistant and the EAGLE-3 head draft among each position's allowed tokens (the
    host fills the masks before each draft step): on code prompts under a JSON schema, which
    the tiny pair does not write unconstrained, most drafts are accepted (measured 0.85 and
    0.74 of those drafted; 0.02 when they ignored the grammar), and the tokens are those
    without drafts."""
    from flashspec.bench.prompt_sets import encode_prompts, load_prompts

    model, draft, tokenizer = pair()
    drafts = {"assistant": dict(assistant_model=draft),
              "eagle3": dict(drafter=flashspec.Eagle3.from_pretrained(
                  tiny_pair_path() / "eagle3", model))}[drafter]
    texts = [record["prompt"] for record in load_prompts("code_edit")[:8]]
    batch = encode_prompts(tokenizer, texts, max_length=64)
    spec = {"json": {"type": "object", "properties": {"code": {"type": "string"},
                                                      "lines": {"type": "integer"}},
                     "required": ["code", "lines"]}}
    common = dict(attention_mask=batch.attention_mask, max_new_tokens=64, do_sample=False,
                  sampler="flash", pad_token_id=0, tokenizer=tokenizer, structured_output=spec,
                  return_dict_in_generate=True)
    plain = model.generate(batch.input_ids, **common)
    drafted = model.generate(batch.input_ids, num_assistant_tokens=4, **drafts, **common)
    assert torch.equal(drafted.sequences, plain.sequences)
    stats = drafted.flash_stats
    assert int(stats.accepted.sum()) / int(stats.drafted.sum()) > 0.6


def test_one_spec_per_prompt_and_free_rows():
    """A list gives each prompt its own spec (None: unconstrained, stock's tokens)."""
    model, _, tokenizer = pair()
    ids, mask = encoded()
    common = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    free = model.generate(ids, **common)
    out = model.generate(ids, sampler="flash", tokenizer=tokenizer, **common,
                         structured_output=[{"regex": REGEX}, None, {"choice": ["ok"]}])
    texts = generated_texts(tokenizer, out, ids.shape[1])
    assert texts[2] == ("ok", True)
    assert torch.equal(out[1, : free.shape[1]], free[1])
    stock = model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=24, do_sample=False,
                           pad_token_id=0,
                           logits_processor=[stock_processor(model, tokenizer, "regex", REGEX)])
    assert torch.equal(out[0, : stock.shape[1]], stock[0])


def test_num_return_sequences_repeat_each_prompts_spec():
    """A spec per prompt, each prompt's rows repeated (num_return_sequences=3, sampled):
    every row in its own prompt's language."""
    model, _, tokenizer = pair()
    ids, mask = encoded(PROMPTS[:2])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=True, seed=4,
                         num_return_sequences=3, sampler="flash", tokenizer=tokenizer,
                         pad_token_id=0, structured_output=[{"regex": REGEX},
                                                            {"choice": ["yes", "no"]}])
    texts = generated_texts(tokenizer, out, ids.shape[1])
    assert len(texts) == 6 and all(ended for _, ended in texts)
    assert all(re.fullmatch(REGEX, text) for text, _ in texts[:3])
    assert all(text in ("yes", "no") for text, _ in texts[3:])


def test_stop_strings_cut_constrained_rows():
    """Stop strings end rows mid-grammar (stock's xgrammar processor fails there: it feeds
    the padding to the matcher): each row is the call without stop strings cut at the token
    that completes its first stop string, and the grammars follow the cut rows."""
    model, _, tokenizer = pair()
    ids, mask = encoded()
    common = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0,
                  tokenizer=tokenizer, sampler="flash",
                  structured_output={"json": SCHEMAS["nested"]})
    stopped = model.generate(ids, stop_strings=['"name"'], **common)
    uncut = model.generate(ids, **common)
    cut = 0
    for row, full in zip(stopped[:, ids.shape[1]:].tolist(), uncut[:, ids.shape[1]:].tolist()):
        row = row[: row.index(0)] if 0 in row else row           # EOS and padding: id 0
        assert full[: len(row)] == row
        if '"name"' in tokenizer.decode(full):
            assert '"name"' in tokenizer.decode(row) and '"name"' not in tokenizer.decode(row[:-1])
            cut += 1
    assert cut >= 2


def test_openai_response_formats_and_compiled_grammars():
    model, _, tokenizer = pair()
    ids, mask = encoded()
    common = dict(attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    want = model.generate(ids, sampler="flash", tokenizer=tokenizer,
                          structured_output={"json": SCHEMAS["enums"]}, **common)
    openai = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS["enums"]}}
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=8192)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMAS["enums"]))
    as_string = {"json": json.dumps(SCHEMAS["enums"])}
    for spec in (openai, compiled, as_string):
        got = model.generate(ids, sampler="flash", tokenizer=tokenizer, structured_output=spec,
                             **common)
        assert torch.equal(got, want)
    for spec in ({"type": "json_object"}, {"json_object": True}):
        out = model.generate(ids, sampler="flash", tokenizer=tokenizer, structured_output=spec,
                             **common)
        for text, ended in generated_texts(tokenizer, out, ids.shape[1]):
            if ended:
                json.loads(text)


@pytest.mark.parametrize("spec, error, message", [
    ({"json": "{not json"}, ValueError, "the JSON schema is not valid JSON"),
    ({"json": {"type": "nonsense"}}, ValueError, "cannot compile its json: .*nonsense"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 2}}, ValueError,
     "minimum greater than maximum"),
    ({"regex": "("}, ValueError, "cannot compile its regex: .*parenthesis"),
    ({"grammar": "root ::= foo"}, ValueError, 'cannot compile its grammar: .*"foo"'),
    ({"regex": "[^\\x00-\\U0010FFFF]"}, ValueError, "allows no token to start with"),
    ({"json": {}, "regex": "a"}, ValueError, "exactly one of the keys"),
    ({"jsn": {}}, ValueError, "exactly one of the keys"),
    ({"regex": "a", "disable_any_whitespace": True}, ValueError, "goes with 'json'"),
    ({"choice": []}, ValueError, "non-empty list of strings"),
    ({"json_object": 1}, ValueError, "'json_object' must be True"),
    ({"type": "text"}, ValueError, "OpenAI's structured response formats"),
    ("{}", TypeError, "is a str; allowed: "),
    ([{"regex": "a"}], ValueError, "a list of 1 entries for 3 prompts"),
])
def test_bad_specs_are_refused_naming_the_parameter(spec, error, message):
    model, _, tokenizer = pair()
    ids, mask = encoded()
    with pytest.raises(error, match=message):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, sampler="flash",
                       tokenizer=tokenizer, structured_output=spec, pad_token_id=0)


def test_tokenizers_and_calls_that_cannot_hold_a_grammar_are_refused():
    model, _, tokenizer = pair()
    ids, mask = encoded()
    common = dict(attention_mask=mask, max_new_tokens=4, sampler="flash", pad_token_id=0)
    spec = {"regex": REGEX}
    with pytest.raises(ValueError, match="needs the model's tokenizer: pass `tokenizer=`"):
        model.generate(ids, structured_output=spec, **common)
    torch.manual_seed(0)
    small = flashspec.wrap(LlamaForCausalLM(LlamaConfig(
        vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, eos_token_id=0)).eval())
    with pytest.raises(ValueError, match="`tokenizer` has 8192 tokens and the model's LM head "
                                         "4096 rows"):
        small.generate(ids.clamp_max(4000), structured_output=spec, tokenizer=tokenizer,
                       **common)
    with pytest.raises(ValueError, match=r"`eos_token_id` includes \[9000\]"):
        random_llama().generate(ids, structured_output=spec, tokenizer=tokenizer,
                                eos_token_id=9000, **common)
    with pytest.raises(ValueError, match="needs an `eos_token_id`"):
        model.generate(ids, structured_output=spec, tokenizer=tokenizer, eos_token_id=None,
                       **{**common, "pad_token_id": 0})
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=9000)
    compiled = xgr.GrammarCompiler(info).compile_regex(REGEX)
    with pytest.raises(ValueError, match="CompiledGrammar for a vocabulary of 9000 tokens and "
                                         "the model's LM head 8192 rows"):
        model.generate(ids, structured_output=compiled, **common)
    with pytest.raises(ValueError, match="`structured_output` is a flashspec option"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, structured_output=spec)


def test_without_xgrammar_the_error_names_the_extra(monkeypatch):
    model, _, tokenizer = pair()
    ids, mask = encoded()
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ImportError, match=r'pip install "flashspec\[structured\]"'):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, sampler="flash",
                       tokenizer=tokenizer, structured_output={"regex": REGEX}, pad_token_id=0)


# ---- Hypothesis: random schemas from a small generator -------------------------------------

NAMES = st.text("abcdefgh", min_size=1, max_size=4)
LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.tuples(st.integers(-99, 0), st.integers(0, 99)).map(
        lambda r: {"type": "integer", "minimum": r[0], "maximum": r[1]}),
    st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.text("xyz", min_size=1, max_size=3), min_size=1, max_size=3, unique=True).map(
        lambda values: {"enum": values}),
)


def _objects(children):
    return st.dictionaries(NAMES, children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props)})


SCHEMA_TREES = st.recursive(
    LEAVES, lambda children: st.one_of(
        _objects(children),
        st.tuples(children, st.integers(1, 2)).map(
            lambda a: {"type": "array", "items": a[0], "minItems": 1, "maxItems": a[1]})),
    max_leaves=5).map(lambda schema: schema if schema.get("type") == "object"
                      else {"type": "object", "properties": {"v": schema}, "required": ["v"]})


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(schema=SCHEMA_TREES, seed=st.integers(0, 2**20), lookup=st.booleans())
def test_random_schemas_give_valid_outputs(schema, seed, lookup):
    """Sampled rows, with or without prompt lookup: each output ends, parses and validates."""
    model, _, tokenizer = pair()
    ids, mask = encoded(["{", "x = "])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=160, do_sample=True, seed=seed,
                         sampler="flash", tokenizer=tokenizer, pad_token_id=0,
                         prompt_lookup_num_tokens=3 if lookup else None,
                         structured_output={"json": schema, "disable_any_whitespace": True})
    for text, ended in generated_texts(tokenizer, out, ids.shape[1]):
        assert ended, (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_the_matcher_follows_contexts_by_rolling_back():
    """`StructuredOutput.masks_of` brings a row's matcher to any context: asked along drafts
    and then at a shorter context that shares a prefix, its masks are those of a fresh
    matcher fed the context."""
    tokenizer = pair()[2]
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=8192)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMAS["nested"]),
                                                             any_whitespace=False)
    text = tokenizer('{"user": {"name": "ab", "id": 12}, "ok": true}').input_ids
    structured = grammar.StructuredOutput([compiled], prompt_width=2, stop_token_ids=[0],
                                          vocab_size=8192)
    prompt = [5, 6]
    for length in (3, 7, 5, 5, 0, 9, 8, len(text), 2):
        context = torch.tensor([prompt + text[:length]])
        got = structured.masks_of(torch.tensor([0]), context)
        fresh = xgr.GrammarMatcher(compiled)
        for token in text[:length]:
            assert fresh.accept_token(token)
        want = xgr.allocate_token_bitmask(1, 8192)
        fresh.fill_next_token_bitmask(want)
        assert torch.equal(got, want), length


def test_calls_in_turn_on_one_engine_cross_capacities_and_drafters():
    """One model, calls in turn: a grammar with an assistant sizes the slot; a long
    constrained call grows it; prompt lookup with more drafts widens it; a free call; the
    EAGLE-3 head under the grammar. Each call's tokens equal the same call without drafts
    on a model of its own (a fresh engine)."""
    model, draft, tokenizer = pair()
    path = tiny_pair_path()
    fresh = flashspec.wrap(AutoModelForCausalLM.from_pretrained(path / "target",
                                                                dtype=torch.float32).eval())
    head = flashspec.Eagle3.from_pretrained(path / "eagle3", model)
    ids, mask = encoded()
    spec = {"json": SCHEMAS["array"]}
    calls = [(dict(max_new_tokens=16, structured_output=spec),
              dict(assistant_model=draft, num_assistant_tokens=3)),
             (dict(max_new_tokens=300, structured_output={"grammar": ENDLESS_JSON_LINES}), {}),
             (dict(max_new_tokens=48, structured_output=spec), dict(prompt_lookup_num_tokens=6)),
             (dict(max_new_tokens=48), dict(prompt_lookup_num_tokens=6)),
             (dict(max_new_tokens=48, structured_output=spec),
              dict(drafter=head, num_assistant_tokens=4))]
    for call, drafts in calls:
        common = dict(attention_mask=mask, do_sample=True, seed=7, sampler="flash",
                      pad_token_id=0, tokenizer=tokenizer, **call)
        want = fresh.generate(ids, **common)
        assert torch.equal(model.generate(ids, **common, **drafts), want), (call, drafts)


class _Order(list):
    overlap = True


@pytest.fixture
def split_steps(emulated_graphs, monkeypatch):
    """Under emulated graphs (tests/conftest.py), launching work ahead of the reports as
    on CUDA: the order of a grammar call's split steps (`Engine._decode_masked`), forwards and
    heads launched ("forward", "head") and reports read ("read"); `order.overlap = False`
    runs the same steps one at a time, each report read first (`Engine._decode`)."""
    from flashspec.generation import engine as engine_module
    from flashspec.generation import slot as slot_module

    order = _Order()
    splits, run_step = engine_module.Engine._splits_masked_steps, engine_module.Engine._run_step
    read = slot_module.PendingReport.read

    def recorded(self, slot, key, fn, drafter=None):
        part = str(key if isinstance(key, str) else key[0]).rsplit(" ", 1)[-1]
        if part in ("forward", "head"):
            order.append(part)
        return run_step(self, slot, key, fn, drafter)

    monkeypatch.setattr(engine_module.Engine, "_splits_masked_steps",
                        lambda self, *args: order.overlap and splits(self, *args))
    monkeypatch.setattr(engine_module.Engine, "_runs_ahead", lambda self: True)   # as on CUDA
    monkeypatch.setattr(engine_module.Engine, "_run_step", recorded)
    monkeypatch.setattr(slot_module.PendingReport, "read",
                        lambda self: order.append("read") or read(self))
    return order


def _overlapped_and_not(order, mode: str, **extra):
    """The same seeded grammar call with the masks filled while the forward runs and one
    step at a time (fresh engines), on a batch whose rows complete their grammars (and end)
    at different steps, one never; returns both and the first call's launches and reads."""
    from flashspec.generation.engine import drop_engine

    model, draft, tokenizer = pair()
    ids, mask = encoded()
    drafts = {"plain": {}, "lookup": dict(prompt_lookup_num_tokens=4),
              "assistant": dict(assistant_model=draft, num_assistant_tokens=3)}[mode]
    common = dict(attention_mask=mask, max_new_tokens=40, sampler="flash", do_sample=True,
                  top_k=20, temperature=1.3, seed=4, pad_token_id=0, tokenizer=tokenizer,
                  structured_output=[{"json": SCHEMAS["enums"], "disable_any_whitespace": True},
                                     {"json": SCHEMAS["array"], "disable_any_whitespace": True},
                                     {"grammar": ENDLESS_JSON_LINES}], output_logprobs=True,
                  return_dict_in_generate=True, **drafts, **extra)
    drop_engine(model.model)
    overlapped = model.generate(ids, **common)
    launches = ",".join(order)
    order.overlap = False
    drop_engine(model.model)
    one_at_a_time = model.generate(ids, **common)
    drop_engine(model.model)
    lengths = (overlapped.sequences[:, ids.shape[1]:] != 0).sum(dim=1).tolist()
    assert len(set(lengths)) == 3 and max(lengths) == 40, lengths
    return overlapped, one_at_a_time, launches


@pytest.mark.parametrize("mode", ["plain", "lookup", "assistant"])
def test_split_steps_fill_masks_while_the_forward_runs(split_steps, mode):
    """A grammar call's steps run split: the decoder's forward of step t + 1, then step t's
    report is read and the masks filled, then the LM head's step (an assistant, which drafts
    among the masks, drafts after the report). The output is the one of the same steps one
    at a time: sampled tokens, logprobs, tokens per row and step. (Split steps against
    whole ones: `test_masks_from_the_reports_equal_masks_from_the_contexts`.)"""
    split, whole, launches = _overlapped_and_not(split_steps, mode)
    # A forward in flight while the host reads the report of the step before.
    assert ("forward,read" in launches) == (mode != "assistant"), launches
    assert torch.equal(split.sequences, whole.sequences)
    torch.testing.assert_close(split.logprobs, whole.logprobs)
    for name in ("emitted", "drafted", "accepted"):
        assert torch.equal(getattr(split.flash_stats, name).sum(dim=0),
                           getattr(whole.flash_stats, name).sum(dim=0)), name


@pytest.mark.parametrize("mode", ["plain", "lookup"])
def test_split_steps_complete_flagged_rows_exactly(split_steps, monkeypatch, mode):
    """Rows flagged for exact completion at every step (tests/test_engine.py's
    `_FlaggingSampler`) while the next forward is in flight: that step's head redoes them,
    and flagging them again has them completed before any other forward. The output is the
    unflagged call's."""
    from flashspec.generation import samplers
    from test_engine import _FlaggingSampler

    unflagged = _overlapped_and_not(split_steps, mode)[0]
    split_steps.overlap = True
    del split_steps[:]
    monkeypatch.setattr(samplers, "MaterializedSampler", _FlaggingSampler)
    _FlaggingSampler.flagged = 0
    flagged, _, launches = _overlapped_and_not(split_steps, mode)
    assert _FlaggingSampler.flagged > 0 and "forward,read" in launches
    assert torch.equal(flagged.sequences, unflagged.sequences)
    torch.testing.assert_close(flagged.logprobs, unflagged.logprobs)


def test_calls_with_max_time_replay_the_grammar_calls_split_steps(emulated_graphs, split_steps):
    """A grammar call's steps run split in every loop: a call with max_time (one step at a
    time, each report read first) replays the split graphs of an earlier call without it
    (without drafts: all of them, capturing none), and captures no whole step (with prompt
    lookup it meets the shorter widths max_time cuts drafts to: split steps too)."""
    model, draft, tokenizer = pair()
    ids, mask = encoded()
    for drafts in ({}, dict(prompt_lookup_num_tokens=4)):
        common = dict(attention_mask=mask, max_new_tokens=24, sampler="flash", do_sample=False,
                      pad_token_id=0, tokenizer=tokenizer,
                      structured_output={"json": SCHEMAS["nested"]}, **drafts)
        before = len(emulated_graphs)
        untimed = model.generate(ids, **common)
        captured = list(emulated_graphs)
        split = {key[3] for key in captured[before:] if key[2] is None}   # the target's steps
        assert split == ({"plain forward", "plain head"} if not drafts
                         else {("verify forward", 4), ("verify head", 4)}), split
        assert torch.equal(model.generate(ids, max_time=600.0, **common), untimed)
        new = [key[3] for key in emulated_graphs[len(captured):] if key[2] is None]
        names = [key if isinstance(key, str) else key[0] for key in new]
        assert all(name.endswith((" forward", " head")) for name in names), new
        if not drafts:
            assert new == []
