"""MTP drafts (`generate(use_mtp=True)`) on the engine, against stock transformers' own MTP
generation, on a tiny GLM-4-MoE whose checkpoint carries one MTP layer (CPU, fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
from transformers.generation import candidate_generator

import flashspec
from flashspec.generation import slot as slot_module
from flashspec.generation.mtp import Mtp

from _models import PAD, tiny_model
from test_eagle3 import record_drafts, steps_by_position

LAYERS = 3
HIDDEN = 48


def write_checkpoint(folder) -> None:
    """A GLM-4-MoE of LAYERS layers whose checkpoint holds one MTP layer as the released
    checkpoints do: the layer after the last (``model.layers.{LAYERS}.*``: a decoder layer,
    ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``), which the model itself ignores."""
    config = Glm4MoeConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        num_hidden_layers=LAYERS + 1, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        num_nextn_predict_layers=1, pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
        initializer_range=0.1, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)            # peaked: greedy rarely meets a near-tie
    model.save_pretrained(folder)
    path = folder / "model.safetensors"
    weights = load_file(str(path))
    generator = torch.Generator().manual_seed(1)
    prefix = f"model.layers.{LAYERS}."
    for name in ("enorm", "hnorm", "shared_head.norm"):
        weights[f"{prefix}{name}.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=generator)
    weights[f"{prefix}eh_proj.weight"] = 0.1 * torch.randn(HIDDEN, 2 * HIDDEN, generator=generator)
    save_file(weights, str(path), metadata={"format": "pt"})
    config_path = folder / "config.json"
    fields = json.loads(config_path.read_text())
    fields["num_hidden_layers"] = LAYERS
    config_path.write_text(json.dumps(fields))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("glm4_moe_mtp")
    write_checkpoint(folder)
    loaded = Glm4MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # transformers finds a checkpoint's MTP keys by the model class's ignore patterns, which
    # name the released models' layer numbers (46, 92): this one's is LAYERS.
    loaded._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}\..*"]
    return flashspec.wrap(loaded)


def prompts():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [PAD, PAD, PAD, 3, 4, 5, 3, 4],
                        [PAD, PAD, PAD, PAD, PAD, PAD, 17, 18]])
    return ids, (ids != PAD).long()


def test_greedy_tokens_and_drafts_equal_stocks_mtp(model, monkeypatch):
    """Batch 1 (stock's only size): flashspec's use_mtp tokens equal stock's use_mtp and plain
    tokens, and each step's draft equals the one stock's MTPCandidateGenerator made there."""
    stock_drafts, flash_drafts = {}, {}
    get_candidates = candidate_generator.MTPCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        candidates, logits = get_candidates(self, input_ids, *args, **kwargs)
        if candidates.shape[1] > input_ids.shape[1]:
            stock_drafts[input_ids.shape[1]] = candidates[0, input_ids.shape[1]:].tolist()
        return candidates, logits

    verify = slot_module.Slot.verify

    def verifying(slot, width):
        flash_drafts[int(slot.length[0])] = slot.drafts[0, :width].tolist()
        return verify(slot, width)

    monkeypatch.setattr(candidate_generator.MTPCandidateGenerator, "get_candidates", recording)
    monkeypatch.setattr(slot_module.Slot, "verify", verifying)
    ids = prompts()[0][:1]
    plain = model.generate(ids, max_new_tokens=20, do_sample=False)
    stock = model.generate(ids, max_new_tokens=20, do_sample=False, use_mtp=True)
    flash = model.generate(ids, max_new_tokens=20, do_sample=False, use_mtp=True, sampler="flash",
                           return_dict_in_generate=True)
    assert torch.equal(stock, plain) and torch.equal(flash.sequences, plain)
    assert int(flash.flash_stats.drafted.sum()) > 5
    shared = set(stock_drafts) & set(flash_drafts)
    assert len(shared) > 5
    for length in shared:
        assert flash_drafts[length][:1] == stock_drafts[length][:1], length


@pytest.mark.parametrize("drafts", [None, 3])
def test_batched_and_sampled_mtp_tokens_are_the_tokens_without(model, drafts):
    """A ragged batch (stock refuses batches), greedy and seeded sampling, one draft per step
    (stock's count) or three (the layer reused): the tokens of the call without drafts."""
    ids, mask = prompts()
    extra = {} if drafts is None else {"num_assistant_tokens": drafts}
    for sampling in (dict(do_sample=False), dict(do_sample=True, top_k=8, seed=3)):
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=16, sampler="flash",
                               **sampling)
        drafted = model.generate(ids, attention_mask=mask, max_new_tokens=16, sampler="flash",
                                 use_mtp=True, return_dict_in_generate=True, **extra, **sampling)
        assert torch.equal(drafted.sequences, plain)
        width = drafted.flash_stats.drafted.max()
        assert int(width) == (drafts or 1)


def test_the_mtp_layer_is_loaded_once_and_refused_where_it_cannot_run(model):
    first = Mtp(model)
    assert Mtp(model).mtp is first.mtp                  # kept on the model
    llama = tiny_model("llama")
    with pytest.raises(ValueError, match="num_mtp_layers"):
        llama.generate(torch.tensor([[5, 6]]), max_new_tokens=2, use_mtp=True, sampler="flash")

    ids, mask = prompts()
    with pytest.raises(ValueError, match="one source of drafts: `use_mtp`"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, use_mtp=True,
                       prompt_lookup_num_tokens=2, sampler="flash")
    config = model.config
    config.num_nextn_predict_layers = 2
    try:
        with pytest.raises(ValueError, match="2 MTP layers"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, use_mtp=True,
                           sampler="flash")
    finally:
        config.num_nextn_predict_layers = 1


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the attention by position on CPU tensors runs through Triton's "
                           "interpreter, which a CUDA machine does not use")
