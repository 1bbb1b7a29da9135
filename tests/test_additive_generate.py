"""`generate(sampler="flash")` with additive logit edits: vLLM's `logit_bias`,
`presence_penalty` and `frequency_penalty` (flashspec options) and transformers'
`sequence_bias` (single tokens and sequences), fused (`flashspec.generation.additive`, `edits.EditState`).

Pinned here: they run fused; seeded tokens equal a float64 reference written here (vLLM's
rules, transformers' own processors for its options, in their order) with the same noise,
near-ties detected; the materialized path (forced by a processor that changes nothing)
gives the same tokens; plain = assistant = self-drafting = prompt lookup; greedy
`logit_bias` for every row equals stock's `sequence_bias` of the same single tokens; bad
values are refused by name.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation import logits_process as lp

import flashspec
from flashspec.params import row_seeds

from _models import VOCAB
from test_fused_edits_generate import Unchanged
from test_generate import _quiet_single_threaded  # noqa: F401 - the module's autouse fixture
from test_logits_options import (PROMPTS, SAMPLING, assert_reference_tokens, flash, left_pad,
                                 target)

SEED = 11
ROW_BIAS = [{7: 3.0, 101: -4.0}, None, {20: 2.5, 53: -1.5, 9: 1.0}]
# Single tokens, and sequences whose prefixes the runs below generate (two ending on the
# same token: transformers adds both where both match).
SEQUENCE_BIAS = [[[101], -4.0], [[31, 38], 5.0], [[38, 31], -3.0], [[15], 2.0], [[62, 23, 21], 4.0],
                 [[23, 21], 1.5], [[16, 113], -2.5], [[7], 3.0]]
SEQUENCES = [entry for entry in SEQUENCE_BIAS if len(entry[0]) > 1]
INFINITE_BIAS = [[[31], float("-inf")], [[62, 23], float("-inf")], [[15], 2.0], [[16, 113], 3.0]]
ORDER_BIAS = {5: 6.0, 6: 6.0, 9: 6.0, 10: 6.0, 53: 6.0, 20: 6.0}


class ReferenceBias(LogitsProcessor):
    """float64: each row's ``{token: bias}`` added."""

    def __init__(self, rows):
        self.rows = rows

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row, bias in enumerate(self.rows):
            for token, value in (bias or {}).items():
                scores[row, token] += value
        return scores


class ReferencePenalties(LogitsProcessor):
    """float64: vLLM's ``l - f * count - p * (count > 0)`` over the tokens after the first
    `width` (the generated ones)."""

    def __init__(self, width, presence, frequency):
        self.width, self.presence, self.frequency = width, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row in range(scores.shape[0]):
            presence = self.presence[row] if isinstance(self.presence, list) else self.presence
            frequency = self.frequency[row] if isinstance(self.frequency, list) else self.frequency
            counts = torch.bincount(input_ids[row, self.width:], minlength=scores.shape[1])
            scores[row] -= frequency * counts.double() + presence * (counts > 0).double()
        return scores


