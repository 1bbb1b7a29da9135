"""Launchers of the fused LM-head kernels: `fused_argmax`, `fused_sample`, `fused_verify`.

Each launches stage 1, stage 2 (and verification's finaliser) and returns the typed result
of `flashspec.outputs` as device tensors, with per-row status, no host synchronisation and no
data-dependent allocation: safe to capture in a CUDA graph. They check only that the
kernels can run on the tensors' device (`check_device`); they neither validate their other
arguments nor act on the status: `flashspec.sampling`, the public door, does both, completing
the rare rows whose truncated support did not fit the candidate budget through the exact
materialized path (counted in `stats()`).

Their tiles come from the fixed table of `tile_config.py` unless a `TileConfig` is passed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..outputs import ArgmaxOutput, SampleOutput, VerifyOutput
from ..params import LogitEdits, SamplingParams
from . import lm_head, lm_head_ws, merge, verify_finalize
from .epilogue import edit_arguments
from .keys import PAD_KEY
from .race import NO_BOUND
from .tile_config import TileConfig, default_config


@dataclasses.dataclass
class KernelStats:
    rows_sampled: int = 0  # batch rows of checked fused calls (verify: B, not B*(G+1))
    rows_completed: int = 0  # of those, truncated rows finished by the exact materialized path


_stats = KernelStats()


def stats() -> KernelStats:
    """Counters of `flashspec.sampling`'s checked fused calls since the last `reset_stats()`."""
    return dataclasses.replace(_stats)


def reset_stats() -> None:
    _stats.rows_sampled = 0
    _stats.rows_completed = 0


def count_checked_rows(num_rows: int, num_completed: int) -> None:
    """Add one checked fused call to `stats()`: its batch rows and those it completed."""
    _stats.rows_sampled += num_rows
    _stats.rows_completed += num_completed


def check_device(hidden: torch.Tensor) -> None:
    """Refuses tensors the kernels cannot run on, naming their device: Triton runs CUDA
    tensors, or any under its interpreter (TRITON_INTERPRET=1); elsewhere it would fail with
    "0 active drivers". The same rule as `flashspec.sampling`'s backend 'fused'."""
    if not (hidden.is_cuda or triton.knobs.runtime.interpret):
        raise ValueError(f"the fused kernels need CUDA tensors (or Triton's interpreter: "
                         f"TRITON_INTERPRET=1), got tensors on {hidden.device}; use "
                         "flashspec.sampling with backend='reference'")


def _on_hidden_device(launch):
    """Run `launch` with the hidden states' GPU as the current device: Triton launches on
    the current device's stream, whatever device the tensors are on (a model on cuda:1
    would otherwise run its kernels on cuda:0, reading cuda:1's memory)."""
    @functools.wraps(launch)
    def on_device(hidden, *args, **kwargs):
        if not hidden.is_cuda:          # Triton's interpreter, or a refusal by check_device
            return launch(hidden, *args, **kwargs)
        with torch.cuda.device(hidden.device):
            return launch(hidden, *args, **kwargs)
    return on_device


@_on_hidden_device
def fused_argmax(hidden: torch.Tensor, weight: torch.Tensor, *, edits: LogitEdits | None = None,
                 bias: torch.Tensor | None = None, softcap: float | None = None,
                 config: TileConfig | None = None) -> ArgmaxOutput:
    """Greedy tokens of ``hidden [B, D] @ weight [V, D].T`` (see `flashspec.sampling.argmax`),
    unchecked; `bias` (``[V]``) and `softcap`: the model's head transforms, applied before
    `edits` (`LogitEdits` of the B rows) in stage 1's epilogue; `config`:
    tiles of stage 1 (None: `default_config`)."""
    check_device(hidden)
    head = dict(bias=bias, softcap=softcap)
    if edits is None:
        out = _launch(hidden, weight, None, None, 1, config, **head)
    else:  # one greedy parameter row per row: each reads its own penalties
        greedy, positions = greedy_params(hidden.shape[0], hidden.device)
        out = _launch(hidden, weight, greedy, positions, 1, config, edits=edits, **head)
    return ArgmaxOutput(out.tokens, out.status)


