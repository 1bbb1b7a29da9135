"""The generation engine on CUDA, where it runs the Triton kernels.

CPU twins: tests/test_generate.py and tests/test_generate_distribution.py check the same
engine logic through the torch reference (the engine, caches and drafters are the same code;
on CPU the steps run eagerly and the LM head through the reference). Here the GPU runs must agree with stock
transformers (greedy) and with the CPU reference (seeded sampling), and be speculation
invariant; where two runs diverge, the first differing token must be a near-tie of the
float64 target (bf16 and fp32 GEMMs round differently), never a plain disagreement.
"""

import functools
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import flashspec
from flashspec import rng
from flashspec.bench.statistics import acceptance_check, assert_acceptance_matches, is_near_tie
from flashspec.generation.engine import cached_engine

pytestmark = pytest.mark.gpu

VOCAB = 512


def _llama(seed: int, layers: int, dtype, device="cuda"):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, pad_token_id=0, bos_token_id=None,
                         eos_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)       # peaked enough to be a real test of sampling
    return model.to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=None)
def _pair(dtype):
    """(wrapped target, assistant) on CUDA."""
    return flashspec.wrap(_llama(0, 2, dtype)), _llama(1, 1, dtype)


@functools.lru_cache(maxsize=None)
def _cpu_pair():
    """The same pair on the CPU in float32: the engine's steps run eagerly there."""
    return flashspec.wrap(_llama(0, 2, torch.float32, "cpu")), _llama(1, 1, torch.float32, "cpu")


@functools.lru_cache(maxsize=None)
def _reference():
    """The target's initial weights in float64 on the CPU: judges near-ties."""
    return _llama(0, 2, torch.float64, device="cpu")


def _prompts(device):
    torch.manual_seed(7)
    ids = torch.randint(1, VOCAB, (4, 12), device=device)
    ids[:, 6:9] = ids[:, 0:3]                # repeated n-grams: prompt lookup drafts
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 3, 5, 8)):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


def _assert_same_or_near_tie(ids, mask, got, want, sampling: dict, seeds, tol: float):
    """Rows equal, or the first difference is a near-tie of the float64 target (the same
    initial weights, on the CPU in float64)."""
    for row in range(len(ids)):
        a, b = got[row].cpu(), want[row].cpu()
        if torch.equal(a, b):
            continue
        k = int((a != b).nonzero()[0])
        prompt_len = ids.shape[1]
        assert k >= prompt_len, "the prompt itself differs"
        real = a[:k][mask[row].cpu().bool().tolist() + [True] * (k - prompt_len)]
        with torch.no_grad():
            logits64 = _reference()(real[None]).logits[0, -1].double()
        position = len(real)
        noise = rng.gumbel(torch.tensor(int(seeds[row])), torch.tensor(position),
                           torch.arange(VOCAB)) if sampling.get("do_sample") else torch.zeros(VOCAB)
        assert is_near_tie(logits64, bool(sampling.get("do_sample")), sampling.get("temperature", 1.0),
                           sampling.get("top_k", 50 if sampling.get("do_sample") else 0),
                           sampling.get("top_p", 1.0), sampling.get("min_p", 0.0), noise.double(),
                           int(a[k]), int(b[k]), tol=tol), \
            f"row {row} differs at new token {k - prompt_len}: {int(a[k])} vs {int(b[k])}, not a near-tie"


MODES = {
    "plain": {},
    "assistant": {"assistant": True, "num_assistant_tokens": 4},
    "prompt_lookup": {"prompt_lookup_num_tokens": 3},
}


