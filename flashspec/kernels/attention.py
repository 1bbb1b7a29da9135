"""Causal attention by sequence position over the engine's KV cache, for the few queries per
row of a decode step.

The engine's cache keeps each row's keys in columns that need not follow the positions
(other rows' drafts leave holes, left padding, compaction), and records per row the column
of every live position (``key_index``). Each query reads its keys by *position*, through
that index, in blocks of `BLOCK_N` positions aligned at position 0, with an online softmax
in that order: no mask tensor is built, dead columns are never read, and grouped-query
heads share their keys' loads (a tile's rows are (query, head of the group) pairs).

Long contexts are cut into chunks of `CHUNK` positions (a multiple of `BLOCK_N`) that run in
parallel programs, whose partial results are then merged in chunk order. A query's result
therefore depends only on its own keys and position: not on the other queries of its tile,
the cache's layout, the view or the batch (`flashspec.generation.invariant` relies on it).
A block entirely masked for a query leaves its state bitwise unchanged, and an empty chunk
adds exact zeros, so the one-chunk and many-chunk paths agree bitwise.

    out = attention(query, key, value, key_index, positions, scaling)   # [B, T, Hq, D]

The same code runs under Triton's CPU interpreter (the CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N = 16, 64    # (query, head) rows per tile; key positions per block
CHUNK = 512                  # key positions per program; longer contexts merge chunks
LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # the kernels' copy (a Triton kernel reads constexpr globals only)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:     # fp32 operands: full fp32 products, not TF32
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, index_ptr, pos_ptr, out_ptr, part_ptr, stat_ptr,
                      T, G, num_positions, qk_scale, softcap, window, num_chunks,
                      sq_b, sq_h, sq_t, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                      si_b, sp_b, so_b, so_t, so_h,
                      HEAD_DIM: tl.constexpr, D_BLOCK: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr,
                      SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2) // num_chunks
    chunk = tl.program_id(2) % num_chunks
    r = tile * BM + tl.arange(0, BM)
    t = r // G
    head = kv_head * G + r % G
    valid = t < T
    d = tl.arange(0, D_BLOCK)       # the head dimension, padded to a power of two >= 16
    q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + t[:, None] * sq_t + d[None, :],
                mask=valid[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    q_pos = tl.load(pos_ptr + b * sp_b + t, mask=valid, other=-1)
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, D_BLOCK), dtype=tl.float32)
    first = chunk * CHUNK
    last = tl.minimum(tl.max(q_pos, axis=0), first + CHUNK - 1)
    for start in range(first, last + 1, BN):
        positions = start + tl.arange(0, BN)
        columns = tl.load(index_ptr + b * si_b + positions,
                          mask=positions < num_positions, other=0)
        k = tl.load(k_ptr + b * sk_b + kv_head * sk_h + columns[:, None] * sk_n + d[None, :],
                    mask=d[None, :] < HEAD_DIM, other=0.0)
        v = tl.load(v_ptr + b * sv_b + kv_head * sv_h + columns[:, None] * sv_n + d[None, :],
                    mask=d[None, :] < HEAD_DIM, other=0.0)
        seen = positions[None, :] <= q_pos[:, None]
        if window > 0:
            seen = seen & (positions[None, :] > q_pos[:, None] - window)
        s = _dot(q, tl.trans(k), tl.zeros((BM, BN), dtype=tl.float32), IEEE)
        if SOFTCAP:      # Gemma-2's softcap of the scaled scores, then log2 units
            s = softcap * _tanh(s * (qk_scale / _LOG2E / softcap)) * _LOG2E
        else:
            s = s * qk_scale
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Exact no-op where the block is masked for the row (alpha 1, p 0): a query's state
        # depends only on the blocks it sees, not on how far its tile's loop runs.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp2(m_i - m_safe))
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        m_i = m_new
    inside = valid[:, None] & (d[None, :] < HEAD_DIM)
    if SPLIT:        # this chunk's state, merged by _merge_kernel
        row = ((b * T + t) * (G * tl.num_programs(1)) + head) * num_chunks + chunk
        tl.store(part_ptr + row[:, None] * D_BLOCK + d[None, :], acc, mask=inside)
        tl.store(stat_ptr + row * 2, m_i, mask=valid)
        tl.store(stat_ptr + row * 2 + 1, l_i, mask=valid)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + b * so_b + t[:, None] * so_t + head[:, None] * so_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _merge_kernel(part_ptr, stat_ptr, out_ptr, T, Hq, num_chunks, so_b, so_t, so_h,
                  HEAD_DIM: tl.constexpr, D_BLOCK: tl.constexpr):
    """One (row, query, head): its chunks' states merged in chunk order."""
    pid = tl.program_id(0)
    head = pid % Hq
    t = (pid // Hq) % T
    b = pid // (Hq * T)
    d = tl.arange(0, D_BLOCK)
    m = tl.full((), float("-inf"), dtype=tl.float32)
    for c in range(0, num_chunks):
        m = tl.maximum(m, tl.load(stat_ptr + (pid * num_chunks + c) * 2))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros((D_BLOCK,), dtype=tl.float32)
    norm = tl.zeros((), dtype=tl.float32)
    for c in range(0, num_chunks):
        row = pid * num_chunks + c
        weight = tl.exp2(tl.load(stat_ptr + row * 2) - m_safe)
        norm += tl.load(stat_ptr + row * 2 + 1) * weight
        total += tl.load(part_ptr + row * D_BLOCK + d, mask=d < HEAD_DIM, other=0.0) * weight
    out = total / tl.where(norm == 0.0, 1.0, norm)
    tl.store(out_ptr + b * so_b + t * so_t + head * so_h + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              key_index: torch.Tensor, positions: torch.Tensor, scaling: float,
              window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention by sequence position: query ``[B, Hq, T, D]`` at `positions`
    ``[B, T]`` attends to the keys at positions ``<= its own`` (and ``> own - window``), whose
    columns in `key` / `value` ``[B, Hkv, N, D]`` are ``key_index[b, position]``; every
    position up to a query's own must be indexed, and positions are below N (the chunks
    launched cover N positions). `softcap`: Gemma-2's ``c * tanh(scores / c)`` of the
    scaled scores. Returns ``[B, T, Hq, D]``."""
    B, Hq, T, D = query.shape
    Hkv = key.shape[1]
    group = Hq // Hkv
    out = torch.empty(B, T, Hq, D, dtype=query.dtype, device=query.device)
    if B == 0 or T == 0:
        return out
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"attention by position needs a contiguous head dimension in "
                             f"`{name}`")
    key_index = key_index.contiguous()
    positions = positions.contiguous()
    d_block = max(16, triton.next_power_of_2(D))
    num_chunks = triton.cdiv(min(key.shape[2], key_index.shape[1]), CHUNK)
    split = num_chunks > 1
    if split:
        part = torch.empty(B * T * Hq * num_chunks, d_block, dtype=torch.float32,
                           device=query.device)
        stat = torch.empty(B * T * Hq * num_chunks, 2, dtype=torch.float32, device=query.device)
    else:
        part = stat = out                       # not read
    grid = (B, Hkv, triton.cdiv(T * group, BLOCK_M) * num_chunks)
    _attention_kernel[grid](
        query, key, value, key_index, positions, out, part, stat, T, group, key_index.shape[1],
        scaling * LOG2E, float(softcap or 1.0), window or 0, num_chunks,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1),
        key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        key_index.stride(0), positions.stride(0), out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=D, D_BLOCK=d_block, BM=BLOCK_M, BN=BLOCK_N, CHUNK=CHUNK, SPLIT=split,
        SOFTCAP=softcap is not None, IEEE=query.dtype == torch.float32, num_warps=4)
    if split:
        _merge_kernel[(B * T * Hq,)](part, stat, out, T, Hq, num_chunks, out.stride(0),
                                     out.stride(1), out.stride(2), HEAD_DIM=D, D_BLOCK=d_block,
                                     num_warps=1)
    return out
