"""The exact materialized path: a call's logit edits that the fused kernels do not make.

Transformers' logits processors that are not fused (encoder_*, exponential decay, ... a user's
`logits_processor`; the fused ones too when one of those is set), the warpers flashspec does
not fuse (typical_p, epsilon_cutoff, eta_cutoff, top_h), watermarking, a softcap after a
logit scale, `output_scores` / `output_logits` and `output_attentions` /
`output_hidden_states` (`recording`) run here, inside the same engine and its steps. Per step:

1. the target's logits are formed for the call's rows and the positions the step verifies,
   ``[B, W, V]``, as the model computes them (`heads.head_logits`: bias, scale, softcap),
   in float32 (float64 for a float64 model), as the reference computes logits;
2. transformers' own `LogitsProcessorList`, built once per call by the model's
   `_get_logits_processor` from the merged config (so: processors, then temperature and
   the warpers, then watermarking, in transformers' order), is applied to each position
   with that position's context: stock's ``input_ids`` (the row's left-padded prompt and
   its generated tokens) and, for a drafted position, the drafts before it;
3. the token is drawn with flashspec's noise, ``argmax_v(scores[v] + gumbel(seed, position,
   v))`` (``argmax(scores)`` for greedy rows), and drafts are verified by the strict rule
   (accepted iff equal to that token), so seeded tokens are the same with and without
   speculation, for any draft length.

Processors see the call's batch, as in stock `generate`: one ``[B, L]`` call per distinct
context length L a step needs (one for a plain step; with drafts, one per position and per
distinct number of tokens rows have generated). A row that needs another length there is
given its own context cut to L or extended with `pad_token_id` (what stock feeds a finished
row), and its result is discarded. Processors must therefore be functions of
``(input_ids, scores)`` row by row, as every transformers processor but guidance and
SynthID watermarking is (those two keep state between calls: `plan` defers them to stock).
The same holds for stock assisted generation, which also calls them on drafted positions.

Each step's work is eager (no CUDA graph, host reads allowed). An option with a fused
version (`edits.FUSED_OPTIONS`, the head's bias and softcap, the allowed-token masks of
`allowed`) runs here only when another one forces this path; transformers' own processor
then applies it here.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import LogitsProcessorList

from .. import reference
from ..outputs import NON_FINITE, OK
from .heads import OutputHead, head_logits
from .recording import ForwardOutputs


class LogitsProcessing:
    """One call's logit edits: what to apply, and the scores kept for the output.

    Args:
        processors: transformers' processors and warpers for the call, in order.
        head: the target's `OutputHead` (its logits are the model's own).
        prompt_ids: ``[B, L]`` the call's rows as stock's ``input_ids`` start (left-padded,
            after ``num_return_sequences``).
        pad_token_id: fills a row's context past its end (as stock fills finished rows).
        reasons: what forced this path, named in the warning.
        keep_scores / keep_logits: collect each emitted token's processed scores / raw
            logits ``[V]`` (`output_scores` / `output_logits`).
        forwards: collects each emitted token's attentions and hidden states
            (`recording.ForwardOutputs`: `output_attentions` / `output_hidden_states`), or None.
    """

    def __init__(self, processors: LogitsProcessorList, head: OutputHead, prompt_ids: torch.Tensor,
                 pad_token_id: int, reasons: tuple[str, ...], keep_scores: bool = False,
                 keep_logits: bool = False, forwards: ForwardOutputs | None = None):
        self.processors = processors
        self.forwards = forwards
        self.head = head
        self.prompt_ids = prompt_ids
        self.pad_token_id = pad_token_id
        self.reasons = reasons
        self.keep_scores, self.keep_logits = keep_scores, keep_logits
        rows = prompt_ids.shape[0]
        self._kept_scores = [[] for _ in range(rows)]
        self._kept_logits = [[] for _ in range(rows)]
        self._step = None            # (scores, logits) [rows, W, V] of the last step, if kept

    def sampler(self, slot) -> "ProcessedSampler":
        return ProcessedSampler(self, slot)

    def recording(self, slot):
        """What the call's steps in `slot` run inside: the target's forwards return the
        attentions and hidden states `forwards` keeps (nothing without)."""
        return contextlib.nullcontext() if self.forwards is None else self.forwards.recording(slot)

    def apply(self, logits: torch.Tensor, drafts: torch.Tensor | None, slot) -> torch.Tensor:
        """Scores ``[B, W, V]``: `logits` ``[B, W, V]`` (position j of row b predicts the
        token after the row's tokens and its first j drafts, ``drafts`` ``[B, W-1]``, -1
        padded) after the processors, each with its position's context. Positions a row
        does not use, and rows that are finished or pad the slot, keep their logits."""
        scores = logits.clone()
        rows = self.prompt_ids.shape[0]
        every_row = torch.arange(rows, device=logits.device)
        for which, at, context in position_contexts(self.prompt_ids, self.pad_token_id, slot,
                                                    drafts, logits.shape[1]):
            position = torch.zeros(rows, dtype=torch.long, device=logits.device).index_copy(0, which, at)
            out = self.processors(context, logits[every_row, position])
            scores[which, at] = out[which].to(scores.dtype)
        return scores

    def keep(self, scores: torch.Tensor, logits: torch.Tensor) -> None:
        """The last step's scores and logits, until `record` reads what it emitted."""
        if self.keep_scores or self.keep_logits:
            rows = self.prompt_ids.shape[0]
            self._step = (scores[:rows], logits[:rows])

    def record(self, emitted: list[int]) -> None:
        """Keep the scores and logits of each row's tokens the last step emitted (its first
        ``emitted[b]`` positions, after EOS, budget and stop-string cuts), and their
        attentions and hidden states."""
        if self.forwards is not None:
            self.forwards.record(emitted)
        if self._step is None:
            return
        scores, logits = self._step
        for row, count in enumerate(emitted[: len(self._kept_scores)]):
            for j in range(count):
                if self.keep_scores:
                    self._kept_scores[row].append(scores[row, j])
                if self.keep_logits:
                    self._kept_logits[row].append(logits[row, j])
        self._step = None

    def outputs(self) -> tuple[tuple | None, tuple | None]:
        """`scores` and `logits` as stock returns them: one ``[B, V]`` tensor per generated
        token. A row that ended earlier holds NaN there (stock would show the scores of the
        pad tokens it keeps feeding that row)."""
        return (self._stack(self._kept_scores) if self.keep_scores else None,
                self._stack(self._kept_logits) if self.keep_logits else None)

    def _stack(self, kept: list[list[torch.Tensor]]) -> tuple:
        steps = max(len(row) for row in kept)
        vocab = self.head.vocab_size
        out = []
        for t in range(steps):
            column = [row[t] if t < len(row) else None for row in kept]
            like = next(x for x in column if x is not None)
            out.append(torch.stack([x if x is not None else like.new_full((vocab,), float("nan"))
                                    for x in column]))
        return tuple(out)