def _run(model, draft, ids, mask, mode: dict, **kwargs):
    extra = {k: v for k, v in mode.items() if k != "assistant"}
    if mode.get("assistant"):
        extra["assistant_model"] = draft
    kwargs.setdefault("sampler", "flash")
    return model.generate(ids, attention_mask=mask, max_new_tokens=16, **extra, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_greedy_matches_stock_generate_on_cuda(mode, dtype):
    model, draft = _pair(dtype)
    ids, mask = _prompts("cuda")
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    flash = _run(model, draft, ids, mask, mode, do_sample=False)
    assert flash.shape == stock.shape
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    _assert_same_or_near_tie(ids, mask, flash, stock, {}, [0] * 4, tol)


SAMPLING = {
    "plain": dict(do_sample=True, top_k=0),
    "qwen3": dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95),
    "min_p": dict(do_sample=True, top_k=0, min_p=0.05),
}


@pytest.mark.parametrize("sampling", SAMPLING.values(), ids=SAMPLING.keys())
def test_seeded_sampling_is_speculation_invariant_on_cuda_and_equals_cpu(sampling):
    model, draft = _pair(torch.float32)
    ids, mask = _prompts("cuda")
    seeds = torch.tensor([11, 12, 13, 14])
    plain = _run(model, draft, ids, mask, MODES["plain"], seed=seeds, **sampling)
    for mode in ("assistant", "prompt_lookup"):
        spec = _run(model, draft, ids, mask, MODES[mode], seed=seeds, **sampling)
        _assert_same_or_near_tie(ids, mask, spec, plain, sampling, seeds, 1e-4)
    cpu_model = flashspec.wrap(_llama(0, 2, torch.float32, device="cpu"))
    on_cpu = cpu_model.generate(ids.cpu(), attention_mask=mask.cpu(), sampler="flash", max_new_tokens=16,
                                seed=seeds, **sampling)
    _assert_same_or_near_tie(ids, mask, plain.cpu(), on_cpu, sampling, seeds, 1e-4)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_batch_rows_equal_single_runs_on_cuda(mode):
    """Each row of a batched CUDA run equals its prompt run alone (same row seed)."""
    model, draft = _pair(torch.float32)
    ids, mask = _prompts("cuda")
    seeds = torch.tensor([21, 22, 23, 24])
    sampling = SAMPLING["qwen3"]
    batched = _run(model, draft, ids, mask, mode, seed=seeds, **sampling)
    alone = torch.cat([_run(model, draft, ids[row:row + 1], mask[row:row + 1], mode,
                            seed=seeds[row:row + 1], **sampling) for row in range(len(ids))])
    _assert_same_or_near_tie(ids, mask, batched, alone, sampling, seeds, 1e-4)


@pytest.mark.parametrize("sampling", [{"do_sample": False}, SAMPLING["qwen3"]], ids=["greedy", "qwen3"])
@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_cuda_graphs_equal_the_cpu_engine(mode, sampling):
    """The engine on CUDA (CUDA graphs of compiled steps, fused kernels) and on the CPU
    (the same steps run eagerly, the torch reference) emit the same tokens, greedy and
    seeded; so does the materialized sampler on CUDA."""
    model, draft = _pair(torch.float32)
    ids, mask = _prompts("cuda")
    seeds = torch.tensor([31, 32, 33, 34])
    graphed = _run(model, draft, ids, mask, mode, seed=seeds, **sampling)
    on_cpu = _run(*_cpu_pair(), ids.cpu(), mask.cpu(), mode, seed=seeds, **sampling)
    _assert_same_or_near_tie(ids, mask, graphed, on_cpu, sampling, seeds, 1e-4)
    materialized = _run(model, draft, ids, mask, mode, seed=seeds, sampler="materialized", **sampling)
    _assert_same_or_near_tie(ids, mask, materialized, on_cpu, sampling, seeds, 1e-4)


