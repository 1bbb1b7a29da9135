"""A KV cache shared by the batch, addressed by sequence position.

Every layer keeps keys and values in preallocated ``[B, H, capacity + 1, Dh]`` buffers. A
forward writes its n new entries into the same n columns for every row, and each column
records, per row, whether it holds a live entry and at which sequence position. Attention
masks are built from those positions, so rows can advance by different numbers of tokens
(ragged acceptance) without moving anything:

* before a forward that feeds positions ``p0, p0+1, ...`` of a row, the row's entries at
  positions ``>= p0`` are stale (rejected drafts, or entries about to be recomputed) and are
  dropped;
* the write column is one past the last column still live in any row, so a rejected draft's
  column is reused at once (rollback by position; a batch of one never leaves a hole);
* query at position q of row b sees the live entries of row b at positions ``<= q`` (and
  ``> q - window`` for sliding-window layers).

A forward attends over the cache's first ``view`` columns only (`WindowCache.set_view`), so
its cost follows the live length, not the capacity; the view is read from a tensor's shape
(`view_columns`, whose values nothing reads), which a compiled forward treats as a symbolic
size: one compilation serves every view.

The buffers hold one spare column past the capacity, which no view reaches: a view is then
always a strict part of the buffer, so the compiled code never meets a view that happens to
be the whole buffer (which it would specialise on, and compile again for the other case).

Everything above is device arithmetic on ``[B, capacity]`` tensors: no host read, fixed
shapes for a given view, so a forward through this cache can be captured in a CUDA graph.
Rows that fall far behind leave holes; `WindowCache.compact` packs the live entries to the
left (an eager copy, needed only when the write column would run past the capacity), and
`WindowCache.grow` moves everything to larger buffers.

A row's live entries therefore lie in column order at positions 0, 1, 2, ... (a forward drops
the row's entries from its first fed position on and writes past every live column; compaction
keeps column order), so ``(live.cumsum(-1) - 1) * live`` over a view is each live entry's
position, as transformers computes positions from its own 2-D padding mask. Decoders whose
forward reads that 2-D mask itself (ALiBi: Bloom, Falcon with ``alibi=True``;
`PADDING_MASK_DECODERS`) get it (`WindowCache.padding_mask`), and the causal mask their
forward then builds from it is the cache's own position-addressed mask
(`engine_causal_mask`). ALiBi by key column (MPT, `COLUMN_ALIBI_DECODERS`) cannot be served:
a row's keys need not sit in adjacent columns. GPT-Neo's attention modules, which apply their
own causal buffer by key column with a window in their "local" layers, attend with the
cache's mask of their own kind instead (`engine_layer_masks`).

The position ids the model takes (rotary or learned positions) are the cache's positions,
but for a right-padded row's new tokens, which stock feeds at the positions after its last
(padding) column's: a per-row offset (`WindowCache.model_positions`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from types import MethodType

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

FULL, SLIDING = "full_attention", "sliding_attention"
ATTENTION = ("sdpa", "eager")        # implementations that take masks built from positions

# transformers' decoders (base-model classes, by name) whose forward reads the 2-D padding
# mask itself before building its causal mask from it with `create_causal_mask`: ALiBi biases
# from each key's position ``(mask.cumsum(-1) - 1) * mask`` (their `build_alibi_tensor`),
# which a 4-D mask breaks. Each with the config flag that turns ALiBi on (None: always on).
# Found in transformers 5.17 by the base models' forwards that use `attention_mask` other than
# by passing it to the mask functions.
PADDING_MASK_DECODERS = {"BloomModel": None, "FalconModel": "alibi"}
# Decoders whose ALiBi biases follow key columns (the last columns of a fixed table): equal to
# position differences only where each row's keys sit in adjacent columns, which the
# position-addressed cache does not keep (other rows' longer accepted drafts and compaction
# leave holes). Refused (`heads.check_decoder`).
COLUMN_ALIBI_DECODERS = ("MptModel",)
# Attention modules (by class name) that pick their layer's window themselves: GPT-Neo's
# (``config.attention_layers``: "global" or "local" per layer, ``config.window_size``) slices
# a causal buffer ``bias`` ``[1, 1, max_positions, max_positions]`` to the last KV columns
# (``bias[..., k - q : k, :k]``: a window of key columns for "local" layers) and adds the one
# mask its decoder's forward hands every layer. Each names the attribute holding its kind.
# Inside `engine_layer_masks`, the buffer is all True and each module takes the cache's
# position-addressed mask of its own kind.
LAYER_MASK_ATTENTION = {"GPTNeoSelfAttention": "attention_type"}
LAYER_KIND_NAMES = {"global": FULL, "local": SLIDING}     # GPT-Neo's names of the mask kinds


class WindowLayer(CacheLayerMixin):
    """One layer's key/value buffers; writes go to the cache's current columns."""

    is_compileable = True

    def __init__(self, cache: "WindowCache"):
        super().__init__()
        self.cache = cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # Every row of the batch, also when the first forward reads only its first rows.
        shape = (self.cache.live.shape[0], key_states.shape[1], self.cache.capacity + 1)
        self.keys = key_states.new_zeros(*shape, key_states.shape[-1])
        self.values = value_states.new_zeros(*shape, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        columns = self.cache.columns
        if columns.device != self.keys.device:  # a layer that accelerate placed on another GPU
            columns = self.cache.columns_on(self.keys.device)
        keys = first_rows(self.keys, key_states.shape[0])
        values = first_rows(self.values, key_states.shape[0])
        keys.index_copy_(2, columns, key_states.to(keys.dtype))
        values.index_copy_(2, columns, value_states.to(values.dtype))
        view = self.cache.view_columns.shape[0]
        return keys[:, :, :view], values[:, :, :view]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.view_columns.shape[0], 0

    def get_seq_length(self) -> int:
        return self.cache.view_columns.shape[0]

    def get_max_length(self) -> int:
        return self.cache.capacity


class WindowCache(Cache):
    """KV cache of one decoder for a batch of `batch_size` rows and `capacity` columns.

    `live` and `position` (``[B, capacity + 1]``) describe every column; `begin` prepares a
    forward and returns its attention mask(s)."""

    def __init__(self, batch_size: int, capacity: int, device: torch.device,
                 layer_kinds: dict[str, int | None], mask_dtype: torch.dtype | None):
        super().__init__(layer_class_to_replicate=lambda: WindowLayer(self))
        self.capacity = capacity
        self.layer_kinds = layer_kinds      # mask kind -> sliding window (None: full attention)
        self.mask_dtype = mask_dtype        # None: boolean masks (sdpa), else additive masks
        self.live = torch.zeros(batch_size, capacity + 1, dtype=torch.bool, device=device)
        self.position = torch.zeros(batch_size, capacity + 1, dtype=torch.long, device=device)
        # Per row, the column of each live position (the invariant attention reads keys in
        # position order); dead and padding entries point at the unused last index.
        self.key_index = torch.zeros(batch_size, capacity + 1, dtype=torch.long, device=device)
        self.column_index = torch.arange(capacity + 1, device=device)
        self.columns = self.column_index[:0]
        # Per row, what the model's position ids add to the cache's positions from
        # `offset_from` on (`model_positions`): stock's positions of a right-padded row's new
        # tokens (`Slot.load`); zeros otherwise.
        self.offset = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.offset_from = torch.zeros(batch_size, dtype=torch.long, device=device)
        # Added to every model position: an MTP layer's entry at cache position p is the
        # model's position p + 1 (`chain.ChainHead.shift`); the cache keeps positions from 0,
        # which the attention by position reads.
        self.position_shift = 0
        self.positions_fed = None           # the last `begin`'s positions (cache positions)
        self.num_updates = 0
        self.mask = None                    # what the last `begin` returned
        self._views: dict[int, torch.Tensor] = {}
        self._columns_copies: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.set_view(capacity)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # Counted here, not in WindowLayer.update: a compiled layer calls its WindowLayer
        # directly, and would guard on this int (one compilation per layer). Only the eager
        # forward checks the count.
        self.num_updates += 1
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def view(self) -> int:
        return self.view_columns.shape[0]

    def set_view(self, columns: int) -> None:
        """Attend over the first `columns` columns (at most the capacity) from now on."""
        columns = min(columns, self.capacity)
        if columns not in self._views:       # one small tensor per view, not one per step
            self._views[columns] = torch.empty(columns, dtype=torch.uint8, device=self.live.device)
        self.view_columns = self._views[columns]

    def dynamic_tensors(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """Each tensor a compiled forward reads from the cache, with its dimensions that vary
        (batch rows, capacity, view): symbolic in the compiled code."""
        layers = [(t, (0, 2)) for layer in self.layers if layer.is_initialized
                  for t in (layer.keys, layer.values)]
        return [(self.live, (0, 1)), (self.position, (0, 1)), (self.key_index, (0, 1)),
                (self.column_index, (0,)), (self.view_columns, (0,)), (self.offset, (0,)),
                (self.offset_from, (0,)), *layers]

    def reset(self) -> None:
        self.live.zero_()

    def nbytes(self) -> int:
        """Bytes held by the buffers (keys, values, positions, flags)."""
        tensors = [self.live, self.position, self.key_index] + [t for layer in self.layers if layer.is_initialized
                                                for t in (layer.keys, layer.values)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def begin(self, position_ids: torch.Tensor, new_live: torch.Tensor | None = None,
              masks: bool = True):
        """Prepare a forward of ``position_ids`` ``[b, n]`` (consecutive per row) over the
        cache's first b rows (all of them, or the rows of a prefill that skips those padding
        the batch): drop the stale entries, choose the write columns, record the new entries
        (live unless `new_live` ``[b, n]`` says otherwise) and return the attention mask for
        the model: one ``[b, 1, n, view]`` mask, or a dict by layer kind (None without
        `masks`: attention by `key_index` needs none)."""
        rows = position_ids.shape[0]
        self.drop_from(position_ids[:, 0])
        self.columns = self.last_live_column() + self.column_index[: position_ids.shape[1]]
        first_rows(self.position, rows).index_copy_(1, self.columns, position_ids)
        live = torch.ones_like(position_ids, dtype=torch.bool) if new_live is None else new_live
        first_rows(self.live, rows).index_copy_(1, self.columns, live)
        spare = self.key_index.shape[1] - 1      # a size, not an int a compiled step guards on
        first_rows(self.key_index, rows).scatter_(
            1, torch.where(live, position_ids, spare), self.columns.expand(rows, -1))
        self.positions_fed = position_ids
        self.num_updates = 0
        self.mask = None
        if not masks:
            return None
        masks = {kind: self._mask(position_ids, window) for kind, window in self.layer_kinds.items()}
        self.mask = masks if len(masks) > 1 else next(iter(masks.values()))
        return self.mask

    def set_offsets(self, offset: torch.Tensor, offset_from: torch.Tensor) -> None:
        """From now on, row b's model position ids are its cache positions plus
        ``offset[b]`` from position ``offset_from[b]`` on (`model_positions`)."""
        self.offset.copy_(offset)
        self.offset_from.copy_(offset_from)

    def model_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The position ids the model takes (rotary or learned positions) for a forward of
        the cache positions `position_ids` ``[b, n]`` (the cache's first b rows): the same,
        but for each row's positions from ``offset_from`` on, shifted by ``offset`` (stock's
        positions of a right-padded row's new tokens, `Slot.load`), and all by
        ``position_shift``."""
        rows = position_ids.shape[0]
        shift = torch.where(position_ids >= first_rows(self.offset_from, rows)[:, None],
                            first_rows(self.offset, rows)[:, None], 0)
        return position_ids + shift + self.position_shift

    def padding_mask(self, rows: int) -> torch.Tensor:
        """``[rows, view]`` bool: which of the view's columns hold a live entry of each of the
        first `rows` rows, after `begin` (the forward's own entries included). A row's live
        entries lie in column order at positions 0, 1, 2, ..., so ``(mask.cumsum(-1) - 1) *
        mask`` is each one's position, as transformers derives positions from its 2-D mask:
        for the decoders that read it (`PADDING_MASK_DECODERS`)."""
        return first_rows(self.live, rows)[:, : self.view_columns.shape[0]]

    def _mask(self, position_ids: torch.Tensor, window: int | None) -> torch.Tensor:
        view = self.view_columns.shape[0]
        rows = position_ids.shape[0]
        query = position_ids[:, None, :, None]
        key = first_rows(self.position, rows)[:, None, None, :view]
        allowed = first_rows(self.live, rows)[:, None, None, :view] & (key <= query)
        if window is not None:
            allowed &= key > query - window
        if self.mask_dtype is None:
            return allowed
        return torch.zeros((), dtype=self.mask_dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(self.mask_dtype).min)

    def last_live_column(self) -> torch.Tensor:
        """Device scalar: one past the last column live in any row."""
        return torch.where(self.live.any(dim=0), self.column_index + 1, 0).max()

    def drop_from(self, positions: torch.Tensor) -> None:
        """Drop row b's entries at positions ``>= positions[b]`` (b < ``len(positions)``)."""
        rows = positions.shape[0]
        first_rows(self.live, rows).logical_and_(first_rows(self.position, rows) < positions[:, None])

    def columns_on(self, device: torch.device) -> torch.Tensor:
        """This forward's write columns on `device` (a layer's, when accelerate spread the
        layers over GPUs): copied once per forward and device."""
        copy = self._columns_copies.get(device)
        if copy is None or copy[0] is not self.columns:
            copy = self._columns_copies[device] = (self.columns, self.columns.to(device))
        return copy[1]

    def compact(self) -> None:
        """Move every row's live entries to its first columns, in column order (eager: a
        copy of the whole cache, in place so that captured graphs stay valid)."""
        order = torch.sort((~self.live).to(torch.int8), dim=1, stable=True).indices
        count = self.live.sum(dim=1, keepdim=True)
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            layer_order = order.to(layer.keys.device)   # layers may sit on other GPUs
            for states in (layer.keys, layer.values):
                index = layer_order[:, None, :, None].expand(-1, states.shape[1], -1,
                                                             states.shape[3])
                states.copy_(states.gather(2, index))
        self.position.copy_(self.position.gather(1, order))
        self.live.copy_(self.column_index[None, :] < count)
        self.key_index.scatter_(1, torch.where(self.live, self.position, self.capacity),
                                self.column_index.expand(self.live.shape[0], -1))

    def grow(self, capacity: int) -> None:
        """Move to buffers of `capacity` columns (more than now), keeping every entry where it
        is. Graphs captured over the old buffers are stale afterwards."""
        old = self.capacity
        device = self.live.device
        self.capacity = capacity
        for name in ("live", "position", "key_index"):
            buffer = getattr(self, name)
            grown = buffer.new_zeros(buffer.shape[0], capacity + 1)
            grown[:, :old] = buffer[:, :old]
            setattr(self, name, grown)
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            for name in ("keys", "values"):
                states = getattr(layer, name)
                grown = states.new_zeros(*states.shape[:2], capacity + 1, states.shape[3])
                grown[:, :, :old] = states[:, :, :old]
                setattr(layer, name, grown)
        self.column_index = torch.arange(capacity + 1, device=device)
        self.set_view(self.view)
        self.columns = self.column_index[:0]


