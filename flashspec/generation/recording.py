"""`output_attentions` / `output_hidden_states`: each emitted token's attentions and hidden
states, taken from the target's forward that computed it and laid out as stock returns them.

Stock `generate` (greedy search, sampling) returns one entry per generated token: the first
from the prompt's forward, a tuple over layers of ``[B, heads, L, L]`` attention weights
(``[B, L, D]`` hidden states, one per layer and the embeddings'), each later one from the
forward of the token before it, ``[B, heads, 1, L + k]`` (``[B, 1, D]``), over stock's
columns: the prompt's (padding included) and the generated tokens, as far as stock's cache
layer hands them to that layer's attention (a sliding-window layer its last ``window - 1``
and the new one, a static cache its whole length: `key_layouts`); without a cache
(``use_cache=False``) each entry is the forward of the whole sequence so far, built here from
the prompt's rows and each token's (a query's rows do not depend on later columns). The
engine runs the same
decoder, with ``output_attentions`` / ``output_hidden_states`` (a forward pre-hook held during
the call, `recording`), on its materialized path (eager steps, the model's own attention
with masks): the steps' weights come over the KV cache's view columns, addressed by position,
and each live entry is moved to its token's column of ``sequences`` (padding columns, dead
and stale entries: 0, which is what stock's softmax gives a masked key). Only the emitted
tokens' entries are kept: a verification forward gives one per token it emits (the accepted
drafts and the target's own), a rejected draft's none, as stock's assisted generation keeps.

The prompt's forward runs with stock's own mask over the prompt's columns, which the
position-addressed cache's columns are there: a padding column's query attends to the live
tokens of the columns up to its own (none for left padding: eager attention then spreads it
evenly over the columns, sdpa gives zeros, as in stock), at stock's position 0 and with its
own token type, so that every row of the first entry is stock's.

What differs from stock (`FlashGenerateOutput`): a row that ended before the others holds NaN
in the later entries (stock shows the forwards of the padding it keeps feeding that row);
stock's assisted generation returns, for the tokens its first verification emits after the
first, the rows of the prompt's first columns (its `_split_model_outputs` indexes that
forward's rows from 0, not from the prompt's end), where flashspec returns each token's own
(those of greedy search, also for sliding-window layers, whose columns stock's split cuts
from the wrong end); and under eager attention a leading-padding column's row, which sees no
key, with a static cache or without a cache: stock spreads it evenly over every column of its
forward (the static cache's empty ones, or the whole sequence at each step), the engine over
the prompt's columns, so its hidden states and weights there differ (every other row equal).
"""

from __future__ import annotations

import contextlib

import torch
from transformers.cache_utils import (DynamicSlidingWindowLayer, StaticLayer,
                                      StaticSlidingWindowLayer)
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

from .compiled import cache_keyword
from .past import layer_windows


