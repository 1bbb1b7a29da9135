"""Vocab-parallel `argmax`, `sample` and `verify`: the LM head split over the ranks of a
`torch.distributed` process group by vocabulary rows, tokens identical to one process.

Each rank holds a contiguous shard ``[V_r, D]`` of the LM-head weight (`VocabShards` says
which) and the same hidden states, parameters, positions and drafts. A call:

1. computes the shard's logits and summarises each row of them (`shard.py`): the best
   Gumbel-perturbed score and its global id, the log-sum-exp, the draft's logit and, where
   the call truncates, the shard's top candidates; the noise is keyed by global token ids;
2. all-gathers the summaries, one collective of a few bytes per row (`summary.py` lists
   them: 8 per row for `argmax`, 16 for `sample`, 20 per position for `verify`, 8 more per
   candidate and 8 for their floor);
3. merges them on every rank identically (`merge.py`, `acceptance.py`; where the fused
   kernels summarised, in one kernel: `flashspec.kernels.merge_shard_summaries`): the same
   tokens, logprobs, log-sum-exps and statuses everywhere;
4. for truncated rows whose support the candidates do not certify, and only for them, runs
   steps 1-3 again with `RETRY_FACTOR` times the candidates; the rows still uncertified
   then all-gather their logits and are sampled by `flashspec.reference`
   (`exchange.stats()` counts both).

Results are `flashspec.sampling`'s on the full weight (reference backend): the same tokens
except at near-ties (the logits' rounding, which a shard's matmul may change; and top-p /
min-p boundaries within rounding of their threshold), logprobs and log-sum-exps to float32
rounding. Every rank must call with the same arguments but its own `weight` (and `bias`,
`edits` codes) shard; each call is a collective.

Arguments are `flashspec.sampling`'s, with these differences: `weight` ``[V_r, D]``,
`bias` ``[V_r]`` and the `edits` codes ``[..., V_r]`` are this rank's shards; draft ids are
global; `shards` (keyword) is the layout; `candidates` sets the truncation budget
(`summary.summary_layout`); float64 inputs are refused (the candidates' keys hold float32);
`backend` says who summarises a shard (`BACKENDS`): "fused", the fused kernels' stage 1
over the shard and a per-shard stage 2 (`flashspec.kernels.fused_shard_summaries`: the
logits never exist), or "reference", torch ops on the shard's logits (`shard.py`); "auto"
takes the fused kernels for CUDA tensors. With ``complete=True`` (the default) rows the
candidates leave uncertified are completed (step 4), so no status is `NEEDS_COMPLETION`;
with ``complete=False`` they come back with that status and no host read happens: without
`check`, a fused `sample` or `verify` is then one fixed sequence of kernels and one
collective, which a CUDA graph can hold (`flashspec.generation`'s engine completes such
rows after its step, through this module again).
"""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from .. import kernels, reference
from ..checks import NonFiniteLogitsError, check_draft_tokens, check_lm_head, check_sampling_inputs
from ..outputs import NEEDS_COMPLETION, NON_FINITE, OK, ArgmaxOutput, SampleOutput, VerifyOutput
from ..params import LogitEdits, SamplingParams
from ..sampling import check_edits
from . import shard, summary
from .acceptance import accept, flat_drafts
from .exchange import all_gather_logits, all_gather_summaries, count_retried
from .layout import VocabShards
from .merge import merge_argmax, merge_rows
from .summary import DEFAULT_CANDIDATES

ACCEPTANCE_MODES = ("strict", "probabilistic")
# What the fused route's merge returns for the uncertified rows: flagged in the statuses
# (finite rows only: a row not finite stays NON_FINITE, neither retried nor completed).
_FLAGGED = object()
BACKENDS = ("auto", "fused", "reference")


