"""Capturing the steps of a model that accelerate spread over several GPUs (``device_map``).

`torch.cuda.graph` captures the work of one stream on one device: the head's GPU's capture
stream, with its allocations in one private memory pool there. A device_map model's step also
runs kernels on the other GPUs (its layers there) and copies between them. Those are recorded
into the same graph when, inside the capture, each other GPU's current stream is a side stream
that waits on the capture stream first (which makes it part of the capture) and that the
capture stream waits on last (the capture ends joined). torch's cross-device copies already
order the two devices' current streams both ways, so the layers' data follow. A CUDA graph may
hold nodes on several devices; replaying it on the head's stream runs them all.

The tensors the step allocates on the other GPUs must keep their addresses for as long as a
graph may replay, as the head's do in the graph's pool: the caching allocator routes this
thread's allocations there, during a capture, to a private pool on each GPU, which the
`OtherGpus` object holds (the engine keeps it as long as it keeps graphs). Like the engine's
own pool, one pool per GPU serves every graph (the engine replays one graph at a time).

Outside the graphs, work on the other GPUs (a prefill's layers, a compaction of their KV
caches) runs on their current streams, which a replay on the head's stream does not wait for
by itself: `wait_for_eager_work` orders it before each replay.
"""

from __future__ import annotations

import contextlib
import weakref

import torch


def _release(devices: tuple[int, ...], pool) -> None:
    for device in devices:
        torch._C._cuda_releasePool(device, pool)


class OtherGpus:
    """The GPUs in `devices` (a spread model's, beside its head's) as a capture sees them:
    a side stream and a private memory pool on each."""

    def __init__(self, devices: tuple[torch.device, ...]):
        self.devices = tuple(torch.device(d).index for d in devices)
        self.pool = torch.cuda.graph_pool_handle()
        self.sides = [torch.cuda.Stream(device=device) for device in self.devices]
        for device in self.devices:
            # Creates the pool with one use, this object's: it then outlives every capture
            # (the allocator frees a private pool's memory once its uses drop to none).
            torch._C._cuda_beginAllocateCurrentThreadToPool(device, self.pool)
            torch._C._cuda_endAllocateToPool(device, self.pool)
        weakref.finalize(self, _release, self.devices, self.pool)

    def reserved(self) -> int:
        """Bytes the caching allocator reserves on these GPUs (their growth during a capture
        is the graph's)."""
        return sum(torch.cuda.memory_reserved(device) for device in self.devices)

    def synchronize(self) -> None:
        for device in self.devices:
            torch.cuda.synchronize(device)

    def wait_for_eager_work(self) -> None:
        """Make the current stream (the head's, which replays) wait for the work queued so
        far on these GPUs' current streams."""
        stream = torch.cuda.current_stream()
        for device in self.devices:
            stream.wait_stream(torch.cuda.current_stream(device))

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
                torch._C._cuda_beginAllocateCurrentThreadToPool(device, self.pool)
                stack.callback(self._end, device)
            stack.enter_context(torch.cuda.device(head_device))
            try:
                yield
            finally:
                for side in self.sides:
                    capture_stream.wait_stream(side)

    def _end(self, device: int) -> None:
        torch._C._cuda_endAllocateToPool(device, self.pool)
        torch._C._cuda_releasePool(device, self.pool)
