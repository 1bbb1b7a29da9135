"""CUDA graphs that hold NCCL collectives go before their process group.

NCCL does not destroy a communicator while a CUDA graph that captured one of its collectives
is alive: ``torch.distributed.destroy_process_group()`` then waits forever, on every rank,
with no error (pytorch/pytorch#115388; measured with a tensor-parallel model on 2 H200s,
2026-11-28: docs/notes/tp_capture.md). The engine of a tensor-parallel model captures its
steps with their collectives, and it lives on the model, which a script still holds when it
ends its process group. So the engines that hold such graphs register here (`hold`), and
``torch.distributed.destroy_process_group`` is wrapped, once, to release their graphs first
(`release_all`): every rank calls it, and each releases its own; the interpreter's exit
releases them too. A later call on such a model (in a new process group) captures its steps
again. A script that bound ``destroy_process_group`` by name before its first flashspec call
(``from torch.distributed import destroy_process_group``) calls the unwrapped function: it
must release the graphs first, ``flashspec.generation.teardown.release_all()``.
"""

from __future__ import annotations

import atexit
import functools
import gc
import weakref

import torch
import torch.distributed as dist

_HOLDERS: "weakref.WeakSet" = weakref.WeakSet()      # engines whose graphs hold collectives


def hold(engine) -> None:
    """`engine` (with a ``release()`` that drops its graphs) may capture collectives: its
    graphs are released before any process group is destroyed."""
    _HOLDERS.add(engine)
    _wrap_destroy()


def release_all() -> None:
    """Drop the graphs of every engine that `hold` registered, after the work queued on the
    current device."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for engine in list(_HOLDERS):
        engine.release()
    gc.collect()          # a graph held in a reference cycle must go now, not at the next pass


def _wrap_destroy() -> None:
    original = dist.destroy_process_group
    if getattr(original, "_releases_flashspec_graphs", False):
        return

    @functools.wraps(original)
    def destroy_process_group(*args, **kwargs):
        release_all()
        return original(*args, **kwargs)

    destroy_process_group._releases_flashspec_graphs = True
    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group
    atexit.register(release_all)
