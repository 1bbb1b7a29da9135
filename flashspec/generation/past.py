"""`past_key_values` in and out of `generate(sampler="flash")`, as stock `generate` has them.

Out. Stock's returned cache (`return_dict_in_generate=True`, `use_cache` not False) holds the
target's keys and values of every column of ``sequences`` but the last, laid out as
``sequences`` is: the prompt's columns (padding included: entries the next call masks), then
the new tokens, a finished row's padding tokens included (stock feeds them, at the positions
that follow). `Slot.returned_kv` gathers the same from the target's position-addressed
`WindowCache` (after one eager forward of what the engine never fed: a finished row's last
token and its padding), one ``[rows, kv heads, columns, head dim]`` tensor per layer and kind,
and `returned_cache` hands them to the cache stock would have made (`DynamicCache` with the
model's config, whose sliding-window layers keep their last ``window - 1`` entries; the
`StaticCache` of `cache_implementation="static"`, sized as stock sizes it) through the
cache's own `update`, so each layer keeps what stock's would. A cache the caller passed is
updated in place, as stock updates it (and returned).

In. A `Cache` passed as `past_key_values` holds the first N columns of the call's prompt (a
previous call's `past_key_values`, whose ``sequences`` the prompt continues, or a prompt cache
the caller filled): `check_past` reads N and refuses what cannot be taken, `load_past` writes
its entries into the target's `WindowCache` (each live column at its position, the padding
columns dead, as the prefill would have written them), and the prefill feeds only the columns
after N. An assistant keeps no cache of its own across calls: it reads the whole prompt.

Layers read: transformers' `DynamicLayer`, `DynamicSlidingWindowLayer`, `StaticLayer`,
`StaticSlidingWindowLayer` (a sliding-window layer's last ``window - 1`` entries are all a
later query reads). Quantized and other layers are refused.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import (Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer,
                                      StaticLayer, StaticSlidingWindowLayer)
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

_READABLE = (DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer)
_NAME = "`past_key_values`"


def layer_windows(config) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention), as transformers picks its
    cache layers (`cache_utils.get_layer_types_and_kwargs`)."""
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in types]