@pytest.mark.parametrize("by_position", [False, True])
def test_an_mtp_layer_passing_its_hidden_state_through_drafts_the_last_token(
        tmp_path, monkeypatch, by_position):
    """The tapped state is the target's output at the right position: an MTP layer whose
    projection passes the (normed) hidden state through and whose decoder layer adds nothing
    drafts, from the target's own LM head, the target's greedy token at the position before
    the row's last: that last token, at every step (a ragged batch; with the steps'
    attention by position too)."""
    write_checkpoint(tmp_path)
    loaded = Glm4MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    loaded._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}\..*"]
    target = flashspec.wrap(loaded)
    layer = Mtp(target).mtp.layers[0]
    with torch.no_grad():
        layer.eh_proj.weight.zero_()
        layer.eh_proj.weight[:, HIDDEN:] = torch.eye(HIDDEN)
        for norm in (layer.enorm, layer.hnorm, layer.post_norm):
            norm.weight.fill_(1.0)
        block = layer.mtp_block
        block.self_attn.o_proj.weight.zero_()
        block.mlp.experts.down_proj.zero_()
        block.mlp.shared_experts.down_proj.weight.zero_()
    if by_position:
        steps_by_position(monkeypatch)
    records = record_drafts(monkeypatch)
    ids, mask = prompts()
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    drafted = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              use_mtp=True, num_assistant_tokens=2, sampler="flash")
    assert torch.equal(drafted, plain)
    assert len(records) > 10
    assert all(drafts[0] == tokens[-1] for tokens, drafts, _ in records)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the attention by position on CPU tensors runs through Triton's "
                           "interpreter, which a CUDA machine does not use")
def test_mtp_drafts_are_the_same_through_compaction_and_attention_by_position(model, monkeypatch):
    """The MTP layer's drafts do not depend on how its cache is kept: a slot of 16 columns
    that compacts its caches again and again (the MTP layer's last entry kept), and the
    steps' attention by position (the MTP layer's own attention switched with the target's),
    give the drafts of the plain path."""
    ids, mask = prompts()

    def drafts(by_position: bool = False, **patches):
        with pytest.MonkeyPatch.context() as patch:
            for name, value in patches.items():
                patch.setattr(slot_module, name, value)
            if by_position:
                steps_by_position(patch)
            records = record_drafts(patch)
            flashspec.generation.engine.drop_engine(model.model)
            model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                           use_mtp=True, num_assistant_tokens=2, sampler="flash")
        return records

    reference = drafts()
    assert len(reference) > 40
    assert drafts(MIN_VIEW=16) == reference
    assert drafts(by_position=True) == reference


