"""The LM-head operations of the engine's steps, without host reads.

Both classes answer the same three questions from final hidden states through
`flashspec.sampling` with ``check=False``, reporting problems per row instead of raising, so
that a step can be captured in a CUDA graph:

* ``argmax(hidden [B, D]) -> tokens [B]`` (-1 where the logits are not finite);
* ``sample(hidden [B, D], positions [B]) -> (tokens, logprobs, status)``;
* ``verify(hidden [B, G+1, D], drafts [B, G], positions [B]) -> (num_accepted [B],
  tokens [B, G+1], logprobs [B, G+1], accept_probs [B, G], status [B])``.

A sampler of the target holds its head transforms (`OutputHead.bias`, `OutputHead.softcap`),
which every operation applies first, so that it samples the model's own logits; `sample` and
`verify` take the step's fused logit edits as ``edits`` (`LogitEdits`, made by
`edits.EditState`), applied after them and before temperature and truncation.

status is int32 ``[B]`` (`flashspec.outputs`): 0 ok, `NEEDS_COMPLETION` (a truncated support
did not fit the fused kernels' candidate budget: redo the row with `complete_sample` /
`complete_verify`), `NON_FINITE` (NaN or inf logits).

`FusedSampler` runs the fused backend (the logits never exist). `MaterializedSampler`
computes the ``[B, V]`` logits and samples them with the torch reference's arithmetic: with
`flashspec.reference.compute_logits` it *is* the reference backend; with the model-dtype
matmul (`model_dtype_logits`) it is the materialized backend, the baseline a stock stack
would run, kept to compare against.
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import kernels, parallel, reference, sampling
# The engine reads the status codes here.
from ..outputs import NEEDS_COMPLETION, NO_TOKEN_LEFT, NON_FINITE  # noqa: F401
from ..params import LogitEdits, SamplingParams
from ..reference import model_dtype_logits

# The backend of `flashspec.sampling` that samples each kind of materialized logits.
_BACKEND_OF_LOGITS = {reference.compute_logits: "reference", model_dtype_logits: "materialized"}


class _Sampler:
    """The three operations through `flashspec.sampling`'s `backend`, on `weight` with the
    head transforms `bias` (``[V]``) and `softcap` (None: none)."""

    backend: str

    def __init__(self, weight: torch.Tensor, params: SamplingParams, *,
                 bias: torch.Tensor | None = None, softcap: float | None = None):
        self.weight = weight
        self.params = params
        self.head = dict(bias=bias, softcap=softcap)

    def argmax(self, hidden: torch.Tensor, edits: LogitEdits | None = None) -> torch.Tensor:
        return sampling.argmax(hidden, self.weight, edits=edits, check=False,
                               backend=self.backend, **self.head).tokens

    def sample(self, hidden: torch.Tensor, positions: torch.Tensor,
               edits: LogitEdits | None = None):
        out = sampling.sample(hidden, self.weight, self.params, positions, edits=edits,
                              check=False, backend=self.backend, **self.head)
        return out.tokens, out.logprobs, out.status

    def verify(self, hidden: torch.Tensor, drafts: torch.Tensor, positions: torch.Tensor,
               edits: LogitEdits | None = None):
        out = sampling.verify(hidden, self.weight, drafts, self.params, positions, edits=edits,
                              check=False, backend=self.backend, **self.head)
        return out.num_accepted, out.tokens, out.logprobs, out.accept_probs, out.status


class MaterializedSampler(_Sampler):
    def __init__(self, weight: torch.Tensor, params: SamplingParams,
                 logits: Callable = reference.compute_logits, *,
                 bias: torch.Tensor | None = None, softcap: float | None = None):
        if logits not in _BACKEND_OF_LOGITS:
            raise ValueError(f"`logits` must be flashspec.reference.compute_logits or "
                             f"model_dtype_logits, got {logits!r}")
        super().__init__(weight, params, bias=bias, softcap=softcap)
        self.logits = logits
        self.backend = _BACKEND_OF_LOGITS[logits]


class FusedSampler(_Sampler):
    backend = "fused"


class ParallelSampler(_Sampler):
    """The three operations on a tensor-parallel head: `weight` (and `bias`) are this rank's
    rows of the vocabulary, `shards` their place; `flashspec.parallel` exchanges per-row
    summaries with the other ranks, which make the same calls, and returns one process's
    results on every rank, rows whose truncated support the candidates leave uncertified
    flagged `NEEDS_COMPLETION` on every rank alike (`complete_sample` / `complete_verify`
    finish them). The step's edits cover the whole vocabulary: each call passes this rank's
    columns."""

    backend = "parallel"

    def __init__(self, weight: torch.Tensor, params: SamplingParams, shards, *,
                 bias: torch.Tensor | None = None, softcap: float | None = None):
        super().__init__(weight, params, bias=bias, softcap=softcap)
        self.shards = shards

    def argmax(self, hidden: torch.Tensor, edits: LogitEdits | None = None) -> torch.Tensor:
        return parallel.argmax(hidden, self.weight, shards=self.shards,
                               edits=self.shards.local_edits(edits), check=False,
                               **self.head).tokens

    def sample(self, hidden: torch.Tensor, positions: torch.Tensor,
               edits: LogitEdits | None = None):
        out = parallel.sample(hidden, self.weight, self.params, positions, shards=self.shards,
                              edits=self.shards.local_edits(edits), check=False, complete=False,
                              **self.head)
        return out.tokens, out.logprobs, out.status

    def verify(self, hidden: torch.Tensor, drafts: torch.Tensor, positions: torch.Tensor,
               edits: LogitEdits | None = None):
        out = parallel.verify(hidden, self.weight, drafts, self.params, positions,
                              shards=self.shards, edits=self.shards.local_edits(edits),
                              check=False, complete=False, **self.head)
        return out.num_accepted, out.tokens, out.logprobs, out.accept_probs, out.status


def complete_sample(sampler, hidden: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                    edits: LogitEdits | None = None):
    """Exact `sample` of the given rows by the reference (eager): used for rows a fused step
    flagged `NEEDS_COMPLETION`, which are finite (non-finite rows are flagged `NON_FINITE`),
    as `flashspec.sampling`'s checked path completes them (a `ParallelSampler`'s with every
    rank, as `flashspec.parallel` completes them). `edits`: the step's, of every row
    (`Slot.step_edits`)."""
    params = sampler.params.select(rows, validate=False)
    edits = None if edits is None else edits.select(rows)
    if isinstance(sampler, ParallelSampler):
        out = parallel.sample(hidden[rows], sampler.weight, params, positions[rows],
                              shards=sampler.shards, edits=sampler.shards.local_edits(edits),
                              check=False, backend="reference", **sampler.head)
    else:
        out = sampling.sample(hidden[rows], sampler.weight, params, positions[rows], edits=edits,
                              check=False, backend="reference", **sampler.head)
    return out.tokens, out.logprobs.float()


def complete_verify(sampler, hidden: torch.Tensor, drafts: torch.Tensor, rows: torch.Tensor,
                    positions: torch.Tensor, edits: LogitEdits | None = None):
    """Exact `verify` of the given rows by the reference (eager), as `complete_sample`."""
    params = sampler.params.select(rows, validate=False)
    edits = None if edits is None else edits.select(rows)
    if isinstance(sampler, ParallelSampler):
        out = parallel.verify(hidden[rows], sampler.weight, drafts[rows], params, positions[rows],
                              shards=sampler.shards, edits=sampler.shards.local_edits(edits),
                              check=False, backend="reference", **sampler.head)
    else:
        out = sampling.verify(hidden[rows], sampler.weight, drafts[rows], params, positions[rows],
                              edits=edits, check=False, backend="reference", **sampler.head)
    return out.num_accepted, out.tokens, out.logprobs.float(), out.accept_probs


def kernel_settings(vocab_size: int) -> dict[str, dict]:
    """One sampling setting per variant of the fused kernels that rows sharing one setting
    select (`kernels.ops.kernel_variant`): the argmax epilogue, Gumbel-max over the whole
    vocabulary, candidates normalised over a top-k, candidates with the full log-sum-exp (a
    top-p or min-p without a top-k), and a top-k that keeps the whole vocabulary."""
    return {"greedy": dict(do_sample=False), "sampled": dict(top_k=0),
            "top-k": dict(top_k=min(50, vocab_size - 1)), "top-p": dict(top_k=0, top_p=0.9),
            "top-k of V": dict(top_k=vocab_size)}


# The inputs a step's `LogitEdits` can hold beyond its penalties, each a kernel variant.
EDIT_INPUTS = ("codes", "bias", "position bias", "counts")


def compile_variants(weight: torch.Tensor, rows: int, width: int, edits: tuple[str, ...] = (), *,
                     bias: torch.Tensor | None = None, softcap: float | None = None,
                     shards=None) -> None:
    """Run the fused `sample` (``width == 0``) or `verify` of `width` drafts for `rows` rows
    with every setting of `kernel_settings` on zeros, so that Triton compiles (or loads from
    its disk cache) each variant now: a later call that only changes its sampling setting
    then compiles nothing. `edits`: the logit edits' inputs the steps hold, names of
    `EDIT_INPUTS` (`edits.EditState.kernel_inputs`): the variants that apply codes, a bias
    per row or per position, counts (all of them changing nothing here); with `bias` /
    `softcap`, those that apply the head's transforms. With `shards` (`weight` is this
    rank's rows of a tensor-parallel head), the per-shard kernels of `flashspec.parallel`
    (`kernels.fused_shard_summaries`) and the merge (`kernels.merge_shard_summaries`, on
    this rank's words as every rank's), without any exchange. Eager, outside any graph."""
    if not isinstance(edits, tuple) or not set(edits) <= set(EDIT_INPUTS):
        raise ValueError(f"`edits` must be a tuple of names from {EDIT_INPUTS}, got "
                         f"{type(edits).__name__} {edits!r}")
    hidden = weight.new_zeros(rows, width + 1, weight.shape[1]) if width else \
        weight.new_zeros(rows, weight.shape[1])
    positions = torch.zeros(rows, dtype=torch.long, device=weight.device)
    no_edits = None
    if edits:
        device, vocab = weight.device, weight.shape[0]
        codes = torch.zeros(*hidden.shape[:-1], vocab, dtype=torch.uint8, device=device)
        ones = torch.ones(rows, dtype=torch.float64, device=device)
        no_edits = LogitEdits(codes, ones)
        if "bias" in edits or "position bias" in edits:
            shape = hidden.shape[:-1] if "position bias" in edits else (rows,)
            no_edits = no_edits._replace(
                bias=torch.zeros(*shape, vocab, dtype=torch.float32, device=device))
        if "counts" in edits:
            no_edits = no_edits._replace(
                counts=torch.zeros(rows, vocab, dtype=torch.int32, device=device),
                frequency=ones, presence=ones)
    vocab_size = weight.shape[0] if shards is None else shards.vocab_size
    drafts = positions.new_zeros(rows, width)
    for setting in kernel_settings(vocab_size).values():
        params = SamplingParams.create(rows, device=weight.device, **setting)
        if shards is not None:
            layout = parallel.summary_layout("verify" if width else "sample", shards, params)
            words = kernels.fused_shard_summaries(hidden, weight, layout, params, positions,
                                                  shards.offset, vocab_size,
                                                  drafts=drafts if width else None,
                                                  edits=no_edits, bias=bias, softcap=softcap)
            # The merge of every rank's words: this rank's stand in for all of them.
            gathered = words.expand(shards.world_size, *words.shape)
            for acceptance in parallel.sampling.ACCEPTANCE_MODES if width else ("strict",):
                kernels.merge_shard_summaries(gathered, layout, vocab_size, params, positions,
                                              drafts if width else None, acceptance)
            continue
        sampler = FusedSampler(weight, params, bias=bias, softcap=softcap)
        if width:
            sampler.verify(hidden, drafts, positions, edits=no_edits)
        else:
            sampler.sample(hidden, positions, edits=no_edits)