def argmax(hidden: torch.Tensor, weight: torch.Tensor, *, shards: VocabShards,
           edits: LogitEdits | None = None, bias: torch.Tensor | None = None,
           softcap: float | None = None, check: bool = True,
           backend: str = "auto") -> ArgmaxOutput:
    """Greedy token of each row of ``hidden @ full_weight.T``, as `flashspec.sampling.argmax`.

    Args:
        hidden: ``[B, D]`` final hidden states, the same on every rank.
        weight: ``[V_r, D]`` this rank's rows of the LM head, ``shards.size`` of them.
        shards: `VocabShards`, the layout of the shards over the process group.
        edits, bias, softcap: as in `flashspec.sampling.argmax`, this rank's shard of the
            edit codes (``[B, V_r]``) and of the bias (``[V_r]``).
        check: raise `NonFiniteLogitsError` for non-finite rows (on every rank).
        backend: one of `BACKENDS` (module docstring).

    Returns:
        `ArgmaxOutput` with global token ids, the same on every rank.

    Example (on each of n ranks, after ``torch.distributed.init_process_group``):
        >>> shards = VocabShards.chunked(full_weight.shape[0])
        >>> out = flashspec.parallel.argmax(hidden, shards.local(full_weight), shards=shards)
    """
    _check(hidden, weight, shards, 2, edits, bias, softcap, check=check)
    layout = summary.summary_layout("argmax", shards)
    implementation = _backend(backend, hidden)
    words = _summaries(implementation, hidden, weight, layout, None, None, shards,
                       edits=edits, bias=bias, softcap=softcap)
    gathered = all_gather_summaries(words, shards)
    if implementation == "fused":
        out = kernels.merge_shard_summaries(gathered, layout, shards.vocab_size)
    else:
        out = merge_argmax(summary.unpack(gathered, layout))
    if check:
        _raise_non_finite(out.status)
    return out


def sample(hidden: torch.Tensor, weight: torch.Tensor, params: SamplingParams,
           positions: torch.Tensor, *, shards: VocabShards,
           candidates: int = DEFAULT_CANDIDATES, edits: LogitEdits | None = None,
           bias: torch.Tensor | None = None, softcap: float | None = None,
           check: bool = True, complete: bool = True, backend: str = "auto") -> SampleOutput:
    """One token per row, as `flashspec.sampling.sample` on the full LM head.

    Args:
        hidden, weight, shards, edits, bias, softcap: as in `argmax`.
        params: `SamplingParams` of the B rows, the same on every rank.
        positions: int64 ``[B]``, each row's sequence index (keys the noise).
        candidates: candidate keys each rank sends per row where the call truncates (raised
            to the largest top-k + 1 up to `summary.MAX_TOP_K_CANDIDATES`).
        check: validate the positions and raise `NonFiniteLogitsError` for non-finite rows;
            False returns them with status `NON_FINITE`.
        complete: complete uncertified truncated rows; False returns them with status
            `NEEDS_COMPLETION` (module docstring).
        backend: one of `BACKENDS`.

    Returns:
        `SampleOutput`, the same on every rank.

    Example (on each rank):
        >>> params = flashspec.SamplingParams.create(4, temperature=0.7, top_p=0.9, seed=0)
        >>> out = flashspec.parallel.sample(hidden, shards.local(full_weight), params,
        ...                                 positions, shards=shards)
    """
    _check(hidden, weight, shards, 2, edits, bias, softcap, candidates, check=check)
    check_sampling_inputs(hidden, params, positions, check_values=check)
    layout = summary.summary_layout("sample", shards, params, candidates)
    head = {"bias": bias, "softcap": softcap}
    implementation = _backend(backend, hidden)

    def merged(rows, layout, implementation="reference"):
        if rows is None:
            return _sampled(implementation, hidden, weight, params, positions, shards, layout,
                            edits, head)
        return _sampled(implementation, hidden[rows], weight,
                        params.select(rows, validate=False), positions[rows], shards, layout,
                        None if edits is None else edits.select(rows), head)

    def exact(rows):
        logits = shard.shard_logits(hidden[rows], weight, **head,
                                    edits=None if edits is None else edits.select(rows))
        return reference.sample_logits(all_gather_logits(logits, shards, rows.numel()),
                                       params.select(rows, validate=False), positions[rows])

    out = _completed(merged, exact, implementation, layout, shards, complete)
    if check:
        _raise_non_finite(out.status)
    return out