def test_a_model_moved_after_its_mtp_layer_was_loaded(model):
    """The kept MTP layer follows the model to another dtype and back (the MoE experts run
    in float32, bfloat16 or float16 only), and to a new embedding table."""
    ids, mask = prompts()
    model.to(torch.bfloat16)
    try:
        drafted = model.generate(ids, attention_mask=mask, max_new_tokens=8, use_mtp=True,
                                 sampler="flash")
        assert drafted.shape == (3, 16)
        assert Mtp(model).mtp.layers[0].eh_proj.weight.dtype == torch.bfloat16
    finally:
        model.to(torch.float32)
    assert Mtp(model).mtp.layers[0].eh_proj.weight.dtype == torch.float32
    embeddings = model.get_input_embeddings()
    model.set_input_embeddings(torch.nn.Embedding.from_pretrained(embeddings.weight.clone(),
                                                                  freeze=False))
    try:
        assert Mtp(model).mtp.embed_tokens is model.get_input_embeddings()
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=8,
                                          use_mtp=True, sampler="flash"),
                           model.generate(ids, attention_mask=mask, max_new_tokens=8,
                                          sampler="flash"))
    finally:
        model.set_input_embeddings(embeddings)


def test_moe_experts_that_cuda_graphs_cannot_capture_are_named(model):
    """On CUDA the engine refuses MoE experts whose grouped GEMMs fall back to a loop reading
    the host (transformers' grouped_mm experts in another dtype than bfloat16; seen failing
    at capture on an H200): the check itself, on the CPU copy (CPU twin of the refusal)."""
    from flashspec.generation.heads import uncapturable_experts

    why = uncapturable_experts(model.model, "model")
    assert "float32 weights" in why and "bfloat16" in why and "Glm4MoeExperts" in why
    assert uncapturable_experts(tiny_model("llama").model, "model") is None
    model.to(torch.bfloat16)
    try:
        assert uncapturable_experts(model.model, "model") is None
    finally:
        model.to(torch.float32)


def test_mtp_drafts_among_a_grammars_tokens(model, monkeypatch):
    """With `structured_output` (an xgrammar grammar over a raw 128-token vocabulary: token
    i is letter i % 26 written 1 + i // 26 times) the MTP layer drafts among each
    position's allowed tokens: every draft up to an EOS draft is made of the grammar's
    letters (the random layer drafts any token unmasked), and the tokens are those without
    drafts."""
    import xgrammar as xgr

    vocab = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(127)] + ["</s>"]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[127])
    grammar = xgr.GrammarCompiler(info).compile_regex("[ab]+e")
    drafts = []
    verify = slot_module.Slot.verify_head      # a grammar's steps run split

    def verifying(slot, width):
        for row in slot.verified_drafts(width).tolist():     # up to an EOS: nothing after
            row = [d for d in row if d >= 0]
            drafts.extend(row[: row.index(127) + 1] if 127 in row else row)
        return verify(slot, width)

    monkeypatch.setattr(slot_module.Slot, "verify_head", verifying)
    ids, mask = prompts()
    common = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, sampler="flash",
                  structured_output=grammar, eos_token_id=127)
    plain = model.generate(ids, **common)
    drafted = model.generate(ids, use_mtp=True, num_assistant_tokens=3, **common)
    assert torch.equal(drafted, plain)
    for row in plain[:, ids.shape[1]:].tolist():                 # the grammar's language
        matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=[127])
        for token in row[: row.index(127) + 1] if 127 in row else row:
            assert matcher.accept_token(token)
    assert len(drafts) > 20
    assert [t for t in drafts if not (t == 127 or t % 26 in (0, 1, 4))] == []
