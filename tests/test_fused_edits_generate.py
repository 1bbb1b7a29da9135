"""`generate(sampler="flash")` with the fused logit edits (`flashspec.generation.edits`).

Pinned here: the fused options run fused (no warning, no materialized processing), their
seeded tokens equal the materialized path's (transformers' own processors, forced by a
custom processor that changes nothing), plain = assistant = self-drafting = prompt lookup
with each option and with all of them at once, and each step's codes equal those of plain
decoding at the same position. (tests/test_logits_options.py pins each option against a
float64 reference of transformers' processors, now on the fused path.)
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import pytest
import torch
from hypothesis import given, seed, settings, strategies as st
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation import logits_process as lp

import flashspec
from flashspec.generation.edits import NEVER, EditRules, EditState
from flashspec.params import BAN, PENALIZE

from _models import VOCAB, tiny_model
from test_generate import _quiet_single_threaded  # noqa: F401 - the module's autouse fixture
from test_logits_options import EOS, PROMPTS, flash, left_pad, target

SEED = 5
SAMPLING = dict(do_sample=True, temperature=0.9, top_k=0)
QWEN25_INSTRUCT = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8,
                       repetition_penalty=1.05)
FUSED = {
    "repetition_penalty": dict(repetition_penalty=1.8),
    "suppress_tokens": dict(suppress_tokens=[101, 53, 65]),
    "begin_suppress_tokens": dict(begin_suppress_tokens=[101, 53, 65, 7]),
    "bad_words_ids": dict(bad_words_ids=[[101], [62], [38]]),
    "multi-token bad_words_ids": dict(bad_words_ids=[[101], [92, 62], [31, 38], [5, 6, 7, 8]]),
    "min_new_tokens": dict(min_new_tokens=8, eos_token_id=EOS),
    "min_length": dict(min_length=18, eos_token_id=EOS),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "no_repeat_ngram_size 1": dict(no_repeat_ngram_size=1),
    "forced_eos_token_id": dict(forced_eos_token_id=[77]),
    "all": dict(repetition_penalty=1.3, suppress_tokens=[53], bad_words_ids=[[62], [38], [9, 10]],
                begin_suppress_tokens=[7], min_new_tokens=6, eos_token_id=[EOS, 4],
                no_repeat_ngram_size=3, forced_eos_token_id=77),
    "qwen2.5-instruct": QWEN25_INSTRUCT,
}


class Unchanged(LogitsProcessor):
    """A custom processor that changes nothing: the call then runs on the materialized path,
    with transformers' own processors for every other option."""

    def __call__(self, input_ids, scores):
        return scores


def sampling_of(option):
    return {} if option == "qwen2.5-instruct" else SAMPLING


@functools.lru_cache(maxsize=None)
def run(option: str, mode: str = "plain", materialized: bool = False) -> torch.Tensor:
    ids, mask = left_pad(PROMPTS)
    extra = dict(logits_processor=LogitsProcessorList([Unchanged()])) if materialized else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "sampler='flash' runs this call")
        return flash(target(), ids, mask, mode, seed=SEED, **sampling_of(option), **FUSED[option],
                     **extra).sequences