@functools.lru_cache(maxsize=None)
def greedy_params(num_rows: int, device: torch.device) -> tuple[SamplingParams, torch.Tensor]:
    """Greedy parameters and positions (zeros) for `num_rows` rows, which the kernels only
    read: made once per row count and device, so that a CUDA graph's capture of an argmax
    with edits (a drafter's among a grammar's tokens; on a vocabulary shard too), which a
    warm-up run of the same step precedes, copies nothing from the host."""
    positions = torch.zeros(num_rows, dtype=torch.int64, device=device)
    return SamplingParams.create(num_rows, do_sample=False, seed=0, device=device), positions


@_on_hidden_device
def fused_sample(hidden: torch.Tensor, weight: torch.Tensor, params: SamplingParams,
                 positions: torch.Tensor, *, edits: LogitEdits | None = None,
                 bias: torch.Tensor | None = None, softcap: float | None = None,
                 config: TileConfig | None = None) -> SampleOutput:
    """One token per row of ``hidden [B, D]`` (see `flashspec.sampling.sample`), unchecked,
    with its logprob and the log-sum-exp, which every caller wants (the engine reports
    logprobs): stage 1 computes the log-sum-exp unless every row has a top-k below V.
    `bias`, `softcap` and `edits` as in `fused_argmax`."""
    check_device(hidden)
    out = _launch(hidden, weight, params, positions, 1, config, edits=edits, bias=bias,
                  softcap=softcap)
    return SampleOutput(out.tokens, out.logprobs, out.lse, out.status)


@_on_hidden_device
def fused_verify(hidden: torch.Tensor, weight: torch.Tensor, draft_tokens: torch.Tensor,
                 params: SamplingParams, positions: torch.Tensor, *, acceptance: str = "strict",
                 edits: LogitEdits | None = None, bias: torch.Tensor | None = None,
                 softcap: float | None = None,
                 config: TileConfig | None = None) -> VerifyOutput:
    """Verification of ``draft_tokens [B, G]`` against ``hidden [B, G+1, D]`` (see
    `flashspec.sampling.verify`), unchecked; `edits`: `LogitEdits` with codes
    ``[B, G+1, V]``, one row per position, and counts before the first position (stage 1
    adds each position's drafts before it); `bias` and `softcap` as in `fused_argmax`."""
    check_device(hidden)
    batch_size, num_positions, dim = hidden.shape
    num_drafts = num_positions - 1
    draft_tokens = draft_tokens.contiguous()
    rows = _launch(hidden.reshape(batch_size * num_positions, dim), weight, params, positions,
                   num_positions, config, drafts=draft_tokens, edits=edits, bias=bias,
                   softcap=softcap)
    device = hidden.device
    pdl = programmatic_launch_ready(device)
    out = VerifyOutput(
        torch.empty(batch_size, dtype=torch.int64, device=device),
        torch.empty(batch_size, num_positions, dtype=torch.int64, device=device),
        torch.empty(batch_size, num_drafts, dtype=torch.float32, device=device),
        torch.empty(batch_size, num_positions, dtype=torch.float32, device=device),
        torch.empty(batch_size, dtype=torch.int32, device=device))
    verify_finalize.verify_finalize_kernel[(batch_size,)](
        draft_tokens, rows.tokens, rows.masked, rows.logprobs, rows.masked_logprobs,
        rows.draft_probs, rows.draft_logprobs, rows.status,
        params.do_sample, params.temperature, params.seed, positions,
        out.num_accepted, out.tokens, out.accept_probs, out.logprobs, out.status,
        num_drafts, PROBABILISTIC=acceptance == "probabilistic",
        POSITIONS_POW2=triton.next_power_of_2(num_positions), PDL=pdl, num_warps=1,
        launch_pdl=pdl,
    )
    return out


_greedy_rows: dict[torch.device, tuple[torch.Tensor, ...]] = {}