class ForwardOutputs:
    """One call's attentions and hidden states per emitted token (`attentions`,
    `hidden_states`: which to keep), for rows whose prompts' columns are `attention_mask`
    ``[B, W]`` (stock's, after ``num_return_sequences``), the first `past_length` of them held
    by a passed cache; `token_type_ids` ``[B, W]``: the prompts' token types, if the call has
    them. `layouts`: the key columns each layer's attentions span in stock (`key_layouts`),
    or None where stock runs without a cache (every forward feeds the whole sequence)."""

    def __init__(self, attention_mask: torch.Tensor, past_length: int,
                 token_type_ids: torch.Tensor | None, attentions: bool, hidden_states: bool,
                 layouts: list[tuple[str, int | None]] | None):
        mask = attention_mask.bool()
        self.rows, self.width = mask.shape
        self.mask = mask
        self.past_length = past_length
        self.token_type_ids = token_type_ids
        self.attentions, self.hidden_states = attentions, hidden_states
        self.layouts = layouts
        self.prompt_length = mask.sum(dim=1)
        # The column of each row's live prompt token at position p: its p-th live column.
        self.prompt_columns = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
        self._kept_attentions = [[] for _ in range(self.rows)]
        self._kept_hidden = [[] for _ in range(self.rows)]
        self._last = None           # the last target forward's outputs, until `record`
        self._cache = None          # the target's cache while `recording`
        self._prompt_pending = False
        self._view = None

    @contextlib.contextmanager
    def recording(self, slot):
        """Inside, the target's forwards in `slot` return what the call keeps, with the
        model's own attention and masks (eager steps, no attention by position)."""
        runner, cache = slot.target.runner, slot.target.cache
        decoder = runner.decoder
        self._cache, self._prompt_pending = cache, True
        self._keyword = cache_keyword(type(decoder).forward)
        saved = runner.eager, runner.steps_by_position
        runner.eager, runner.steps_by_position = True, False
        before = decoder.register_forward_pre_hook(self._before, with_kwargs=True)
        after = decoder.register_forward_hook(self._after, with_kwargs=True)
        try:
            yield
        finally:
            before.remove()
            after.remove()
            runner.eager, runner.steps_by_position = saved
            if self._view is not None:
                cache.set_view(self._view)
                self._view = None
            self._cache = None

    def _ours(self, kwargs: dict) -> bool:
        return self._cache is not None and kwargs.get(self._keyword) is self._cache

    def _before(self, module, args, kwargs):
        if not self._ours(kwargs):
            return None
        kwargs = dict(kwargs)
        if self.attentions:
            kwargs["output_attentions"] = True
        if self.hidden_states:
            kwargs["output_hidden_states"] = True
        if self._prompt_pending:
            self._as_stock_prompt(kwargs)
        return args, kwargs

    def _as_stock_prompt(self, kwargs: dict) -> None:
        """The prompt's forward as stock runs it: the fed columns (those after a passed
        cache's) attend over the prompt's `width` columns with stock's mask; padding columns
        with their own token types (the engine feeds stock's position ids already:
        `Slot.load`)."""
        cache = self._cache
        rows, fed = kwargs["position_ids"].shape
        start = self.width - fed
        device = kwargs["position_ids"].device
        if self.token_type_ids is not None and kwargs.get("token_type_ids") is not None:
            kwargs["token_type_ids"] = self.token_type_ids[:rows, start:].to(device)
        self._view = cache.view
        cache.set_view(self.width)
        masks = {kind: self._stock_mask(rows, start, window)
                 for kind, window in cache.layer_kinds.items()}
        single = next(iter(masks.values()))
        # The cache's own, for modules that take theirs from it (an ALiBi decoder's
        # `create_causal_mask`, GPT-Neo's attention: `kv_cache.engine_causal_mask`,
        # `engine_layer_masks`).
        if isinstance(cache.mask, dict):
            cache.mask = masks
        elif cache.mask is not None:
            cache.mask = single
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict):
            kwargs["attention_mask"] = masks
        elif isinstance(mask, torch.Tensor) and mask.dim() == 4:
            kwargs["attention_mask"] = single
        elif isinstance(mask, torch.Tensor):        # an ALiBi decoder's 2-D padding mask
            kwargs["attention_mask"] = cache.padding_mask(rows)

    def _stock_mask(self, rows: int, start: int, window: int | None) -> torch.Tensor:
        """Stock's mask of the prompt's columns `start`... over its `width` columns (the
        cache's first, where the prompt lies): a live key at a column up to the query's
        (and within the sliding window), as bool or additive like the cache's own."""
        cache = self._cache
        device = cache.live.device
        keys = torch.arange(self.width, device=device)
        queries = torch.arange(start, self.width, device=device)
        allowed = (cache.live[:rows, None, None, : self.width]
                   & (keys[None, None, None, :] <= queries[None, None, :, None]))
        if window is not None:
            allowed = allowed & (keys[None, None, None, :] > queries[None, None, :, None] - window)
        if cache.mask_dtype is None:
            return allowed
        return torch.zeros((), dtype=cache.mask_dtype, device=device).masked_fill(
            ~allowed, torch.finfo(cache.mask_dtype).min)

    def _after(self, module, args, kwargs, output):
        if not self._ours(kwargs):
            return
        attentions = tuple(a for a in (output.attentions or ()) if a is not None) \
            if self.attentions else None
        hidden = tuple(output.hidden_states or ()) if self.hidden_states else None
        if self._prompt_pending:
            self._prompt_pending = False
            self._cache.set_view(self._view)
            self._view = None
            self._last = ("prompt", attentions, hidden, None)
            return
        cache = self._cache
        # The queries' cache positions (the model's position ids may be shifted: a
        # right-padded row's new tokens, `WindowCache.model_positions`).
        queries = getattr(cache, "positions_fed", None)
        queries = kwargs["position_ids"] if queries is None else queries
        rows = min(self.rows, queries.shape[0])
        view = cache.view
        where = (cache.live[:rows, :view].clone(), cache.position[:rows, :view].clone(),
                 queries[:rows].clone())
        self._last = ("step", attentions, hidden, where)

    def record(self, emitted: list[int]) -> None:
        """Keep the entries of each row's tokens the last target forward emitted (its first
        ``emitted[b]`` queries, after EOS, budget and stop-string cuts)."""
        if self._last is None:
            return
        kind, attentions, hidden, where = self._last
        self._last = None
        if kind == "prompt":
            first = self.past_length          # the prompt's forward feeds the columns after
            for row, count in enumerate(emitted[: self.rows]):
                if count:
                    self._keep(row, attentions and self._spanned([a[row] for a in attentions],
                                                                 first),
                               hidden and tuple(h[row] for h in hidden))
            return
        live, position, queries = where
        plen = self.prompt_length.to(live.device)[: live.shape[0], None]
        kv = self.width + queries + 1 - plen                  # stock's key columns per query
        if attentions:
            columns = self._columns(live, position, plen, int(kv.max()))
            moved = tuple(self._moved(a[: live.shape[0]], columns, int(kv.max()))
                          for a in attentions)
        for row, count in enumerate(emitted[: live.shape[0]]):
            for j in range(count):
                size = int(kv[row, j])
                self._keep(row, attentions and self._spanned([a[row, :, j:j + 1, :size]
                                                              for a in moved], size - 1),
                           hidden and tuple(h[row, j:j + 1] for h in hidden))

    def _columns(self, live: torch.Tensor, position: torch.Tensor, plen: torch.Tensor,
                 size: int) -> torch.Tensor:
        """``[rows, view]``: the column of ``sequences`` of each cache column's live entry
        (`size`, past every query's keys, for the others)."""
        prompt = self.prompt_columns.to(live.device)[: live.shape[0]]
        column = torch.where(position < plen,
                             prompt.gather(1, position.clamp(0, self.width - 1)),
                             self.width + position - plen)
        return torch.where(live, column, size).clamp(0, size)

    @staticmethod
    def _moved(weights: torch.Tensor, columns: torch.Tensor, size: int) -> torch.Tensor:
        """`weights` ``[rows, H, n, view]`` over the cache's columns, moved to the columns of
        ``sequences`` ``[rows, H, n, size]`` (a masked key's weight is 0 in both)."""
        rows, heads, queries, view = weights.shape
        out = weights.new_zeros(rows, heads, queries, size + 1)
        index = columns.to(weights.device)[:, None, None, :].expand(rows, heads, queries, view)
        return out.scatter_(3, index, weights)[..., :size]

    def _spanned(self, weights: list[torch.Tensor], first: int) -> tuple:
        """Each layer's `weights` ``[H, n, X]`` (the queries at the columns from `first` on,
        over the columns ``[0, X)`` of ``sequences``) over the key columns stock's cache layer
        hands that forward's attention (`_span`): cut to a sliding window's, padded with zeros
        to a static cache's length."""
        if self.layouts is None or len(self.layouts) != len(weights):
            return tuple(weights)
        out = []
        for layout, layer in zip(self.layouts, weights):
            start, end = _span(layout, first, layer.shape[-2])
            if (start, end) == (0, layer.shape[-1]):
                out.append(layer)
                continue
            fitted = layer.new_zeros(*layer.shape[:-1], end - start)
            kept = min(end, layer.shape[-1]) - start
            fitted[..., :kept] = layer[..., start:start + kept]
            out.append(fitted)
        return tuple(out)

    def _keep(self, row: int, attentions, hidden) -> None:
        if attentions is not None:
            self._kept_attentions[row].append(attentions)
        if hidden is not None:
            self._kept_hidden[row].append(hidden)

    def outputs(self) -> tuple[tuple | None, tuple | None]:
        """`attentions` and `hidden_states` as stock returns them: per generated token a
        tuple over layers of ``[B, ...]``; NaN for a row after its end."""
        attentions, hidden = self._kept_attentions, self._kept_hidden
        if self.layouts is None:
            attentions = [_whole(row, attention=True) for row in attentions]
            hidden = [_whole(row, attention=False) for row in hidden]
        return (_stacked(attentions) if self.attentions else None,
                _stacked(hidden) if self.hidden_states else None)