@pytest.mark.parametrize("option", list(FUSED))
def test_fused_options_plan_no_materialized_path(option):
    ids, mask = left_pad(PROMPTS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = flashspec.generation.plan.plan_generation(
            target(), ids, None, attention_mask=mask, max_new_tokens=12, **sampling_of(option),
            **FUSED[option])
    assert plan.processing is None and plan.edits is not None


@pytest.mark.parametrize("option", list(FUSED))
def test_fused_tokens_equal_the_materialized_path(option):
    fused = run(option)
    assert torch.equal(fused, run(option, materialized=True)), (
        fused[:, len(PROMPTS[0]):].tolist(), run(option, materialized=True)[:, len(PROMPTS[0]):].tolist())


@pytest.mark.parametrize("option", list(FUSED))
def test_fused_options_change_the_tokens(option):
    """The option bites on these prompts (the tests above compare what it decides)."""
    ids, mask = left_pad(PROMPTS)
    kept = {k: v for k, v in FUSED[option].items() if k in ("eos_token_id",)}
    sampling = QWEN25_INSTRUCT | dict(repetition_penalty=1.0) if option == "qwen2.5-instruct" \
        else SAMPLING
    without = flash(target(), ids, mask, seed=SEED, **sampling, **kept).sequences
    assert not torch.equal(run(option), without)


@pytest.mark.parametrize("mode", ["assistant", "self", "lookup"])
@pytest.mark.parametrize("option", list(FUSED))
def test_speculation_invariance(option, mode):
    assert torch.equal(run(option, mode), run(option))


@pytest.mark.parametrize("num_drafts", [1, 3, 6])
def test_all_options_any_draft_length(num_drafts):
    ids, mask = left_pad(PROMPTS)
    out = flash(target(), ids, mask, seed=SEED, **SAMPLING, **FUSED["all"],
                assistant_model=target(), num_assistant_tokens=num_drafts)
    assert torch.equal(out.sequences, run("all"))
    assert int(out.flash_stats.accepted.sum()) > 0


def test_greedy_with_every_fused_option_equals_stock():
    ids, mask = left_pad(PROMPTS)
    kwargs = dict(FUSED["all"], max_new_tokens=12, do_sample=False)
    expected = target().generate(ids, attention_mask=mask, **kwargs)
    for mode in ("plain", "self", "lookup"):
        out = flash(target(), ids, mask, mode, **kwargs)
        assert torch.equal(out.sequences, expected), mode


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_greedy_no_repeat_ngram_equals_stock(size):
    """Greedy decoding repeats itself, so every n-gram size bites: stock's tokens, plain and
    with drafts (prompt lookup drafts the repeats that the n-grams ban)."""
    ids, mask = left_pad(PROMPTS)
    kwargs = dict(no_repeat_ngram_size=size, max_new_tokens=16, do_sample=False)
    expected = target().generate(ids, attention_mask=mask, **kwargs)
    without = target().generate(ids, attention_mask=mask, **dict(kwargs, no_repeat_ngram_size=None))
    assert not torch.equal(expected, without)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "sampler='flash' runs this call")
        for mode in ("plain", "self", "lookup"):
            assert torch.equal(flash(target(), ids, mask, mode, **kwargs).sequences, expected), mode


def test_forced_bos_for_one_token_prompts():
    """Transformers forces the BOS only where its input_ids hold one token (one-token
    prompts, and begin_suppress_tokens then bites one position later): fused, greedy
    equals stock, sampled tokens equal the materialized path's and stay the same with
    drafts."""
    ids = torch.tensor([[5], [9]])
    kwargs = dict(forced_bos_token_id=17, begin_suppress_tokens=[26, 92], max_new_tokens=6)
    greedy = dict(kwargs, do_sample=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "sampler='flash' runs this call")
        flashed = target().generate(ids, sampler="flash", **greedy)
        assert torch.equal(flashed, target().generate(ids, **greedy))
        assert (flashed[:, 1] == 17).all() and not torch.isin(flashed[:, 2], torch.tensor([26, 92])).any()
        plain = target().generate(ids, sampler="flash", seed=SEED, **SAMPLING, **kwargs)
        for speculative in (dict(assistant_model=target(), num_assistant_tokens=3),
                            dict(prompt_lookup_num_tokens=2)):
            assert torch.equal(target().generate(ids, sampler="flash", seed=SEED, **SAMPLING,
                                                 **kwargs, **speculative), plain)
    assert (plain[:, 1] == 17).all()
    with pytest.warns(UserWarning, match="`logits_processor` \\(Unchanged\\)"):
        materialized = target().generate(ids, sampler="flash", seed=SEED, **SAMPLING, **kwargs,
                                         logits_processor=LogitsProcessorList([Unchanged()]))
    assert torch.equal(plain, materialized)