def verify(hidden: torch.Tensor, weight: torch.Tensor, draft_tokens: torch.Tensor,
           params: SamplingParams, positions: torch.Tensor, *, shards: VocabShards,
           acceptance: str = "strict", candidates: int = DEFAULT_CANDIDATES,
           edits: LogitEdits | None = None, bias: torch.Tensor | None = None,
           softcap: float | None = None, check: bool = True, complete: bool = True,
           backend: str = "auto") -> VerifyOutput:
    """Verification of G drafted tokens per row, as `flashspec.sampling.verify` on the full
    LM head.

    Args:
        hidden: ``[B, G+1, D]`` target hidden states, the same on every rank.
        weight, shards, bias, softcap: as in `argmax`.
        draft_tokens: int64 ``[B, G]`` global draft ids, -1 padded.
        params, positions, candidates: as in `sample` (positions: each row's first draft's
            sequence index).
        acceptance: "strict" or "probabilistic", as in `flashspec.sampling.verify`.
        edits: this rank's shard of the edits, codes ``[B, G+1, V_r]``.
        check: as in `sample`; validates the draft ids too.
        complete, backend: as in `sample`.

    Returns:
        `VerifyOutput`, the same on every rank.
    """
    _check(hidden, weight, shards, 3, edits, bias, softcap, candidates, check=check)
    check_draft_tokens(draft_tokens, hidden, shards.vocab_size, check_values=check)
    check_sampling_inputs(hidden, params, positions, hidden.shape[1], check_values=check)
    if acceptance not in ACCEPTANCE_MODES:
        raise ValueError(f"`acceptance`={acceptance!r} is not allowed: use one of "
                         f"{ACCEPTANCE_MODES}")
    num_positions = hidden.shape[1]
    layout = summary.summary_layout("verify", shards, params, candidates)
    head = {"bias": bias, "softcap": softcap}
    flat = []   # the edits one row per position: made once, only for torch summaries

    def flat_edits(rows=None):
        if edits is None:
            return None
        if not flat:
            flat.append(_flat_edits(edits, draft_tokens, shards))
        if rows is None:
            return flat[0]
        offsets = torch.arange(num_positions, device=rows.device)
        return flat[0].select((rows[:, None] * num_positions + offsets[None, :]).flatten())

    implementation = _backend(backend, hidden)

    def merged(rows, layout, implementation="reference"):
        if rows is None:
            return _verified(implementation, hidden, weight, draft_tokens, params, positions,
                             shards, layout, acceptance, edits, flat_edits, head)
        return _verified(implementation, hidden[rows], weight, draft_tokens[rows],
                         params.select(rows, validate=False), positions[rows], shards, layout,
                         acceptance, None if edits is None else edits.select(rows),
                         lambda: flat_edits(rows), head)

    def exact(rows):
        logits = shard.shard_logits(hidden[rows].flatten(0, 1), weight, **head,
                                    edits=flat_edits(rows))
        return reference.verify_logits(all_gather_logits(logits, shards, rows.numel()),
                                       draft_tokens[rows], params.select(rows, validate=False),
                                       positions[rows], acceptance=acceptance)

    out = _completed(merged, exact, implementation, layout, shards, complete)
    if check:
        _raise_non_finite(out.status)
    return out


def _sampled(implementation, hidden, weight, params, positions, shards, layout, edits, head):
    """`SampleOutput` of the rows of `hidden` ``[R, D]`` from one exchange of summaries at
    `layout`, and what says which rows the candidates left uncertified: bool ``[R]``, or
    `_FLAGGED` (the fused route's merge flagged them in the statuses), or None (the layout
    has no candidates: every row is decided)."""
    words = _summaries(implementation, hidden, weight, layout, params, positions, shards,
                       edits=edits, **head)
    gathered = all_gather_summaries(words, shards)
    if implementation == "fused":
        out = kernels.merge_shard_summaries(gathered, layout, shards.vocab_size, params,
                                            positions)
        return out, _FLAGGED if layout.num_candidates else None
    rows = merge_rows(summary.unpack(gathered, layout), shards, params, positions)
    out = SampleOutput(torch.where(rows.finite, rows.tokens, -1),
                       torch.where(rows.finite, rows.logprobs, float("nan")),
                       torch.where(rows.finite, rows.lse, float("nan")),
                       torch.where(rows.finite, OK, NON_FINITE).to(torch.int32))
    return out, rows.incomplete if layout.num_candidates else None


