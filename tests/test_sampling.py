"""`flashspec.sampling`, the one public door to the LM-head operations: its backends, the
`check` flag, the typed results, the one definition of the row status codes, and the engine's
samplers on top of it. What each backend computes is checked in test_reference.py (the
reference), test_kernels.py and test_verify_kernel.py (the fused kernels)."""

import ast
import contextlib
import functools
from pathlib import Path
from unittest import mock

import pytest
import torch
import triton

import flashspec
from flashspec import SamplingParams, kernels, outputs, reference, sampling
from flashspec.generation import samplers
from flashspec.outputs import NEEDS_COMPLETION, NON_FINITE, OK

from test_kernels import DEVICE, ON_GPU, SMALL, mixed_params, random_problem

MATERIALIZING = ("reference", "materialized")
# Per-row parameters that take each of the fused kernels' paths: greedy only (no noise),
# sampled without truncation (stage 1's noise and log-sum-exp), every row with a top-k below
# V (no log-sum-exp in stage 1: the candidates normalise), and all of them mixed (supports
# within the candidate budget: no row needs completion).
PARAMS = {
    "greedy": dict(do_sample=False),
    "untruncated": dict(temperature=[0.7, 1.0, 1.5, 0.6]),
    "top_k": dict(temperature=0.8, top_k=[5, 3, 7, 10]),
    "mixed": dict(do_sample=[True, False, True, True], temperature=[0.7, 1.0, 0.6, 1.2],
                  top_k=[0, 0, 5, 0], top_p=[1.0, 1.0, 0.9, 1.0], min_p=[0.0, 0.0, 0.0, 0.3]),
}


@functools.lru_cache(maxsize=1)
def _problem():
    """hidden [4, 32], hidden [4, 3, 32], weight [200, 32], drafts [4, 2], positions [4] on
    DEVICE (made once: no test changes them, and copies to a GPU would sync)."""
    batch, num_drafts, vocab_size, dim = 4, 2, 200, 32
    g = torch.Generator().manual_seed(0)
    flat, weight, positions = random_problem(g, batch * (num_drafts + 1), vocab_size, dim)
    hidden3 = flat.view(batch, num_drafts + 1, dim)
    drafts = torch.randint(0, vocab_size, (batch, num_drafts), generator=g).to(DEVICE)
    return hidden3[:, 0].contiguous(), hidden3, weight, drafts, positions[:batch]


def _call(operation, backend, params, **kwargs):
    hidden, hidden3, weight, drafts, positions = _problem()
    config = dict(config=SMALL) if backend == "fused" else {}
    if operation == "argmax":
        return sampling.argmax(hidden, weight, backend=backend, **config, **kwargs)
    if operation == "sample":
        return sampling.sample(hidden, weight, params, positions, backend=backend, **config,
                               **kwargs)
    return sampling.verify(hidden3, weight, drafts, params, positions, backend=backend,
                           **config, **kwargs)


def test_status_codes_are_defined_once():
    """`flashspec.outputs` holds the only assignments of the status codes; the kernels'
    constexprs and the engine's names are those values."""
    names = {"OK", "NEEDS_COMPLETION", "NON_FINITE", "STATUS_OK", "STATUS_NEEDS_COMPLETION",
             "STATUS_NON_FINITE"}
    package = Path(flashspec.__file__).parent
    defined = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name) and name.id in names:
                        defined.setdefault(name.id, []).append(path.relative_to(package).as_posix())
    assert defined == {"OK": ["outputs.py"], "NEEDS_COMPLETION": ["outputs.py"],
                       "NON_FINITE": ["outputs.py"]}
    merge = kernels.merge
    assert (merge._OK.value, merge._NEEDS_COMPLETION.value, merge._NON_FINITE.value) \
        == (OK, NEEDS_COMPLETION, NON_FINITE) == (0, 1, 2)
    assert (samplers.NEEDS_COMPLETION, samplers.NON_FINITE) == (NEEDS_COMPLETION, NON_FINITE)