def first_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor`'s first `rows` rows (a view, writes land in `tensor`); `tensor` itself when
    that is all of them, so that a compiled step traces no slice."""
    return tensor if rows == tensor.shape[0] else tensor[:rows]


def layer_kinds(config) -> dict[str, int | None] | None:
    """Mask kinds the decoder's layers use, each with its sliding window (None = full
    attention), read from the model config the way transformers' models choose their
    masks (GPT-Neo's attention modules from ``attention_layers`` and ``window_size``:
    `LAYER_MASK_ATTENTION`); None if some layer uses another kind of attention (chunked,
    linear...)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if getattr(config, "model_type", None) == "gpt_neo":   # its modules pick: LAYER_MASK_ATTENTION
        window = config.window_size
        types = [LAYER_KIND_NAMES.get(kind, kind) for kind in config.attention_layers]
    if types is None:        # one mask for every layer: Llama, GPT-2, Mistral...
        return {FULL: window if window else None}
    if not set(types) <= {FULL, SLIDING}:
        return None
    if set(types) == {FULL}:
        return {FULL: None}
    if not window:
        return None
    return {kind: (window if kind == SLIDING else None) for kind in sorted(set(types))}



def _base_class(decoder: torch.nn.Module, names) -> str | None:
    """The first class name of `decoder`'s class hierarchy that is in `names`, or None."""
    return next((cls.__name__ for cls in type(decoder).__mro__ if cls.__name__ in names), None)


def takes_padding_mask(decoder: torch.nn.Module) -> bool:
    """Whether `decoder`'s forward reads the 2-D padding mask itself (`PADDING_MASK_DECODERS`,
    with its ALiBi flag on): the engine then passes it `WindowCache.padding_mask` inside
    `engine_causal_mask`."""
    name = _base_class(decoder, PADDING_MASK_DECODERS)
    if name is None:
        return False
    flag = PADDING_MASK_DECODERS[name]
    return flag is None or bool(getattr(decoder.config, flag, False))


def column_alibi(decoder: torch.nn.Module) -> str | None:
    """The class (of `COLUMN_ALIBI_DECODERS`) by which `decoder` adds ALiBi biases by key
    column, or None."""
    return _base_class(decoder, COLUMN_ALIBI_DECODERS)


def layer_mask_modules(decoder: torch.nn.Module) -> list[torch.nn.Module]:
    """`decoder`'s attention modules that pick their layer's window themselves
    (`LAYER_MASK_ATTENTION`: GPT-Neo's)."""
    return [module for module in decoder.modules()
            if _base_class(module, LAYER_MASK_ATTENTION) is not None]


def _layer_kind(module: torch.nn.Module) -> str:
    """The mask kind (`FULL` or `SLIDING`) of one of `layer_mask_modules`."""
    kind = getattr(module, LAYER_MASK_ATTENTION[_base_class(module, LAYER_MASK_ATTENTION)])
    return LAYER_KIND_NAMES.get(kind, kind)


def _forward_with_own_mask(self: torch.nn.Module, *args, **kwargs):
    """The module's class forward, with the mask of the module's own kind that
    `WindowCache.begin` made for a forward over a `WindowCache` (its ``layer_past``) instead
    of the one its decoder passed every layer (`engine_layer_masks` installs it)."""
    cache = kwargs.get("layer_past")
    cache = cache.cache if isinstance(cache, WindowLayer) else cache
    if isinstance(cache, WindowCache) and isinstance(cache.mask, dict):
        kwargs["attention_mask"] = cache.mask[_layer_kind(self)]
    return type(self).forward(self, *args, **kwargs)


_ALL_TRUE: dict[torch.device, torch.Tensor] = {}
_LAYER_USERS: dict[int, tuple[int, torch.Tensor]] = {}   # id(module) -> (forwards inside, bias)


@contextlib.contextmanager
def engine_layer_masks(modules: list[torch.nn.Module]):
    """Inside, each of `modules` (`layer_mask_modules`) attends with the cache's
    position-addressed mask of its own kind, its causal buffer by key column (``bias``)
    all True: a GPT-Neo "local" layer's window then counts the row's positions, as its
    buffer counts stock's columns (equal for stock's rows, whose tokens lie in adjacent
    columns; `plan._mask_deferral` sends masks with holes to stock). The module's buffer and
    forward are its own again when the last forward inside ends."""
    with _LOCK:
        for module in modules:
            users, bias = _LAYER_USERS.get(id(module), (0, None))
            if users == 0:
                bias = module.bias
                device = bias.device
                if device not in _ALL_TRUE:   # stride 0: any key length slices it
                    _ALL_TRUE[device] = torch.ones((), dtype=torch.bool, device=device).expand(
                        1, 1, 1 << 30, 1 << 30)
                module.bias = _ALL_TRUE[device]
                module.forward = MethodType(_forward_with_own_mask, module)
            _LAYER_USERS[id(module)] = (users + 1, bias)
    try:
        yield
    finally:
        with _LOCK:
            for module in modules:
                users, bias = _LAYER_USERS.pop(id(module))
                if users > 1:
                    _LAYER_USERS[id(module)] = (users - 1, bias)
                else:
                    module.bias = bias
                    del module.forward


def forward_globals(decoder: torch.nn.Module) -> dict:
    """The module namespace `decoder`'s forward reads its functions from (its modeling file)."""
    return inspect.unwrap(type(decoder).forward).__globals__


_LOCK = threading.Lock()
_DISPATCHERS: dict[int, tuple] = {}   # id(namespace) -> (dispatcher, transformers' function)
_USERS: dict[int, int] = {}           # id(namespace) -> forwards inside `engine_causal_mask`


def _dispatcher(original):
    """`original` (transformers' `create_causal_mask`), except for a forward over a
    `WindowCache` prepared with masks: that forward's mask (`WindowCache.mask`)."""
    @functools.wraps(original)
    def create_causal_mask(*args, **kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))   # "cache" from 5.24
        if cache is None and len(args) > 3:
            cache = args[3]
        if isinstance(cache, WindowCache) and isinstance(cache.mask, torch.Tensor):
            return cache.mask
        return original(*args, **kwargs)

    return create_causal_mask


@contextlib.contextmanager
def engine_causal_mask(decoder: torch.nn.Module):
    """Inside, the `create_causal_mask` that `decoder`'s forward calls returns, for a forward
    over a `WindowCache`, the position-addressed mask `WindowCache.begin` made for it, so that
    the forward may be given the 2-D `WindowCache.padding_mask` (`takes_padding_mask`); any
    other call (another thread's stock forward of a model of that file included) goes to
    transformers' function. The name is swapped in the modeling file's namespace while any
    forward is inside, always for the same function (a compiled forward guards on it)."""
    names = forward_globals(decoder)
    key = id(names)
    with _LOCK:
        entry = _DISPATCHERS.get(key)
        if _USERS.get(key, 0) == 0:
            current = names["create_causal_mask"]
            if entry is None or entry[1] is not current:
                entry = _DISPATCHERS[key] = (_dispatcher(current), current)
            names["create_causal_mask"] = entry[0]
        _USERS[key] = _USERS.get(key, 0) + 1
    try:
        yield
    finally:
        with _LOCK:
            _USERS[key] -= 1
            if _USERS[key] == 0:
                names["create_causal_mask"] = entry[1]
