"""CUDA graphs that hold NCCL collectives go before their process group.

NCCL does not destroy a communicator while a CUDA graph that captured one of its collectives
is alive: ``torch.distributed.destroy_process_group()`` then waits forever, on every rank,
with no error (pytorch/pytorch#115388; measured with a tensor-parallel model on 2 H200s,
2026-11-28: docs/notes/tp_capture.md). The engine of a tensor-parallel model captures its
steps with their collectives, and it lives on the model, which a script still holds when it
ends its process group. So the engines that hold such graphs register here (`hold`), and
``torch.distributed.destroy_process_group`` is wrapped, once, to release the graphs of the
group it destroys first (`release_all`): every rank calls it, and each releases its own; the
interpreter's exit releases them too. A later call on such a model (in a new process group)
captures its steps again. A script that bound ``destroy_process_group`` by name before its
first flashspec call (``from torch.distributed import destroy_process_group``) calls the
unwrapped function: it must release the graphs first,
``flashspec.generation.teardown.release_all()``.
"""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import weakref

import torch
import torch.distributed as dist

# Engines whose graphs may hold collectives -> the process group those run in (None: the
# default group).
_HOLDERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def hold(engine, group) -> None:
    """`engine` (with a ``release()`` that drops its graphs) may capture collectives of
    `group` (None: the default group): its graphs are released before that group, or the
    default group (which ends every group), is destroyed."""
    _HOLDERS[engine] = group
    _wrap_destroy()


def release_all(group=None) -> None:
    """Drop the graphs of the engines `hold` registered whose collectives run in `group`
    (None or the default group: all of them), after the work queued on the current device."""
    everything = group is None or group is dist.GroupMember.WORLD
    engines = [engine for engine, held in list(_HOLDERS.items())
               if everything or held is group]
    if not engines:
        return
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for engine in engines:
        engine.release()
    gc.collect()          # a graph held in a reference cycle must go now, not at the next pass


def _release_at_exit() -> None:
    """At the interpreter's exit, what a process group still alive would otherwise wait for;
    after a CUDA error (the device unusable) there is nothing left to release."""
    try:
        release_all()
    except RuntimeError as error:
        logging.getLogger("flashspec").warning("releasing CUDA graphs at exit failed: %s", error)


def _wrap_destroy() -> None:
    original = dist.destroy_process_group
    if getattr(original, "_releases_flashspec_graphs", False):
        return

    @functools.wraps(original)
    def destroy_process_group(*args, **kwargs):
        release_all(args[0] if args else kwargs.get("group"))
        return original(*args, **kwargs)

    destroy_process_group._releases_flashspec_graphs = True
    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group
    atexit.register(_release_at_exit)
