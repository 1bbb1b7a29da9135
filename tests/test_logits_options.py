"""Every logits option stock `generate` accepts runs with sampler="flash" (issue 30, CPU part).

What is pinned here:

1. For each option, seeded tokens equal a float64 reference that applies transformers' own
   `LogitsProcessor` for that option (built here, not through the engine's plan) to the
   float64 logits of the same context, then draws with the same Philox noise; where the two
   differ the float64 scores must be a near-tie (perturbed scores within 1e-4 relative),
   never a blanket tolerance.
2. Speculation invariance: the seeded tokens of a plain run equal those of an assistant,
   of the target drafting for itself (most drafts accepted, so drafted positions' contexts
   matter) and of prompt lookup, with each option and with several at once; with a custom
   processor that reads the whole context too.
3. Greedy equals stock transformers token for token (float32 tiny models) for the
   deterministic options, plain and speculative; output_scores / output_logits equal stock's.
4. A model whose generation_config carries Qwen2.5-Instruct's values and a Gemma-2-style
   model with final_logit_softcapping (and a model with an LM-head bias) run
   ``generate(ids, sampler="flash")`` with no other argument, plain and speculative.
5. One warning names what forced the materialized path and where its value came from;
   beam search defers to stock with a warning; flashspec's own options are refused there.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, WatermarkingConfig
from transformers.generation import logits_process as lp

import flashspec
from flashspec import rng
from flashspec.params import row_seeds

from _models import VOCAB, tiny_draft, tiny_model
from test_generate import _quiet_single_threaded  # noqa: F401 - the module's autouse fixture

MAX_NEW = 12
SEED = 11
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9], [53, 53, 20, 21, 53]]
SAMPLING = dict(do_sample=True, top_k=0, temperature=0.9)
NEAR_TIE = 1e-4


# The materialized path's warning has its own tests.
pytestmark = pytest.mark.filterwarnings("ignore:sampler='flash' runs this call")


@functools.lru_cache(maxsize=None)
def target():
    return tiny_model("llama")


@functools.lru_cache(maxsize=None)
def target64():
    return copy.deepcopy(tiny_model("llama", wrap=False)).double()


@functools.lru_cache(maxsize=None)
def draft():
    return tiny_draft("llama")


def left_pad(prompts):
    length = max(map(len, prompts))
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt):] = torch.tensor(prompt)
        mask[row, length - len(prompt):] = 1
    return ids, mask


def positions_of(mask):
    return (mask.long().cumsum(dim=1) - 1).clamp_min(0)


MODES = {
    "plain": {},
    "assistant": lambda: dict(assistant_model=draft(), num_assistant_tokens=3),
    "self": lambda: dict(assistant_model=target(), num_assistant_tokens=4),
    "lookup": dict(prompt_lookup_num_tokens=3),
}


def flash(model, ids, mask, mode="plain", **kwargs):
    spec = MODES[mode]
    kwargs = {"max_new_tokens": MAX_NEW, **(spec() if callable(spec) else spec), **kwargs}
    return model.generate(ids, attention_mask=mask, sampler="flash", return_dict_in_generate=True,
                          **kwargs)


# --------------------------------------------------------------------------------------
# The options, each with transformers' processor for the float64 reference
# --------------------------------------------------------------------------------------

EOS = 101        # an id the tiny model emits early in the free runs below
# option -> (generate kwargs, processors(prompt width, eos) for the reference, sampled?)
OPTIONS = {
    "repetition_penalty": (dict(repetition_penalty=1.8),
                           lambda w, ids: [lp.RepetitionPenaltyLogitsProcessor(1.8)]),
    "encoder_repetition_penalty": (
        dict(encoder_repetition_penalty=3.0),
        lambda w, ids: [lp.EncoderRepetitionPenaltyLogitsProcessor(3.0, ids)]),
    "no_repeat_ngram_size": (dict(no_repeat_ngram_size=2),
                             lambda w, ids: [lp.NoRepeatNGramLogitsProcessor(2)]),
    "encoder_no_repeat_ngram_size": (
        dict(encoder_no_repeat_ngram_size=2),
        lambda w, ids: [lp.EncoderNoRepeatNGramLogitsProcessor(2, ids)]),
    "bad_words_ids": (dict(bad_words_ids=[[101], [92, 62], [31, 38]]),
                      lambda w, ids: [lp.NoBadWordsLogitsProcessor([[101], [92, 62], [31, 38]], None)]),
    "sequence_bias": (dict(sequence_bias=[[[101], -4.0], [[35, 44], 5.0], [[7], 3.0]]),
                      lambda w, ids: [lp.SequenceBiasLogitsProcessor([[[101], -4.0], [[35, 44], 5.0],
                                                                 [[7], 3.0]])]),
    "suppress_tokens": (dict(suppress_tokens=[101, 53, 65]),
                        lambda w, ids: [lp.SuppressTokensLogitsProcessor([101, 53, 65])]),
    "begin_suppress_tokens": (dict(begin_suppress_tokens=[101, 53, 65]),
                              lambda w, ids: [lp.SuppressTokensAtBeginLogitsProcessor([101, 53, 65], w)]),
    "min_new_tokens": (dict(min_new_tokens=8, eos_token_id=EOS),
                       lambda w, ids: [lp.MinNewTokensLengthLogitsProcessor(w, 8, torch.tensor([EOS]))]),
    "min_length": (dict(min_length=18, eos_token_id=EOS),
                   lambda w, ids: [lp.MinLengthLogitsProcessor(18, torch.tensor([EOS]))]),
    "exponential_decay_length_penalty": (
        dict(exponential_decay_length_penalty=(2, 1.6), eos_token_id=EOS),
        lambda w, ids: [lp.ExponentialDecayLengthPenalty((2, 1.6), torch.tensor([EOS]), w)]),
    "forced_eos_token_id": (dict(forced_eos_token_id=7, max_new_tokens=4),
                            lambda w, ids: [lp.ForcedEOSTokenLogitsProcessor(w + 4, 7)]),
    "renormalize_logits": (dict(renormalize_logits=True), lambda w, ids: [lp.LogitNormalization()]),
    "watermarking_config": (dict(watermarking_config=WatermarkingConfig(bias=4.0)),
                            lambda w, ids: [WatermarkingConfig(bias=4.0).construct_processor(VOCAB, "cpu")]),
}
# Warpers transformers applies after temperature, only when sampling.
WARPERS = {
    "typical_p": (dict(typical_p=0.6), lambda: [lp.TypicalLogitsWarper(0.6)]),
    "epsilon_cutoff": (dict(epsilon_cutoff=0.02), lambda: [lp.EpsilonLogitsWarper(0.02)]),
    "eta_cutoff": (dict(eta_cutoff=0.02), lambda: [lp.EtaLogitsWarper(0.02)]),
    "top_h": (dict(top_h=0.6), lambda: [lp.TopHLogitsWarper(top_h=0.6)]),
}


# Applied after temperature and the warpers, as stock orders them.
LAST = ("watermarking_config", "renormalize_logits")


def reference_processors(option: str, ids: torch.Tensor, sampled: bool) -> LogitsProcessorList:
    """transformers' processors of `option` and, when sampling, temperature and its warpers,
    in stock's order (processors, temperature, the unfused warpers, watermarking,
    renormalization)."""
    width = ids.shape[1]
    edits = OPTIONS[option][1](width, ids) if option in OPTIONS else []
    processors = [] if option in LAST else edits
    if sampled:
        processors.append(lp.TemperatureLogitsWarper(SAMPLING["temperature"]))
        if option in WARPERS:
            processors += WARPERS[option][1]()
    if option in LAST:
        processors += edits
    return LogitsProcessorList(processors)


def option_kwargs(option: str) -> dict:
    return dict((OPTIONS.get(option) or WARPERS[option])[0])


@torch.no_grad()
def assert_reference_tokens(sequences, ids, mask, processors, seeds, sampled: bool):
    """Teacher-forced along `sequences`: each new token is the float64 reference's draw
    (transformers' `processors` on float64 logits of the same context, Gumbel-max with the
    row's Philox noise at its sequence index), or a near-tie of it. Returns the number of
    near-ties (rows after their EOS are padding and not checked)."""
    width = ids.shape[1]
    full_mask = torch.cat([mask, torch.ones_like(sequences[:, width:])], dim=1)
    logits = target64()(input_ids=sequences, attention_mask=full_mask,
                        position_ids=positions_of(full_mask)).logits
    vocab = torch.arange(VOCAB)
    near_ties = 0
    ended = torch.zeros(sequences.shape[0], dtype=torch.bool)
    for t in range(sequences.shape[1] - width):
        scores = processors(sequences[:, : width + t], logits[:, width + t - 1].clone())
        index = mask.sum(dim=1) + t
        noise = rng.gumbel(seeds[:, None], index[:, None], vocab[None, :], dtype=torch.float64)
        perturbed = scores + noise if sampled else scores
        want = perturbed.argmax(dim=-1)
        got = sequences[:, width + t]
        for row in torch.nonzero((got != want) & ~ended).flatten().tolist():
            a, b = float(perturbed[row, got[row]]), float(perturbed[row, want[row]])
            assert abs(a - b) <= NEAR_TIE * (1 + max(abs(a), abs(b))), (
                f"row {row}, new token {t}: flash {int(got[row])} ({a}), float64 reference "
                f"{int(want[row])} ({b}): not a near-tie")
            near_ties += 1
        ended |= got == EOS
    assert near_ties <= 1, f"{near_ties} near-ties"
    return near_ties


ALL_OPTIONS = list(OPTIONS) + list(WARPERS)


@functools.lru_cache(maxsize=None)
def plain_run(option: str, sampled: bool) -> torch.Tensor:
    ids, mask = left_pad(PROMPTS)
    sampling = SAMPLING if sampled else dict(do_sample=False)
    return flash(target(), ids, mask, seed=SEED, **sampling, **option_kwargs(option)).sequences


# --------------------------------------------------------------------------------------
# 1. Each option: the float64 reference of transformers' processor, same noise
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("option", ALL_OPTIONS)
def test_seeded_tokens_equal_the_float64_reference(option):
    ids, mask = left_pad(PROMPTS)
    sequences = plain_run(option, True)
    seeds = row_seeds(SEED, len(PROMPTS))
    assert_reference_tokens(sequences, ids, mask, reference_processors(option, ids, True), seeds, True)


@pytest.mark.parametrize("option", ALL_OPTIONS)
def test_each_option_changes_the_tokens(option):
    """The options bite on these prompts: without them the seeded run differs (so the
    tests above and below compare something the option decides)."""
    ids, mask = left_pad(PROMPTS)
    kept = {k: v for k, v in option_kwargs(option).items() if k in ("eos_token_id", "max_new_tokens")}
    without = flash(target(), ids, mask, seed=SEED, **SAMPLING, **kept).sequences
    if option in ("renormalize_logits",):           # log-softmax: the same distribution
        assert torch.equal(plain_run(option, True), without)
    else:
        assert not torch.equal(plain_run(option, True), without)


# --------------------------------------------------------------------------------------
# 2. Speculation invariance
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["assistant", "self", "lookup"])
@pytest.mark.parametrize("option", ALL_OPTIONS)
def test_same_tokens_with_any_drafter(option, mode):
    ids, mask = left_pad(PROMPTS)
    out = flash(target(), ids, mask, mode, seed=SEED, **SAMPLING, **option_kwargs(option))
    assert torch.equal(out.sequences, plain_run(option, True)), (
        out.sequences[:, ids.shape[1]:].tolist(), plain_run(option, True)[:, ids.shape[1]:].tolist())
    assert int(out.flash_stats.drafted.sum()) > 0


SEVERAL = dict(repetition_penalty=1.3, no_repeat_ngram_size=3, bad_words_ids=[[101], [92, 62]],
               suppress_tokens=[53], sequence_bias=[[[7], 2.0]], min_new_tokens=4,
               eos_token_id=EOS, typical_p=0.9, top_k=30, top_p=0.95, temperature=0.8,
               do_sample=True)


@pytest.mark.parametrize("num_drafts", [1, 2, 5])
@pytest.mark.parametrize("mode", ["self", "lookup"])
def test_several_options_at_once_any_draft_length(mode, num_drafts):
    ids, mask = left_pad(PROMPTS)
    plain = flash(target(), ids, mask, seed=SEED, **SEVERAL).sequences
    drafts = ({"assistant_model": target(), "num_assistant_tokens": num_drafts} if mode == "self"
              else {"prompt_lookup_num_tokens": num_drafts})
    out = flash(target(), ids, mask, "plain", seed=SEED, **SEVERAL, **drafts)
    assert torch.equal(out.sequences, plain)
    # no_repeat_ngram_size bans what prompt lookup copies: its drafts are all rejected.
    stats = out.flash_stats
    assert int(stats.drafted.sum()) > 0 and (mode == "lookup" or int(stats.accepted.sum()) > 0)


class ContextParity(LogitsProcessor):
    """A custom processor that reads the whole context: bans the token equal to the sum of
    the context's last three ids (mod V), and boosts the one after the last id."""

    def __call__(self, input_ids, scores):
        banned = input_ids[:, -3:].sum(dim=1) % scores.shape[1]
        boosted = (input_ids[:, -1] + 1) % scores.shape[1]
        scores = scores.clone()
        rows = torch.arange(scores.shape[0])
        scores[rows, boosted] += 3.0
        scores[rows, banned] = float("-inf")
        return scores


@pytest.mark.parametrize("sampled", [True, False])
def test_custom_processor_with_drafts(sampled):
    ids, mask = left_pad(PROMPTS)
    sampling = SAMPLING if sampled else dict(do_sample=False)
    custom = dict(logits_processor=LogitsProcessorList([ContextParity()]))
    plain = flash(target(), ids, mask, seed=SEED, **sampling, **custom).sequences
    processors = LogitsProcessorList([ContextParity()])
    if sampled:
        processors.append(lp.TemperatureLogitsWarper(SAMPLING["temperature"]))
    assert_reference_tokens(plain, ids, mask, processors, row_seeds(SEED, 3), sampled)
    for mode in ("self", "assistant", "lookup"):
        out = flash(target(), ids, mask, mode, seed=SEED, **sampling, **custom)
        assert torch.equal(out.sequences, plain), mode


def test_prefix_allowed_tokens_fn_gets_the_row_and_its_context():
    """Constrained decoding: row b may only continue with tokens of row b's own allowed set,
    and the set depends on the context's last token; speculation gives the same tokens."""
    ids, mask = left_pad(PROMPTS)
    calls = []

    def allowed(row, context):
        calls.append((row, context.shape[0]))
        return [(int(context[-1]) + k + row) % VOCAB for k in (1, 2, 5, 9)]

    plain = flash(target(), ids, mask, seed=SEED, prefix_allowed_tokens_fn=allowed, **SAMPLING)
    new = plain.sequences[:, ids.shape[1]:]
    previous = plain.sequences[:, ids.shape[1] - 1:-1]
    offsets = (new - previous - torch.arange(3)[:, None]) % VOCAB
    assert torch.isin(offsets, torch.tensor([1, 2, 5, 9])).all()
    assert {row for row, _ in calls} == {0, 1, 2}
    lookup = flash(target(), ids, mask, "self", seed=SEED, prefix_allowed_tokens_fn=allowed, **SAMPLING)
    assert torch.equal(lookup.sequences, plain.sequences)


# --------------------------------------------------------------------------------------
# 3. Greedy equals stock transformers
# --------------------------------------------------------------------------------------

DETERMINISTIC = [name for name in OPTIONS if name != "watermarking_config"] + ["custom"]


def greedy_kwargs(option):
    if option == "custom":
        return dict(logits_processor=LogitsProcessorList([ContextParity()]))
    return option_kwargs(option)


@pytest.mark.parametrize("option", DETERMINISTIC)
def test_greedy_equals_stock(option):
    ids, mask = left_pad(PROMPTS)
    kwargs = greedy_kwargs(option)
    kwargs.setdefault("max_new_tokens", MAX_NEW)
    expected = target().generate(ids, attention_mask=mask, do_sample=False, **kwargs)
    for mode in ("plain", "self", "lookup"):
        out = flash(target(), ids, mask, mode, do_sample=False, **kwargs)
        assert torch.equal(out.sequences, expected), (mode, out.sequences[:, ids.shape[1]:].tolist(),
                                                      expected[:, ids.shape[1]:].tolist())


@pytest.mark.parametrize("mode", ["plain", "lookup"])
def test_output_scores_and_logits_equal_stock(mode):
    """Batch 1 greedy (stock refuses speculation with batches): one [1, V] tensor per new
    token, the processed scores and the raw logits, as stock returns them."""
    ids, mask = left_pad(PROMPTS[:1])
    kwargs = dict(do_sample=False, repetition_penalty=1.5, output_scores=True,
                  output_logits=True, max_new_tokens=MAX_NEW)
    stock = target().generate(ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
    out = flash(target(), ids, mask, mode, **kwargs)
    assert torch.equal(out.sequences, stock.sequences)
    assert len(out.scores) == len(stock.scores) == MAX_NEW
    for ours, theirs in zip(out.scores + out.logits, stock.scores + stock.logits):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_output_scores_of_a_finished_row_are_nan():
    ids, mask = left_pad(PROMPTS)
    out = flash(target(), ids, mask, "self", do_sample=False, output_scores=True, eos_token_id=EOS,
                pad_token_id=0, repetition_penalty=1.1)
    new = out.sequences[:, ids.shape[1]:]
    lengths = [(row == EOS).long().argmax().item() + 1 if (row == EOS).any() else len(row)
               for row in new]
    assert len(out.scores) == max(lengths) and min(lengths) < max(lengths)
    for row, length in enumerate(lengths):
        for t, scores in enumerate(out.scores):
            assert bool(scores[row].isnan().all()) == (t >= length)


# --------------------------------------------------------------------------------------
# 4. Models whose own configuration needs the materialized path
# --------------------------------------------------------------------------------------

QWEN25_INSTRUCT = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8,
                       repetition_penalty=1.05, eos_token_id=[EOS, 4], pad_token_id=0)


def test_qwen25_instruct_generation_config_runs_without_arguments():
    model = tiny_model("qwen3")
    for name, value in QWEN25_INSTRUCT.items():
        setattr(model.generation_config, name, value)
    ids = torch.tensor([PROMPTS[0]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        plain = model.generate(ids, sampler="flash")
    # The repetition penalty is fused (flashspec.generation.edits): no materialized path.
    assert not [w for w in caught if "materialized path" in str(w.message)]
    # transformers' default max_length, or an EOS of the model's config
    assert plain.shape[1] == 20 or int(plain[0, -1]) in QWEN25_INSTRUCT["eos_token_id"]
    torch.manual_seed(0)
    seeds = row_seeds(None, 1)
    for speculative in (dict(assistant_model=model, num_assistant_tokens=4),
                        dict(prompt_lookup_num_tokens=3)):
        torch.manual_seed(0)
        assert torch.equal(model.generate(ids, sampler="flash", **speculative), plain)
    reference = copy.deepcopy(model).double()
    processors = LogitsProcessorList([
        lp.RepetitionPenaltyLogitsProcessor(1.05), lp.TemperatureLogitsWarper(0.7),
        lp.TopKLogitsWarper(20), lp.TopPLogitsWarper(0.8)])
    _assert_model_reference(reference, plain, ids, processors, seeds)


def _assert_model_reference(model64, sequences, ids, processors, seeds):
    """`assert_reference_tokens` for another model (batch 1, no padding)."""
    width = ids.shape[1]
    with torch.no_grad():
        logits = model64(input_ids=sequences).logits
    vocab = torch.arange(VOCAB)
    for t in range(sequences.shape[1] - width):
        scores = processors(sequences[:, : width + t], logits[:, width + t - 1].clone())
        noise = rng.gumbel(seeds[:, None], torch.tensor([[width + t]]), vocab[None, :],
                           dtype=torch.float64)
        perturbed = scores + noise
        got, want = int(sequences[0, width + t]), int(perturbed.argmax())
        a, b = float(perturbed[0, got]), float(perturbed[0, want])
        assert got == want or abs(a - b) <= NEAR_TIE * (1 + max(abs(a), abs(b))), (t, got, want)
        if int(sequences[0, width + t]) in (EOS, 4):
            break


def _gemma2():
    model = tiny_model("gemma2")
    assert model.config.final_logit_softcapping == 30.0
    with torch.no_grad():        # logits near the cap, where tanh bends them
        model.lm_head.weight.mul_(8.0)
    return model


def _biased_llama():
    model = tiny_model("llama")
    torch.manual_seed(5)
    model.lm_head.bias = torch.nn.Parameter(2.0 * torch.randn(VOCAB))
    return model


@pytest.mark.parametrize("make", [_gemma2, _biased_llama], ids=["gemma2-softcap", "lm-head-bias"])
def test_head_transforms_run_without_arguments(make):
    """Greedy (the model's default) equals stock, plain and speculative; seeded sampling is
    the float64 draw from the model's own logits (softcapped / biased), plain and
    speculative; and the head transform matters (without it the tokens differ)."""
    model = make()
    ids, mask = left_pad(PROMPTS[:1])
    stock = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
    for speculative in ({}, dict(prompt_lookup_num_tokens=3),
                        dict(assistant_model=model, num_assistant_tokens=3)):
        assert torch.equal(model.generate(ids, sampler="flash", max_new_tokens=MAX_NEW,
                                          **speculative), stock)
    sampled = model.generate(ids, sampler="flash", seed=SEED, max_new_tokens=MAX_NEW, **SAMPLING)
    for speculative in (dict(prompt_lookup_num_tokens=3),
                        dict(assistant_model=model, num_assistant_tokens=3)):
        assert torch.equal(model.generate(ids, sampler="flash", seed=SEED, max_new_tokens=MAX_NEW,
                                          **SAMPLING, **speculative), sampled)
    processors = LogitsProcessorList([lp.TemperatureLogitsWarper(SAMPLING["temperature"])])
    _assert_model_reference(copy.deepcopy(model).double(), sampled, ids, processors,
                            row_seeds(SEED, 1))
    plain_head = copy.deepcopy(model)
    plain_head.config.final_logit_softcapping = None
    plain_head.lm_head.bias = None
    assert not torch.equal(plain_head.generate(ids, max_new_tokens=MAX_NEW, do_sample=False), stock) \
        or not torch.equal(plain_head.generate(ids, sampler="flash", seed=SEED, max_new_tokens=MAX_NEW,
                                               **SAMPLING), sampled)


# --------------------------------------------------------------------------------------
# 5. Warnings, delegation, what stays on the fused path
# --------------------------------------------------------------------------------------

def test_one_warning_names_every_reason():
    ids, mask = left_pad(PROMPTS[:1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flash(target(), ids, mask, max_new_tokens=2, repetition_penalty=1.2, no_repeat_ngram_size=3,
              logits_processor=LogitsProcessorList([ContextParity()]))
    messages = [str(w.message) for w in caught if "sampler='flash'" in str(w.message)]
    assert len(messages) == 1
    for part in ("`repetition_penalty`=1.2 (set in the call)", "`no_repeat_ngram_size`=3",
                 "`logits_processor` (ContextParity)"):
        assert part in messages[0]


def test_plain_options_stay_fused():
    """Temperature, top-k, top-p and min-p never take the materialized path (no warning,
    no processing in the plan)."""
    ids, mask = left_pad(PROMPTS[:1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = flashspec.generation.plan.plan_generation(
            target(), ids, None, attention_mask=mask, do_sample=True, temperature=0.7, top_k=20,
            top_p=0.9, min_p=0.05, max_new_tokens=2)
    assert plan.processing is None


def test_beam_search_defers_to_stock_with_a_warning():
    ids, mask = left_pad(PROMPTS[:1])
    with pytest.warns(UserWarning, match=r"defers this call to stock transformers generate\(\): "
                                         r"`num_beams`=3 \(set in the call\)"):
        ours = target().generate(ids, attention_mask=mask, sampler="flash", num_beams=3,
                                 max_new_tokens=6)
    assert torch.equal(ours, target().generate(ids, attention_mask=mask, num_beams=3, max_new_tokens=6))
    target().generation_config.num_beams = 2
    try:
        with pytest.warns(UserWarning, match=r"\(from the model's generation_config"):
            target().generate(ids, attention_mask=mask, sampler="flash", max_new_tokens=2)
        with pytest.raises(ValueError, match=r"`seed` keys flashspec's noise.*torch.manual_seed"):
            target().generate(ids, attention_mask=mask, sampler="flash", max_new_tokens=2,
                              do_sample=True, seed=1)
    finally:
        target().generation_config.num_beams = 1


def test_a_refusal_names_where_the_value_came_from():
    assistant = tiny_draft("llama")
    assistant.generation_config.num_assistant_tokens_schedule = "sometimes"
    ids, mask = left_pad(PROMPTS[:1])
    with pytest.raises(ValueError, match=r"'sometimes' is not supported with sampler='flash' "
                                         r"\(from the assistant's generation_config\); pass "
                                         r"num_assistant_tokens_schedule="):
        target().generate(ids, attention_mask=mask, sampler="flash", assistant_model=assistant)


class _BanAfter(LogitsProcessor):
    """Never `token`; after a `token` (which only a draft can propose) nothing is allowed."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.token] = float("-inf")
        scores[input_ids[:, -1] == self.token] = float("-inf")
        return scores


@pytest.mark.parametrize("drafter", ["lookup", "self"])
def test_positions_after_a_rejected_draft_do_not_count(drafter):
    """Edits that leave nothing to sample after a draft the target rejects never stop a call:
    the row never reaches that context (nor does stock's assisted generation)."""
    model, banned = target(), 53
    ids = torch.tensor([[banned, 20, 21] * 3 + [banned, 20]])
    kwargs = dict(sampler="flash", seed=3, do_sample=True, top_k=0, max_new_tokens=10,
                  logits_processor=LogitsProcessorList([_BanAfter(banned)]))
    spec = (dict(prompt_lookup_num_tokens=3) if drafter == "lookup"
            else dict(assistant_model=model, num_assistant_tokens=3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = model.generate(ids, **kwargs)
        drafted = model.generate(ids, **kwargs, **spec)
    assert torch.equal(drafted, plain)
