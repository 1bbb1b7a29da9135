"""The edit codes of a step, ``[B, G+1, V]`` (G = 0: sampling), in one pass over the output.

Position j of row b verifies the row's j-th draft: its codes are the row's base codes (the
bans of every position and the context's PENALIZE), the ban row of the position's generated
count (bans that depend on it: minimum length, the begin position, forced positions), the
context code on each of the row's first j drafts (they join the context before position j)
and BAN where the position's allowed-token bitmask leaves a token out. Made with torch ops,
that is an expanded copy, a gather of ban rows, a maximum, a scatter and a few index
kernels: byte-wise passes over ``[B, G+1, V]`` and about ten launches, 10-25% of a
verification step on an H200 (BENCHMARKS.md). Here each output byte is written once, 16 per
thread, from inputs read from L2 (``[B, V]`` and the few ban rows), at the speed of a copy;
a draft costs a compare per element only in the one vocabulary tile that holds it.

`generation.edits.EditState` calls this on CUDA; its torch ops are the reference and the CPU
path (`tests/test_edit_codes.py` checks the two equal, through the interpreter on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import params

BLOCK_V = 4096
_BAN = tl.constexpr(params.BAN)


@triton.jit
def _verify_codes_kernel(out_ptr, base_ptr, drafts_ptr, context_code_ptr, ban_rows_ptr,
                         generated_ptr, min_count_ptr, begin_count_ptr, forced_count_ptr,
                         allowed_ptr, V, NUM_WORDS, W: tl.constexpr, G: tl.constexpr,
                         BAN_ROWS: tl.constexpr, NUM_FORCED: tl.constexpr,
                         FORCED_ROW: tl.constexpr, ALLOWED: tl.constexpr, BLOCK: tl.constexpr):
    pid_v = tl.program_id(0)
    row = tl.program_id(1)            # b * W + j
    b = row // W
    j = row % W
    start = pid_v * BLOCK
    tokens = start + tl.arange(0, BLOCK)
    ok = tokens < V
    code = tl.load(base_ptr + b.to(tl.int64) * V + tokens, mask=ok, other=0)
    if BAN_ROWS:
        # `generation.edits.EditState`'s rule: row 1 below the minimum count (EOS), + 2 at
        # the begin position, `FORCED_ROW` (every token) at a forced position.
        count = tl.load(generated_ptr + b) + j
        which = ((count < tl.load(min_count_ptr)).to(tl.int64)
                 + 2 * (count == tl.load(begin_count_ptr)).to(tl.int64))
        for k in tl.static_range(NUM_FORCED):
            which = tl.where(count == tl.load(forced_count_ptr + k), FORCED_ROW, which)
        code = tl.maximum(code, tl.load(ban_rows_ptr + which * V + tokens, mask=ok, other=0))
    if ALLOWED:
        # Bit v % 32 of word v // 32 (xgrammar's token bitmask): the tile's words loaded once
        # each and spread to their 32 tokens (a load per token took 1.3x as long at 64 rows).
        word_ids = pid_v * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
        words = tl.load(allowed_ptr + row.to(tl.int64) * NUM_WORDS + word_ids,
                        mask=word_ids < NUM_WORDS, other=0)
        bits = (words[:, None] >> tl.arange(0, 32)[None, :]) & 1
        code = tl.where(tl.reshape(bits, (BLOCK,)) == 0, _BAN, code)
    context_code = tl.load(context_code_ptr)
    alive = j >= 0                    # True, as a tensor the loop can and with
    for i in tl.static_range(G):
        draft = tl.load(drafts_ptr + b * G + i)
        alive = alive & (draft >= 0)           # a row's drafts end at its first -1
        if alive & (i < j) & (draft >= start) & (draft < start + BLOCK):
            code = tl.where(tokens == draft, tl.maximum(code, context_code), code)
    tl.store(out_ptr + row.to(tl.int64) * V + tokens, code, mask=ok)


def verify_codes(base: torch.Tensor, drafts: torch.Tensor, context_code: torch.Tensor, *,
                 bans: tuple | None = None, forced_row: int = 0,
                 allowed: torch.Tensor | None = None, block: int = BLOCK_V,
                 num_warps: int = 8) -> torch.Tensor:
    """uint8 ``[B, G+1, V]``: position j of row b holds the maximum of ``base[b]``, its ban
    row and, on the row's drafts before j, `context_code`; and `BAN` on every token that
    `allowed` leaves out.

    Args:
        base: uint8 ``[B, V]``, contiguous.
        drafts: int64 ``[B, G]``, -1 padded (a row's drafts end at its first -1).
        context_code: uint8 ``[1]`` on the device (a tensor, so that graphs replay the
            current call's value).
        bans: None (no position-dependent bans) or ``(ban_rows, generated, min_count,
            begin_count, forced_count)``: uint8 ``[R, V]``, int64 ``[B]`` (each row's
            generated tokens), int64 ``[1]``, ``[1]`` and ``[F]`` or None, picked as
            `generation.edits.EditState` picks its ban rows (`forced_row`: every token).
        allowed: int32 ``[B, G+1, ceil(V / 32)]``, each position's allowed tokens (bit
            ``v % 32`` of word ``v // 32``), or None: every token.
    """
    batch, vocab = base.shape
    num_drafts = drafts.shape[1]
    width = num_drafts + 1
    out = torch.empty(batch, width, vocab, dtype=torch.uint8, device=base.device)
    ban_rows, generated, min_count, begin_count, forced_count = bans or (base,) + (drafts,) * 4
    grid = (triton.cdiv(vocab, block), batch * width)
    _verify_codes_kernel[grid](
        out, base, drafts.contiguous(), context_code, ban_rows, generated, min_count,
        begin_count, drafts if forced_count is None else forced_count,
        base if allowed is None else allowed.contiguous(), vocab, triton.cdiv(vocab, 32),
        W=width, G=num_drafts, BAN_ROWS=bans is not None,
        NUM_FORCED=0 if bans is None or forced_count is None else forced_count.numel(),
        FORCED_ROW=forced_row, ALLOWED=allowed is not None, BLOCK=block, num_warps=num_warps)
    return out
