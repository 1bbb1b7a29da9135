"""The model's head transforms inside the fused kernels: an LM-head bias and Gemma-2's
``final_logit_softcapping`` (`flashspec.sampling`'s ``bias`` and ``softcap``, applied by
stage 1's `epilogue._head_logits`), against the float64 reference with the same noise.

They are applied to the fp32 logits tile before the logit edits, so every summary (Gumbel
race, screen, log-sum-exp, candidates, the draft left out, greedy rows' argmax) sees the
model's logits: the kernel tests run several tile configurations, vocabularies that do not
fill the last tile and every truncation mode, with and without edits. End to end, tiny
Gemma-2-style and biased models run ``generate(ids, sampler="flash")`` with no other
argument on the fused path (on CPU the engine's LM head runs the kernels through Triton's
interpreter here): greedy equals stock, seeded tokens equal the materialized path's and the
float64 reference's, with and without speculation.

On a CPU machine the kernels run through Triton's interpreter on small shapes (which runs
bf16 matmuls wrongly: bf16 operands are checked by the `gpu` tests, bf16 biases here); the
`gpu` tests run the same checks compiled, in bf16, through the warp-specialized kernel on
Hopper.
"""

from __future__ import annotations

import copy
import functools
import warnings

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, seed, settings, strategies as st
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation import logits_process as lp

from flashspec import SamplingParams, kernels, reference, sampling
from flashspec.generation import samplers
from flashspec.generation.engine import Engine
from flashspec.generation.heads import output_head
from flashspec.kernels import epilogue, lm_head_ws
from flashspec.params import LogitEdits, row_seeds

from _models import VOCAB, tiny_draft, tiny_model
from test_fused_edits import (CONFIGS, assert_near_ties, assert_verify_differences_are_near_ties,
                              random_edits)
from test_generate import _quiet_single_threaded  # noqa: F401 - the module's autouse fixture
from test_kernels import DEVICE, ON_GPU, SMALL, mixed_params, random_problem
from test_logits_options import _assert_model_reference, left_pad
from test_reference import TRUNCATION_CASES
from test_verify_kernel import random_drafts

HEADS = ("bias", "softcap", "bias+softcap")
SOFTCAP = 4.0   # logits of `random_problem` have a standard deviation of 3: the cap bends them


def head_of(g, vocab_size, kind, dtype=torch.float32, softcap=SOFTCAP) -> dict:
    """`sample`'s ``bias`` / ``softcap`` keywords of `kind` (one of HEADS)."""
    bias = 2.0 * torch.randn(vocab_size, generator=g)
    return dict(bias=bias.to(DEVICE, dtype) if "bias" in kind else None,
                softcap=softcap if "softcap" in kind else None)


def float64(head: dict) -> dict:
    return {name: value.double() if torch.is_tensor(value) else value
            for name, value in head.items()}


def model_logits64(hidden, weight, bias=None, softcap=None, edits=None) -> torch.Tensor:
    """float64 logits ``[rows, V]`` on CPU as a model forms them (transformers' Gemma-2 head:
    the linear layer with its bias, then ``logits / c``, tanh, ``* c``), then `edits`."""
    flat = hidden.reshape(-1, hidden.shape[-1]).double().cpu()
    logits = torch.nn.functional.linear(flat, weight.double().cpu(),
                                        None if bias is None else bias.double().cpu())
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if edits is not None:
        logits = reference.edit_logits(logits, edits.flat().to("cpu"))
    return logits


def position_edits(edits: LogitEdits | None, j: int) -> LogitEdits | None:
    """Verification's edits ``[B, G+1, V]`` of position j, as `sample` takes them."""
    return None if edits is None else LogitEdits(edits.codes[:, j], edits.penalty)


def reference64(op, hidden, weight, *args, head, **kwargs):
    """`op` of `flashspec.sampling` on the float64 reference, with the same head."""
    return op(hidden.double(), weight.double(), *args, backend="reference", **float64(head),
              **kwargs)


# --------------------------------------------------------------------------------------
# tanh
# --------------------------------------------------------------------------------------

