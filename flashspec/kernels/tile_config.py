"""Stage 1's tiles and the candidate budget: `TileConfig` and the fixed table `default_config`.

Tile sizes come from a fixed table keyed by the number of rows and the epilogue's weight (no
autotuning: re-tuning per batch size is what wrecks serving); results never depend on them.
Each entry was chosen by `probes/sweep_tiles.py` against cuBLAS matmul of the same rows in one
run; the measurements behind the numbers are in BENCHMARKS.md's history and the git history of
docs/bench/.
"""

from __future__ import annotations

import dataclasses

from . import lm_head_ws


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
    best through the noise screen (`epilogue._screen`: about half the epilogue's instructions,
    more registers; the same results), for tiles where the epilogue bounds the time;
    race: sampled rows skip the search for a tile's best wherever the best score already
    found for the row, shared by all programs through global memory, provably beats every
    column of the tile (`race._race_beaten`: an exponential and a multiply-add per column
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
    # (exact either way, completions counted in `stats()`), 8 epilogue warps and no screen,
    # whose registers cost the candidates' extraction more than it saves; 64-row tiles up to
    # 128 rows, whose 32 KB hand-over leaves room for 8 stages (qwen R = 64 1.03x matmul
    # against 1.09x for the Triton table). History: tenth and eleventh sessions.
    if truncation and num_rows <= 128:
        return TileConfig(block_v=128, block_r=64, block_d=64, num_warps=8, num_stages=8,
                          warp_specialized=True)
    if truncation:
        return TileConfig(block_v=128, block_r=128, block_d=64, num_warps=8, num_stages=4,
                          warp_specialized=True)
    # Untruncated, 65-128 rows: 64-row tiles on 8 stages and the exact epilogue, 1-2% faster
    # than 128-row tiles with the screen in every pair timed.
    if num_rows <= 128:
        return TileConfig(block_v=128, block_r=64, block_d=64, num_warps=4, num_stages=8,
                          warp_specialized=True)
    # 129-256 rows: the main loop waits for its loads, so a fifth 32 KB stage (it fits beside
    # the hand-over, 224 KB); the screen and the race on 4 epilogue warps, which make the
    # epilogue cheap enough to hide (sample R = 256 1.10x matmul, verify 1.17x at locked
    # clocks). History: eleventh, seventeenth and eighteenth sessions.
    if num_rows <= 256:
        return TileConfig(block_v=128, block_r=128, block_d=64, num_warps=4, num_stages=5,
                          warp_specialized=True, screen=True, race=True)
    # Above 256 rows: 8 epilogue warps with the screen, no race (on 8 warps the race loses).
    # One entry serves every kernel: verify R = 512 1.26x matmul here against 1.37x on 4
    # warps with both, though sample would take the latter (1.19x against 1.22x).
    return TileConfig(block_v=128, block_r=128, block_d=64, num_warps=8, num_stages=4,
                      warp_specialized=True, screen=True)


def _bf16_config(num_rows: int) -> TileConfig:
    # Up to 16 rows, the weight's stream is the time: 64-wide vocab tiles (five 40 KB
    # programs per SM instead of three of 72 KB, more of them streaming while others are in
    # their epilogue) and 512-deep steps (each step reads 1 KB runs of 64 weight rows);
    # num_stages=2 keeps one 80 KB buffer (Triton allocates num_stages - 1): two programs per
    # SM, and it fits GPUs with ~100 KB of shared memory per block (4-byte inputs:
    # `default_config`). H100, sample B = 16: 0.441 -> 0.432 ms for the 64-wide tiles, then
    # 0.436 -> 0.424 for the deeper steps. History: eighth and twelfth sessions.
    if num_rows <= 16:
        return TileConfig(block_v=64, block_r=16, block_d=512, num_warps=4, num_stages=2)
    if num_rows <= 64:  # two stages: two programs per SM, epilogue overlaps the main loop
        return TileConfig(block_v=128, block_r=32 if num_rows <= 32 else 64, block_d=128,
                          num_warps=8, num_stages=2)
    # 128x128 tiles keep the TMA main loop near cuBLAS; summarising them in two halves
    # needs fewer registers (H100, B=128: 0.546 -> 0.532 ms).
    return TileConfig(block_v=128, block_r=128, block_d=128, num_warps=8, num_stages=3,
                      epilogue_parts=2)


def _bf16_verification_config(num_rows: int) -> TileConfig:
    # Verification's epilogue (log-sum-exp, the draft's mask and logit) takes 209 registers
    # on 128x128 tiles, one program per SM; 64-row tiles keep it at 128 registers, two per
    # SM, one's epilogue beside the other's main loop (probes/kernel_registers.py; H100,
    # R = 128: 0.652 -> 0.540 ms; eighth session). Sampling gains nothing from them.
    if 64 < num_rows <= 128:
        return TileConfig(block_v=128, block_r=64, block_d=64, num_warps=8, num_stages=4)
    return _bf16_config(num_rows)


def _bf16_truncation_config(num_rows: int) -> TileConfig:
    # Candidates are extracted from the fp32 logits (no int64 sort in the epilogue), so
    # 128-wide tiles win, and halve the tile maxima stage 2 sorts (H200, top-k 20 + top-p
    # 0.95, 33-64 rows: 0.404 -> 0.377 ms; seventh session).
    if num_rows <= 16:
        return TileConfig(block_v=128, block_r=16, block_d=128, num_warps=4, num_stages=3)
    if num_rows <= 32:
        return TileConfig(block_v=128, block_r=32, block_d=128, num_warps=8, num_stages=3)
    if num_rows <= 64:
        return TileConfig(block_v=128, block_r=64, block_d=64, num_warps=8, num_stages=4)
    return TileConfig(block_v=64, block_r=128, block_d=128, num_warps=8, num_stages=4)
