"""Stage 1 for many rows on Hopper: a warp-specialized Gluon kernel whose summaries equal
`lm_head.lm_head_tiles_kernel`'s.

Why: with 128x128 tiles the Triton kernel's sampling epilogue needs 209-255 registers, so one
program runs per SM and the MMA stands idle while the epilogue runs (BENCHMARKS.md, "Why
large B misses"): at B = 256 on an H100 sampling took 1.53x the cuBLAS matmul. Here each
SM runs one persistent program of three partitions that work on different tiles at once:

* a load warp streams hidden and weight tiles through a ring of shared-memory stages (TMA);
* an MMA warpgroup multiplies them (wgmma) into a ``[BR, BV]`` fp32 accumulator in
  registers and hands each finished tile to the epilogue through shared memory;
* the epilogue warps (the default partition) summarise the handed-over tile in chunks of
  rows while the MMA warpgroup already accumulates the next one.

Launches of fewer rows than a whole number of tiles get zero rows up to it (TMA's own
zero-fill of rows past the tensor is slow), and the epilogue skips chunks past the last row.

The epilogue is the Triton kernel's own code (`epilogue._scaled_logits`, `_screen`,
`_exact_best`, `_tile_summary`, `_store_summary`, `_store_candidates`,
`noise.philox_tile_bits`), which the interpreter tests run on the CPU; only the index
tensors, which Gluon needs in explicit layouts, are built here. Its chunks hold the tile in
the layout of a tensor-core accumulator (two neighbouring columns per thread, repeated every
8), so the four words of one Philox call land in one thread as in the Triton kernel. What
only runs on a Hopper GPU (the pipeline, the layouts of those index tensors, the chunks'
addresses) is checked there against the Triton kernel, output by output
(tests/test_kernels_ws.py).

Covers every launch (argmax, sampling, verification, with or without truncation: candidates
from interleaved tiles, loaded as one 16-row box per group; with or without the head's bias
and softcap, `epilogue._head_logits`, and logit edits, `epilogue._edited_logits`) of bf16/fp16
inputs whose rows are TMA-aligned, on Hopper GPUs;
`supported` says where.
"""

from __future__ import annotations

import functools

import torch
import triton

from .epilogue import (_additive_operands, _drafts_in_tile, _edited_logits, _exact_best,
                       _head_logits, _scaled_logits, _screen, _screened_best, _store_candidates,
                       _store_summary, _tile_summary, edit_arguments)
from .race import (_beaten_summary, _leader_summary, _publish_bounds, _race_beaten,
                   _race_leaders, _racing_rows, _row_bounds)
from .rows import _column_tokens, _row_drafts, _row_noise_keys, _row_params
from .noise import gumbel_from_bits, opaque, philox_blocks, philox_tile_bits

# Gluon is experimental and changes between Triton releases: the kernel is used with the
# release it was written and tested for, and the Triton kernel covers every launch otherwise.
TESTED_TRITON = "3.6."
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None
if not triton.__version__.startswith(TESTED_TRITON):  # pragma: no cover
    gluon = None

# Registers per thread: the launch gives every warp the same share of the SM's 65,536 (the
# load warp's warpgroup, the MMA warpgroup and the epilogue's 4 or 8 warps); then the load
# warp gives most of its share back, the MMA warpgroup takes what its 128-register
# accumulator needs, and the epilogue warps get the rest (256 registers for 4 warps, 160 for
# 8; 168 for the MMA warpgroup compiles to the same spills, offline).
LOAD_REGISTERS = triton.language.constexpr(24)
MMA_REGISTERS = triton.language.constexpr(160)
EPILOGUE_WARPS = (4, 8)


def max_registers(epilogue_warps: int) -> int:
    """Registers per thread at launch: 65,536 over the kernel's warps, in multiples of 8."""
    return 65536 // (32 * (epilogue_warps + 8)) // 8 * 8


