"""The LM-head operations, straight from final hidden states: greedy `argmax`, `sample` and
speculative `verify`, with Hugging Face's sampling semantics and never the ``[B, V]`` logits
on the fused path.

Each returns a typed result of `flashspec.outputs` whose fields are the same whatever the
arguments. These keywords are shared:

* ``bias`` and ``softcap``: the model's head transforms, which make ``hidden @ weight.T`` the
  model's own logits: an LM-head bias ``[V]`` added, then Gemma-2's
  ``final_logit_softcapping`` c, ``c * tanh(logits / c)``, in the models' order. Every
  backend applies them first (the fused one in its kernels' epilogue), so logit edits,
  temperature and truncation, greedy rows included, see the model's logits as transformers'
  processors do.
* ``edits``: `flashspec.params.LogitEdits`, per-(row, token) edits of the model's logits
  (a logit bias, transformers' repetition penalty, vLLM's frequency and presence penalties,
  banned tokens, in that order) applied before temperature and truncation, as transformers
  applies its logits processors before its warpers; the fused backend applies them in its
  kernels' epilogue, the others to their materialized logits.

* ``backend`` picks the implementation (`BACKENDS`):

  - ``"auto"`` (default): ``"fused"`` for CUDA tensors that are not float64, ``"reference"``
    otherwise;
  - ``"fused"``: the Triton kernels (`flashspec.kernels`), which multiply by the weight tile
    by tile on chip; CUDA tensors (or any, under Triton's interpreter, TRITON_INTERPRET=1),
    float16, bfloat16 or float32;
  - ``"reference"``: float32 logits (float64 for float64 inputs) sampled by
    `flashspec.reference`, the oracle;
  - ``"materialized"``: logits as transformers computes them (a matmul in the weight's dtype,
    then float32), sampled by the reference's arithmetic: the baseline the benchmarks compare
    against.

  Every backend draws the same token from the same logits, seed and position (DESIGN §3);
  they differ only where rounding of the logits decides a near-tie.
* ``check`` decides who acts on a row's status (`flashspec.outputs`). ``True`` (for users):
  the values are validated too (positions and draft ids: device reads), non-finite rows raise
  `NonFiniteLogitsError`, and rows the fused kernels flag `NEEDS_COMPLETION` (a truncated
  support larger than their candidate budget) are completed exactly through the reference
  (counted in `flashspec.kernels.stats()`), so every status is `OK` on return. ``False``
  (for the generation engine and CUDA graphs): shapes, dtypes and devices only, no device
  read, no data-dependent allocation; each row's status is returned and flagged rows are the
  caller's.

This module is the one place that chooses the implementation and acts on the status.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

import torch

from . import reference
from .checks import (NonFiniteLogitsError, check_draft_tokens, check_lm_head,
                     check_sampling_inputs)
from .outputs import NEEDS_COMPLETION, NON_FINITE, ArgmaxOutput, SampleOutput, VerifyOutput
from .params import LogitEdits, SamplingParams

if TYPE_CHECKING:
    from .kernels import TileConfig

BACKENDS = ("auto", "fused", "reference", "materialized")
ACCEPTANCE_MODES = ("strict", "probabilistic")
# The logits each materializing backend samples.
_LOGITS = {"reference": reference.compute_logits, "materialized": reference.model_dtype_logits}


def argmax(hidden: torch.Tensor, weight: torch.Tensor, *, edits: LogitEdits | None = None,
           bias: torch.Tensor | None = None, softcap: float | None = None,
           check: bool = True, backend: str = "auto",
           config: TileConfig | None = None) -> ArgmaxOutput:
    """Greedy token of each row of ``hidden @ weight.T`` (with `bias` and `softcap`, of the
    model's logits they make).

    Args:
        hidden: ``[B, D]`` final hidden states (after the model's last norm), float16,
            bfloat16, float32 or float64.
        weight: ``[V, D]`` LM-head weight (``model.get_output_embeddings().weight``),
            contiguous, same dtype and device as `hidden`.
        edits: `LogitEdits` of the B rows (codes uint8 ``[B, V]``, penalties ``[B]``, a
            logit bias ``[B, V]``, counts ``[B, V]``), or None.
        bias: the LM-head bias, ``[V]`` of a float dtype on `weight`'s device, or None.
        softcap: a positive finite float c (logits become ``c * tanh(logits / c)`` after the
            bias), or None.
        check: validate the values of `edits` and raise `NonFiniteLogitsError` for rows
            with NaN or infinite logits (device reads); False returns them with token -1 and
            status `NON_FINITE`.
        backend: one of `BACKENDS` (module docstring).
        config: `flashspec.kernels.TileConfig` of the fused kernels (None: their fixed
            table); only with the fused backend. Results never depend on it.

    Returns:
        `ArgmaxOutput`: tokens int64 ``[B]`` (lowest id on ties), status int32 ``[B]``.

    Example:
        >>> import torch, flashspec
        >>> hidden, weight = torch.randn(2, 64), torch.randn(1000, 64)
        >>> out = flashspec.sampling.argmax(hidden, weight)
        >>> torch.equal(out.tokens, (hidden @ weight.T).argmax(-1)), out.status.tolist()
        (True, [0, 0])
    """
    check_lm_head(hidden, weight, hidden_dims=2)
    check_edits(edits, hidden, weight.shape[0], check)
    head = _checked_head(bias, softcap, weight)
    implementation = _implementation(backend, hidden, config)
    if implementation == "fused":
        out = _fused().fused_argmax(hidden, weight, edits=edits, config=config, **head)
    else:
        out = reference.argmax_logits(_edited(_LOGITS[implementation](hidden, weight, **head),
                                              edits))
    if check:
        _rows_to_complete(out.status)  # raises for non-finite rows; none needs completion
    return out


def sample(hidden: torch.Tensor, weight: torch.Tensor, params: SamplingParams,
           positions: torch.Tensor, *, edits: LogitEdits | None = None,
           bias: torch.Tensor | None = None, softcap: float | None = None, check: bool = True,
           backend: str = "auto", config: TileConfig | None = None) -> SampleOutput:
    """One token per row from softmax of the transformed logits ``hidden @ weight.T``
    (temperature, top-k, top-p, min-p in Hugging Face's order; greedy rows take the argmax),
    by Gumbel-max with the counter-based noise of `flashspec.rng`.

    Args:
        hidden: ``[B, D]`` final hidden states, as in `argmax`.
        weight: ``[V, D]`` LM-head weight, as in `argmax`.
        params: `SamplingParams` of the B rows, on `hidden`'s device.
        positions: int64 ``[B]``, the sequence index of each row's token; it keys the noise,
            so the same (seed, position) gives the same token wherever it is computed.
        edits: `LogitEdits` of the B rows, as in `argmax`, or None.
        bias, softcap: the model's head transforms, as in `argmax`.
        check: validate the positions and the values of `edits`, raise
            `NonFiniteLogitsError` for rows with NaN or infinite logits (or logits /
            temperature) and complete flagged rows exactly (module docstring); False leaves
            both to the caller, without device reads.
        backend: one of `BACKENDS`.
        config: `flashspec.kernels.TileConfig` of the fused kernels, as in `argmax`.

    Returns:
        `SampleOutput`: tokens int64 ``[B]``, logprobs and lse ``[B]`` (float32; float64 for
        float64 inputs), status int32 ``[B]``. Every field is computed on every call.

    Example:
        >>> import torch, flashspec
        >>> hidden, weight = torch.randn(4, 64), torch.randn(1000, 64)
        >>> params = flashspec.SamplingParams.create(4, temperature=0.7, top_k=50, seed=0)
        >>> positions = torch.zeros(4, dtype=torch.long)
        >>> out = flashspec.sampling.sample(hidden, weight, params, positions)
        >>> out.tokens.shape, out.status.tolist()
        (torch.Size([4]), [0, 0, 0, 0])
    """
    check_lm_head(hidden, weight, hidden_dims=2)
    check_sampling_inputs(hidden, params, positions, check_values=check)
    check_edits(edits, hidden, weight.shape[0], check)
    head = _checked_head(bias, softcap, weight)
    implementation = _implementation(backend, hidden, config)
    if implementation != "fused":
        out = reference.sample_logits(
            _edited(_LOGITS[implementation](hidden, weight, **head), edits), params, positions)
        if check:
            _rows_to_complete(out.status)  # raises for non-finite rows; none needs completion
        return out
    out = _fused().fused_sample(hidden, weight, params, positions, edits=edits, config=config,
                                **head)
    if not check:
        return out
    rows = _rows_to_complete(out.status)
    if rows.numel():
        logits = _edited(reference.compute_logits(hidden[rows], weight, **head),
                         None if edits is None else edits.select(rows))
        exact = reference.sample_logits(logits, params.select(rows), positions[rows])
        out = SampleOutput(*(field.index_copy(0, rows, part) for field, part in zip(out, exact)))
    _fused().count_checked_rows(hidden.shape[0], rows.numel())
    return out


def verify(hidden: torch.Tensor, weight: torch.Tensor, draft_tokens: torch.Tensor,
           params: SamplingParams, positions: torch.Tensor, *, acceptance: str = "strict",
           edits: LogitEdits | None = None, bias: torch.Tensor | None = None,
           softcap: float | None = None, check: bool = True, backend: str = "auto",
           config: TileConfig | None = None) -> VerifyOutput:
    """Verify G drafted tokens per row in one pass over the LM head, emitting the accepted
    drafts and one recovered or bonus token.

    Args:
        hidden: ``[B, G+1, D]`` target hidden states; ``hidden[b, j]`` predicts sequence
            index ``positions[b] + j``.
        weight: ``[V, D]`` LM-head weight, as in `argmax`.
        draft_tokens: int64 ``[B, G]`` drafted ids (from a greedy drafter) in [0, V), -1
            padded; drafts end at a row's first -1.
        params: `SamplingParams` of the B rows.
        positions: int64 ``[B]``, sequence index of each row's first drafted token.
        acceptance: ``"strict"`` (default): the target draws its own Gumbel-max sample at
            each position and accepts the draft iff they are equal; on rejection that sample
            is the recovered token. Emitted tokens are then exactly what `sample` gives at the
            same positions, whatever the drafts. ``"probabilistic"``: accept iff u < p(draft),
            u from the independent acceptance stream of `flashspec.rng`; on rejection the
            token is the Gumbel-max sample with the draft masked out. Both are exact
            speculative sampling for greedy (one-hot) drafts.
        edits: `LogitEdits` with codes uint8 ``[B, G+1, V]`` (position j's edits, made with
            the drafts before j in its context), penalties ``[B]``, a logit bias ``[B, V]``
            (every position) or ``[B, G+1, V]`` (one row per position), and counts ``[B, V]``
            before the first position (position j adds the drafts before it), or None.
        bias, softcap: the model's head transforms, as in `argmax`.
        check: as in `sample` (validates the draft ids too). Only the positions a row can
            emit count: its drafts and the one after them.
        backend: one of `BACKENDS`.
        config: `flashspec.kernels.TileConfig` of the fused kernels, as in `argmax`.

    Returns:
        `VerifyOutput`: num_accepted int64 ``[B]``, tokens int64 ``[B, G+1]`` (-1 after the
        emitted ones), accept_probs ``[B, G]``, logprobs ``[B, G+1]``, status int32 ``[B]``.

    Example:
        >>> import torch, flashspec
        >>> hidden, weight = torch.randn(2, 4, 64), torch.randn(1000, 64)
        >>> params = flashspec.SamplingParams.create(2, temperature=0.7, seed=0)
        >>> positions = torch.tensor([10, 20])
        >>> plain = torch.stack([flashspec.sampling.sample(hidden[:, j], weight, params,
        ...                                                positions + j).tokens
        ...                      for j in range(4)], dim=1)
        >>> out = flashspec.sampling.verify(hidden, weight, plain[:, :3], params, positions)
        >>> out.num_accepted.tolist(), torch.equal(out.tokens, plain)
        ([3, 3], True)
    """
    check_lm_head(hidden, weight, hidden_dims=3)
    check_draft_tokens(draft_tokens, hidden, weight.shape[0], check_values=check)
    check_sampling_inputs(hidden, params, positions, hidden.shape[1], check_values=check)
    check_edits(edits, hidden, weight.shape[0], check)
    head = _checked_head(bias, softcap, weight)
    if acceptance not in ACCEPTANCE_MODES:
        raise ValueError(f"`acceptance`={acceptance!r} is not allowed: use one of "
                         f"{ACCEPTANCE_MODES}")
    implementation = _implementation(backend, hidden, config)
    if implementation != "fused":
        out = _verify_logits(_LOGITS[implementation], hidden, weight, draft_tokens, params,
                             positions, acceptance, edits, head)
        if check:
            _rows_to_complete(out.status)  # raises for non-finite rows; none needs completion
        return out
    out = _fused().fused_verify(hidden, weight, draft_tokens, params, positions,
                                acceptance=acceptance, edits=edits, config=config, **head)
    if not check:
        return out
    rows = _rows_to_complete(out.status)
    if rows.numel():
        exact = _verify_logits(reference.compute_logits, hidden[rows], weight, draft_tokens[rows],
                               params.select(rows), positions[rows], acceptance,
                               None if edits is None else edits.select(rows), head)
        out = VerifyOutput(*(field.index_copy(0, rows, part) for field, part in zip(out, exact)))
    _fused().count_checked_rows(hidden.shape[0], rows.numel())
    return out


def _verify_logits(logits, hidden, weight, draft_tokens, params, positions, acceptance,
                   edits, head) -> VerifyOutput:
    """`reference.verify_logits` of the logits `logits(hidden rows, weight, **head)` after
    `edits`."""
    flat = logits(hidden.reshape(-1, hidden.shape[-1]), weight, **head)
    flat = _edited(flat, None if edits is None else edits.flat(draft_tokens))
    return reference.verify_logits(flat, draft_tokens, params, positions, acceptance=acceptance)


def _edited(logits: torch.Tensor, edits: LogitEdits | None) -> torch.Tensor:
    return logits if edits is None else reference.edit_logits(logits, edits)


def _checked_head(bias: torch.Tensor | None, softcap, weight: torch.Tensor) -> dict:
    """The head transforms as keywords of the logits' functions: `bias` None or a float
    tensor ``[V]`` on `weight`'s device, `softcap` None or a positive real (as a float; no
    device read)."""
    if bias is not None:
        if not torch.is_tensor(bias) or not bias.is_floating_point() \
                or bias.shape != weight.shape[:1]:
            got = (bias.dtype, tuple(bias.shape)) if torch.is_tensor(bias) else type(bias).__name__
            raise ValueError(f"`bias` must be a float tensor of shape [{weight.shape[0]}] (the "
                             f"LM-head bias), got {got}")
        if bias.device != weight.device:
            raise ValueError(f"`bias` is on {bias.device} but `weight` is on {weight.device}")
    if softcap is not None:
        # The kernels take it in float32, where it must stay a positive normal number.
        float32 = torch.finfo(torch.float32)
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) \
                or not float32.tiny <= float(softcap) <= float32.max:
            raise ValueError(f"`softcap` must be a positive float within float32's normal "
                             f"range, got {softcap!r}")
        softcap = float(softcap)
    return dict(bias=bias, softcap=softcap)


def check_edits(edits: LogitEdits | None, hidden: torch.Tensor, vocab_size: int,
                 check_values: bool = True) -> None:
    """`edits` is None or a `LogitEdits` whose tensors fit `hidden` ``[B, D]`` or
    ``[B, G+1, D]``, `vocab_size` and `hidden`'s device (`LogitEdits` gives each shape and
    dtype); with `check_values` (one device read) the values too: penalties finite in
    float32 (the repetition penalty > 0), the bias finite, the counts >= 0."""
    if edits is None:
        return
    if not isinstance(edits, LogitEdits):
        raise ValueError(f"`edits` must be a flashspec.params.LogitEdits, got {type(edits).__name__}")
    batch = hidden.shape[0]
    positions = (*hidden.shape[1:-1], vocab_size)     # [V] or [G+1, V]
    shapes = {
        "codes": (torch.uint8, [(batch, *positions)]),
        "penalty": (torch.float64, [(batch,)]),
        # Verification's bias: one row per batch row, or one per position.
        "bias": (torch.float32, sorted({(batch, vocab_size), (batch, *positions)}, key=len)),
        "counts": (torch.int32, [(batch, vocab_size)]),
        "frequency": (torch.float64, [(batch,)]),
        "presence": (torch.float64, [(batch,)]),
    }
    for name, (dtype, allowed) in shapes.items():
        tensor = getattr(edits, name)
        if tensor is None:
            continue
        if not torch.is_tensor(tensor) or tensor.dtype != dtype \
                or tuple(tensor.shape) not in allowed:
            got = (tensor.dtype, tuple(tensor.shape)) if torch.is_tensor(tensor) \
                else type(tensor).__name__
            shape = " or ".join(str(list(a)) for a in allowed)
            kind = str(dtype)[len("torch."):]
            article = "an" if kind.startswith("int") else "a"
            raise ValueError(f"`edits.{name}` must be {article} {kind} tensor of shape {shape}, "
                             f"got {got}")
        if tensor.device != hidden.device:
            raise ValueError(f"`edits.{name}` is on {tensor.device} but `hidden` is on {hidden.device}")
    pairs = (("codes", "penalty", "the repetition penalty of the PENALIZE codes"),
             ("counts", "frequency", "vLLM's frequency penalty of the counts"),
             ("counts", "presence", "vLLM's presence penalty of the counts"))
    for first, second, what in pairs:
        if (getattr(edits, first) is None) != (getattr(edits, second) is None):
            given, missing = (first, second) if getattr(edits, second) is None else (second, first)
            raise ValueError(f"`edits.{given}` is given without `edits.{missing}`: {what} "
                             f"needs both (or neither)")
    if check_values:
        _check_edit_values(edits)


def _check_edit_values(edits: LogitEdits) -> None:
    """The values `_check_edits` checks, from one device read (and one more to name a bad
    value)."""
    float32 = lambda t: t.to(torch.float32)  # noqa: E731 - as the kernels apply them
    rules = {
        "penalty": ("finite and > 0 in float32",
                    lambda p: torch.isfinite(float32(p)) & (float32(p) > 0)),
        "bias": ("finite", torch.isfinite),
        "counts": (">= 0", lambda c: c >= 0),
        "frequency": ("finite in float32", lambda f: torch.isfinite(float32(f))),
        "presence": ("finite in float32", lambda p: torch.isfinite(float32(p))),
    }
    checked = {name: is_ok(getattr(edits, name)) for name, (_, is_ok) in rules.items()
               if getattr(edits, name) is not None and getattr(edits, name).numel()}
    if not checked:
        return
    all_ok = torch.stack([ok.all() for ok in checked.values()]).tolist()
    for (name, ok), fine in zip(checked.items(), all_ok):
        if not fine:
            where = tuple(int(i) for i in (~ok).nonzero()[0])
            value = getattr(edits, name)[where].item()
            raise ValueError(f"`edits.{name}`={value} (at {list(where)}) is not allowed: must be "
                             f"{rules[name][0]}")


def _implementation(backend: str, hidden: torch.Tensor, config: TileConfig | None) -> str:
    """The backend that runs: `backend` with "auto" resolved, refused where it cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"`backend`={backend!r} is not allowed: use one of {BACKENDS}")
    if backend == "auto":
        backend = "fused" if hidden.is_cuda and hidden.dtype != torch.float64 else "reference"
    if backend != "fused":
        if config is not None:
            raise ValueError(f"`config` sets the fused kernels' tiles; backend {backend!r} "
                             "takes none (pass backend='fused', or no config)")
        return backend
    if hidden.dtype == torch.float64:
        raise ValueError("backend 'fused' takes float16, bfloat16 or float32 inputs, got "
                         "float64; use backend='reference'")
    import triton

    if not (hidden.is_cuda or triton.knobs.runtime.interpret):
        raise ValueError(f"backend 'fused' needs CUDA tensors (or Triton's interpreter: "
                         f"TRITON_INTERPRET=1), got tensors on {hidden.device}; use "
                         "backend='reference'")
    return backend


def _fused():
    """The fused kernels' launchers, imported on first use (`import flashspec` does not
    import Triton)."""
    from .kernels import ops

    return ops


def _rows_to_complete(status: torch.Tensor) -> torch.Tensor:
    """Rows flagged `NEEDS_COMPLETION`, from one read of `status` ``[B]``; raises
    `NonFiniteLogitsError` naming the `NON_FINITE` rows."""
    flagged = torch.nonzero(status).flatten()
    if not flagged.numel():  # the usual case: no further reads
        return flagged
    flagged_status = status[flagged]
    non_finite = flagged[flagged_status == NON_FINITE]
    if non_finite.numel():
        raise NonFiniteLogitsError(non_finite.tolist())
    return flagged[flagged_status == NEEDS_COMPLETION]
