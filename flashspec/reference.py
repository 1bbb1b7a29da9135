"""Materialized torch implementation: the oracle for the kernels and the CPU path of
`flashspec.sampling`.

It computes the full ``[rows, V]`` logits, applies Hugging Face's warpers with their exact
arithmetic (temperature, then top-k, then top-p, then min-p; see `flashspec.params`), and
samples by Gumbel-max with the counter-based noise of `flashspec.rng`:

    token = argmax_v ( transformed_logits[v] + gumbel(seed, position, v) )

which draws exactly from softmax(transformed_logits). Greedy rows take the argmax of the
raw logits (lowest id on ties). Logits are float32 (float64 when the inputs are float64);
`compute_logits` makes them the model's own where its head transforms them (an LM-head
bias, Gemma-2's softcap), as the fused kernels' epilogue does.

On the CPU, where this is the engine's path and a host read costs nothing, the noise is drawn
only for the tokens that can win: those whose score lies within the span of the noise
(`rng.GUMBEL_MIN`, `rng.GUMBEL_MAX`) of their row's top score, which a truncated support or a
peaked row keeps to a few. The others lose whatever their noise, so the token is the same as
with noise for every token (up to the rounding of `log`, which DESIGN §3 allows). Elsewhere
every token gets its noise: the shapes stay fixed, as a CUDA graph needs.

Tie rule where transformers leaves it to an unstable sort: at the top-p boundary, tokens
with equal logits are dropped highest id first (the kernels' preference order is higher
logit, then lower id). The number of tokens kept always equals transformers'.

The functions here take materialized logits and neither validate nor read the device:
`flashspec.sampling` checks the arguments and acts on the status they return.
"""

from __future__ import annotations

import torch

from . import rng
from .outputs import NON_FINITE, OK, ArgmaxOutput, SampleOutput, VerifyOutput
from .params import BAN, BANNED_LOGIT, PENALIZE, LogitEdits, SamplingParams

INVALID_TOKEN = -1