def test_qwen25_instruct_generation_config_runs_fused():
    """The model's own generation_config (Qwen2.5-Instruct's values), no argument: no
    warning, the materialized path's tokens, and the same with speculation."""
    model = tiny_model("qwen3")
    for name, value in dict(QWEN25_INSTRUCT, eos_token_id=[EOS, 4], pad_token_id=0).items():
        setattr(model.generation_config, name, value)
    ids = torch.tensor([PROMPTS[1]])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "sampler='flash' runs this call")
        plain = model.generate(ids, sampler="flash", seed=SEED, min_new_tokens=10)
        for speculative in (dict(assistant_model=model, num_assistant_tokens=4),
                            dict(prompt_lookup_num_tokens=3)):
            assert torch.equal(model.generate(ids, sampler="flash", seed=SEED, min_new_tokens=10,
                                              **speculative), plain)
    with pytest.warns(UserWarning, match="`logits_processor` \\(Unchanged\\)"):
        materialized = model.generate(ids, sampler="flash", seed=SEED, min_new_tokens=10,
                                      logits_processor=LogitsProcessorList([Unchanged()]))
    assert torch.equal(plain, materialized)
    assert plain.shape[1] > ids.shape[1] + 10


def test_unfused_options_keep_the_materialized_path_and_name_the_fused_ones():
    ids, mask = left_pad(PROMPTS[:1])
    for kwargs, named in ((dict(bad_words_ids=[[92, 62]], encoder_repetition_penalty=1.5),
                           "`bad_words_ids`=\\[\\[92, 62\\]\\]"),
                          (dict(repetition_penalty=1.2, forced_eos_token_id=[7, 8]),
                           "`repetition_penalty`=1.2")):
        with pytest.warns(UserWarning, match=named):
            plan = flashspec.generation.plan.plan_generation(
                target(), ids, None, attention_mask=mask, max_new_tokens=2, **kwargs)
        assert plan.processing is not None and plan.edits is None


def test_rules_from_transformers_processors():
    """Lengths as transformers counts them: the padded prompt's width plus the generated
    tokens (prompt width 10 here); ids outside the vocabulary dropped as torch.isin drops
    them."""
    eos = torch.tensor([EOS, 4])
    processors = [lp.RepetitionPenaltyLogitsProcessor(1.5), lp.NoBadWordsLogitsProcessor([[8]], eos),
                  lp.MinLengthLogitsProcessor(14, eos), lp.MinNewTokensLengthLogitsProcessor(10, 2, eos),
                  lp.SuppressTokensLogitsProcessor([9]),
                  lp.SuppressTokensAtBeginLogitsProcessor([3, VOCAB + 5], 10),
                  lp.TemperatureLogitsWarper(0.5), lp.TopKLogitsWarper(4)]
    rules = EditRules.from_processors(processors, 10, VOCAB, 6)
    assert rules == EditRules(penalty=1.5, banned=(8, 9), begin_banned=(3,), begin_count=0,
                              eos=(4, EOS), min_count=4)
    assert EditRules.from_processors(processors + [lp.NoRepeatNGramLogitsProcessor(2)], 10,
                                     VOCAB, 6) == dataclasses.replace(rules, ngram=2,
                                                                     context_columns=16)
    assert EditRules.from_processors([lp.NoBadWordsLogitsProcessor([[8, VOCAB]], eos)], 10,
                                     VOCAB, 6) is None
    words = EditRules.from_processors([lp.NoBadWordsLogitsProcessor([[8, 9], [4], [7]], eos)], 10,
                                      VOCAB, 6)
    assert words == EditRules(banned=(7,), words=((8, 9),))      # [4] is an EOS: dropped
    assert EditRules.from_processors([lp.NoRepeatNGramLogitsProcessor(2),
                                      lp.NoRepeatNGramLogitsProcessor(3)], 10, VOCAB, 6) is None