def _greedy_row_params(device: torch.device):
    """One greedy parameter row shared by every row (argmax), cached per device."""
    if device not in _greedy_rows:
        _greedy_rows[device] = (
            torch.zeros(1, dtype=torch.bool, device=device),
            torch.ones(1, dtype=torch.float64, device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
        )
    return _greedy_rows[device]


class _Rows(NamedTuple):
    """Stage-2 outputs per row (device tensors); the draft fields only for verification."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    lse: torch.Tensor
    status: torch.Tensor
    masked: torch.Tensor | None = None
    masked_logprobs: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None
    draft_logprobs: torch.Tensor | None = None


class KernelVariant(NamedTuple):
    """What selects the fused kernels' compiled variant (besides the tile config): two
    calls whose parameters give the same variant run the same compiled kernels."""

    sample: bool          # some row is sampled
    truncate: bool        # some row keeps a truncated support: candidates per tile
    need_lse: bool        # stage 1 sums the whole vocabulary's log-sum-exp
    tile_noise: bool      # stage 1 draws the Gumbel-max of sampled rows
    tile_drafts: bool     # stage 1 leaves each row's draft out and reads its logit


def kernel_variant(params: SamplingParams | None, vocab_size: int, verify: bool) -> KernelVariant:
    """The variant of the fused kernels that `params` (None: argmax) select."""
    sample = params is not None and not params.all_greedy
    truncate = params is not None and params.any_truncation
    # Stage 1's full log-sum-exp: for the logprobs of rows without a top-k below V (sampling
    # and verification always report them; argmax none) and for a top-p without one (a top-k
    # of V or more keeps everything: the top-p then needs the whole sum). Where every row has
    # a top-k below V, each support is normalised over its candidates in stage 2 (one `exp`
    # per logit less).
    every_row_top_k = params is not None and params.top_k_everywhere(vocab_size)
    need_lse = params is not None and not every_row_top_k
    # Truncated rows draw their token in stage 2, among their candidates and with the
    # candidates' own noise, and judge their draft there too: stage 1's Gumbel-max serves
    # only sampled rows without truncation, the draft's mask and logit only those and greedy
    # rows. Where every sampled row is truncated, stage 1 runs the argmax epilogue beside the
    # candidates (the noise was most of its work).
    every_sampled_row_truncated = (params is not None
                                   and params.sampled_rows_truncated(vocab_size))
    tile_noise = sample and not every_sampled_row_truncated
    tile_drafts = verify and (params.any_greedy or not every_sampled_row_truncated)
    return KernelVariant(sample, truncate, need_lse, tile_noise, tile_drafts)


class _Tiles(NamedTuple):
    """Stage 1's outputs (device tensors) and what stage 2 reads beside them: the per-(row,
    vocab tile) summaries ``[R, num_vt]``, the candidates ``[R, num_vt, cand]`` (with cand >
    0), each row's draft logit ``[R]`` (where stage 1 left drafts out), the drafts it read,
    the parameter rows (`row`: pointers by name, read at row r // rows_per_param) and the
    tile config."""

    best: torch.Tensor
    best_id: torch.Tensor
    best_s: torch.Tensor
    tile_max: torch.Tensor
    tile_sum: torch.Tensor
    bad: torch.Tensor
    candidates: torch.Tensor
    draft_s: torch.Tensor
    drafts: torch.Tensor
    row: dict
    rows_per_param: int
    num_vt: int
    cand: int
    config: TileConfig


def _stage1(hidden: torch.Tensor, weight: torch.Tensor, params: SamplingParams | None,
            positions: torch.Tensor | None, rows_per_param: int, config: TileConfig | None,
            variant: KernelVariant, drafts: torch.Tensor | None = None,
            edits: LogitEdits | None = None, bias: torch.Tensor | None = None,
            softcap: float | None = None, vocab_offset: int = 0) -> _Tiles:
    """Stage 1 of `variant` over rows of `hidden` ``[R, D]``; row r uses parameter row
    r // rows_per_param and noise position positions[r // rows_per_param] + r % rows_per_param.
    With `drafts` (``[R // rows_per_param, rows_per_param - 1]``, -1 padded), row r also
    verifies draft ``drafts[r // rows_per_param, r % rows_per_param]`` (none on the last).
    With `bias` (``[V]``) and `softcap` every row's logits are the model's (``+ bias``, then
    ``softcap * tanh(logits / softcap)``); then, with `edits` (`LogitEdits`), row r's are
    edited by codes row r (codes ``[..., V]`` holding R rows), the per-row values of batch row
    ``r // rows_per_param`` (penalties, counts, a ``[B, V]`` bias; a ``[B, G+1, V]`` bias:
    row r) and, with counts and `drafts`, the drafts before position r % rows_per_param
    (`epilogue._edited_logits`). `weight` may be a vocabulary shard: its token j is global
    token ``vocab_offset + j`` for the noise, and in its own ids for everything else
    (`lm_head.py`), the drafts included."""
    num_rows, dim = hidden.shape
    vocab_size = weight.shape[0]
    verify = drafts is not None
    sample, truncate, need_lse, tile_noise, tile_drafts = variant
    device = hidden.device
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    # The Gluon kernel draws the noise by the tiles' groups of 16 tokens only.
    column_noise = tile_noise and vocab_offset % 16 != 0
    warp_specialized = warp_specialized_ready(hidden, weight) and not column_noise
    config = config or default_config(num_rows, hidden.element_size(), truncate, verify,
                                      warp_specialized)
    if config.warp_specialized and not warp_specialized:
        raise ValueError("TileConfig(warp_specialized=True) needs CUDA tensors on a Hopper GPU "
                         "(not Triton's interpreter), Triton " + lm_head_ws.TESTED_TRITON + "x "
                         "with Gluon, bf16 or fp16 operands with 16-byte aligned rows and, "
                         "where it draws the noise of a vocabulary shard, a vocab_offset that "
                         "is a multiple of 16; use another TileConfig")
    cand = config.candidates if truncate else 0
    if params is None:  # argmax: every row reads the one greedy parameter row
        do_sample, temperature, zeros = _greedy_row_params(device)
        row = dict(do_sample=do_sample, temperature=temperature, top_k=zeros, top_p=temperature,
                   min_p=temperature, seed=zeros, position=zeros)
        rows_per_param = num_rows
    else:
        row = dict(do_sample=params.do_sample, temperature=params.temperature,
                   top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                   seed=params.seed, position=positions)

    num_vt = triton.cdiv(vocab_size, config.block_v)
    f32 = dict(dtype=torch.float32, device=device)
    best = torch.empty(num_rows, num_vt, **f32)
    best_id = torch.empty(num_rows, num_vt, dtype=torch.int32, device=device)
    bad = torch.empty(num_rows, num_vt, dtype=torch.int32, device=device)
    best_s, tile_max, tile_sum = (torch.empty(num_rows, num_vt, **f32) if need_lse else best
                                  for _ in range(3))
    candidates = (torch.empty(num_rows, num_vt, cand, dtype=torch.int64, device=device)
                  if cand else best_id)
    draft_s = torch.empty(num_rows, **f32) if tile_drafts else best
    drafts = drafts if verify else best_id
    race = config.race and tile_noise
    # The race's per-row bounds start empty at every launch (they hold this launch's scores).
    bounds = (torch.full((num_rows,), NO_BOUND, dtype=torch.int32, device=device)
              if race else best_id)
    summaries = (best, best_id, best_s, tile_max, tile_sum, bad)
    head = dict(bias=None if bias is None else bias.contiguous(), softcap=softcap)
    if config.warp_specialized:
        lm_head_ws.launch(hidden, weight, row, summaries, candidates, drafts, draft_s, bounds,
                          num_vt, rows_per_param, config, tile_noise, need_lse, cand, tile_drafts,
                          race, edits, **head, vocab_offset=vocab_offset)
    else:
        _launch_tiles(hidden, weight, row, summaries, candidates, drafts, draft_s, bounds, num_vt,
                      rows_per_param, config, tile_noise, need_lse, cand, tile_drafts, race, edits,
                      **head, vocab_offset=vocab_offset, column_noise=column_noise)
    return _Tiles(*summaries, candidates, draft_s, drafts, row, rows_per_param, num_vt, cand,
                  config)


def _launch(hidden: torch.Tensor, weight: torch.Tensor, params: SamplingParams | None,
            positions: torch.Tensor | None, rows_per_param: int, config: TileConfig | None,
            drafts: torch.Tensor | None = None, edits: LogitEdits | None = None,
            bias: torch.Tensor | None = None, softcap: float | None = None) -> _Rows:
    """Stage 1 (`_stage1`, the rows and arguments as there) + stage 2 over the rows of
    `hidden` ``[R, D]`` and the whole vocabulary `weight` ``[V, D]``."""
    num_rows = hidden.shape[0]
    vocab_size = weight.shape[0]
    verify = drafts is not None
    variant = kernel_variant(params, vocab_size, verify)
    tiles = _stage1(hidden, weight, params, positions, rows_per_param, config, variant, drafts,
                    edits, bias, softcap)
    row, config, cand = tiles.row, tiles.config, tiles.cand
    device = hidden.device
    f32 = dict(dtype=torch.float32, device=device)
    out = _Rows(torch.empty(num_rows, dtype=torch.int64, device=device), torch.empty(num_rows, **f32),
                torch.empty(num_rows, **f32), torch.empty(num_rows, dtype=torch.int32, device=device),
                *((torch.empty(num_rows, dtype=torch.int64, device=device),
                   *(torch.empty(num_rows, **f32) for _ in range(3))) if verify else ()))
    unused = out.logprobs  # pointers the kernel does not touch without DRAFT
    pdl = programmatic_launch_ready(device)
    vt_pow2 = triton.next_power_of_2(tiles.num_vt)
    top_tiles = min(config.max_support, vt_pow2)
    merge.lm_head_rows_kernel[(num_rows,)](
        tiles.best, tiles.best_id, tiles.best_s, tiles.tile_max, tiles.tile_sum, tiles.bad,
        tiles.candidates, tiles.draft_s,
        row["do_sample"], row["temperature"], row["top_k"], row["top_p"], row["min_p"],
        row["seed"], row["position"], tiles.drafts,
        out.tokens, out.logprobs, out.lse, out.status,
        *((out.masked, out.masked_logprobs, out.draft_probs, out.draft_logprobs) if verify
          else (out.tokens, unused, unused, unused)),
        vocab_size, tiles.num_vt, tiles.rows_per_param,
        LSE=variant.need_lse, CAND=cand, DRAFT=verify, TILE_DRAFTS=variant.tile_drafts,
        K_MAX=min(config.max_support, top_tiles * max(cand, 1)),
        TOP_TILES=top_tiles, VT_POW2=vt_pow2,
        PAD=PAD_KEY, PDL=pdl, num_warps=config.merge_warps if cand else 4,
        launch_pdl=pdl,
    )
    return out


def _launch_tiles(hidden, weight, row, summaries, candidates, drafts, draft_s, bounds, num_vt,
                  rows_per_param, config, noise, need_lse, cand, leave_out_drafts, race,
                  edits=None, bias=None, softcap=None, vocab_offset=0, column_noise=False):
    """Stage 1 through the Triton kernel (`lm_head.lm_head_tiles_kernel`): the per-(row, vocab
    tile) `summaries` (best, best_id, best_s, tile_max, tile_sum, bad) and `candidates`; with
    `noise` the best is the Gumbel-max of sampled rows, with `leave_out_drafts` it leaves each
    row's draft out and writes the draft's logit to `draft_s` (`drafts`: ``[B, G]`` in
    verification, whose counts edits read them too). With `race` (and `noise`),
    `bounds` holds each row's race bound (int32 order keys, `race.NO_BOUND` at first), and
    a tile's best is -inf where the bound already beats it (or only a lower score, also
    below the bound, where one column of the row escapes it: `race._race_leaders`). The
    logits are first the model's with its LM-head `bias` (``[V]``, contiguous) and `softcap`
    (`epilogue._head_logits`), then edited with `edits` (`LogitEdits`, codes of the
    launch's rows). `vocab_offset`: the global id of the weight's first token, which keys the
    noise; `column_noise` where it is not a multiple of 16 (`lm_head.py`)."""
    num_rows, dim = hidden.shape
    vocab_size = weight.shape[0]
    grid = (num_vt * triton.cdiv(num_rows, config.block_r),)
    # Truncation keeps candidates per tile: interleaved tiles spread a support of
    # neighbouring token ids over many tiles (see rows._column_tokens).
    interleave = cand > 0
    descriptors = tma_descriptors(hidden, weight, config, interleave)
    tma = descriptors is not None
    hidden_desc, weight_desc = descriptors if tma else (hidden, weight)
    edit_pointers, edit_flags = edit_arguments(edits, num_rows, vocab_size, draft_s)
    lm_head.lm_head_tiles_kernel[grid](
        hidden, weight, hidden_desc, weight_desc, row["do_sample"], row["temperature"], row["seed"], row["position"],
        *summaries, candidates, drafts, draft_s, bounds, *edit_pointers,
        draft_s if bias is None else bias, 1.0 if softcap is None else softcap,
        num_rows, vocab_size, dim, hidden.stride(0), weight.stride(0), num_vt, rows_per_param,
        vocab_offset, SAMPLE=noise, LSE=need_lse, CAND=cand, DRAFT=leave_out_drafts, **edit_flags,
        BIAS=bias is not None, SOFTCAP=softcap is not None,
        IEEE_DOT=hidden.dtype == torch.float32, INTERLEAVE=interleave,
        EVEN_V=vocab_size % config.block_v == 0, EVEN_D=dim % config.block_d == 0, TMA=tma,
        PARTS=config.epilogue_parts, SCREEN=config.screen, RACE=race, COLUMN_NOISE=column_noise,
        BLOCK_V=config.block_v, BLOCK_R=config.block_r, BLOCK_D=config.block_d,
        NUM_STAGES=config.num_stages, PDL=programmatic_launch_ready(hidden.device),
        num_warps=config.num_warps,
    )


def stage1_best_scores(hidden: torch.Tensor, weight: torch.Tensor, params: SamplingParams,
                       positions: torch.Tensor, config: TileConfig, want_lse: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 alone, for tests and diagnostics: every (row, vocab tile)'s best score
    ``[R, num_vt]`` under `config` (sampled rows' Gumbel-max score, untruncated, no drafts;
    -inf where `config.race` left the row's tile out, or lower where it took a lone column
    below the bound) and the race's final per-row bounds (int32 order
    keys, `race.NO_BOUND` where none). With `want_lse` the epilogue also computes the
    log-sum-exp's summaries (and the race takes their form of its test)."""
    num_rows = hidden.shape[0]
    num_vt = triton.cdiv(weight.shape[0], config.block_v)
    f32 = dict(dtype=torch.float32, device=hidden.device)
    best = torch.empty(num_rows, num_vt, **f32)
    best_id = torch.empty(num_rows, num_vt, dtype=torch.int32, device=hidden.device)
    summaries = (best, best_id, torch.empty(num_rows, num_vt, **f32),
                 torch.empty(num_rows, num_vt, **f32), torch.empty(num_rows, num_vt, **f32),
                 torch.empty_like(best_id))
    bounds = torch.full((num_rows,), NO_BOUND, dtype=torch.int32, device=hidden.device)
    row = dict(do_sample=params.do_sample, temperature=params.temperature, seed=params.seed,
               position=positions)
    launch = lm_head_ws.launch if config.warp_specialized else _launch_tiles
    launch(hidden, weight, row, summaries, best_id, best_id, best, bounds, num_vt, 1, config,
           True, want_lse, 0, False, config.race)
    return best, bounds


@functools.lru_cache(maxsize=None)
def _capability_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def programmatic_launch_ready(device: torch.device) -> bool:
    """Whether stage 2 and the finaliser launch as programmatic dependents (Hopper and
    later, not Triton's interpreter): each is scheduled while the kernel before it drains and
    waits for that kernel's writes (`griddepcontrol.wait`) instead of for its end and a
    launch. Results are the same either way."""
    if device.type != "cuda" or triton.knobs.runtime.interpret or torch.version.hip:
        return False
    return _capability_major(device) >= 9


def tma_ready(matrix: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned base and row stride (any real LM head: D % 8 == 0 in bf16)."""
    row_bytes = matrix.stride(0) * matrix.element_size()
    return matrix.data_ptr() % 16 == 0 and row_bytes % 16 == 0


def warp_specialized_ready(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Gluon stage 1 can run these operands (`lm_head_ws.supported`, and rows
    its TMA loads can read); the default table then takes it where it wins."""
    return lm_head_ws.supported(hidden, weight) and tma_ready(hidden) and tma_ready(weight)


def tma_descriptors(hidden: torch.Tensor, weight: torch.Tensor, config: TileConfig,
                    interleave: bool) -> tuple[TensorDescriptor, TensorDescriptor] | None:
    """TMA descriptors of stage 1's hidden and weight tiles, or None where the tiles must
    load through pointers. A contiguous vocab tile is one box of the weight. An interleaved
    tile (groups pid_v, pid_v + NUM_VT, ... of 16 tokens) is one box of the weight viewed
    as ``[BLOCK_V / 16, NUM_VT, 16, D]``, which exists when V is a multiple of BLOCK_V (both
    Qwen's 151,936 and Llama's 128,256 are, at 64 and 128)."""
    if not (tma_ready(hidden) and tma_ready(weight)):
        return None
    vocab_size, dim = weight.shape
    hidden_desc = TensorDescriptor.from_tensor(hidden, [config.block_r, config.block_d])
    if not interleave:
        return hidden_desc, TensorDescriptor.from_tensor(weight, [config.block_v, config.block_d])
    if vocab_size % config.block_v or weight.stride(0) != dim:
        return None
    groups = config.block_v // 16
    grouped = weight.view(groups, vocab_size // config.block_v, 16, dim)
    return hidden_desc, TensorDescriptor.from_tensor(grouped, [groups, 1, 16, config.block_d])

