"""The work each rank does on its own vocabulary shard in torch ops: `summaries`, each row's
summary (`summary.py`) of the shard's logits, keyed by global token ids.

It materializes the shard's ``[R, V_r]`` logits (`shard_logits`) and summarises them
(`summarize`): the CPU's way, the retries' (which want more candidates than the fused
kernels merge) and the reference the fused summaries
(`flashspec.kernels.fused_shard_summaries`, stage 1 over the shard's tiles and a per-shard
stage 2) are tested against. `shard_logits` also serves the rows that completion gathers
whole.
"""

from __future__ import annotations

import torch

from .. import reference, rng
from ..params import LogitEdits, SamplingParams
from . import summary
from .layout import VocabShards
from .summary import SummaryLayout


def summaries(hidden: torch.Tensor, weight: torch.Tensor, layout: SummaryLayout,
              params: SamplingParams | None, positions: torch.Tensor | None,
              shards: VocabShards, drafts: torch.Tensor | None = None, *,
              bias: torch.Tensor | None = None, softcap: float | None = None,
              edits: LogitEdits | None = None) -> torch.Tensor:
    """int32 words ``[R, layout.words]``: the summary of each row of `hidden` ``[R, D]``
    over this rank's shard `weight` ``[V_r, D]`` (its `bias`, `softcap`, `edits` of R rows),
    with `params` and `positions` of R rows (None: argmax) and, in verification, `drafts`
    int64 ``[R]`` (global ids, -1 where none)."""
    logits = shard_logits(hidden, weight, bias=bias, softcap=softcap, edits=edits)
    return summarize(logits, layout, params, positions, shards.offset, shards.vocab_size, drafts)


def shard_logits(hidden: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None,
                 softcap: float | None = None, edits: LogitEdits | None = None) -> torch.Tensor:
    """float32 logits ``[R, V_r]`` of `hidden` ``[R, D]`` and the shard's `weight` ``[V_r, D]``,
    the model's own (the shard's `bias` ``[V_r]``, `softcap`), then `edits` (codes
    ``[R, V_r]``), as `flashspec.reference` makes them."""
    logits = reference.compute_logits(hidden, weight, bias=bias, softcap=softcap)
    return logits if edits is None else reference.edit_logits(logits, edits)


def summarize(logits: torch.Tensor, layout: SummaryLayout, params: SamplingParams | None,
              positions: torch.Tensor | None, vocab_offset: int, vocab_size: int,
              drafts: torch.Tensor | None = None) -> torch.Tensor:
    """int32 words ``[R, layout.words]`` summarising the shard's `logits` ``[R, V_r]``, whose
    column j is global token ``vocab_offset + j``, with row r's `params` (None: argmax) and
    noise position ``positions[r]``; `drafts` int64 ``[R]`` (verification): each position's
    global draft id, -1 where none."""
    num_rows, shard_size = logits.shape
    columns = torch.arange(shard_size, device=logits.device)
    ids = vocab_offset + columns
    low, high = logits.amin(dim=-1), logits.amax(dim=-1)
    finite = torch.isfinite(low) & torch.isfinite(high)
    if params is None:
        best = torch.where(finite, high, float("nan"))
        return summary.pack([best, vocab_offset + logits.argmax(dim=-1)])

    greedy = params.is_greedy
    temperature = params.temperature.float()
    temperature = torch.where(temperature > 0, temperature, 1.0)
    # The reference's arithmetic: divided where sampled with a temperature other than 1.
    scaled = ~greedy & (params.temperature != 1.0)
    scores = torch.where(scaled[:, None], logits / temperature[:, None], logits)
    largest = torch.maximum(low.abs(), high.abs())
    finite &= greedy | torch.isfinite(largest / temperature)
    lse = torch.where(finite, scores.logsumexp(dim=-1), float("nan"))

    race = scores
    fields_after = []
    if drafts is not None:
        column = drafts - vocab_offset
        here = (drafts >= 0) & (column >= 0) & (column < shard_size)
        column = column.clamp(0, shard_size - 1)[:, None]
        draft_score = torch.where(here, scores.gather(-1, column).squeeze(-1), float("-inf"))
        race = race.masked_fill(here[:, None] & (columns[None, :] == column), float("-inf"))
        fields_after.append(draft_score)
    # Sampled rows the candidates do not decide race with their noise; greedy rows without.
    noisy = ~greedy & ~summary.truncated_rows(params, vocab_size)
    if bool(noisy.any()):
        race = _perturbed(race, noisy, params.seed, positions, ids)
    index = race.argmax(dim=-1, keepdim=True)  # the first of equal scores: the lowest id
    fields = [race.gather(-1, index).squeeze(-1), vocab_offset + index.squeeze(-1),
              scores.gather(-1, index).squeeze(-1), lse, *fields_after]

    if not layout.num_candidates:
        return summary.pack(fields)
    # + 0.0 folds -0.0 into +0.0, which the reference ties with it.
    all_keys = summary.pack_candidates(logits + 0.0, ids.expand(num_rows, -1))
    keys = all_keys.topk(min(layout.num_candidates, shard_size), dim=-1).values
    # The top keys exactly: a missing token's key is below the last one.
    floor = keys[:, -1] if shard_size > layout.num_candidates else \
        torch.full_like(keys[:, 0], summary.PAD_KEY)
    if keys.shape[1] < layout.num_candidates:
        keys = torch.nn.functional.pad(keys, (0, layout.num_candidates - keys.shape[1]),
                                       value=summary.PAD_KEY)
    return summary.pack(fields, keys, floor)


def _perturbed(scores: torch.Tensor, rows: torch.Tensor, seed: torch.Tensor,
               positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`scores` ``[R, V_r]`` with the Gumbel noise of global token `ids` added in the bool
    `rows`, where only the tokens that can win get theirs, as `flashspec.reference` does on
    the CPU: a token more than the noise's span below its row's top score loses to it
    whatever its noise (a margin covers the rounding), and is set to -inf."""
    span = rng.GUMBEL_MAX - rng.GUMBEL_MIN
    top = scores.amax(dim=-1, keepdim=True)
    reach = top - span - (1.0 + (top.abs() + span) * 2.0**-20)
    row, column = ((scores >= reach) & rows[:, None]).nonzero(as_tuple=True)
    noise = rng.gumbel(seed[row], positions[row], ids[column], dtype=scores.dtype,
                       validate=False)
    out = scores.masked_fill(rows[:, None], float("-inf"))
    out[row, column] = scores[row, column] + noise
    return out
