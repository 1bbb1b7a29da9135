"""Per-row sampling parameters, validated, with Hugging Face `GenerationConfig` semantics.

A row is *greedy* when ``do_sample`` is False or ``temperature == 0``: its token is the
argmax of the raw logits (lowest id on ties, as ``torch.argmax``). Otherwise the logits go
through HF's warpers in HF's order, each only where HF would apply it:

    temperature (if != 1)  ->  top-k (if > 0)  ->  top-p (if < 1)  ->  min-p (if > 0)

Float parameters are stored as float64, i.e. exactly the Python floats the user gave, so
that every implementation can round them the way transformers does.

The module also holds `LogitEdits`, the other input every LM-head operation takes, with its
codes (about 550 lines: what the reference, the kernels and `generate` all read).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple, Sequence, Union

import torch

from . import rng

RowValues = Union[bool, int, float, Sequence, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of a batch, one entry per row, all tensors of shape ``[B]``.

    Attributes:
        do_sample: bool. False means greedy for that row.
        temperature: float64, finite and >= 0; 0 means greedy, 1 means unscaled.
        top_k: int64, >= 0; 0 disables top-k. Values above the vocabulary keep everything.
        top_p: float64 in (0, 1]; 1 disables top-p.
        min_p: float64 in [0, 1]; 0 disables min-p.
        seed: int64 in [0, 2**63); keys the row's noise together with the sequence position
            (see `flashspec.rng`).

    Build one with `SamplingParams.create` (scalars or per-row values) or
    `SamplingParams.from_generation_config` (HF semantics and defaults).
    """

    do_sample: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor
    # Host-side summaries, computed once at construction (validation reads the values
    # anyway) so that kernel launches never need a device-to-host read.
    any_truncation: bool = dataclasses.field(init=False, repr=False, compare=False)
    all_greedy: bool = dataclasses.field(init=False, repr=False, compare=False)
    any_top_k: bool = dataclasses.field(init=False, repr=False, compare=False)
    any_top_p: bool = dataclasses.field(init=False, repr=False, compare=False)
    any_min_p: bool = dataclasses.field(init=False, repr=False, compare=False)
    # Every row sampled with a top-k below the vocabulary (`max_top_k`: the largest top-k,
    # 0 where none): stage 1 of the fused kernels can leave out the full log-sum-exp (the
    # candidates normalise the support).
    all_top_k: bool = dataclasses.field(init=False, repr=False, compare=False)
    max_top_k: int = dataclasses.field(init=False, repr=False, compare=False)
    # Greedy rows, and the largest top-k of sampled rows without top-p or min-p (top-k 0,
    # which keeps everything, counted as 2**63 - 1; 0 where there are none): every sampled
    # row is truncated below a vocabulary of more than `max_plain_top_k` tokens.
    any_greedy: bool = dataclasses.field(init=False, repr=False, compare=False)
    max_plain_top_k: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        expected = {
            "do_sample": torch.bool, "temperature": torch.float64, "top_k": torch.int64,
            "top_p": torch.float64, "min_p": torch.float64, "seed": torch.int64,
        }
        batch_size = None
        device = self.do_sample.device if torch.is_tensor(self.do_sample) else None
        for name, dtype in expected.items():
            value = getattr(self, name)
            if not torch.is_tensor(value):
                raise ValueError(f"`{name}` must be a torch.Tensor, got {type(value).__name__}")
            if value.dtype != dtype:
                raise ValueError(f"`{name}` must have dtype {dtype}, got {value.dtype}")
            if value.dim() != 1:
                raise ValueError(f"`{name}` must have shape [batch_size], got {tuple(value.shape)}")
            if batch_size is None:
                batch_size = value.shape[0]
            elif value.shape[0] != batch_size:
                raise ValueError(
                    f"`{name}` has {value.shape[0]} rows but `do_sample` has {batch_size}; "
                    "every parameter needs one entry per row"
                )
            if value.device != device:
                raise ValueError(f"`{name}` is on {value.device} but `do_sample` is on {device}")
        if batch_size == 0:
            raise ValueError("SamplingParams needs at least one row, got batch_size=0")
        # The kernels scale in float32: a positive temperature that rounds to 0 there
        # would be greedy for them and sampled for the host.
        _check_range("temperature", self.temperature,
                     "finite and >= 0 (0 means greedy), and not rounding to 0 in float32",
                     lambda t: torch.isfinite(t) & (t >= 0) & ((t == 0) | (t.float() > 0)))
        _check_range("top_k", self.top_k, ">= 0 (0 disables top-k)", lambda k: k >= 0)
        _check_range("top_p", self.top_p, "in (0, 1] (1 disables top-p)",
                     lambda p: (p > 0) & (p <= 1))
        _check_range("min_p", self.min_p, "in [0, 1] (0 disables min-p)",
                     lambda p: (p >= 0) & (p <= 1))
        _check_range("seed", self.seed, f"in [0, {rng.MAX_SEED}]", lambda s: s >= 0)
        sampled = ~self.is_greedy
        top_k, top_p = sampled & (self.top_k > 0), sampled & (self.top_p < 1)
        rows = torch.stack([sampled, top_k, top_p, sampled & (self.min_p > 0),
                            ~top_k, ~sampled]).any(dim=1).long()
        # Top-p and min-p as the kernels read them, in float32: a top-p that rounds to 1 or
        # a min-p that rounds to 0 truncates nothing there (the float64 reference may drop a
        # tail of mass 1 - top_p < 2**-25: the parameters' rounding).
        kernel_truncated = (self.top_p.float() < 1) | (self.min_p.float() > 0)
        plain_top_k = torch.where(self.top_k > 0, self.top_k, torch.iinfo(torch.int64).max)
        plain_top_k = torch.where(sampled & ~kernel_truncated, plain_top_k, 0)
        (any_sampled, any_top_k, any_top_p, any_min_p, any_without_top_k, any_greedy,
         max_top_k, max_plain_top_k) = torch.cat(
            [rows, self.top_k.max()[None], plain_top_k.max()[None]]).tolist()
        flags = dict(all_greedy=not any_sampled, any_top_k=bool(any_top_k),
                     any_top_p=bool(any_top_p), any_min_p=bool(any_min_p),
                     any_truncation=bool(any_top_k or any_top_p or any_min_p),
                     all_top_k=not any_without_top_k, max_top_k=max_top_k,
                     any_greedy=bool(any_greedy), max_plain_top_k=max_plain_top_k)
        for name, value in flags.items():  # one device read for all of them
            object.__setattr__(self, name, value)

    @property
    def batch_size(self) -> int:
        return self.do_sample.shape[0]

    @property
    def device(self) -> torch.device:
        return self.do_sample.device

    def top_k_everywhere(self, vocab_size: int) -> bool:
        """Every row is sampled with a top-k below `vocab_size` (one of V or more keeps
        everything): the fused kernels then normalise each row over its candidates."""
        return self.all_top_k and self.max_top_k < vocab_size

    def sampled_rows_truncated(self, vocab_size: int) -> bool:
        """Every sampled row keeps a truncated support (a top-k below `vocab_size`, a top-p
        or a min-p, the last two as read in float32), or no row is sampled: the fused kernels
        then draw each sampled token among its candidates."""
        return self.max_plain_top_k < vocab_size

    def kernel_flags(self, vocab_size: int) -> tuple[bool, ...]:
        """The host-side summaries that select the fused kernels' variants for a vocabulary
        of `vocab_size` (a cache key: parameters with the same flags share captured graphs)."""
        return (self.all_greedy, self.any_top_k, self.any_top_p, self.any_min_p,
                self.top_k_everywhere(vocab_size), self.sampled_rows_truncated(vocab_size),
                self.any_greedy)

    @property
    def is_greedy(self) -> torch.Tensor:
        """bool ``[B]``: rows whose token is the argmax of the raw logits."""
        return ~self.do_sample | (self.temperature == 0)

    def to(self, device) -> "SamplingParams":
        return self._map(lambda t: t.to(device))

    def repeat_interleave(self, repeats: int, validate: bool = True) -> "SamplingParams":
        """Each row repeated `repeats` times in place (row b becomes rows b*r .. b*r+r-1),
        seeds included: e.g. one row per verified position of a speculative step.
        ``validate=False`` as in `select`."""
        return self._map(lambda t: t.repeat_interleave(repeats), validate)

    def select(self, rows: torch.Tensor, validate: bool = True) -> "SamplingParams":
        """The parameters of the given rows (an index tensor), in that order.

        ``validate=False`` skips the range checks (rows of valid parameters are valid) and
        keeps this batch's host flags: they hold for every subset of rows (the `any_` flags
        only switch work on: truncation candidates, the sampling epilogue, the warpers of
        the reference; `all_top_k` holds for each row, `max_top_k` and `max_plain_top_k`
        bound each row's), so the whole batch's flags give the subset the same results. A
        decode loop then selects its running rows without a device read, and a CUDA graph
        can capture it."""
        return self._map(lambda t: t[rows.to(t.device)], validate)

    def _map(self, fn, validate: bool = True) -> "SamplingParams":
        if validate:
            return SamplingParams(**{f.name: fn(getattr(self, f.name))
                                     for f in dataclasses.fields(self) if f.init})
        mapped = object.__new__(SamplingParams)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            object.__setattr__(mapped, f.name, fn(value) if f.init else value)
        return mapped

    @classmethod
    def create(
        cls,
        batch_size: int,
        *,
        do_sample: RowValues = True,
        temperature: RowValues = 1.0,
        top_k: RowValues = 0,
        top_p: RowValues = 1.0,
        min_p: RowValues = 0.0,
        seed: RowValues | None = None,
        device=None,
    ) -> "SamplingParams":
        """Parameters for ``batch_size`` rows from scalars (shared) or per-row values.

        Unlike `from_generation_config`, nothing is implied: ``top_k=0`` means no top-k.
        ``seed``: see `row_seeds`.
        """
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"`batch_size` must be a positive int, got {batch_size!r}")
        rows = lambda name, value, dtype: _per_row(name, value, dtype, batch_size, device)  # noqa: E731
        return cls(
            do_sample=rows("do_sample", do_sample, torch.bool),
            temperature=rows("temperature", temperature, torch.float64),
            top_k=rows("top_k", top_k, torch.int64),
            top_p=rows("top_p", top_p, torch.float64),
            min_p=rows("min_p", min_p, torch.float64),
            seed=row_seeds(seed, batch_size, device),
        )

    @classmethod
    def from_generation_config(cls, generation_config, batch_size: int, seed=None,
                               device=None) -> "SamplingParams":
        """Parameters equivalent to what transformers' `generate` would sample with.

        Fields left as ``None`` take transformers' global defaults
        (``GenerationConfig._get_default_generation_params``: ``top_k=50``, ``temperature=1``,
        ``top_p=1``), as `generate` does once the model's own config has been merged in.
        Values are checked by transformers' rules (`generation_sampling`): e.g.
        ``do_sample=True, temperature=0`` is refused, as transformers refuses it.
        Warpers the fused kernels do not make (``typical_p``, ``epsilon_cutoff``,
        ``eta_cutoff``, ``top_h``) and beam search raise instead of being silently dropped
        (``generate(sampler="flash")`` runs the warpers on its materialized path and defers
        beam search to stock transformers).
        """
        from transformers import GenerationConfig

        if not isinstance(generation_config, GenerationConfig):
            raise TypeError(f"`generation_config` must be a transformers GenerationConfig, got "
                            f"{type(generation_config).__name__} (for a dict d, pass "
                            "GenerationConfig(**d))")
        defaults = GenerationConfig._get_default_generation_params()

        def field(name):
            value = getattr(generation_config, name, None)
            return defaults.get(name) if value is None else value

        num_beams = field("num_beams")
        if num_beams is not None and num_beams > 1:
            raise ValueError(
                f"`num_beams`={num_beams}: beam search is not sampling; SamplingParams takes "
                "num_beams=1 (generate(sampler='flash') defers beam search to stock generate)"
            )
        options = generation_sampling(field, lambda name: "in the generation config")
        if options["do_sample"]:
            unsupported = {
                "typical_p": field("typical_p") is not None and field("typical_p") < 1.0,
                "epsilon_cutoff": _in_open_unit(field("epsilon_cutoff")),
                "eta_cutoff": _in_open_unit(field("eta_cutoff")),
                "top_h": field("top_h") is not None,
            }
            for name, is_set in unsupported.items():
                if is_set:
                    raise ValueError(
                        f"`{name}`={field(name)!r} is not supported by SamplingParams (the fused "
                        "sampler takes temperature, top_k, top_p, min_p); unset it, or use "
                        "generate(sampler='flash'), which applies it on its materialized path"
                    )
        return cls.create(batch_size, **options, seed=seed, device=device)