def key_layouts(config, past, cache_implementation: str | None, max_cache_length: int,
                use_cache: bool) -> list[tuple[str, int | None]] | None:
    """How stock's cache hands each layer's attention its keys: per layer ``("dynamic",
    window or None)``, ``("static", length)`` or ``("static_sliding", window)``, from the
    caller's cache's layers, else as stock makes its cache for `config` (`DynamicCache`, or the
    `StaticCache` of `max_cache_length` columns of a static `cache_implementation`); None
    without a cache (`use_cache` False)."""
    if past is not None:
        return [_layout(layer) for layer in past.layers]
    if not use_cache:
        return None
    windows = layer_windows(config)
    if cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS:
        return [("static", max_cache_length) if window is None
                else ("static_sliding", min(window, max_cache_length)) for window in windows]
    return [("dynamic", window) for window in windows]


def _layout(layer) -> tuple[str, int | None]:
    if isinstance(layer, StaticSlidingWindowLayer):
        return "static_sliding", layer.max_cache_len
    if isinstance(layer, StaticLayer):
        return "static", layer.max_cache_len
    if isinstance(layer, DynamicSlidingWindowLayer):
        return "dynamic", layer.sliding_window
    return "dynamic", None


def _span(layout: tuple[str, int | None], first: int, count: int) -> tuple[int, int]:
    """The columns ``[start, end)`` of ``sequences`` whose keys a stock cache layer of
    `layout` hands the attention of a forward of `count` queries from column `first` on:
    all of them (a full dynamic layer); the last ``window - 1`` cached and the new ones (a
    sliding dynamic layer); its whole buffer (a static layer: columns past the written ones
    are zeros, masked); a sliding static layer's buffer, or the cached and new ones where the
    forward overflows it (`StaticSlidingWindowLayer.update`)."""
    kind, size = layout
    end = first + count
    if kind == "dynamic":
        return (0, end) if size is None else (first - min(first, size - 1), end)
    if kind == "static":
        return 0, max(size, end)
    if first >= size:
        return first - size + 1, end
    return (0, end) if end > size else (0, size)