@pytest.mark.parametrize("sampling", [{"do_sample": False}, SAMPLING["qwen3"]], ids=["greedy", "qwen3"])
def test_graphed_steps_report_accept_probabilities(sampling):
    """The captured verification steps send p(x) of every draft through the step report
    (as float64 bits): probabilities, 0/1 when greedy (then exactly the realised count), and
    sampled, the realised acceptance agrees with them (a z-test at the kit's level). The
    drafts themselves may differ from another device's at an assistant's near-tie (the
    tokens do not), so p(x) is judged against the run's own acceptance. CPU twin:
    test_speculation_stats.py."""
    model, draft = _pair(torch.float32)
    ids, mask = _prompts("cuda")
    stats = _run(model, draft, ids, mask, MODES["assistant"], seed=7,
                 return_dict_in_generate=True, **sampling).flash_stats
    assert stats.drafted.sum() > 0
    assert ((stats.accept_probs >= 0) & (stats.accept_probs <= 1)).all()
    if not sampling.get("do_sample"):
        assert ((stats.accept_probs == 0) | (stats.accept_probs == 1)).all()
        check = acceptance_check(stats)
        assert check.std == 0 and check.expected == check.realised
    else:
        assert ((stats.accept_probs > 0) & (stats.accept_probs < 1)).any()
        assert_acceptance_matches(stats, what="graphed verification")


def test_a_first_call_with_embeddings_alone_checks_the_head_on_the_gpu():
    """A model's first call (its head's logits checked against the model's own forward,
    `heads.check_logits`) given `inputs_embeds` and no ids: the check's stand-in token sits
    on the embedding's GPU (it was made on the CPU: a crash, found by the fuzz), and the
    tokens are stock's."""
    model = flashspec.wrap(_llama(7, 2, torch.float32))
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(7)).cuda()
    embeds = model.get_input_embeddings()(ids)
    mask = torch.ones_like(ids)
    kwargs = dict(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(sampler="flash", **kwargs), model.generate(**kwargs))


def test_slots_grow_and_capture_again_in_the_engine_pool():
    """A prompt longer than the slot's KV view grows the slot, which drops every graph over
    its old buffers; the captures that follow go into the same engine pool (a pool whose
    graphs were all dropped must stay usable), and tokens still equal stock's."""
    model, draft = _pair(torch.float32)
    torch.manual_seed(3)
    for length in (8, 250, 8, 250):
        ids = torch.randint(1, VOCAB, (1, length), device="cuda")
        mask = torch.ones_like(ids)
        stock = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
        for mode in MODES.values():
            flash = _run(model, draft, ids, mask, mode, do_sample=False)
            _assert_same_or_near_tie(ids, mask, flash, stock, {}, [0], 1e-4)