def test_forcing_rules_from_transformers_processors():
    """A forced BOS only for a one-token prompt, a forced EOS at max_length - 1; a forced
    token that a later processor bans there is banned too (every token is: stock's row is
    all -inf), one that an earlier processor bans is not (the forcing undoes it); several
    forced EOS ids (a uniform draw in transformers), ids outside the vocabulary (an error
    there) and context-dependent bans after the forcing stay on the materialized path."""
    def forced(processors, width=10):
        rules = EditRules.from_processors(processors, width, VOCAB, 6)
        return None if rules is None else rules.forced

    bos, eos = lp.ForcedBOSTokenLogitsProcessor(7), lp.ForcedEOSTokenLogitsProcessor(16, 9)
    assert forced([bos], width=1) == ((0, 7, False),)
    assert forced([bos]) == ()
    assert forced([eos]) == ((5, 9, False),)
    assert forced([lp.ForcedEOSTokenLogitsProcessor(16, [9, 9])]) == ((5, 9, False),)
    assert forced([lp.ForcedEOSTokenLogitsProcessor(16.5, 9)]) == ()
    assert forced([lp.ForcedEOSTokenLogitsProcessor(9, 9)]) == ()      # before the prompt's end
    assert forced([lp.NoBadWordsLogitsProcessor([[9]], None), lp.MinLengthLogitsProcessor(18, [9]),
                   eos]) == ((5, 9, False),)
    assert forced([eos, lp.SuppressTokensLogitsProcessor([9])]) == ((5, 9, True),)
    assert forced([eos, lp.SuppressTokensAtBeginLogitsProcessor([9], 15)]) == ((5, 9, True),)
    assert forced([eos, lp.SuppressTokensAtBeginLogitsProcessor([9], 14)]) == ((5, 9, False),)
    assert forced([bos, lp.ForcedEOSTokenLogitsProcessor(2, 3)], width=1) == ((0, 7, False),
                                                                              (0, 3, False))
    for unfused in ([lp.ForcedEOSTokenLogitsProcessor(16, [9, 4])],
                    [lp.ForcedEOSTokenLogitsProcessor(16, VOCAB)],
                    [lp.ForcedBOSTokenLogitsProcessor(-1)],
                    [eos, lp.NoRepeatNGramLogitsProcessor(2)],
                    [eos, lp.NoBadWordsLogitsProcessor([[8, 9]], None)],
                    [bos, bos, eos]):
        assert forced(unfused, width=1) is None, unfused


@seed(0)
@settings(max_examples=25, deadline=None, derandomize=True)
@given(batch=st.integers(1, 3), num_drafts=st.integers(1, 5), penalized=st.booleans(),
       positional=st.booleans(), words=st.booleans(), ngram=st.sampled_from([0, 1, 2, 3]),
       setting=st.integers(0, 10_000))
def test_verify_codes_are_plain_decodings(batch, num_drafts, penalized, positional, words,
                                          ngram, setting):
    """Position j of a verification step has the codes a plain step has after the drafts
    before j were emitted: the same state, absorbed one token at a time (with and without
    position bans, forced tokens, words and n-grams: without all, a plain step's codes are
    the base codes)."""
    g = torch.Generator().manual_seed(setting)
    vocab = 40
    begin_count, min_count, forced_count = (int(torch.randint(0, 4, (1,), generator=g)),
                                            int(torch.randint(0, 6, (1,), generator=g)),
                                            int(torch.randint(0, 6, (1,), generator=g)))
    rules = EditRules(penalty=1.3 if penalized else 1.0, banned=(3, 5), begin_banned=(7, 8),
                      begin_count=begin_count if positional else NEVER, eos=(1,),
                      min_count=min_count if positional else 0,
                      words=((2, 4), (6, 2, 9), (1, 1, 1, 30)) if words else (),
                      ngram=ngram, context_columns=6 + 5 + num_drafts,
                      forced=((forced_count, 2, False), (begin_count, 7, True)) if positional
                      else ())
    # Tokens mostly from a few ids, so that the bad words' prefixes and n-grams come up.
    prompts = torch.randint(0, 10, (batch, 6), generator=g)
    drafts = torch.randint(0, 10, (batch, num_drafts), generator=g)
    lengths = torch.randint(0, num_drafts + 1, (batch,), generator=g)
    drafts = torch.where(torch.arange(num_drafts)[None] < lengths[:, None], drafts, -1)
    generated = torch.randint(0, 5, (batch,), generator=g)
    emitted = torch.randint(0, 10, (batch, 4), generator=g)
    state = EditState(batch, vocab, torch.device("cpu"))
    state.load(rules, prompts)
    plain = EditState(batch, vocab, torch.device("cpu"))
    plain.load(rules, prompts)
    for each in (state, plain):     # the generated tokens, not all of them written yet
        each.absorb(emitted, torch.arange(4)[None] < generated[:, None])
    codes = state.verify_edits(generated, drafts).codes
    for j in range(num_drafts + 1):
        expected = plain.sample_edits(generated + j).codes.clone()
        used = lengths >= j
        assert torch.equal(codes[used, j], expected[used]), j
        if j < num_drafts:
            plain.absorb(drafts[:, j:j + 1], (drafts[:, j:j + 1] >= 0))
    assert not (codes == PENALIZE).any() or penalized
    assert (codes[..., [3, 5]] == BAN).all() and (codes.max() <= BAN)