# option -> (generate kwargs, processors(prompt width) in transformers' and vLLM's order)
OPTIONS = {
    "sequence_bias single tokens": (
        dict(sequence_bias=[[[101], -4.0], [[7], 3.0], [[53], 2.5]]),
        lambda w: [lp.SequenceBiasLogitsProcessor([[[101], -4.0], [[7], 3.0], [[53], 2.5]])]),
    "sequence_bias": (dict(sequence_bias=SEQUENCE_BIAS),
                      lambda w: [lp.SequenceBiasLogitsProcessor(SEQUENCE_BIAS)]),
    "sequence_bias of sequences": (
        dict(sequence_bias=SEQUENCES), lambda w: [lp.SequenceBiasLogitsProcessor(SEQUENCES)]),
    "logit_bias": (dict(logit_bias={7: 3.0, 101: -4.0, 20: 2.0}),
                   lambda w: [ReferenceBias([{7: 3.0, 101: -4.0, 20: 2.0}] * 3)]),
    "logit_bias per row": (dict(logit_bias=ROW_BIAS), lambda w: [ReferenceBias(ROW_BIAS)]),
    "frequency_penalty": (dict(frequency_penalty=1.5),
                          lambda w: [ReferencePenalties(w, 0.0, 1.5)]),
    "presence_penalty": (dict(presence_penalty=2.0), lambda w: [ReferencePenalties(w, 2.0, 0.0)]),
    "penalties per row": (dict(presence_penalty=[0.5, 0.0, -0.5], frequency_penalty=[1.0, 2.0, 0.0]),
                          lambda w: [ReferencePenalties(w, [0.5, 0.0, -0.5], [1.0, 2.0, 0.0])]),
    # The order matters here: the biases before the repetition penalty (a product), vLLM's
    # penalties after it.
    "all": (dict(sequence_bias=[[[53], 2.5]], logit_bias=ROW_BIAS, repetition_penalty=1.6,
                 presence_penalty=0.7, frequency_penalty=0.9, suppress_tokens=[65]),
            lambda w: [lp.SequenceBiasLogitsProcessor([[[53], 2.5]]), ReferenceBias(ROW_BIAS),
                       lp.RepetitionPenaltyLogitsProcessor(1.6),
                       ReferencePenalties(w, 0.7, 0.9), lp.SuppressTokensLogitsProcessor([65])]),
    # Strong enough, and long enough, that another order draws other tokens (the test
    # after next): negative penalties make generated tokens compete.
    # (Bad words too: transformers' NoBadWordsLogitsProcessor is a SequenceBiasLogitsProcessor
    # that comes after the repetition penalty, which must not move the bias there.)
    "order": (dict(logit_bias=ORDER_BIAS, repetition_penalty=3.0, frequency_penalty=-1.5,
                   presence_penalty=-1.0, bad_words_ids=[[99]], max_new_tokens=40),
              lambda w: [ReferenceBias([ORDER_BIAS] * 3), lp.RepetitionPenaltyLogitsProcessor(3.0),
                         ReferencePenalties(w, -1.0, -1.5), lp.NoBadWordsLogitsProcessor([[99]])]),
    # transformers' way to ban: an infinite negative bias, single tokens and sequences.
    "sequence_bias -inf": (dict(sequence_bias=INFINITE_BIAS),
                           lambda w: [lp.SequenceBiasLogitsProcessor(INFINITE_BIAS)]),
}


@functools.lru_cache(maxsize=None)
def run(option: str, mode: str = "plain", materialized: bool = False,
        sampled: bool = True) -> torch.Tensor:
    ids, mask = left_pad(PROMPTS)
    extra = dict(logits_processor=LogitsProcessorList([Unchanged()])) if materialized else {}
    sampling = SAMPLING if sampled else dict(do_sample=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "sampler='flash' runs this call")
        return flash(target(), ids, mask, mode, seed=SEED, **sampling, **OPTIONS[option][0],
                     **extra).sequences


