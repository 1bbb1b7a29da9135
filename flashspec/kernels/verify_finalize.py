"""Verification's finaliser (`verify_finalize_kernel`): the acceptance chain of each batch row.

After stage 2 (`merge.py`) has decided, per position, the target's own sample, p(draft) and
the best other token, one program per batch row accepts drafts along its G + 1 positions and
writes the emitted tokens, their logprobs and the row's status. The chain itself
(`accept_chain`) is shared with the merge of tensor-parallel ranks' summaries
(`shard_merge.py`), which decides each position's results in registers instead.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .merge import _NEEDS_COMPLETION, _NON_FINITE, _OK
from .noise import ACCEPT_STREAM, philox_bits
from .rows import _row_params


@triton.jit
def verify_finalize_kernel(
    draft_ptr, target_ptr, masked_ptr, target_logprob_ptr, masked_logprob_ptr,
    draft_prob_ptr, draft_logprob_ptr, row_status_ptr,
    do_sample_ptr, temperature_ptr, seed_ptr, position_ptr,
    num_accepted_ptr, tokens_ptr, accept_probs_ptr, logprobs_ptr, status_ptr,
    NUM_DRAFTS, PROBABILISTIC: tl.constexpr, POSITIONS_POW2: tl.constexpr, PDL: tl.constexpr,
):
    """Per batch row: the acceptance chain over the G + 1 positions (`accept_chain`) of the
    per-position results stage 2 wrote."""
    if PDL:
        gdc_wait()
    b = tl.program_id(0)
    j = tl.arange(0, POSITIONS_POW2)
    valid = j < NUM_DRAFTS + 1
    rows = b * (NUM_DRAFTS + 1) + j
    drafts, is_draft = row_drafts(draft_ptr, b, j, NUM_DRAFTS)
    target = tl.load(target_ptr + rows, mask=valid, other=-1)
    target_logprob = tl.load(target_logprob_ptr + rows, mask=valid, other=0.0)
    draft_prob = tl.load(draft_prob_ptr + rows, mask=valid, other=0.0)
    draft_logprob = tl.load(draft_logprob_ptr + rows, mask=valid, other=0.0)
    row_status = tl.load(row_status_ptr + rows, mask=valid, other=0)
    masked = target
    masked_logprob = target_logprob
    if PROBABILISTIC:   # strict acceptance never emits the best other token
        masked = tl.load(masked_ptr + rows, mask=valid, other=-1)
        masked_logprob = tl.load(masked_logprob_ptr + rows, mask=valid, other=0.0)
    accept_chain(b, j, drafts, is_draft, target, target_logprob, masked, masked_logprob,
                 draft_prob, draft_logprob, row_status, do_sample_ptr, temperature_ptr,
                 seed_ptr, position_ptr, num_accepted_ptr, tokens_ptr, accept_probs_ptr,
                 logprobs_ptr, status_ptr, NUM_DRAFTS, PROBABILISTIC, POSITIONS_POW2)


@triton.jit
def row_drafts(draft_ptr, b, j, NUM_DRAFTS):
    """Batch row b's drafts at positions `j` (``draft_tokens [B, G]`` contiguous) and which
    are drafts: those before the row's first padding (-1), none at the last position."""
    drafts = tl.load(draft_ptr + b * NUM_DRAFTS + j, mask=j < NUM_DRAFTS, other=-1)
    is_draft = (tl.cumsum((drafts < 0).to(tl.int32), 0) == 0) & (j < NUM_DRAFTS)
    return drafts, is_draft


@triton.jit
def accept_chain(b, j, drafts, is_draft, target, target_logprob, masked, masked_logprob,
                 draft_prob, draft_logprob, row_status, do_sample_ptr, temperature_ptr,
                 seed_ptr, position_ptr, num_accepted_ptr, tokens_ptr, accept_probs_ptr,
                 logprobs_ptr, status_ptr, NUM_DRAFTS, PROBABILISTIC: tl.constexpr,
                 POSITIONS_POW2: tl.constexpr):
    """Batch row b's acceptance chain (DESIGN §3) from its positions' results ``[P]`` (`j`
    the arange of P; `target` the target's own sample, `masked` the best other token), its
    outputs written.

    strict: accept the draft iff it equals the target's own sample; the first rejection
    emits that sample (on the last position, the bonus token). probabilistic: accept iff
    u < p(draft), u from the acceptance stream; a rejection emits the best other token.
    Greedy rows accept iff the draft is the argmax either way.
    """
    num_positions = NUM_DRAFTS + 1
    valid = j < num_positions
    rows = b * num_positions + j
    sampled, _ = _row_params(do_sample_ptr, temperature_ptr, b, 1)
    matches = drafts == target
    accept_prob = tl.where(is_draft, tl.where(sampled, draft_prob, matches.to(tl.float32)), 0.0)
    if PROBABILISTIC:
        seed = tl.load(seed_ptr + b)
        position = tl.load(position_ptr + b) + j
        bits = philox_bits(seed, position, j.to(tl.int64) * 0, ACCEPT_STREAM)
        u = (bits.to(tl.float64) + 0.5) * 2.3283064365386963e-10  # exact, as flashspec.rng
        accepted = is_draft & tl.where(sampled, u < draft_prob.to(tl.float64), matches)
        replacement = tl.where(is_draft, masked, target)
        replacement_logprob = tl.where(is_draft, masked_logprob, target_logprob)
    else:
        accepted = is_draft & matches
        replacement = target
        replacement_logprob = target_logprob
    num_accepted = tl.min(tl.where(accepted | ~valid, POSITIONS_POW2, j), axis=0)
    tokens = tl.where(j < num_accepted, drafts, tl.where(j == num_accepted, replacement, -1))
    logprobs = tl.where(j < num_accepted, draft_logprob,
                        tl.where(j == num_accepted, replacement_logprob, 0.0))
    # Positions after the drafts end (padding) are never emitted: their status is not the row's.
    used = valid & (j <= tl.sum(is_draft.to(tl.int32)))
    non_finite = tl.sum(((row_status == _NON_FINITE) & used).to(tl.int32)) > 0
    incomplete = tl.sum(((row_status == _NEEDS_COMPLETION) & used).to(tl.int32)) > 0
    status = tl.where(non_finite, _NON_FINITE, tl.where(incomplete, _NEEDS_COMPLETION, _OK))
    tl.store(num_accepted_ptr + b, tl.where(status == _OK, num_accepted, -1).to(tl.int64))
    tl.store(tokens_ptr + rows, tl.where(status == _OK, tokens, -1).to(tl.int64), mask=valid)
    tl.store(logprobs_ptr + rows, tl.where(status == _OK, logprobs, 0.0), mask=valid)
    tl.store(accept_probs_ptr + b * NUM_DRAFTS + j, accept_prob, mask=j < NUM_DRAFTS)
    tl.store(status_ptr + b, status)