def compute_logits(hidden: torch.Tensor, weight: torch.Tensor, chunk_rows: int = 32768, *,
                   bias: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """``hidden[..., D] @ weight[V, D].T`` in float32 (float64 for float64 inputs), then the
    model's head transforms in the models' order: ``+ bias`` (``[V]``, the LM-head bias),
    then Gemma-2's ``softcap * tanh(logits / softcap)``, in the same dtype.

    The weight is upcast `chunk_rows` vocabulary rows at a time, so a large bf16 head never
    needs a full float32 copy.
    """
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    hidden = hidden.to(dtype)
    if weight.dtype == dtype:
        logits = matmul(hidden, weight)
    else:
        logits = torch.cat([hidden @ weight[v:v + chunk_rows].to(dtype).T
                            for v in range(0, weight.shape[0], chunk_rows)], dim=-1)
    if bias is not None:
        logits = logits + bias.to(dtype)
    return softcapped(logits, softcap)


# Rows of the weight that one product of `matmul`'s batch reads; the most rows it takes so.
_BLOCK_ROWS = 16
FEW_ROWS = 8


def matmul(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden[..., D] @ weight[V, D].T``. On the CPU, for the few rows of a decode step (at
    most `FEW_ROWS`), as a batch of ``[16, D] @ [D, rows]`` products over the weight's blocks
    of 16 rows (a view: no copy): MKL's matrix-vector product reads a row-major weight with
    short rows at about 8 GB/s where the batched form reads 16-20 (2026-11-28, AMD EPYC,
    torch 2.13: 0.46 against 1.1 ms for an 8192 x 256 fp32 head, one thread). The same sums,
    rounded in another order. With more than one row the batched form pays only for short
    rows (D <= 512). The CPU's decode steps multiply their linear layers' rows so too
    (`flashspec.generation.cpu`)."""
    rows, (vocab, width) = hidden.numel() // hidden.shape[-1], weight.shape
    blocked = vocab - vocab % _BLOCK_ROWS
    if (hidden.device.type != "cpu" or not blocked or rows > FEW_ROWS
            or (rows > 1 and width > 512)):
        return hidden @ weight.T
    flat = hidden.reshape(rows, width)
    blocks = weight[:blocked].view(blocked // _BLOCK_ROWS, _BLOCK_ROWS, width)
    logits = torch.bmm(blocks, flat.T.expand(blocks.shape[0], width, rows)).view(blocked, rows)
    logits = logits.T.contiguous()       # row-major, as a product of torch's (a few rows)
    if blocked < vocab:
        logits = torch.cat([logits, flat @ weight[blocked:].T], dim=1)
    return logits.reshape(*hidden.shape[:-1], vocab)


def softcapped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma-2's ``softcap * tanh(logits / softcap)`` in the logits' dtype, as transformers
    computes it (`logits` itself without a softcap)."""
    if softcap is None:
        return logits
    return torch.tanh(logits / softcap) * softcap


def edit_logits(logits: torch.Tensor, edits: LogitEdits) -> torch.Tensor:
    """`logits` ``[R, V]`` after `edits` (`LogitEdits` of R rows: `LogitEdits.flat` for
    verification), in its order and the logits' dtype: ``+ bias``; transformers' repetition
    penalty where the code is PENALIZE (its arithmetic: ``l * p`` where ``l < 0``, else
    ``l / p``); vLLM's ``l - frequency * c``, then ``l - presence * (c > 0)``, each product
    and difference rounded on its own, as vLLM's torch ops round them; `BANNED_LOGIT` where
    the code is BAN (see `flashspec.params` for why not -inf). Penalties are rounded to the
    logits' dtype first."""
    dtype = logits.dtype
    if edits.bias is not None:
        logits = logits + edits.bias.to(dtype)
    if edits.codes is not None:
        penalty = edits.penalty.to(dtype)[:, None]
        penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits = torch.where(edits.codes == PENALIZE, penalized, logits)
    if edits.counts is not None:
        logits = logits - edits.frequency.to(dtype)[:, None] * edits.counts.to(dtype)
        logits = logits - edits.presence.to(dtype)[:, None] * (edits.counts > 0).to(dtype)
    if edits.codes is not None:
        logits = logits.masked_fill(edits.codes == BAN, BANNED_LOGIT)
    return logits


def transform_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits ``[B, V]`` after HF's warpers, ``-inf`` outside the support.

    Greedy rows are returned unchanged (transformers applies no warper without sampling);
    when every row is greedy, `logits` itself is returned.
    """
    if params.all_greedy:
        return logits
    sampled = ~params.is_greedy
    scores = logits.clone()
    # HF divides by the Python float, which torch rounds to the logits' dtype first.
    scaled = sampled & (params.temperature != 1.0)
    scores = torch.where(scaled[:, None], scores / _safe_temperature(params, logits.dtype), scores)

    # The host flags skip unused warpers without reading the device.
    if params.any_top_k:
        use_top_k = sampled & (params.top_k > 0)
        scores = torch.where(use_top_k[:, None], _top_k(scores, params.top_k, params.max_top_k),
                             scores)
    if params.any_top_p:
        use_top_p = sampled & (params.top_p < 1.0)
        scores = torch.where(use_top_p[:, None], _top_p(scores, params.top_p), scores)
    if params.any_min_p:
        use_min_p = sampled & (params.min_p > 0.0)
        scores = torch.where(use_min_p[:, None], _min_p(scores, params.min_p), scores)
    return scores


def _top_k(scores: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """HF `TopKLogitsWarper`: drop scores below the k-th largest (ties with it are kept).
    On CPU `max_top_k` (a host value) bounds every row's k: the largest `max_top_k` scores,
    not a sort of the row, hold each row's k-th. Elsewhere the row is sorted whole: a
    captured graph must not keep a size that a later call's top-k changes (the graph key
    holds the kernel flags, not the largest k)."""
    vocab_size = scores.shape[-1]
    k = top_k.clamp(1, vocab_size)
    kept = min(max(max_top_k, 1), vocab_size) if scores.device.type == "cpu" else vocab_size
    largest = scores.topk(kept, dim=-1).values
    kth = largest.gather(-1, (k - 1)[:, None])
    return scores.masked_fill(scores < kth, float("-inf"))


def _top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """HF `TopPLogitsWarper`: ascending sort, drop tokens whose cumulative mass from the
    bottom is <= 1 - top_p, always keep the top token.

    HF sorts with an unstable sort; here ties sort by descending id (stable sort of the
    reversed row), so the lowest ids of a tie class straddling the boundary are kept.
    """
    vocab_size = scores.shape[-1]
    sorted_scores, order = torch.sort(scores.flip(-1), dim=-1, stable=True)
    order = vocab_size - 1 - order
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    # HF computes 1 - top_p on the Python float, then compares in the logits' dtype.
    threshold = (1.0 - top_p).to(scores.dtype)[:, None]
    drop_sorted = cumulative <= threshold
    drop_sorted[:, -1] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def _min_p(scores: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """HF `MinPLogitsWarper`: drop tokens with probability < min_p * (top probability)."""
    probs = scores.softmax(dim=-1)
    top_prob = probs.amax(dim=-1, keepdim=True)
    drop = probs < min_p.to(scores.dtype)[:, None] * top_prob
    drop.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
    return scores.masked_fill(drop, float("-inf"))


def _finite_rows(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """bool ``[B]``: raw logits finite and, for sampled rows, logits / temperature too.

    From each row's extremes (NaN propagates to them): division by a positive temperature is
    monotone, so the largest magnitude overflows first.
    """
    low, high = logits.amin(dim=-1), logits.amax(dim=-1)  # aminmax: 20x slower on CPU
    finite = torch.isfinite(low) & torch.isfinite(high)
    if params.all_greedy:    # a host flag: no row is divided by a temperature
        return finite
    largest = torch.maximum(low.abs(), high.abs())
    scaled_finite = torch.isfinite(largest / _safe_temperature(params, logits.dtype)[:, 0])
    return finite & (params.is_greedy | scaled_finite)


def _safe_temperature(params: SamplingParams, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1]`` temperatures in `dtype`, with greedy rows' 0 replaced by 1 (unused there)."""
    temperature = params.temperature.to(dtype)
    return torch.where(temperature > 0, temperature, 1.0)[:, None]


def gumbel_argmax(scores: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
                   exclude: torch.Tensor | None = None,
                   used: torch.Tensor | None = None) -> torch.Tensor:
    """argmax_v (scores[r, v] + gumbel(seed[r], position[r], v)), optionally skipping
    token ``exclude[r]`` (>= 0) of each row; only the rows of bool ``used[r]`` (default all)
    need their token."""
    vocab = torch.arange(scores.shape[-1], device=scores.device)
    if exclude is not None:
        hit = (vocab[None, :] == exclude[:, None]) & (exclude[:, None] >= 0)
        scores = scores.masked_fill(hit, float("-inf"))
    contenders = _contenders(scores, used) if scores.device.type == "cpu" else None
    if contenders is not None:
        # In id order, so that argmax's first of equal values is the lowest id, as below.
        vocab = contenders.sort(dim=-1).values
        scores = scores.gather(-1, vocab)
    else:
        vocab = vocab[None, :]
    # Seeds and positions were validated by `flashspec.sampling`; no device read here.
    noise = rng.gumbel(seed[:, None], position[:, None], vocab, dtype=scores.dtype,
                       validate=False)
    best = (scores + noise).argmax(dim=-1, keepdim=True)
    return vocab.expand(scores.shape).gather(-1, best).squeeze(-1)


# Contenders beyond this share of the vocabulary: noise for every token costs less than
# choosing them.
MAX_CONTENDER_SHARE = 1 / 16


def _contenders(scores: torch.Tensor, used: torch.Tensor | None) -> torch.Tensor | None:
    """Ids ``[B, K]`` holding every token of each row that can win the Gumbel race (the K
    highest scores; K from one host read), or None when K would exceed MAX_CONTENDER_SHARE of
    the vocabulary.

    A token wins only if its score is above the row's top score less the noise's span:
    otherwise the top token's smallest noise beats its largest. A margin of an ulp of the top
    score and of the span keeps that true of the rounded sums.
    """
    top = scores.amax(dim=-1, keepdim=True)
    span = rng.GUMBEL_MAX - rng.GUMBEL_MIN
    reach = top - span - (1.0 + (top.abs() + span) * 2.0**-20)
    count = (scores >= reach).sum(dim=-1)
    if used is not None:
        count = count.masked_fill(~used, 0)
    most = max(int(count.max()), 1)
    if most > MAX_CONTENDER_SHARE * scores.shape[-1]:
        return None
    return scores.topk(most, dim=-1, sorted=False).indices


def _choose(logits: torch.Tensor, scores: torch.Tensor, params: SamplingParams,
            positions: torch.Tensor, exclude: torch.Tensor | None = None) -> torch.Tensor:
    """Token of each row ``[B, V]``: argmax of the raw `logits` for greedy rows, Gumbel-max
    of the transformed `scores` otherwise; token ``exclude[r]`` (>= 0) is skipped."""
    greedy_scores = logits
    if exclude is not None:
        vocab = torch.arange(logits.shape[-1], device=logits.device)
        greedy_scores = logits.masked_fill(vocab[None, :] == exclude[:, None], float("-inf"))
    greedy = greedy_scores.argmax(dim=-1)
    if params.all_greedy:            # no noise needed (a host flag, no device read)
        return greedy
    sampled = gumbel_argmax(scores, params.seed, positions, exclude, used=~params.is_greedy)
    return torch.where(params.is_greedy, greedy, sampled)


def model_dtype_logits(hidden: torch.Tensor, weight: torch.Tensor, *,
                       bias: torch.Tensor | None = None,
                       softcap: float | None = None) -> torch.Tensor:
    """Logits the way transformers computes them: a matmul in the weight's dtype (rounded
    to it), with the LM-head `bias` and then the `softcap` in that dtype too (as
    `compute_logits`), then float32. The materialized baseline of the benchmarks samples
    these."""
    bias = None if bias is None else bias.to(weight.dtype)
    return softcapped(torch.nn.functional.linear(hidden, weight, bias), softcap).float()


def argmax_logits(logits: torch.Tensor) -> ArgmaxOutput:
    """Greedy token of each row of `logits` ``[B, V]`` (lowest id on ties); token -1 and
    status `NON_FINITE` where the row is not finite."""
    finite = torch.isfinite(logits).all(dim=-1)
    return ArgmaxOutput(torch.where(finite, logits.argmax(dim=-1), INVALID_TOKEN), _status(finite))


def sample_logits(logits: torch.Tensor, params: SamplingParams,
                  positions: torch.Tensor) -> SampleOutput:
    """One token per row of `logits` ``[B, V]`` from softmax of the transformed logits, with
    the noise of sequence index ``positions[b]``; token -1, NaN logprob and lse and status
    `NON_FINITE` for rows whose logits (or logits / temperature) are not finite."""
    finite = _finite_rows(logits, params)
    scores = transform_logits(logits, params)
    tokens = torch.where(finite, _choose(logits, scores, params, positions), INVALID_TOKEN)
    lse = torch.where(finite, scores.logsumexp(dim=-1), float("nan"))
    logprobs = scores.gather(-1, tokens.clamp_min(0)[:, None]).squeeze(-1) - lse
    return SampleOutput(tokens, logprobs, lse, _status(finite))


def verify_logits(logits: torch.Tensor, draft_tokens: torch.Tensor, params: SamplingParams,
                  positions: torch.Tensor, *, acceptance: str = "strict") -> VerifyOutput:
    """Verification of ``draft_tokens`` ``[B, G]`` (-1 padded) from materialized `logits`
    ``[B * (G+1), V]``, where row b*(G+1)+j predicts sequence index ``positions[b] + j``;
    `acceptance` as in `flashspec.sampling.verify`. Rows whose logits are not finite at a
    position they can emit get num_accepted -1 and status `NON_FINITE`."""
    batch_size, num_drafts = draft_tokens.shape
    num_positions = num_drafts + 1
    vocab_size = logits.shape[-1]
    # With every row greedy (a host flag) the functions below read only that flag, not the
    # rows' values: the per-position copy of each parameter is skipped.
    flat_params = (params if params.all_greedy
                   else params.repeat_interleave(num_positions, validate=False))
    offsets = torch.arange(num_positions, device=logits.device)
    flat_positions = (positions[:, None] + offsets[None, :]).reshape(-1)
    # Drafts end at the first padding; the position after the last draft gets no draft.
    # Positions past it are never emitted: their logits are not checked either.
    is_draft = (draft_tokens >= 0).cumprod(dim=1).bool()
    used = offsets[None, :] <= is_draft.sum(dim=1, keepdim=True)
    finite = (_finite_rows(logits, flat_params).view(batch_size, num_positions) | ~used).all(dim=1)
    drafts = torch.cat([torch.where(is_draft, draft_tokens, -1),
                        draft_tokens.new_full((batch_size, 1), -1)], dim=1)
    flat_scores = transform_logits(logits, flat_params)
    target = _choose(logits, flat_scores, flat_params, flat_positions).view(batch_size, num_positions)
    scores = flat_scores.view(batch_size, num_positions, vocab_size)
    log_norm = scores.logsumexp(dim=-1)
    greedy = params.is_greedy[:, None]
    accept_prob = (drafts == target).to(scores.dtype)
    if not params.all_greedy:
        draft_prob = (scores.gather(-1, drafts.clamp_min(0)[..., None]).squeeze(-1)
                      - log_norm).exp()
        accept_prob = torch.where(greedy, accept_prob, draft_prob)
    accept_prob = torch.where(drafts >= 0, accept_prob, 0.0)

    if acceptance == "strict":
        accepted = (drafts == target) & (drafts >= 0)
        replacement = target
    else:
        u = rng.uniform(params.seed[:, None], positions[:, None] + offsets[None, :], 0,
                        stream=rng.ACCEPT_STREAM, validate=False)
        accepted = torch.where(greedy, drafts == target, u < accept_prob.double()) & (drafts >= 0)
        masked = _choose(logits, flat_scores, flat_params, flat_positions, exclude=drafts.reshape(-1))
        replacement = torch.where(drafts >= 0, masked.view(batch_size, num_positions), target)

    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    emitted = offsets[None, :] <= num_accepted[:, None]
    at_stop = offsets[None, :] == num_accepted[:, None]
    tokens = torch.where(at_stop, replacement, drafts)
    tokens = torch.where(emitted, tokens, INVALID_TOKEN)
    logprobs = scores.gather(-1, tokens.clamp_min(0)[..., None]).squeeze(-1) - log_norm
    logprobs = torch.where(emitted, logprobs, 0.0)

    tokens = torch.where(finite[:, None], tokens, INVALID_TOKEN)
    num_accepted = torch.where(finite, num_accepted, -1)
    logprobs = torch.where(finite[:, None], logprobs, 0.0)
    return VerifyOutput(num_accepted, tokens, accept_prob[:, :num_drafts], logprobs,
                        _status(finite))


def _status(finite: torch.Tensor) -> torch.Tensor:
    return torch.where(finite, OK, NON_FINITE).to(torch.int32)