@pytest.mark.parametrize("backend", ["fused", *MATERIALIZING])
@pytest.mark.parametrize("case", list(PARAMS))
def test_results_have_the_same_fields_whatever_the_flags(backend, case):
    """Every backend, `check` either way and every kernel path return the one NamedTuple
    type of each operation, with every field computed: sampling's logprobs and log-sum-exps
    are the reference's (within rounding) even where the kernels take no log-sum-exp in
    stage 1, and its status is OK."""
    params = SamplingParams.create(4, seed=3, device=DEVICE, **PARAMS[case])
    hidden, hidden3, weight, drafts, positions = _problem()
    expected = reference.sample_logits(reference.compute_logits(hidden, weight), params, positions)
    results = {check: (_call("argmax", backend, params, check=check),
                       _call("sample", backend, params, check=check),
                       _call("verify", backend, params, check=check))
               for check in (True, False)}
    for check, (greedy, sampled, verified) in results.items():
        assert type(greedy) is outputs.ArgmaxOutput and greedy._fields == ("tokens", "status")
        assert type(sampled) is outputs.SampleOutput
        assert sampled._fields == ("tokens", "logprobs", "lse", "status")
        assert type(verified) is outputs.VerifyOutput
        assert verified._fields == ("num_accepted", "tokens", "accept_probs", "logprobs", "status")
        assert [(t.shape, t.dtype) for t in sampled] == [
            ((4,), torch.int64), ((4,), torch.float32), ((4,), torch.float32), ((4,), torch.int32)]
        assert [(t.shape, t.dtype) for t in verified] == [
            ((4,), torch.int64), ((4, 3), torch.int64), ((4, 2), torch.float32),
            ((4, 3), torch.float32), ((4,), torch.int32)]
        assert [(t.shape, t.dtype) for t in greedy] == [((4,), torch.int64), ((4,), torch.int32)]
        for result in (greedy, sampled, verified):
            assert (result.status == OK).all(), (check, result.status)
        same = sampled.tokens == expected.tokens
        assert same.sum() >= 3  # a near-tie at most (the materialized logits are rounded)
        for field in ("logprobs", "lse"):
            theirs = getattr(expected, field)[same]
            tolerance = 5e-2 if backend == "materialized" else 2e-4
            assert torch.allclose(getattr(sampled, field)[same], theirs, atol=tolerance), field
    for a, b in zip(results[True], results[False]):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@pytest.mark.parametrize("operation", ["argmax", "sample", "verify"])
def test_a_bad_backend_is_refused_by_name(operation):
    params = SamplingParams.create(4, seed=0, device=DEVICE)
    allowed = r"\('auto', 'fused', 'reference', 'materialized'\)"
    with pytest.raises(ValueError, match=rf"`backend`='triton' is not allowed: use one of {allowed}"):
        _call(operation, "triton", params)


def test_backends_are_refused_where_they_cannot_run(monkeypatch):
    hidden, _, weight, _, positions = _problem()
    params = SamplingParams.create(4, seed=0, device=DEVICE)
    with pytest.raises(ValueError, match="`config` sets the fused kernels' tiles; backend "
                                         "'reference' takes none"):
        sampling.sample(hidden, weight, params, positions, backend="reference", config=SMALL)
    with pytest.raises(ValueError, match="backend 'fused' takes float16, bfloat16 or float32"):
        sampling.argmax(hidden.double(), weight.double(), backend="fused")
    if not ON_GPU:
        monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
        with pytest.raises(ValueError, match="backend 'fused' needs CUDA tensors"):
            sampling.argmax(hidden, weight, backend="fused")


