"""Launchers of the fused LM-head kernels: `fused_argmax`, `fused_sample`, `fused_verify`.

Each launches stage 1, stage 2 (and verification's finaliser) and returns the typed result
of `flashspec.outputs` as device tensors, with per-row status, no host synchronisation and no
data-dependent allocation: safe to capture in a CUDA graph. They neither validate their
arguments nor act on the status: `flashspec.sampling`, the public door, does both, completing
the rare rows whose truncated support did not fit the candidate budget through the exact
materialized path (counted in `stats()`).

Tile sizes come from a fixed table keyed by the number of rows (no autotuning: re-tuning
per batch size is what wrecks serving); results never depend on them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..outputs import ArgmaxOutput, SampleOutput, VerifyOutput
from ..params import SamplingParams
from . import lm_head, lm_head_ws


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile shape of stage 1 and the candidate budget of truncation.

    block_v: vocabulary rows of the weight per program; block_r: hidden rows per program
    (>= 16 for tl.dot); block_d: reduction step; candidates: top logits kept per
    (row, vocab tile); max_support: largest truncated support handled without completion;
    merge_warps: warps of the per-row stage 2 (its sorts are the cost of truncation);
    epilogue_parts: summarise the tile in 1, 2 or 4 vocab parts one after the other
    (fewer live registers); warp_specialized: stage 1 through the Gluon kernel of
    `lm_head_ws` (Hopper): a load warp, an MMA warpgroup and num_warps epilogue warps on
    different tiles at once, num_stages (>= 2) deep; screen: sampled rows find each tile's
    best through the noise screen (`lm_head._screen`: about half the epilogue's instructions,
    more registers; the same results), for tiles where the epilogue bounds the time;
    race: sampled rows skip the search for a tile's best wherever the best score already
    found for the row, shared by all programs through global memory, provably beats every
    column of the tile (`lm_head._race_beaten`: an exponential and a multiply-add per column
    instead of the screen's two logarithms), and take only the exact score of the one column
    per row that the bound does not rule out where there is at most one (`_race_leaders`);
    the same results.
    """

    block_v: int = 128
    block_r: int = 16
    block_d: int = 128
    num_warps: int = 4
    num_stages: int = 4
    # 8: a trained model's support crowds tiles (the built-in pair, top-k 20 + top-p 0.95:
    # 10 of 64 rows needed completion with 4 per tile, 1 with 8).
    candidates: int = 8
    max_support: int = 64
    merge_warps: int = 16
    epilogue_parts: int = 1
    warp_specialized: bool = False
    screen: bool = False
    race: bool = False

    def __post_init__(self):
        for name in ("block_v", "block_r", "block_d", "candidates", "max_support"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"TileConfig.{name}={value} must be a power of two")
        if min(self.block_v, self.block_r, self.block_d) < 16:
            raise ValueError("TileConfig.block_v, block_r and block_d must be >= 16 (tl.dot)")
        if self.epilogue_parts not in (1, 2, 4) or self.block_v // self.epilogue_parts < 16:
            raise ValueError(f"TileConfig.epilogue_parts={self.epilogue_parts} must be 1, 2 or 4 "
                             f"and leave parts of >= 16 columns (block_v={self.block_v})")
        if self.candidates > self.block_v:
            raise ValueError(f"TileConfig.candidates={self.candidates} exceeds block_v")
        if self.warp_specialized and not (
                self.block_r % 64 == 0 and self.block_r * self.block_v <= 128 * 128
                and self.num_warps in lm_head_ws.EPILOGUE_WARPS and self.epilogue_parts == 1
                and self.num_stages >= 2):
            # One stage would deadlock: the MMA frees a step's stage only after the next
            # step's data has arrived in another one.
            raise ValueError(
                f"TileConfig(warp_specialized=True) needs block_r a multiple of 64 (wgmma), "
                f"block_r * block_v <= 16384 (the MMA warpgroup's accumulator), num_warps in "
                f"{lm_head_ws.EPILOGUE_WARPS}, epilogue_parts=1 and num_stages >= 2; got "
                f"block_r={self.block_r}, block_v={self.block_v}, num_warps={self.num_warps}, "
                f"epilogue_parts={self.epilogue_parts}, num_stages={self.num_stages}")


