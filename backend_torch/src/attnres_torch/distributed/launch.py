"""Run a function on a local gloo world of `world_size` CPU processes (tests, CPU experiments).

On real clusters use `torchrun` (docs/distributed.md); this launcher exists so that the
distributed code paths can be exercised on one machine without a GPU.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, queue) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size)
    except BaseException:  # report any failure of a rank to the parent
        queue.put((rank, False, traceback.format_exc()))
        return
    try:
        queue.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        # Reported before the process group goes down: the peers' "connection closed" errors
        # that its teardown causes reach the parent after this root cause.
        queue.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_local(fn: Callable[..., Any], world_size: int, *args, timeout: float = 120.0,
              start_method: str = "fork") -> List[Any]:
    """Start `world_size` processes, initialize a gloo process group in each, call
    `fn(rank, world_size, *args)` and return the list of its (picklable) results by rank.

    Raises RuntimeError with the failing rank's traceback if any rank raised, or on timeout.
    `start_method="fork"` reuses the parent's imported modules (fast); use "spawn" where the
    parent has started threads that a fork would copy in a locked state.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    ctx = mp.get_context(start_method)
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_entry, args=(r, world_size, init_file, fn, args, queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict = {}
        failures = []
        try:
            for _ in range(world_size):
                rank, ok, value = _get(queue, procs, timeout)
                (results.__setitem__(rank, value) if ok else failures.append((rank, value)))
                if failures:
                    break
        finally:
            for p in procs:
                p.join(timeout=5 if not failures else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
    if failures:
        rank, tb = failures[0]
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{tb}")
    return [results[r] for r in range(world_size)]


def _get(queue, procs, timeout: float):
    """Next (rank, ok, value) from the queue; raises if every process died without reporting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not queue.empty():
            return queue.get()
        if all(not p.is_alive() for p in procs) and queue.empty():
            codes = [p.exitcode for p in procs]
            raise RuntimeError(f"every rank exited without reporting (exit codes {codes})")
        time.sleep(0.01)
    raise RuntimeError(f"local world timed out after {timeout} s")
