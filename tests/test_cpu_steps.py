"""The CPU form of the engine's steps (`flashspec.generation.cpu`, issue 48): how the LM head's
few rows are multiplied, the decode loop's threads and inference mode, verifications that
check only the drafted columns, and `invariant=True` refused where its kernels cannot run.
What they compute stays stock's: tokens equal stock's and the plain run's throughout."""

from __future__ import annotations

import pytest
import torch

from flashspec import reference
from flashspec.generation import cpu
from flashspec.generation import engine as engine_module
from flashspec.generation import slot as slot_module

from _models import tiny_model


@pytest.mark.parametrize("vocab, width", [(8192, 32), (1000, 600), (23, 64), (7, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_head_product_of_few_rows_is_the_matrix_product(vocab, width, dtype):
    """Blocks of 16 weight rows (and a remainder: 1000 = 62 * 16 + 8; 7 rows: no block)
    multiply the hidden rows as ``hidden @ weight.T`` does, up to the order of the sums,
    in every shape the samplers pass (``[B, D]``, ``[B, G+1, D]``)."""
    g = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, width, generator=g, dtype=dtype)
    for shape in [(1, width), (3, width), (2, 4, width), (9, width)]:
        hidden = torch.randn(*shape, generator=g, dtype=dtype)
        exact = hidden.double() @ weight.double().T
        got = reference.matmul(hidden, weight)
        assert got.shape == exact.shape and got.dtype == dtype and got.is_contiguous()
        tolerance = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(got.double(), exact, rtol=tolerance, atol=tolerance * width)


def test_head_product_of_many_rows_is_torchs():
    """More rows than a decode step has (a prefill's): torch's own product, bit for bit."""
    weight, hidden = torch.randn(512, 64), torch.randn(9, 64)
    assert torch.equal(reference.matmul(hidden, weight), hidden @ weight.T)


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_decode_steps_of_a_small_model_run_on_one_thread_in_inference_mode(two_threads,
                                                                         monkeypatch):
    monkeypatch.setattr(cpu, "SMALL_STEP_BYTES", 2000)
    decoder = torch.nn.Linear(10, 20, bias=False)             # 800 bytes
    small, large = torch.zeros(100), torch.zeros(400)
    cpu_device = torch.device("cpu")
    with cpu.decode_steps(cpu_device, [decoder], small, eager=True, invariant=False):
        assert torch.get_num_threads() == 1 and torch.is_inference_mode_enabled()
        with cpu.outside_inference_mode():
            assert not torch.is_inference_mode_enabled() and not torch.is_grad_enabled()
    assert torch.get_num_threads() == 2 and not torch.is_inference_mode_enabled()
    with cpu.decode_steps(cpu_device, [decoder, decoder], decoder.weight, eager=True,
                          invariant=False):
        assert torch.get_num_threads() == 1            # a tied head and a shared model: once
    with cpu.decode_steps(cpu_device, [decoder], large, eager=True, invariant=False):
        assert torch.get_num_threads() == 2 and torch.is_inference_mode_enabled()
    with pytest.raises(RuntimeError, match="inside"):
        with cpu.decode_steps(cpu_device, [decoder], small, eager=True, invariant=False):
            raise RuntimeError("inside")
    assert torch.get_num_threads() == 2 and "forward" not in decoder.__dict__
    with cpu.decode_steps(cpu_device, [decoder], small, eager=True, invariant=True):
        assert "forward" not in decoder.__dict__        # the invariant kernels' linears
    # Compiled steps (inference mode would compile them again) and CUDA: left as they are.
    for device, eager in [(cpu_device, False), (torch.device("cuda"), True)]:
        with cpu.decode_steps(device, [decoder], small, eager=eager, invariant=False):
            assert torch.get_num_threads() == 2 and not torch.is_inference_mode_enabled()
            assert "forward" not in decoder.__dict__


def test_few_rows_of_plain_float32_linears_go_by_blocks(monkeypatch):
    """Inside `few_row_linears` a plain fp32 `nn.Linear` sends up to 8 rows to
    `reference.matmul` (bias added after); more rows, other dtypes, subclasses and forwards
    replaced by hooks keep theirs; every forward is restored after."""
    calls = []
    monkeypatch.setattr(cpu, "matmul", lambda x, w: calls.append(x.shape) or x @ w.T)

    class Sub(torch.nn.Linear):
        pass

    plain, biased, half, sub = (torch.nn.Linear(8, 32, bias=False), torch.nn.Linear(8, 32),
                                torch.nn.Linear(8, 32).to(torch.bfloat16), Sub(8, 32))
    hooked = torch.nn.Linear(8, 32)
    hooked.forward = lambda x: x          # as accelerate's hooks replace a module's forward
    model = torch.nn.ModuleList([plain, biased, half, sub, hooked])
    x = torch.randn(2, 3, 8)
    with cpu.few_row_linears([model]):
        torch.testing.assert_close(biased(x), torch.nn.functional.linear(x, biased.weight,
                                                                         biased.bias))
        plain(x), plain(torch.randn(9, 8)), half(x.bfloat16()), sub(x)
        assert hooked(x) is x
    assert calls == [(2, 3, 8), (2, 3, 8)]
    assert all("forward" not in layer.__dict__ for layer in (plain, biased, half, sub))
    assert "forward" in hooked.__dict__


def test_outputs_and_state_outlive_the_decode_loop(two_threads):
    """What a call returns, and the slot it grows inside its decode loop (which runs in
    inference mode), are ordinary tensors: the caller may write them, the next call too."""
    model = tiny_model("llama")
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    kwargs = dict(sampler="flash", do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    for new in (8, 300, 20):                               # the second call grows the slot
        out = model.generate(ids, max_new_tokens=new, prompt_lookup_num_tokens=3, **kwargs)
        assert not out.sequences.is_inference()
        out.sequences[0, 0] = 1                            # writable in place
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("sampling", [dict(do_sample=False),
                                      dict(do_sample=True, top_k=0, seed=3)])
def test_cpu_verifications_check_only_drafted_columns(monkeypatch, sampling):
    """On the CPU a verification checks up to the last column some row drafted, none when
    no row found an n-gram (a one-token step, as stock's prompt lookup then takes); the
    tokens are the plain call's (and greedy, stock's)."""
    widths = []
    verify = slot_module.Slot.verify
    monkeypatch.setattr(slot_module.Slot, "verify",
                        lambda self, width: (widths.append(width), verify(self, width))[1])
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(2)
    phrase = torch.randint(1, 100, (6,), generator=g)
    ids = torch.stack([torch.cat([phrase, torch.randint(1, 100, (4,), generator=g), phrase]),
                       torch.randint(1, 100, (16,), generator=g)])
    kwargs = dict(sampler="flash", max_new_tokens=24, pad_token_id=0, **sampling)
    lookup = model.generate(ids, prompt_lookup_num_tokens=4, **kwargs)
    assert 0 in widths and max(widths) == 4 and len(set(widths)) > 2, widths
    assert torch.equal(lookup, model.generate(ids, **kwargs))
    if not sampling["do_sample"]:
        stock = tiny_model("llama").generate(ids, max_new_tokens=24, do_sample=False,
                                             pad_token_id=0)
        assert torch.equal(lookup, stock)


def test_invariant_without_its_kernels_is_refused_before_anything_runs(monkeypatch):
    """A CPU model without Triton's interpreter: `invariant=True` cannot run its kernels
    (Triton would fail with "0 active drivers" inside the first forward)."""
    import triton

    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"`invariant`=True is not supported for a model on "
                                         r"cpu: .* need a CUDA GPU"):
        model.generate(torch.tensor([[5, 6, 7]]), sampler="flash", invariant=True,
                       max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert engine_module.cached_engine(model.model) is None


@pytest.mark.parametrize("threshold, most", [(1.0, 1), (0.0, 4), (0.05, None)])
def test_an_unconfident_draft_ends_the_rows_drafts_on_the_cpu(monkeypatch, threshold, most):
    """With `assistant_confidence_threshold` 1 every draft is below it: each row drafts one
    token per step (kept, as stock keeps it), and the verification checks that column
    alone; 0 drafts the full count; in between, rows stop on their own in a batch. The
    tokens are the plain call's either way."""
    from _models import tiny_draft

    widths = []
    verify = slot_module.Slot.verify
    monkeypatch.setattr(slot_module.Slot, "verify",
                        lambda self, width: (widths.append(width), verify(self, width))[1])
    model, assistant = tiny_model("llama"), tiny_draft("llama")
    ids = torch.randint(1, 100, (3, 7), generator=torch.Generator().manual_seed(4))
    kwargs = dict(sampler="flash", max_new_tokens=16, pad_token_id=0, do_sample=True, top_k=0,
                  seed=5)
    drafted = model.generate(ids, assistant_model=assistant, num_assistant_tokens=4,
                             assistant_confidence_threshold=threshold, **kwargs)
    assert widths and (most is None or max(widths) == most)
    assert torch.equal(drafted, model.generate(ids, **kwargs))


def test_the_confidence_threshold_is_checked():
    from _models import tiny_draft

    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"`assistant_confidence_threshold` must be a number "
                                         r"in \[0, 1\], got 2 \(set in the call\)"):
        model.generate(torch.tensor([[5, 6, 7]]), sampler="flash", max_new_tokens=4,
                       assistant_model=tiny_draft("llama"), assistant_confidence_threshold=2,
                       pad_token_id=0)


def test_a_call_inside_the_callers_inference_mode_grows_and_compacts_its_slot():
    """Buffers made inside the caller's inference mode are updated in it throughout: the
    decode loop leaves only the inference mode it entered itself, to grow or compact."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(6)
    phrase = torch.randint(1, 100, (5,), generator=g)
    ids = torch.stack([torch.cat([phrase, torch.randint(1, 100, (3,), generator=g), phrase])
                       for _ in range(3)])
    kwargs = dict(sampler="flash", max_new_tokens=240, do_sample=False, pad_token_id=0,
                  prompt_lookup_num_tokens=4)
    with torch.inference_mode():
        inside = model.generate(ids, **kwargs)
    assert torch.equal(inside, tiny_model("llama").generate(ids, **kwargs))