def test_completion_applies_the_step_edits():
    """`complete_sample` / `complete_verify` (rows a fused step flagged) apply the step's
    edits of their rows: the tokens of the whole batch's call at those rows."""
    from flashspec import SamplingParams, sampling
    from flashspec.generation import samplers
    from flashspec.params import LogitEdits

    g = torch.Generator().manual_seed(4)
    batch, vocab, dim, num_drafts = 4, 50, 8, 2
    weight = torch.randn(vocab, dim, generator=g)
    hidden = torch.randn(batch, num_drafts + 1, dim, generator=g) * 3
    params = SamplingParams.create(batch, temperature=0.8, seed=2)
    positions = torch.arange(batch) * 7
    codes = torch.randint(0, 3, (batch, num_drafts + 1, vocab), generator=g).to(torch.uint8)
    edits = LogitEdits(codes, torch.full((batch,), 1.5, dtype=torch.float64))
    drafts = torch.randint(0, vocab, (batch, num_drafts), generator=g)
    sampler = samplers.MaterializedSampler(weight, params)
    rows = torch.tensor([3, 1])
    unedited = sampling.sample(hidden[:, 0], weight, params, positions).tokens
    codes[torch.arange(batch), 0, unedited] = BAN          # the edits bite
    sample_edits = LogitEdits(codes[:, 0], edits.penalty)
    tokens, _ = samplers.complete_sample(sampler, hidden[:, 0], rows, positions, edits=sample_edits)
    whole = sampling.sample(hidden[:, 0], weight, params, positions, edits=sample_edits)
    assert torch.equal(tokens, whole.tokens[rows]) and not (tokens == unedited[rows]).any()
    num_accepted, tokens, _, _ = samplers.complete_verify(sampler, hidden, drafts, rows, positions,
                                                          edits=edits)
    whole = sampling.verify(hidden, weight, drafts, params, positions, edits=edits)
    assert torch.equal(tokens, whole.tokens[rows]) and torch.equal(num_accepted, whole.num_accepted[rows])


# --------------------------------------------------------------------------------------
# CUDA: the engine's fused path (CUDA graphs, the kernels with edit codes)
# --------------------------------------------------------------------------------------

GPU_EDITS = dict(repetition_penalty=1.3, bad_words_ids=[[7], [30, 31]], suppress_tokens=[9],
                 min_new_tokens=6, eos_token_id=[3, 4], pad_token_id=0)


def _assert_same_or_edited_near_tie(ids, mask, got, want, sampling, seeds):
    """Rows equal, or the first difference is a near-tie of the float64 target's logits
    after transformers' processors for `GPU_EDITS` (stock's input_ids: the padded prompt
    and the tokens before)."""
    from flashspec import rng
    from flashspec.bench.statistics import is_near_tie
    from test_generate_gpu import VOCAB as GPU_VOCAB, _reference

    eos = torch.tensor(GPU_EDITS["eos_token_id"])
    width = ids.shape[1]
    processors = LogitsProcessorList([
        lp.RepetitionPenaltyLogitsProcessor(GPU_EDITS["repetition_penalty"]),
        lp.NoBadWordsLogitsProcessor(GPU_EDITS["bad_words_ids"], eos),
        lp.MinNewTokensLengthLogitsProcessor(width, GPU_EDITS["min_new_tokens"], eos),
        lp.SuppressTokensLogitsProcessor(GPU_EDITS["suppress_tokens"])])
    for row in range(len(ids)):
        a, b = got[row].cpu(), want[row].cpu()
        if torch.equal(a, b):
            continue
        k = int((a != b).nonzero()[0])
        real = a[:k][mask[row].cpu().bool().tolist() + [True] * (k - width)]
        with torch.no_grad():
            logits64 = _reference()(real[None]).logits[0, -1].double()
        edited = processors(a[None, :k], logits64[None])[0]
        noise = rng.gumbel(torch.tensor(int(seeds[row])), torch.tensor(len(real)),
                           torch.arange(GPU_VOCAB))
        assert is_near_tie(edited, True, sampling["temperature"], sampling["top_k"],
                           sampling["top_p"], 0.0, noise.double(), int(a[k]), int(b[k])), \
            f"row {row} differs at new token {k - width}: {int(a[k])} vs {int(b[k])}"


