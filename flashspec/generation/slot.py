"""The running state of one batch bucket and the fixed-shape steps that advance it.

A `Slot` holds preallocated device tensors: each row's tokens, left-aligned in ``seq`` (so a
token's column is its sequence position), its length, its end (prompt + max_new_tokens), a
finished flag, its draft count, the drafts of the current step, the sampling parameters, and
the KV caches of the target and of any drafter (`WindowCache`, one per decoder). A step
reads that state, runs a decoder forward and one LM-head operation, and commits the result
back on the device:

* ``prefill`` (eager, the prompt's width varies): feed the prompts, sample one token or
  verify the first drafts;
* ``plain``: feed each row's last token, sample one token;
* ``verify`` (width G): feed the last token and the G drafts a drafter wrote into
  ``drafts``, verify them in one pass, emit the accepted drafts plus one token.

With fused logit edits (`edits`), the slot also holds each row's edit codes, updated by
every commit, and each step hands the kernels its positions' codes (`step_edits`).

Rows never move: the caches roll back by position. Rows that are finished, or that only pad
the batch up to its bucket, stay in the batch, emit nothing and cost a little compute, which
keeps every shape fixed (the prefill, eager, skips the padding rows). The host reads one small report per step (`Report`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..params import SamplingParams
from .compiled import DecoderRunner
from .allowed import unpack
from .cpu import outside_inference_mode
from ..outputs import NO_TOKEN_LEFT, OK
from .edits import EditState, bans_every_token
from .inputs import decoder_inputs, embeddings_instead
from .kv_cache import WindowCache, layer_kinds
from .past import kv_by_column, load_past
from .taps import tap_layers, tapping

MIN_VIEW = 256            # KV columns of the smallest view (and capacity)
# Without CUDA graphs a view costs nothing to change: it grows by this many columns, and
# attention reads fewer dead ones (on CPU, a GQA model's keys are copied per head over all).
EAGER_VIEW_STEP = 32
EOS_SLOTS = 8             # end-of-sequence ids a slot holds before it needs a larger buffer
NO_TOKEN = -2             # fills unused EOS entries: never a token, never the -1 of "none"


def bucket(columns: int) -> int:
    """The power of two, at least `MIN_VIEW`, that holds `columns`."""
    return max(MIN_VIEW, 1 << max(columns - 1, 0).bit_length())


def kv_view(columns: int, graphs: bool) -> int:
    """KV columns a step attends over when it needs `columns`: with graphs a `bucket` (each
    view is a graph), else the next multiple of `EAGER_VIEW_STEP`."""
    if graphs:
        return bucket(columns)
    return -(-columns // EAGER_VIEW_STEP) * EAGER_VIEW_STEP


@dataclasses.dataclass
class Report:
    """What the host reads after a step (one transfer): per row, and each cache's fill."""

    emitted: list
    drafted: list
    accepted: list
    finished: list
    status: list
    broken: list           # the drafter failed (e.g. the assistant's logits were not finite)
    length: list
    num_drafts: list
    fills: list            # per cache: one past its last column the next step still needs
    tokens: list           # [W][B] tokens of the step
    accept_probs: list     # [G][B] p(x) of each draft (float64, sent as its bits)

    FIELDS = 8

    @classmethod
    def read(cls, report: torch.Tensor, num_caches: int, max_drafts: int,
             width: int | None = None) -> "Report":
        """The report of a step that verified `width` drafts (0: a plain step; None: any):
        only its own token and probability rows become Python lists (a slot sized for
        thousands of drafts would otherwise make tens of thousands of objects per step)."""
        tokens_start = cls.FIELDS + num_caches
        probs_start = tokens_start + max_drafts + 1
        width = max_drafts if width is None else width
        report = report.cpu()           # one transfer from a device
        rows = report[:tokens_start + width + 1].tolist()
        probs = report[probs_start:probs_start + width].view(torch.float64).tolist()
        return cls(*rows[: cls.FIELDS], fills=[row[0] for row in rows[cls.FIELDS:tokens_start]],
                   tokens=rows[tokens_start:], accept_probs=probs)


class PendingReport:
    """A step's report on its way to host memory (`Slot.copy_report`): `read` waits for it."""

    def __init__(self, host: torch.Tensor, done, num_caches: int, max_drafts: int,
                 width: int | None):
        self.host, self.done = host, done
        self.num_caches, self.max_drafts, self.width = num_caches, max_drafts, width

    def read(self) -> Report:
        if self.done is not None:
            self.done.synchronize()
        return Report.read(self.host, self.num_caches, self.max_drafts, self.width)


class PendingDrafts:
    """A step's drafts on their way to host memory (`Slot.copy_drafts`)."""

    def __init__(self, host: torch.Tensor, done):
        self.host, self.done = host, done

    def read(self) -> list[list[int]]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


class _Cache:
    """A decoder's runner and its cache in the slot; `refeed`: how many of a row's last
    tokens the decoder's next step feeds again (so their entries may be dropped)."""

    def __init__(self, runner: DecoderRunner, cache: WindowCache, refeed: int):
        self.runner, self.cache, self.refeed = runner, cache, refeed


