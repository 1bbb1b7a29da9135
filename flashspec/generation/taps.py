"""Target hidden states that a drafter reads: the residual stream entering chosen layers.

EAGLE-3 drafts from three of the target's intermediate hidden states at each verified
position. A drafter names them by layer index in the input convention (vLLM's, and the
original EAGLE code's): tap ``k`` is the tensor entering ``layers[k]`` (transformers'
``output_hidden_states[k]``), and ``k == num_layers`` the last layer's output (the stream
before the final norm); `FINAL` is the decoder's output (after the final norm: what MTP
layers read). The engine's target steps copy them, side by side, into a buffer of the slot
(`Slot.taps`) inside the step: forward pre-hooks (and for ``k == num_layers`` and `FINAL`
forward hooks) on the decoder and its layers, which run outside the compiled layer code and
are recorded in the step's CUDA graph like any other copy.
"""

from __future__ import annotations

import contextlib

import torch

from .compiled import _decoder_layers

FINAL = -1          # the decoder's output, after its final norm


def tap_layers(decoder: torch.nn.Module, layers: tuple[int, ...], role: str = "model"):
    """The decoder's layer stack, after checking that `layers` can be tapped there; a
    ValueError naming what cannot."""
    stack = _decoder_layers(decoder)
    if stack is None:
        raise ValueError(
            f"`{role}` ({type(decoder).__name__}) has no stack of decoder layers whose inputs "
            "a drafter can read (or its layers' forwards are replaced, as accelerate's hooks "
            "do); drafters that read the target's hidden states (EAGLE-3 heads, MTP layers) "
            "need one")
    bad = [k for k in layers if not isinstance(k, int) or not (0 <= k <= len(stack) or k == FINAL)]
    if bad or not layers:
        raise ValueError(f"target layers to read {list(layers)} must be ints in [0, "
                         f"{len(stack)}] (or FINAL, {FINAL}) for `{role}` ({len(stack)} layers)")
    return stack


@contextlib.contextmanager
def tapping(decoder: torch.nn.Module, stack, layers: tuple[int, ...], sink: torch.Tensor):
    """Inside, each forward of `decoder` (its layer stack `stack`, as `tap_layers` returned
    it) over ``[b, n]`` tokens copies the hidden states of its first
    ``w = min(n, sink.shape[1])`` columns entering ``layers[k]`` for each tapped `k` into
    ``sink[:b, :w, j*D:(j+1)*D]`` (`j`: the tap's place in `layers`)."""
    width = sink.shape[-1] // len(layers)

    def copy(index: int, hidden) -> None:
        if hasattr(hidden, "last_hidden_state"):
            hidden = hidden.last_hidden_state
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        rows, columns = hidden.shape[:2]
        columns = min(columns, sink.shape[1])
        sink[:rows, :columns, index * width:(index + 1) * width].copy_(hidden[:, :columns])

    def before(index):
        def hook(module, args, kwargs):
            copy(index, args[0] if args else kwargs["hidden_states"])
        return hook

    def after(index):
        def hook(module, args, kwargs, output):
            copy(index, output)
        return hook

    handles = []
    try:
        for index, layer in enumerate(layers):
            if layer == FINAL:
                handles.append(decoder.register_forward_hook(after(index), with_kwargs=True))
            elif layer < len(stack):
                handles.append(stack[layer].register_forward_pre_hook(before(index),
                                                                      with_kwargs=True))
            else:
                handles.append(stack[-1].register_forward_hook(after(index), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