def default_config(num_rows: int, element_size: int = 2, truncation: bool = False,
                   verification: bool = False, warp_specialized: bool = False) -> TileConfig:
    """Fixed tile table by number of rows (decode batch, or batch x (G+1) for verify) and by
    epilogue: candidates kept (truncation, whether verifying or not) or drafts verified are
    heavier, and other shapes win for them; 4-byte inputs take half the reduction step to
    fit the same shared memory. `warp_specialized`: the Gluon stage 1 can run (see
    `lm_head_ws.supported`); it takes launches of more than 64 rows, and of more than 32
    with truncation."""
    if warp_specialized and num_rows > (32 if truncation else 64):
        return _warp_specialized_config(num_rows, truncation)
    if truncation:
        config = _bf16_truncation_config(num_rows)
    elif verification:
        config = _bf16_verification_config(num_rows)
    else:
        config = _bf16_config(num_rows)
    if element_size > 2:
        config = dataclasses.replace(config, block_d=max(16, config.block_d // 2))
        if config.block_d > 128:
            # Up to 16 rows: 256-deep fp32 steps would take 144 KB (more than ~100 KB GPUs
            # give a block); the 40 KB of 64-deep steps on 3 stages, as before the 512-deep
            # bf16 entry (untimed for fp32).
            config = dataclasses.replace(config, block_d=64, num_stages=3)
    return config


def _warp_specialized_config(num_rows: int, truncation: bool) -> TileConfig:
    # Above 64 rows on Hopper (32 with truncation): tiles of 64 or 128 rows by 128 tokens,
    # 64-deep steps, the epilogue beside the MMA (lm_head_ws.py). With truncation, 8
    # candidates per tile, the budget per token of the Triton truncation table's 33-64 rows
    # (its 64-wide tiles above had twice that; exact either way, completions counted in
    # `stats()`).
    # probes/sweep_tiles.py, H100, ratios to matmul in one run. 2026-11-23, tenth session:
    # untruncated, the noise screen with 4 epilogue warps up to 256 rows (sample R = 128
    # 0.985x, R = 256 1.19-1.24x, against 1.31-1.35x for the exact epilogue on 8 warps), 8
    # above (verify R = 512 1.22x against 1.42x on 4). Truncation: 8 warps without the screen,
    # whose registers cost the candidates' extraction more than it saves (verify-qwen R = 256
    # 0.72 ms against 0.79; sample-qwen R = 128 0.507 against 0.53 on 4 warps). Eleventh
    # session: the main loop waits for its loads (Nsight Compute: the MMA warps stalled on a
    # full stage half of argmax's time at R = 256), and a fifth 32 KB stage fits beside the
    # unpadded hand-over (224 KB): argmax R = 256 1.04-1.07x against 1.12-1.15x, sample and
    # verify R = 128 1% faster; for 8 warps above 256 rows and for truncation, 4 stages
    # stayed as fast or faster (verify R = 384-512 1.14-1.25x on 4 against 1.14-1.32x on 5,
    # qwen R = 256 1.36x against 1.43x).
    # Truncation from 33 to 128 rows: 64-row tiles, whose 32 KB hand-over leaves room for 8
    # stages (qwen R = 64 1.03x matmul against 1.09x for the Triton table, R = 128 1.05x
    # against 1.09x for 128-row tiles; verify-qwen R = 64 1.06x against 1.21x, R = 128
    # 1.08x against 1.11x; the Triton table stays up to 32 rows, where it is as fast or
    # faster: verify-qwen R = 16 1.04x against 1.05x).
    if truncation and num_rows <= 128:
        return TileConfig(block_v=128, block_r=64, block_d=64, num_warps=8, num_stages=8,
                          warp_specialized=True)
    if truncation:
        return TileConfig(block_v=128, block_r=128, block_d=64, num_warps=8, num_stages=4,
                          warp_specialized=True)
    # Untruncated from 65 to 128 rows: 64-row tiles on 8 stages and the exact epilogue, 1-2%
    # faster than 128-row tiles on 5 with the screen in every pair timed (sample, verify,
    # argmax at R = 96 and 128: sample R = 128 0.455-0.457 ms against 0.462-0.467).
    if num_rows <= 128:
        return TileConfig(block_v=128, block_r=64, block_d=64, num_warps=4, num_stages=8,
                          warp_specialized=True)
    # 129-256 rows: the race too. Seventeenth session, H100, stage 1 at locked base clocks
    # (probes/epilogue_probe.py, variant full), R = 256: sample 1.199 -> 1.102x matmul,
    # verify 1.271 -> 1.231x. On 8 epilogue warps it loses (R = 512: sample 1.236 -> 1.261x,
    # verify 1.296 -> 1.394x); 64-row tiles with the exact epilogue too (verify R = 128
    # 0.995 -> 1.03x matmul in a sweep). Eighteenth session, the leaders' path
    # (`lm_head._race_leaders`), the same probe, two A/B pairs in one call: verify
    # 1.210 / 1.226 -> 1.171 / 1.173x (its 132 bytes of spills gone), sample 1.093 / 1.097 ->
    # 1.099 / 1.098x. At 512 rows, 4 warps with both against 8 with the screen: sample 1.189
    # against 1.223x, verify 1.373 against 1.264x; 8 warps stay (the table has no kernel kind).
    if num_rows <= 256:
        return TileConfig(block_v=128, block_r=128, block_d=64, num_warps=4, num_stages=5,
                          warp_specialized=True, screen=True, race=True)
    return TileConfig(block_v=128, block_r=128, block_d=64, num_warps=8, num_stages=4,
                      warp_specialized=True, screen=True)


def _bf16_config(num_rows: int) -> TileConfig:
    # From probes/sweep_tiles.py on an H200 and scratch probes on an H100 (D=4096,
    # V=151,936, bf16), 2026-11-21. Up to 16 rows, 64-wide vocab tiles: five programs of
    # 40 KB per SM instead of three of 72 KB (probes/kernel_registers.py), more of them
    # streaming while others are in their prologue or epilogue (graph-timed H100, B=16:
    # sample 0.441 -> 0.432 ms, argmax 0.435 -> 0.430; B=1 and the H200 tie). Truncation
    # keeps 128 (its own table). 512-deep steps (H100, 2026-11-23, sweeps in one call):
    # sample R = 1 0.438 -> 0.422 ms, R = 16 0.436 -> 0.424, argmax R = 1 0.434 -> 0.421,
    # verify R = 16 0.441 -> 0.431; each step reads 1 KB runs of 64 weight rows instead of
    # 256-byte ones (256-deep steps do as well, 64-deep ones worse: 0.448 in another call).
    # num_stages=2 keeps one 80 KB buffer (Triton allocates num_stages - 1): two programs
    # per SM, and it fits GPUs with ~100 KB of shared memory per block (bf16; 4-byte
    # inputs: `default_config`).
    if num_rows <= 16:
        return TileConfig(block_v=64, block_r=16, block_d=512, num_warps=4, num_stages=2)
    if num_rows <= 64:  # two stages: two programs per SM, epilogue overlaps the main loop
        return TileConfig(block_v=128, block_r=32 if num_rows <= 32 else 64, block_d=128,
                          num_warps=8, num_stages=2)
    # 128x128 tiles keep the TMA main loop near cuBLAS; summarising them in two halves
    # needs fewer registers (H100, B=128: 0.546 -> 0.532 ms with 128-deep steps, 3 stages).
    return TileConfig(block_v=128, block_r=128, block_d=128, num_warps=8, num_stages=3,
                      epilogue_parts=2)


def _bf16_verification_config(num_rows: int) -> TileConfig:
    # Verification's epilogue (log-sum-exp, the draft's mask and logit) takes 209 registers
    # on 128x128 tiles, one program per SM; 64-row tiles keep it at 128 registers, two per
    # SM, one's epilogue beside the other's main loop (probes/kernel_registers.py).
    # probes/sweep_tiles.py --kernel verify, H100, 2026-11-21, same run each: R = 96
    # 0.645 -> 0.590 ms, R = 128 0.652 -> 0.540 (sampling gains nothing: 128 rows tie, 96
    # and 256 rows are 12-14% slower). R = 256: -4% in one probe, not taken yet.
    if 64 < num_rows <= 128:
        return TileConfig(block_v=128, block_r=64, block_d=64, num_warps=8, num_stages=4)
    return _bf16_config(num_rows)


def _bf16_truncation_config(num_rows: int) -> TileConfig:
    # probes/sweep_tiles.py --truncation on an H200, 2026-11-21 (top_k=20, top_p=0.95),
    # after candidates were extracted from the fp32 logits (no int64 sort in the
    # epilogue): 128-wide tiles win again, and halve the tile maxima stage 2 sorts.
    # 17-32 rows: 0.368 -> 0.354 ms; 33-64 rows: 0.404 -> 0.377 ms.
    if num_rows <= 16:  # 128-wide: half the tile maxima for stage 2 to sort
        return TileConfig(block_v=128, block_r=16, block_d=128, num_warps=4, num_stages=3)
    if num_rows <= 32:
        return TileConfig(block_v=128, block_r=32, block_d=128, num_warps=8, num_stages=3)
    if num_rows <= 64:
        return TileConfig(block_v=128, block_r=64, block_d=64, num_warps=8, num_stages=4)
    return TileConfig(block_v=64, block_r=128, block_d=128, num_warps=8, num_stages=4)


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


def fused_argmax(hidden: torch.Tensor, weight: torch.Tensor, *,
                 config: TileConfig | None = None) -> ArgmaxOutput:
    """Greedy tokens of ``hidden [B, D] @ weight [V, D].T`` (see `flashspec.sampling.argmax`),
    unchecked; `config`: tiles of stage 1 (None: `default_config`)."""
    out = _launch(hidden, weight, None, None, 1, config)
    return ArgmaxOutput(out.tokens, out.status)


def fused_sample(hidden: torch.Tensor, weight: torch.Tensor, params: SamplingParams,
                 positions: torch.Tensor, *, config: TileConfig | None = None) -> SampleOutput:
    """One token per row of ``hidden [B, D]`` (see `flashspec.sampling.sample`), unchecked,
    with its logprob and the log-sum-exp, which every caller wants (the engine reports
    logprobs): stage 1 computes the log-sum-exp unless every row has a top-k below V."""
    out = _launch(hidden, weight, params, positions, 1, config)
    return SampleOutput(out.tokens, out.logprobs, out.lse, out.status)


def fused_verify(hidden: torch.Tensor, weight: torch.Tensor, draft_tokens: torch.Tensor,
                 params: SamplingParams, positions: torch.Tensor, *, acceptance: str = "strict",
                 config: TileConfig | None = None) -> VerifyOutput:
    """Verification of ``draft_tokens [B, G]`` against ``hidden [B, G+1, D]`` (see
    `flashspec.sampling.verify`), unchecked."""
    batch_size, num_positions, dim = hidden.shape
    num_drafts = num_positions - 1
    draft_tokens = draft_tokens.contiguous()
    rows = _launch(hidden.reshape(batch_size * num_positions, dim), weight, params, positions,
                   num_positions, config, drafts=draft_tokens)
    device = hidden.device
    pdl = programmatic_launch_ready(device)
    out = VerifyOutput(
        torch.empty(batch_size, dtype=torch.int64, device=device),
        torch.empty(batch_size, num_positions, dtype=torch.int64, device=device),
        torch.empty(batch_size, num_drafts, dtype=torch.float32, device=device),
        torch.empty(batch_size, num_positions, dtype=torch.float32, device=device),
        torch.empty(batch_size, dtype=torch.int32, device=device))
    lm_head.verify_finalize_kernel[(batch_size,)](
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


def _launch(hidden: torch.Tensor, weight: torch.Tensor, params: SamplingParams | None,
            positions: torch.Tensor | None, rows_per_param: int, config: TileConfig | None,
            drafts: torch.Tensor | None = None) -> _Rows:
    """Stage 1 + stage 2 over rows of `hidden` ``[R, D]``; row r uses parameter row
    r // rows_per_param and noise position positions[r // rows_per_param] + r % rows_per_param.
    With `drafts` (``[R // rows_per_param, rows_per_param - 1]``, -1 padded), row r also
    verifies draft ``drafts[r // rows_per_param, r % rows_per_param]`` (none on the last)."""
    num_rows, dim = hidden.shape
    vocab_size = weight.shape[0]
    verify = drafts is not None
    sample, truncate, need_lse, tile_noise, tile_drafts = kernel_variant(params, vocab_size, verify)
    device = hidden.device
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    warp_specialized = warp_specialized_ready(hidden, weight)
    config = config or default_config(num_rows, hidden.element_size(), truncate, verify,
                                      warp_specialized)
    if config.warp_specialized and not warp_specialized:
        raise ValueError("TileConfig(warp_specialized=True) needs CUDA tensors on a Hopper GPU "
                         "(not Triton's interpreter), Triton " + lm_head_ws.TESTED_TRITON + "x "
                         "with Gluon, and bf16 or fp16 operands with 16-byte aligned rows; use "
                         "another TileConfig")
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
    bounds = (torch.full((num_rows,), lm_head.NO_BOUND, dtype=torch.int32, device=device)
              if race else best_id)
    summaries = (best, best_id, best_s, tile_max, tile_sum, bad)
    if config.warp_specialized:
        lm_head_ws.launch(hidden, weight, row, summaries, candidates, drafts, draft_s, bounds,
                          num_vt, rows_per_param, config, tile_noise, need_lse, cand, tile_drafts,
                          race)
    else:
        _launch_tiles(hidden, weight, row, summaries, candidates, drafts, draft_s, bounds, num_vt,
                      rows_per_param, config, tile_noise, need_lse, cand, tile_drafts, race)
    out = _Rows(torch.empty(num_rows, dtype=torch.int64, device=device), torch.empty(num_rows, **f32),
                torch.empty(num_rows, **f32), torch.empty(num_rows, dtype=torch.int32, device=device),
                *((torch.empty(num_rows, dtype=torch.int64, device=device),
                   *(torch.empty(num_rows, **f32) for _ in range(3))) if verify else ()))
    unused = out.logprobs  # pointers the kernel does not touch without DRAFT
    pdl = programmatic_launch_ready(device)
    vt_pow2 = triton.next_power_of_2(num_vt)
    top_tiles = min(config.max_support, vt_pow2)
    lm_head.lm_head_rows_kernel[(num_rows,)](
        best, best_id, best_s, tile_max, tile_sum, bad, candidates, draft_s,
        row["do_sample"], row["temperature"], row["top_k"], row["top_p"], row["min_p"],
        row["seed"], row["position"], drafts,
        out.tokens, out.logprobs, out.lse, out.status,
        *((out.masked, out.masked_logprobs, out.draft_probs, out.draft_logprobs) if verify
          else (out.tokens, unused, unused, unused)),
        vocab_size, num_vt, rows_per_param,
        LSE=need_lse, CAND=cand, DRAFT=verify, TILE_DRAFTS=tile_drafts,
        K_MAX=min(config.max_support, top_tiles * max(cand, 1)),
        TOP_TILES=top_tiles, VT_POW2=vt_pow2,
        PAD=lm_head.PAD_KEY, PDL=pdl, num_warps=config.merge_warps if cand else 4,
        launch_pdl=pdl,
    )
    return out


def _launch_tiles(hidden, weight, row, summaries, candidates, drafts, draft_s, bounds, num_vt,
                  rows_per_param, config, noise, need_lse, cand, leave_out_drafts, race):
    """Stage 1 through the Triton kernel (`lm_head.lm_head_tiles_kernel`): the per-(row, vocab
    tile) `summaries` (best, best_id, best_s, tile_max, tile_sum, bad) and `candidates`; with
    `noise` the best is the Gumbel-max of sampled rows, with `leave_out_drafts` it leaves each
    row's draft out and writes the draft's logit to `draft_s`. With `race` (and `noise`),
    `bounds` holds each row's race bound (int32 order keys, `lm_head.NO_BOUND` at first), and
    a tile's best is -inf where the bound already beats it (or only a lower score, also
    below the bound, where one column of the row escapes it: `lm_head._race_leaders`)."""
    num_rows, dim = hidden.shape
    vocab_size = weight.shape[0]
    grid = (num_vt * triton.cdiv(num_rows, config.block_r),)
    # Truncation keeps candidates per tile: interleaved tiles spread a support of
    # neighbouring token ids over many tiles (see lm_head._column_tokens).
    interleave = cand > 0
    descriptors = tma_descriptors(hidden, weight, config, interleave)
    tma = descriptors is not None
    hidden_desc, weight_desc = descriptors if tma else (hidden, weight)
    lm_head.lm_head_tiles_kernel[grid](
        hidden, weight, hidden_desc, weight_desc, row["do_sample"], row["temperature"], row["seed"], row["position"],
        *summaries, candidates, drafts, draft_s, bounds,
        num_rows, vocab_size, dim, hidden.stride(0), weight.stride(0), num_vt, rows_per_param,
        SAMPLE=noise, LSE=need_lse, CAND=cand, DRAFT=leave_out_drafts,
        IEEE_DOT=hidden.dtype == torch.float32, INTERLEAVE=interleave,
        EVEN_V=vocab_size % config.block_v == 0, EVEN_D=dim % config.block_d == 0, TMA=tma,
        PARTS=config.epilogue_parts, SCREEN=config.screen, RACE=race,
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
    keys, `lm_head.NO_BOUND` where none). With `want_lse` the epilogue also computes the
    log-sum-exp's summaries (and the race takes their form of its test)."""
    num_rows = hidden.shape[0]
    num_vt = triton.cdiv(weight.shape[0], config.block_v)
    f32 = dict(dtype=torch.float32, device=hidden.device)
    best = torch.empty(num_rows, num_vt, **f32)
    best_id = torch.empty(num_rows, num_vt, dtype=torch.int32, device=hidden.device)
    summaries = (best, best_id, torch.empty(num_rows, num_vt, **f32),
                 torch.empty(num_rows, num_vt, **f32), torch.empty(num_rows, num_vt, **f32),
                 torch.empty_like(best_id))
    bounds = torch.full((num_rows,), lm_head.NO_BOUND, dtype=torch.int32, device=hidden.device)
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
