"""Acceptance tests of the generation engine, `model.generate(..., sampler="flash")`, on CPU.

What is pinned here (the engine's contract, from the issue's acceptance list):

1. Greedy decoding is token-for-token stock transformers greedy, for Llama, Qwen3, Mistral
   (sliding window smaller than the sequence) and GPT-2, in plain, assistant (smaller
   model, and the target itself) and prompt-lookup modes, batch 1 and left-padded batch 4.
2. Seeded sampling gives the same tokens whatever the drafter (none, a useless random
   assistant, the target itself, G in {1, 3, 8}, heuristic schedule, prompt lookup), for
   plain sampling and the top-k / top-p / min-p / temperature warpers; and those tokens
   are the documented Gumbel-max draw from the model's own logits.
3. Each row of a batch equals its prompt run alone with that row's seed.
4. EOS inside an accepted draft ends the row there, as stock greedy does; max_new_tokens
   is exact; finished rows are padded with pad_token_id like transformers.
5. A streamer sees the prompt, then exactly the new tokens, then one end().
6. num_return_sequences=n with seed s: row r is the single run with seed s + r.
7. output_logprobs equals a float64 recomputation from the model's logits.
8. What cannot run is refused with a ValueError naming it (options that edit the logits:
   tests/test_logits_options.py).
9. Cohere's logit_scale: greedy equals stock, sampling equals the noise contract.
10. stop_strings end a row where stock transformers ends it, also inside an accepted chunk.

Also: from_pretrained / wrap; the assistant drafts are the assistant's greedy continuation
and the prompt-lookup drafts are transformers' candidates, for every row at every step;
the heuristic schedule follows transformers' +2 / -1 rule.

The models are tiny random float32 models from `tests/_models.py`.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast
from transformers.generation.streamers import BaseStreamer

import flashspec
from flashspec import SamplingParams, reference, rng

from _models import ARCHS, PAD, SLIDING_WINDOW, VOCAB, tiny_draft, tiny_model

MAX_NEW = 16

# Prompts of different lengths with repeated n-grams, so prompt lookup finds drafts.
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [9, 10, 11, 9, 10, 11, 9],
    [20, 21, 20, 21, 20],
    [30, 31, 32, 33, 34, 30, 31, 32, 33, 34, 30, 31],
]
ROW_SEEDS = [101, 7, 55, 3]

# Decoding modes; `mode_kwargs` turns one into generate() kwargs.
MODES = ("plain", "assistant", "self", "lookup")

SAMPLING_SETTINGS = {
    "plain": dict(do_sample=True, top_k=0),
    "top_k=20": dict(do_sample=True, top_k=20),
    "top_p=0.9": dict(do_sample=True, top_p=0.9, top_k=0),
    "min_p=0.1": dict(do_sample=True, min_p=0.1, top_k=0),
    "temperature=0.7": dict(do_sample=True, temperature=0.7),
}


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _quiet_single_threaded():
    """Tiny matmuls run fastest on one thread (and do not fight other processes for cores);
    transformers' generation warnings are noise here. Both restored afterwards."""
    threads = torch.get_num_threads()
    verbosity = transformers.logging.get_verbosity()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    yield
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity(verbosity)


@functools.lru_cache(maxsize=None)
def target(arch: str = "llama"):
    return tiny_model(arch)