def supported(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the warp-specialized stage 1 can run these operands: a Hopper GPU, the Triton
    release it was tested with, 16-bit inputs, not Triton's interpreter. (Its TMA loads also
    need 16-byte aligned rows: `ops.tma_ready`.)"""
    if gluon is None or not hidden.is_cuda or triton.knobs.runtime.interpret:
        return False
    if torch.version.hip or torch.cuda.get_device_capability(hidden.device)[0] != 9:
        return False
    return hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == hidden.dtype


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


if gluon is not None:

    @gluon.jit
    def _load_partition(h_desc, w_desc, h_bufs, w_bufs, ready, empty, acc_smem, acc_ready,
                        acc_empty, D, NUM_VT, num_tiles, num_rt, INTERLEAVE: gl.constexpr):
        """One warp: hidden [BR, BD] and weight [BV, BD] tiles into the ring of stages. An
        interleaved weight tile (`rows._column_tokens`) is BV / 16 boxes of 16 rows.
        (Worker partitions share one argument list: the hand-over tile's is unused here.)"""
        BR: gl.constexpr = h_desc.block_type.shape[0]
        BD: gl.constexpr = h_desc.block_type.shape[1]
        BV: gl.constexpr = w_bufs.type.shape[1]
        STAGES: gl.constexpr = h_bufs.type.shape[0]
        nbytes: gl.constexpr = h_desc.block_type.nbytes + BV * BD * w_desc.dtype.primitive_bitwidth // 8
        step = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            # Row tiles of one vocab tile run side by side on neighbouring programs: the
            # weight tile comes from HBM once and from L2 for the others.
            pid_r = tile % num_rt
            pid_v = tile // num_rt
            for k in range(0, D, BD):
                stage = step % STAGES
                # A fresh barrier counts as having completed the phase before 0.
                mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(stage), nbytes)
                tma.async_copy_global_to_shared(h_desc, [pid_r * BR, k], ready.index(stage),
                                                h_bufs.index(stage))
                if INTERLEAVE:
                    for group in gl.static_range(BV // 16):
                        tma.async_copy_global_to_shared(
                            w_desc, [(group * NUM_VT + pid_v) * 16, k], ready.index(stage),
                            w_bufs.index(stage).slice(group * 16, 16))
                else:
                    tma.async_copy_global_to_shared(w_desc, [pid_v * BV, k], ready.index(stage),
                                                    w_bufs.index(stage))
                step += 1

    @gluon.jit
    def _mma_partition(h_desc, w_desc, h_bufs, w_bufs, ready, empty, acc_smem, acc_ready,
                       acc_empty, D, NUM_VT, num_tiles, num_rt, INTERLEAVE: gl.constexpr):
        """One warpgroup: acc[BR, BV] = hidden @ weight.T over the stages, fp32, then the
        tile to shared memory for the epilogue."""
        BR: gl.constexpr = h_desc.block_type.shape[0]
        BD: gl.constexpr = h_desc.block_type.shape[1]
        BV: gl.constexpr = w_bufs.type.shape[1]
        STAGES: gl.constexpr = h_bufs.type.shape[0]
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
        step = 0
        tile_count = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            acc = gl.zeros([BR, BV], gl.float32, layout)
            for k in range(0, D, BD):
                stage = step % STAGES
                mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
                acc = warpgroup_mma(h_bufs.index(stage), w_bufs.index(stage).permute((1, 0)), acc,
                                    is_async=True)
                # At most this step's MMA in flight: the previous step's stage is free.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=k > 0)
                step += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
            mbarrier.wait(acc_empty, (tile_count & 1) ^ 1)
            acc_smem.store(acc)
            mbarrier.arrive(acc_ready)
            tile_count += 1

    @gluon.constexpr_function
    def _handover_layout():
        """Row-major fp32 rows whose 8-word groups are permuted by row (the group index XOR
        the row mod 4): the MMA layout's stores (8 rows x 4 threads x 2 words per
        instruction) and the epilogue's loads then meet each bank at most twice, the least
        for 256 bytes, instead of 8 times (rows a multiple of 128 bytes apart start on the
        same bank), with no padding to take shared memory from the ring of stages. Viewed as
        chunks of rows (a multiple of 4 each), every chunk keeps the same permutation."""
        return gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=4, order=[1, 0])

    @gluon.jit
    def _tile_bits(seed, position, pid_v, NUM_VT, vocab_offset, CR: gl.constexpr,
                   BV: gl.constexpr, INTERLEAVE: gl.constexpr, layout: gl.constexpr):
        """`philox_tile_bits` of rows (seed, position) and vocab tile pid_v, in `layout`; the
        tile's tokens are global tokens `vocab_offset` + token, a multiple of 16 (`launch`)."""
        probe = gl.zeros([CR, BV], gl.float32, layout)
        # The layout philox_tile_bits's join / permute / reshape maps back onto `layout`.
        split: gl.constexpr = gl.permute(gl.reshape(probe, [CR, BV // 16, 2, 4, 2]),
                                         [0, 1, 3, 4, 2]).type.layout
        calls: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, split))
        first_columns = gl.arange(0, BV // 16, layout=gl.SliceLayout(1, gl.SliceLayout(0, calls))) * 16
        groups = (_column_tokens(first_columns, pid_v, NUM_VT, BV, INTERLEAVE) // 16
                  + vocab_offset // 16)
        quads = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, calls)))
        blocks = philox_blocks(groups, quads)
        rows: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, calls))
        seed = gl.convert_layout(seed, rows)[:, None, None]
        position = gl.convert_layout(position, rows)[:, None, None]
        return gl.convert_layout(philox_tile_bits(seed, position, blocks, CR, BV), layout)

    @gluon.jit
    def _chunk_rows(tile, chunk, num_rt, R, ROWS_PER_PARAM, do_sample_ptr, temperature_ptr,
                    seed_ptr, position_ptr, draft_ptr, bound_ptr, BR: gl.constexpr,
                    CR: gl.constexpr, layout: gl.constexpr, DRAFT: gl.constexpr,
                    RACE: gl.constexpr):
        """Rows of chunk `chunk` of `tile` and their parameters (global loads, issued a chunk
        ahead of their use so that their latency hides behind the previous chunk; the race's
        bounds are then a chunk older, which only makes them weaker)."""
        offs_r = (tile % num_rt) * BR + chunk * CR + gl.arange(0, CR, layout=gl.SliceLayout(1, layout))
        r_ok = offs_r < R
        safe_rows = gl.where(r_ok, offs_r, 0)
        sampled, temperature = _row_params(do_sample_ptr, temperature_ptr, safe_rows,
                                           ROWS_PER_PARAM)
        seed, position = _row_noise_keys(seed_ptr, position_ptr, safe_rows, ROWS_PER_PARAM)
        draft = offs_r  # unused without DRAFT
        if DRAFT:
            draft = _row_drafts(draft_ptr, safe_rows, r_ok, ROWS_PER_PARAM)
        bound = temperature  # unused without RACE
        if RACE:
            bound = _row_bounds(bound_ptr, offs_r, r_ok)
        return offs_r, r_ok, sampled, temperature, seed, position, draft, bound

    @gluon.jit
    def _noise_summary(s, row_sum, offs_v, columns, bits, pid_v, NUM_VT, vocab_offset, sampled,
                       seed, position, draft, LSE: gl.constexpr, DRAFT: gl.constexpr,
                       INTERLEAVE: gl.constexpr, SCREEN: gl.constexpr, layout: gl.constexpr):
        """`epilogue._noise_summary` of a chunk, with the Philox words in `layout`."""
        CR: gl.constexpr = s.shape[0]
        BV: gl.constexpr = s.shape[1]
        if SCREEN:
            unsure, top, leader, leader_s = _screen(s, row_sum, columns, bits, sampled, BV)
            draft_s = row_sum  # unused: a screened tile holds no draft (`_store_summary`)
            if DRAFT:  # the tile that holds a row's draft: exact (`epilogue._screen`)
                unsure |= _drafts_in_tile(draft, pid_v, NUM_VT, BV, INTERLEAVE)
            if unsure:
                bits = _tile_bits(opaque(seed), position, pid_v, NUM_VT, vocab_offset, CR, BV,
                                  INTERLEAVE, layout)
                best, best_column, best_s, draft_s = _exact_best(
                    s, row_sum, offs_v, columns, gumbel_from_bits(bits), sampled, draft,
                    True, LSE, DRAFT)
            else:
                best, best_column, best_s = _screened_best(
                    top, leader, leader_s, sampled, seed, position, pid_v, NUM_VT, vocab_offset,
                    BV, INTERLEAVE)
        else:
            best, best_column, best_s, draft_s = _exact_best(
                s, row_sum, offs_v, columns, gumbel_from_bits(bits), sampled, draft, True, LSE,
                DRAFT)
        return _tile_summary(s, row_sum, best, best_column, best_s, draft_s, pid_v, NUM_VT, BV,
                             INTERLEAVE, LSE)

    @gluon.jit
    def _summarise_chunk(acc, rows, count, pid_v, V, NUM_VT, ROWS_PER_PARAM, vocab_offset,
                         best_ptr, best_id_ptr, best_s_ptr, max_ptr, sumexp_ptr, bad_ptr,
                         draft_s_ptr, cand_ptr, bound_ptr, codes_ptr, penalty_ptr,
                         logit_bias_ptr, frequency_ptr, presence_ptr, bias_ptr, softcap,
                         SAMPLE: gl.constexpr, LSE: gl.constexpr, DRAFT: gl.constexpr,
                         CAND: gl.constexpr, CODES: gl.constexpr, LOGIT_BIAS: gl.constexpr,
                         BIAS_PER_POSITION: gl.constexpr, COUNTS: gl.constexpr,
                         BIAS: gl.constexpr, SOFTCAP: gl.constexpr, INTERLEAVE: gl.constexpr,
                         EVEN_V: gl.constexpr, SCREEN: gl.constexpr, RACE: gl.constexpr,
                         layout: gl.constexpr):
        """The summaries (and candidates) of a chunk `acc` ``[CR, BV]`` of rows `rows`
        (`_chunk_rows`) and vocab tile pid_v; with BIAS / SOFTCAP of the model's logits,
        with CODES, LOGIT_BIAS or COUNTS of its edited logits (`count`: the chunk's counts,
        `epilogue._additive_operands`)."""
        CR: gl.constexpr = acc.shape[0]
        BV: gl.constexpr = acc.shape[1]
        offs_r, r_ok, sampled, temperature, seed, position, draft, bound = rows
        inv_t = 1.0 / temperature
        columns = gl.arange(0, BV, layout=gl.SliceLayout(0, layout))
        EDITS: gl.constexpr = CODES or LOGIT_BIAS or COUNTS
        if BIAS or SOFTCAP or EDITS:
            tokens = _column_tokens(columns, pid_v, NUM_VT, BV, INTERLEAVE)
        if BIAS or SOFTCAP:  # as the Triton kernel: the model's own logits first
            acc = _head_logits(acc, bias_ptr, softcap, tokens, tokens < V, BIAS, SOFTCAP)
        if EDITS:  # then the logits processors
            safe_rows = gl.where(r_ok, offs_r, 0)
            # The bias with the chunk (the counts came before it: `_epilogue_partition`).
            bias, _ = _additive_operands(logit_bias_ptr, None, None, safe_rows, tokens, r_ok,
                                         tokens < V, V, ROWS_PER_PARAM, LOGIT_BIAS,
                                         BIAS_PER_POSITION, False)
            acc = _edited_logits(acc, codes_ptr, penalty_ptr, (bias, count), frequency_ptr,
                                 presence_ptr, safe_rows, tokens, r_ok, tokens < V, V,
                                 ROWS_PER_PARAM, CODES, LOGIT_BIAS, COUNTS)
        s, row_sum, offs_v = _scaled_logits(acc, columns, pid_v, NUM_VT, V, inv_t, BV,
                                            INTERLEAVE, EVEN_V)
        if CAND > 0:  # first: the raw logits are not needed after it
            _store_candidates(acc, offs_v, V, cand_ptr + (offs_r * NUM_VT + pid_v) * CAND, r_ok,
                              CAND, EVEN_V)
        # As lm_head._part_summary, with two differences that only registers decide:
        # candidates first (the Triton kernel keeps the whole tile in registers anyway)
        # and the Philox words computed after the chunk's load.
        if SAMPLE:
            # With the screen, the words' position is made to depend on the chunk's logits
            # (NaN rows, the only ones it changes, are never beaten and take the screen's
            # exact path, which recomputes the words): the words are then computed after the
            # chunk's load, not hoisted above it and held through it (8 warps: 80 -> 24
            # bytes of spills). Without the screen the words are the exact path's own.
            words_position = position
            if SCREEN:
                words_position = position + (row_sum != row_sum).to(gl.int64)
            bits = _tile_bits(seed, words_position, pid_v, NUM_VT, vocab_offset, CR, BV,
                              INTERLEAVE, layout)
            if RACE:
                racing = _racing_rows(sampled, draft, pid_v, NUM_VT, BV, INTERLEAVE, DRAFT)
                beaten, tile_max, exp_s = _race_beaten(s, row_sum, bits, bound, racing, r_ok,
                                                       LSE)
                if beaten:
                    summary = _beaten_summary(row_sum, tile_max, exp_s, LSE)
                else:
                    single, num_candidates, leader, leader_s = _race_leaders(
                        s, row_sum, columns, bits, bound, racing, r_ok, tile_max, exp_s, BV,
                        LSE)
                    if single:
                        summary = _leader_summary(
                            num_candidates, leader, leader_s, row_sum, tile_max, exp_s, seed,
                            position, pid_v, NUM_VT, vocab_offset, BV, INTERLEAVE, LSE)
                    else:
                        summary = _noise_summary(s, row_sum, offs_v, columns, bits, pid_v,
                                                 NUM_VT, vocab_offset, sampled, seed, position,
                                                 draft, LSE, DRAFT, INTERLEAVE, SCREEN, layout)
            else:
                summary = _noise_summary(s, row_sum, offs_v, columns, bits, pid_v, NUM_VT,
                                         vocab_offset, sampled, seed, position, draft, LSE, DRAFT,
                                         INTERLEAVE, SCREEN, layout)
        else:
            best, best_column, best_s, draft_s = _exact_best(
                s, row_sum, offs_v, columns, s, sampled, draft, SAMPLE, LSE, DRAFT)
            summary = _tile_summary(s, row_sum, best, best_column, best_s, draft_s, pid_v,
                                    NUM_VT, BV, INTERLEAVE, LSE)
        _store_summary(summary, offs_r, r_ok, draft, pid_v, NUM_VT, best_ptr, best_id_ptr,
                       best_s_ptr, max_ptr, sumexp_ptr, bad_ptr, draft_s_ptr, BV, INTERLEAVE, LSE,
                       DRAFT)
        if RACE and SAMPLE:
            _publish_bounds(bound_ptr, offs_r, r_ok, sampled, summary[0], summary[2], bound)

    @gluon.jit
    def _epilogue_partition(acc_smem, acc_ready, acc_empty,
                            do_sample_ptr, temperature_ptr, seed_ptr, position_ptr,
                            best_ptr, best_id_ptr, best_s_ptr, max_ptr, sumexp_ptr, bad_ptr,
                            draft_ptr, draft_s_ptr, cand_ptr, bound_ptr, codes_ptr, penalty_ptr,
                            logit_bias_ptr, counts_ptr, frequency_ptr, presence_ptr,
                            bias_ptr, softcap, R, V, NUM_VT, ROWS_PER_PARAM, vocab_offset,
                            num_tiles, num_rt,
                            SAMPLE: gl.constexpr, LSE: gl.constexpr, DRAFT: gl.constexpr,
                            CAND: gl.constexpr, CODES: gl.constexpr, LOGIT_BIAS: gl.constexpr,
                            BIAS_PER_POSITION: gl.constexpr, COUNTS: gl.constexpr,
                            BIAS: gl.constexpr, SOFTCAP: gl.constexpr, INTERLEAVE: gl.constexpr,
                            EVEN_V: gl.constexpr, SCREEN: gl.constexpr, RACE: gl.constexpr,
                            CR: gl.constexpr):
        """The default partition: each handed-over tile, CR rows at a time, through the
        Triton kernel's epilogue."""
        BR: gl.constexpr = acc_smem.type.shape[0]
        BV: gl.constexpr = acc_smem.type.shape[1]
        NUM_CHUNKS: gl.constexpr = BR // CR
        layout: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [gl.num_warps(), 1], [1, 0])
        # The same bytes as NUM_CHUNKS consecutive [CR, BV] tiles, one indexed per step.
        chunks = acc_smem._reinterpret(gl.float32, [NUM_CHUNKS, CR, BV], _handover_layout())
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        num_steps = gl.cdiv(num_tiles - pid, nprog) * NUM_CHUNKS
        rows = _chunk_rows(pid, 0, num_rt, R, ROWS_PER_PARAM, do_sample_ptr, temperature_ptr,
                           seed_ptr, position_ptr, draft_ptr, bound_ptr, BR, CR, layout, DRAFT,
                           RACE)
        for step in range(num_steps):
            tile = pid + (step // NUM_CHUNKS) * nprog
            chunk = step % NUM_CHUNKS
            pid_v = tile // num_rt
            # The next chunk's rows (past the last tile: in-bounds rows, never used).
            next_rows = _chunk_rows(pid + ((step + 1) // NUM_CHUNKS) * nprog,
                                    (step + 1) % NUM_CHUNKS, num_rt, R, ROWS_PER_PARAM,
                                    do_sample_ptr, temperature_ptr, seed_ptr, position_ptr,
                                    draft_ptr, bound_ptr, BR, CR, layout, DRAFT, RACE)
            count = 0  # unused without COUNTS
            if COUNTS:
                # The counts before the chunk's logits (`epilogue._additive_operands`: fewer
                # spills; the bias comes with the chunk, `_summarise_chunk`).
                offs_r, r_ok = rows[0], rows[1]
                tokens = _column_tokens(gl.arange(0, BV, layout=gl.SliceLayout(0, layout)),
                                        pid_v, NUM_VT, BV, INTERLEAVE)
                _, count = _additive_operands(None, counts_ptr, draft_ptr,
                                              gl.where(r_ok, offs_r, 0), tokens, r_ok,
                                              tokens < V, V, ROWS_PER_PARAM, False, False,
                                              COUNTS)
            if chunk == 0:
                mbarrier.wait(acc_ready, (step // NUM_CHUNKS) & 1)
            acc = chunks.index(chunk).load(layout)
            if chunk == NUM_CHUNKS - 1:  # the whole tile is in registers or done: free it
                mbarrier.arrive(acc_empty)
            # Chunks past the last row (a tile of fewer than BR rows) are skipped.
            if (tile % num_rt) * BR + chunk * CR < R:
                _summarise_chunk(acc, rows, count, pid_v, V, NUM_VT, ROWS_PER_PARAM,
                                 vocab_offset, best_ptr, best_id_ptr, best_s_ptr, max_ptr,
                                 sumexp_ptr, bad_ptr, draft_s_ptr, cand_ptr, bound_ptr, codes_ptr,
                                 penalty_ptr, logit_bias_ptr, frequency_ptr, presence_ptr,
                                 bias_ptr, softcap, SAMPLE, LSE, DRAFT, CAND,
                                 CODES, LOGIT_BIAS, BIAS_PER_POSITION, COUNTS, BIAS, SOFTCAP,
                                 INTERLEAVE, EVEN_V, SCREEN, RACE, layout)
            rows = next_rows

    @gluon.jit
    def lm_head_tiles_ws_kernel(
        h_desc, w_desc, do_sample_ptr, temperature_ptr, seed_ptr, position_ptr,
        best_ptr, best_id_ptr, best_s_ptr, max_ptr, sumexp_ptr, bad_ptr, draft_ptr, draft_s_ptr,
        cand_ptr, bound_ptr, codes_ptr, penalty_ptr, logit_bias_ptr, counts_ptr, frequency_ptr,
        presence_ptr, bias_ptr, softcap, R, V, D, NUM_VT,
        ROWS_PER_PARAM, vocab_offset, SAMPLE: gl.constexpr, LSE: gl.constexpr,
        DRAFT: gl.constexpr, CAND: gl.constexpr, CODES: gl.constexpr, LOGIT_BIAS: gl.constexpr,
        BIAS_PER_POSITION: gl.constexpr, COUNTS: gl.constexpr, BIAS: gl.constexpr,
        SOFTCAP: gl.constexpr, INTERLEAVE: gl.constexpr, EVEN_V: gl.constexpr,
        SCREEN: gl.constexpr, RACE: gl.constexpr,
        BLOCK_V: gl.constexpr, NUM_STAGES: gl.constexpr, CHUNK_R: gl.constexpr,
    ):
        BR: gl.constexpr = h_desc.block_type.shape[0]
        BD: gl.constexpr = h_desc.block_type.shape[1]
        BV: gl.constexpr = BLOCK_V  # an interleaved tile loads as boxes of 16 weight rows
        h_bufs = gl.allocate_shared_memory(h_desc.dtype, [NUM_STAGES, BR, BD], h_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BV, BD],
                                           gl.NVMMASharedLayout.get_default_for([BV, BD], w_desc.dtype))
        # The finished tile, handed from the MMA warpgroup to the epilogue.
        acc_smem = gl.allocate_shared_memory(gl.float32, [BR, BV], _handover_layout())
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        acc_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        acc_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(acc_ready, count=1)
        mbarrier.init(acc_empty, count=1)

        num_rt = gl.cdiv(R, BR)
        num_tiles = num_rt * NUM_VT
        worker_args = (h_desc, w_desc, h_bufs, w_bufs, ready, empty, acc_smem, acc_ready,
                       acc_empty, D, NUM_VT, num_tiles, num_rt, INTERLEAVE)
        gl.warp_specialize([
            (_epilogue_partition, (acc_smem, acc_ready, acc_empty, do_sample_ptr, temperature_ptr,
                                   seed_ptr, position_ptr, best_ptr, best_id_ptr, best_s_ptr,
                                   max_ptr, sumexp_ptr, bad_ptr, draft_ptr, draft_s_ptr, cand_ptr,
                                   bound_ptr, codes_ptr, penalty_ptr, logit_bias_ptr, counts_ptr,
                                   frequency_ptr, presence_ptr, bias_ptr, softcap, R, V,
                                   NUM_VT, ROWS_PER_PARAM, vocab_offset, num_tiles, num_rt,
                                   SAMPLE, LSE, DRAFT, CAND, CODES, LOGIT_BIAS,
                                   BIAS_PER_POSITION, COUNTS, BIAS, SOFTCAP, INTERLEAVE, EVEN_V,
                                   SCREEN, RACE, CHUNK_R)),
            (_load_partition, worker_args),
            (_mma_partition, worker_args),
        ], [1, 4], [LOAD_REGISTERS, MMA_REGISTERS])


def descriptors(hidden: torch.Tensor, weight: torch.Tensor, block_r: int, block_v: int,
                block_d: int, interleave: bool):
    """Gluon TMA descriptors of the hidden [block_r, block_d] and weight [block_v, block_d]
    tiles, or weight [16, block_d] groups for interleaved tiles (zero-filled past the
    edges: padded rows and columns add nothing)."""
    dtype = gl.bfloat16 if hidden.dtype == torch.bfloat16 else gl.float16
    weight_box = [16 if interleave else block_v, block_d]
    return (TensorDescriptor.from_tensor(
                hidden, [block_r, block_d], gl.NVMMASharedLayout.get_default_for([block_r, block_d], dtype)),
            TensorDescriptor.from_tensor(
                weight, weight_box, gl.NVMMASharedLayout.get_default_for(weight_box, dtype)))


def launch(hidden, weight, row, summaries, candidates, drafts, draft_s, bounds, num_vt,
           rows_per_param, config, noise, need_lse, cand, leave_out_drafts, race,
           edits=None, bias=None, softcap=None, vocab_offset=0) -> None:
    """Stage 1 through the warp-specialized kernel, writing what `ops._launch_tiles` writes:
    `summaries` (best, best_id, best_s, tile_max, tile_sum, bad; with `noise` the best is the
    Gumbel-max of sampled rows, -inf with `race` where `bounds` beat it), with `cand` > 0
    the `candidates` of interleaved tiles, and, with `leave_out_drafts`, `draft_s`. The
    logits are first the model's with its LM-head `bias` (``[V]``, contiguous) and `softcap`
    (`epilogue._head_logits`), then edited with `edits` (`flashspec.params.LogitEdits` of
    the launch's rows, `epilogue.edit_arguments`). `vocab_offset`: the global id of the
    weight's first token, which keys the noise; a multiple of 16, so that the noise's groups
    of 16 tokens are the tiles' (`ops` runs the Triton kernel for other shards)."""
    num_rows, dim = hidden.shape
    vocab_size = weight.shape[0]
    interleave = cand > 0
    if num_rows % config.block_r:
        # Zero rows up to the tile: TMA also fills a box's rows past the tensor with zeros,
        # but slowly (BENCHMARKS.md: 128-row tiles at R = 1 / 16 / 64 took 1.48 / 1.34 /
        # 1.11x matmul against 0.99x at R = 128). The kernel still reads R rows' parameters
        # and writes R rows' summaries.
        padded = hidden.new_zeros(triton.cdiv(num_rows, config.block_r) * config.block_r, dim)
        padded[:num_rows] = hidden
        hidden = padded
    h_desc, w_desc = descriptors(hidden, weight, config.block_r, config.block_v, config.block_d,
                                 interleave)
    num_tiles = num_vt * triton.cdiv(num_rows, config.block_r)
    grid = (min(num_tiles, _num_sms(hidden.device.index)),)
    edit_pointers, edit_flags = edit_arguments(edits, num_rows, vocab_size, draft_s)
    lm_head_tiles_ws_kernel[grid](
        h_desc, w_desc, row["do_sample"], row["temperature"], row["seed"], row["position"],
        *summaries, drafts, draft_s, candidates, bounds, *edit_pointers,
        draft_s if bias is None else bias, 1.0 if softcap is None else softcap,
        num_rows, vocab_size, dim, num_vt, rows_per_param, vocab_offset,
        SAMPLE=noise, LSE=need_lse, DRAFT=leave_out_drafts, CAND=cand, **edit_flags,
        BIAS=bias is not None, SOFTCAP=softcap is not None, INTERLEAVE=interleave,
        EVEN_V=vocab_size % config.block_v == 0, SCREEN=config.screen, RACE=race,
        BLOCK_V=config.block_v,
        NUM_STAGES=config.num_stages, CHUNK_R=8 * config.num_warps,  # rows its layout covers
        num_warps=config.num_warps, maxnreg=max_registers(config.num_warps),
    )
