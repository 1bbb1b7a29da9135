"""The engine: one per target model, serving every `generate(sampler="flash")` call.

The engine lives on the target's decoder (so it goes away with the model) and holds:

* one `DecoderRunner` per decoder it has met (the target, assistants) and kernel choice
  (`invariant`): on CUDA each runs a forward compiled once with symbolic sizes
  (`compiled`), so no prompt length, `max_new_tokens`, sampling value or batch size
  compiles again;
* one `Slot` per batch bucket (on CUDA 2, 4, 8, ... rows; the rows a call lacks are
  finished padding): running state and KV caches, grown when a call needs more columns,
  evicted least recently used when a new one does not fit the memory budget, rebuilt when a
  call switches `invariant`;
* the CUDA graphs of the slots' steps, captured on first use per (slot, step, KV view,
  kernel flags) into one shared memory pool; a capture replays an already compiled forward
  and costs well under a second.

A call (`Engine.run`) loads its rows into a slot, prefills eagerly (any prompt length
without compiling), then repeats: decide the next step on the host from the last report,
make room in the caches, run the drafter's steps and the target's step (each a graph
replay on CUDA, a plain call elsewhere), read the step's report. Every compilation and
capture is logged (logger ``"flashspec"``) with the shape that caused it.

A call with `max_time` compiles and captures nothing: its budget counts from the call's
start, and a compilation (seconds) would overrun it. Where its steps would compile or capture
(`Engine.needs_compiling` says what), the call runs uncompiled: eager forwards, no CUDA
graphs, the LM head by torch ops (`samplers.MaterializedSampler` over model-dtype logits).

(About 750 lines: the call loop, the slots, the graphs and the memory budget share one
object's state; the steps themselves live in `slot`, the drafters in `drafters`.)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
import weakref

import torch
import torch.distributed as dist

from ..checks import NonFiniteLogitsError
from ..outputs import OK
from . import fused_projections, samplers, teardown
from .compiled import LOG, DecoderRunner, Event
from .cpu import decode_steps
from .inputs import TokenTypes, decoder_inputs
from .outputs import Generated, SpeculationStats
from .slot import Report, Slot, bucket

SAMPLER_KINDS = ("fused", "materialized")
MAX_HEURISTIC_DRAFTS = 64        # the heuristic schedule's drafts per step, at most
_ENGINE_ATTRIBUTE = "_flashspec_engine"
_BUDGET_ATTRIBUTE = "_flashspec_memory_budget"
_WARMING_ATTRIBUTE = "_flashspec_warming"


def engine_for(plan, sampler: str = "fused", invariant: bool = False) -> "Engine":
    """The engine of `plan`'s target (created on first use, replaced when the target's
    weights moved, e.g. after ``model.half()`` or ``.to(...)``), set for this call's sampler
    and decoder kernels (`invariant`: `flashspec.generation.invariant`'s)."""
    if sampler not in SAMPLER_KINDS:
        raise ValueError(f"`sampler`={sampler!r} is not allowed: use one of {SAMPLER_KINDS}")
    decoder = plan.head.decoder
    engine = getattr(decoder, _ENGINE_ATTRIBUTE, None)
    if engine is None or not engine.serves(plan.head):
        if engine is not None:
            engine.release()
        engine = Engine(plan.head)
        object.__setattr__(decoder, _ENGINE_ATTRIBUTE, engine)
    engine.sampler_kind = sampler
    engine.invariant = invariant
    return engine


def batch_bucket(rows: int, graphs: bool) -> int:
    """Rows of the slot that serves a batch of `rows`: with graphs a power of two of at
    least 2 (a batch of one would compile separately), else exactly `rows`."""
    return max(2, 1 << (rows - 1).bit_length()) if graphs else rows


def cached_engine(decoder: torch.nn.Module) -> "Engine | None":
    """The engine living on `decoder` (a target's decoder), or None."""
    return getattr(decoder, _ENGINE_ATTRIBUTE, None)


def set_memory_budget(decoder: torch.nn.Module, budget: int) -> None:
    """Bytes the engine of `decoder` (a target's decoder) may hold in KV caches and graphs,
    now and for any engine built for it later."""
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise ValueError(f"`memory_budget` must be a positive number of bytes, got {budget!r}")
    object.__setattr__(decoder, _BUDGET_ATTRIBUTE, budget)
    engine = cached_engine(decoder)
    if engine is not None:
        engine.memory_budget = budget


@contextlib.contextmanager
def warming(decoder: torch.nn.Module):
    """Calls on the engine of `decoder` (a target's decoder) inside this block are warm-up
    calls (`flashspec.warmup`): with drafts, their first steps take each width a call with
    `max_time` can meet (`Engine.timed_widths`), so that such calls find every step compiled
    and captured."""
    object.__setattr__(decoder, _WARMING_ATTRIBUTE, True)
    try:
        yield
    finally:
        object.__setattr__(decoder, _WARMING_ATTRIBUTE, False)


def drop_engine(decoder: torch.nn.Module) -> None:
    """Free the engine living on `decoder` (its slots and graphs)."""
    engine = cached_engine(decoder)
    if engine is not None:
        engine.release()
        object.__setattr__(decoder, _ENGINE_ATTRIBUTE, None)


class Engine:
    def __init__(self, head):
        self.head = head
        self.sampler_kind = "fused"               # this call's: part of every graph's key
        self.invariant = False                    # this call's: its slot's runners use it
        self.timed = False                        # this call has a max_time: it captures nothing
        self.uncompiled = False                   # this call runs uncompiled (`needs_compiling`)
        self.device = head.weight.device
        # A tensor-parallel model's steps are captured with their collectives (its layers'
        # all-reduces, the LM head's exchange), its graphs released before the process group
        # is destroyed (`teardown`); a model spread over devices runs its steps eagerly.
        self.graphs_enabled = self.device.type == "cuda" and not head.spread
        # Captures run on a stream of the head's GPU (torch's default capture stream is on
        # whichever GPU was current at the process's first capture).
        self.capture_stream = torch.cuda.Stream(self.device) if self.graphs_enabled else None
        self.pool = torch.cuda.graph_pool_handle() if self.graphs_enabled else None
        self._pool_anchor = (_anchor(self.pool, self.capture_stream, self.capture_mode)
                             if self.graphs_enabled else None)
        if self.graphs_enabled:
            if head.shards is not None:
                teardown.hold(self, head.shards.group)
            # Before the weights' addresses are recorded: fused members' parameters become
            # views (`fused_projections`; drafters fuse theirs as they are made).
            fused_projections.fuse(head.decoder)
        self.weight_storage = _weight_storage(head)
        self.events: list[Event] = []            # compilations and captures, in order
        # decoder -> {invariant: runner}
        self.runners: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.target = self.runner(head.decoder, "model")
        self.slots: dict[int, Slot] = {}          # batch bucket -> slot, least recent first
        self.graphs: dict = {}
        self.graph_bytes = 0
        self.last_call_steps: set = set()         # keys of the steps the last call replayed
        # A benchmark's timer (`flashspec.bench.timing.StepTimer`): when set, it replays
        # each graph between CUDA events. Graphs are replayed only here, inside a call, after
        # `Slot.ensure_room` made room for the step's writes: a replay outside a call could
        # write past the KV cache (a verification after a call that ended at its capacity).
        self.step_timer = None
        # (rows, the edits' kernel inputs) -> step widths (0: sampling) compiled for them
        self.compiled_kernels: dict[tuple[int, tuple], set[int]] = {}
        self.memory_budget = getattr(head.decoder, _BUDGET_ATTRIBUTE, None)
        if self.memory_budget is None and self.device.type == "cuda":
            self.memory_budget = int(0.5 * torch.cuda.mem_get_info(self.device)[0])

    @property
    def capture_mode(self) -> str:
        """The CUDA graph capture mode: thread-local wherever a process group exists (NCCL's
        watchdog thread queries the events of earlier collectives, which a capture in the
        default "global" mode forbids to other threads), else global."""
        collectives = self.head.shards is not None or (dist.is_available()
                                                       and dist.is_initialized())
        return "thread_local" if collectives else "global"

    def _same_budget_on_every_rank(self) -> None:
        """A tensor-parallel model's ranks decide alike whether a slot fits (else one rank
        would refuse a call, or grow a slot, that the others run): the smallest budget of
        the ranks, each read from its own GPU's free memory or set by the caller."""
        if self.memory_budget is None:
            return
        group = self.head.shards.group
        budget = torch.tensor([self.memory_budget], dtype=torch.int64, device=self.device)
        dist.all_reduce(budget, op=dist.ReduceOp.MIN, group=group)
        self.memory_budget = int(budget)

    def serves(self, head) -> bool:
        """Same weights where the engine's graphs and samplers read them, and the same head
        transforms (which its captured steps' kernels apply)."""
        return _weight_storage(head) == self.weight_storage

    def release(self) -> None:
        self.graphs.clear()
        self.slots.clear()
        self.graph_bytes = 0

    # ---- what the engine holds ---------------------------------------------------------

    def runner(self, decoder: torch.nn.Module, role: str) -> DecoderRunner:
        """`decoder`'s runner with the call's decoder kernels."""
        runners = self.runners.setdefault(decoder, {})
        if self.invariant not in runners:
            runners[self.invariant] = DecoderRunner(decoder, role, self.graphs_enabled,
                                                    self.events, self.invariant)
        return runners[self.invariant]

    def dtype_of(self, decoder: torch.nn.Module) -> torch.dtype:
        return next(decoder.parameters()).dtype

    def sampler(self, weight: torch.Tensor, slot: Slot, bias: torch.Tensor | None = None,
                softcap: float | None = None, shards=None):
        """The LM-head operations on `weight` (with the head transforms `bias` and `softcap`):
        the fused kernels on CUDA, except in an uncompiled call, which takes the materialized
        backend (torch ops, nothing to compile; exact for logits rounded to the model's
        dtype, as stock's are). A tensor-parallel head (`shards`: `weight` is this rank's
        rows) exchanges per-row summaries with the other ranks (`flashspec.parallel`)."""
        params = slot.call_params
        head = dict(bias=bias, softcap=softcap)
        if shards is not None:
            return samplers.ParallelSampler(weight, params, shards, **head)
        cuda = self.device.type == "cuda"
        fused = self.sampler_kind == "fused" and cuda and weight.dtype != torch.float64
        if fused and not self.uncompiled:
            return samplers.FusedSampler(weight, params, **head)
        if fused or (self.sampler_kind == "materialized" and cuda):
            return samplers.MaterializedSampler(weight, params, samplers.model_dtype_logits,
                                                **head)
        return samplers.MaterializedSampler(weight, params, **head)

    def target_sampler(self, slot: Slot):
        """The target's LM-head operations: the call's materialized path when its logits are
        edited (`processing`), else this engine's sampler with the target's head transforms
        (its LM-head bias and softcap: the model's own logits)."""
        if slot.processing is not None:
            return slot.processing.sampler(slot)
        return self.sampler(self.head.weight, slot, bias=self.head.bias,
                            softcap=self.head.softcap, shards=self.head.shards)

    def memory(self) -> dict:
        """What the engine holds on the device: per slot its rows, KV columns and bytes, and
        the bytes its captured graphs' pool took (measured around each capture)."""
        return {"slots": [{"batch_size": slot.batch_size, "capacity": slot.capacity,
                           "bytes": slot.nbytes()} for slot in self.slots.values()],
                "graphs": len(self.graphs), "graph_pool_bytes": self.graph_bytes,
                "budget_bytes": self.memory_budget}

    def slot_for(self, plan) -> Slot:
        """A slot for `plan`'s rows, with room for its prompts and first drafts."""
        rows, width = plan.attention_mask.shape
        batch = batch_bucket(rows, self.graphs_enabled)
        max_drafts = _max_drafts(plan)
        capacity = bucket(width + max(max_drafts, 1) + 2)
        slot = self.slots.pop(batch, None)
        if slot is not None and (slot.target.runner.invariant != self.invariant
                                 or _stale_masks(slot, self.dtype_of)):
            self._drop_graphs(slot)             # its runners use the other decoder kernels,
            slot = None                         # or its caches make masks of the other kind
        if slot is None:
            kv_bytes = self._slot_bytes(plan, batch, capacity)
            self._make_room(kv_bytes, keep=None)
            slot = Slot(self, batch, capacity, max(max_drafts, 1))
            LOG.info("new slot: %d rows, %d KV columns (%.1f MiB of KV cache)", batch, capacity,
                     kv_bytes / 2**20)
        self.slots[batch] = slot                          # most recently used last
        if capacity > slot.capacity:
            self.grow(slot, capacity)
        if max_drafts > slot.max_drafts:
            slot.widen(max_drafts)
        return slot

    def grow(self, slot: Slot, capacity: int) -> None:
        """Grow `slot` to `capacity` KV columns within the memory budget."""
        extra = slot.nbytes() * (capacity / slot.capacity - 1)
        self._make_room(int(extra), keep=slot)
        slot.grow(capacity)
        LOG.info("slot of %d rows grown to %d KV columns", slot.batch_size, capacity)

    def _slot_bytes(self, plan, batch: int, capacity: int) -> int:
        decoders = [self.head.decoder] + list(getattr(plan.drafter, "decoders", ()))
        return sum(batch * capacity * _kv_bytes_per_column(d, self.dtype_of(d)) for d in decoders)

    def _make_room(self, needed: int, keep: Slot | None) -> None:
        """Evict least recently used slots (not `keep`) until `needed` more bytes fit the
        budget; a clear error if they cannot."""
        if self.memory_budget is None:
            return
        held = lambda: sum(slot.nbytes() for slot in self.slots.values()) + self.graph_bytes
        for batch in list(self.slots):
            if held() + needed <= self.memory_budget:
                break
            if self.slots[batch] is not keep:
                self._evict(batch)
        if held() + needed > self.memory_budget:
            raise ValueError(
                f"sampler='flash' needs {needed / 2**30:.2f} GiB more for KV caches, over its "
                f"memory budget of {self.memory_budget / 2**30:.2f} GiB ({held() / 2**30:.2f} "
                "GiB held): lower max_new_tokens or max_length, the batch size or the prompt "
                "length, or raise the budget (flashspec.warmup(..., memory_budget=...))")

    def _evict(self, batch: int) -> None:
        slot = self.slots.pop(batch)
        self._drop_graphs(slot)
        LOG.info("evicted the slot of %d rows (%d KV columns)", slot.batch_size, slot.capacity)

    def _drop_graphs(self, slot: Slot) -> None:
        for key in [key for key in self.graphs if key[0] == id(slot)]:
            self.graph_bytes -= self.graphs.pop(key)[2]

    # ---- one generate() call -------------------------------------------------------------

    def run(self, plan) -> Generated:
        """Run the call of `plan`, on the head's GPU as the current device (Triton kernels
        and CUDA graphs use the current device's stream; a model on cuda:1 needs it). The
        call's token types reach every forward of the target through a hook held meanwhile
        (`inputs.TokenTypes`)."""
        types = (None if plan.token_type_ids is None
                 else TokenTypes(plan.token_type_ids, plan.attention_mask))
        with decoder_inputs(self.head.decoder, types):
            if self.device.type != "cuda":
                return self._run(plan)
            with torch.cuda.device(self.device):
                return self._run(plan)

    def _run(self, plan) -> Generated:
        started = time.monotonic()
        self.last_call_steps = set()
        if self.head.shards is not None:
            self._same_budget_on_every_rank()
        slot = self.slot_for(plan)
        drafter = slot.attached(plan.drafter) if plan.drafter is not None else None
        slot.drafter_name = getattr(plan.drafter, "name", "the drafter")
        prompt = slot.load(plan, _max_drafts(plan))
        timed_widths = self.timed_widths(slot) if drafter is not None else []
        self.timed, self.uncompiled = plan.max_time is not None, False
        if self.timed:
            missing = self.needs_compiling(slot, plan, timed_widths)
            if missing is not None:
                self.uncompiled = True
                LOG.info("this call has max_time and would %s: it runs uncompiled (eager "
                         "forwards, no CUDA graphs, the LM head by torch ops); "
                         "flashspec.warmup() with this call's settings prepares it", missing)
        for runner in self._call_runners(slot, plan):
            runner.eager = self.uncompiled
        warming = getattr(self.head.decoder, _WARMING_ATTRIBUTE, False)
        self._compile_kernels(slot, self._kernel_widths(slot, timed_widths, self.timed or warming))
        warm_widths = list(timed_widths) if warming else []
        num_rows = plan.input_ids.shape[0]
        stops = (_HostStops(plan, num_rows)
                 if plan.stop_criteria is not None or plan.custom_stops is not None else None)
        steps = []
        deadline = None if plan.max_time is None else started + plan.max_time
        # The materialized path's forwards return what `output_attentions` /
        # `output_hidden_states` keep (`recording`), inside.
        with (plan.processing.recording(slot) if plan.processing is not None
              else contextlib.nullcontext()):
            report = self._prefill(slot, drafter, prompt)
            if self._decodes_ahead(slot, plan, stops, warm_widths):
                self._decode_ahead(slot, plan, drafter, report, steps, num_rows)
            else:
                decoders = (self.head.decoder, *getattr(plan.drafter, "decoders", ()))
                with decode_steps(self.device, decoders, self.head.weight,
                                  eager=not slot.target.runner.compile,
                                  invariant=self.invariant):
                    if self._splits_masked_steps(slot, plan, stops, warm_widths):
                        self._decode_masked(slot, plan, drafter, report, steps, num_rows)
                    else:
                        self._decode(slot, plan, drafter, report, steps, num_rows, stops,
                                     deadline, warm_widths)
        if plan.persist_schedule is not None:
            plan.persist_schedule(slot.num_drafts[:num_rows].clone())
        if plan.streamer is not None:
            plan.streamer.end()
        tokens, count, logprobs = slot.outputs(num_rows, plan.pad_token_id, plan.output_logprobs)
        kv = slot.returned_kv(plan, int(count.max()) if num_rows else 0) if plan.wants_kv else None
        return Generated(tokens, count, logprobs, _stats(steps, num_rows), kv)

    def _decode(self, slot: Slot, plan, drafter, report: Report, steps: list, num_rows: int,
                stops, deadline: float | None, warm_widths: list[int]) -> None:
        """The decode loop, one step at a time: each step's report is read before the next
        step is chosen (stop strings and criteria, a streamer, max_time, eager steps)."""
        per_forward = None                  # seconds per forward, from the last step
        while True:
            self._after_step(plan, slot, report, stops)
            steps.append(report)
            if all(report.finished[:num_rows]):
                return
            if deadline is not None and time.monotonic() > deadline:
                return
            width = self._width(slot, report) if drafter is not None else 0
            timed = deadline is not None and width > 0
            if timed:
                width = _width_in_time(width, deadline - time.monotonic(), per_forward)
            elif warm_widths and width > 0:
                width, timed = warm_widths.pop(0), True
            step_started = time.monotonic()
            hidden, drafts = self._launch(slot, plan, drafter, report, width, timed)
            report = self._finish(slot, hidden, drafts)
            # Per position the step verified (on the CPU, fewer than `width` may be).
            per_forward = (time.monotonic() - step_started) / (_verified(drafts) + 1)

    def _decodes_ahead(self, slot: Slot, plan, stops, warm_widths: list[int]) -> bool:
        """Whether the call's steps can run one ahead of the host: captured steps, and no
        host work between steps (stop strings or criteria, a streamer, max_time, a warm-up's
        widths, allowed-token masks)."""
        return (self._runs_ahead() and not slot.eager and not self.uncompiled
                and not self.timed and not warm_widths and stops is None
                and plan.streamer is None and slot.allowed is None)

    def _runs_ahead(self) -> bool:
        """Whether the engine launches work before the host has read the last step's report:
        where its steps are captured graphs."""
        return self.graphs_enabled

    def _decode_ahead(self, slot: Slot, plan, drafter, report: Report, steps: list,
                      num_rows: int) -> None:
        """The decode loop with the next step launched before the host reads a step's
        report (a copy the step's end leaves in host memory), so that the GPU does not wait
        for the host between steps. The next step is chosen from the report before (its
        drafts, its room: `_launch` makes room for both steps); rows finished meanwhile emit
        nothing, and near the end a step runs only if some row can still be running after
        the one in flight (with EOS ids, one step at the end may emit nothing).

        A row that a step flags for exact completion did not advance, so the step in flight
        computes its position again: its report completes the row, or completes it exactly
        if it flags the row again (no step is launched before that report is read, so its
        hidden states are still the step's outputs)."""
        self._after_step(plan, slot, report, None)
        steps.append(report)
        if all(report.finished[:num_rows]):
            return
        in_flight: collections.deque = collections.deque()
        hold = False
        while True:
            if (len(in_flight) < 2 and not hold
                    and _may_run(report, slot.end_list, num_rows, len(in_flight))):
                width = self._width(slot, report) if drafter is not None else 0
                outputs = self._launch(slot, plan, drafter, report, width,
                                       ahead=len(in_flight))
                in_flight.append((outputs, slot.copy_report(_verified(outputs[1]))))
                continue
            outputs, pending = in_flight.popleft()
            report, hold = self._read_pending(slot, plan, pending, outputs, bool(in_flight),
                                              steps)
            if all(report.finished[:num_rows]):
                return

    def _splits_masked_steps(self, slot: Slot, plan, stops, warm_widths: list[int]) -> bool:
        """Whether the call decodes in `_decode_masked`'s loop: its masks come from the
        host's reports alone (`Slot.masks_drafts`: grammars), and no other host work comes
        between steps (as `_decodes_ahead`). Such a call's steps run split wherever they
        run (`_launch`); this loop overlaps the host's fill with the forward."""
        return (slot.masks_drafts and not slot.eager and not self.uncompiled and not self.timed
                and not warm_widths and stops is None and plan.streamer is None)

    def _decode_masked(self, slot: Slot, plan, drafter, report: Report, steps: list,
                       num_rows: int) -> None:
        """The decode loop of a call whose masks come from the host's reports (grammars).
        A step's masks need the last step's tokens, so the step runs as two, the target's
        forward (after the drafter's steps) and its LM head's step, and the host fills the
        masks in between, while the forward runs: it launches step t + 1's forward, then
        reads step t's report, advances the grammars by it, fills the masks of step t + 1's
        positions (along its drafts, copied to the host ahead of the forward), and launches
        the head. A drafter that reads masks drafts only after the report is read, and the
        forward then runs while the host fills the positions after the drafts.

        A row that step t flags for exact completion did not advance: the forward in flight
        computed its position again, so step t + 1's head completes it, or flags it again
        and has it completed exactly before another forward runs (as `_decode_ahead`)."""
        self._after_step(plan, slot, report, None)
        steps.append(report)
        if all(report.finished[:num_rows]):
            return
        # Drafts and forwards launched before the report, where steps are captured (on the
        # CPU, which runs each step as it is called, that gains nothing) and the drafter does
        # not read the masks.
        early = self._runs_ahead() and not getattr(drafter, "reads_masks", False)
        pending = outputs = None          # the last head's report on its way, its outputs
        hold = False
        while True:
            ahead = (pending is not None and early and not hold
                     and _may_run(report, slot.end_list, num_rows, 1))
            if pending is not None and not ahead:
                report, hold = self._read_pending(slot, plan, pending, outputs, False, steps)
                pending = None
                if all(report.finished[:num_rows]):
                    return
            width = self._width(slot, report) if drafter is not None else 0
            step = self._draft(slot, plan, drafter, report, width, False, int(ahead))
            drafts = self._target_forward(slot, step)
            if ahead:
                report, hold = self._read_pending(slot, plan, pending, outputs, True, steps)
                if all(report.finished[:num_rows]):
                    return
            outputs = self._target_head(slot, drafter, report, width, step, drafts)
            pending = slot.copy_report(step or 0)

    def _read_pending(self, slot: Slot, plan, pending, outputs, in_flight: bool,
                      steps: list) -> tuple[Report, bool]:
        """Read the report of a step launched ahead (`outputs`: its hidden states and drafts)
        and act on it; `in_flight`: a later step's forward was launched since, which redoes
        the rows this one flagged. Returns the report and whether it left flagged rows to
        that step."""
        report = pending.read()
        flagged = [b for b, s in enumerate(report.status) if s == samplers.NEEDS_COMPLETION]
        hold = bool(flagged and in_flight)
        for b in flagged if hold else ():
            report.status[b] = OK          # the step in flight redoes the row
        report = self._finish(slot, *outputs, report)
        self._after_step(plan, slot, report, None)
        steps.append(report)
        return report, hold

    def _launch(self, slot: Slot, plan, drafter, report: Report, width: int,
                timed: bool = False, ahead: int = 0):
        """Make room and run one step: plain (`width` 0) or `width` drafts and their
        verification; `ahead`: steps launched before it whose reports are not read yet (its
        room counts theirs). Returns the step's hidden states and drafts (None if plain). A
        call whose masks come from the host's reports runs the step split, as
        `_decode_masked` does (the same graphs, without its overlap)."""
        step = self._draft(slot, plan, drafter, report, width, timed, ahead)
        if slot.masks_drafts:
            drafts = self._target_forward(slot, step)
            return self._target_head(slot, drafter, report, width, step, drafts)
        if slot.allowed is not None:
            slot.fill_allowed(step or 0)
        key, = self._target_steps(slot, step)
        if step is None:
            return self._run_step(slot, key, slot.plain), None
        return self._run_step(slot, key, lambda: slot.verify(step))

    @staticmethod
    def _target_steps(slot: Slot, step: int | None) -> list:
        """The graph keys of the target's step verifying `step` positions (None: plain): one
        step, or where the call's masks come from the host's reports, its forward and its
        head (`Slot.plain_forward`, `plain_head`, `verify_forward`, `verify_head`)."""
        if not slot.masks_drafts:
            return ["plain" if step is None else ("verify", step)]
        if step is None:
            return ["plain forward", "plain head"]
        return [("verify forward", step), ("verify head", step)]

    def _target_forward(self, slot: Slot, step: int | None):
        """A split step's first graph, the target's forward over its last tokens and the
        drafts a verification of `step` positions checks (None: plain), the drafts first
        copied to host memory (`Slot.copy_drafts`, returned; None if plain)."""
        key = self._target_steps(slot, step)[0]
        if step is None:
            self._run_step(slot, key, slot.plain_forward)
            return None
        drafts = slot.copy_drafts(step)
        self._run_step(slot, key, lambda: slot.verify_forward(step))
        return drafts

    def _target_head(self, slot: Slot, drafter, report: Report, width: int, step: int | None,
                     drafts):
        """A split step's second graph, after its forward (`_target_forward`, whose `drafts`
        copy it reads): the masks of its positions filled on the host from `report` (the
        step before's) along the drafts, then the LM head's step. Returns its hidden states
        and drafts (None if plain)."""
        verified = None if step is None else slot.host_verified_drafts(drafts.read(), report)
        slot.fill_allowed(step or 0, self._drafts_masked(slot, drafter, width, step), verified)
        key = self._target_steps(slot, step)[1]
        if step is None:
            return self._run_step(slot, key, slot.plain_head), None
        return self._run_step(slot, key, lambda: slot.verify_head(step))

    def _draft(self, slot: Slot, plan, drafter, report: Report, width: int, timed: bool,
               ahead: int) -> int | None:
        """Make room for a step of `width` drafts (and the `ahead` steps before it) and run
        the drafter's steps, the masks of their positions filled before each where the
        drafter reads them. Returns the positions the verification checks (None: a plain
        step)."""
        if width == 0:
            # A one-token forward writes a dead column too.
            slot.ensure_room(report, 2 * (ahead + 1))
            return None
        step = self._step_width(slot, width, timed)
        # A drafter's steps may write more columns of its cache than the verification's.
        columns = max(step + 2, getattr(drafter, "columns", lambda width: 0)(step))
        slot.ensure_room(report, columns * (ahead + 1))
        masked = self._drafts_masked(slot, drafter, width, step) > 0
        for column, (key, fn) in enumerate(drafter.steps(width)):
            if masked:
                slot.fill_draft_masks(column)
            self._run_step(slot, key, fn, plan.drafter.key)
        step = self._verification_width(slot, width, step)
        if step > width:  # fewer drafts than columns: those past them are an old step's
            slot.drafts[:, width:step] = -1
            slot.draft_failed[:, width:step] = False
        return step

    @staticmethod
    def _drafts_masked(slot: Slot, drafter, width: int, step: int | None) -> int:
        """The positions whose masks the drafter's steps of a step verifying `width` drafts
        had (`Slot.fill_draft_masks`): `width` where the drafter reads masks and the call
        gives them to it (`Slot.masks_drafts`), else 0."""
        reads = getattr(drafter, "reads_masks", False)    # a caller's may not subclass ours
        return width if step is not None and slot.masks_drafts and reads else 0

    def _verification_width(self, slot: Slot, width: int, step: int) -> int:
        """Positions the verification of `width` drafts checks: `step` (`_step_width`)
        where steps are compiled (a fixed set of shapes); for the eager steps of the CPU,
        which read the drafts for free and pay a row of every matmul per position, one past
        the last column some row drafted (or failed to draft: the verification reports
        that row), 0 when none did (the step samples one token, as stock's prompt lookup
        does without a match)."""
        if self.device.type != "cpu" or slot.target.runner.compile:
            return step
        used = ((slot.drafts[:, :width] >= 0) | slot.draft_failed[:, :width]).any(dim=0)
        return int(used.nonzero().max()) + 1 if used.any() else 0

    def timed_widths(self, slot: Slot) -> list[int]:
        """The verification widths a call with `max_time` can meet in `slot` (its drafts cut
        to any count up to the call's): each count's `_step_width`, powers of two and the
        call's draft count, smallest first."""
        return sorted({self._step_width(slot, w, timed=True) for w in range(1, slot.call_drafts + 1)})

    def needs_compiling(self, slot: Slot, plan, timed_widths: list[int]) -> str | None:
        """What a call with `max_time` would compile or capture first (None: nothing, and it
        runs compiled, replaying the graphs that exist):

        * a decoder of the call (the target, an assistant) whose forward is not compiled;
        * with the fused LM head, a width of `timed_widths` (or 0, sampling) whose kernels
          are not compiled for the slot's rows (`compiled_kernels`);
        * where steps are captured (CUDA, no materialized fallback), a step the call can meet
          (``plain`` without drafts; with drafts, the drafter's steps and the verification
          at each of `timed_widths`) never captured over the slot's buffers with this call's
          drafter, sampler, kernel flags and schedule, at any KV view. A capture proves what
          the step's kernels are (edit codes, an assistant's argmax) compiled.

        A KV view the call grows into may lack a graph of a step captured at another view:
        such a step runs its compiled forward and kernels directly (`_run_step`)."""
        for runner in self._call_runners(slot, plan):
            if runner.would_compile:
                return f"compile the {runner.role}'s forward ({type(runner.decoder).__name__})"
        if self._runs_kernels(slot):
            compiled = self.compiled_kernels.get(self._kernel_key(slot), set())
            missing = [w for w in [0, *timed_widths] if w not in compiled]
            if missing:
                return (f"compile the LM-head kernels for {slot.batch_size} rows at widths "
                        f"{missing}")
        if not self.graphs_enabled or slot.eager:
            return None
        if plan.drafter is None:
            steps = [(key, None) for key in self._target_steps(slot, None)]
        else:
            steps = list(dict.fromkeys(
                [(key, plan.drafter.key) for w in timed_widths
                 for key, _ in slot.drafters[plan.drafter.key].steps(w)]
                + [(key, None) for w in timed_widths for key in self._target_steps(slot, w)]))
        captured = {key[:-1] for key in self.graphs}
        for key, drafter in steps:
            if self._step_kind(slot, key, drafter) not in captured:
                return f"capture its step {key!r} for {slot.batch_size} rows"
        return None

    def _call_runners(self, slot: Slot, plan) -> list[DecoderRunner]:
        """The runners of `slot` whose decoders this call runs (the target, its drafter's)."""
        decoders = [self.head.decoder, *getattr(plan.drafter, "decoders", ())]
        return [entry.runner for entry in slot.caches
                if any(entry.runner.decoder is decoder for decoder in decoders)]

    def _kernel_widths(self, slot: Slot, timed_widths: list[int], timed: bool) -> set[int]:
        """Widths whose LM-head kernels a call needs: sampling (0), the step widths of its
        schedule, and with `timed` (a call with max_time, or a warm-up) those of a timed
        call (`timed_widths`)."""
        untimed = {self._step_width(slot, w) for w in range(1, slot.call_drafts + 1)}
        return {0} | untimed | (set(timed_widths) if timed else set())

    def _compile_kernels(self, slot: Slot, widths: set[int]) -> None:
        """Compile the fused LM-head kernels' variants that `slot`'s steps of `widths` meet,
        for every sampling setting (`samplers.kernel_settings`), the first time a (rows,
        width) comes: a later call that changes only its sampling options then compiles no
        kernel. Triton keeps them on disk, so another process only loads them."""
        if not self._runs_kernels(slot):
            return
        key = self._kernel_key(slot)
        for width in sorted(widths - self.compiled_kernels.get(key, set())):
            started = time.perf_counter()
            samplers.compile_variants(self.head.weight, slot.batch_size, width, edits=key[1],
                                      bias=self.head.bias, softcap=self.head.softcap,
                                      shards=self.head.shards)
            self.compiled_kernels.setdefault(key, set()).add(width)
            settings = ", ".join(samplers.kernel_settings(self.head.vocab_size))
            edited = " with logit edits" if key[1] else ""
            event = Event("compile", f"LM-head kernels ({settings}){edited} for "
                          f"{slot.batch_size} rows, "
                          + (f"verifying {width} drafts" if width else "sampling"),
                          time.perf_counter() - started)
            self.events.append(event)
            LOG.info("compiled %s in %.1f s", event.what, event.seconds)

    def _runs_kernels(self, slot: Slot) -> bool:
        """Whether the target's LM head runs the fused kernels: `FusedSampler`, or a
        tensor-parallel head's `ParallelSampler` on GPUs (its per-shard kernels)."""
        sampler = self.target_sampler(slot)
        return isinstance(sampler, samplers.FusedSampler) or (
            isinstance(sampler, samplers.ParallelSampler) and self.device.type == "cuda")

    @staticmethod
    def _kernel_key(slot: Slot) -> tuple[int, tuple]:
        """The fused kernels' variants a slot's steps select beyond the sampling setting: its
        rows and the logit edits' inputs of the call (`Slot.edits`; empty: none)."""
        return slot.batch_size, slot.edits.kernel_inputs() if slot.edits is not None else ()

    def _prefill(self, slot: Slot, drafter, prompt) -> Report:
        """Eager: the decoders read the prompts and the target samples each row's first
        token. Drafts begin with the next step: every later position is then computed by
        the same (compiled) steps with or without drafts, which the bitwise invariance of
        seeded tokens needs (an eager forward and a compiled one round differently)."""
        for entry in slot.caches:
            entry.cache.set_view(bucket(prompt[0].shape[1] + 1))
        if drafter is not None:
            drafter.start(prompt)
        # The target reads the columns after a passed cache's (`Slot.prefill_target`).
        hidden = slot.prefill_target()[:, -1]
        taps = slot.take_prompt_taps()
        prefilled = getattr(drafter, "prefilled", None)    # a caller's may not subclass ours
        if prefilled is not None:
            prefilled(prompt, taps)
        if slot.allowed is not None:
            slot.fill_allowed(0)
        return self._finish(slot, slot.sample(hidden), None)

    def _after_step(self, plan, slot: Slot, report: Report, stops) -> None:
        """Host-side work on a step's report: the grammars' texts, stop strings, the streamer,
        the scores kept for `output_scores` / `output_logits`."""
        if stops is not None:
            stops.check(slot, report)
        if slot.allowed is not None:            # after the stops: they cut rows' tokens
            slot.allowed.advance(report)
        if plan.processing is not None:
            plan.processing.record(report.emitted)
        if plan.streamer is not None and report.emitted[0]:
            plan.streamer.put(torch.tensor([t[0] for t in report.tokens[: report.emitted[0]]]))

    def _width(self, slot: Slot, report: Report) -> int:
        """Drafts to verify next: the most any running row may take (its draft count,
        leaving room in its budget for the target's own token)."""
        widths = [min(num, end - length - 1) for num, end, length, done in
                  zip(report.num_drafts, slot.end_list, report.length, report.finished)
                  if not done]
        return max(0, min(max(widths), slot.call_drafts))

    def _step_width(self, slot: Slot, width: int, timed: bool = False) -> int:
        """Positions a verification step checks. Each distinct width is a captured graph,
        so widths come from a short list: a constant schedule's G (fewer drafts only near
        the end of a row's budget), the heuristic schedule's (and a `timed` step's, whose
        drafts `max_time` cut) next power of two. The extra positions verify padding: a few
        more rows in a memory-bound step."""
        if not slot.heuristic and not timed:
            return slot.call_drafts
        return min(1 << (width - 1).bit_length(), slot.call_drafts)

    def graph_key(self, slot: Slot, key, drafter=None) -> tuple:
        """Everything a captured step depends on: its kind (`_step_kind`) and each cache's
        view."""
        return (*self._step_kind(slot, key, drafter), tuple(e.cache.view for e in slot.caches))

    def _step_kind(self, slot: Slot, key, drafter=None) -> tuple:
        """A step's graph key but the KV views: the slot and its buffers' generation, the
        step (a drafter's steps with the drafter's key), the sampler, the kernel flags, the
        schedule, the edits, whether it reads allowed-token masks (and its drafts do), and
        the taps."""
        return (id(slot), slot.generation, drafter, key, self.sampler_kind,
                slot.call_params.kernel_flags(self.head.vocab_size), slot.heuristic,
                slot.edits_key(), slot.allowed is not None, slot.masks_drafts, slot.taps_key())

    def _run_step(self, slot: Slot, key, fn, drafter=None):
        """Run a step (of `drafter`, a drafter key, if given): replay its CUDA graph (captured
        on first use), or call it (always when the call's steps read the host, `Slot.eager`,
        and in an uncompiled call). A call with max_time captures nothing: a step without a graph
        (a KV view the call grew into) runs directly, compiled as the graph's would be."""
        if not self.graphs_enabled or slot.eager or self.uncompiled:
            return fn()
        full_key = self.graph_key(slot, key, drafter)
        if full_key not in self.graphs:
            if self.timed:
                return fn()
            self._drop_stale_graphs(slot)
            self.graphs[full_key] = self._capture(slot, key, fn)
        graph, outputs, _ = self.graphs[full_key]
        self.last_call_steps.add(key)
        if self.step_timer is not None:
            self.step_timer.replay(key, graph)
        else:
            graph.replay()
        return outputs

    def _drop_stale_graphs(self, slot: Slot) -> None:
        """Forget `slot`'s graphs over buffers it has since replaced (their pool memory is
        reused by the next captures)."""
        stale = [key for key in self.graphs if key[0] == id(slot) and key[1] != slot.generation]
        for key in stale:
            self.graph_bytes -= self.graphs.pop(key)[2]

    def _capture(self, slot: Slot, key, fn):
        started = time.perf_counter()
        events_before = len(self.events)
        state = slot.state_tensors()
        saved = [tensor.clone() for tensor in state]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        error = reserved = None
        try:
            with torch.cuda.stream(stream):  # warm-up: compiles, loads kernels, sets up cuBLAS
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            for tensor, value in zip(state, saved):
                tensor.copy_(value)
            # Emptied here as the capture empties it, so that the growth measured is the graph's.
            torch.cuda.empty_cache()
            reserved = torch.cuda.memory_reserved(self.device)
            with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream,
                                  capture_error_mode=self.capture_mode):
                outputs = fn()
        except BaseException as caught:
            error = caught
        grown = 0 if reserved is None else torch.cuda.memory_reserved(self.device) - reserved
        # Ranks agree on a failure before any rank's capture began or after all began: one
        # failing inside the warm-up's collectives leaves the others in them (not covered).
        failed, pool_bytes = self._agreed_capture(error is not None, grown)
        if failed or error is not None:
            if reserved is not None:
                # A capture that fails midway can leave its pool taking allocations for it,
                # and every later capture into that pool fails: the next ones use a new pool.
                self.pool = torch.cuda.graph_pool_handle()
                self._pool_anchor = _anchor(self.pool, self.capture_stream, self.capture_mode)
            reason = (f"{type(error).__name__}: {error}" if error is not None
                      else "on another rank of the tensor-parallel group")
            LOG.warning("capturing %s failed (%s)%s", key, reason,
                        "; graphs continue in a new memory pool" if reserved is not None else "")
            try:
                raise error if error is not None else RuntimeError(
                    f"capturing the step {key!r} failed on another rank of the "
                    "tensor-parallel group (its error is in that rank's output)")
            finally:
                # The error's traceback holds this frame: without this, the two make a cycle
                # that only the garbage collector frees, at any later moment, which may be
                # inside another capture, and freeing the failed graph there can break it.
                error = None
        self.graph_bytes += pool_bytes
        compiling = sum(e.seconds for e in self.events[events_before:])   # its own events
        event = Event("capture", f"{key} for {slot.batch_size} rows, KV views "
                      f"{[e.cache.view for e in slot.caches]}",
                      time.perf_counter() - started - compiling)
        self.events.append(event)
        LOG.info("captured %s in %.2f s", event.what, event.seconds)
        return graph, outputs, pool_bytes

    def _agreed_capture(self, failed: bool, pool_bytes: int) -> tuple[bool, int]:
        """What a tensor-parallel model's ranks decide alike after a capture: whether any
        rank's failed (then every rank drops it and raises: a rank replaying a graph whose
        collectives another rank never runs would wait forever), and the most pool bytes a
        rank's took (which the memory budget's evictions read). Elsewhere, this rank's."""
        if self.head.shards is None:
            return failed, pool_bytes
        agreed = torch.tensor([int(failed), pool_bytes], dtype=torch.int64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.head.shards.group)
        return bool(agreed[0]), int(agreed[1])

    def _finish(self, slot: Slot, hidden, drafts, report: Report | None = None) -> Report:
        """Read the step's report (or take it, read from its host copy); raise on
        non-finite logits; complete flagged rows."""
        report = slot.read_report(_verified(drafts)) if report is None else report
        if any(report.broken):
            raise NonFiniteLogitsError([b for b, x in enumerate(report.broken) if x],
                                       source=slot.drafter_name)
        bad = [b for b, s in enumerate(report.status) if s == samplers.NON_FINITE]
        if bad:
            raise NonFiniteLogitsError(bad)
        excluded = [b for b, s in enumerate(report.status) if s == samplers.NO_TOKEN_LEFT]
        if excluded:
            raise ValueError(f"the call's logit edits leave no token to sample for row "
                             f"{excluded[0]}: `suppress_tokens`, `begin_suppress_tokens`, "
                             "`bad_words_ids`, `no_repeat_ngram_size`, `forced_bos_token_id` / "
                             "`forced_eos_token_id` (which ban every other token) and "
                             "`min_new_tokens` / `min_length` (which ban every `eos_token_id`)"
                             f"{_allowed_names(slot)} ban every token there; transformers' "
                             "sampling fails there too")
        flagged = [b for b, s in enumerate(report.status) if s == samplers.NEEDS_COMPLETION]
        if flagged:
            report = self._complete(slot, hidden, drafts, flagged, report)
        return report

    def _complete(self, slot: Slot, hidden, drafts, flagged: list[int], report: Report) -> Report:
        """Redo the flagged rows exactly through the checked path, then commit them."""
        device = slot.device
        rows = torch.tensor(flagged, device=device)
        sampler = self.target_sampler(slot)
        if drafts is None:
            tokens, logprobs = samplers.complete_sample(sampler, hidden, rows, slot.length,
                                                        slot.step_edits())
            tokens, logprobs = tokens[:, None], logprobs[:, None]
            proposed = torch.ones_like(rows)
            drafted = torch.zeros_like(rows)
            accept_probs = None
        else:
            num_accepted, tokens, logprobs, accept_probs = samplers.complete_verify(
                sampler, hidden, drafts, rows, slot.length, slot.step_edits(drafts))
            proposed = num_accepted + 1
            drafted = (drafts[rows] >= 0).sum(dim=1)
        batch = slot.batch_size

        def full(part, fill):
            return torch.full((batch, *part.shape[1:]), fill, dtype=part.dtype,
                              device=device).index_copy(0, rows, part)

        selected = torch.zeros(batch, dtype=torch.bool, device=device)
        selected[rows] = True
        slot.commit(full(tokens, -1), full(logprobs, 0), full(proposed, 0), full(drafted, 0),
                    torch.zeros(batch, dtype=torch.int32, device=device),
                    schedule=drafts is not None, rows=selected,
                    accept_probs=None if accept_probs is None else full(accept_probs, 0))
        redone = slot.read_report(_verified(drafts))
        for b in flagged:       # the other rows' values are the step's own
            for name in ("emitted", "drafted", "accepted", "status", "broken"):
                getattr(report, name)[b] = getattr(redone, name)[b]
            for step_rows, redone_rows in ((report.tokens, redone.tokens),
                                           (report.accept_probs, redone.accept_probs)):
                for step_row, redone_row in zip(step_rows, redone_rows):
                    step_row[b] = redone_row[b]
        return dataclasses.replace(report, finished=redone.finished, length=redone.length,
                                   num_drafts=redone.num_drafts, fills=redone.fills)