def test_max_time_counts_compilation_and_capture():
    """A fresh engine: a first call with max_time=0.3 would compile the decoder and the
    LM-head kernels and capture graphs (seconds); it runs uncompiled instead, ends within
    0.3 s + 0.2 s + one forward, compiles and captures nothing, and its greedy tokens are
    stock's up to bf16 near-ties. After warm-up, calls with max_time run compiled: they
    replay graphs, at every width a timed step can take, and compile or capture nothing.
    CPU twin: test_engine.py::test_max_time_runs_uncompiled_where_its_steps_would_compile."""
    model, assistant = flashspec.wrap(_llama(0, 2, torch.bfloat16)), _llama(1, 1, torch.bfloat16)
    torch.manual_seed(5)
    ids = torch.randint(1, VOCAB, (1, 12), device="cuda")
    mask = torch.ones_like(ids)
    # CUDA, cuBLAS and sdpa are set up by a stock call first: not flashspec's work to count.
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    kwargs = dict(attention_mask=mask, sampler="flash", do_sample=False)
    # Nor is CUDA loading each kernel's module at its first launch in the process (tens of
    # ms each, 0.3-0.7 s in all measured on an H200, 2026-11-28: the first call then ran out
    # of time after its first token): a twin model's uncompiled call loads them.
    twin = flashspec.wrap(_llama(0, 2, torch.bfloat16))
    twin.generate(ids, max_time=0.3, max_new_tokens=8, **kwargs)
    started = time.monotonic()
    out = model.generate(ids, max_time=0.3, max_new_tokens=10**6, **kwargs)
    seconds = time.monotonic() - started
    started = time.monotonic()
    model.generate(ids, max_time=60.0, max_new_tokens=1, **kwargs)      # one uncompiled forward
    one_forward = time.monotonic() - started
    assert seconds < 0.3 + 0.2 + one_forward, (seconds, one_forward)
    engine = cached_engine(model.model)
    assert engine.events == [] and engine.graphs == {} and engine.compiled_kernels == {}
    new = out.shape[1] - ids.shape[1]
    assert new > 1
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    _assert_same_or_near_tie(ids, mask, out, stock, {}, [0], 3e-2)

    drafts = dict(assistant_model=assistant, num_assistant_tokens=4,
                  num_assistant_tokens_schedule="constant")
    # Drafts first: attaching the assistant replaces the slot's buffers (and their graphs).
    flashspec.warmup(model, batch_sizes=(1,), max_length=256, progress=False, do_sample=False,
                     **drafts)
    flashspec.warmup(model, batch_sizes=(1,), max_length=256, progress=False, do_sample=False)
    want = model.generate(ids, max_new_tokens=64, **kwargs)
    for extra, replayed in (({}, {"plain"}),
                            (drafts, {"draft_first", "draft_next", ("verify", 1), ("verify", 4)})):
        events = len(engine.events)
        out = model.generate(ids, max_time=30.0, max_new_tokens=64, **kwargs, **extra)
        assert engine.events[events:] == []
        assert replayed <= engine.last_call_steps, engine.last_call_steps
        if not extra:      # the same graphs as the call without max_time: the same tokens
            assert torch.equal(out, want)


def test_a_capture_that_fails_midway_leaves_later_calls_working(monkeypatch):
    """A step that raises while its CUDA graph is being captured (here a ValueError, as a
    refusal raised from inside a step would be) ends that call with the error; the next
    call captures and runs, in a new memory pool (the failed capture's pool may still be
    taking allocations for it)."""
    from flashspec.generation.slot import Slot

    model = flashspec.wrap(_llama(0, 2, torch.bfloat16))
    ids = torch.randint(1, VOCAB, (1, 12), device="cuda", generator=None)
    kwargs = dict(attention_mask=torch.ones_like(ids), sampler="flash", do_sample=False,
                  max_new_tokens=4)
    plain = Slot.plain

    def refuses_while_capturing(self):
        if torch.cuda.is_current_stream_capturing():
            raise ValueError("refused inside a capture")
        return plain(self)

    monkeypatch.setattr(Slot, "plain", refuses_while_capturing)
    with pytest.raises(ValueError, match="refused inside a capture"):
        model.generate(ids, **kwargs)
    monkeypatch.setattr(Slot, "plain", plain)
    out = model.generate(ids, **kwargs)
    assert out.shape == (1, 16)
    assert "plain" in cached_engine(model.model).last_call_steps


