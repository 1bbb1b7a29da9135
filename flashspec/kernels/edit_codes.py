"""The edit codes of a verification step, ``[B, G+1, V]``, in one pass over the output.

Position j of row b verifies the row's j-th draft: its codes are the row's base codes (the
bans of every position and the context's PENALIZE), the ban row of that position (bans that
depend on the generated count: minimum length, the begin position, ...) and the context code
for each of the row's first j drafts (they join the context before position j). Made with
torch ops, that is an expanded copy, a gather of ban rows, a maximum and a scatter: three
passes over ``[B, G+1, V]`` bytes and about ten small kernels, up to 17% of a verification
step at 64 rows (`flashspec.bench.edit_cost`). Here each output byte is written once and the
inputs (``[B, V]`` and the few ban rows) are read from L2.

`generation.edits.EditState` calls this on CUDA; its torch ops are the reference and the CPU
path (`tests/test_fused_edits.py` checks the two equal, through the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048


@triton.jit
def _verify_codes_kernel(out_ptr, base_ptr, ban_rows_ptr, which_ptr, drafts_ptr,
                         context_code_ptr, V, W: tl.constexpr, G: tl.constexpr,
                         BAN_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid_v = tl.program_id(0)
    row = tl.program_id(1)            # b * W + j
    b = row // W
    j = row % W
    tokens = pid_v * BLOCK + tl.arange(0, BLOCK)
    ok = tokens < V
    code = tl.load(base_ptr + b.to(tl.int64) * V + tokens, mask=ok, other=0)
    if BAN_ROWS:
        which = tl.load(which_ptr + row).to(tl.int64)
        code = tl.maximum(code, tl.load(ban_rows_ptr + which * V + tokens, mask=ok, other=0))
    context_code = tl.load(context_code_ptr)
    alive = True
    for i in tl.static_range(G):
        draft = tl.load(drafts_ptr + b * G + i)
        alive = alive & (draft >= 0)           # a row's drafts end at its first -1
        joined = alive & (i < j)
        code = tl.where(joined & (tokens == draft), tl.maximum(code, context_code), code)
    tl.store(out_ptr + row.to(tl.int64) * V + tokens, code, mask=ok)


def verify_codes(base: torch.Tensor, drafts: torch.Tensor, context_code: torch.Tensor,
                 ban_rows: torch.Tensor | None = None,
                 which: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 ``[B, G+1, V]``: position j of row b holds ``max(base[b], ban_rows[which[b, j]])``
    with `context_code` (uint8 ``[1]``) at least on the row's drafts before j.

    Args:
        base: uint8 ``[B, V]``, contiguous.
        drafts: int64 ``[B, G]``, -1 padded (a row's drafts end at its first -1).
        context_code: uint8 ``[1]`` on the device (a tensor, so that graphs replay the
            current call's value).
        ban_rows / which: uint8 ``[R, V]`` and integer ``[B, G+1]`` indices into it, or
            None for no position-dependent bans.
    """
    batch, vocab = base.shape
    num_drafts = drafts.shape[1]
    width = num_drafts + 1
    out = torch.empty(batch, width, vocab, dtype=torch.uint8, device=base.device)
    has_bans = ban_rows is not None
    grid = (triton.cdiv(vocab, BLOCK_V), batch * width)
    _verify_codes_kernel[grid](
        out, base, ban_rows if has_bans else base, which.contiguous() if has_bans else drafts,
        drafts.contiguous(), context_code, vocab, W=width, G=num_drafts, BAN_ROWS=has_bans,
        BLOCK=BLOCK_V, num_warps=4)
    return out