@triton.jit
def _tanh_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < N
    tl.store(out_ptr + offsets, epilogue._tanh(tl.load(x_ptr + offsets, mask=ok)), mask=ok)


def test_tanh_is_accurate_to_two_ulp():
    """`epilogue._tanh` against float64 tanh over [-12, 12] (it is +-1 in fp32 past 9.01),
    magnitudes from 1e-40 to 50 and the edges: within 2 ulp of the exact value (5 on a GPU,
    whose exp and division are approximate), +-inf to +-1, NaN to NaN."""
    grid = torch.linspace(-12, 12, 120_001)
    tiny = torch.logspace(-40, 1.7, 20_001)
    edges = torch.tensor([0.0, -0.0, 0.625, -0.625, 0.6249999, 9.0, 9.1, 44.0, 45.0, 89.0, 1e30,
                          -1e30, 1e-45, float("inf"), float("-inf")])
    x = torch.cat([grid, tiny, -tiny, edges]).to(DEVICE)
    out = torch.empty_like(x)
    _tanh_kernel[(triton.cdiv(x.numel(), 65536),)](x, out, x.numel(), BLOCK=65536)
    exact = torch.tanh(x.double().cpu())
    ulp = torch.from_numpy(np.spacing(exact.abs().float().numpy())).double()
    error = (out.double().cpu() - exact).abs() / ulp
    assert float(error.max()) <= (5.0 if ON_GPU else 2.0), float(x[int(error.argmax())])
    nan = torch.full((1,), float("nan"), device=DEVICE)
    _tanh_kernel[(1,)](nan, out, 1, BLOCK=16)
    assert torch.isnan(out[0])


# --------------------------------------------------------------------------------------
# The kernels against the float64 reference
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,config", [("bias", "small"), ("softcap", "parts"),
                                         ("bias+softcap", "small"),
                                         ("bias+softcap", "screen+race")])
def test_sample_with_head_equals_the_reference(kind, config):
    """Every truncation mode and greedy rows (`mixed_params`), 301 tokens (the last tile
    partly past V): the float64 reference's tokens, logprobs and log-sum-exp, and the head
    transform matters (without it, another log-sum-exp)."""
    g = torch.Generator().manual_seed(len(kind) + len(config))
    batch, vocab_size = 12, 301
    hidden, weight, positions = random_problem(g, batch, vocab_size, 32)
    params = mixed_params(g, batch, seed=5)
    head = head_of(g, vocab_size, kind)
    ours = sampling.sample(hidden, weight, params, positions, backend="fused",
                           config=CONFIGS[config], **head)
    theirs = reference64(sampling.sample, hidden, weight, params, positions, head=head)
    assert_near_ties(ours.tokens, theirs.tokens, model_logits64(hidden, weight, **head), params,
                     positions, kind)
    same = ours.tokens == theirs.tokens
    assert torch.allclose(ours.logprobs[same].double(), theirs.logprobs[same], atol=2e-4, rtol=1e-4)
    assert torch.allclose(ours.lse.double(), theirs.lse, atol=2e-4, rtol=1e-5)
    plain = sampling.sample(hidden, weight, params, positions, backend="fused", config=SMALL)
    assert not torch.allclose(plain.lse, ours.lse, atol=1e-2)


def test_each_truncation_mode_with_head():
    g = torch.Generator().manual_seed(3)
    batch, vocab_size = 6, 200
    hidden, weight, positions = random_problem(g, batch, vocab_size, 32)
    head = head_of(g, vocab_size, "bias+softcap")
    logits64 = model_logits64(hidden, weight, **head)
    for case in ("none", "top_k", "top_p", "min_p", "all"):
        params = SamplingParams.create(batch, seed=7, device=DEVICE, **TRUNCATION_CASES[case])
        ours = sampling.sample(hidden, weight, params, positions, backend="fused", config=SMALL,
                               **head).tokens
        theirs = reference64(sampling.sample, hidden, weight, params, positions, head=head).tokens
        assert_near_ties(ours, theirs, logits64, params, positions, case)


