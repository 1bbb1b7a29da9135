"""How a call's decode steps run on the CPU.

A decode step of a small model is hundreds of small torch ops, each a few microseconds of
dispatch around little arithmetic, and matrix-vector products that read the weights once.
Three settings make such steps cheaper without changing what they compute:

* inference mode: no version counters or autograd metadata per op (the steps write only
  buffers made before them, in place, and temporaries);
* one intra-op thread while the step reads few weights: splitting a small matrix-vector
  product over threads costs a fork and a join per op and buys no bandwidth, and on a
  machine whose cores are busy each join waits for the slowest thread's turn on a core.
  Measured on 2-core AMD EPYC machines (2026-11-28, torch 2.13, stock transformers greedy
  decoding): a 78 MB fp32 Llama 6.9 ms per token on one thread against 7.2 on two; 665 MB:
  38.6 against 37.1; with a busy loop on each core, the demo's 6.8M-parameter target
  1.34 s per call on two threads, 0.55 s on one;
* the decoders' float32 linear layers multiply a step's few rows as the LM head does
  (`reference.matmul`: blocks of 16 weight rows in one batched product, 1.3-2.5x MKL's
  matrix-vector product on those machines): the same sums, rounded in another order. The
  demo's target decoder: 4.0-4.5 ms per token, 3.5-3.6 with them.

The prefill (many rows: compute, which threads speed up) runs with the caller's threads and
torch's own products.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F

from ..reference import FEW_ROWS, matmul

# Steps that read fewer weight bytes than this run on one intra-op thread.
SMALL_STEP_BYTES = 256 * 2**20
# Whether the innermost decode loop of this thread entered inference mode itself.
_loop = threading.local()


def weight_bytes(weights: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct tensors among `weights` (a tied head counted once)."""
    distinct = {weight.data_ptr(): weight for weight in weights}
    return sum(weight.numel() * weight.element_size() for weight in distinct.values())


@contextlib.contextmanager
def decode_steps(device: torch.device, decoders: Iterable[torch.nn.Module],
                 head_weight: torch.Tensor, eager: bool, invariant: bool) -> Iterator[None]:
    """The context of a call's decode loop, which runs `decoders` (the target's, an
    assistant's) and reads the target's `head_weight`: for `eager` steps on the CPU, inference
    mode, the decoders' float32 linear layers by `matmul` for few rows (not with the
    `invariant` kernels, which replace them), and one intra-op thread when the weights hold
    fewer than `SMALL_STEP_BYTES`; nothing for compiled steps (which inference mode would
    compile again, besides the prefill's) or elsewhere (CUDA steps are captured graphs)."""
    if device.type != "cpu" or not eager:
        yield
        return
    decoders = list(decoders)
    threads = torch.get_num_threads()
    weights = [head_weight, *(p for decoder in decoders for p in decoder.parameters())]
    single = threads > 1 and weight_bytes(weights) < SMALL_STEP_BYTES
    # A caller already in inference mode made the call's buffers in it: the loop stays in
    # it throughout (`outside_inference_mode` leaves only the mode entered here).
    entering = not torch.is_inference_mode_enabled()
    entered_before = getattr(_loop, "entered", False)
    if single:
        torch.set_num_threads(1)
    try:
        _loop.entered = entering
        with (torch.inference_mode() if entering else contextlib.nullcontext()), \
                few_row_linears([] if invariant else decoders):
            yield
    finally:
        _loop.entered = entered_before
        if single:
            torch.set_num_threads(threads)


@contextlib.contextmanager
def few_row_linears(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Within it, every plain float32 `torch.nn.Linear` of `modules` on the CPU (its class's
    own forward: not a subclass, not a forward replaced by hooks such as accelerate's)
    computes inputs of at most `FEW_ROWS` rows by `matmul`; others as before."""
    swapped = list({id(layer): layer for module in modules for layer in module.modules()
                    if type(layer) is torch.nn.Linear and "forward" not in layer.__dict__
                    and type(layer.weight.data) is torch.Tensor     # not a quantized subclass
                    and layer.weight.dtype == torch.float32
                    and layer.weight.device.type == "cpu" and layer.weight.is_contiguous()
                    }.values())      # a model passed twice (self-drafting) is swapped once
    for layer in swapped:
        layer.forward = functools.partial(_linear, layer)
    try:
        yield
    finally:
        for layer in swapped:
            layer.__dict__.pop("forward", None)


def _linear(layer: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    if input.numel() > FEW_ROWS * input.shape[-1] or torch.is_autocast_enabled("cpu"):
        return F.linear(input, layer.weight, layer.bias)
    out = matmul(input, layer.weight)
    return out if layer.bias is None else out + layer.bias


@contextlib.contextmanager
def outside_inference_mode() -> Iterator[None]:
    """Leave the inference mode `decode_steps` entered, if in it, for tensors that outlive
    the call (a tensor made in inference mode can never be updated in place outside it); a
    caller's own inference mode stays (the call's buffers were made in it); grad mode stays
    off (``inference_mode(False)`` alone would turn it on)."""
    if not (torch.is_inference_mode_enabled() and getattr(_loop, "entered", False)):
        yield
        return
    with torch.inference_mode(False), torch.no_grad():
        yield