def _stale_masks(slot: Slot, dtype_of) -> bool:
    """Whether a cache of `slot` makes masks of another kind than its decoder's attention
    takes now (boolean for sdpa, additive in the decoder's dtype otherwise, as `Slot.add_cache`
    chose them): the model's attention implementation changed since (say to "eager", for
    `output_attentions`), and eager attention would add a boolean mask to its scores."""
    for entry in slot.caches:
        decoder = entry.runner.decoder
        if decoder is None:
            continue
        wanted = None if decoder.config._attn_implementation == "sdpa" else dtype_of(decoder)
        if entry.cache.mask_dtype != wanted:
            return True
    return False


def _allowed_names(slot: Slot) -> str:
    """The allowed-token functions of the slot's call, for an error message."""
    if slot.allowed is None:
        return ""
    return ", with " + " and ".join(f"`{name}`" for _, name in slot.allowed.sources)


class _HostStops:
    """Stop strings and the caller's `stopping_criteria`, checked on the host after each
    step, token by token as stock's plain decoding checks them: a row whose criterion holds
    after a token inside a step is cut there and finished.

    Stop strings read each row's unpadded tokens (their last `maximum_token_len`); a custom
    criterion gets the row as stock's ``input_ids`` hold it, ``[1, L + t]`` (the left-padded
    prompt and the tokens so far), and ``scores=None``: the fused path forms no logits."""

    def __init__(self, plan, num_rows: int):
        self.strings = plan.stop_criteria
        self.custom = plan.custom_stops
        # Stock's input_ids are the prompts' last columns (none beside inputs_embeds alone).
        mask = plan.attention_mask[:, plan.attention_mask.shape[1] - plan.input_ids.shape[1]:]
        mask = mask.bool().cpu()
        prompts = plan.input_ids.cpu()
        self.rows = [prompts[b][mask[b]].tolist() for b in range(num_rows)]
        self.num_rows = num_rows
        if self.custom is not None:
            # Each row as stock's input_ids hold it, on their device: a criterion reads
            # ``padded[b : b + 1, : width + t]``; a step's tokens arrive in one copy per row.
            width = plan.input_ids.shape[1]
            self.padded = plan.input_ids.new_empty(num_rows, width + min(plan.max_new_tokens, 256))
            self.padded[:, :width] = plan.input_ids[:num_rows]
            self.lengths = [width] * num_rows
        self.tail = self.strings.maximum_token_len if self.strings is not None else 0

    def _stops(self, b: int) -> bool:
        if self.strings is not None and bool(
                self.strings(torch.tensor([self.rows[b][-self.tail:]]), None)[0]):
            return True
        if self.custom is None:
            return False
        try:
            done = self.custom(self.padded[b:b + 1, :self.lengths[b]], None)
        except Exception as error:
            error.add_note("sampler='flash' calls `stopping_criteria` per row and new token with "
                           "that row's input_ids [1, L] and scores=None (the fused kernels form "
                           "no logits)")
            raise
        return bool(done[0]) if torch.is_tensor(done) else bool(done)

    def check(self, slot: Slot, report: Report) -> None:
        cut_rows, cut_lengths = [], []
        for b in range(self.num_rows):
            emitted = report.emitted[b]
            tokens = [report.tokens[j][b] for j in range(emitted)]
            if self.custom is not None and tokens:
                start = self.lengths[b]
                if start + len(tokens) > self.padded.shape[1]:        # doubles as rows grow
                    grown = self.padded.new_empty(self.num_rows, 2 * (start + len(tokens)))
                    grown[:, :self.padded.shape[1]] = self.padded
                    self.padded = grown
                self.padded[b, start:start + len(tokens)] = torch.tensor(tokens)
            for j, token in enumerate(tokens):
                self.rows[b].append(token)
                if self.custom is not None:
                    self.lengths[b] += 1
                if self._stops(b):
                    if j + 1 < emitted or not report.finished[b]:
                        cut_rows.append(b)
                        cut_lengths.append(report.length[b] - emitted + j + 1)
                    report.emitted[b] = j + 1
                    report.finished[b] = True
                    break
        if cut_rows:
            slot.stop_rows(cut_rows, cut_lengths)
            for b, length in zip(cut_rows, cut_lengths):
                report.length[b] = length