# Edit codes of `LogitEdits`, one per (row, token).
KEEP = 0          # the raw logit
PENALIZE = 1      # HF's repetition penalty: l * p where l < 0, else l / p
BAN = 2           # excluded: the logit becomes `BANNED_LOGIT`
# A banned token's logit. Finite, unlike transformers' -inf, so that the fused kernels'
# row sums (which report NaN/inf logits) and the log-sum-exp of a wholly banned tile stay
# finite; exp(BANNED_LOGIT / T - max) is exactly 0 in float32 and float64, and its Gumbel
# score never beats a token whose logit / T exceeds -2**63, so every token, probability and
# log-sum-exp is what -inf gives. (Only a temperature below about 1e-17 takes a tile's sum
# of banned logits / T past float32's range: the kernels then report the row non-finite.)
BANNED_LOGIT = -2.0**64


class LogitEdits(NamedTuple):
    """Per-(row, token) edits of the model's logits, applied before temperature and
    truncation as transformers applies its logits processors before its warpers, in
    transformers' and vLLM's order:

    1. ``+ bias`` (transformers' single-token ``sequence_bias``, vLLM's and OpenAI's
       ``logit_bias``);
    2. the repetition penalty of the tokens whose code is `PENALIZE`;
    3. vLLM's penalties in float32, as vLLM computes them: ``l - frequency * c``, then
       ``l - presence * (c > 0)``, c = `counts` of the token;
    4. `BANNED_LOGIT` where the code is `BAN`, whatever came before.

    Every field is optional (None: that edit is not made, and the fused kernels compile
    without it); `codes` and `penalty` go together, as `counts`, `frequency` and
    `presence` do.

    Attributes:
        codes: uint8 ``[B, V]`` (`sample`, `argmax`) or ``[B, G+1, V]`` (`verify`, one row of
            codes per verified position): `KEEP`, `PENALIZE` or `BAN` for each token.
        penalty: float64 ``[B]``, each row's repetition penalty (> 0; 1 leaves a penalized
            logit as it is), rounded to the logits' dtype where it is applied, as
            transformers rounds its Python float.
        bias: float32 ``[B, V]``, added to each row's logits (in verification, to every
            position of the row), or ``[B, G+1, V]`` in verification, one row per position
            (transformers' multi-token ``sequence_bias`` depends on the context, so on the
            drafts before a position); or None.
        counts: int32 ``[B, V]``, >= 0: how many times each token occurs among the row's
            generated tokens before this step (vLLM counts its output tokens, not the
            prompt). In verification these are the counts before the first verified
            position: position j adds the row's drafts before it,
            ``counts[b, t] + #{m < j : drafts[b, m] == t}`` (the fused kernels from the
            drafts they already read), which is the count a plain step after accepting those
            drafts holds, so speculation changes no logit. None: no `frequency` / `presence`.
        frequency, presence: float64 ``[B]``, vLLM's frequency and presence penalties (any
            value finite in float32; vLLM takes -2 to 2), rounded to the logits' dtype where
            they are applied (float32 in the kernels, as vLLM holds them); with `counts`.

    Example:
        >>> import torch
        >>> codes = torch.zeros(1, 6, dtype=torch.uint8)
        >>> codes[0, 2], codes[0, 4] = PENALIZE, BAN
        >>> edits = LogitEdits(codes, torch.tensor([2.0], dtype=torch.float64))
        >>> from flashspec import reference
        >>> logits = torch.tensor([[1., -1., 3., -3., 5., 0.]])
        >>> reference.edit_logits(logits, edits)[0].tolist()
        [1.0, -1.0, 1.5, -3.0, -1.8446744073709552e+19, 0.0]

        With a bias, then counts (token 2: ``(3 - 4) * 2 - 0.5 * 1 - 0.25``):

        >>> edits = edits._replace(
        ...     bias=torch.tensor([[0., 0., -4., 0.5, 9., 0.]]),
        ...     counts=torch.tensor([[0, 2, 1, 0, 3, 0]], dtype=torch.int32),
        ...     frequency=torch.tensor([0.5], dtype=torch.float64),
        ...     presence=torch.tensor([0.25], dtype=torch.float64))
        >>> reference.edit_logits(logits, edits)[0].tolist()
        [1.0, -2.25, -2.75, -2.5, -1.8446744073709552e+19, 0.0]
    """

    codes: torch.Tensor | None = None
    penalty: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    presence: torch.Tensor | None = None

    def select(self, rows: torch.Tensor) -> "LogitEdits":
        """The edits of the given batch rows (an index tensor), in that order."""
        return LogitEdits(*(None if field is None else field[rows] for field in self))

    def to(self, device) -> "LogitEdits":
        return LogitEdits(*(None if field is None else field.to(device) for field in self))

    def flat(self, drafts: torch.Tensor | None = None) -> "LogitEdits":
        """Verification's edits as one row per position, ``[B*(G+1), V]`` (row
        b*(G+1)+j: position j of batch row b), each batch row's penalties repeated G+1
        times, a ``[B, V]`` bias too, and position j's counts with the drafts before it
        (``drafts`` ``[B, G]``, -1 padded, needed with counts). Edits of `sample` (no
        `drafts`, nothing per position) are returned as they are."""
        if drafts is not None:
            positions = drafts.shape[1] + 1
        elif self.codes is not None and self.codes.dim() == 3:
            positions = self.codes.shape[1]
        elif self.bias is not None and self.bias.dim() == 3:
            positions = self.bias.shape[1]
        else:
            return self
        if self.counts is not None and drafts is None and positions > 1:
            raise ValueError("LogitEdits.flat needs the drafts with counts: position j counts "
                             "the drafts before it")
        per_row = lambda t: None if t is None else t.repeat_interleave(positions)  # noqa: E731
        counts = self.counts
        if counts is not None and drafts is not None:   # (one position alone: no drafts before it)
            counts = (counts[:, None, :] + drafted_counts(drafts, counts.shape[-1])).flatten(0, 1)
        bias = self.bias
        if bias is not None and bias.dim() == 2:
            bias = bias.repeat_interleave(positions, dim=0)
        elif bias is not None:
            bias = bias.flatten(0, 1)
        return LogitEdits(None if self.codes is None else self.codes.flatten(0, 1),
                          per_row(self.penalty), bias, counts, per_row(self.frequency),
                          per_row(self.presence))


