"""The ranks' gathered shard summaries merged into each row's result in one kernel
(`shard_merge_kernel`) and its launcher, `merge_shard_summaries`.

`flashspec.parallel` all-gathers every rank's summary words of its vocabulary shard
(`flashspec.parallel.summary`); this kernel does on every rank what
`flashspec.parallel.merge.merge_argmax` / `merge_rows` and, for verification,
`flashspec.parallel.acceptance.accept` do with some forty torch kernels, for calls without
candidates (no row truncated): one program per batch row reads its rows' words of every rank
and writes the call's typed result.

* The race: the best of the ranks' best scores, ties to the lower id; the log-sum-exp of the
  ranks' log-sum-exps; the logprob the winner's score minus it; a row is not finite where
  some rank's log-sum-exp (argmax: best) is NaN.
* Verification: each rank left the draft out of its best and sent the draft's logit; the
  target's own sample is the draft iff its perturbed score beats the best other token (the
  noise by `noise.gumbel_noise`, the fused kernels' own, where the torch merge recomputes it
  by `flashspec.rng`: the two differ at most in the rounding of `log`), then the acceptance
  chain of the one-GPU finaliser (`verify_finalize.accept_chain`).

Truncated calls keep the torch merge: their candidate keys are sorted, filtered by
transformers' rules and certified against each rank's floor (`flashspec.parallel.merge`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..outputs import ArgmaxOutput, SampleOutput, VerifyOutput
from ..params import SamplingParams
from .merge import _NON_FINITE, _OK
from .noise import gumbel_noise
from .rows import _row_params
from .shard_summary import _BEST, _DRAFT, _LSE, _SCORE, _TOKEN
from .verify_finalize import accept_chain, row_drafts

_NO_ID = tl.constexpr(2**31 - 1)   # above every token id (ids < 2**31): loses every tie


@triton.jit
def shard_merge_kernel(
    words_ptr, do_sample_ptr, temperature_ptr, seed_ptr, position_ptr, draft_ptr,
    token_ptr, logprob_ptr, lse_ptr, status_ptr, num_accepted_ptr, accept_probs_ptr,
    NUM_RANKS, NUM_ROWS, WORDS, NUM_DRAFTS,
    FIELDS: tl.constexpr, PROBABILISTIC: tl.constexpr, RANKS_POW2: tl.constexpr,
    POSITIONS_POW2: tl.constexpr,
):
    """Batch row b's rows (its G + 1 positions in verification, else the row itself) from
    the words ``[NUM_RANKS, NUM_ROWS, WORDS]``: FIELDS 2 writes argmax's token and status,
    4 sampling's token, logprob, log-sum-exp and status, 5 verification's outputs."""
    b = tl.program_id(0)
    num_positions = NUM_DRAFTS + 1
    j = tl.arange(0, POSITIONS_POW2)
    valid = j < num_positions
    rows = b * num_positions + j
    ranks = tl.arange(0, RANKS_POW2)
    here = valid[:, None] & (ranks < NUM_RANKS)[None, :]
    at = words_ptr + (ranks[None, :].to(tl.int64) * NUM_ROWS + rows[:, None]) * WORDS
    best = tl.load(at + _BEST, mask=here, other=0).to(tl.float32, bitcast=True)
    best = tl.where(here, best, float("-inf"))
    ids = tl.load(at + _TOKEN, mask=here, other=0)
    top = tl.max(best, axis=1)
    contenders = tl.where(here & (best == top[:, None]), ids, _NO_ID)
    token = tl.min(contenders, axis=1)
    if FIELDS == 2:
        finite = tl.sum((here & (best != best)).to(tl.int32), axis=1) == 0
        tl.store(token_ptr + rows, tl.where(finite, token, -1).to(tl.int64), mask=valid)
        tl.store(status_ptr + rows, tl.where(finite, _OK, _NON_FINITE), mask=valid)
    else:
        parts = tl.load(at + _LSE, mask=here, other=0).to(tl.float32, bitcast=True)
        parts = tl.where(here, parts, float("-inf"))
        finite = tl.sum((here & (parts != parts)).to(tl.int32), axis=1) == 0
        largest = tl.max(parts, axis=1)
        # torch.logsumexp's shift: none where the largest is infinite (all -inf: -inf).
        shift = tl.where((largest == float("inf")) | (largest == float("-inf")), 0.0, largest)
        lse = shift + tl.log(tl.sum(tl.exp(parts - shift[:, None]), axis=1))
        score = tl.load(at + _SCORE, mask=here, other=0).to(tl.float32, bitcast=True)
        won = (contenders == token[:, None]) & (token < _NO_ID)[:, None]
        logprob = tl.sum(tl.where(won, score, 0.0), axis=1) - lse
        if FIELDS == 4:
            tl.store(token_ptr + rows, tl.where(finite, token, -1).to(tl.int64), mask=valid)
            tl.store(logprob_ptr + rows, tl.where(finite, logprob, float("nan")), mask=valid)
            tl.store(lse_ptr + rows, tl.where(finite, lse, float("nan")), mask=valid)
            tl.store(status_ptr + rows, tl.where(finite, _OK, _NON_FINITE), mask=valid)
        else:
            drafts, is_draft = row_drafts(draft_ptr, b, j, NUM_DRAFTS)
            drafted = tl.load(at + _DRAFT, mask=here, other=0).to(tl.float32, bitcast=True)
            draft_s = tl.max(tl.where(here, drafted, float("-inf")), axis=1)
            sampled, _ = _row_params(do_sample_ptr, temperature_ptr, b, 1)
            seed = tl.load(seed_ptr + b)
            position = tl.load(position_ptr + b) + j
            noise = gumbel_noise(seed, position, tl.where(is_draft, drafts, 0).to(tl.int64))
            # `token` is the best other token; the draft's score is on its own rank only.
            draft_score = draft_s + tl.where(sampled, noise, 0.0)
            draft_wins = is_draft & ((draft_score > top)
                                     | ((draft_score == top) & (drafts < token)))
            draft_logprob = tl.where(is_draft, draft_s - lse, float("-inf"))
            target = tl.where(draft_wins, drafts, token)
            target_logprob = tl.where(draft_wins, draft_logprob, logprob)
            accept_chain(b, j, drafts, is_draft, target, target_logprob, token, logprob,
                         tl.exp(draft_logprob), draft_logprob,
                         tl.where(finite, _OK, _NON_FINITE), do_sample_ptr, temperature_ptr,
                         seed_ptr, position_ptr, num_accepted_ptr, token_ptr,
                         accept_probs_ptr, logprob_ptr, status_ptr, NUM_DRAFTS, PROBABILISTIC,
                         POSITIONS_POW2)


def merge_shard_summaries(words: torch.Tensor, fields: int, params: SamplingParams | None = None,
                          positions: torch.Tensor | None = None,
                          draft_tokens: torch.Tensor | None = None, acceptance: str = "strict"):
    """The call's result from every rank's summary words ``[n, R, fields]`` (no candidates):

    * `fields` 2: `ArgmaxOutput` of the R rows;
    * 4: `SampleOutput` of the R rows with `params` and noise `positions` ``[R]``;
    * 5: `VerifyOutput` of ``draft_tokens [B, G]`` (R = B * (G+1), position j of batch row b
      at b * (G+1) + j), `params` and `positions` ``[B]`` per batch row (the first draft's
      index), `acceptance` "strict" or "probabilistic".

    Unchecked; no host read, no data-dependent allocation (a CUDA graph can hold it).
    """
    num_ranks, num_rows, num_words = words.shape
    if num_words != fields:
        raise ValueError(f"the kernel merges summaries without candidates ({fields} words per "
                         f"row), got {num_words}")
    words = words.contiguous()
    device = words.device
    num_drafts = 0 if draft_tokens is None else draft_tokens.shape[1]
    batch_size = num_rows // (num_drafts + 1)
    tokens = torch.empty(batch_size, num_drafts + 1, dtype=torch.int64, device=device)
    status = torch.empty(batch_size, dtype=torch.int32, device=device)
    logprobs = lse = num_accepted = accept_probs = words     # (unwritten where not returned)
    if fields > 2:
        logprobs = torch.empty(batch_size, num_drafts + 1, dtype=torch.float32, device=device)
    if fields == 4:
        lse = torch.empty(num_rows, dtype=torch.float32, device=device)
    if fields == 5:
        num_accepted = torch.empty(batch_size, dtype=torch.int64, device=device)
        accept_probs = torch.empty(batch_size, num_drafts, dtype=torch.float32, device=device)
    sampling = params is not None
    shard_merge_kernel[(batch_size,)](
        words, params.do_sample if sampling else words, params.temperature if sampling else words,
        params.seed if sampling else words, positions if sampling else words,
        draft_tokens.contiguous() if num_drafts else words,
        tokens, logprobs, lse, status, num_accepted, accept_probs,
        num_ranks, num_rows, num_words, num_drafts,
        FIELDS=fields, PROBABILISTIC=acceptance == "probabilistic",
        RANKS_POW2=triton.next_power_of_2(num_ranks),
        POSITIONS_POW2=triton.next_power_of_2(num_drafts + 1), num_warps=1,
    )
    if fields == 2:
        return ArgmaxOutput(tokens.view(-1), status)
    if fields == 4:
        return SampleOutput(tokens.view(-1), logprobs.view(-1), lse, status)
    return VerifyOutput(num_accepted, tokens, accept_probs, logprobs, status)