@pytest.mark.gpu
def test_fused_edits_on_cuda_equal_the_cpu_engine_and_survive_switching():
    """On CUDA the call runs the kernels with codes in captured graphs: plain, assistant
    and prompt lookup equal the CPU engine (the reference with the same codes), up to
    near-ties of the edited float64 logits; a call without edits in between (other graphs:
    the slot's buffers' generation moves) leaves the next call with edits unchanged."""
    from flashspec.generation.engine import cached_engine
    from test_generate_gpu import MODES as GPU_MODES, _cpu_pair, _pair, _prompts, _run

    model, draft = _pair(torch.float32)
    ids, mask = _prompts("cuda")
    seeds = torch.tensor([41, 42, 43, 44])
    sampling = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "sampler='flash' runs this call")
        on_cpu = _run(*_cpu_pair(), ids.cpu(), mask.cpu(), GPU_MODES["plain"], seed=seeds,
                      **sampling, **GPU_EDITS)
        for mode in GPU_MODES.values():
            graphed = _run(model, draft, ids, mask, mode, seed=seeds, **sampling, **GPU_EDITS)
            _assert_same_or_edited_near_tie(ids, mask, graphed, on_cpu, sampling, seeds)
        assert cached_engine(model.get_decoder()).graphs
        plain = _run(model, draft, ids, mask, GPU_MODES["plain"], seed=seeds, **sampling)
        assert not torch.equal(plain, graphed)
        again = _run(model, draft, ids, mask, GPU_MODES["prompt_lookup"], seed=seeds, **sampling,
                     **GPU_EDITS)
        assert torch.equal(again, graphed)


def test_slot_edits_key_and_generation_follow_the_edits():
    """The slot's `edits_key` (for the engine's graph key) follows what the steps run: edits
    on or off, position bans, forced positions, the n-gram size, the bad words' and (with
    n-grams) the n-gram context's buffer shapes. Its buffers' generation moves only when the
    bad words need other buffers or the n-gram context a larger one (it never shrinks):
    graphs with and without edits, with and without position bans or n-grams, live side by
    side (a server alternating calls with and without a repetition penalty, or with and
    without n-grams, captures each step once)."""
    from flashspec.generation.engine import cached_engine

    ids, mask = left_pad(PROMPTS)
    rows = len(PROMPTS)
    words = [[7, 8], [9, 10, 11]]
    calls = [(dict(repetition_penalty=1.2), (False, False, 0, (0, 1), None)),
             (dict(repetition_penalty=1.5, bad_words_ids=[[7]]), (False, False, 0, (0, 1), None)),
             (dict(min_new_tokens=3, eos_token_id=EOS), (True, False, 0, (0, 1), None)),
             (dict(forced_eos_token_id=7), (True, True, 0, (0, 1), None)),
             (dict(no_repeat_ngram_size=1), (False, False, 0, (0, 1), None)),
             (dict(bad_words_ids=words), (False, False, 0, (2, 3), None)),
             (dict(bad_words_ids=words, no_repeat_ngram_size=2),
              (False, False, 2, (2, 3), (rows, 256))),
             (dict(bad_words_ids=words, no_repeat_ngram_size=4),
              (False, False, 4, (2, 3), (rows, 256))),
             (dict(repetition_penalty=1.2), (False, False, 0, (0, 1), None)),
             (dict(no_repeat_ngram_size=3), (False, False, 3, (0, 1), (rows, 256))),
             ({}, None)]
    moves, grew = [], []
    for kwargs, key in calls:
        engine = cached_engine(target().get_decoder())
        before = [s for s in (engine.slots.values() if engine else ()) if s.batch_size == rows]
        state = before[0].edit_state if before else None
        generation = before[0].generation if state is not None else None
        columns = state.context.shape[1] if state is not None else 1
        flash(target(), ids, mask, seed=SEED, max_new_tokens=2, **SAMPLING, **kwargs)
        slot, = [s for s in cached_engine(target().get_decoder()).slots.values()
                 if s.batch_size == rows]
        edits_key = slot.edits_key()
        assert (edits_key and edits_key[:5]) == key, kwargs
        assert edits_key is None or edits_key[5:] == (False, (), False)  # no additive edits
        moves.append(0 if generation is None else slot.generation - generation)
        grew.append(slot.edit_state.context.shape[1] > columns)
    # Words' buffers: (0, 1) -> (2, 3) at call 6 and back at call 9; the n-gram context grows
    # at call 7 (unless an earlier test grew it), then never again, and never shrinks.
    assert moves[:5] == [0] * 5 and moves[5] == 1 and moves[6] == int(grew[6]) and moves[7] == 0
    assert moves[8] == 1 and moves[9] == 0 and moves[10] == 0
    assert not any(grew[:6] + grew[7:])