def drafted_counts(drafts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 ``[B, G+1, V]``: at position j, how many times each token occurs among the
    drafts ``drafts[b, :j]`` (``[B, G]``; -1, padding, is no token)."""
    batch, num_drafts = drafts.shape
    hits = torch.zeros(batch, num_drafts + 1, vocab_size, dtype=torch.int32, device=drafts.device)
    drafted = (drafts >= 0).to(torch.int32)[..., None]
    hits[:, 1:].scatter_(2, drafts.clamp_min(0)[..., None], drafted)
    return hits.cumsum(dim=1, dtype=torch.int32)


def generation_sampling(value_of, where) -> dict:
    """`SamplingParams.create`'s keywords (do_sample, temperature, top_k, top_p, min_p) for
    a merged generation config, by transformers' rules: each value is read where
    transformers' `generate` reads it (the warpers only when sampling, each only when set
    away from its neutral value) and is refused where transformers refuses it, with a
    ValueError or TypeError naming the option, its value, what is allowed and `where(name)`
    (where the value came from). `value_of(name)`: the merged value, None when unset.

    As in transformers: ``top_p=0`` keeps only the most likely token (here top_k=1), a
    ``top_p`` of 1 or more (or NaN) and a ``top_k`` of 0 truncate nothing, a ``top_k`` beyond
    the vocabulary keeps everything. Not as in transformers: an infinite temperature (which
    transformers turns into uniform sampling) is refused.
    """
    def refuse(error, name, allowed):
        value = value_of(name)
        shown = f"{value!r} ({type(value).__name__})" if not isinstance(value, (bool, int, float)) \
            else repr(value)
        return error(f"`{name}`={shown} ({where(name)}) is not allowed: {allowed}")

    do_sample = value_of("do_sample")
    if do_sample is not None and not isinstance(do_sample, (bool, numbers.Integral)):
        raise refuse(TypeError, "do_sample", "must be a bool")
    if not do_sample:
        return dict(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)

    temperature = value_of("temperature")
    if temperature is None or (_is_real(temperature) and temperature == 1):
        temperature = 1.0
    elif not (isinstance(temperature, float) and temperature > 0):
        raise refuse(ValueError, "temperature", "with do_sample=True transformers takes a float "
                     "> 0 (for greedy decoding set do_sample=False)")
    elif temperature == float("inf"):
        raise refuse(ValueError, "temperature", "must be finite")
    top_k = value_of("top_k")
    if top_k is None or (_is_real(top_k) and top_k == 0):
        top_k = 0
    elif not (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 0):
        # (transformers' top-k warper takes True, then torch.topk refuses it)
        raise refuse(ValueError, "top_k", "must be an int > 0 (0 or None: no top-k)")
    top_p = value_of("top_p")
    if top_p is not None and not _is_real(top_p):
        raise refuse(TypeError, "top_p", "must be a real number (>= 1: no top-p)")
    if top_p is None or not top_p < 1:
        top_p = 1.0
    elif not top_p >= 0:
        raise refuse(ValueError, "top_p", "must be in [0, 1] (>= 1: no top-p)")
    elif top_p == 0:                    # transformers keeps min_tokens_to_keep=1 token
        top_k, top_p = 1, 1.0
    min_p = value_of("min_p")
    if min_p is not None and not _is_real(min_p):
        raise refuse(TypeError, "min_p", "must be a real number in [0, 1]")
    if min_p is not None and not 0 <= min_p <= 1:
        raise refuse(ValueError, "min_p", "must be in [0, 1] (None or 0: no min-p)")
    return dict(do_sample=True, temperature=float(temperature),
                top_k=min(int(top_k), torch.iinfo(torch.int64).max), top_p=float(top_p),
                min_p=0.0 if min_p is None else float(min_p))


def _is_real(value) -> bool:
    """A real Python or numpy number (bools count, as transformers compares them)."""
    return isinstance(value, numbers.Real)


def row_seeds(seed, batch_size: int, device=None) -> torch.Tensor:
    """int64 ``[batch_size]`` seeds.

    * ``None``: drawn from torch's default generator, so ``torch.manual_seed(s)`` before the
      call makes the run repeatable, as transformers users expect.
    * an ``int`` ``s`` in ``[0, 2**63)``: row ``b`` gets ``s + b`` (modulo ``2**63``, so that
      every seed of the range serves every batch size): independent Philox keys, reproducible.
    * a sequence or tensor of ``batch_size`` ints: used as given.
    """
    if seed is None:
        return torch.randint(0, rng.MAX_SEED, (batch_size,), dtype=torch.int64).to(device)
    if isinstance(seed, bool):
        raise ValueError(f"`seed` must be an int, a sequence of ints or an int tensor, got {seed!r}")
    if isinstance(seed, numbers.Integral):
        if not 0 <= seed <= rng.MAX_SEED:
            raise ValueError(f"`seed`={seed} is not allowed: must lie in [0, {rng.MAX_SEED}] "
                             f"(row b uses seed + b, modulo 2**63)")
        rows = [(int(seed) + b) % (rng.MAX_SEED + 1) for b in range(batch_size)]
        return torch.tensor(rows, dtype=torch.int64, device=device)
    return _per_row("seed", seed, torch.int64, batch_size, device, broadcast=False)


def _concrete(device: torch.device) -> torch.device:
    """``cuda`` as the current CUDA device (``cuda:0``, say), which a tensor's device names."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _per_row(name: str, value, dtype: torch.dtype, batch_size: int, device,
             broadcast: bool = True) -> torch.Tensor:
    if torch.is_tensor(value):
        if value.dtype.is_complex:
            raise ValueError(f"`{name}` must be real, got dtype {value.dtype}")
        if dtype != torch.bool and value.dtype == torch.bool:
            raise ValueError(f"`{name}` must be numeric, got a bool tensor")
        if not dtype.is_floating_point and value.dtype.is_floating_point:
            raise ValueError(f"`{name}` must hold integers, got dtype {value.dtype}")
        if device is not None and value.device != _concrete(torch.device(device)):
            raise ValueError(f"`{name}` is on {value.device}, expected {device}")
        tensor = value.to(dtype)
    else:
        _check_python_values(name, value, dtype)
        tensor = torch.tensor(value, dtype=dtype, device=device)
    if tensor.dim() == 0 and broadcast:
        tensor = tensor.expand(batch_size)
    if tensor.shape != (batch_size,):
        raise ValueError(
            f"`{name}` must be a scalar or have shape [{batch_size}] (one value per row), "
            f"got shape {tuple(tensor.shape)}"
        )
    return tensor.contiguous()


def _check_python_values(name: str, value, dtype: torch.dtype) -> None:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if dtype == torch.bool:
            ok = isinstance(v, bool)
        elif dtype.is_floating_point:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        else:
            ok = isinstance(v, int) and not isinstance(v, bool)
        if not ok:
            kind = {torch.bool: "a bool", torch.int64: "an int"}.get(dtype, "a float")
            raise ValueError(f"`{name}` must be {kind} or a sequence of them, got {v!r}")
        if dtype == torch.int64 and not -2**63 <= v < 2**63:
            raise ValueError(f"`{name}`={v} is not allowed: must fit in int64")


def _check_range(name: str, values: torch.Tensor, allowed: str, is_ok) -> None:
    bad = ~is_ok(values)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"`{name}`={values[row].item()} (row {row}) is not allowed: must be {allowed}")


def _in_open_unit(value) -> bool:
    return value is not None and 0.0 < value < 1.0
