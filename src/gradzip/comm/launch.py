"""Start N real worker processes on this machine, joined by a gloo group on 127.0.0.1.

``run_processes(n, fn, *args)`` spawns ``n`` processes (a free TCP port is chosen
automatically), sets torchrun's environment variables in each, initialises
``torch.distributed`` and calls ``fn(comm, *args)`` with the process's
:class:`~gradzip.comm.TorchGroup`; it returns the ``n`` results in rank order. ``fn`` must
be importable (a module-level function). If any worker raises, the others are stopped
and the first failure is re-raised here with the worker's traceback attached; a worker
that dies without a word (killed, segfault) is reported by rank and signal, together with
what the survivors reported (their :class:`~gradzip.comm.PeerFailure` naming it: they are
given up to ``SETTLE_S`` to notice).

Like torchrun's agent, this parent process hosts the c10d store the workers rendezvous
on (``TORCHELASTIC_USE_AGENT_STORE``), so the store, and with it the workers' heartbeats,
outlive the death of any worker, rank 0 included.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import allocator
from . import init_from_env
from .base import DEFAULT_TIMEOUT_S, PeerFailure, check_timeout, check_world_size
from .liveness import announce_failure, record_launch
from ..errors import GradzipError

#: Seconds the other workers get to finish after one failed, before they are terminated.
GRACE_S = 5.0
#: Once a worker died or gave up on a peer, seconds the others get to report their own view
#: (a peer dies: they notice it at once on this machine, within STALE_S elsewhere).
SETTLE_S = 5.0
#: Seconds before a rank that the others blame, and that is still running, counts as stuck
#: (a dead one shows up as a death meanwhile, even when its exit is slow under load).
BLAMED_GRACE_S = 2.0
#: Host the c10d store in this (parent) process, as torchrun's agent does; False: rank 0
#: hosts it (plain env:// rendezvous), and its death takes the store with it.
HOST_STORE_IN_PARENT = True


class WorkerError(RuntimeError):
    """A worker process failed; the message carries its rank and traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(parent_pid: int) -> None:
    """End this process when its parent (the launcher) dies, by SIGKILL or otherwise: the
    kernel's parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG)``), and, as a fallback
    for other systems (and for a parent gone before the call), a daemon thread that
    checks the parent's pid every ``PARENT_POLL_S`` seconds."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass
    if os.getppid() != parent_pid:  # gone already, before the signal was armed
        os._exit(_ORPHANED)

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent_pid:
                os._exit(_ORPHANED)
    threading.Thread(target=watch, name="gradzip-parent-watch", daemon=True).start()


_PR_SET_PDEATHSIG = 1
_ORPHANED = 70
#: Seconds between a worker's checks that its launcher is alive (the fallback to the parent-death signal).
PARENT_POLL_S = 1.0


def worker_threads(world_size: int) -> int:
    """Torch's intra-op thread count in each of ``world_size`` local workers: the
    ``OMP_NUM_THREADS`` the launcher was given (as torchrun does; it changes the numbers,
    docs/reliability.md "Determinism"), else an equal share of the machine's cores."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) >= 1:
        return int(given)
    return max(1, (os.cpu_count() or 1) // world_size)


def _worker(rank: int, world_size: int, port: int, agent_store: bool, timeout_s: float, results,
            fn, args, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      TORCHELASTIC_USE_AGENT_STORE=str(agent_store))
    torch.set_num_threads(worker_threads(world_size))
    try:
        group = init_from_env(timeout_s=timeout_s)
        out = fn(group, *args)
        # plain pickle: tensors travel by value, not as shared memory that dies with us
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        announce_failure(exc)  # the peers' errors then name this rank and exc
        try:
            results.put((rank, "error", pickle.dumps((exc, traceback.format_exc()))))
        except Exception:  # the exception does not pickle
            results.put((rank, "error", pickle.dumps((None, traceback.format_exc()))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _leave(results)


def _leave(results) -> None:
    """End this worker once its report is on its way: the queue's pipe flushed, stdout and
    stderr too, then out without the interpreter's finalisation, which tearing down torch's
    modules makes take 1 to 5 s on a loaded machine while the launcher waits for every
    worker's exit (docs/benchmarks/startup.md). The exit code is 0 either way: a
    failure travels in the report."""
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_processes(world_size: int, fn: Callable[..., Any], *args: Any,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run ``fn(comm, *args)`` on ``world_size`` gloo processes; results in rank order.

    ``timeout_s`` bounds every collective: a worker that dies or hangs makes the others
    raise :class:`~gradzip.comm.PeerFailure` naming it (at once for a death, after about
    ``timeout_s`` for a hang), and this call raises :class:`WorkerError` (a worker's own
    :class:`~gradzip.errors.GradzipError` is re-raised as it is)."""
    check_world_size(world_size, "worker processes")
    timeout_s = check_timeout(timeout_s)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = None
    if HOST_STORE_IN_PARENT:
        store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        port = store.port
    else:
        port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, store is not None, timeout_s, results,
                                               fn, args, os.getpid()),
                         name=f"gradzip-rank{r}", daemon=False) for r in range(world_size)]
    with _environment(allocator.worker_env()):   # read by the spawned interpreters
        for r, p in enumerate(procs):
            p.start()
            if store is not None:   # a worker that never reaches the rendezvous is then named with its state
                record_launch(store, r, p.pid)
    outputs: dict[int, Any] = {}
    reports: dict[int, tuple[BaseException | None, str]] = {}  # rank -> (exception, traceback)
    deaths: dict[int, int] = {}  # rank -> exit code, for workers gone without reporting
    failed_at = None
    try:
        while True:
            exited = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode is not None}
            try:  # drain what arrived (a worker reports before it exits)
                wait = 0.1
                while True:
                    rank, status, payload = results.get(timeout=wait)
                    wait = 0.0
                    if status == "ok":
                        outputs[rank] = pickle.loads(payload)
                    else:
                        reports[rank] = pickle.loads(payload)
            except queue.Empty:
                pass
            for r, code in exited.items():
                if r not in outputs and r not in reports and r not in deaths:
                    deaths[r] = code
            if not reports and not deaths:
                if len(outputs) == world_size:
                    return [outputs[r] for r in range(world_size)]
                continue
            failed_at = failed_at or time.monotonic()
            running = {r for r, p in enumerate(procs) if p.exitcode is None}
            if _settled(world_size, outputs, reports, deaths, running, time.monotonic() - failed_at):
                break
        _raise_failure(reports, deaths, [r for r, p in enumerate(procs) if p.is_alive()])
    finally:
        for p in procs:
            p.join(timeout=GRACE_S if failed_at is None else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=1)
            if p.is_alive():  # ignores SIGTERM, or stopped (SIGSTOP): left, it would hang our exit
                p.kill()
                p.join(timeout=2)
        del store  # after the workers: they must not see it go


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """This process's environment replaced by ``env`` for the block (children inherit it)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _settled(world_size: int, outputs: dict, reports: dict, deaths: dict, running: set[int],
             since_s: float) -> bool:
    """Whether a failed run's cause is known, ``since_s`` seconds after its first failure:
    a worker's own error; or every rank accounted for (finished, reported, dead, or blamed by
    the others and still running after :data:`BLAMED_GRACE_S`: stuck); or :data:`SETTLE_S`
    passed. The grace matters on a loaded machine: a SIGKILLed worker's sockets close, and
    its peers blame it, before its exit is seen here; counted at once as stuck, it would be
    reported as "still running" instead of killed."""
    if any(not isinstance(exc, PeerFailure) for exc, _ in reports.values()):
        return True
    accounted = set(outputs) | set(reports) | set(deaths)
    if since_s >= BLAMED_GRACE_S:
        accounted |= {r for exc, _ in reports.values() for r in exc.lost if r in running}
    return len(accounted) >= world_size or since_s >= SETTLE_S


def _raise_failure(reports: dict, deaths: dict, running: list[int]) -> None:
    """Raise the failure of a run: a worker's own error first, then a death, then the
    survivors' :class:`PeerFailure`; the others' views follow, one line each."""
    own = [r for r, (exc, _) in reports.items() if not isinstance(exc, PeerFailure)]
    if own:
        exc, tb = reports[own[0]]
        if isinstance(exc, GradzipError):
            raise exc
        raise WorkerError(f"worker rank {own[0]} failed:\n{tb}") from exc
    views = [f"  rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(reports.items())]
    stuck = [r for r in running if r not in reports]
    tail = f"\nstill running, terminated: rank(s) {stuck}" if stuck else ""
    if deaths:
        r, code = next(iter(deaths.items()))
        others = [f"  rank {q}: {_exit_text(c)} without reporting" for q, c in deaths.items() if q != r]
        text = f"worker rank {r} {_exit_text(code)} without reporting"
        if views or others:
            text += "; the others reported:\n" + "\n".join(views + others)
        raise WorkerError(text + tail)
    r = next(iter(reports))  # every report is a PeerFailure: its message says it all, no traceback
    exc, _ = reports[r]
    text = f"worker rank {r} failed: {exc}"
    if len(views) > 1:
        text += "; the others reported:\n" + "\n".join(v for v in views if not v.startswith(f"  rank {r}:"))
    raise WorkerError(text + tail.replace("\n", "; " if len(views) <= 1 else "\n")) from exc


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
