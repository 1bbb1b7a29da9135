"""How the engine runs a decoder forward: eagerly, or with its layers compiled.

Regional compilation: a decoder is a stack of identical layers, so the engine compiles the
layer class's forward once, with the layer module as an argument (its weights are graph
inputs, not constants) and that layer's own `WindowLayer` as its cache; the same compiled code
serves all of the decoder's layers, and every decoder of that class and widths. The embedding,
rotary tables, mask and final norm around the layers run eagerly (inside the same CUDA graph).
Compilation time is one layer's, not the stack's. A decoder without such a stack (or whose
layers carry hooks that replace their forward) is compiled whole.

The compiled code is traced with symbolic sizes (`torch._dynamo.maybe_mark_dynamic`): the
batch rows, the tokens fed per row, the cache's capacity and the KV columns attended over are
symbols; the model's own sizes (hidden, heads, head dimension) stay constants. One
compilation then serves every batch bucket, draft count, prompt length and KV view. PyTorch
specialises a size of 1, so the engine never feeds one token or one row to a compiled
forward: a step that decodes one token per row feeds it with a second, dead column (not live
in the cache, its output unused), and batches are bucketed to two rows or more. Compilation
therefore depends on the model, its dtype and its device, nothing else.

Compiled artifacts (inductor's FX graph and kernel caches, Triton's kernels) persist in
`cache_dir()`, so a second process only retraces. Every compilation is logged (logger ``"flashspec"``) with the
shape that caused it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import stat
import time
import weakref
from pathlib import Path

import torch

from . import attention, fused_projections
from .invariant import invariant_forward
from .kv_cache import (WindowCache, engine_causal_mask, engine_layer_masks, first_rows,
                       layer_mask_modules, takes_padding_mask)

LOG = logging.getLogger("flashspec")
CACHE_ENV = "FLASHSPEC_CACHE_DIR"
LOG_LEVEL_ENV = "FLASHSPEC_LOG_LEVEL"
# A fused group's members compute one product (`fused_projections`), merged here.
COMPILE_OPTIONS = {"post_grad_custom_pre_pass": fused_projections.MERGE}


def _default_logging() -> None:
    """Compilations and captures are worth seeing (they cost seconds): flashspec's logger
    prints INFO lines to stderr unless ``FLASHSPEC_LOG_LEVEL`` says otherwise or the
    application configured the logger itself."""
    if LOG.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("flashspec: %(message)s"))
    LOG.addHandler(handler)
    LOG.setLevel(os.environ.get(LOG_LEVEL_ENV, "INFO").upper())
    LOG.propagate = False


_default_logging()


def cache_dir() -> Path:
    """flashspec's on-disk cache: ``$FLASHSPEC_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/flashspec``, else ``~/.cache/flashspec``. Created with mode 0700; a
    directory that another user owns or that others may write is refused (torch's caches
    hold pickles, which must never be read from a place someone else can write). Delete it
    to clear the compiled artifacts."""
    root = os.environ.get(CACHE_ENV)
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "flashspec")
    path = Path(root).resolve()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if hasattr(os, "getuid") and (info.st_uid != os.getuid()
                                  or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        raise PermissionError(
            f"flashspec's cache directory {path} is owned by another user or writable by others "
            f"(mode {stat.filemode(info.st_mode)}); compiled artifacts are not read from there. "
            f"Set {CACHE_ENV} to a directory of your own (it is created with mode 0700)")
    return path


def use_disk_cache() -> None:
    """Point inductor's caches at ``cache_dir()/torchinductor`` and Triton's at
    ``cache_dir()/triton``, unless the user chose directories (``TORCHINDUCTOR_CACHE_DIR``,
    ``TRITON_CACHE_DIR``). Triton's must be fixed before anything compiles: inductor sets it
    to its own directory at its first kernel, so the fused LM-head kernels would land in
    ``~/.triton/cache`` or there depending on which compiled first, and a second process
    would miss them."""
    for variable, name in (("TORCHINDUCTOR_CACHE_DIR", "torchinductor"),
                           ("TRITON_CACHE_DIR", "triton")):
        if variable not in os.environ:
            directory = cache_dir() / name
            directory.mkdir(mode=0o700, exist_ok=True)
            os.environ[variable] = str(directory)


@dataclasses.dataclass
class Event:
    """A compilation or a graph capture: what, why (the shape that caused it) and seconds."""

    kind: str          # "compile" or "capture"
    what: str
    seconds: float


class DecoderRunner:
    """Runs one decoder (a causal LM without its LM head) over a `WindowCache`, eagerly or
    through its compiled forward."""

    def __init__(self, decoder: torch.nn.Module, role: str, compile: bool, events: list[Event],
                 invariant: bool = False):
        # Weak: the engine keeps runners by decoder, and an assistant the user drops must go.
        self._decoder = weakref.ref(decoder)
        self.role = role
        self.compile = compile
        self.invariant = invariant
        self.events = events
        self.compiled = False
        self._compiled = None            # the compiled forward, made at the first compiled step
        # Set by the engine for a call that must not compile (`max_time`): steps run eagerly.
        self.eager = False
        # The decoder's forward reads the 2-D padding mask itself (ALiBi: Bloom, Falcon-ALiBi).
        self.padding_mask = takes_padding_mask(decoder)
        # Its attention modules pick their layer's window themselves (GPT-Neo): each takes its
        # own kind's mask (`kv_cache.engine_layer_masks`). Weak, as the decoder.
        self._layer_masks = [weakref.ref(module) for module in layer_mask_modules(decoder)]
        # Compiled steps on CUDA attend by position (`attention`): no mask to build, grouped
        # heads' keys read once. The prefill's many queries keep the model's own attention
        # and mask, as do CPU forwards (Triton runs there through its interpreter).
        cuda = next(decoder.parameters()).is_cuda
        self.steps_by_position = invariant or (compile and cuda
                                               and attention.unsupported_reason(decoder) is None)
        if compile:
            use_disk_cache()

    @property
    def decoder(self) -> torch.nn.Module:
        return self._decoder()

    @property
    def would_compile(self) -> bool:
        """The next compiled step would compile the forward first (seconds)."""
        return self.compile and not self.compiled

    def _compiled_forward(self):
        """The forward torch.compile traces: regional (the layer stack's) where the decoder
        has one, else whole. Made at the first compiled step, so that a call that runs
        uncompiled does not pay dynamo's import either."""
        dynamo = torch._dynamo.config
        # Every decoder (target, assistants) is a compilation of the same function.
        dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 1024)
        layers = _decoder_layers(self.decoder)
        if layers is None:
            return torch.compile(self._forward, options=COMPILE_OPTIONS)
        self._layers = _RegionalLayers(layers)
        return self._regional_forward

    def forward(self, cache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                new_live: torch.Tensor | None = None,
                model_positions: torch.Tensor | None = None,
                inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Final hidden states ``[B, n, D]`` of `input_ids` at `position_ids` ``[B, n]``,
        eager (the prefill, whose width varies from call to call); checks that every layer
        kept its state in `cache`. `model_positions`: the position ids the model takes, if
        not the cache's `WindowCache.model_positions` (the prefill's: stock's). `inputs`:
        more keyword arguments of the decoder's forward, tensors ``[B, n, ...]`` (a
        drafter's hidden-state input)."""
        with self._kernels(self.invariant):
            hidden = self._forward(cache, input_ids, position_ids, new_live, self.invariant,
                                   model_positions, inputs)
        layers = self.decoder.config.num_hidden_layers
        if cache.num_updates != layers:
            raise ValueError(
                f"`{self.role}` ({type(self.decoder).__name__}) keeps no attention KV cache in "
                f"{layers - cache.num_updates} of its {layers} layers (recurrent or other "
                "state); sampler='flash' supports decoders whose whole state is an attention KV "
                "cache; run generate() without sampler='flash'")
        return hidden

    def _kernels(self, by_position: bool):
        """What a forward of this runner runs inside (entered outside any compiled code): the
        invariant kernels (`invariant.invariant_forward`) when this runner uses them, else
        the attention by position if `by_position`, and for a decoder that takes the 2-D
        padding mask, its `create_causal_mask` answering with the cache's mask
        (`kv_cache.engine_causal_mask`)."""
        stack = contextlib.ExitStack()
        if self.compile and not self.invariant:
            stack.enter_context(fused_projections.active())
        if self.invariant:
            stack.enter_context(invariant_forward(self.decoder))
        elif by_position:
            stack.enter_context(attention.by_position(self.decoder))
        if self.padding_mask:
            stack.enter_context(engine_causal_mask(self.decoder))
        if self._layer_masks:
            stack.enter_context(engine_layer_masks([module() for module in self._layer_masks]))
        return stack

    def _forward(self, cache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 new_live: torch.Tensor | None = None, by_position: bool = False,
                 model_positions: torch.Tensor | None = None,
                 inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        mask = cache.begin(position_ids, new_live, masks=not by_position)
        if self.padding_mask and mask is not None:
            # The decoder builds its ALiBi biases from the 2-D mask, each live key's position
            # as in stock; its create_causal_mask returns `mask` (`engine_causal_mask`).
            mask = cache.padding_mask(input_ids.shape[0])
        if self._layer_masks and isinstance(mask, dict):
            # The decoder hands one mask to every layer; each of its attention modules takes
            # its own kind's from the cache (`engine_layer_masks`).
            mask = next(iter(mask.values()))
        # The attention by position reads keys through the cache's index, by the queries'
        # cache positions (the model's position ids may differ: `model_positions`); a dead
        # query (no key of its own: a right-padded row's last column, whose query gives the
        # row's first token) reads those before its position, as the cache's mask has it.
        extra = {}
        if by_position:
            queries = (position_ids if new_live is None
                       else torch.where(new_live, position_ids, position_ids - 1))
            extra = {"key_index": first_rows(cache.key_index, input_ids.shape[0]),
                     "query_positions": queries}
        extra[cache_keyword(type(self.decoder).forward)] = cache
        if model_positions is None:
            model_positions = cache.model_positions(position_ids)
        return self.decoder(input_ids=input_ids, attention_mask=mask, position_ids=model_positions,
                            use_cache=True, **extra, **(inputs or {})).last_hidden_state

    def _regional_forward(self, cache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                          new_live: torch.Tensor | None = None, by_position: bool = False,
                          inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        with self._layers:
            return self._forward(cache, input_ids, position_ids, new_live, by_position,
                                 inputs=inputs)

    def step(self, cache, input_ids: torch.Tensor, position_ids: torch.Tensor,
             new_live: torch.Tensor, inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """`forward` of a fixed-shape step (at least two rows and two tokens per row):
        compiled when this runner compiles, unless `eager` is set. `inputs`: as `forward`'s,
        their first two dimensions symbolic when compiled."""
        # An uncompiled call (max_time) compiles nothing: not the attention's Triton kernel.
        by_position = self.invariant or (self.steps_by_position and not self.eager)
        with self._kernels(by_position):
            return self._step(cache, input_ids, position_ids, new_live, by_position, inputs)

    def _step(self, cache, input_ids: torch.Tensor, position_ids: torch.Tensor,
              new_live: torch.Tensor, by_position: bool,
              inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        if not self.compile or self.eager:
            return self._forward(cache, input_ids, position_ids, new_live, by_position,
                                 inputs=inputs)
        if min(input_ids.shape) < 2:
            raise ValueError(f"a compiled step needs at least 2 rows and 2 tokens per row, got "
                             f"{tuple(input_ids.shape)}")
        for tensor, dims in [*cache.dynamic_tensors(), (input_ids, (0, 1)),
                             (position_ids, (0, 1)), (new_live, (0, 1)),
                             *((tensor, (0, 1)) for tensor in (inputs or {}).values())]:
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        if self.compiled:
            return self._compiled(cache, input_ids, position_ids, new_live, by_position,
                                  inputs=inputs)
        started = time.perf_counter()
        if self._compiled is None:
            self._compiled = self._compiled_forward()
        # Sizes that happen to be equal (say 2 rows feeding 2 tokens) must stay separate
        # symbols, or a later call where they differ would compile again.
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            hidden = self._compiled(cache, input_ids, position_ids, new_live, by_position,
                                    inputs=inputs)
        self.compiled = True
        kernels = ", invariant kernels" if self.invariant else ""
        event = Event("compile", f"{self.role} ({type(self.decoder).__name__}{kernels}), first at "
                      f"{input_ids.shape[0]} rows x {input_ids.shape[1]} tokens, {cache.view} KV "
                      "columns", time.perf_counter() - started)
        self.events.append(event)
        LOG.info("compiled %s in %.1f s", event.what, event.seconds)
        return hidden


@functools.cache
def cache_keyword(forward) -> str:
    """The name under which `forward` (a transformers decoder's or layer's) takes its KV cache:
    ``cache`` where it names it (transformers 5.24 on, where ``past_key_values`` is
    deprecated), else ``past_key_values`` (named, or taken through ``**kwargs``)."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _parameters(forward) -> list[str]:
    return list(inspect.signature(forward).parameters)


def _decoder_layers(decoder: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The decoder's stack of layers (``decoder.layers``): its longest ModuleList of one class
    whose forward takes a KV cache (`cache_keyword`). None if there is none, or if a layer's
    forward is replaced on the instance by anything but accelerate's hooks (which keep the
    layer's own forward as ``_old_forward``): those decoders compile whole."""
    stacks = [m for m in decoder.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1
              and len({type(layer) for layer in m}) == 1
              and {"cache", "past_key_values"} & set(_parameters(type(m[0]).forward))]
    if not stacks:
        return None
    layers = max(stacks, key=len)
    replaced = [layer for layer in layers
                if "forward" in vars(layer) and _ACCELERATE_FORWARD not in vars(layer)]
    return None if replaced else layers


def _mark_all_dynamic(value) -> None:
    """maybe_mark_dynamic every dim of every tensor in `value` (tuples, lists, dicts): dims
    tied to the weights (hidden, head dimension) are specialised back while tracing; rows,
    tokens and KV columns stay symbols. Needed on every call, as guards check the marks."""
    if isinstance(value, torch.Tensor):
        for dim in range(value.dim()):
            torch._dynamo.maybe_mark_dynamic(value, dim)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _mark_all_dynamic(item)
    elif isinstance(value, dict):
        for item in value.values():
            _mark_all_dynamic(item)


# Where accelerate's hooks keep a layer's own forward: its patched `forward` moves the
# inputs to the layer's device, calls this, and moves the outputs on.
_ACCELERATE_FORWARD = "_old_forward"


class _RegionalLayers:
    """One torch.compile of the layer class's forward, called with the layer module as an
    argument and the layer's own `WindowLayer` as its cache. `WindowLayer.update`
    ignores the layer index and the compiled frame reads no Python int that differs between
    layers (an int it reads becomes a guard, and a recompilation per layer), so every layer
    shares one compilation (under accelerate's hooks too, which run around it).
    Installed only inside ``with``: prefill and any use of the model outside flashspec run
    the layers' own forward."""

    def __init__(self, layers: torch.nn.ModuleList):
        self.layers = list(layers)
        self.compiled = torch.compile(type(self.layers[0]).forward, options=COMPILE_OPTIONS)
        self.keyword = cache_keyword(type(self.layers[0]).forward)

    def _call(self, layer, index: int, *args, **kwargs):
        cache = kwargs.get(self.keyword)
        if isinstance(cache, WindowCache):
            _mark_all_dynamic(cache.columns)      # begin() writes a new one per step
            kwargs[self.keyword] = cache.layers[index]
        _mark_all_dynamic(args)
        _mark_all_dynamic(kwargs)
        return self.compiled(layer, *args, **kwargs)

    def __enter__(self) -> "_RegionalLayers":
        self._saved = []
        for index, layer in enumerate(self.layers):
            name = _ACCELERATE_FORWARD if _ACCELERATE_FORWARD in vars(layer) else "forward"
            self._saved.append((layer, name, vars(layer).get(name)))
            setattr(layer, name, functools.partial(self._call, layer, index))
        return self

    def __exit__(self, *exc) -> None:
        for layer, name, forward in self._saved:
            if forward is None:
                delattr(layer, name)
            else:
                setattr(layer, name, forward)