@pytest.mark.parametrize("config", ["small", "screen+race"])
def test_head_comes_before_the_edits(config):
    """The logit edits (repetition penalty, bans) act on the model's logits, as
    transformers' processors act on the model's output: the float64 reference of the
    softcapped, biased, then edited logits."""
    g = torch.Generator().manual_seed(11)
    batch, vocab_size = 9, 257
    hidden, weight, positions = random_problem(g, batch, vocab_size, 24)
    params = mixed_params(g, batch, seed=2)
    head = head_of(g, vocab_size, "bias+softcap")
    edits = random_edits(g, (batch,), vocab_size, batch)
    ours = sampling.sample(hidden, weight, params, positions, edits=edits, backend="fused",
                           config=CONFIGS[config], **head)
    theirs = reference64(sampling.sample, hidden, weight, params, positions, head=head,
                         edits=edits)
    logits64 = model_logits64(hidden, weight, **head, edits=edits)
    assert_near_ties(ours.tokens, theirs.tokens, logits64, params, positions, config)
    assert torch.allclose(ours.lse.double(), theirs.lse, atol=2e-4, rtol=1e-5)


def test_argmax_with_head_and_the_softcaps_ties():
    """Greedy rows take the argmax of the model's logits; where the softcap rounds two large
    logits to the same fp32 value, the lower id wins, as the model's own argmax picks it
    (token 250 has the larger logit, token 20 the same capped one)."""
    g = torch.Generator().manual_seed(4)
    batch, vocab_size = 9, 333
    hidden, weight, _ = random_problem(g, batch, vocab_size, 32)
    greedy = SamplingParams.create(batch, do_sample=False, seed=0, device=DEVICE)
    for kind in HEADS:
        head = head_of(g, vocab_size, kind)
        ours = sampling.argmax(hidden, weight, backend="fused", config=SMALL, **head).tokens
        theirs = reference64(sampling.argmax, hidden, weight, head=head).tokens
        assert_near_ties(ours, theirs, model_logits64(hidden, weight, **head), greedy,
                         torch.zeros(batch, dtype=torch.long), kind)
    weight = torch.zeros(vocab_size, 16, device=DEVICE)
    weight[20, 0], weight[250, 0] = 600.0, 700.0
    hidden = torch.zeros(2, 16, device=DEVICE)
    hidden[:, 0] = 1.0
    capped = sampling.argmax(hidden, weight, backend="fused", config=SMALL, softcap=30.0).tokens
    model = torch.tanh(reference.compute_logits(hidden, weight) / 30.0) * 30.0
    assert capped.tolist() == model.argmax(dim=-1).tolist() == [20, 20]
    uncapped = sampling.argmax(hidden, weight, backend="fused", config=SMALL).tokens
    assert uncapped.tolist() == [250, 250]


@pytest.mark.parametrize("acceptance,config,edited", [("strict", "parts", False),
                                                      ("probabilistic", "screen+race", True)])
def test_verify_with_head_equals_the_reference(acceptance, config, edited):
    """The drafted token's logit, the draft left out of each tile's best and the candidates
    of each position are the model's (then edited): the float64 reference's verification,
    with the plain samples as drafts (all accepted) and with wrong and padded drafts."""
    g = torch.Generator().manual_seed(17 + edited)
    batch, num_drafts, vocab_size, dim = 5, 3, 301, 32
    flat, weight, _ = random_problem(g, batch * (num_drafts + 1), vocab_size, dim)
    hidden = flat.view(batch, num_drafts + 1, dim)
    positions = torch.randint(0, 1000, (batch,), generator=g).to(DEVICE)
    params = mixed_params(g, batch, seed=4)
    head = head_of(g, vocab_size, "bias+softcap")
    edits = random_edits(g, (batch, num_drafts + 1), vocab_size, batch) if edited else None
    plain = torch.stack([
        reference64(sampling.sample, hidden[:, j], weight, params, positions + j, head=head,
                    edits=position_edits(edits, j)).tokens
        for j in range(num_drafts + 1)], dim=1)
    logits64 = model_logits64(hidden, weight, **head, edits=edits).view(batch, num_drafts + 1, -1)
    for drafts in (plain[:, :-1], random_drafts(g, plain.cpu(), vocab_size).to(DEVICE)):
        ours = sampling.verify(hidden, weight, drafts, params, positions, acceptance=acceptance,
                               edits=edits, backend="fused", config=CONFIGS[config], **head)
        theirs = reference64(sampling.verify, hidden, weight, drafts, params, positions,
                             head=head, acceptance=acceptance, edits=edits)
        differing = assert_verify_differences_are_near_ties(ours, theirs, logits64, params,
                                                            positions, vocab_size, torch.float64)
        same = ~differing.to(DEVICE)
        assert torch.allclose(ours.accept_probs[same].double(), theirs.accept_probs[same],
                              atol=2e-5)
        if acceptance == "strict":   # emitted tokens are the plain samples, whatever the drafts
            emitted = (ours.tokens >= 0) & same[:, None]
            assert torch.equal(ours.tokens[emitted], plain[emitted])