def test_the_automatic_backend_is_the_reference_for_cpu_and_float64():
    hidden, hidden3, weight, drafts, positions = (t.cpu() for t in _problem())
    params = mixed_params(torch.Generator().manual_seed(1), 4).to("cpu")
    for h, h3, w in ((hidden, hidden3, weight), (hidden.double(), hidden3.double(), weight.double())):
        for operation, args in ((sampling.argmax, (h, w)),
                                (sampling.sample, (h, w, params, positions)),
                                (sampling.verify, (h3, w, drafts, params, positions))):
            ours, theirs = operation(*args), operation(*args, backend="reference")
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_the_materialized_backend_samples_logits_in_the_models_dtype():
    """bf16 logits as transformers rounds them, sampled with the reference's arithmetic."""
    hidden, hidden3, weight, drafts, positions = (t.cpu() for t in _problem())
    hidden, hidden3, weight = hidden.bfloat16(), hidden3.bfloat16(), weight.bfloat16()
    params = mixed_params(torch.Generator().manual_seed(2), 4).to("cpu")
    logits = torch.nn.functional.linear(hidden, weight).float()
    flat_logits = torch.nn.functional.linear(hidden3.reshape(-1, hidden3.shape[-1]), weight).float()
    for ours, theirs in (
            (sampling.argmax(hidden, weight, backend="materialized"),
             reference.argmax_logits(logits)),
            (sampling.sample(hidden, weight, params, positions, backend="materialized"),
             reference.sample_logits(logits, params, positions)),
            (sampling.verify(hidden3, weight, drafts, params, positions, backend="materialized"),
             reference.verify_logits(flat_logits, drafts, params, positions))):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


class DeviceRead(Exception):
    pass


@contextlib.contextmanager
def host_reads_refused():
    """Every `torch.Tensor` method (and `torch.nonzero`) that brings values to the host, or
    sizes a tensor by them, raises `DeviceRead` (Triton's interpreter moves the kernels' data
    without them)."""
    def refuse(name):
        def method(*args, **kwargs):
            raise DeviceRead(name)
        return method
    with contextlib.ExitStack() as stack:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__",
                     "nonzero", "cpu", "numpy"):
            stack.enter_context(mock.patch.object(torch.Tensor, name, refuse(name)))
        stack.enter_context(mock.patch.object(torch, "nonzero", refuse("torch.nonzero")))
        yield


@pytest.mark.parametrize("operation", ["argmax", "sample", "verify"])
@pytest.mark.parametrize("backend", MATERIALIZING)
def test_unchecked_materializing_backends_read_nothing_off_the_cpu(operation, backend):
    """Meta tensors have no values, so any read of one raises: off the CPU, where a step may
    be captured in a graph, check=False runs through, and a read of its result (the teeth)
    cannot. On the CPU the reference reads how many tokens can win the noise's race (the
    engine runs eagerly there: nothing to capture, no device to wait for)."""
    params = mixed_params(torch.Generator().manual_seed(4), 4)
    on_meta = lambda t: t.to("meta")  # noqa: E731
    with mock.patch(f"{__name__}._problem", return_value=tuple(map(on_meta, _problem()))):
        out = _call(operation, backend, params._map(on_meta, validate=False), check=False)
    assert out.status.shape == (4,) and out.status.is_meta
    with pytest.raises((NotImplementedError, RuntimeError), match="meta"):
        out.status.max().item()


@pytest.mark.skipif(ON_GPU, reason="the GPU twin below watches the device's syncs instead")
@pytest.mark.parametrize("operation", ["argmax", "sample", "verify"])
def test_unchecked_fused_backend_reads_nothing(operation):
    params = mixed_params(torch.Generator().manual_seed(4), 4)
    with host_reads_refused():
        out = _call(operation, "fused", params, check=False)
        with pytest.raises(DeviceRead):
            _call(operation, "fused", params, check=True)
    assert out.status.shape == (4,)