def _verified(implementation, hidden, weight, draft_tokens, params, positions, shards, layout,
              acceptance, edits, flat_edits, head):
    """`VerifyOutput` of the batch rows of `hidden` ``[B, G+1, D]`` from one exchange of
    summaries at `layout`, and bool ``[B]``: the rows with an uncertified position among
    those they emit from (or `_FLAGGED`, or None, as `_sampled` says). The fused kernels take
    `edits` (one row per batch row, codes per position); the torch summaries
    ``flat_edits()`` (one row per position)."""
    batch_size, num_positions, dim = hidden.shape
    if implementation == "fused":
        # A position after a row's first padding keeps its id here; the merge kernel reads
        # none there, and the acceptance chain never emits from it.
        words = kernels.fused_shard_summaries(
            hidden, weight, layout, params, positions, shards.offset, shards.vocab_size,
            drafts=draft_tokens, edits=edits, **head)
        out = kernels.merge_shard_summaries(all_gather_summaries(words, shards), layout,
                                            shards.vocab_size, params, positions,
                                            draft_tokens, acceptance)
        return out, _FLAGGED if layout.num_candidates else None
    drafts = flat_drafts(draft_tokens)
    flat_params = params.repeat_interleave(num_positions, validate=False)
    offsets = torch.arange(num_positions, device=positions.device)
    flat_positions = (positions[:, None] + offsets[None, :]).flatten()
    words = shard.summaries(hidden.reshape(-1, dim), weight, layout, flat_params,
                            flat_positions, shards, drafts, edits=flat_edits(), **head)
    rows = merge_rows(summary.unpack(all_gather_summaries(words, shards), layout), shards,
                      flat_params, flat_positions, drafts)
    out = accept(rows, draft_tokens, params, positions, acceptance)
    if not layout.num_candidates:
        return out, None
    # Positions after a row's drafts end are never emitted: their certificate does not count.
    has_draft = drafts.view(batch_size, num_positions) >= 0
    used = offsets[None, :] <= has_draft.sum(dim=1, keepdim=True)
    return out, (rows.incomplete.view(batch_size, num_positions) & used).any(dim=1)


def _summaries(implementation, hidden, weight, layout, params, positions, shards, *, edits,
               bias, softcap):
    """This rank's summary words of the rows of `hidden` ``[R, D]`` (sampling, argmax)."""
    if implementation == "fused":
        return kernels.fused_shard_summaries(hidden, weight, layout, params, positions,
                                             shards.offset, shards.vocab_size, edits=edits,
                                             bias=bias, softcap=softcap)
    return shard.summaries(hidden, weight, layout, params, positions, shards, edits=edits,
                           bias=bias, softcap=softcap)