def position_contexts(prompt_ids: torch.Tensor, pad_token_id: int, slot, drafts: torch.Tensor | None,
                      width: int):
    """The contexts of a step's positions, grouped as stock would see them: for each distinct
    count c of tokens generated before a position, ``(rows, positions, input_ids)`` with the
    (row, position) pairs at that count (int64 ``[N]`` each) and ``input_ids`` ``[B, L + c]``:
    every row's prompt as stock holds it (`prompt_ids` ``[B, L]``, left-padded), its
    generated tokens, its drafts (`drafts` ``[B, W-1]``, -1 padded, or None), then
    `pad_token_id`; only the listed rows' contexts are theirs at that count. Rows that are
    finished, and slot rows past B, have none."""
    rows, prompt_width = prompt_ids.shape
    device = prompt_ids.device
    generated = (slot.length - slot.prompt_length)[:rows]
    finished = slot.finished[:rows].tolist()
    num_drafts = ([0] * rows if drafts is None or width == 1 else
                  (drafts[:rows] >= 0).long().cumprod(dim=1).sum(dim=1).tolist())
    needed: dict[int, list[tuple[int, int]]] = {}       # tokens generated -> (row, position)
    for row, (count, done) in enumerate(zip(generated.tolist(), finished)):
        if not done:
            for j in range(num_drafts[row] + 1):
                needed.setdefault(count + j, []).append((row, j))
    most = int(generated.max()) if rows else 0
    history = torch.full((rows, prompt_width + most + width - 1), pad_token_id,
                         dtype=torch.long, device=device)
    history[:, :prompt_width] = prompt_ids
    offsets = torch.arange(most, device=device)[None, :]
    source = (slot.prompt_length[:rows, None] + offsets).clamp_max(slot.seq.shape[1] - 1)
    history[:, prompt_width:prompt_width + most] = torch.where(
        offsets < generated[:, None], slot.seq[:rows].gather(1, source), pad_token_id)
    if drafts is not None and width > 1:
        drafts = drafts[:rows]
        index = prompt_width + generated[:, None] + torch.arange(width - 1, device=device)[None, :]
        is_draft = (drafts >= 0).long().cumprod(dim=1).bool()
        history.scatter_(1, index, torch.where(is_draft, drafts, history.gather(1, index)))
    for count, pairs in sorted(needed.items()):
        yield (torch.tensor([row for row, _ in pairs], device=device),
               torch.tensor([j for _, j in pairs], device=device),
               history[:, : prompt_width + count])