def test_low_precision_bias():
    """A bf16 or fp16 bias (a bf16 model's) is added exactly as its float32 value."""
    g = torch.Generator().manual_seed(6)
    batch, vocab_size = 7, 301
    hidden, weight, positions = random_problem(g, batch, vocab_size, 32)
    params = mixed_params(g, batch, seed=3)
    for dtype in (torch.bfloat16, torch.float16):
        head = head_of(g, vocab_size, "bias+softcap", dtype)
        ours = sampling.sample(hidden, weight, params, positions, backend="fused", config=SMALL,
                               **head)
        wide = sampling.sample(hidden, weight, params, positions, backend="fused", config=SMALL,
                               bias=head["bias"].float(), softcap=head["softcap"])
        for mine, theirs in zip(ours, wide):
            assert torch.equal(mine, theirs)


def test_zero_bias_changes_nothing():
    """A bias of zeros: the tokens, logprobs and log-sum-exp of the call without one, bit
    for bit."""
    g = torch.Generator().manual_seed(9)
    batch, vocab_size = 6, 257
    hidden, weight, positions = random_problem(g, batch, vocab_size, 24)
    params = mixed_params(g, batch, seed=2)
    zeros = torch.zeros(vocab_size, device=DEVICE)
    plain = sampling.sample(hidden, weight, params, positions, backend="fused", config=SMALL)
    biased = sampling.sample(hidden, weight, params, positions, backend="fused", config=SMALL,
                             bias=zeros)
    for mine, theirs in zip(biased, plain):
        assert torch.equal(mine, theirs)


@seed(0)
@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 5), vocab_size=st.integers(40, 200),
       bias_scale=st.sampled_from([0.0, 0.5, 4.0, None]),
       softcap=st.sampled_from([None, 0.5, 2.0, 8.0, 30.0]),
       logit_scale=st.sampled_from([0.3, 3.0, 30.0]), setting=st.integers(0, 1_000_000))
def test_property_fused_equals_reference(batch, vocab_size, bias_scale, softcap, logit_scale,
                                         setting):
    """Any vocabulary, bias size and softcap, logits far inside the cap or far past it
    (where tanh saturates and capped logits tie): fused = float64 reference, up to
    near-ties."""
    g = torch.Generator().manual_seed(setting)
    hidden, weight, positions = random_problem(g, batch, vocab_size, 16, scale=logit_scale)
    params = mixed_params(g, batch, seed=setting)
    bias = None if bias_scale is None else (
        bias_scale * torch.randn(vocab_size, generator=g)).to(DEVICE)
    head = dict(bias=bias, softcap=softcap)
    ours = sampling.sample(hidden, weight, params, positions, backend="fused", config=SMALL,
                           **head)
    theirs = reference64(sampling.sample, hidden, weight, params, positions, head=head)
    assert_near_ties(ours.tokens, theirs.tokens, model_logits64(hidden, weight, **head), params,
                     positions)