@functools.lru_cache(maxsize=None)
def draft(arch: str = "llama"):
    return tiny_draft(arch)


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` [B, max_len], padding (PAD) on the left."""
    length = max(map(len, prompts))
    ids = torch.full((len(prompts), length), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt):] = torch.tensor(prompt)
        mask[row, length - len(prompt):] = 1
    return ids, mask


def mode_kwargs(mode: str, arch: str = "llama", num_drafts: int | None = None) -> dict:
    """generate() kwargs of a speculative mode."""
    if mode == "plain":
        return {}
    if mode == "assistant":
        return dict(assistant_model=draft(arch), num_assistant_tokens=num_drafts or 3)
    if mode == "self":
        return dict(assistant_model=target(arch), num_assistant_tokens=num_drafts or 4)
    if mode == "lookup":
        return dict(prompt_lookup_num_tokens=num_drafts or 3)
    raise ValueError(mode)


def flash(model, ids, mask=None, **kwargs) -> flashspec.FlashGenerateOutput:
    """A flash run with ``return_dict_in_generate=True`` (defaults: MAX_NEW tokens, greedy)."""
    kwargs.setdefault("max_new_tokens", MAX_NEW)
    kwargs.setdefault("do_sample", False)
    out = model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids),
                         sampler="flash", return_dict_in_generate=True, **kwargs)
    assert isinstance(out, flashspec.FlashGenerateOutput)
    return out


def stock(model, ids, mask=None, **kwargs) -> torch.Tensor:
    """Stock transformers generate (greedy unless told), sequences only."""
    kwargs.setdefault("max_new_tokens", MAX_NEW)
    kwargs.setdefault("do_sample", False)
    return model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids),
                          **kwargs)


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """Sequence index of every column, as transformers computes it for left padding."""
    return (mask.long().cumsum(dim=1) - 1).clamp_min(0)


@torch.no_grad()
def oracle_sample(model, ids, mask, max_new_tokens: int, seed, **sampling) -> torch.Tensor:
    """The documented sampler, one full forward per token: row b's token at sequence index i
    is argmax(transformed logits + gumbel(seed_b, i, v)) (float32, as the engine computes),
    from the model's own logits (model(...).logits, which include e.g. Cohere's scale)."""
    params = SamplingParams.from_generation_config(GenerationConfig(**sampling), ids.shape[0], seed=seed)
    vocab = torch.arange(model.config.vocab_size)
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_of(mask)).logits[:, -1]
        scores = reference.transform_logits(logits.float(), params)
        noise = rng.gumbel(params.seed[:, None], mask.sum(dim=1)[:, None], vocab[None, :],
                           dtype=torch.float32)
        tokens = torch.where(params.is_greedy, logits.argmax(dim=-1), (scores + noise).argmax(dim=-1))
        ids = torch.cat([ids, tokens[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids


def unpadded(ids: torch.Tensor, mask: torch.Tensor, row: int) -> torch.Tensor:
    """Row `row`'s prompt without its padding, as a [1, n] batch."""
    return ids[row, mask[row].bool()][None, :]


def first_new_occurrence(tokens: list[int], steps) -> tuple[int, int] | None:
    """(step, token) of the first step in `steps` whose token appears nowhere earlier in
    `tokens` and is not PAD."""
    for step in steps:
        if tokens[step] != PAD and tokens[step] not in tokens[:step]:
            return step, tokens[step]
    return None


def ended_inside_accepted_draft(stats: flashspec.SpeculationStats, row: int = 0) -> bool:
    """True when row `row`'s last step emitted no more tokens than it accepted drafts, i.e.
    the row ended on an accepted draft and the rest of the verified chunk was dropped."""
    active = (stats.emitted[:, row] > 0).nonzero().flatten()
    last = int(active[-1])
    return int(stats.emitted[last, row]) <= int(stats.accepted[last, row])


# --------------------------------------------------------------------------------------
# 1. Greedy equals stock transformers
# --------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def stock_greedy(arch: str, batch_size: int) -> torch.Tensor:
    ids, mask = left_pad(PROMPTS[:batch_size])
    return stock(target(arch), ids, mask)


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_stock_generate(arch, mode, batch_size):
    """Greedy flash = stock greedy, token for token, with left padding, in every mode. The
    target drafting for itself must have every draft accepted; prompt lookup must draft."""
    ids, mask = left_pad(PROMPTS[:batch_size])
    out = flash(target(arch), ids, mask, **mode_kwargs(mode, arch))
    expected = stock_greedy(arch, batch_size)
    assert out.sequences.shape == (batch_size, ids.shape[1] + MAX_NEW)
    assert torch.equal(out.sequences, expected), (out.sequences[:, ids.shape[1]:].tolist(),
                                                  expected[:, ids.shape[1]:].tolist())
    stats = out.flash_stats
    if mode == "plain":
        assert int(stats.drafted.sum()) == 0 and stats.num_steps == MAX_NEW
    if mode == "self":
        assert int(stats.drafted.sum()) > 0 and stats.acceptance_rate == 1.0, stats.summary()
    if mode == "lookup":
        assert int(stats.drafted.sum()) > 0, stats.summary()
    assert torch.equal(stats.emitted.sum(dim=0), torch.full((batch_size,), MAX_NEW))


def test_greedy_prompt_lookup_drafts_are_accepted():
    """The prompt-lookup path really speculates: some of its drafts are accepted, so some row
    needs fewer target forwards than tokens, and the output is still stock greedy."""
    ids, mask = left_pad(PROMPTS)
    out = flash(target("llama"), ids, mask, prompt_lookup_num_tokens=3)
    assert torch.equal(out.sequences, stock_greedy("llama", 4))
    assert int(out.flash_stats.accepted.sum()) > 0, out.flash_stats.summary()
    assert int((out.flash_stats.emitted > 0).sum(dim=0).min()) < MAX_NEW
    assert out.flash_stats.mean_accepted_length > 1.0


def test_mistral_sliding_window_matters():
    """Sanity check of the Mistral cases above: with the window removed, stock greedy gives
    different tokens, so flash = stock there really tests the window."""
    assert SLIDING_WINDOW < len(PROMPTS[0]) + MAX_NEW
    no_window = tiny_model("mistral", sliding_window=None)
    ids, mask = left_pad(PROMPTS)
    assert not torch.equal(stock(no_window, ids, mask), stock_greedy("mistral", 4))


def test_gemma2_softcapped_assistant_is_accepted():
    """A Gemma-2 assistant's final_logit_softcapping is monotone, so it may draft greedily
    for a target with the same vocabulary; the output is the target's stock greedy."""
    gemma = tiny_model("gemma2", "draft", seed=3)
    ids, mask = left_pad(PROMPTS)
    out = flash(target("llama"), ids, mask, assistant_model=gemma, num_assistant_tokens=3)
    assert torch.equal(out.sequences, stock_greedy("llama", 4))
    assert int(out.flash_stats.drafted.sum()) > 0


def test_from_pretrained_and_wrap(tmp_path):
    """from_pretrained(folder) loads a wrapped model that generates like the original;
    wrap is idempotent and leaves stock generate (no sampler) untouched."""
    original = tiny_model("llama", wrap=False)
    ids, mask = left_pad(PROMPTS)
    expected = stock(original, ids, mask)
    original.save_pretrained(tmp_path)
    loaded = flashspec.from_pretrained(tmp_path).float().eval()
    assert isinstance(loaded, flashspec.FlashGenerationMixin)
    assert flashspec.wrap(loaded) is loaded and type(flashspec.wrap(loaded)) is type(loaded)
    assert torch.equal(stock(loaded, ids, mask), expected)
    assert torch.equal(flash(loaded, ids, mask).sequences, expected)
    assert torch.equal(loaded.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                       do_sample=False, sampler="flash"), expected)


# --------------------------------------------------------------------------------------
# 2. Seeded sampling: the same tokens whatever the drafter
# --------------------------------------------------------------------------------------

SPECULATIVE_VARIANTS = {
    "random-assistant-G1": ("assistant", 1, "constant"),
    "random-assistant-G3": ("assistant", 3, "constant"),
    "random-assistant-G8": ("assistant", 8, "constant"),
    "self-G1": ("self", 1, "constant"),
    "self-G3": ("self", 3, "constant"),
    "self-G8": ("self", 8, "constant"),
    "self-heuristic": ("self", 2, "heuristic"),
    "random-assistant-heuristic": ("assistant", 2, "heuristic"),
    "lookup-3": ("lookup", 3, None),
    "lookup-8": ("lookup", 8, None),
}


@functools.lru_cache(maxsize=None)
def plain_sampled(arch: str, setting: str) -> torch.Tensor:
    ids, mask = left_pad(PROMPTS)
    return flash(target(arch), ids, mask, seed=11, **SAMPLING_SETTINGS[setting]).sequences


@pytest.mark.parametrize("setting", SAMPLING_SETTINGS)
def test_seeded_sampling_is_the_documented_gumbel_draw(setting):
    """The plain seeded run is argmax(warped logits + gumbel(seed + b, index, token)) from
    the model's own logits, one token at a time (flashspec.rng's contract)."""
    ids, mask = left_pad(PROMPTS)
    expected = oracle_sample(target(), ids, mask, MAX_NEW, 11, **SAMPLING_SETTINGS[setting])
    assert torch.equal(plain_sampled("llama", setting), expected)


@pytest.mark.parametrize("variant", SPECULATIVE_VARIANTS)
@pytest.mark.parametrize("setting", SAMPLING_SETTINGS)
def test_seeded_sampling_same_tokens_with_any_drafter(setting, variant):
    """Seeded sampling emits identical tokens with or without an assistant or prompt lookup,
    for any draft length and schedule; a constant schedule drafts exactly G per step
    (where the budget allows)."""
    mode, num_drafts, schedule = SPECULATIVE_VARIANTS[variant]
    kwargs = mode_kwargs(mode, num_drafts=num_drafts)
    if schedule is not None:
        kwargs["num_assistant_tokens_schedule"] = schedule
    ids, mask = left_pad(PROMPTS)
    out = flash(target(), ids, mask, seed=11, **SAMPLING_SETTINGS[setting], **kwargs)
    assert torch.equal(out.sequences, plain_sampled("llama", setting)), (
        out.sequences[:, ids.shape[1]:].tolist(), plain_sampled("llama", setting)[:, ids.shape[1]:].tolist())
    stats = out.flash_stats
    assert int(stats.drafted.sum()) > 0, stats.summary()
    if schedule == "constant":
        assert int(stats.drafted.max()) == num_drafts
    if mode == "self" and num_drafts == 8:
        # The sampled target agrees with its own greedy drafts often enough to skip forwards.
        assert int(stats.accepted.sum()) > 0 and stats.mean_accepted_length > 1.0, stats.summary()


@pytest.mark.parametrize("mode", ["assistant", "self", "lookup"])
@pytest.mark.parametrize("arch", ["qwen3", "mistral", "gpt2"])
def test_seeded_sampling_same_tokens_other_architectures(arch, mode):
    """The drafter invariance of seeded sampling (top_p=0.9, T=0.7) on the other
    architectures, including Mistral's sliding window."""
    sampling = dict(do_sample=True, top_p=0.9, top_k=0, temperature=0.7)
    ids, mask = left_pad(PROMPTS)
    base = flash(target(arch), ids, mask, seed=23, **sampling).sequences
    out = flash(target(arch), ids, mask, seed=23, **sampling, **mode_kwargs(mode, arch, 4))
    assert torch.equal(out.sequences, base)
    assert torch.equal(base, oracle_sample(target(arch), ids, mask, MAX_NEW, 23, **sampling))


def test_heuristic_schedule_grows_and_shrinks_like_transformers():
    """num_assistant_tokens_schedule="heuristic": +2 drafts after a fully accepted step, -1
    (at least 1) otherwise, capped by the remaining budget (transformers' rule). The prompt's
    step drafts nothing (the first token comes from the prefill); greedy self-drafting then
    accepts everything: 2, 4, 6, 8 drafts, then budget 30 - 25 - 1 = 4. (No confidence
    threshold: every step drafts its count.)"""
    ids, mask = left_pad(PROMPTS[:1])
    every = dict(assistant_confidence_threshold=0)
    out = flash(target(), ids, mask, max_new_tokens=30, assistant_model=target(),
                num_assistant_tokens=2, num_assistant_tokens_schedule="heuristic", **every)
    assert out.flash_stats.drafted[:, 0].tolist() == [0, 2, 4, 6, 8, 4]
    assert torch.equal(out.sequences, stock(target(), ids, mask, max_new_tokens=30))
    # A useless random assistant (sampled target): mostly rejected, checked step by step.
    out = flash(target(), ids, mask, max_new_tokens=8, assistant_model=draft(), seed=0,
                num_assistant_tokens=2, num_assistant_tokens_schedule="heuristic", do_sample=True,
                **every)
    drafted, accepted = out.flash_stats.drafted[:, 0].tolist(), out.flash_stats.accepted[:, 0].tolist()
    assert drafted[:2] == [0, 2]
    for step in range(2, len(drafted)):
        grow = accepted[step - 1] == drafted[step - 1]
        budget = 8 - int(out.flash_stats.emitted[:step, 0].sum()) - 1
        expected = drafted[step - 1] + 2 if grow else max(drafted[step - 1] - 1, 1)
        assert drafted[step] == min(expected, budget), (drafted, accepted)


def test_num_assistant_tokens_from_assistant_generation_config():
    """Without num_assistant_tokens in the call, the assistant's generation_config value is
    used (where transformers reads it)."""
    assistant = tiny_draft("llama")
    assistant.generation_config.num_assistant_tokens = 2
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    ids, mask = left_pad(PROMPTS)
    out = flash(target(), ids, mask, assistant_model=assistant)
    assert int(out.flash_stats.drafted.max()) == 2
    assert torch.equal(out.sequences, stock_greedy("llama", 4))


# --------------------------------------------------------------------------------------
# Drafters propose what transformers' drafters would
# --------------------------------------------------------------------------------------

def record_proposals(monkeypatch) -> list:
    """Record the drafts of every verification step as (tokens, valid, max_drafts, drafts),
    tokens right-aligned: what each row had when its drafts were made."""
    from flashspec.generation.slot import Slot
    calls = []
    verify = Slot.verify

    def recorded_verify(self, width):
        length = int(self.seq.shape[1])
        source = torch.arange(length)[None, :] - length + self.length[:, None]
        valid = source >= 0
        tokens = torch.where(valid, self.seq.gather(1, source.clamp_min(0)), PAD)
        allowed = torch.where(self.finished, 0,
                              torch.minimum(self.num_drafts, self.end - self.length - 1))
        hidden, drafts = verify(self, width)
        calls.append((tokens, valid, allowed, drafts.clone()))
        return hidden, drafts

    monkeypatch.setattr(Slot, "verify", recorded_verify)
    return calls


def check_proposals(calls, expected_drafts) -> None:
    """Each row's drafts are ``expected_drafts(row_tokens [1, n], k)`` (a list of at most k
    ids), then -1; `row_tokens` is the row without padding."""
    assert calls
    for tokens, valid, max_drafts, drafts in calls:
        for row in range(tokens.shape[0]):
            k = int(max_drafts[row])
            expected = expected_drafts(tokens[row, valid[row]][None, :], k) if k > 0 else []
            padded = expected + [-1] * (drafts.shape[1] - len(expected))
            assert drafts[row].tolist() == padded, (tokens[row, valid[row]].tolist(), k)


@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(do_sample=True, top_k=0, seed=ROW_SEEDS)],
                         ids=["greedy", "sampled"])
def test_assistant_drafts_are_its_greedy_continuation(monkeypatch, sampling):
    """Every proposal of the assistant drafter, for every row of a ragged batch whose rows
    accept different numbers of drafts (its KV cache realigned between steps), is the
    assistant's stock greedy continuation of that row."""
    calls = record_proposals(monkeypatch)
    assistant = draft()
    ids, mask = left_pad(PROMPTS)
    flash(target(), ids, mask, max_new_tokens=16, assistant_model=assistant, num_assistant_tokens=5,
          num_assistant_tokens_schedule="heuristic", assistant_confidence_threshold=0, **sampling)

    def greedy(row, k):
        return assistant.generate(row, max_new_tokens=k, do_sample=False)[0, row.shape[1]:].tolist()

    check_proposals(calls, greedy)
    assert len({tuple(c[2].tolist()) for c in calls}) > 1          # ragged draft budgets occurred


@pytest.mark.parametrize("ngram", [1, 2, 3])
def test_prompt_lookup_drafts_are_transformers_candidates(monkeypatch, ngram):
    """Every prompt-lookup proposal, per row of a ragged batch, is what transformers'
    PromptLookupCandidateGenerator proposes for that row alone (longest n-gram first,
    leftmost match with a continuation, up to G tokens)."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    calls = record_proposals(monkeypatch)
    ids, mask = left_pad(PROMPTS)
    flash(target(), ids, mask, max_new_tokens=16, prompt_lookup_num_tokens=4,
          max_matching_ngram_size=ngram, do_sample=True, top_k=0, seed=ROW_SEEDS)

    def lookup(row, k):
        generator = PromptLookupCandidateGenerator(num_output_tokens=k, max_matching_ngram_size=ngram,
                                                   max_length=10**6)
        return generator.get_candidates(row)[0][0, row.shape[1]:].tolist()

    check_proposals(calls, lookup)
    assert any(bool((c[3] >= 0).any()) for c in calls)


# --------------------------------------------------------------------------------------
# 3. Batch invariance
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_batch_rows_equal_single_runs(arch, mode):
    """Row b of a left-padded batch with per-row seeds equals its prompt run alone (no
    padding) with seed ROW_SEEDS[b], in every mode; seeds as a list or a tensor; an int
    seed s means s + b."""
    sampling = dict(do_sample=True, top_k=0, temperature=0.8)
    kwargs = mode_kwargs(mode, arch)
    ids, mask = left_pad(PROMPTS)
    batched = flash(target(arch), ids, mask, seed=ROW_SEEDS, **sampling, **kwargs).sequences
    as_tensor = flash(target(arch), ids, mask, seed=torch.tensor(ROW_SEEDS), **sampling, **kwargs)
    assert torch.equal(as_tensor.sequences, batched)
    assert batched.shape == (4, ids.shape[1] + MAX_NEW)
    # An int seed s gives row b the seed s + b.
    assert torch.equal(flash(target(arch), ids, mask, seed=100, **sampling, **kwargs).sequences,
                       flash(target(arch), ids, mask, seed=[100, 101, 102, 103], **sampling, **kwargs).sequences)
    for row, seed in enumerate(ROW_SEEDS):
        alone_ids = unpadded(ids, mask, row)
        alone = flash(target(arch), alone_ids, seed=seed, **sampling, **kwargs).sequences
        assert torch.equal(batched[row, ids.shape[1]:], alone[0, alone_ids.shape[1]:]), row
        assert torch.equal(batched[row, :ids.shape[1]], ids[row])


@pytest.mark.parametrize("mode", MODES)
def test_batch_rows_equal_single_runs_when_rows_finish_early(mode):
    """The same with an EOS that row 0 samples early: the finished row leaves the running
    batch (the caches of the others are realigned) and every row still equals its single
    run, cut after its EOS and padded with pad_token_id."""
    sampling = dict(do_sample=True, top_k=0, temperature=0.8)
    kwargs = mode_kwargs(mode, num_drafts=5)
    ids, mask = left_pad(PROMPTS)
    free = flash(target(), ids, mask, seed=ROW_SEEDS, **sampling).sequences[:, ids.shape[1]:]
    step, eos = first_new_occurrence(free[0].tolist(), range(1, 6))
    out = flash(target(), ids, mask, seed=ROW_SEEDS, eos_token_id=eos, **sampling, **kwargs).sequences
    assert out[0, ids.shape[1]:].tolist()[:step + 1] == free[0, :step + 1].tolist()
    for row, seed in enumerate(ROW_SEEDS):
        alone_ids = unpadded(ids, mask, row)
        alone = flash(target(), alone_ids, seed=seed, eos_token_id=eos, **sampling, **kwargs).sequences
        new_alone = alone[0, alone_ids.shape[1]:]
        new_batched = out[row, ids.shape[1]:]
        assert torch.equal(new_batched[:len(new_alone)], new_alone), row
        assert (new_batched[len(new_alone):] == PAD).all(), row


# --------------------------------------------------------------------------------------
# 4. EOS, max_new_tokens, padding of finished rows
# --------------------------------------------------------------------------------------

def test_eos_inside_accepted_draft_ends_the_row_there():
    """Greedy, the target drafting 4 tokens for itself (all accepted): declaring the token
    generated at step k < 4 the EOS ends the row right after it, inside the first verified
    chunk, exactly like stock greedy with that EOS."""
    ids, mask = left_pad(PROMPTS[:1])
    free = flash(target(), ids, mask, **mode_kwargs("self")).sequences[0, ids.shape[1]:].tolist()
    found = first_new_occurrence(free, range(1, 4))
    assert found is not None, free
    step, eos = found
    out = flash(target(), ids, mask, eos_token_id=eos, **mode_kwargs("self"))
    expected = stock(target(), ids, mask, eos_token_id=eos)
    assert out.sequences[0, ids.shape[1]:].tolist() == free[:step + 1]
    assert torch.equal(out.sequences, expected)
    assert ended_inside_accepted_draft(out.flash_stats)


@pytest.mark.parametrize("mode", ["self", "lookup", "plain"])
def test_seeded_eos_ends_the_row_identically_in_every_mode(mode):
    """Seeded sampling with an EOS that the run samples at some step: every mode stops at
    that step with the same tokens (the seeded run without EOS, cut after the EOS)."""
    sampling = dict(do_sample=True, top_k=0, seed=5)
    ids, mask = left_pad(PROMPTS[:1])
    free = flash(target(), ids, mask, **sampling).sequences[0, ids.shape[1]:].tolist()
    step, eos = first_new_occurrence(free, range(2, MAX_NEW - 1))
    out = flash(target(), ids, mask, eos_token_id=eos, **sampling, **mode_kwargs(mode, num_drafts=8))
    assert out.sequences[0, ids.shape[1]:].tolist() == free[:step + 1]


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 7])
@pytest.mark.parametrize("mode", ["assistant", "self", "lookup"])
def test_max_new_tokens_is_exact(mode, max_new_tokens):
    """Without EOS every row has exactly max_new_tokens new tokens, even when the drafts of
    a step (G = 8) could overshoot the budget; tokens equal stock greedy."""
    ids, mask = left_pad(PROMPTS)
    out = flash(target(), ids, mask, max_new_tokens=max_new_tokens, **mode_kwargs(mode, num_drafts=8))
    assert out.sequences.shape == (4, ids.shape[1] + max_new_tokens)
    assert torch.equal(out.sequences, stock(target(), ids, mask, max_new_tokens=max_new_tokens))
    assert torch.equal(out.flash_stats.emitted.sum(dim=0), torch.full((4,), max_new_tokens))


@functools.lru_cache(maxsize=None)
def batch_eos_token() -> int:
    """An EOS that row 0 generates early (greedy, step <= 3) and that some other row never
    generates, so one row finishes early and another runs to max_new_tokens."""
    ids, mask = left_pad(PROMPTS)
    new = stock_greedy("llama", 4)[:, ids.shape[1]:].tolist()
    for step in range(4):
        token = new[0][step]
        if token != PAD and token not in new[0][:step] and any(token not in row for row in new[1:]):
            return token
    raise AssertionError(f"no suitable EOS token in {new}")


@pytest.mark.parametrize("several_eos", [False, True], ids=["one-eos", "eos-list"])
@pytest.mark.parametrize("mode", MODES)
def test_batch_with_early_eos_is_padded_like_transformers(mode, several_eos):
    """Batch 4, one row hitting EOS early: finished rows are padded with pad_token_id after
    the EOS, exactly as stock greedy pads them; logprobs are 0 after a row's end. Also with
    a list of EOS ids (the other one never generated)."""
    eos = batch_eos_token()
    ids, mask = left_pad(PROMPTS)
    prompt_len = ids.shape[1]
    unused = next(t for t in range(1, VOCAB) if not (stock_greedy("llama", 4) == t).any())
    eos_ids = [unused, eos] if several_eos else eos
    out = flash(target(), ids, mask, eos_token_id=eos_ids, pad_token_id=PAD, output_logprobs=True,
                **mode_kwargs(mode))
    expected = stock(target(), ids, mask, eos_token_id=eos_ids, pad_token_id=PAD)
    assert torch.equal(out.sequences, expected)
    new = out.sequences[:, prompt_len:]
    ended = (new == eos).any(dim=1)
    assert bool(ended[0]) and not bool(ended.all())
    assert new.shape[1] == MAX_NEW                      # some row ran to the end
    for row in range(4):
        if ended[row]:
            end = int((new[row] == eos).nonzero()[0]) + 1
            assert (new[row, end:] == PAD).all()
            assert (out.logprobs[row, end:] == 0).all()
            assert int(out.flash_stats.emitted[:, row].sum()) == end


# --------------------------------------------------------------------------------------
# 5. Streamer
# --------------------------------------------------------------------------------------

class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.puts: list[torch.Tensor] = []
        self.ends = 0

    def put(self, value):
        assert self.ends == 0, "put() after end()"
        self.puts.append(value.detach().clone())

    def end(self):
        self.ends += 1


@pytest.mark.parametrize("eos", [False, True])
@pytest.mark.parametrize("mode", ["assistant", "self"])
def test_streamer_sees_prompt_then_exactly_the_new_tokens(mode, eos):
    """In assistant mode the streamer gets the prompt first, then exactly the new tokens of
    `sequences`, in order (nothing past an EOS), then one end()."""
    ids, mask = left_pad(PROMPTS[:1])
    kwargs = dict(mode_kwargs(mode), do_sample=True, top_k=0, seed=3)
    if eos:
        free = flash(target(), ids, mask, **kwargs).sequences[0, ids.shape[1]:].tolist()
        kwargs["eos_token_id"] = first_new_occurrence(free, range(2, MAX_NEW - 1))[1]
    streamer = RecordingStreamer()
    out = flash(target(), ids, mask, streamer=streamer, **kwargs)
    assert streamer.ends == 1
    assert torch.equal(streamer.puts[0].reshape(ids.shape), ids)
    streamed = torch.cat([p.reshape(-1) for p in streamer.puts[1:]])
    assert streamed.tolist() == out.sequences[0, ids.shape[1]:].tolist()
    if eos:
        assert out.sequences.shape[1] < ids.shape[1] + MAX_NEW
    if mode == "self":
        assert max(p.numel() for p in streamer.puts[1:]) > 1     # chunks of accepted drafts


# --------------------------------------------------------------------------------------
# 6. num_return_sequences
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["plain", "self"])
def test_num_return_sequences_rows_use_consecutive_seeds(mode):
    """num_return_sequences=3, seed s: prompt b's copies are rows 3b..3b+2 and row r equals
    the single run of its prompt with seed s + r."""
    sampling = dict(do_sample=True, top_k=0, **mode_kwargs(mode))
    ids, mask = left_pad(PROMPTS[:2])
    out = flash(target(), ids, mask, seed=40, num_return_sequences=3, **sampling).sequences
    assert out.shape[0] == 6
    for row in range(6):
        prompt = unpadded(ids, mask, row // 3)
        alone = flash(target(), prompt, seed=40 + row, **sampling).sequences
        assert torch.equal(out[row, :ids.shape[1]], ids[row // 3])
        assert torch.equal(out[row, ids.shape[1]:], alone[0, prompt.shape[1]:]), row
    # The three copies of a prompt are not all the same sample.
    assert not (torch.equal(out[0], out[1]) and torch.equal(out[1], out[2]))


# --------------------------------------------------------------------------------------
# 7. Logprobs
# --------------------------------------------------------------------------------------

@torch.no_grad()
def recomputed_logprobs(model, sequences, mask, prompt_len, **sampling) -> torch.Tensor:
    """float64 log-probability of each new token under the transformed distribution of the
    model's own logits (raw softmax for greedy), from one forward over the finished rows."""
    full_mask = torch.cat([mask, torch.ones_like(sequences[:, prompt_len:])], dim=1)
    logits = model(input_ids=sequences, attention_mask=full_mask,
                   position_ids=positions_of(full_mask)).logits.double()
    new = sequences[:, prompt_len:]
    params = SamplingParams.from_generation_config(GenerationConfig(**sampling), sequences.shape[0])
    result = torch.empty(new.shape, dtype=torch.float64)
    for j in range(new.shape[1]):
        scores = reference.transform_logits(logits[:, prompt_len - 1 + j], params)
        result[:, j] = scores.log_softmax(dim=-1).gather(1, new[:, j:j + 1]).squeeze(1)
    return result


@pytest.mark.parametrize("mode", ["plain", "self", "lookup"])
@pytest.mark.parametrize("setting", ["greedy", "plain", "top_k=20", "top_p=0.9", "min_p=0.1",
                                     "temperature=0.7"])
def test_logprobs_match_float64_recomputation(setting, mode):
    """output_logprobs: float32 [B, new], each the log-probability of the emitted token
    after transformers' warpers, within 1e-4 of a float64 recomputation."""
    sampling = dict(do_sample=False) if setting == "greedy" else SAMPLING_SETTINGS[setting]
    ids, mask = left_pad(PROMPTS)
    out = flash(target(), ids, mask, seed=9, output_logprobs=True, **sampling, **mode_kwargs(mode))
    assert out.logprobs.shape == (4, MAX_NEW) and out.logprobs.dtype == torch.float32
    expected = recomputed_logprobs(target(), out.sequences, mask, ids.shape[1], **sampling)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(out.logprobs.double(), expected, rtol=0, atol=1e-4)


def test_logprobs_absent_unless_requested():
    ids, mask = left_pad(PROMPTS[:1])
    assert flash(target(), ids, mask).logprobs is None


# --------------------------------------------------------------------------------------
# 8. Refusals
# --------------------------------------------------------------------------------------

ERROR_CASES = {
    "unknown sampler": (dict(sampler="fast"), r"`sampler`='fast' is not allowed"),
    "seed without sampler": (dict(sampler=None, seed=1), r"`seed` is a flashspec option"),
    "logprobs without sampler": (dict(sampler=None, output_logprobs=True),
                                 r"`output_logprobs` is a flashspec option"),
    "assistant vocab": (lambda: dict(assistant_model=tiny_draft("llama", vocab_size=VOCAB + 8)),
                        r"`assistant_model` has a vocabulary of 136 tokens but the model has 128"),
    "assistant and lookup": (lambda: dict(assistant_model=draft(), prompt_lookup_num_tokens=3),
                             r"either `assistant_model` or `prompt_lookup_num_tokens`.*not both"),
    "streamer batch": (lambda: dict(streamer=RecordingStreamer(), input_ids=torch.ones(2, 4, dtype=torch.long)),
                       r"`streamer` needs a single sequence with sampler='flash' \(batch 2"),
    "stop_strings without tokenizer": (dict(stop_strings=["ab"]), r"`stop_strings` needs the tokenizer"),
    "num_assistant_tokens=0": (lambda: dict(assistant_model=draft(), num_assistant_tokens=0),
                               r"`num_assistant_tokens` must be an int >= 1, got 0"),
    "bad schedule": (lambda: dict(assistant_model=draft(), num_assistant_tokens_schedule="sometimes"),
                     r"`num_assistant_tokens_schedule`='sometimes' is not supported"),
    "prompt_lookup_num_tokens=0": (dict(prompt_lookup_num_tokens=0),
                                   r"`prompt_lookup_num_tokens` must be an int >= 1, got 0"),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_unsupported_options_are_refused(case):
    """Everything flashspec cannot do exactly raises a ValueError that names it."""
    kwargs, message = ERROR_CASES[case]
    kwargs = dict(kwargs() if callable(kwargs) else kwargs)
    model = kwargs.pop("model", None)
    model = target() if model is None else model
    input_ids = kwargs.pop("input_ids", torch.tensor([[5, 6, 7, 8]]))
    kwargs.setdefault("attention_mask", torch.ones_like(input_ids))
    kwargs.setdefault("sampler", "flash")
    if kwargs["sampler"] is None:
        del kwargs["sampler"]
    with pytest.raises(ValueError, match=message):
        model.generate(input_ids, max_new_tokens=4, **kwargs)


# --------------------------------------------------------------------------------------
# 9. Cohere's logit_scale
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["plain", "self", "lookup"])
def test_cohere_logit_scale_greedy_equals_stock(mode):
    cohere = tiny_model("cohere")
    assert cohere.logit_scale == 0.5
    ids, mask = left_pad(PROMPTS)
    kwargs = dict(assistant_model=cohere, num_assistant_tokens=4) if mode == "self" else mode_kwargs(mode)
    out = flash(cohere, ids, mask, **kwargs)
    assert torch.equal(out.sequences, stock(cohere, ids, mask))


@pytest.mark.parametrize("sampling", [dict(do_sample=True, top_k=0),
                                      dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=0)],
                         ids=["plain", "T=0.7,top_p=0.9"])
def test_cohere_logit_scale_seeded_sampling(sampling):
    """Sampling from Cohere's scaled logits: the seeded run is the documented Gumbel-max draw
    from model(...).logits (which include logit_scale), also with prompt lookup and with
    the model drafting for itself."""
    cohere = tiny_model("cohere")
    ids, mask = left_pad(PROMPTS)
    base = flash(cohere, ids, mask, seed=17, **sampling).sequences
    assert torch.equal(base, oracle_sample(cohere, ids, mask, MAX_NEW, 17, **sampling))
    lookup = flash(cohere, ids, mask, seed=17, prompt_lookup_num_tokens=3, **sampling)
    assert torch.equal(lookup.sequences, base)
    itself = flash(cohere, ids, mask, seed=17, assistant_model=cohere, num_assistant_tokens=4, **sampling)
    assert torch.equal(itself.sequences, base)


# --------------------------------------------------------------------------------------
# 10. Stop strings
# --------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level word tokenizer over the model vocabulary: id 0 is "<pad>", ids
    1..26 the letters, the rest two-letter consonant-vowel tokens; decoding fuses tokens."""
    letters = [chr(ord("a") + i) for i in range(26)]
    pairs = [c + v for c in "bcdfghjklmnpqrstvwxz" for v in "aeiouy"]
    tokens = ["<pad>"] + letters + pairs[:VOCAB - 27]
    assert len(set(tokens)) == VOCAB
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")


def stop_string_for(tokens: list[int], steps) -> tuple[int, str]:
    """(step, stop string) where the stop string is the last character of the token at
    step - 1 and the first of the token at `step`: it completes at `step`, across a token
    boundary. The first `step` in `steps` whose stop string does not occur earlier in the
    generated text is used."""
    tokenizer = tiny_tokenizer()
    for step in steps:
        if tokens[step - 1] == PAD or tokens[step] == PAD:
            continue
        stop = tokenizer.decode([tokens[step - 1]])[-1] + tokenizer.decode([tokens[step]])[0]
        if stop not in tokenizer.decode(tokens[:step]):
            return step, stop
    raise AssertionError(f"no usable stop string in {tokens}")


def test_stop_string_inside_accepted_chunk_ends_like_transformers():
    """Greedy, the target drafting 6 tokens for itself: a stop string that completes at an
    accepted draft ends the row there, exactly where stock greedy with the same
    stop_strings and tokenizer ends it."""
    tokenizer = tiny_tokenizer()
    ids, mask = left_pad(PROMPTS[:1])
    kwargs = dict(assistant_model=target(), num_assistant_tokens=6)
    free = flash(target(), ids, mask, **kwargs).sequences[0, ids.shape[1]:].tolist()
    step, stop = stop_string_for(free, range(1, 6))
    out = flash(target(), ids, mask, stop_strings=[stop], tokenizer=tokenizer, **kwargs)
    expected = stock(target(), ids, mask, stop_strings=[stop], tokenizer=tokenizer)
    assert expected.shape[1] < ids.shape[1] + MAX_NEW            # the stop string fired
    assert torch.equal(out.sequences, expected)
    assert out.sequences[0, ids.shape[1]:].tolist() == free[:step + 1]
    assert ended_inside_accepted_draft(out.flash_stats)


@pytest.mark.parametrize("mode", MODES)
def test_stop_strings_in_a_batch_end_rows_like_transformers(mode):
    """Batch 4 greedy with a stop string that row 0 produces: every mode ends and pads the
    rows as stock greedy does.

    An EOS id that is never generated is set: stock transformers pads the rows that a stop
    string finished only when an EOS criterion exists (without one it keeps appending that
    row's tokens), and real models always have an EOS."""
    tokenizer = tiny_tokenizer()
    ids, mask = left_pad(PROMPTS)
    free = stock_greedy("llama", 4)
    unused_eos = next(t for t in range(1, VOCAB) if not (free == t).any())
    _, stop = stop_string_for(free[0, ids.shape[1]:].tolist(), range(2, 8))
    kwargs = dict(stop_strings=stop, tokenizer=tokenizer, eos_token_id=unused_eos, pad_token_id=PAD)
    out = flash(target(), ids, mask, **kwargs, **mode_kwargs(mode))
    expected = stock(target(), ids, mask, **kwargs)
    assert torch.equal(out.sequences, expected)
    new = expected[:, ids.shape[1]:]
    assert (new[0, -1] == PAD) and (new[1:] != PAD).all()       # row 0 stopped and was padded