def test_rows_whose_edits_ban_every_token_are_refused_when_sampled():
    """Every token an EOS id and a minimum length; every token completing a repeated n-gram
    (n = 1: each token in the prompt) or suppressed (n = 2: the prompt's last token 9 came
    before each of tokens 0-7 and the others are suppressed); a forced EOS that
    begin_suppress_tokens bans: a sampled row has nothing left to draw. Stock's sampling
    fails (torch.multinomial); flashspec raises a ValueError saying so, with and without
    drafts, rather than drawing a banned token. A greedy row takes token 0, as stock's
    argmax of a row of -inf does."""
    model = tiny_model("llama")
    every = list(range(VOCAB))
    after_nine = [9] + [token for pair in zip(range(8), [9] * 8) for token in pair]
    cases = [([5, 6, 7], dict(min_new_tokens=2, eos_token_id=every)),
             (every, dict(no_repeat_ngram_size=1)),
             (after_nine, dict(no_repeat_ngram_size=2, suppress_tokens=every[8:])),
             ([5, 6, 7], dict(forced_eos_token_id=7, begin_suppress_tokens=[7], max_new_tokens=1))]
    for prompt, edits in cases:
        ids = torch.tensor([prompt])
        kwargs = dict(max_new_tokens=4, pad_token_id=0) | edits
        with pytest.raises(RuntimeError):
            model.generate(ids, do_sample=True, **kwargs)
        for drafts in ({}, dict(prompt_lookup_num_tokens=2)):
            with pytest.raises(ValueError, match="leave no token to sample for row 0"):
                model.generate(ids, sampler="flash", do_sample=True, seed=0, **drafts, **kwargs)
        greedy = dict(kwargs, do_sample=False)
        assert torch.equal(model.generate(ids, sampler="flash", **greedy),
                           model.generate(ids, **greedy)), edits


def test_a_temperature_past_what_a_finite_ban_holds_is_refused():
    """A ban is a finite logit (`params.BANNED_LOGIT`): above temperature 2**40 it could win a
    race, so such a call is refused by name (stock samples uniformly over the allowed tokens
    there); at 2**40 banned tokens are still never drawn."""
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7]])
    kwargs = dict(sampler="flash", do_sample=True, max_new_tokens=3, pad_token_id=0,
                  suppress_tokens=list(range(64)))
    with pytest.raises(ValueError, match=r"`temperature`=1e\+19 \(set in the call\) is not "
                                         "allowed with banned tokens"):
        model.generate(ids, temperature=1e19, **kwargs)
    many = dict(kwargs, max_new_tokens=8)        # 128 draws, each banned with odds 1/2 if broken
    out = model.generate(ids.repeat(16, 1), temperature=2.0**40, seed=torch.arange(16), **many)
    assert (out[:, 3:] >= 64).all()