def _whole(kept: list[tuple], attention: bool) -> list[tuple]:
    """A row's entries as stock returns them without a cache, where each forward feeds the
    whole sequence: entry k holds the prompt's rows and those of the first k tokens' queries
    (each query's keys, padded with zeros to the entry's columns)."""
    out = []
    for k in range(len(kept)):
        parts = kept[: k + 1]
        layers = []
        for layer in range(len(parts[0])):
            if attention:
                size = parts[-1][layer].shape[-1]
                rows = [torch.nn.functional.pad(part[layer], (0, size - part[layer].shape[-1]))
                        for part in parts]
                layers.append(torch.cat(rows, dim=-2))
            else:
                layers.append(torch.cat([part[layer] for part in parts], dim=-2))
        out.append(tuple(layers))
    return out


def _stacked(kept: list[list[tuple]]) -> tuple:
    """Per token t, per layer, the rows' tensors stacked (NaN for a row without token t)."""
    steps = max((len(row) for row in kept), default=0)
    out = []
    for t in range(steps):
        column = [row[t] if t < len(row) else None for row in kept]
        like = next(x for x in column if x is not None)
        out.append(tuple(
            torch.stack([x[layer] if x is not None else torch.full_like(like[layer], float("nan"))
                         for x in column])
            for layer in range(len(like))))
    return tuple(out)
