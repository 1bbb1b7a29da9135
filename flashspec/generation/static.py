"""The static engine: fixed-shape steps over `WindowCache`s, captured as CUDA graphs.

All running state lives in preallocated device tensors of the `_Engine`: each row's tokens,
left-aligned in ``seq`` (so a token's column is its sequence position), its length, its
end (prompt + max_new_tokens), a finished flag and its draft count. A step reads that
state, runs a decoder forward of fixed width and one LM-head operation, and commits the
result back on the device:

* ``plain``: feed each row's last token, sample one token;
* ``draft_first`` / ``draft_next`` (assistant): feed the last two tokens (the one before
  may have been an accepted draft the assistant never saw), then one draft at a time,
  greedy through the tiled argmax;
* ``verify`` (width G): feed the last token and G drafts (assistant drafts, or prompt
  lookup computed inside the step), verify them in one pass, emit accepted drafts plus
  one token.

Rows never move: the caches roll back by position (see `window`). Finished rows stay in
the batch, emit nothing and cost a little compute, which keeps every shape fixed.

On CUDA each step is captured once as a CUDA graph and replayed; the host reads one small
report per step (tokens emitted, finished flags, status: ``_Report``) to decide what to
launch next, which is the only device-to-host transfer of a step. Engines are cached per
target decoder and reused by later calls of the same shape, so capture is paid once.
Without CUDA the same steps run eagerly and give the same tokens.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..checks import NonFiniteLogitsError
from ..params import SamplingParams
from . import samplers
from .drafters import AssistantDrafter, PromptLookupDrafter, prompt_lookup_drafts
from .loop import Generated, cut_at_first_end, heuristic_draft_counts
from .outputs import SpeculationStats
from .window import WindowCache, layer_kinds

SAMPLER_KINDS = ("fused", "materialized")
_ATTENTION = ("sdpa", "eager")
# The engine lives on the target decoder, so that it goes away with the model.
_ENGINE_ATTRIBUTE = "_flashspec_static_engine"


def cached_engine(decoder: torch.nn.Module):
    """The static engine last used with `decoder` (a target's decoder), or None; its
    ``graphs`` map each step ("plain", "draft_first", "draft_next", ("verify", G)) to its
    captured CUDA graph, which benchmarks replay to time a step alone."""
    return getattr(decoder, _ENGINE_ATTRIBUTE, None)


def drop_engine(decoder: torch.nn.Module) -> None:
    """Free the engine cached on `decoder` (its caches and graphs)."""
    if cached_engine(decoder) is not None:
        object.__setattr__(decoder, _ENGINE_ATTRIBUTE, None)


def unsupported_reason(plan) -> str | None:
    """Why `plan` cannot run on the static engine (None if it can)."""
    if plan.stop_criteria is not None:
        return "stop strings are checked on decoded text, between steps"
    decoders = [("model", plan.head.decoder)]
    if isinstance(plan.drafter, AssistantDrafter):
        decoders.append(("assistant_model", plan.drafter.head.decoder))
    for role, decoder in decoders:
        config = decoder.config
        implementation = getattr(config, "_attn_implementation", None)
        if implementation not in _ATTENTION:
            return (f"`{role}` uses attn_implementation={implementation!r}; the static engine "
                    f"builds its own attention masks for {_ATTENTION}")
        if layer_kinds(config) is None:
            return f"`{role}` has layers other than full or sliding-window attention"
    return None


def decode_static(plan, sampler: str = "fused", graphs: bool | None = None,
                  compile: bool | None = None):
    """Run `plan` on the static engine; returns `flashspec.generation.loop.Generated`.

    `sampler`: "fused" (Triton kernels on CUDA, the reference elsewhere) or
    "materialized" (``[B, V]`` logits in the model's dtype, sampled with torch ops).
    `graphs`: capture CUDA graphs (default: on CUDA). `compile`: the captured steps run a
    torch.compile'd decoder forward (default: with graphs)."""
    if sampler not in SAMPLER_KINDS:
        raise ValueError(f"`sampler`={sampler!r} is not allowed: use one of {SAMPLER_KINDS}")
    reason = unsupported_reason(plan)
    if reason is not None:
        raise ValueError(f"the static engine cannot run this generation: {reason}")
    device = plan.input_ids.device
    graphs = device.type == "cuda" if graphs is None else graphs
    if graphs and device.type != "cuda":
        raise ValueError(f"`graphs`=True needs CUDA tensors, got inputs on {device}")
    compile = graphs if compile is None else compile
    shape = _Shape.of(plan, sampler, graphs, compile)
    decoder = plan.head.decoder
    engine = cached_engine(decoder)
    if engine is None or engine.shape != shape or not engine.serves(plan):
        engine = None
        drop_engine(decoder)         # free the old buffers and graphs before allocating
        engine = _Engine(plan, shape)
        object.__setattr__(decoder, _ENGINE_ATTRIBUTE, engine)
    return engine.run(plan)


def _weight_storage(plan) -> tuple:
    """Address and dtype of every tensor an engine reads from the models: the LM-head
    weights and the decoders' parameters."""
    heads = [plan.head] + ([plan.drafter.head] if isinstance(plan.drafter, AssistantDrafter)
                           else [])
    return tuple((tensor.data_ptr(), tensor.dtype) for head in heads
                 for tensor in (head.weight, *head.decoder.parameters()))


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What the buffers and captured graphs of an engine depend on."""

    batch_size: int
    capacity: int          # KV cache columns
    seq_columns: int       # token buffer columns
    max_drafts: int        # draft buffer columns
    drafter: str           # "none", "assistant" or "lookup"
    heuristic: bool        # the assistant's draft count follows transformers' heuristic
    sampler: str
    graphs: bool
    compile: bool          # captured steps run a torch.compile'd forward
    flags: tuple           # the sampling parameters' host flags (they pick kernel variants)
    num_eos: int

    @classmethod
    def of(cls, plan, sampler: str, graphs: bool, compile: bool) -> "_Shape":
        batch_size, prompt_width = plan.input_ids.shape
        drafter = ("none" if plan.drafter is None else
                   "assistant" if isinstance(plan.drafter, AssistantDrafter) else "lookup")
        max_drafts = max(0, min(plan.num_drafts if plan.schedule == "constant" else plan.max_new_tokens,
                                plan.max_new_tokens - 1)) if drafter != "none" else 0
        # Round up so that calls of similar lengths share an engine (and its graphs).
        capacity = _round_up(prompt_width + plan.max_new_tokens + 1, 128)
        params = plan.params
        return cls(batch_size, capacity, capacity + max_drafts + 1, max(max_drafts, 1), drafter,
                   drafter == "assistant" and plan.schedule == "heuristic", sampler, graphs, compile,
                   params.kernel_flags(plan.head.weight.shape[0]),
                   0 if plan.eos_token_ids is None else plan.eos_token_ids.numel())


class _Decoder:
    """A decoder with its `WindowCache`."""

    def __init__(self, decoder: torch.nn.Module, role: str, shape: _Shape, device: torch.device,
                 dtype: torch.dtype):
        self.decoder = decoder
        self.role = role
        config = decoder.config
        self.num_layers = config.num_hidden_layers
        mask_dtype = None if config._attn_implementation == "sdpa" else dtype
        self.cache = WindowCache(shape.batch_size, shape.capacity, device, layer_kinds(config),
                                 mask_dtype)
        # Captured steps run a compiled forward: inductor fuses the dozens of small kernels
        # of each layer (norms, rotary, residuals), which a graph of the eager forward
        # would replay one by one. One compilation per step width.
        self.step_forward = self._forward
        if shape.compile:
            # Each engine shape and step width is a compilation of the same function: allow
            # more than dynamo's default of 8 before it falls back to eager.
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
            dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 1024)
            self.step_forward = torch.compile(self._forward, dynamic=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                new_live: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states ``[B, n, D]`` of `input_ids` at `position_ids` ``[B, n]``,
        eager (the prompt: its width varies from call to call)."""
        hidden = self._forward(input_ids, position_ids, new_live)
        if self.cache.num_updates != self.num_layers:
            raise ValueError(
                f"`{self.role}` ({type(self.decoder).__name__}) updated {self.cache.num_updates} "
                f"attention caches for {self.num_layers} layers; the static engine supports "
                "decoders whose whole state is an attention KV cache")
        return hidden

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 new_live: torch.Tensor | None = None) -> torch.Tensor:
        mask = self.cache.begin(position_ids, new_live)
        return self.decoder(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                            past_key_values=self.cache, use_cache=True).last_hidden_state


@dataclasses.dataclass
class _Report:
    """What the host reads after a step (one transfer): per row, and the caches' fill."""

    emitted: list
    drafted: list
    accepted: list
    finished: list
    status: list
    broken: list           # the assistant's logits were not finite
    length: list
    num_drafts: list
    tokens: list           # [W][B] tokens of the step (streamer)
    accept_probs: list     # [G][B] p(x) of each draft (float64, sent as its bits)
    target_fill: int       # one past the target cache's last column kept for the next step
    draft_fill: int

    FIELDS = 8

    @staticmethod
    def rows(max_drafts: int) -> int:
        """Rows of the report tensor: the fields, the two fills, the tokens, the probs."""
        return _Report.FIELDS + 2 + (max_drafts + 1) + max_drafts

    @classmethod
    def read(cls, report: torch.Tensor) -> "_Report":
        rows = report.tolist()
        tokens_start = cls.FIELDS + 2
        probs_start = tokens_start + (len(rows) - tokens_start + 1) // 2
        probs = torch.tensor(rows[probs_start:], dtype=torch.int64).view(torch.float64)
        return cls(*rows[: cls.FIELDS], tokens=rows[tokens_start:probs_start],
                   accept_probs=probs.tolist(), target_fill=rows[cls.FIELDS][0],
                   draft_fill=rows[cls.FIELDS + 1][0])


class _Engine:
    def __init__(self, plan, shape: _Shape):
        self.shape = shape
        device = plan.input_ids.device
        weight = plan.head.weight
        self.device = device
        self.target = _Decoder(plan.head.decoder, "model", shape, device, weight.dtype)
        self.assistant = None
        if shape.drafter == "assistant":
            draft_head = plan.drafter.head
            self.assistant = _Decoder(draft_head.decoder, "assistant_model", shape, device,
                                      draft_head.weight.dtype)
        batch, seq = shape.batch_size, shape.seq_columns
        long = dict(dtype=torch.long, device=device)
        self.seq = torch.zeros(batch, seq, **long)
        self.logprobs = torch.zeros(batch, seq, dtype=torch.float32, device=device)
        self.prompt_length = torch.zeros(batch, **long)
        self.length = torch.zeros(batch, **long)
        self.end = torch.zeros(batch, **long)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.num_drafts = torch.zeros(batch, **long)
        self.drafts = torch.full((batch, shape.max_drafts), -1, **long)
        self.draft_count = torch.zeros((), **long)
        self.eos = torch.zeros(shape.num_eos, **long)
        self.report = torch.zeros(_Report.rows(shape.max_drafts), batch, **long)
        self.params = plan.params._map(torch.clone, validate=False)
        self.sampler = self._sampler(weight, self.params)
        if self.assistant is not None:
            self.draft_sampler = self._sampler(plan.drafter.head.weight, self.params)
        self.lookup_ngram = plan.drafter.max_ngram_size if shape.drafter == "lookup" else 0
        self.state = [self.seq, self.logprobs, self.length, self.finished, self.num_drafts,
                      self.drafts, self.draft_count, self.report,
                      *(d.cache.live for d in self._decoders()),
                      *(d.cache.position for d in self._decoders())]
        self.graphs: dict = {}
        self.pool = torch.cuda.graph_pool_handle() if shape.graphs else None
        self.weight_storage = _weight_storage(plan)

    def _sampler(self, weight: torch.Tensor, params: SamplingParams):
        if self.shape.sampler == "fused" and self.device.type == "cuda" and weight.dtype != torch.float64:
            return samplers.FusedSampler(weight, params)
        logits = (samplers.model_dtype_logits if self.shape.sampler == "materialized"
                  and self.device.type == "cuda" else None)
        return samplers.MaterializedSampler(weight, params, *((logits,) if logits else ()))

    def _decoders(self) -> list[_Decoder]:
        return [self.target] + ([self.assistant] if self.assistant is not None else [])

    def serves(self, plan) -> bool:
        """The same models, with the same weight tensors (an engine holds its decoders'
        caches, its samplers hold the LM-head weights and its graphs the parameters'
        addresses: after ``model.half()``, ``.to(...)`` or a replaced weight it must go)."""
        draft = plan.drafter.head.decoder if isinstance(plan.drafter, AssistantDrafter) else None
        mine = self.assistant.decoder if self.assistant is not None else None
        return (draft is mine and _weight_storage(plan) == self.weight_storage
                and (not isinstance(plan.drafter, PromptLookupDrafter)
                     or plan.drafter.max_ngram_size == self.lookup_ngram))

    # ---- one generate() call -------------------------------------------------------

    def run(self, plan):
        self._load(plan)
        started = time.monotonic()
        steps = []
        report = self._prefill(plan)
        steps.append(report)
        while not all(report.finished):
            if plan.max_time is not None and time.monotonic() - started > plan.max_time:
                break
            width = self._width(report) if self.shape.drafter != "none" else 0
            if width == 0:
                self._ensure_room(report, 1, 0)
                hidden = self._step("plain", self._plain)
                report = self._finish(plan, hidden, None)
            else:
                step = self._ensure_room(report, self._step_width(width) + 1, width + 1) - 1
                width = min(width, step)
                if self.assistant is not None:
                    self._step("draft_first", self._draft_first)
                    for _ in range(width - 1):
                        self._step("draft_next", self._draft_next)
                hidden, drafts = self._step(("verify", step), lambda: self._verify(step))
                report = self._finish(plan, hidden, drafts)
            steps.append(report)
        if plan.persist_schedule is not None:
            plan.persist_schedule(self.num_drafts.clone())
        if plan.streamer is not None:
            plan.streamer.end()
        return Generated(*self._outputs(plan), stats=_stats(steps, self.shape.batch_size))

    def _load(self, plan) -> None:
        """Reset the state for `plan`'s prompts and parameters (same buffers, so that the
        captured graphs stay valid)."""
        batch, width = plan.input_ids.shape
        mask = plan.attention_mask.long()
        self.prompt_length.copy_(mask.sum(dim=1))
        source = (torch.arange(self.shape.seq_columns, device=self.device)[None, :]
                  + width - self.prompt_length[:, None])
        inside = source < width
        prompt = plan.input_ids.gather(1, source.clamp(0, width - 1))
        self.seq.copy_(torch.where(inside, prompt, 0))
        self.logprobs.zero_()
        self.length.copy_(self.prompt_length)
        self.end.copy_(self.prompt_length + plan.max_new_tokens)
        self.end_list = self.end.tolist()
        self.finished.zero_()
        self.num_drafts.fill_(plan.num_drafts)
        if self.shape.num_eos:
            self.eos.copy_(plan.eos_token_ids)
        for name in ("do_sample", "temperature", "top_k", "top_p", "min_p", "seed"):
            getattr(self.params, name).copy_(getattr(plan.params, name))
        for decoder in self._decoders():
            decoder.cache.reset()
        self.prompt = (plan.input_ids, mask)

    def _prefill(self, plan) -> _Report:
        """Eager: both decoders read the prompts; the first step verifies drafts (when
        there are any) together with the prompt, as the eager loop does."""
        input_ids, mask = self.prompt
        prompt = (input_ids, (mask.cumsum(dim=1) - 1).clamp_min(0), mask.bool())
        width = 0
        if self.shape.drafter != "none":
            width = min(plan.num_drafts, plan.max_new_tokens - 1, self.shape.max_drafts)
        if width == 0:
            hidden = self._sample(self.target.forward(*prompt)[:, -1])
            return self._finish(plan, hidden, None)
        if self.assistant is not None:
            hidden = self.assistant.forward(*prompt)[:, -1]
            self.drafts[:, 0] = self.draft_sampler.argmax(hidden.to(self.draft_sampler.weight.dtype))
            self.draft_count.fill_(1)
            for _ in range(width - 1):
                self._step("draft_next", self._draft_next)
        hidden, drafts = self._verify(width, prompt)
        return self._finish(plan, hidden, drafts)

    # ---- steps (fixed shapes, no host reads: captured on CUDA) ----------------------

    def _plain(self) -> torch.Tensor:
        positions = (self.length - 1)[:, None]
        return self._sample(self.target.step_forward(self.seq.gather(1, positions), positions)[:, -1])

    def _sample(self, hidden: torch.Tensor) -> torch.Tensor:
        """Sample one token per row from the target's last hidden states and commit it."""
        hidden = hidden.to(self.sampler.weight.dtype)
        tokens, logprobs, status = self.sampler.sample(hidden, self.length)
        self._commit(tokens[:, None], logprobs[:, None], torch.ones_like(self.length),
                     torch.zeros_like(self.length), status)
        return hidden

    def _draft_first(self) -> None:
        positions = (self.length - 2)[:, None] + torch.arange(2, device=self.device)
        hidden = self.assistant.step_forward(self.seq.gather(1, positions), positions)[:, -1]
        self.drafts[:, 0] = self.draft_sampler.argmax(hidden.to(self.draft_sampler.weight.dtype))
        self.draft_count.fill_(1)

    def _draft_next(self) -> None:
        count = self.draft_count.view(1)
        previous = self.drafts.index_select(1, count - 1).clamp_min(0)
        # Rows that take fewer drafts keep drafting (unused), inside their budget's positions.
        positions = torch.minimum(self.length[:, None] + count - 1, (self.end - 1)[:, None])
        hidden = self.assistant.step_forward(previous, positions)[:, -1]
        tokens = self.draft_sampler.argmax(hidden.to(self.draft_sampler.weight.dtype))
        self.drafts.index_copy_(1, count, tokens[:, None])
        self.draft_count.add_(1)

    def _verify(self, width: int, prompt: tuple | None = None):
        """Verify `width` drafts per row after the row's last token or, on the first step,
        after the whole `prompt` (input ids, positions, live flags)."""
        columns = torch.arange(width, device=self.device)
        allowed = torch.minimum(self.num_drafts, self.end - self.length - 1)
        allowed = torch.where(self.finished, 0, allowed)
        within = columns[None, :] < allowed[:, None]
        if self.assistant is not None:
            proposed = self.drafts[:, :width]
            broken = ((proposed < 0) & within).any(dim=1)
        else:
            proposed = self._lookup(width, allowed)
            broken = torch.zeros_like(self.finished)
        drafts = torch.where(within, proposed, -1)
        # Padding (columns a row does not draft) stays out of the cache, at positions within
        # the row's budget: past it, a learned position table could end.
        draft_positions = torch.minimum(self.length[:, None] + columns, (self.end - 1)[:, None])
        if prompt is None:
            last = (self.length - 1)[:, None]
            hidden = self.target.step_forward(
                torch.cat([self.seq.gather(1, last), drafts.clamp_min(0)], dim=1),
                torch.cat([last, draft_positions], dim=1),
                torch.cat([torch.ones_like(last, dtype=torch.bool), within], dim=1))
        else:
            input_ids, positions, live = prompt
            hidden = self.target.forward(torch.cat([input_ids, drafts.clamp_min(0)], dim=1),
                                         torch.cat([positions, draft_positions], dim=1),
                                         torch.cat([live, within], dim=1))
        hidden = hidden[:, -(width + 1):].to(self.sampler.weight.dtype)
        num_accepted, tokens, logprobs, accept_probs, status = self.sampler.verify(
            hidden, drafts, self.length)
        self._commit(tokens, logprobs, num_accepted + 1, (drafts >= 0).sum(dim=1), status,
                     broken, schedule=True, accept_probs=accept_probs)
        return hidden, drafts

    def _lookup(self, width: int, allowed: torch.Tensor) -> torch.Tensor:
        """Prompt-lookup drafts from each row's tokens so far (right-aligned for the search)."""
        columns = self.seq.shape[1]
        source = (torch.arange(columns, device=self.device)[None, :] - columns
                  + self.length[:, None])
        valid = source >= 0
        tokens = torch.where(valid, self.seq.gather(1, source.clamp_min(0)), 0)
        return prompt_lookup_drafts(tokens, valid, allowed, self.lookup_ngram, num_drafts=width)

    def _commit(self, tokens: torch.Tensor, logprobs: torch.Tensor, proposed: torch.Tensor,
                drafted: torch.Tensor, status: torch.Tensor, broken: torch.Tensor | None = None,
                schedule: bool = False, rows: torch.Tensor | None = None,
                accept_probs: torch.Tensor | None = None) -> None:
        """Append each row's emitted tokens (cut at its budget and first EOS), update its
        flags and draft count, and write the report (with the drafts' `accept_probs`).
        Rows that are finished, flagged by `status`, or (with `rows`) not listed emit
        nothing."""
        ok = ~self.finished & (status == 0)
        if rows is not None:
            ok &= rows
        width = tokens.shape[1]
        columns = torch.arange(width, device=self.device)
        emitted = torch.where(ok, torch.minimum(proposed, self.end - self.length), 0)
        if self.shape.num_eos:
            emitted, has_end = cut_at_first_end(emitted, torch.isin(tokens, self.eos))
        else:
            has_end = torch.zeros_like(ok)
        index = (self.length[:, None] + columns[None, :]).clamp_max(self.seq.shape[1] - 1)
        write = columns[None, :] < emitted[:, None]
        self.seq.scatter_(1, index, torch.where(write, tokens, self.seq.gather(1, index)))
        self.logprobs.scatter_(1, index, torch.where(write, logprobs.float(),
                                                     self.logprobs.gather(1, index)))
        self.length += emitted
        self.finished |= ok & (has_end | (self.length >= self.end))
        accepted = torch.where(ok, proposed - 1, 0)
        drafted = torch.where(ok, drafted, 0)
        if schedule and self.shape.heuristic:
            stepped = heuristic_draft_counts(self.num_drafts, accepted, drafted)
            self.num_drafts.copy_(torch.where(ok, stepped, self.num_drafts))
        fills = [self._fill(self.target, 1)]
        fills.append(self._fill(self.assistant, 2) if self.assistant is not None else fills[0])
        fill_rows = torch.stack(fills)[:, None].expand(2, len(ok))
        broken = torch.zeros_like(ok) if broken is None else broken & ok
        tokens_rows = torch.full((self.shape.max_drafts + 1, len(ok)), -1, dtype=torch.long,
                                 device=self.device)
        tokens_rows[:width] = torch.where(write, tokens, -1).T
        probs_rows = torch.zeros(self.shape.max_drafts, len(ok), dtype=torch.float64,
                                 device=self.device)
        if accept_probs is not None:
            probs_rows[: accept_probs.shape[1]] = torch.where(ok[:, None], accept_probs.double(), 0.0).T
        self.report.copy_(torch.cat([
            torch.stack([emitted, drafted, accepted, self.finished.long(), status.long(),
                         broken.long(), self.length, self.num_drafts]),
            fill_rows, tokens_rows, probs_rows.view(torch.int64)]))

    def _fill(self, decoder: _Decoder, refeed: int) -> torch.Tensor:
        """One past the last cache column still needed by the next step, which re-feeds
        each row's last `refeed` tokens."""
        cache = decoder.cache
        kept = cache.live & (cache.position < (self.length - refeed)[:, None])
        return torch.where(kept.any(dim=0), cache.column_index + 1, 0).max()

    # ---- host side -------------------------------------------------------------------

    def _width(self, report: _Report) -> int:
        """Drafts to verify next: the most any running row may take (its draft count,
        leaving room in its budget for the target's own token)."""
        widths = [min(num, end - length - 1) for num, end, length, done in
                  zip(report.num_drafts, self.end_list, report.length, report.finished) if not done]
        return max(0, min(max(widths), self.shape.max_drafts))

    def _step_width(self, width: int) -> int:
        """Positions a verification step of `width` drafts checks. Each distinct width is a
        compilation and a captured graph (seconds to a minute each, on a shape's first
        call), so widths come from a short list: a constant schedule's G (fewer drafts only
        near the end of a row's budget), the heuristic schedule's next power of two. The
        extra positions verify padding: a few more rows in a memory-bound step."""
        if not self.shape.heuristic:
            return self.shape.max_drafts
        return min(1 << (width - 1).bit_length(), self.shape.max_drafts)

    def _ensure_room(self, report: _Report, target_columns: int, draft_columns: int) -> int:
        """Make room for the next step's writes (compacting a cache whose holes left too
        little); returns how many target columns fit, at most `target_columns`."""
        capacity = self.shape.capacity
        fits = target_columns
        for decoder, fill, need, refeed in ((self.target, report.target_fill, target_columns, 1),
                                            (self.assistant, report.draft_fill, draft_columns, 2)):
            if decoder is None or need == 0:
                continue
            if fill + need > capacity:
                decoder.cache.drop_from(self.length - refeed)
                decoder.cache.compact()
                fill = int(decoder.cache.last_live_column())
            fits = min(fits, capacity - fill)
        return fits

    def _step(self, key, fn):
        """Run a step: replay its CUDA graph (captured on first use), or call it."""
        if not self.shape.graphs:
            return fn()
        if key not in self.graphs:
            self.graphs[key] = self._capture(fn)
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def _capture(self, fn):
        saved = [tensor.clone() for tensor in self.state]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):      # warm-up: compiles kernels, sets up cuBLAS
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        for tensor, value in zip(self.state, saved):
            tensor.copy_(value)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn()
        return graph, outputs

    def _finish(self, plan, hidden, drafts) -> _Report:
        """Read the step's report; raise on non-finite logits; complete flagged rows."""
        report = _Report.read(self.report)
        if any(report.broken):
            raise NonFiniteLogitsError([b for b, x in enumerate(report.broken) if x],
                                       source="assistant_model")
        bad = [b for b, s in enumerate(report.status) if s == samplers.NON_FINITE]
        if bad:
            raise NonFiniteLogitsError(bad)
        flagged = [b for b, s in enumerate(report.status) if s == samplers.NEEDS_COMPLETION]
        if flagged:
            report = self._complete(hidden, drafts, flagged, report)
        if plan.streamer is not None and report.emitted[0]:
            plan.streamer.put(torch.tensor([t[0] for t in report.tokens[: report.emitted[0]]]))
        return report

    def _complete(self, hidden, drafts, flagged: list[int], report: _Report) -> _Report:
        """Redo the flagged rows exactly through the checked path, then commit them."""
        rows = torch.tensor(flagged, device=self.device)
        if drafts is None:
            tokens, logprobs = samplers.complete_sample(self.sampler, hidden, rows, self.length)
            tokens, logprobs = tokens[:, None], logprobs[:, None]
            proposed = torch.ones_like(rows)
            drafted = torch.zeros_like(rows)
            accept_probs = None
        else:
            num_accepted, tokens, logprobs, accept_probs = samplers.complete_verify(
                self.sampler, hidden, drafts, rows, self.length)
            proposed = num_accepted + 1
            drafted = (drafts[rows] >= 0).sum(dim=1)
        batch = self.shape.batch_size
        full = lambda part, fill: torch.full((batch, *part.shape[1:]), fill, dtype=part.dtype,
                                              device=self.device).index_copy(0, rows, part)
        selected = torch.zeros(batch, dtype=torch.bool, device=self.device)
        selected[rows] = True
        self._commit(full(tokens, -1), full(logprobs, 0), full(proposed, 0), full(drafted, 0),
                     torch.zeros(batch, dtype=torch.int32, device=self.device),
                     schedule=drafts is not None, rows=selected,
                     accept_probs=None if accept_probs is None else full(accept_probs, 0))
        redone = _Report.read(self.report)
        for b in flagged:       # the other rows' values are the step's own
            for name in ("emitted", "drafted", "accepted", "status", "broken"):
                getattr(report, name)[b] = getattr(redone, name)[b]
            for step_rows, redone_rows in ((report.tokens, redone.tokens),
                                           (report.accept_probs, redone.accept_probs)):
                for step_row, redone_row in zip(step_rows, redone_rows):
                    step_row[b] = redone_row[b]
        return dataclasses.replace(report, finished=redone.finished, length=redone.length,
                                   num_drafts=redone.num_drafts, target_fill=redone.target_fill,
                                   draft_fill=redone.draft_fill)

    def _outputs(self, plan):
        max_new = plan.max_new_tokens
        count = self.length - self.prompt_length
        index = (self.prompt_length[:, None] + torch.arange(max_new, device=self.device)[None, :])
        index = index.clamp_max(self.seq.shape[1] - 1)
        emitted = torch.arange(max_new, device=self.device)[None, :] < count[:, None]
        tokens = torch.where(emitted, self.seq.gather(1, index), plan.pad_token_id)
        logprobs = (torch.where(emitted, self.logprobs.gather(1, index), 0.0)
                    if plan.output_logprobs else None)
        return tokens, count, logprobs


def _stats(steps: list[_Report], batch_size: int) -> SpeculationStats:
    """Speculation statistics, one entry per step and row that was running."""
    running = [True] * batch_size
    table = []
    for report in steps:
        rows = [b for b in range(batch_size) if running[b]]
        table.append((torch.tensor(rows, dtype=torch.long),
                      *(torch.tensor([getattr(report, name)[b] for b in rows])
                        for name in ("drafted", "accepted", "emitted")),
                      torch.tensor(report.accept_probs, dtype=torch.float64).T[rows]))
        running = [not done for done in report.finished]
    return SpeculationStats.from_steps(table, batch_size)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