def _anchor(pool, stream: torch.cuda.Stream, mode: str) -> "torch.cuda.CUDAGraph":
    """A one-kernel graph in `pool` that lives as long as the engine. The caching allocator
    counts a private pool's live graphs; once the engine has dropped them all (a slot grown,
    evicted) while tensors allocated in the pool still live, capturing into the same pool
    again fails an internal assert (``use_count > 0``). The anchor keeps the count above
    zero, so graphs can be dropped and captured again for as long as the engine lives."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=mode):
        torch.zeros(1, device=stream.device)
    return graph


def _verified(drafts: torch.Tensor | None) -> int:
    """Drafts a step verified: its drafts' columns (0 for a plain step)."""
    return 0 if drafts is None else drafts.shape[1]


def _may_run(report: Report, ends: list[int], num_rows: int, in_flight: int) -> bool:
    """Whether some row may still be running after `in_flight` more steps (each emits at
    least one token for every row it runs and does not flag)."""
    return any(not done and end - length > in_flight for done, end, length
               in zip(report.finished[:num_rows], ends, report.length))


def _width_in_time(width: int, seconds_left: float, per_forward: float | None) -> int:
    """Drafts for a step that must end within `seconds_left` (`max_time`): each draft is a
    drafter forward and the verification one more; without a timed step yet, one draft.
    Fewer drafts never change the tokens (the strict rule), only how many come per step."""
    if per_forward is None:
        return min(width, 1)
    return max(0, min(width, int(seconds_left / per_forward) - 1))