@pytest.mark.parametrize("option", list(OPTIONS))
def test_runs_fused(option):
    ids, mask = left_pad(PROMPTS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = flashspec.generation.plan.plan_generation(
            target(), ids, None, attention_mask=mask, **SAMPLING,
            **(dict(max_new_tokens=12) | OPTIONS[option][0]))
    assert plan.processing is None and plan.edits is not None


@pytest.mark.parametrize("option", list(OPTIONS))
def test_seeded_tokens_equal_the_float64_reference(option):
    ids, mask = left_pad(PROMPTS)
    processors = LogitsProcessorList(OPTIONS[option][1](ids.shape[1])
                                     + [lp.TemperatureLogitsWarper(SAMPLING["temperature"])])
    assert_reference_tokens(run(option), ids, mask, processors, row_seeds(SEED, len(PROMPTS)),
                            True)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_option_changes_the_tokens(option):
    ids, mask = left_pad(PROMPTS)
    without = flash(target(), ids, mask, seed=SEED, **SAMPLING).sequences
    assert not torch.equal(run(option), without)


@pytest.mark.parametrize("swapped", [
    lambda w: [ReferencePenalties(w, -1.0, -1.5), ReferenceBias([ORDER_BIAS] * 3),
               lp.RepetitionPenaltyLogitsProcessor(3.0)],
    lambda w: [lp.RepetitionPenaltyLogitsProcessor(3.0), ReferenceBias([ORDER_BIAS] * 3),
               ReferencePenalties(w, -1.0, -1.5)],
    lambda w: [ReferenceBias([ORDER_BIAS] * 3), ReferencePenalties(w, -1.0, -1.5),
               lp.RepetitionPenaltyLogitsProcessor(3.0)],
], ids=["penalties-bias-repetition", "repetition-bias-penalties", "bias-penalties-repetition"])
def test_the_reference_in_another_order_disagrees(swapped):
    """The float64 reference with the edits in another order disagrees with the run beyond
    near-ties: the reference test of "order" pins transformers' and vLLM's order."""
    ids, mask = left_pad(PROMPTS)
    processors = LogitsProcessorList(swapped(ids.shape[1])
                                     + [lp.TemperatureLogitsWarper(SAMPLING["temperature"])])
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_reference_tokens(run("order"), ids, mask, processors, row_seeds(SEED, len(PROMPTS)),
                                True)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_fused_tokens_equal_the_materialized_path(option):
    assert torch.equal(run(option), run(option, materialized=True))


@pytest.mark.parametrize("mode", ["assistant", "self", "lookup"])
@pytest.mark.parametrize("option", ["sequence_bias", "sequence_bias of sequences",
                                    "logit_bias per row", "penalties per row", "all"])
def test_speculation_invariance(option, mode):
    assert torch.equal(run(option, mode), run(option))


@pytest.mark.parametrize("num_drafts", [1, 3, 6])
def test_penalties_any_draft_length(num_drafts):
    """Drafts repeat tokens within one verification: each position counts those before it."""
    ids, mask = left_pad(PROMPTS)
    out = flash(target(), ids, mask, seed=SEED, **SAMPLING, **OPTIONS["all"][0],
                assistant_model=target(), num_assistant_tokens=num_drafts)
    assert torch.equal(out.sequences, run("all"))
    assert int(out.flash_stats.accepted.sum()) > 0


def test_greedy_logit_bias_equals_stock_sequence_bias():
    ids, mask = left_pad(PROMPTS)
    bias = {7: 3.0, 101: -4.0, 20: 2.0}
    expected = target().generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                                 sequence_bias=[[[t], b] for t, b in bias.items()])
    for mode in ("plain", "self", "lookup"):
        out = flash(target(), ids, mask, mode, do_sample=False, logit_bias=bias)
        assert torch.equal(out.sequences, expected), mode


def test_greedy_infinite_sequence_bias_equals_stock():
    """transformers bans with a bias of -inf: the fused path bans those tokens too."""
    ids, mask = left_pad(PROMPTS)
    kwargs = dict(do_sample=False, max_new_tokens=12, sequence_bias=INFINITE_BIAS)
    expected = target().generate(ids, attention_mask=mask, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "sampler='flash' runs this call")
        for mode in ("plain", "self", "lookup"):
            assert torch.equal(flash(target(), ids, mask, mode, **kwargs).sequences, expected), mode


def test_a_padded_batch_bucket_loads_the_call_rows():
    """On CUDA a slot pads the call's rows to its bucket: the call's values go to its rows,
    zeros to the rest."""
    from flashspec.generation.additive import AdditiveEdits
    from flashspec.generation.edits import EditRules, EditState

    state = EditState(4, VOCAB, torch.device("cpu"))
    edits = AdditiveEdits.of_call([{7: 1.0}, None, {9: -2.0}], [0.5, 0.0, 1.0], 0.25, 3, VOCAB)
    state.load(EditRules(), torch.ones(4, 5, dtype=torch.long), edits)
    assert state.presence.tolist() == [0.5, 0.0, 1.0, 0.0]
    assert state.frequency.tolist() == [0.25, 0.25, 0.25, 0.0]
    assert state.bias[0, 7] == 1.0 and state.bias[2, 9] == -2.0 and int(state.bias[3].count_nonzero()) == 0