def _backend(backend: str, hidden: torch.Tensor) -> str:
    """The summaries' implementation: `backend` with "auto" resolved, refused where it
    cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"`backend`={backend!r} is not allowed: use one of {BACKENDS}")
    if backend == "auto":
        return "fused" if hidden.is_cuda else "reference"
    if backend == "fused":
        kernels.ops.check_device(hidden)
    return backend


def _completed(merged, exact, implementation: str, layout: summary.SummaryLayout,
               shards: VocabShards, complete: bool):
    """The call's output: ``merged(None, layout, implementation)`` for every row; with
    `complete`, then, for the rows it leaves uncertified, ``merged(rows, larger layout)``
    (torch summaries: the retry is rare and wants more candidates than the kernels merge),
    then ``exact(rows)`` (from the gathered logits) for the rows still uncertified; every
    rank reaches the same rows. Without it, those rows are flagged `NEEDS_COMPLETION`."""
    out, incomplete = merged(None, layout, implementation)
    if incomplete is None:      # no candidates: every row decided
        return out
    if incomplete is _FLAGGED:
        if not complete:
            return out
        incomplete = out.status == NEEDS_COMPLETION
    elif not complete:
        return _flag_incomplete(out, incomplete)
    retry = summary.retry_layout(layout, shards)
    for finish in ("retry", "exact") if retry is not None else ("exact",):
        rows = incomplete.nonzero().flatten()
        if not rows.numel():
            break
        if finish == "retry":
            part, still = merged(rows, retry)
            count_retried(rows.numel())
        else:
            part, still = exact(rows), torch.zeros_like(rows, dtype=torch.bool)
        out = type(out)(*(field.index_copy(0, rows, value) for field, value in zip(out, part)))
        incomplete = torch.zeros_like(incomplete).index_copy(0, rows, still)
    return out


def _flag_incomplete(out, incomplete: torch.Tensor):
    """`out` with its finite `incomplete` rows flagged `NEEDS_COMPLETION` and their tokens
    -1, as the fused kernels flag theirs."""
    flagged = incomplete & (out.status == OK)
    status = torch.where(flagged, NEEDS_COMPLETION, out.status).to(torch.int32)
    if isinstance(out, SampleOutput):
        return out._replace(tokens=torch.where(flagged, -1, out.tokens), status=status)
    return out._replace(num_accepted=torch.where(flagged, -1, out.num_accepted),
                        tokens=torch.where(flagged[:, None], -1, out.tokens),
                        logprobs=torch.where(flagged[:, None], 0.0, out.logprobs), status=status)


def _check(hidden, weight, shards, hidden_dims, edits, bias, softcap,
           candidates: int = DEFAULT_CANDIDATES, check: bool = True) -> None:
    """The shapes, dtypes and layout of a call; with `check`, the edits' values too (one
    device read, as `flashspec.sampling`'s)."""
    if not isinstance(shards, VocabShards):
        raise ValueError(f"`shards` must be a flashspec.parallel.VocabShards, got "
                         f"{type(shards).__name__}")
    check_lm_head(hidden, weight, hidden_dims)
    if hidden.dtype == torch.float64:
        raise ValueError("flashspec.parallel takes float16, bfloat16 or float32 inputs (its "
                         "candidate keys hold float32 logits), got float64")
    if weight.shape[0] != shards.size:
        raise ValueError(f"`weight` has {weight.shape[0]} rows but rank {shards.rank}'s shard "
                         f"holds {shards.size} (`shards.sizes`={list(shards.sizes)})")
    if dist.get_world_size(shards.group) != shards.world_size \
            or dist.get_rank(shards.group) != shards.rank:
        raise ValueError(f"`shards` describes rank {shards.rank} of {shards.world_size}, but "
                         f"this process is rank {dist.get_rank(shards.group)} of "
                         f"{dist.get_world_size(shards.group)} in its group")
    if isinstance(candidates, bool) or not isinstance(candidates, numbers.Integral) \
            or candidates < 1:
        raise ValueError(f"`candidates` must be a positive int, got {candidates!r}")
    if bias is not None and (not torch.is_tensor(bias) or not bias.is_floating_point()
                             or bias.shape != (shards.size,) or bias.device != weight.device):
        raise ValueError(f"`bias` must be this rank's shard of the LM-head bias: a float tensor "
                         f"of shape [{shards.size}] on {weight.device}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                                or not torch.finfo(torch.float32).tiny <= softcap
                                <= torch.finfo(torch.float32).max):
        raise ValueError(f"`softcap` must be a positive float within float32's normal range, "
                         f"got {softcap!r}")
    # This rank's columns of the edits: `flashspec.sampling`'s checks with the shard's size.
    check_edits(edits, hidden, shards.size, check)


def _flat_edits(edits, drafts: torch.Tensor, shards: VocabShards):
    """Verification's `edits` one row per position, their per-token counts (where they have
    them) counting the drafts this shard holds, by shard column. The drafts say how many
    positions there are, also for edits that hold nothing per position (a ``[B, V]`` bias
    alone)."""
    column = drafts - shards.offset
    here = (drafts >= 0) & (column >= 0) & (column < shards.size)
    return edits.flat(torch.where(here, column, -1))


def _raise_non_finite(status: torch.Tensor) -> None:
    rows = (status == NON_FINITE).nonzero().flatten()
    if rows.numel():
        raise NonFiniteLogitsError(rows.tolist())
