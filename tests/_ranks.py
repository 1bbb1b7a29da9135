"""Ranks of a process group for the distributed tests: `run_ranks` starts them and fails
the test with a rank's traceback, or after a timeout instead of hanging CI."""

from __future__ import annotations

import json
import time

import torch.multiprocessing as mp


def run_ranks(worker, world_size: int, args: tuple, report_file: str, preload: str,
              timeout_s: float) -> dict:
    """Runs ``worker(rank, world_size, *args, report_file)`` on `world_size` processes and
    returns the JSON that rank 0 wrote to `report_file`. A fork server imports `preload` (the
    test module, and flashspec with it: ~3 s) once, then forks every rank from its single
    thread; spawned ranks would each import it."""
    mp.set_forkserver_preload([preload])
    context = mp.start_processes(worker, args=(world_size, *args, report_file),
                                 nprocs=world_size, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} ranks still running after {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    with open(report_file) as f:
        return json.load(f)