def test_zero_penalties_and_no_bias_are_no_edits():
    from flashspec.generation.additive import AdditiveEdits

    assert AdditiveEdits.of_call(None, 0.0, [0.0, 0.0], 2, VOCAB) is None
    assert AdditiveEdits.of_call([None, {}], None, None, 2, VOCAB) is None


def test_greedy_penalties_equal_the_materialized_path():
    for option in ("penalties per row", "all"):
        assert torch.equal(run(option, sampled=False), run(option, materialized=True, sampled=False))


@pytest.mark.parametrize("kwargs, message", [
    (dict(logit_bias={VOCAB: 1.0}), r"`logit_bias` has token %d" % VOCAB),
    (dict(logit_bias={-1: 1.0}), r"`logit_bias` has token -1"),
    (dict(logit_bias={"7": 1.0}), r"`logit_bias` has token '7'"),
    (dict(logit_bias={7: float("inf")}), r"`logit_bias`\[7\]=inf"),
    (dict(logit_bias={7: 1e39}), r"`logit_bias`\[7\]=1e\+39"),
    (dict(logit_bias=[{7: 1.0}]), r"`logit_bias` has 1 entries but the call has 3 rows"),
    (dict(logit_bias=[{7: 1.0}, 5, None]), r"each entry of `logit_bias` must be a dict"),
    (dict(presence_penalty=float("nan")), r"`presence_penalty`=nan"),
    (dict(frequency_penalty=[1.0, 2.0]), r"`frequency_penalty` has 2 entries"),
    (dict(frequency_penalty="high"), r"`frequency_penalty` must be one value"),
    (dict(presence_penalty=True), r"`presence_penalty`=True"),
    (dict(presence_penalty=1e39), r"`presence_penalty`=1e\+39 is not allowed: it must be a number "
                                  "finite in float32"),
])
def test_bad_values_are_refused_by_name(kwargs, message):
    ids, mask = left_pad(PROMPTS)
    with pytest.raises((ValueError, TypeError), match=message):
        flash(target(), ids, mask, seed=SEED, **SAMPLING, **kwargs)