class Slot:
    """State of `batch_size` rows with KV caches of `capacity` columns and room for
    `max_drafts` drafts per step."""

    def __init__(self, engine, batch_size: int, capacity: int, max_drafts: int):
        self.engine = engine
        self.device = engine.device
        self.batch_size = batch_size
        self.rows = batch_size                    # the call's own rows; the rest pad the bucket
        self.capacity = capacity
        self.max_drafts = max_drafts
        self.caches: list[_Cache] = []
        self.drafters: dict = {}                  # drafter key -> AttachedDrafter
        self.drafter_name = "the drafter"         # the call's, in messages
        self.generation = 0                       # bumped when buffers are replaced
        long = dict(dtype=torch.long, device=self.device)
        self.prompt_length = torch.zeros(batch_size, **long)
        # Positions before which `seq` holds no token known to the call (prompt columns given
        # as embeddings or by a passed cache only): prompt lookup does not search them.
        self.known_from = torch.zeros(batch_size, **long)
        self.token_types = False                  # the call's forwards take token types
        # The target's prefill: (ids, positions, live, the model's position ids or None)
        self._target_prompt = None
        self._prompt_embeds = None                # ... its embeddings, if given
        self._past_columns = 0                    # ... and the columns a passed cache held
        self.length = torch.zeros(batch_size, **long)
        self.end = torch.zeros(batch_size, **long)
        self.finished = torch.zeros(batch_size, dtype=torch.bool, device=self.device)
        self.num_drafts = torch.zeros(batch_size, **long)
        self.eos = torch.full((EOS_SLOTS,), NO_TOKEN, **long)
        self.params = SamplingParams.create(batch_size, device=self.device)
        self.call_params = self.params
        self.processing = None                    # the call's `LogitsProcessing`, if any
        self.allowed = None                       # the call's `AllowedTokens`, if any
        # Each position's allowed tokens for the next step, int32 [B, max_drafts + 1, words]
        # (`fill_allowed`, on the host before the step), once a call had masks (`mask_words`
        # words per mask; 0: none yet): the steps read it, so that they stay captured.
        self.mask_words = 0
        self.allowed_masks: torch.Tensor | None = None
        self.host_masks: torch.Tensor | None = None
        self.step_hidden: torch.Tensor | None = None
        self.host_drafts: torch.Tensor | None = None
        self.drafts_copied = None                 # `copy_drafts`' CUDA event, once made
        self.edit_state: EditState | None = None  # fused edits' buffers, once a call had edits
        self.edits: EditState | None = None       # the call's fused edits, if any
        self.heuristic = False
        # Target layers whose input hidden states the call's drafter reads (`taps`): each
        # target step copies them into `taps` [B, max_drafts + 1, n * D], its columns from
        # position `tap_position` [B] on; the prefill's, all of the prompt's, into
        # `prompt_taps` until the drafter took them.
        self.tap_layers: tuple[int, ...] = ()     # those the buffers hold
        self.call_taps: tuple[int, ...] = ()      # the call's (empty: no taps)
        self._tap_stack = None                    # the target's layer stack, found once
        self.taps: torch.Tensor | None = None
        self.tap_position = torch.zeros(batch_size, **long)
        self.prompt_taps: torch.Tensor | None = None
        # A one-token step feeds its token and a dead copy (see `compiled`): live flags.
        self.one_live = torch.tensor([[True, False]], device=self.device).repeat(batch_size, 1)
        self._allocate_columns()
        self.add_cache(engine.target.decoder, "model", refeed=1)

    def _allocate_columns(self) -> None:
        """The buffers whose width follows the capacity or the draft count (their tokens
        and logprobs kept)."""
        batch, long = self.batch_size, dict(dtype=torch.long, device=self.device)
        seq_columns = self.capacity + self.max_drafts + 1
        old = (self.seq, self.logprobs) if hasattr(self, "seq") else None
        self.seq = torch.zeros(batch, seq_columns, **long)
        self.logprobs = torch.zeros(batch, seq_columns, dtype=torch.float32, device=self.device)
        if old is not None:
            kept = min(seq_columns, old[0].shape[1])
            self.seq[:, :kept] = old[0][:, :kept]
            self.logprobs[:, :kept] = old[1][:, :kept]
        self.drafts = torch.full((batch, self.max_drafts), -1, **long)
        self.draft_failed = torch.zeros(batch, self.max_drafts, dtype=torch.bool, device=self.device)
        if self.mask_words:
            shape = (batch, self.max_drafts + 1, self.mask_words)
            self.allowed_masks = torch.full(shape, -1, dtype=torch.int32, device=self.device)
            # Where the host writes them; pinned, so that the copy is asynchronous.
            self.host_masks = torch.empty(shape, dtype=torch.int32,
                                          pin_memory=self.device.type == "cuda")
            # A split step's hidden states (`plain_forward`, `verify_forward`; in the LM
            # head's dtype, the rounding the head's step applies anyway) and its drafts' host
            # copy (`copy_drafts`): the steps of calls whose masks come from the host's
            # reports are split.
            weight = self.engine.head.weight
            self.step_hidden = torch.zeros(batch, self.max_drafts + 1, weight.shape[1],
                                           dtype=weight.dtype, device=self.device)
            self.host_drafts = torch.empty(batch, self.max_drafts, dtype=torch.long,
                                           pin_memory=self.device.type == "cuda")
        if self.tap_layers:
            old_taps, width = self.taps, self._tap_width(self.tap_layers)
            self.taps = torch.zeros(batch, self.max_drafts + 1, width,
                                    dtype=self.engine.dtype_of(self.engine.head.decoder),
                                    device=self.device)
            if old_taps is not None and old_taps.shape[-1] == width:    # a call growing
                kept = min(old_taps.shape[1], self.taps.shape[1])
                self.taps[:, :kept] = old_taps[:, :kept]
        self.generation += 1

    def _tap_width(self, layers: tuple[int, ...]) -> int:
        return len(layers) * self.engine.head.decoder.config.get_text_config().hidden_size

    def use_taps(self, layers: tuple[int, ...]) -> None:
        """This call's drafter reads the hidden states entering the target's `layers`
        (`taps`; empty: none): buffers for them, made anew when the layers change."""
        self.call_taps = tuple(layers)
        if self.call_taps and self._tap_stack is None:
            self._tap_stack = tap_layers(self.target.runner.decoder, self.call_taps)
        if self.call_taps and self.call_taps != self.tap_layers:
            self.tap_layers = self.call_taps
            self._allocate_columns()

    def taps_key(self) -> tuple[int, ...]:
        """The target layers the call's target steps copy (for the engine's graph key)."""
        return self.call_taps

    def _tapping(self, sink: torch.Tensor | None):
        """Inside, the target's forwards copy the call's taps into `sink` (nothing without
        taps)."""
        if not self.call_taps:
            return contextlib.nullcontext()
        return tapping(self.target.runner.decoder, self._tap_stack, self.call_taps, sink)

    # ---- what the slot holds -----------------------------------------------------------

    def add_cache(self, decoder: torch.nn.Module, role: str, refeed: int):
        """A KV cache for `decoder` in this slot; returns its runner and cache."""
        runner = self.engine.runner(decoder, role)
        config = decoder.config
        mask_dtype = None if config._attn_implementation == "sdpa" else self.engine.dtype_of(decoder)
        cache = WindowCache(self.batch_size, self.capacity, self.device, layer_kinds(config),
                            mask_dtype)
        self.caches.append(_Cache(runner, cache, refeed))
        self._resize_report()
        return runner, cache

    def _resize_report(self) -> None:
        rows = Report.FIELDS + len(self.caches) + (self.max_drafts + 1) + self.max_drafts
        self.report = torch.zeros(rows, self.batch_size, dtype=torch.long, device=self.device)
        self.host_reports = None    # `copy_report`'s, made at its first use
        self.generation += 1

    def attached(self, drafter):
        """`drafter` attached to this slot (once; later calls share the attachment), with
        this call's settings."""
        if drafter.key not in self.drafters:
            self.drafters[drafter.key] = drafter.attach(self)
        attached = self.drafters[drafter.key]
        use = getattr(attached, "use", None)      # a caller's drafter may not subclass ours
        if use is not None:
            use(drafter)
        return attached

    def sampler(self, weight: torch.Tensor, shards=None):
        """The LM-head operations on `weight` (this rank's rows with `shards`) for this
        slot's rows (their parameters are the slot's buffers, with the current call's kernel
        flags)."""
        return self.engine.sampler(weight, self, shards=shards)

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor a step writes besides the KV entries (which a step rewrites with the
        same values): what a graph capture's warm-up run must leave as it found it."""
        drafter_state = [t for attached in self.drafters.values() for t in attached.state_tensors()]
        edit_state = self.edits.tensors() if self.edits is not None else []
        taps = [self.taps, self.tap_position] if self.taps is not None else []
        return [self.seq, self.logprobs, self.length, self.finished, self.num_drafts, self.drafts,
                self.draft_failed, self.report, *drafter_state, *edit_state, *taps,
                *([self.allowed_masks, self.step_hidden] if self.allowed_masks is not None
                  else []),
                *(t for entry in self.caches
                  for t in (entry.cache.live, entry.cache.position, entry.cache.key_index))]

    def nbytes(self) -> int:
        tensors = [self.seq, self.logprobs, self.drafts, self.draft_failed, self.report,
                   *([self.taps] if self.taps is not None else []),
                   *([self.allowed_masks, self.step_hidden] if self.allowed_masks is not None
                     else [])]
        edit_bytes = self.edit_state.nbytes() if self.edit_state is not None else 0
        return (sum(t.numel() * t.element_size() for t in tensors) + edit_bytes
                + sum(entry.cache.nbytes() for entry in self.caches))

    @property
    def target(self) -> _Cache:
        return self.caches[0]

    # ---- room ----------------------------------------------------------------------------

    def ensure_room(self, report: Report, columns: int) -> None:
        """Make every cache able to write `columns` more entries after what the next step
        keeps: compact a cache whose holes leave too little, grow the slot when even its live
        entries do not fit; then set the caches' view (one for all of them: fewer graphs).
        Outside inference mode (in which the CPU's decode loop runs, `cpu.decode_steps`):
        the buffers it makes outlive the call."""
        with outside_inference_mode():
            self._make_room(report, columns)

    def _make_room(self, report: Report, columns: int) -> None:
        fills = list(report.fills)
        for index, entry in enumerate(self.caches):
            if fills[index] + columns > self.capacity:
                entry.cache.drop_from(self.length - entry.refeed)
                entry.cache.compact()
                fills[index] = int(entry.cache.last_live_column())
        needed = max(fills) + columns
        if needed > self.capacity:
            self.engine.grow(self, bucket(needed))
        view = kv_view(needed, self.engine.graphs_enabled)
        for entry in self.caches:
            entry.cache.set_view(view)

    def grow(self, capacity: int) -> None:
        """Larger buffers for every cache, the token columns and the call's n-gram context
        (graphs are captured anew)."""
        self.capacity = capacity
        self._allocate_columns()
        for entry in self.caches:
            entry.cache.grow(capacity)
        if self.edits is not None:
            self.edits.grow_context(self.prompt_width + self.seq.shape[1])
        self._resize_report()

    def widen(self, max_drafts: int) -> None:
        """Room for `max_drafts` drafts per step."""
        self.max_drafts = max_drafts
        self._allocate_columns()
        self._resize_report()

    # ---- a call --------------------------------------------------------------------------

    def load(self, plan, call_drafts: int) -> tuple:
        """Reset the state for `plan`'s rows (the same buffers, so that captured graphs stay
        valid); rows past the plan's batch pad the bucket and are finished from the start.
        `call_drafts`: the most drafts the call verifies per step. Returns the prompt as a
        drafter reads it (`AttachedDrafter.start`): ids, positions and live flags ``[B, L]``,
        the columns whose ids the call does not know (given as embeddings, or by a passed
        cache only) dead. Each live column is at position ``mask.cumsum(-1) - 1``; a dead one
        at the next live column's (so that no forward from there drops a live entry; a
        right-padded row's last column, whose query gives its first token, sees all of its
        prompt); `seq` holds the live tokens by position. The model takes stock's position
        ids (`plan._stock_positions`): the prefill's as they are, the new tokens' as their
        cache positions plus the row's offset (`WindowCache.model_positions`, nonzero for a
        right-padded row). A passed cache (`plan.past_key_values`) is read
        into the target's cache here; the target's prefill (`prefill_target`) feeds the
        columns after it."""
        rows, width = plan.attention_mask.shape
        pad = self.batch_size - rows
        mask = plan.attention_mask.long()
        stock_ids = plan.input_ids              # stock's input_ids: the last columns' ids
        unknown = width - stock_ids.shape[1]
        input_ids = torch.cat([stock_ids.new_full((rows, unknown), plan.pad_token_id), stock_ids],
                              dim=1)
        if pad:
            input_ids = torch.cat([input_ids, input_ids[:1].expand(pad, -1)])
            stock_ids = torch.cat([stock_ids, stock_ids[:1].expand(pad, -1)])
            mask = torch.cat([mask, mask[:1].expand(pad, -1)])
        live = mask.bool()
        self.prompt_length.copy_(mask.sum(dim=1))
        self.known_from.copy_(mask[:, :unknown].sum(dim=1))
        order = torch.sort((~live).to(torch.int8), dim=1, stable=True).indices
        by_position = torch.where(torch.arange(width, device=self.device)[None, :]
                                  < self.prompt_length[:, None], input_ids.gather(1, order), 0)
        self.seq.zero_()
        self.seq[:, :width] = by_position
        self.logprobs.zero_()
        self.length.copy_(self.prompt_length)
        self.end.copy_(self.prompt_length + plan.max_new_tokens)
        self.end_list = self.end.tolist()
        self.call_drafts = call_drafts
        self.rows = rows
        self.finished.copy_(torch.arange(self.batch_size, device=self.device) >= rows)
        self.num_drafts.fill_(plan.num_drafts)
        if plan.eos_token_ids is not None and plan.eos_token_ids.numel() > self.eos.numel():
            self.eos = torch.full((plan.eos_token_ids.numel(),), NO_TOKEN, dtype=torch.long,
                                  device=self.device)
            self.generation += 1
        self.eos.fill_(NO_TOKEN)
        if plan.eos_token_ids is not None:
            self.eos[: plan.eos_token_ids.numel()] = plan.eos_token_ids
        params = plan.params
        if pad:
            params = params.select(torch.cat([torch.arange(rows), torch.zeros(pad, dtype=torch.long)]),
                                   validate=False)
        for name in ("do_sample", "temperature", "top_k", "top_p", "min_p", "seed"):
            getattr(self.params, name).copy_(getattr(params, name))
        self.call_params = _with_flags(self.params, params)
        self.processing = plan.processing
        self.allowed = plan.allowed
        if self.allowed is not None and not self.mask_words:
            self.mask_words = -(-self.engine.head.vocab_size // 32)
            self._allocate_columns()
        self._load_edits(plan.edits, stock_ids, plan.additive)
        self.heuristic = plan.schedule == "heuristic" and plan.drafter is not None
        self.use_taps(getattr(plan.drafter, "taps", ()) if plan.drafter is not None else ())
        self.token_types = plan.token_type_ids is not None
        # Position ids as stock feeds them (`plan._stock_positions`): the prefill's are stock's;
        # each row continues from its last column's (a right-padded row's: a padding
        # column's), its new tokens from cache position `prompt_length` on.
        model_positions = plan.prompt_positions
        offset = torch.zeros_like(self.prompt_length)
        if model_positions is not None:
            model_positions = model_positions.to(self.device).long()
            if pad:
                model_positions = torch.cat([model_positions, model_positions[:1].expand(pad, -1)])
            offset = model_positions[:, -1] + 1 - self.prompt_length
        for entry in self.caches:
            entry.cache.reset()
            entry.cache.set_offsets(offset, self.prompt_length)
        positions = mask.cumsum(dim=1) - mask
        self._target_prompt = (input_ids, positions, live, model_positions)
        self._prompt_embeds = plan.inputs_embeds
        self._past_columns = plan.past_length
        if plan.past_length:
            columns = plan.past_length
            decoder = self.target.runner.decoder
            load_past(self.target.cache, plan.past_key_values, columns, positions[:rows, :columns],
                      live[:rows, :columns], decoder, self.engine.dtype_of(decoder))
        known = torch.arange(width, device=self.device)[None, :] >= unknown
        return input_ids, positions, live & known

    def _load_edits(self, rules, input_ids: torch.Tensor, additive=None) -> None:
        """The call's fused edits (`edits.EditRules`, or None; `additive.AdditiveEdits`, or
        None) for the padded prompts `input_ids`. Steps with and without edits, with and
        without position bans, read the same buffers and differ in the graph key
        (`edits_key`), so their graphs live side by side; a call that needs other buffers
        for its bad words bumps the buffers' generation, so its steps are captured anew."""
        if rules is not None and self.edit_state is None:
            self.edit_state = EditState(self.batch_size, self.engine.head.vocab_size, self.device)
        edits = self.edit_state if rules is not None else None
        self.prompt_width = input_ids.shape[1]
        if edits is not None and edits.load(rules, input_ids, additive, self.seq.shape[1]):
            self.generation += 1
        self.edits = edits

    def edits_key(self) -> tuple | None:
        """What the steps' captured work depends on in the call's fused edits (None without):
        for the engine's graph key."""
        if self.edits is None:
            return None
        return self.edits.key()

    @property
    def eager(self) -> bool:
        """Whether the call's steps read the host (the materialized path) or take token
        types (`inputs.TokenTypes`, a hook no graph records), so that they run without CUDA
        graphs."""
        return self.processing is not None or self.token_types

    @property
    def masks_drafts(self) -> bool:
        """Whether a drafter that reads masks (`AttachedDrafter.reads_masks`) gets them:
        the call's masks come from the host's reports alone (`AllowedTokens.from_host`)."""
        return self.allowed is not None and self.allowed.from_host

    def fill_allowed(self, width: int, filled: int = 0,
                     drafts: list[list[int]] | None = None) -> None:
        """On the host, before a step: the call's allowed tokens (`AllowedTokens.bitmask`)
        at the positions of the step verifying `width` drafts (0: sampling one token), into
        `allowed_masks`, which the step reads. Reads the slot's state and drafts (a host
        sync; only the drafts where the masks come from the host's reports, and not those
        given as `drafts`: `host_verified_drafts`'s). `filled`: the first positions, whose
        masks the drafter's steps had (`fill_draft_masks`): they stay, and are not copied
        again."""
        if self.allowed.from_host:
            if drafts is None and width:
                drafts = self.verified_drafts(width).tolist()
            self.allowed.host_masks(drafts, width + 1, self.host_masks, resume=filled > 0)
            masks = self.host_masks
        else:
            masks = self.allowed.bitmask(self, self.verified_drafts(width) if width else None,
                                         width + 1)
        first = min(filled, width + 1)
        self.allowed_masks[:, first: width + 1].copy_(masks[:, first: width + 1],
                                                      non_blocking=True)

    def copy_drafts(self, width: int) -> "PendingDrafts":
        """Start copying the drafters' first `width` drafts per row to host memory (after
        the drafter's steps, in stream order), for a split step's masks: the host reads
        them (`PendingDrafts.read`) while the target's forward runs."""
        # A contiguous destination: into a strided one the copy would go through an unpinned
        # buffer, and wait for the device.
        host = self.host_drafts.view(-1)[: self.batch_size * width].view(self.batch_size, width)
        host.copy_(self.drafts[:, :width], non_blocking=True)
        if self.device.type == "cuda":
            # One event serves every step: the host reads a step's drafts before the next
            # step copies its own.
            if self.drafts_copied is None:
                self.drafts_copied = torch.cuda.Event()
            self.drafts_copied.record()
        return PendingDrafts(host, self.drafts_copied)

    def host_verified_drafts(self, drafts: list[list[int]], report: Report) -> list[list[int]]:
        """`verified_drafts` on the host: each row's `drafts` (`copy_drafts`'s), -1 past its
        draft count and budget and on finished rows, as `report` (the last step's, the state
        the verification reads) gives them."""
        verified = []
        for b, row in enumerate(drafts):
            count = 0 if report.finished[b] else min(report.num_drafts[b],
                                                     self.end_list[b] - report.length[b] - 1)
            verified.append([draft if j < count else -1 for j, draft in enumerate(row)])
        return verified

    def draft_allowed(self, column: torch.Tensor) -> torch.Tensor | None:
        """Inside a drafter's step: bool ``[B, V]``, the tokens allowed at draft `column`
        (``[1]``, on the device) as `fill_draft_masks` left them, where `masks_drafts`;
        else None."""
        if not self.masks_drafts:
            return None
        masks = self.allowed_masks.index_select(1, column)[:, 0]
        return unpack(masks, self.engine.head.vocab_size)

    def fill_draft_masks(self, column: int) -> None:
        """On the host, before the drafter's step writing draft `column`: that position's
        allowed tokens into `allowed_masks[:, column]`, after the drafts before it (read
        from the device: a host sync)."""
        previous = self.drafts[:, column - 1].tolist() if column else None
        self.allowed.draft_masks(column, previous, self.host_masks)
        self.allowed_masks[:, column].copy_(self.host_masks[:, column], non_blocking=True)

    def step_edits(self, drafts: torch.Tensor | None = None):
        """The fused edits (`LogitEdits`, or None without) of the rows' next token, or with
        `drafts` ``[B, G]`` of the positions verifying them, the call's allowed-token masks
        (`fill_allowed`'s) included: a step's own, and after it those of the rows it flagged
        for completion (`samplers.complete_sample` / `complete_verify`; they emitted nothing,
        their masks are the step's)."""
        if self.edits is None:
            return None
        generated = self.length - self.prompt_length
        width = 1 if drafts is None else drafts.shape[1] + 1
        allowed = self.allowed_masks[:, :width] if self.allowed is not None else None
        if drafts is None:
            return self.edits.sample_edits(generated, allowed)
        return self.edits.verify_edits(generated, drafts, allowed)

    def forward_prompt(self, runner: DecoderRunner, cache: WindowCache, input_ids: torch.Tensor,
                       positions: torch.Tensor, live: torch.Tensor,
                       model_positions: torch.Tensor | None = None,
                       inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Eager forward of the prompts over the call's own rows (`inputs`: the decoder's
        other inputs, ``[B, L, ...]``): rows that only pad the bucket emit nothing, and
        reading a prompt would cost as much for them as for a real row. Their hidden states
        are zeros."""
        rows = self.rows
        hidden = runner.forward(cache, input_ids[:rows], positions[:rows], live[:rows],
                                None if model_positions is None else model_positions[:rows],
                                None if inputs is None else {name: tensor[:rows] for name, tensor
                                                             in inputs.items()})
        if rows == self.batch_size:
            return hidden
        return torch.cat([hidden, hidden.new_zeros(self.batch_size - rows, *hidden.shape[1:])])

    def prefill_target(self) -> torch.Tensor:
        """The target's prefill (eager): the prompt's columns after those a passed cache held
        (`load`), their embeddings instead of their ids when the call gave `inputs_embeds`.
        Returns the hidden states ``[B, n, D]``."""
        start = self._past_columns
        ids, positions, live, model_positions = (None if t is None else t[:, start:]
                                                 for t in self._target_prompt)
        target = self.target
        embeds = self._prompt_embeds
        self._target_prompt = self._prompt_embeds = None      # the slot outlives the call
        supply = None if embeds is None else embeddings_instead(embeds[: self.rows, start:])
        sink = None
        if self.call_taps:
            sink = self.taps.new_zeros(self.batch_size, start + ids.shape[1], self.taps.shape[-1])
        with decoder_inputs(target.runner.decoder, supply), self._tapping(
                None if sink is None else sink[:, start:]):
            hidden = self.forward_prompt(target.runner, target.cache, ids, positions, live,
                                         model_positions)
        if sink is not None:
            self._prompt_taps_taken(sink, positions, live, start)
        return hidden

    def _prompt_taps_taken(self, sink: torch.Tensor, positions: torch.Tensor,
                           live: torch.Tensor, start: int) -> None:
        """After the prefill: its taps ``[B, L, n * D]`` (zeros in the columns a passed cache
        held) in `prompt_taps`, for the drafter (`AttachedDrafter.prefilled`); each row's
        last prompt position's in the first column of `taps`, where the first step's drafter
        reads them (zeros for a row whose last prompt column the passed cache held)."""
        self.prompt_taps = sink
        last = self.prompt_length - 1
        at_last = (positions == last[:, None]) & live
        column = start + at_last.int().argmax(dim=1)
        rows = torch.arange(self.batch_size, device=self.device)
        self.taps.zero_()
        self.taps[:, 0] = torch.where(at_last.any(dim=1)[:, None], sink[rows, column], 0)
        self.tap_position.copy_(last)

    def take_prompt_taps(self) -> torch.Tensor | None:
        """The prefill's taps (`_prompt_taps_taken`), once."""
        taps, self.prompt_taps = self.prompt_taps, None
        return taps

    def returned_kv(self, plan, new_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The target's keys and values of the call's rows as stock's returned cache holds
        them (`past.kv_by_column`), per layer ``[rows, H, L + new_tokens - 1, D]``: the
        prompt's columns (zeros where padding), then the new tokens' but the last. First one
        eager forward of what stock feeds and the engine never did: for a row that ended
        before `new_tokens`, its last token and the padding after it (at the positions that
        follow, as stock feeds a finished row)."""
        rows = self.rows
        width = plan.attention_mask.shape[1]
        length = self.length[:rows]
        missing = (new_tokens - (length - self.prompt_length[:rows])).clamp_min(0)
        tail = int(missing.max()) if rows else 0
        target = self.target
        vocab = target.runner.decoder.get_input_embeddings().num_embeddings
        if tail > 1 and not 0 <= plan.pad_token_id < vocab:
            raise ValueError(
                f"`pad_token_id`={plan.pad_token_id} is not a token of the model's vocabulary "
                f"[0, {vocab}), but a row ended before the others and the call hands back or "
                "updates `past_key_values`, which holds the entries of the padding tokens stock "
                "feeds a finished row (stock's forward fails on them too); pass a pad_token_id "
                "in the vocabulary")
        if tail:
            self.ensure_room(_Fills([int(self._fill(entry)) for entry in self.caches]), tail + 1)
            columns = torch.arange(tail, device=self.device)
            first = length - 1
            # Dead columns (a row's past its own tail) stay at its last position fed.
            positions = torch.minimum(first[:, None] + columns,
                                      (first + (missing - 1).clamp_min(0))[:, None])
            last_token = self.seq[:rows].gather(1, first[:, None])
            tokens = torch.where(columns[None, :] == 0, last_token, plan.pad_token_id)
            target.runner.forward(target.cache, tokens, positions,
                                  columns[None, :] < missing[:, None])
        mask = plan.attention_mask.to(self.device).long()
        prompt = torch.where(mask.bool(), mask.cumsum(dim=1) - 1, -1)
        generated = self.prompt_length[:rows, None] + torch.arange(new_tokens, device=self.device)
        column_positions = torch.cat([prompt, generated], dim=1)[:, : width + new_tokens - 1]
        return kv_by_column(target.cache, rows, column_positions)

    # ---- steps (fixed shapes, no host reads: captured on CUDA) ---------------------------

    def plain(self) -> torch.Tensor:
        return self.sample(self._plain_forward())

    def _plain_forward(self) -> torch.Tensor:
        """The target's hidden states ``[B, D]`` after each row's last token."""
        target = self.target
        # A compiled forward takes two tokens or more: the token and a dead copy. An eager one
        # takes the token alone (on CPU a second row of every matmul costs 1.7x the first).
        fed = 2 if target.runner.compile and not target.runner.eager else 1
        positions = (self.length - 1)[:, None].repeat(1, fed)
        with self._tapping(self.taps):
            hidden = target.runner.step(target.cache, self.seq.gather(1, positions), positions,
                                        self.one_live[:, :fed])
        if self.call_taps:
            self.tap_position.copy_(positions[:, 0])
        return hidden[:, 0]

    # A split step (`Engine._target_forward`, `_target_head`): the decoder's forward, then
    # the LM head's step, two graphs, between which the host fills the step's masks;
    # `step_hidden` carries the forward's hidden states from one to the other.

    def plain_forward(self) -> None:
        """`plain`'s forward, its hidden states into `step_hidden`."""
        self.step_hidden[:, 0].copy_(self._plain_forward())

    def plain_head(self) -> torch.Tensor:
        """`plain`'s sampling, from `step_hidden`."""
        return self.sample(self.step_hidden[:, 0])

    def sample(self, hidden: torch.Tensor) -> torch.Tensor:
        """Sample one token per row from the target's last hidden states and commit it."""
        sampler = self.engine.target_sampler(self)
        hidden = hidden.to(sampler.weight.dtype)
        if self.edits is None:
            tokens, logprobs, status = sampler.sample(hidden, self.length)
        else:
            edits = self.step_edits()
            tokens, logprobs, status = sampler.sample(hidden, self.length, edits=edits)
            status = self._unless_all_banned(status, edits, tokens)
        self.commit(tokens[:, None], logprobs[:, None], torch.ones_like(self.length),
                    torch.zeros_like(self.length), status)
        return hidden

    def verified_drafts(self, width: int) -> torch.Tensor:
        """``[B, width]``: the drafts a verification of `width` checks, -1 past each row's
        draft count and budget (none on finished rows)."""
        return self._verify_drafts(width)[0]

    def _within(self, width: int) -> torch.Tensor:
        columns = torch.arange(width, device=self.device)
        allowed = torch.minimum(self.num_drafts, self.end - self.length - 1)
        allowed = torch.where(self.finished, 0, allowed)
        return columns[None, :] < allowed[:, None]

    def verify(self, width: int):
        """Verify `width` drafts per row (``drafts[:, :width]``) after the row's last token."""
        drafts, within = self._verify_drafts(width)
        return self._verify_head(self._verify_forward(drafts, within), drafts, within)

    def verify_forward(self, width: int) -> None:
        """`verify`'s forward, its hidden states into `step_hidden`."""
        self.step_hidden[:, : width + 1].copy_(self._verify_forward(*self._verify_drafts(width)))

    def verify_head(self, width: int):
        """`verify`'s verification, from `step_hidden`."""
        return self._verify_head(self.step_hidden[:, : width + 1], *self._verify_drafts(width))

    def _verify_drafts(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafts the verification checks (`verified_drafts`) and which columns a row
        drafts."""
        within = self._within(width)
        return torch.where(within, self.drafts[:, :width], -1), within

    def _verify_forward(self, drafts: torch.Tensor, within: torch.Tensor) -> torch.Tensor:
        """The target's hidden states ``[B, G + 1, D]`` at each row's last token and its
        `drafts` ``[B, G]`` (`_verify_drafts`)."""
        width = drafts.shape[1]
        columns = torch.arange(width, device=self.device)
        # Padding (columns a row does not draft) stays out of the cache, at positions within
        # the row's budget: past it, a learned position table could end.
        draft_positions = torch.minimum(self.length[:, None] + columns, (self.end - 1)[:, None])
        target = self.target
        last = (self.length - 1)[:, None]          # with the drafts, two columns or more
        with self._tapping(self.taps):
            hidden = target.runner.step(
                target.cache, torch.cat([self.seq.gather(1, last), drafts.clamp_min(0)], dim=1),
                torch.cat([last, draft_positions], dim=1),
                torch.cat([torch.ones_like(last, dtype=torch.bool), within], dim=1))
        if self.call_taps:
            self.tap_position.copy_(last[:, 0])
        return hidden[:, -(width + 1):]

    def _verify_head(self, hidden: torch.Tensor, drafts: torch.Tensor, within: torch.Tensor):
        broken = (self.draft_failed[:, : drafts.shape[1]] & within).any(dim=1)
        sampler = self.engine.target_sampler(self)
        hidden = hidden.to(sampler.weight.dtype)
        if self.edits is None:
            num_accepted, tokens, logprobs, accept_probs, status = sampler.verify(
                hidden, drafts, self.length)
        else:
            edits = self.step_edits(drafts)
            num_accepted, tokens, logprobs, accept_probs, status = sampler.verify(
                hidden, drafts, self.length, edits=edits)
            status = self._unless_all_banned(status, edits, tokens)
        self.commit(tokens, logprobs, num_accepted + 1, (drafts >= 0).sum(dim=1), status,
                    broken, schedule=True, accept_probs=accept_probs)
        return hidden, drafts

    def _unless_all_banned(self, status: torch.Tensor, edits, tokens: torch.Tensor):
        """`status` with `NO_TOKEN_LEFT` for the sampled rows whose edits ban every token
        (`edits.bans_every_token`), which transformers' sampling refuses."""
        banned = bans_every_token(edits, tokens, ~self.call_params.is_greedy)
        return torch.where(banned & (status == OK), NO_TOKEN_LEFT, status).to(status.dtype)

    def commit(self, tokens: torch.Tensor, logprobs: torch.Tensor, proposed: torch.Tensor,
               drafted: torch.Tensor, status: torch.Tensor, broken: torch.Tensor | None = None,
               schedule: bool = False, rows: torch.Tensor | None = None,
               accept_probs: torch.Tensor | None = None) -> None:
        """Append each row's emitted tokens (cut at its budget and first EOS), update its
        flags and draft count, and write the report (with the drafts' `accept_probs`).
        Rows that are finished, flagged by `status`, or (with `rows`) not listed emit
        nothing."""
        running = ~self.finished
        ok = running & (status == 0)
        if rows is not None:
            ok &= rows
        width = tokens.shape[1]
        columns = torch.arange(width, device=self.device)
        emitted = torch.where(ok, torch.minimum(proposed, self.end - self.length), 0)
        # A comparison with every EOS id, not torch.isin: for some sizes isin sorts and reads
        # the host, which no CUDA graph capture may do.
        is_end = (tokens[..., None] == self.eos).any(dim=-1)
        emitted, has_end = cut_at_first_end(emitted, is_end)
        index = (self.length[:, None] + columns[None, :]).clamp_max(self.seq.shape[1] - 1)
        write = columns[None, :] < emitted[:, None]
        self.seq.scatter_(1, index, torch.where(write, tokens, self.seq.gather(1, index)))
        if self.edits is not None:
            self.edits.absorb(tokens, write)
        self.logprobs.scatter_(1, index, torch.where(write, logprobs.float(),
                                                     self.logprobs.gather(1, index)))
        self.length += emitted
        self.finished |= ok & (has_end | (self.length >= self.end))
        accepted = torch.where(ok, proposed - 1, 0)
        drafted = torch.where(ok, drafted, 0)
        if schedule and self.heuristic:
            stepped = heuristic_draft_counts(self.num_drafts, accepted, drafted)
            self.num_drafts.copy_(torch.where(ok, stepped, self.num_drafts))
        fills = torch.stack([self._fill(entry) for entry in self.caches])
        fill_rows = fills[:, None].expand(-1, len(ok))
        broken = torch.zeros_like(ok) if broken is None else broken & ok
        tokens_rows = torch.full((self.max_drafts + 1, len(ok)), -1, dtype=torch.long,
                                 device=self.device)
        tokens_rows[:width] = torch.where(write, tokens, -1).T
        probs_rows = torch.zeros(self.max_drafts, len(ok), dtype=torch.float64, device=self.device)
        if accept_probs is not None:
            probs_rows[: accept_probs.shape[1]] = torch.where(ok[:, None], accept_probs.double(), 0.0).T
        # Rows finished before the step (padding rows among them) report nothing to act on.
        status = torch.where(running, status, 0)
        self.report.copy_(torch.cat([
            torch.stack([emitted, drafted, accepted, self.finished.long(), status.long(),
                         broken.long(), self.length, self.num_drafts]),
            fill_rows, tokens_rows, probs_rows.view(torch.int64)]))

    def _fill(self, entry: _Cache) -> torch.Tensor:
        """One past the last column of `entry`'s cache still needed by its next step, which
        re-feeds each row's last ``entry.refeed`` tokens."""
        cache = entry.cache
        kept = cache.live & (cache.position < (self.length - entry.refeed)[:, None])
        return torch.where(kept.any(dim=0), cache.column_index + 1, 0).max()

    def read_report(self, width: int | None = None) -> Report:
        """The last step's report (`Report.read`; `width`: the drafts it verified)."""
        return Report.read(self.report, len(self.caches), self.max_drafts, width)

    def copy_report(self, width: int | None = None) -> PendingReport:
        """Start copying the last step's report to host memory (after the step, in stream
        order) and return it pending: the next step may overwrite the report meanwhile.
        The two host buffers alternate: at most two copies may be pending."""
        if self.host_reports is None:
            # Two host copies: a step's while the host reads the one before. Pinned memory
            # costs a host allocation: only calls that decode ahead make them.
            cuda = self.device.type == "cuda"
            self.host_reports = [torch.zeros(self.report.shape, dtype=torch.long,
                                             pin_memory=cuda) for _ in range(2)]
            self.copies = [torch.cuda.Event() if cuda else None for _ in range(2)]
            self.next_copy = 0
        index, self.next_copy = self.next_copy, 1 - self.next_copy
        host, done = self.host_reports[index], self.copies[index]
        host.copy_(self.report, non_blocking=done is not None)
        if done is not None:
            done.record()
        return PendingReport(host, done, len(self.caches), self.max_drafts, width)

    def stop_rows(self, rows: list[int], lengths: list[int]) -> None:
        """End the given rows at the given lengths (a stop string completed inside a step)."""
        index = torch.tensor(rows, device=self.device)
        self.length.index_copy_(0, index, torch.tensor(lengths, device=self.device))
        self.finished.index_fill_(0, index, True)

    def outputs(self, num_rows: int, pad_token_id: int, want_logprobs: bool):
        """Each of the first `num_rows` rows' new tokens ``[rows, most emitted]`` (padded with
        `pad_token_id`), their counts and, if wanted, logprobs."""
        count = (self.length - self.prompt_length)[:num_rows]
        width = int(count.max()) if num_rows else 0
        offsets = torch.arange(width, device=self.device)[None, :]
        index = (self.prompt_length[:num_rows, None] + offsets).clamp_max(self.seq.shape[1] - 1)
        emitted = offsets < count[:, None]
        tokens = torch.where(emitted, self.seq[:num_rows].gather(1, index), pad_token_id)
        logprobs = (torch.where(emitted, self.logprobs[:num_rows].gather(1, index), 0.0)
                    if want_logprobs else None)
        return tokens, count, logprobs


def cut_at_first_end(emitted: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's emitted count cut after its first end (``ends`` bool ``[B, W]``: an EOS
    among the tokens it emits), and whether it had one."""
    columns = torch.arange(ends.shape[1], device=ends.device)
    ends = ends & (columns[None, :] < emitted[:, None])
    has_end = ends.any(dim=1)
    return torch.where(has_end, ends.int().argmax(dim=1) + 1, emitted), has_end


def heuristic_draft_counts(num_drafts: torch.Tensor, accepted: torch.Tensor,
                           drafted: torch.Tensor) -> torch.Tensor:
    """transformers' "heuristic" schedule: two more drafts after a step that accepted all
    of its drafts, one fewer (at least one) otherwise."""
    grow = (accepted == drafted) & (drafted > 0)
    return torch.where(grow, num_drafts + 2, (num_drafts - 1).clamp_min(1))


def _with_flags(buffers: SamplingParams, flags_from: SamplingParams) -> SamplingParams:
    """`buffers`' tensors with `flags_from`'s host flags (which pick the kernels' variants)."""
    params = object.__new__(SamplingParams)
    for field in dataclasses.fields(SamplingParams):
        source = buffers if field.init else flags_from
        object.__setattr__(params, field.name, getattr(source, field.name))
    return params


@dataclasses.dataclass
class _Fills:
    """What `Slot.ensure_room` reads of a `Report`: each cache's fill."""

    fills: list
