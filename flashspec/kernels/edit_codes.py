"""The edit codes of a verification step, ``[B, G+1, V]``, in one pass over the output.

Position j of row b verifies the row's j-th draft: its codes are the row's base codes (the
bans of every position and the context's PENALIZE), the ban row of the position's generated
count (bans that depend on it: minimum length, the begin position, ...) and the context code
on each of the row's first j drafts (they join the context before position j). Made with
torch ops, that is an expanded copy, a gather of ban rows, a maximum, a scatter and a few
index kernels: byte-wise passes over ``[B, G+1, V]`` and about ten launches, up to 25% of a
verification step (`probes/edit_codes_profile.py`). Here each output byte is written once,
16 per thread, from inputs read from L2 (``[B, V]`` and the few ban rows); a draft costs a
compare per element only in the one vocabulary tile that holds it.

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
def _verify_codes_kernel(out_ptr, base_ptr, ban_rows_ptr, row_of_count_ptr, generated_ptr,
                         drafts_ptr, context_code_ptr, allowed_ptr, V, NUM_COUNTS, NUM_WORDS,
                         W: tl.constexpr, G: tl.constexpr, BAN_ROWS: tl.constexpr,
                         ALLOWED: tl.constexpr, BLOCK: tl.constexpr):
    pid_v = tl.program_id(0)
    row = tl.program_id(1)            # b * W + j
    b = row // W
    j = row % W
    start = pid_v * BLOCK
    tokens = start + tl.arange(0, BLOCK)
    ok = tokens < V
    code = tl.load(base_ptr + b.to(tl.int64) * V + tokens, mask=ok, other=0)
    if BAN_ROWS:
        count = tl.minimum(tl.load(generated_ptr + b) + j, NUM_COUNTS - 1)
        which = tl.load(row_of_count_ptr + count).to(tl.int64)
        code = tl.maximum(code, tl.load(ban_rows_ptr + which * V + tokens, mask=ok, other=0))
    if ALLOWED:
        # Bit v % 32 of word v // 32 (xgrammar's token bitmask): 32 neighbours share a load.
        word = tl.load(allowed_ptr + row.to(tl.int64) * NUM_WORDS + tokens // 32, mask=ok, other=0)
        code = tl.where(((word >> (tokens % 32)) & 1) == 0, _BAN, code)
    context_code = tl.load(context_code_ptr)
    alive = j >= 0
    for i in tl.static_range(G):
        draft = tl.load(drafts_ptr + b * G + i)
        alive = alive & (draft >= 0)           # a row's drafts end at its first -1
        if alive & (i < j) & (draft >= start) & (draft < start + BLOCK):
            code = tl.where(tokens == draft, tl.maximum(code, context_code), code)
    tl.store(out_ptr + row.to(tl.int64) * V + tokens, code, mask=ok)


def verify_codes(base: torch.Tensor, drafts: torch.Tensor, context_code: torch.Tensor,
                 ban_rows: torch.Tensor | None = None, row_of_count: torch.Tensor | None = None,
                 generated: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
                 *, block: int = BLOCK_V, num_warps: int = 8) -> torch.Tensor:
    """uint8 ``[B, G+1, V]``: position j of row b holds
    ``max(base[b], ban_rows[row_of_count[min(generated[b] + j, C - 1)]])``, at least
    `context_code` on the row's drafts before j, and `BAN` on every token that `allowed`
    leaves out.

    Args:
        base: uint8 ``[B, V]``, contiguous.
        drafts: int64 ``[B, G]``, -1 padded (a row's drafts end at its first -1).
        context_code: uint8 ``[1]`` on the device (a tensor, so that graphs replay the
            current call's value).
        ban_rows / row_of_count / generated: uint8 ``[R, V]``, integer ``[C]`` (the ban row
            of each generated count, the last one for every count beyond) and int64 ``[B]``
            (each row's generated tokens), or all None: no position-dependent bans.
        allowed: int32 ``[B, G+1, ceil(V / 32)]``, each position's allowed tokens (bit
            ``v % 32`` of word ``v // 32``), or None: every token.
    """
    batch, vocab = base.shape
    num_drafts = drafts.shape[1]
    width = num_drafts + 1
    out = torch.empty(batch, width, vocab, dtype=torch.uint8, device=base.device)
    bans = ban_rows is not None
    grid = (triton.cdiv(vocab, block), batch * width)
    _verify_codes_kernel[grid](
        out, base, ban_rows if bans else base, row_of_count if bans else drafts,
        generated if bans else drafts, drafts.contiguous(), context_code,
        base if allowed is None else allowed.contiguous(), vocab,
        row_of_count.numel() if bans else 1, triton.cdiv(vocab, 32), W=width, G=num_drafts,
        BAN_ROWS=bans, ALLOWED=allowed is not None, BLOCK=block, num_warps=num_warps)
    return out