@pytest.mark.parametrize("name", ["logit_bias", "presence_penalty", "frequency_penalty"])
def test_flashspec_options_are_refused_by_stock(name):
    ids, mask = left_pad(PROMPTS)
    value = {7: 1.0} if name == "logit_bias" else 0.5
    with pytest.raises(ValueError, match=f"`{name}` is a flashspec option"):
        target().generate(ids, attention_mask=mask, max_new_tokens=2, **{name: value})
    with pytest.raises(ValueError, match=f"`{name}` needs flashspec's engine"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target().generate(ids, attention_mask=mask, max_new_tokens=2, sampler="flash",
                          num_beams=2, **{name: value})


# --------------------------------------------------------------------------------------
# CUDA: the kernels with a bias (per row, and per position with sequences) and counts, in
# captured graphs
# --------------------------------------------------------------------------------------

GPU_BIAS = [{9: 1.5}, None, {9: -1.0, 11: 2.0}, {}]
GPU_SEQUENCES = [[[7], 2.0], [[30, 31], 3.0], [[31, 7], -2.0]]
# A bad word beside the sequences: bans and biases share the words' matching, in graphs.
GPU_ADDITIVE = dict(sequence_bias=GPU_SEQUENCES, logit_bias=GPU_BIAS, repetition_penalty=1.3,
                    presence_penalty=0.5, frequency_penalty=-0.4, bad_words_ids=[[40, 41]])


def _gpu_reference_processors(row: int, width: int) -> LogitsProcessorList:
    """float64 processors of `GPU_ADDITIVE` for row `row` alone (a [1, L] context)."""
    return LogitsProcessorList([lp.SequenceBiasLogitsProcessor(GPU_SEQUENCES),
                                ReferenceBias([GPU_BIAS[row]]),
                                lp.RepetitionPenaltyLogitsProcessor(1.3),
                                ReferencePenalties(width, 0.5, -0.4),
                                lp.NoBadWordsLogitsProcessor([[40, 41]])])


@pytest.mark.gpu
def test_additive_edits_on_cuda_equal_the_cpu_engine_and_survive_switching():
    """On CUDA (fp32) plain, assistant and prompt lookup equal the CPU engine up to near-ties
    of the edited float64 logits; a call without edits in between leaves the next call with
    them unchanged (their graphs live side by side)."""
    from flashspec import rng
    from flashspec.bench.statistics import is_near_tie
    from flashspec.generation.engine import cached_engine
    from test_generate_gpu import MODES as GPU_MODES, VOCAB as GPU_VOCAB, _cpu_pair, _pair, \
        _prompts, _reference, _run

    model, draft = _pair(torch.float32)
    ids, mask = _prompts("cuda")
    seeds = torch.tensor([41, 42, 43, 44])
    sampling = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8)
    width = ids.shape[1]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "sampler='flash' runs this call")
        on_cpu = _run(*_cpu_pair(), ids.cpu(), mask.cpu(), GPU_MODES["plain"], seed=seeds,
                      **sampling, **GPU_ADDITIVE)
        for name, mode in GPU_MODES.items():
            graphed = _run(model, draft, ids, mask, mode, seed=seeds, **sampling, **GPU_ADDITIVE)
            for row in range(len(ids)):
                a, b = graphed[row].cpu(), on_cpu[row]
                if torch.equal(a, b):
                    continue
                k = int((a != b).nonzero()[0])
                real = a[:k][mask[row].cpu().bool().tolist() + [True] * (k - width)]
                with torch.no_grad():
                    logits64 = _reference()(real[None]).logits[0, -1].double()
                edited = _gpu_reference_processors(row, width)(a[None, :k], logits64[None])[0]
                noise = rng.gumbel(torch.tensor(int(seeds[row])), torch.tensor(len(real)),
                                   torch.arange(GPU_VOCAB))
                assert is_near_tie(edited, True, sampling["temperature"], sampling["top_k"],
                                   sampling["top_p"], 0.0, noise.double(), int(a[k]), int(b[k])), \
                    f"{name}: row {row} differs at new token {k - width}: {int(a[k])} vs {int(b[k])}"
        assert cached_engine(model.get_decoder()).graphs
        plain = _run(model, draft, ids, mask, GPU_MODES["plain"], seed=seeds, **sampling)
        assert not torch.equal(plain, graphed)
        again = _run(model, draft, ids, mask, GPU_MODES["prompt_lookup"], seed=seeds, **sampling,
                     **GPU_ADDITIVE)
        assert torch.equal(again, graphed)


@pytest.mark.gpu
def test_additive_edits_on_cuda_bf16_are_speculation_invariant():
    """bf16 with the invariant kernels (bitwise the same hidden states with and without
    drafts): the seeded tokens of an assistant and of prompt lookup equal plain decoding's,
    the counts of each drafted position included."""
    from test_generate_gpu import MODES as GPU_MODES, _pair, _prompts, _run

    model, draft = _pair(torch.bfloat16)
    ids, mask = _prompts("cuda")
    seeds = torch.tensor([41, 42, 43, 44])
    runs = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "sampler='flash' runs this call")
        for name, mode in GPU_MODES.items():
            runs[name] = _run(model, draft, ids, mask, mode, seed=seeds, invariant=True,
                              do_sample=True, temperature=0.8, top_k=8, **GPU_ADDITIVE).cpu()
    without = _run(model, draft, ids, mask, GPU_MODES["plain"], seed=seeds, invariant=True,
                   do_sample=True, temperature=0.8, top_k=8).cpu()
    assert not torch.equal(runs["plain"], without)
    for name, out in runs.items():
        assert torch.equal(out, runs["plain"]), name