@pytest.mark.parametrize("keywords, match", [
    (dict(bias=torch.zeros(9)), r"`bias` must be a float tensor of shape \[10\]"),
    (dict(bias=torch.zeros(10, dtype=torch.long)), "`bias` must be a float tensor"),
    (dict(softcap=0.0), "`softcap` must be a positive float"),
    (dict(softcap=float("nan")), "`softcap` must be a positive float"),
    (dict(softcap=1e39), "`softcap` must be a positive float"),
    (dict(softcap=True), "`softcap` must be a positive float"),
])
def test_head_arguments_are_checked(keywords, match):
    hidden, weight = torch.zeros(2, 8, device=DEVICE), torch.zeros(10, 8, device=DEVICE)
    keywords = {name: value.to(DEVICE) if torch.is_tensor(value) else value
                for name, value in keywords.items()}
    params = SamplingParams.create(2, seed=0, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.long, device=DEVICE)
    for backend in ("reference", "fused"):
        with pytest.raises(ValueError, match=match):
            sampling.sample(hidden, weight, params, positions, backend=backend, **keywords)
        with pytest.raises(ValueError, match=match):
            sampling.argmax(hidden, weight, backend=backend, **keywords)


def test_compile_variants_with_head_runs_every_setting(monkeypatch):
    """`samplers.compile_variants` with the head's transforms compiles the variants that
    apply them (the engine's warm-up for a Gemma-2 target)."""
    seen = []
    launch = kernels.ops._launch
    monkeypatch.setattr(kernels.ops, "_launch", lambda *args, **kwargs: seen.append(
        (kwargs.get("bias"), kwargs.get("softcap"))) or launch(*args, **kwargs))
    weight = torch.randn(64, 16, device=DEVICE)
    bias = torch.randn(64, device=DEVICE)
    samplers.compile_variants(weight, 2, 0, bias=bias, softcap=30.0)
    assert len(seen) == len(samplers.kernel_settings(64))
    assert all(b is bias and c == 30.0 for b, c in seen)


def test_a_softcap_after_a_logit_scale_is_not_fused():
    """Cohere's scale folds into the temperature only without a softcap: a head with both
    names itself for the materialized path; a bias or a softcap alone does not."""
    cohere = tiny_model("cohere")
    assert output_head(cohere, "model").unfused_transforms() == ()
    cohere.config.final_logit_softcapping = 30.0
    reason, = output_head(cohere, "model").unfused_transforms()
    assert "final_logit_softcapping=30.0 after its logit scale 0.5" in reason
    assert output_head(_gemma2(), "model").unfused_transforms() == ()
    assert output_head(_biased(tiny_model("llama")), "model").unfused_transforms() == ()


# --------------------------------------------------------------------------------------
# generate(sampler="flash") on the fused path
# --------------------------------------------------------------------------------------

MAX_NEW = 10
SEED = 13
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9], [53, 53, 20, 21, 53]]
SAMPLINGS = {"T 0.9": dict(do_sample=True, temperature=0.9, top_k=0),
             "top-k top-p": dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8)}


@pytest.fixture
def interpreted_engine(monkeypatch):
    """On CPU the engine's target runs the fused kernels through Triton's interpreter (on
    CUDA it runs them compiled: nothing changes there); their warm-up compilation, which
    only saves time on CUDA, is skipped."""
    if ON_GPU:
        return
    target_sampler = Engine.target_sampler

    def fused(self, slot):
        if slot.processing is None and self.sampler_kind == "fused" and not self.uncompiled:
            return samplers.FusedSampler(self.head.weight, slot.call_params, bias=self.head.bias,
                                         softcap=self.head.softcap)
        return target_sampler(self, slot)

    monkeypatch.setattr(Engine, "target_sampler", fused)
    monkeypatch.setattr(Engine, "_compile_kernels", lambda self, slot, widths: None)


class Unchanged(LogitsProcessor):
    """A custom processor that changes nothing: the call runs on the materialized path
    (`heads.head_logits`, transformers' processors), the oracle of the fused one."""

    def __call__(self, input_ids, scores):
        return scores


def _gemma2(bias: bool = False):
    model = tiny_model("gemma2")
    assert model.config.final_logit_softcapping == 30.0
    with torch.no_grad():        # logits near the cap, where tanh bends them
        model.lm_head.weight.mul_(8.0)
    return _biased(model) if bias else model


