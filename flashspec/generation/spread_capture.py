"""Capturing the steps of a model that accelerate spread over several GPUs (``device_map``).

`torch.cuda.graph` captures the work of one stream on one device: the current device's
capture stream, with its allocations in one private memory pool there. A device_map model's
step also runs kernels on the other GPUs (its layers there) and copies between them. Those are
recorded into the same graph when, inside the capture, each other GPU's current stream is a
side stream that waits on the capture stream first (which makes it part of the capture) and
that the capture stream waits on last (the capture ends joined). torch's cross-device copies
already order the two devices' current streams both ways, so the layers' data follow. A CUDA
graph may hold nodes on several devices; replaying it on the head's stream runs them all.

The tensors the step allocates on the other GPUs must outlive the capture at fixed addresses,
as the capture device's do in the graph's pool: the caching allocator routes this thread's
allocations there to a private pool of their own (`OtherGpuPools`), held as long as the
engine. Like the engine's own pool, one pool per GPU serves every graph (the engine replays
one graph at a time).
"""

from __future__ import annotations

import contextlib
import weakref

import torch


def _release(devices: tuple[int, ...], pool) -> None:
    for device in devices:
        torch._C._cuda_releasePool(device, pool)


class OtherGpuPools:
    """A private memory pool on each GPU in `devices` (beside the capture's) for the
    tensors that captured steps allocate there."""

    def __init__(self, devices: tuple[torch.device, ...]):
        self.devices = tuple(torch.device(d).index for d in devices)
        self.id = torch.cuda.graph_pool_handle()
        self.sides = [torch.cuda.Stream(device=device) for device in self.devices]
        for device in self.devices:
            # Creates the pool with one use, the engine's: it then outlives every graph and
            # every capture, the way the engine's anchor graph keeps the capture pool.
            torch._C._cuda_beginAllocateCurrentThreadToPool(device, self.id)
            torch._C._cuda_endAllocateToPool(device, self.id)
        weakref.finalize(self, _release, self.devices, self.id)

    def reserved(self) -> int:
        """Bytes the caching allocator reserves on these GPUs (their growth during a capture
        is the graph's)."""
        return sum(torch.cuda.memory_reserved(device) for device in self.devices)

    def synchronize(self) -> None:
        for device in self.devices:
            torch.cuda.synchronize(device)

    @contextlib.contextmanager
    def joined(self):
        """Inside a capture (on the current stream): the work on these GPUs recorded into
        the same graph and allocated in their pools. The current device stays the capture's
        (Triton launches its kernels on the current device)."""
        head_device = torch.cuda.current_device()
        capture_stream = torch.cuda.current_stream()
        with contextlib.ExitStack() as stack:
            for device, side in zip(self.devices, self.sides):
                side.wait_stream(capture_stream)
                # Entering a stream makes its device current until exit: restored below.
                stack.enter_context(torch.cuda.stream(side))
                torch._C._cuda_beginAllocateCurrentThreadToPool(device, self.id)
                stack.callback(self._end, device)
            stack.enter_context(torch.cuda.device(head_device))
            try:
                yield
            finally:
                for side in self.sides:
                    capture_stream.wait_stream(side)

    def _end(self, device: int) -> None:
        torch._C._cuda_endAllocateToPool(device, self.id)
        torch._C._cuda_releasePool(device, self.id)