def test_many_eos_ids_are_checked_inside_captured_steps():
    """Twenty EOS ids: torch.isin would sort them and read the host for that many, which a
    CUDA graph capture refuses; the steps compare with each id instead and stop at the first
    one emitted, as stock does (fp32: greedy tokens equal stock's). CPU twin: the EOS cuts of
    test_generate.py (the same code)."""
    model = flashspec.wrap(_llama(0, 2, torch.float32))
    ids = torch.randint(1, VOCAB, (2, 12), device="cuda", generator=None)
    free = model.generate(ids, attention_mask=torch.ones_like(ids), sampler="flash",
                          do_sample=False, max_new_tokens=12)
    eos = [int(free[0, 16])] + list(range(VOCAB - 19, VOCAB))       # row 0 stops at new token 5
    out = model.generate(ids, attention_mask=torch.ones_like(ids), sampler="flash",
                         do_sample=False, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    stock = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, stock)
    assert "plain" in cached_engine(model.model).last_call_steps


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_calls_of_every_kind_cross_the_capacity_an_earlier_call_sized(batch):
    """scripts/tok_per_s.py's sequence (where it crashed): plain, drafted, prompt lookup,
    plain again on one engine, each call ending exactly at the capacity of the slot the
    first call sized (128-token prompts, 128 new tokens: 256 columns), each followed by a
    call whose captured steps are timed (`flashspec.bench.timing.step_ms`); bf16, peaked
    weights (every draft accepted): the same tokens from every call. CPU twin:
    test_engine.py's test of the same sequence under emulated graphs."""
    from flashspec.bench.random_init import peak_weights

    model = flashspec.wrap(peak_weights(_llama(0, 2, torch.bfloat16)))
    assistant = peak_weights(_llama(1, 1, torch.bfloat16))
    torch.manual_seed(3)
    ids = torch.randint(1, VOCAB, (batch, 128), device="cuda")
    kinds = [({}, 0), (dict(assistant_model=assistant, num_assistant_tokens=5,
                            num_assistant_tokens_schedule="constant"), 5),
             (dict(prompt_lookup_num_tokens=5), 5), ({}, 0)]
    assert_calls_in_turn_agree(model, ids, kinds)


def assert_calls_in_turn_agree(model, ids, kinds) -> None:
    """Greedy calls of 128 new tokens, one per (generate kwargs, draft width) of `kinds` in
    turn on one engine, each followed by a call whose captured steps are timed (`step_ms`):
    every step timed, the same tokens from every call."""
    from flashspec.bench.timing import step_ms

    common = dict(attention_mask=torch.ones_like(ids), sampler="flash", do_sample=False,
                  max_new_tokens=128)
    outs = []
    for kind, width in kinds:
        generate = functools.partial(model.generate, ids, **common, **kind)
        outs.append(generate())
        steps = step_ms(model, generate, "fused", width)
        assert steps is not None and all(ms is None or ms > 0 for ms in steps.values()), steps
        torch.cuda.synchronize()
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_past_key_values_round_trip_on_cuda(mode):
    """bf16: a chat's second turn continues from the first's returned cache (a DynamicCache
    of bf16 entries, one per column of `sequences` but the last; the call updates it in
    place): its tokens are those of one call on the concatenated prompt, greedy and seeded,
    up to near-ties of the float64 target (a cache filled by steps and one filled by a
    prefill round differently in bf16). CPU twin:
    tests/test_cache_and_inputs.py::test_two_calls_with_the_returned_cache_are_one_call."""
    from transformers import DynamicCache

    model, draft = _pair(torch.bfloat16)
    ids, mask = _prompts("cuda")
    more = torch.tensor([[5, 6, 7]] * 4, device="cuda") + torch.arange(4, device="cuda")[:, None]
    seeds = torch.tensor([31, 32, 33, 34])
    for sampling in ({"do_sample": False}, SAMPLING["qwen3"]):
        kwargs = dict(sampling, seed=seeds) if sampling["do_sample"] else dict(sampling)
        first = _run(model, draft, ids, mask, mode, return_dict_in_generate=True, **kwargs)
        cache = first.past_key_values
        assert isinstance(cache, DynamicCache)
        assert cache.get_seq_length() == first.sequences.shape[1] - 1
        assert cache.layers[0].keys.dtype == torch.bfloat16
        ids2 = torch.cat([first.sequences, more], dim=1)
        mask2 = torch.nn.functional.pad(mask, (0, ids2.shape[1] - mask.shape[1]), value=1)
        second = _run(model, draft, ids2, mask2, mode, past_key_values=cache,
                      return_dict_in_generate=True, **kwargs)
        assert second.past_key_values is cache
        assert cache.get_seq_length() == second.sequences.shape[1] - 1
        once = _run(model, draft, ids2, mask2, mode, **kwargs)
        _assert_same_or_near_tie(ids2, mask2, second.sequences, once, sampling, seeds, 3e-2)