def _biased(model):
    torch.manual_seed(5)
    model.lm_head.bias = torch.nn.Parameter(2.0 * torch.randn(VOCAB))
    return model


MODELS = {"gemma2": _gemma2, "biased llama": lambda: _biased(tiny_model("llama")),
          "gemma2 with a bias": functools.partial(_gemma2, bias=True)}


@functools.lru_cache(maxsize=None)
def model_of(name: str):
    return MODELS[name]()


@functools.lru_cache(maxsize=None)
def assistant():
    return tiny_draft("llama")


def speculative(model, device=None) -> dict:
    """Drafts from prompt lookup, an assistant with the same vocabulary and the model itself
    (most drafts accepted: the drafted positions' own logits decide)."""
    draft = assistant() if device is None else copy.deepcopy(assistant()).to(device)
    return {"lookup": dict(prompt_lookup_num_tokens=3),
            "assistant": dict(assistant_model=draft, num_assistant_tokens=3),
            "self": dict(assistant_model=model, num_assistant_tokens=4)}


def generate(model, ids, mask, **kwargs) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="sampler='flash' runs this call")
        return model.generate(ids, attention_mask=mask, sampler="flash",
                              **{"max_new_tokens": MAX_NEW, **kwargs})


@pytest.mark.parametrize("name", list(MODELS))
def test_generate_without_arguments_is_stock_greedy(name):
    """The models' default (greedy) with no argument, on the fused path (no warning), plain
    and speculative: stock's tokens."""
    model = model_of(name)
    ids, mask = left_pad(PROMPTS)
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    assert torch.equal(generate(model, ids, mask), stock)
    for drafter, kwargs in speculative(model).items():
        assert torch.equal(generate(model, ids, mask, **kwargs), stock), drafter


def materialized(model, ids, mask, **kwargs) -> torch.Tensor:
    """`generate` on the materialized path (forced by a processor that changes nothing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, attention_mask=mask, sampler="flash",
                              logits_processor=LogitsProcessorList([Unchanged()]),
                              **{"max_new_tokens": MAX_NEW, **kwargs})


@pytest.mark.parametrize("sampling_kwargs", list(SAMPLINGS))
@pytest.mark.parametrize("name", list(MODELS))
def test_seeded_sampling_is_exact_and_speculation_invariant(name, sampling_kwargs):
    """Seeded sampling on the fused path: the materialized path's tokens (the model's own
    logits, transformers' warpers), the same with every drafter, for one row the float64
    draw from the model's logits with the same noise, and not the tokens of the model
    without its head transforms."""
    model = model_of(name)
    options = dict(seed=SEED, **SAMPLINGS[sampling_kwargs])
    ids, mask = left_pad(PROMPTS)
    fused = generate(model, ids, mask, **options)
    assert torch.equal(fused, materialized(model, ids, mask, **options))
    for drafter, kwargs in speculative(model).items():
        assert torch.equal(generate(model, ids, mask, **options, **kwargs), fused), drafter
    one, _ = left_pad(PROMPTS[:1])
    sequence = generate(model, one, None, **options)
    warpers = [lp.TemperatureLogitsWarper(options["temperature"])]
    if options.get("top_k"):
        warpers += [lp.TopKLogitsWarper(options["top_k"]), lp.TopPLogitsWarper(options["top_p"])]
    _assert_model_reference(copy.deepcopy(model).double(), sequence, one,
                            LogitsProcessorList(warpers), row_seeds(SEED, 1))
    plain_head = copy.deepcopy(model)
    plain_head.config.final_logit_softcapping = None
    plain_head.lm_head.bias = None
    assert not torch.equal(generate(plain_head, ids, mask, **options), fused)


@pytest.mark.skipif(ON_GPU, reason="the CPU twin of test_gpu_generate_fused_head: the engine "
                    "runs the kernels through the interpreter on CPU models only")
def test_the_engine_runs_the_kernels_with_the_head(interpreted_engine, monkeypatch):
    """The engine's steps through the fused kernels themselves (Triton's interpreter on
    CPU) with a biased, softcapped head: every launch gets the head, and the tokens are the
    materialized path's, plain and speculative."""
    launches = []
    launch = kernels.ops._launch
    monkeypatch.setattr(kernels.ops, "_launch", lambda *args, **kwargs: launches.append(
        (kwargs.get("bias"), kwargs.get("softcap"))) or launch(*args, **kwargs))
    model = model_of("gemma2 with a bias")
    options = dict(seed=SEED, max_new_tokens=4, **SAMPLINGS["top-k top-p"])
    ids, mask = left_pad(PROMPTS[:2])
    fused = generate(model, ids, mask, **options)
    bias = model.lm_head.bias.data_ptr()
    assert launches and all(b.data_ptr() == bias and c == 30.0 for b, c in launches)
    assert torch.equal(fused, materialized(model, ids, mask, **options))
    for kwargs in (dict(prompt_lookup_num_tokens=3),
                   dict(assistant_model=model, num_assistant_tokens=3)):
        assert torch.equal(generate(model, ids, mask, **options, **kwargs), fused)