class ProcessedSampler:
    """The target's `sample` and `verify` of a step on the materialized path, with the
    same results as `samplers.MaterializedSampler`'s (status 0 or `NON_FINITE`: a used
    position whose scores hold NaN or +inf, or exclude every token)."""

    def __init__(self, processing: LogitsProcessing, slot):
        self.processing = processing
        self.slot = slot
        self.weight = processing.head.weight
        self.params = slot.call_params

    def sample(self, hidden: torch.Tensor, positions: torch.Tensor):
        logits = head_logits(self.processing.head, hidden)[:, None]
        no_drafts = torch.full((hidden.shape[0], 0), -1, dtype=torch.long, device=hidden.device)
        _, tokens, logprobs, _, status = self._decide(logits, no_drafts, positions)
        return tokens[:, 0], logprobs[:, 0], status

    def verify(self, hidden: torch.Tensor, drafts: torch.Tensor, positions: torch.Tensor):
        batch, width, dim = hidden.shape
        logits = head_logits(self.processing.head, hidden.reshape(-1, dim)).view(batch, width, -1)
        return self._decide(logits, drafts, positions)

    def _decide(self, logits: torch.Tensor, drafts: torch.Tensor, positions: torch.Tensor):
        """The strict rule on processed scores: the target's own token at every position,
        drafts accepted while equal to it."""
        batch, width, _ = logits.shape
        scores = self.processing.apply(logits, drafts, self.slot)
        self.processing.keep(scores, logits)
        offsets = torch.arange(width, device=logits.device)
        is_draft = (drafts >= 0).long().cumprod(dim=1).bool()
        drafts = torch.cat([torch.where(is_draft, drafts, -1), drafts.new_full((batch, 1), -1)], dim=1)
        target = self._draw(scores, positions[:, None] + offsets[None, :])
        log_norm = scores.logsumexp(dim=-1)
        draft_prob = (scores.gather(-1, drafts.clamp_min(0)[..., None]).squeeze(-1) - log_norm).exp()
        greedy = self.params.is_greedy[:, None]
        accept_prob = torch.where(greedy, (drafts == target).to(scores.dtype), draft_prob)
        accept_prob = torch.where(drafts >= 0, accept_prob, 0.0)
        num_accepted = ((drafts == target) & (drafts >= 0)).long().cumprod(dim=1).sum(dim=1)
        emitted = offsets[None, :] <= num_accepted[:, None]
        logprobs = scores.gather(-1, target[..., None]).squeeze(-1) - log_norm
        # A greedy row whose edits exclude every token takes token 0, stock's argmax. Only
        # the positions a row reaches count: after a rejected draft the context is one that
        # never happens (stock's assisted generation never sees it either).
        kept = (scores > float("-inf")).any(dim=-1)
        excluded = emitted & ~kept & ~greedy
        if bool(excluded.any()):
            row = int(excluded.nonzero()[0, 0])
            raise ValueError(f"the call's logit edits leave no token to sample for row {row}: "
                             f"every score is -inf after {'; '.join(self.processing.reasons)}")
        valid = ~scores.isnan().any(dim=-1) & ~(scores == float("inf")).any(dim=-1) \
            & (kept | greedy)
        finite = (valid | ~emitted).all(dim=1)
        tokens = torch.where(emitted & finite[:, None], target, -1)
        logprobs = torch.where(emitted & finite[:, None], logprobs, 0.0)
        num_accepted = torch.where(finite, num_accepted, -1)
        status = torch.where(finite, OK, NON_FINITE).to(torch.int32)
        return num_accepted, tokens, logprobs, accept_prob[:, : width - 1], status

    def _draw(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[B, W]``: Gumbel-max of `scores` ``[B, W, V]`` with the noise of each row's
        seed and sequence index ``positions`` ``[B, W]``; argmax for greedy rows."""
        greedy = scores.argmax(dim=-1)
        if self.params.all_greedy:
            return greedy
        batch, width, vocab = scores.shape
        sampled = reference.gumbel_argmax(
            scores.reshape(-1, vocab), self.params.seed.repeat_interleave(width),
            positions.reshape(-1), used=(~self.params.is_greedy).repeat_interleave(width))
        return torch.where(self.params.is_greedy[:, None], greedy, sampled.view(batch, width))
