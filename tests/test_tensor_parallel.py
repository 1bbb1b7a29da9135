"""`generate(sampler="flash")` on a tensor-parallel transformers model: a tiny Llama loaded
with ``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`` (the
``tp_plan="auto"`` of transformers before 5.18) on 2 and 3 gloo ranks (transformers' DTensor
split: attention heads and MLP columns per rank, the LM head over the vocabulary), as
torchrun would start it.

Each rank runs every case and checks it against the same model loaded whole in its own
process: the seeded and greedy tokens are the same (plain, prompt lookup, an assistant
replicated on every rank and a tensor-parallel one; truncation; fused logit edits; the
materialized path), greedy equals stock transformers' tensor-parallel generate, seeds drawn
without `seed` agree across ranks, and what ranks could decide differently is refused.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList
from transformers.distributed import DistributedConfig

import flashspec

from _ranks import run_ranks

# Heads divisible by 2 and 3; a vocabulary too (transformers' colwise_gather_output asks it).
VOCAB = 1002
COLLECTIVE_TIMEOUT_S, SPAWN_TIMEOUT_S = 60, 240
PROMPTS = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [0, 0, 0, 9, 10, 11, 9, 10, 11, 9]])
MASK = (PROMPTS != 0).long()
MASK[0] = 1

CASES = {
    "greedy": dict(do_sample=False),
    "sampled": dict(do_sample=True, temperature=0.9, top_k=0),
    "truncated": dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8),
    "min_p": dict(do_sample=True, min_p=0.05, top_k=0),
    # Supports wider than the summaries' candidates: every step completes rows.
    "wide top-p": dict(do_sample=True, temperature=3.0, top_k=0, top_p=0.999),
    "prompt lookup": dict(do_sample=True, temperature=0.9, top_k=0, prompt_lookup_num_tokens=3),
    "edits": dict(do_sample=True, temperature=0.9, top_k=0, repetition_penalty=3.0,
                  bad_words_ids=[[7], [9, 10]], no_repeat_ngram_size=2, presence_penalty=0.5,
                  frequency_penalty=-1.0, logit_bias={11: 8.0, 5: -1.0, 400: 6.0},
                  sequence_bias=[[[11, 5], 3.0]]),
}
# Verification with every kind of edit: codes, a per-position bias, counts and the drafts.
CASES["edits, prompt lookup"] = dict(CASES["edits"], prompt_lookup_num_tokens=3)


class Unchanged(LogitsProcessor):
    """Changes nothing: the call runs on the materialized path (logits gathered)."""

    def __call__(self, input_ids, scores):
        return scores


def _save_tiny(path: str, seed: int, layers: int) -> None:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=96, intermediate_size=192,
                         num_hidden_layers=layers, num_attention_heads=6, num_key_value_heads=6,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         pad_token_id=0, bos_token_id=None, eos_token_id=None)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)         # peaked enough that sampling decides something
    model.save_pretrained(path)


def _generate(model, **kwargs):
    """The call's tokens; on a tensor-parallel model with sampler="flash", also that it ran
    on the engine's fused path, exchanging summaries (no fallback, no deferral to stock)."""
    device = model.device
    split = hasattr(model.lm_head.weight, "placements") and kwargs.get("sampler") == "flash"
    flashspec.parallel.reset_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(PROMPTS.to(device), attention_mask=MASK.to(device),
                             max_new_tokens=12, **kwargs).cpu()
    messages = [str(w.message) for w in caught]
    assert not any("defers this call to stock" in m for m in messages), messages
    if split and "logits_processor" not in kwargs:
        assert not any("materialized path" in m for m in messages), messages
        assert flashspec.parallel.stats().calls > 0
    return out


@contextlib.contextmanager
def _counted(module, name: str):
    """`module.name` replaced by a wrapper that records each call; yields the records."""
    original, calls = getattr(module, name), []

    def counted(*args, **kwargs):
        calls.append(None)
        return original(*args, **kwargs)
    setattr(module, name, counted)
    try:
        yield calls
    finally:
        setattr(module, name, original)


