"""Run a function on R local processes joined in one process group (tests, demo).

gloo on the CPU; NCCL with one GPU per rank.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


COLLECTIVE_TIMEOUT_S = 300  # a rank that never arrives fails the others instead of hanging them
START_METHOD_ENV = "MOONEP_START_METHOD"  # "forkserver" (default) or "spawn"


def _start_method() -> str:
    method = os.environ.get(START_METHOD_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_METHOD_ENV} must be 'forkserver' or 'spawn', got {method!r}")
    return method


def _context():
    """Rank processes start as forks of a server process that has imported torch and moonep_ops (Python's
    forkserver, started once per parent), not as fresh interpreters importing torch each (2-3 s of CPU
    per rank). The server also imports torch._dynamo, which every EPGroup imports for its buffers
    (mark_static): ~1.7 s of CPU a rank otherwise. The server never touches CUDA, so a rank may still
    pick its GPU; it starts with the parent's environment and output at that moment.
    MOONEP_START_METHOD=spawn starts fresh interpreters."""
    ctx = mp.get_context(_start_method())
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "moonep_ops"])
    return ctx


def _entry(rank: int, world_size: int, workdir: str, backend: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # R processes share the machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{workdir}/store", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(workdir, f"result{rank}.pt"))
        dist.barrier()  # no rank tears the group down while a peer is still in a collective
    finally:
        dist.destroy_process_group()
    # Done and saved: leave without interpreter teardown, where background threads (gloo, Inductor's
    # compile workers) sometimes abort the process ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _entry_no_teardown(rank: int, world_size: int, workdir: str, fn: Callable, args: tuple,
                       pg_timeout_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    result = fn(rank, world_size, *args)
    torch.save(result, os.path.join(workdir, f"result{rank}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no closing barrier: after a fault the ranks are out of step on purpose


def run_ranks_faulty(fn: Callable[..., Any], world_size: int, *args: Any, pg_timeout_s: float = 60,
                     join_timeout_s: float = 120) -> list[Any]:
    """Like run_ranks on gloo, for fault injection: a rank may exit or be killed (its result is None),
    the survivors leave without a closing barrier, and no rank outlives join_timeout_s (killed, None)."""
    ctx = _context()
    with tempfile.TemporaryDirectory() as workdir:
        procs = [ctx.Process(target=_entry_no_teardown, args=(r, world_size, workdir, fn, args, pg_timeout_s))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + join_timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        paths = [os.path.join(workdir, f"result{r}.pt") for r in range(world_size)]
        return [torch.load(p, weights_only=False) if os.path.exists(p) else None for p in paths]


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo") -> list[Any]:
    """fn(rank, world_size, *args) on `world_size` processes; returns every rank's result, by rank.

    `fn` must be importable (a module-level function); results travel through torch.save.
    """
    with tempfile.TemporaryDirectory() as workdir:
        mp.start_processes(_entry, args=(world_size, workdir, backend, fn, args), nprocs=world_size, join=True,
                           start_method=_context().get_start_method())
        return [torch.load(os.path.join(workdir, f"result{r}.pt"), weights_only=False) for r in range(world_size)]