def layer_entries(layer, length: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """What `layer` (a readable cache layer holding `length` columns) keeps of them: keys and
    values ``[B, H, n, D]`` and the first column they hold (the last n columns)."""
    if isinstance(layer, StaticLayer):        # a sliding static layer keeps its last entries first
        held = min(length, layer.keys.shape[-2])
        return layer.keys[:, :, :held], layer.values[:, :, :held], length - held
    return layer.keys, layer.values, length - layer.keys.shape[-2]


def check_past(past, decoder: torch.nn.Module, rows: int, width: int, sharded: bool = False) -> int:
    """How many of the prompt's `width` columns `past` holds (0 for an empty cache), or a
    ValueError naming `past_key_values` and what cannot be taken: another object than a
    transformers Cache, a cache as long as the prompt or longer, one of another batch size
    or model shape, layers flashspec cannot read, or a layer missing entries its attention
    reads. `sharded`: the model is tensor-parallel (a rank's cache holds part of the heads)."""
    if isinstance(past, (tuple, list)):
        raise ValueError(f"{_NAME} as a tuple is not supported (nor by transformers 5): pass a "
                         "transformers Cache (a previous call's `past_key_values`, or a "
                         "DynamicCache)")
    if not isinstance(past, Cache):
        raise ValueError(f"{_NAME} must be a transformers Cache, got {type(past).__name__}")
    length = int(past.get_seq_length())
    if length == 0:
        return 0
    if length >= width:
        raise ValueError(
            f"{_NAME} holds {length} tokens, but the prompt has {width} columns: pass input_ids "
            "(or inputs_embeds) that begin with the cached tokens (e.g. the previous call's "
            "`sequences`) and hold at least one token more, with the attention_mask of all of them")
    config = decoder.config
    windows = layer_windows(config)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    model = type(decoder).__name__
    if len(past.layers) != len(windows):
        raise ValueError(f"{_NAME} has {len(past.layers)} layers, but the model ({model}) has "
                         f"{len(windows)}: pass a cache made by this model")
    for index, (layer, window) in enumerate(zip(past.layers, windows)):
        if type(layer) not in _READABLE:
            raise ValueError(
                f"{_NAME} holds a {type(layer).__name__} (layer {index}), which sampler='flash' "
                "does not read (it reads DynamicCache's and StaticCache's layers); pass a "
                "DynamicCache, or run generate() without sampler='flash'")
        if int(layer.get_seq_length()) != length:
            raise ValueError(f"{_NAME} holds {int(layer.get_seq_length())} tokens in layer "
                             f"{index} but {length} in layer 0: pass a cache made by this model")
        keys, values, first = layer_entries(layer, length)
        shape = (rows, keys.shape[1], keys.shape[-1])
        if keys.shape[0] != rows or keys.shape[-1] != head_dim or values.shape[:3] != keys.shape[:3] \
                or (keys.shape[1] != heads and not (sharded and heads % keys.shape[1] == 0)):
            raise ValueError(
                f"{_NAME} holds keys of shape {tuple(keys.shape)} in layer {index}, but this call "
                f"has {rows} rows and the model ({model}) {heads} KV heads of {head_dim}: pass "
                f"a cache made by this model for these rows (got {shape})")
        needed = length if window is None else min(length, window - 1)
        if length - first < needed:
            raise ValueError(
                f"{_NAME} keeps only the last {length - first} of its {length} tokens in layer "
                f"{index}, whose attention reads {needed} of them: pass the cache whole")
    return length


def _layer_devices(decoder: torch.nn.Module, count: int) -> list[torch.device] | None:
    """The device of each of `decoder`'s `count` layers (its stack of `count` modules), or
    None where there is no such stack."""
    stacks = [module for module in decoder.modules()
              if isinstance(module, torch.nn.ModuleList) and len(module) == count]
    if not stacks:
        return None
    devices = [next(layer.parameters(), None) for layer in stacks[0]]
    return None if None in devices else [parameter.device for parameter in devices]


def load_past(cache, past, length: int, positions: torch.Tensor, live: torch.Tensor,
              decoder: torch.nn.Module, dtype: torch.dtype) -> None:
    """Write `past`'s entries of the prompt's first `length` columns into `cache` (a
    `WindowCache` of `decoder` just reset, its layers' buffers on their layers' devices in
    `dtype`), at the columns' positions, `live` where the attention mask is 1 (`positions`,
    `live`: ``[rows, length]``, the call's own rows)."""
    rows = positions.shape[0]
    devices = _layer_devices(decoder, len(past.layers))
    cache.begin(positions, live, masks=False)
    columns = cache.columns
    for index, layer in enumerate(past.layers):
        keys, values, first = layer_entries(layer, length)
        while len(cache.layers) <= index:
            cache.layers.append(cache.layer_class_to_replicate())
        target = cache.layers[index]
        if not target.is_initialized:
            device = devices[index] if devices is not None else cache.live.device
            target.lazy_initialization(keys[:1, :, :1].to(device, dtype),
                                       values[:1, :, :1].to(device, dtype))
        for buffer, states in ((target.keys, keys), (target.values, values)):
            written = buffer[:rows] if rows < buffer.shape[0] else buffer
            held = columns.to(buffer.device)
            if first:                           # entries no later query reads
                written.index_fill_(2, held[:first], 0)
            written.index_copy_(2, held[first:], states.to(buffer.device, buffer.dtype))


def kv_by_column(cache, rows: int, column_positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values ``[rows, H, S, D]`` of `cache` (a `WindowCache`) at
    `column_positions` ``[rows, S]`` (the sequence position each output column holds; -1:
    none, zeros). A row's live entries lie in column order at positions 0, 1, 2, ... (the
    cache's invariant), so the column of position p is its p-th live column."""
    live = cache.live[:rows]
    order = torch.sort((~live).to(torch.int8), dim=1, stable=True).indices
    index = order.gather(1, column_positions.clamp_min(0))
    keep = (column_positions >= 0)[:, None, :, None]
    entries = []
    for layer in cache.layers:
        pair = []
        for states in (layer.keys, layer.values):
            at = index.to(states.device)[:, None, :, None].expand(-1, states.shape[1], -1,
                                                                  states.shape[3])
            gathered = states[:rows].gather(2, at)
            pair.append(torch.where(keep.to(states.device), gathered, gathered.new_zeros(())))
        entries.append(tuple(pair))
    return entries


def returned_cache(model, plan, entries: list[tuple[torch.Tensor, torch.Tensor]]) -> Cache:
    """The cache stock `generate` would return (or the caller's, updated in place as stock
    updates it), holding `entries` (`kv_by_column`'s, all of the call's columns)."""
    cache, start = plan.past_key_values, plan.past_length
    if cache is None:
        start = 0
        if plan.cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS:
            cache = model._prepare_static_cache(
                cache_implementation=plan.cache_implementation, batch_size=entries[0][0].shape[0],
                max_cache_len=plan.max_cache_length, prefill_chunk_size=None, model_kwargs={})
        else:
            cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    for index, (keys, values) in enumerate(entries):
        cache.update(keys[:, :, start:], values[:, :, start:], index)
    return cache