def _cases(rank: int, world_size: int, folder: str) -> dict:
    cuda = torch.cuda.is_available()
    split = dict(distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32)
    whole_on = dict(dtype=torch.float32, device_map=f"cuda:{rank}" if cuda else None)
    target = flashspec.from_pretrained(f"{folder}/target", **split)
    whole = flashspec.from_pretrained(f"{folder}/target", **whole_on)
    draft = flashspec.from_pretrained(f"{folder}/draft", **whole_on)
    draft_split = flashspec.from_pretrained(f"{folder}/draft", **split)
    head = target.lm_head.weight
    assert head.to_local().shape[0] == VOCAB // world_size
    report = {}
    cases = dict(CASES)
    cases["assistant"] = dict(CASES["sampled"], assistant_model=draft, num_assistant_tokens=3)
    cases["tensor-parallel assistant"] = dict(CASES["truncated"], assistant_model=draft_split)
    cases["materialized path"] = dict(CASES["sampled"],
                                      logits_processor=LogitsProcessorList([Unchanged()]))
    for name, kwargs in cases.items():
        with _counted(flashspec.generation.samplers, "complete_sample") as completions:
            split = _generate(target, sampler="flash", seed=7, **kwargs)
        if name == "wide top-p":       # the engine completed the rows the summaries flagged
            assert completions, "no row was completed"
        one = _generate(whole, sampler="flash", seed=7,
                        **{k: (draft if v is draft_split else v) for k, v in kwargs.items()})
        assert torch.equal(split, one), (name, split.tolist(), one.tolist())
        report[name] = split[:, PROMPTS.shape[1]:].tolist()
    # Greedy: stock transformers' own tensor-parallel generate.
    assert torch.equal(_generate(target, sampler="flash", do_sample=False),
                       _generate(target, do_sample=False))
    # Seeds drawn from each rank's own generator: rank 0's are used everywhere, on the fused
    # path and on the materialized one (where each rank draws from all the logits).
    for extra in ({}, dict(logits_processor=LogitsProcessorList([Unchanged()]))):
        torch.manual_seed(100)
        rank0_seeds = flashspec.params.row_seeds(None, len(PROMPTS)).to(whole.device)
        torch.manual_seed(100 + rank)
        drawn = _generate(target, sampler="flash", do_sample=True, top_k=0, **extra)
        assert torch.equal(drawn, _generate(whole, sampler="flash", do_sample=True, top_k=0,
                                            seed=rank0_seeds, **extra)), extra
    # Ranks with different memory budgets agree on the smallest before deciding on slots.
    engine = flashspec.generation.engine.cached_engine(target.get_decoder())
    engine.memory_budget = 10**12 + rank
    _generate(target, sampler="flash", do_sample=False)
    assert engine.memory_budget == 10**12
    # After a capture (CUDA), a failure on one rank fails it on all, and the graphs' pool
    # bytes the budget reads are the most any rank's took.
    assert engine._agreed_capture(rank == world_size - 1, 1000 + rank) == (True, 999 + world_size)
    assert engine._agreed_capture(False, 5) == (False, 5)
    for kwargs, message in ((dict(max_time=5.0), "`max_time`=5.0"),
                            (dict(invariant=True), "`invariant=True` is not supported"),
                            (dict(sampler="materialized"), "sampler='materialized' is not supported")):
        kwargs.setdefault("sampler", "flash")
        with pytest.raises(ValueError, match=message):
            _generate(target, **kwargs)
    return report


def _worker(rank: int, world_size: int, init_file: str, folder: str, report_file: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    backend = "gloo"
    if torch.cuda.is_available():     # a rank per GPU, NCCL, fp32 without TF32
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        backend = "nccl"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        report = _cases(rank, world_size, folder)
        if rank == 0:
            with open(report_file, "w") as f:
                json.dump(report, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_models")
    _save_tiny(str(path / "target"), 0, 2)
    _save_tiny(str(path / "draft"), 1, 1)
    return str(path)


@pytest.mark.parametrize("world_size", [2, 3])
def test_tensor_parallel_generate_equals_one_process(world_size, folder, tmp_path):
    """On CPU (gloo); on a machine with GPUs, the same on one GPU per rank (NCCL): there the
    engine's steps are compiled and captured with their collectives, the LM head's by the
    fused kernels per shard, and each rank destroys its process group with its engines
    alive (their graphs released first: `teardown`)."""
    if torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    report = run_ranks(_worker, world_size, (str(tmp_path / "init"), folder),
                       str(tmp_path / "report.json"), __name__, SPAWN_TIMEOUT_S)
    # The cases decide different tokens (each compares something the option decides).
    assert report["greedy"] != report["sampled"] != report["truncated"]
    assert report["edits"] != report["sampled"]


def test_destroying_a_process_group_releases_graphs_that_hold_collectives(tmp_path, monkeypatch):
    """A CUDA graph that captured an NCCL collective keeps its communicator from being
    destroyed: `destroy_process_group` then waits forever on every rank (issue 50's 2-rank
    hang; docs/notes/tp_capture.md). An engine that may hold such graphs (`teardown.hold`: a
    tensor-parallel model's, on GPUs) has them released when its group, or the default group,
    is destroyed, while the group still exists. gloo, one rank; GPU twin: the test above on
    2 GPUs."""
    import types

    from flashspec.generation import teardown

    for module in (dist, dist.distributed_c10d):          # restored after the test
        monkeypatch.setattr(module, "destroy_process_group", dist.destroy_process_group)
    monkeypatch.setattr(teardown, "atexit", types.SimpleNamespace(register=lambda fn: None))
    released = []

    class Engine:
        def __init__(self, name):
            self.name = name

        def release(self):
            released.append((self.name, dist.is_initialized()))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    subgroup = dist.new_group([0])
    default, sub = Engine("default"), Engine("sub")
    teardown.hold(default, None)
    wrapped = dist.destroy_process_group
    teardown.hold(sub, subgroup)
    assert dist.destroy_process_group is wrapped is dist.distributed_c10d.destroy_process_group
    assert not hasattr(wrapped.__wrapped__, "_releases_flashspec_graphs")    # wrapped once
    dist.destroy_process_group(subgroup)
    assert released == [("sub", True)]
    dist.destroy_process_group()
    assert released[1:] == [("default", True), ("sub", True)] and not dist.is_initialized()