@pytest.mark.gpu
@pytest.mark.parametrize("operation", ["argmax", "sample", "verify"])
def test_unchecked_fused_backend_never_syncs_gpu(operation):
    params = mixed_params(torch.Generator().manual_seed(4), 4)
    _call(operation, "fused", params, check=False)  # compiles, and copies the problem over
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _call(operation, "fused", params, check=False)
        with pytest.raises(RuntimeError, match="synchroniz"):
            _call(operation, "fused", params, check=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_checked_calls_complete_flagged_rows_and_return_status_ok():
    """A support larger than the candidate budget: check=False returns the rows flagged with
    token -1, check=True completes them through the reference (counted)."""
    g = torch.Generator().manual_seed(5)
    hidden, weight, positions = random_problem(g, 3, 30, 16)  # one vocab tile of SMALL
    params = SamplingParams.create(3, temperature=1.5, top_k=12, top_p=0.5, seed=3, device=DEVICE)
    flagged = sampling.sample(hidden, weight, params, positions, check=False, backend="fused",
                              config=SMALL)
    assert flagged.status.tolist() == [NEEDS_COMPLETION] * 3 and (flagged.tokens == -1).all()
    kernels.reset_stats()
    done = sampling.sample(hidden, weight, params, positions, backend="fused", config=SMALL)
    assert kernels.stats().rows_completed == 3 and kernels.stats().rows_sampled == 3
    assert (done.status == OK).all()
    expected = sampling.sample(hidden, weight, params, positions, backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(done, expected))


@pytest.mark.parametrize("kind", ["fused", *MATERIALIZING])
def test_the_engines_samplers_answer_through_the_door(kind):
    """`FusedSampler` and `MaterializedSampler` (reference or model-dtype logits) give the
    door's unchecked results, as tuples in the engine's order; the completions give the
    reference's."""
    params = mixed_params(torch.Generator().manual_seed(6), 4, seed=6)
    hidden, hidden3, weight, drafts, positions = _problem()
    if kind == "fused":
        sampler = samplers.FusedSampler(weight, params)
    else:
        logits = reference.compute_logits if kind == "reference" else samplers.model_dtype_logits
        sampler = samplers.MaterializedSampler(weight, params, logits=logits)
    assert sampler.weight is weight and sampler.params is params
    unchecked = dict(backend=kind, check=False)
    out = sampling.verify(hidden3, weight, drafts, params, positions, **unchecked)
    assert all(torch.equal(a, b) for a, b in zip(
        sampler.verify(hidden3, drafts, positions),
        (out.num_accepted, out.tokens, out.logprobs, out.accept_probs, out.status)))
    out = sampling.sample(hidden, weight, params, positions, **unchecked)
    assert all(torch.equal(a, b) for a, b in zip(sampler.sample(hidden, positions),
                                                 (out.tokens, out.logprobs, out.status)))
    assert torch.equal(sampler.argmax(hidden), sampling.argmax(hidden, weight, **unchecked).tokens)
    rows = torch.tensor([2, 0], device=DEVICE)
    exact = sampling.sample(hidden[rows], weight, params.select(rows), positions[rows],
                            backend="reference")
    tokens, logprobs = samplers.complete_sample(sampler, hidden, rows, positions)
    assert torch.equal(tokens, exact.tokens) and torch.equal(logprobs, exact.logprobs)
    exact = sampling.verify(hidden3[rows], weight, drafts[rows], params.select(rows),
                            positions[rows], backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(
        samplers.complete_verify(sampler, hidden3, drafts, rows, positions),
        (exact.num_accepted, exact.tokens, exact.logprobs, exact.accept_probs)))


def test_a_materialized_sampler_takes_only_the_logits_the_door_knows():
    weight = torch.randn(10, 4)
    with pytest.raises(ValueError, match="`logits` must be flashspec.reference.compute_logits"):
        samplers.MaterializedSampler(weight, SamplingParams.create(1, seed=0),
                                     logits=lambda hidden, weight: hidden @ weight.T)
