"""Start N real worker processes on this machine, joined by a gloo group on 127.0.0.1.

``run_processes(n, fn, *args)`` spawns ``n`` processes (a free TCP port is chosen
automatically), sets torchrun's environment variables in each, initialises
``torch.distributed`` and calls ``fn(comm, *args)`` with the process's
:class:`~gradzip.comm.TorchGroup`; it returns the ``n`` results in rank order. ``fn`` must
be importable (a module-level function). If any worker raises, the others are stopped
and the first failure is re-raised here with the worker's traceback attached; a worker
that dies without a word (killed, segfault) is reported by rank and exit code.
"""
from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from .errors import GradzipError

#: Seconds the other workers get to finish after one failed, before they are terminated.
GRACE_S = 5.0


class WorkerError(RuntimeError):
    """A worker process failed; the message carries its rank and traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, timeout_s: float, results, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    from .comm import init_from_env

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        group = init_from_env(timeout_s=timeout_s)
        out = fn(group, *args)
        # plain pickle: tensors travel by value, not as shared memory that dies with us
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        try:
            results.put((rank, "error", pickle.dumps((exc, traceback.format_exc()))))
        except Exception:  # the exception does not pickle
            results.put((rank, "error", pickle.dumps((None, traceback.format_exc()))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_processes(world_size: int, fn: Callable[..., Any], *args: Any,
                  timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(comm, *args)`` on ``world_size`` gloo processes; results in rank order."""
    if not isinstance(world_size, int) or world_size < 1:
        raise GradzipError(f"the number of worker processes must be an integer >= 1, got {world_size!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, timeout_s, results, fn, args),
                         name=f"gradzip-rank{r}", daemon=False) for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    failure: tuple[int, BaseException | None, str] | None = None
    try:
        while len(outputs) < world_size and failure is None:
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in outputs]
                if dead:
                    r, code = dead[0]
                    failure = (r, None, f"worker rank {r} exited with code {code} without reporting")
                continue
            if status == "ok":
                outputs[rank] = pickle.loads(payload)
            else:
                failure = (rank, *pickle.loads(payload))
        if failure is not None:
            rank, exc, tb = failure
            if isinstance(exc, GradzipError):
                raise exc
            raise WorkerError(f"worker rank {rank} failed:\n{tb}") from exc
        return [outputs[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=GRACE_S if failure is None else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