# --------------------------------------------------------------------------------------
# GPU: bf16, compiled, the warp-specialized kernel on Hopper
# --------------------------------------------------------------------------------------

HOPPER = ON_GPU and torch.cuda.get_device_capability()[0] == 9


def _bf16_problem(rows, vocab_size, dim, seed, truncation=False):
    """bf16 hidden states, weight and bias on CUDA; greedy and sampled rows (with
    `truncation`, every truncation mode)."""
    g = torch.Generator().manual_seed(seed)
    hidden, weight, positions = random_problem(g, rows, vocab_size, dim, torch.bfloat16)
    params = mixed_params(g, rows, seed=seed) if truncation else SamplingParams.create(
        rows, do_sample=(torch.arange(rows) % 4 != 0).tolist(), temperature=0.7, seed=seed,
        device=DEVICE)
    return hidden, weight, params, positions, head_of(g, vocab_size, "bias+softcap", torch.bfloat16)


def _ws_configs(truncation: bool):
    """Tile configurations of the Gluon kernel beside the Triton kernel with its tiles."""
    if not (HOPPER and lm_head_ws.gluon is not None):
        return []
    if truncation:
        return [kernels.default_config(256, truncation=True, warp_specialized=True),
                kernels.default_config(64, truncation=True, warp_specialized=True)]
    return [kernels.default_config(256, warp_specialized=True),
            kernels.default_config(512, warp_specialized=True),
            kernels.default_config(128, warp_specialized=True)]


TRITON_TILES = kernels.TileConfig(block_v=128, block_r=128, block_d=64, num_warps=8,
                                  num_stages=3, epilogue_parts=2)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, vocab_size, dim", [(1, 151_936, 4096), (16, 32_003, 520),
                                                   (200, 32_003, 520), (256, 151_936, 4096)])
