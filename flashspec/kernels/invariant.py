"""Batch-invariant decoder kernels: a row's result is bitwise the same whatever else shares
the launch (how many rows, how many tokens per row, where its keys sit in the cache).

Why they exist: with a seed, flashspec promises the same tokens with or without
speculation and alone or in a batch (DESIGN §3, points 2, 3 and 5). The sampler keeps that
promise only if the hidden state of a position is bitwise the same whether the forward ran
one token or k+1, one row or many. cuBLAS picks its algorithm (tile, split-K) by shape, and
PyTorch's reductions pick their thread layout by the number of rows: a row's sums are then
added in another order, its last bits move, and a close Gumbel race goes the other way.

Each kernel here fixes the order of every sum by the row's own data alone:

* `linear`: ``x @ w.T`` with one tile configuration for every M. The reduction dimension is
  cut into chunks of `CHUNK_K` (a function of K only); each chunk is summed from zero by the
  same sequence of MMAs, and the chunks are added in order. For few rows the chunks run in
  parallel programs (split-K) and the last program to finish a tile adds them; for many rows
  one program loops over them. Both add the same numbers in the same order.
* `row_mean`: the mean over the last dimension, one program per row, one block shape.

Attention is `flashspec.kernels.attention`'s (by sequence position), whose result for a
query does not depend on the call either.

The same code runs under Triton's CPU interpreter (the CPU tests).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 128     # linear's one tile configuration
CHUNK_STEPS = 4                             # BLOCK_K steps per chunk of the reduction
CHUNK_K = BLOCK_K * CHUNK_STEPS
LINEAR_WARPS, LINEAR_STAGES = 4, 4
MEAN_BLOCK = 1024
_MAX_TILES = 1 << 14                           # split-K tickets per device


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:     # fp32 operands: full fp32 products, not TF32
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _linear_chunk(x_ptr, w_ptr, rows, cols, chunk, M, N, K, stride_xm, stride_wn, stride_wk,
                  BLOCK_K: tl.constexpr, STEPS: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, IEEE: tl.constexpr):
    """One chunk of the reduction for a [BM, BN] tile, summed from zero."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for step in range(STEPS):
        ks = chunk * BLOCK_K * STEPS + step * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :] * stride_wk,
                    mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
        acc = _dot(x, tl.trans(w), acc, IEEE)
    return acc


@triton.jit
def _linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, ticket_ptr,
                   M, N, K, stride_xm, stride_wn, stride_wk, stride_om, num_chunks,
                   HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr,
                   STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT:
        # This program's chunk into the partials; the tile's last program adds them in order.
        chunk = tl.program_id(2)
        acc = _linear_chunk(x_ptr, w_ptr, rows, cols, chunk, M, N, K, stride_xm, stride_wn,
                            stride_wk, BLOCK_K, STEPS, BM, BN, IEEE)
        tile = rows[:, None] * N + cols[None, :]
        tl.store(part_ptr + chunk * M * N + tile, acc, mask=inside)
        ticket = ticket_ptr + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(ticket, 1, sem="acq_rel") == num_chunks - 1:
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for c in range(num_chunks):
                total += tl.load(part_ptr + c * M * N + tile, mask=inside, other=0.0,
                                 cache_modifier=".cg")
            tl.store(ticket, 0)         # ready for the next launch
            _linear_store(total, bias_ptr, out_ptr, rows, cols, N, inside, stride_om, HAS_BIAS)
    else:
        total = tl.zeros((BM, BN), dtype=tl.float32)
        for c in range(num_chunks):
            total += _linear_chunk(x_ptr, w_ptr, rows, cols, c, M, N, K, stride_xm, stride_wn,
                                   stride_wk, BLOCK_K, STEPS, BM, BN, IEEE)
        _linear_store(total, bias_ptr, out_ptr, rows, cols, N, inside, stride_om, HAS_BIAS)


@triton.jit
def _linear_store(total, bias_ptr, out_ptr, rows, cols, N, inside, stride_om,
                  HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
             total.to(out_ptr.dtype.element_ty), mask=inside)


@functools.cache
def _tickets(device: torch.device) -> torch.Tensor:
    # Zero between launches: each tile's last program resets its ticket.
    return torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)


@functools.cache
def _programs_to_fill(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose every output row is bitwise independent of the
    other rows of `x` (fp32 accumulation, the result in the dtype of `x`; `weight` may be
    any 2-d view, e.g. a transpose)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*shape[:-1], N)
    num_chunks = triton.cdiv(K, CHUNK_K)
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    split = num_chunks > 1 and tiles < _programs_to_fill(x.device) and tiles <= _MAX_TILES
    part = (torch.empty(num_chunks, M, N, dtype=torch.float32, device=x.device) if split
            else out)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), num_chunks if split else 1)
    _linear_kernel[grid](
        x, weight, bias if bias is not None else weight, out, part, _tickets(x.device),
        M, N, K, x.stride(0), weight.stride(0), weight.stride(1), out.stride(0), num_chunks,
        HAS_BIAS=bias is not None, SPLIT=split, BLOCK_K=BLOCK_K, STEPS=CHUNK_STEPS,
        BM=BLOCK_M, BN=BLOCK_N, IEEE=x.dtype == torch.float32, num_warps=LINEAR_WARPS,
        num_stages=LINEAR_STAGES)
    return out.reshape(*shape[:-1], N)


@triton.jit
def _row_mean_kernel(x_ptr, out_ptr, K, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, K, BLOCK):
        ks = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + row * stride + ks, mask=ks < K, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, (tl.sum(acc, axis=0) / K).to(out_ptr.dtype.element_ty))


def row_mean(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """``x.mean(-1, keepdim)`` with one summation order for every row, whatever the rows."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _row_mean_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0),
                                           BLOCK=MEAN_BLOCK, num_warps=4)
    return out.reshape(*shape[:-1], *((1,) if keepdim else ()))