def _max_drafts(plan) -> int:
    """Draft columns a call needs per step."""
    if plan.drafter is None:
        return 0
    wanted = plan.num_drafts if plan.schedule == "constant" else MAX_HEURISTIC_DRAFTS
    return max(0, min(wanted, plan.max_new_tokens - 1))


def _kv_bytes_per_column(decoder: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes one row's KV entry takes over all layers (keys and values)."""
    config = decoder.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * torch.finfo(dtype).bits // 8


def _weight_storage(head) -> tuple:
    """Address and dtype of every tensor an engine reads from the target (the LM-head
    weight and bias, the decoder's parameters), and the head's softcap."""
    tensors = (head.weight, *(() if head.bias is None else (head.bias,)),
               *head.decoder.parameters())
    return (head.softcap, *((tensor.data_ptr(), tensor.dtype) for tensor in tensors))


def _stats(steps: list[Report], num_rows: int) -> SpeculationStats:
    """Speculation statistics, one entry per step and row that was running (0 for a row
    already finished), built from the reports' lists in one pass (a few tensors per call,
    not per step)."""
    running = [True] * num_rows
    counts, probs = [], []
    for report in steps:
        counts.append([[getattr(report, name)[b] if running[b] else 0 for b in range(num_rows)]
                       for name in ("drafted", "accepted", "emitted")])
        probs.append((report.accept_probs, running))
        running = [not done for done in report.finished[:num_rows]]
    table = (torch.tensor(counts, dtype=torch.long).permute(1, 0, 2) if steps
             else torch.zeros(3, 0, num_rows, dtype=torch.long))
    width = int(table[0].max()) if steps else 0
    accept_probs = torch.tensor(
        [[[step_probs[g][b] if was_running and g < len(step_probs) else 0.0 for g in range(width)]
          for b, was_running in enumerate(rows_running)]
         for step_probs, rows_running in probs], dtype=torch.float64).view(len(steps), num_rows, width)
    return SpeculationStats(*table.contiguous(), accept_probs)