@pytest.mark.parametrize("truncation", [False, True])
def test_gpu_bf16_sample_with_head(rows, vocab_size, dim, truncation):
    """Compiled, bf16, the default tiles (the Gluon kernel above 64 rows on Hopper): the
    float64 reference's tokens up to near-ties; each warp-specialized configuration gives
    the Triton kernel's tokens with the same head."""
    hidden, weight, params, positions, head = _bf16_problem(rows, vocab_size, dim, rows,
                                                            truncation)
    ours = sampling.sample(hidden, weight, params, positions, backend="fused", **head)
    theirs = reference64(sampling.sample, hidden, weight, params, positions, head=head)
    assert_near_ties(ours.tokens, theirs.tokens, model_logits64(hidden, weight, **head), params,
                     positions, f"R={rows}")
    greedy = sampling.argmax(hidden, weight, backend="fused", **head).tokens
    assert_near_ties(greedy, reference64(sampling.argmax, hidden, weight, head=head).tokens,
                     model_logits64(hidden, weight, **head),
                     SamplingParams.create(rows, do_sample=False, seed=0, device=DEVICE),
                     torch.zeros_like(positions), "argmax")
    triton_out = kernels.fused_sample(hidden, weight, params, positions, config=TRITON_TILES,
                                      **head)
    for config in _ws_configs(truncation):
        ws = kernels.fused_sample(hidden, weight, params, positions, config=config, **head)
        assert torch.equal(ws.status, triton_out.status)
        assert torch.equal(ws.tokens, triton_out.tokens)
        assert torch.allclose(ws.lse, triton_out.lse, rtol=1e-6, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, vocab_size, dim", [(16, 151_936, 4096), (64, 32_003, 520)])
@pytest.mark.parametrize("edited", [False, True])
def test_gpu_bf16_verify_with_head(batch, vocab_size, dim, edited):
    """Compiled bf16 verification with the head (and edits): the float64 reference's
    verification, and the Gluon kernel's equals the Triton kernel's."""
    num_drafts = 3
    hidden, weight, _, _, head = _bf16_problem(batch * (num_drafts + 1), vocab_size, dim, batch)
    hidden = hidden.view(batch, num_drafts + 1, dim)
    g = torch.Generator().manual_seed(batch)
    params = mixed_params(g, batch, seed=1)
    positions = torch.arange(batch, device=DEVICE) * 7
    edits = random_edits(g, (batch, num_drafts + 1), vocab_size, batch) if edited else None
    plain = torch.stack([
        sampling.sample(hidden[:, j], weight, params, positions + j, backend="fused", **head,
                        edits=position_edits(edits, j)).tokens
        for j in range(num_drafts + 1)], dim=1)
    drafts = random_drafts(g, plain.cpu(), vocab_size).to(DEVICE)
    ours = sampling.verify(hidden, weight, drafts, params, positions, edits=edits,
                           backend="fused", **head)
    theirs = reference64(sampling.verify, hidden, weight, drafts, params, positions, head=head,
                         edits=edits)
    differing = ((ours.tokens != theirs.tokens).any(dim=1)
                 | (ours.num_accepted != theirs.num_accepted))
    assert int(differing.sum()) <= max(1, batch // 20)
    emitted = (ours.tokens >= 0) & ~differing[:, None]
    # The emitted tokens are the plain samples, whatever the drafts.
    assert torch.equal(ours.tokens[emitted], plain[emitted])
    triton_out = kernels.fused_verify(hidden, weight, drafts, params, positions, edits=edits,
                                      config=TRITON_TILES, **head)
    for config in _ws_configs(truncation=params.any_truncation):
        ws = kernels.fused_verify(hidden, weight, drafts, params, positions, edits=edits,
                                  config=config, **head)
        for name in ("num_accepted", "tokens", "status"):
            assert torch.equal(getattr(ws, name), getattr(triton_out, name)), name


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gemma2", "gemma2 with a bias"])
def test_gpu_generate_fused_head(name, monkeypatch):
    """On CUDA (fp32 model: its forward is invariant to the step's width), the engine's fused
    kernels and graphs: every launch gets the head, greedy equals stock, seeded tokens equal
    the materialized path's and are the same with every drafter."""
    launches = []
    launch = kernels.ops._launch
    monkeypatch.setattr(kernels.ops, "_launch", lambda *args, **kwargs: launches.append(
        (kwargs.get("bias"), kwargs.get("softcap"))) or launch(*args, **kwargs))
    model = copy.deepcopy(model_of(name)).cuda()
    ids, mask = (t.cuda() for t in left_pad(PROMPTS))
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    assert torch.equal(generate(model, ids, mask), stock)
    options = dict(seed=SEED, **SAMPLINGS["top-k top-p"])
    fused = generate(model, ids, mask, **options)
    bias = None if model.lm_head.bias is None else model.lm_head.bias.data_ptr()
    assert launches and all((b is None if bias is None else b.data_ptr() == bias) and c == 30.0
                            for b, c in launches)
    assert torch.equal(fused, materialized(model, ids, mask, **options))
    for drafter, kwargs in speculative(model, "cuda").items():
        assert torch.equal(generate(model, ids, mask, **kwargs), stock), drafter
        assert torch.equal(generate(model, ids, mask, **options, **kwargs), fused), drafter
