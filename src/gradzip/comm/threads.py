"""An in-process group: N workers on threads of this process (``gradzip.simulate``).

The same math as a real process group, for tests and quick experiments. Each collective
is a rendezvous: a worker deposits its tensor and gets a :class:`Work` at once (the call
never blocks, so collectives are asynchronous like ``async_op=True`` in torch); the last
worker to arrive computes the result, summing in rank order, so every worker gets the
same bits. A worker that fails (raises) breaks the group: every peer waiting on it gets a
:class:`PeerFailure` naming the lost rank instead of hanging, and ``simulate`` re-raises
the original error. A worker whose function returns while its peers still wait for it
releases them the same way; one that is stuck (never arrives within ``timeout_s``) is
named, with what it last did and where it is, by the peers that waited for it. A worker
left behind (busy ``GRACE_S`` after a peer failed) stops at its next collective; the
interpreter waits for it at exit (up to ``EXIT_WAIT_S``), since one torn down inside native
code (a kernel, a compiler) aborts the process instead of exiting with the error.

The workers share the process's memory, so two of them could be handed the same
parameters (one model built outside ``fn``): their updates would race, a hang or a crash.
:meth:`ThreadGroup.claim` (every optimizer claims its parameters) refuses that at once.
"""
from __future__ import annotations

import atexit
import queue
import sys
import sysconfig
import threading
import time
import traceback
import weakref
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import GradzipError
from .base import DEFAULT_TIMEOUT_S, TIMEOUT_HINT, Group, PeerFailure, Work, check_timeout, check_world_size, ranks_text

#: Seconds ``simulate`` waits for the other workers once one failed; a worker still running
#: then (stuck outside any collective) is left behind as a daemon thread.
GRACE_S = 2.0
#: Seconds the interpreter waits at exit for the workers ``simulate`` left behind.
EXIT_WAIT_S = 30.0
_left_behind: list[threading.Thread] = []


@atexit.register
def _join_left_behind() -> None:
    """At exit: wait for the worker threads ``simulate`` left behind (the group failed, so
    each stops at its next collective), saying so."""
    alive = [t for t in _left_behind if t.is_alive()]
    if alive:
        print(f"gradzip.simulate: waiting up to {EXIT_WAIT_S:g} s for {len(alive)} worker thread(s) left behind "
              "after a failure to stop", file=sys.stderr, flush=True)
    deadline = time.monotonic() + EXIT_WAIT_S
    for t in alive:
        t.join(max(0.0, deadline - time.monotonic()))


class _Slot:
    __slots__ = ("kind", "inputs", "arrived", "result", "fetched")

    def __init__(self, kind: str, n: int):
        self.kind = kind
        self.inputs: list[Any] = [None] * n
        self.arrived = 0
        self.result: Any = None
        self.fetched = 0


class _Hub:
    """State shared by the N workers of one in-process group."""

    def __init__(self, world_size: int, timeout_s: float):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.cond = threading.Condition()
        self.slots: dict[int, _Slot] = {}
        self.failure: tuple[int, BaseException] | None = None
        self.left: set[int] = set()  # ranks whose worker function returned
        # per rank: (seq, kind, monotonic time, thread id) of its latest collective
        self.last: list[tuple[int, str, float, int] | None] = [None] * world_size
        self.children: list[_Hub] = []  # groups made by new_group(): they fail with this one
        self.owners: dict[int, tuple[int, weakref.ref]] = {}  # id(tensor) -> (rank, the tensor), claim()
        self.watchers: list[Callable[[int, BaseException | None], None]] = []  # ThreadGroup.watch

    def fail(self, rank: int, exc: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = (rank, exc)
            self.cond.notify_all()
            children, watchers = list(self.children), list(self.watchers)
        for child in children:
            child.fail(rank, exc)
        for watcher in watchers:
            watcher(rank, exc)

    def leave(self, rank: int) -> None:
        """Rank ``rank`` will issue no more collectives (its worker function returned).
        Not passed on to groups made by ``new_group()``: a background thread may still be
        finishing an exchange there."""
        with self.cond:
            self.left.add(rank)
            self.cond.notify_all()
            watchers = list(self.watchers)
        for watcher in watchers:
            watcher(rank, None)

    def deposit(self, seq: int, rank: int, kind: str, value: Any,
                combine: Callable[[list[Any]], Any]) -> _Slot:
        with self.cond:
            self._check_failure(rank)
            slot = self.slots.setdefault(seq, _Slot(kind, self.world_size))
            if slot.kind != kind:
                raise GradzipError(
                    f"collective #{seq}: rank {rank} called {kind} while another rank called "
                    f"{slot.kind}; every worker must issue the same collectives in the same order"
                )
            slot.inputs[rank] = value
            slot.arrived += 1
            self.last[rank] = (seq, kind, time.monotonic(), threading.get_ident())
            if slot.arrived == self.world_size:
                slot.result = combine(slot.inputs)
                slot.inputs = None
                self.cond.notify_all()
            return slot

    def collect(self, seq: int, rank: int, slot: _Slot) -> Any:
        def missing() -> list[int]:
            return [r for r, v in enumerate(slot.inputs) if v is None]

        with self.cond:
            self.cond.wait_for(
                lambda: slot.inputs is None or self.failure is not None
                or any(r in self.left for r in missing()), self.timeout_s
            )
            if slot.inputs is not None:
                self._check_failure(rank)
                what = f"{slot.kind} #{seq}"
                gone = [r for r in missing() if r in self.left]
                if gone:
                    raise PeerFailure(
                        f"rank {rank}: peer {ranks_text(gone)} returned from its worker function "
                        f"without joining {what}", rank=rank, lost=gone, collective=what)
                stuck = missing()
                raise PeerFailure(
                    f"rank {rank}: peer {ranks_text(stuck)} is stuck: it did not start {what} within "
                    f"the timeout ({'; '.join(self._doing(r) for r in stuck)}) "
                    f"(timeout {self.timeout_s:g} s; {TIMEOUT_HINT})",
                    rank=rank, lost=stuck, collective=what)
            slot.fetched += 1
            if slot.fetched == self.world_size:
                del self.slots[seq]
            return slot.result

    def _check_failure(self, rank: int) -> None:
        if self.failure is not None and self.failure[0] != rank:
            raise peer_failed(rank, *self.failure)

    def _doing(self, rank: int) -> str:
        """What worker ``rank`` was last seen doing (called with ``cond`` held)."""
        last = self.last[rank]
        if last is None:
            return f"rank {rank} has not started any collective of this group"
        seq, kind, began, ident = last
        text = f"rank {rank}'s last collective, {kind} #{seq}, began {time.monotonic() - began:.1f} s ago"
        frame = sys._current_frames().get(ident)
        if frame is None:
            return text + "; its thread has ended"
        return text + f"; it is now at {_where(frame)}"


def peer_failed(rank: int, lost: int, exc: BaseException) -> PeerFailure:
    """What worker ``rank`` raises once peer ``lost`` of its in-process group failed with
    ``exc``: a :class:`PeerFailure` naming ``lost`` and its error, or, where ``lost`` itself
    gave up on other peers, naming those."""
    if isinstance(exc, PeerFailure) and exc.lost and rank not in exc.lost:
        # the peer gave up on someone else: blame the same rank(s)
        found = str(exc).removeprefix(f"rank {lost}: ")
        return PeerFailure(f"rank {rank}: rank {lost} found that {found}",
                           rank=rank, lost=exc.lost, collective=exc.collective)
    return PeerFailure(f"rank {rank}: peer rank {lost} failed ({type(exc).__name__}: {exc})",
                       rank=rank, lost=(lost,))


def _where(frame) -> str:
    """``file:line in function`` of the innermost frame of ``frame``'s stack outside the
    standard library (a thread waiting on an Event is shown where it called ``wait``)."""
    stack = traceback.extract_stack(frame)
    stdlib = sysconfig.get_paths()["stdlib"]
    outside = [f for f in stack if not f.filename.startswith(stdlib)] or stack
    where = outside[-1]
    return f"{Path(where.filename).name}:{where.lineno} in {where.name}"




def _sum_in_rank_order(inputs: list[torch.Tensor]) -> torch.Tensor:
    total = inputs[0].clone()
    for t in inputs[1:]:
        total.add_(t)
    return total


class ThreadGroup(Group):
    """Worker ``rank`` of an in-process group (create all of them with :func:`make_group`)."""

    def __init__(self, hub: _Hub, rank: int):
        super().__init__()
        self._hub = hub
        self.rank = rank
        self.world_size = hub.world_size
        self._seq = 0

    def _launch(self, kind: str, value: Any, nbytes: int, combine, finish) -> Work:
        seq = self._seq
        self._seq += 1
        slot = self._hub.deposit(seq, self.rank, kind, value, combine)
        return Work(lambda: finish(self._hub.collect(seq, self.rank, slot)), nbytes)

    def claim(self, tensors, owner: str) -> None:
        """Refuse a tensor another worker of this group claimed (one model shared by the
        workers of ``simulate``), naming the fix; else record this worker's."""
        hub = self._hub
        with hub.cond:
            for t in tensors:
                rank, ref = hub.owners.get(id(t), (self.rank, None))
                if rank != self.rank and ref() is t:
                    raise GradzipError(
                        f"{owner}: rank {self.rank} was given a tensor of shape {tuple(t.shape)} that rank {rank} "
                        "updates too: the workers of one simulate() share the same parameters, so their updates "
                        "would race (a hang or a crash). Build the model inside the worker function, one per "
                        "worker, and start them equal with gradzip.broadcast_parameters(model, comm=comm)")
            for t in tensors:
                hub.owners[id(t)] = (self.rank, weakref.ref(t))
    def watch(self, callback: Callable[[int, BaseException | None], None]) -> None:
        """Call ``callback(rank, exc)`` when the worker of ``rank`` fails with ``exc`` (as
        ``simulate`` reports it, to this group and the groups made from it), and, on the
        group ``simulate`` made, ``callback(rank, None)`` when its worker function returns.
        For objects the workers share (:func:`gradzip.comm.p2p.shared_object`) whose own
        waits must end as the group's collectives do. Called in the thread of worker
        ``rank``, no lock held; register once per object (from any one rank)."""
        with self._hub.cond:
            self._hub.watchers.append(callback)

    def new_group(self) -> "ThreadGroup":
        parent = self._hub

        def make(_):
            child = _Hub(self.world_size, parent.timeout_s)
            parent.children.append(child)  # called with parent.cond held
            return child

        work = self._launch("new_group", True, 0, make, lambda hub: ThreadGroup(hub, self.rank))
        return work.wait()

    def _allreduce(self, tensor, nbytes):
        return self._launch("allreduce", tensor, nbytes, _sum_in_rank_order, tensor.copy_)

    def _allgather(self, tensor, nbytes):
        return self._launch("allgather", tensor, nbytes, torch.stack, torch.Tensor.clone)

    def _broadcast(self, tensor, src, nbytes):
        return self._launch(f"broadcast(src={src})", tensor, nbytes,
                            lambda xs: xs[src].clone(), tensor.copy_)

    def _all_to_all(self, tensors, recv_sizes, nbytes):
        rank = self.rank

        def finish(everyone):
            got = [everyone[i][rank] for i in range(self.world_size)]
            wrong = [i for i, (t, size) in enumerate(zip(got, recv_sizes)) if t.numel() != size]
            if wrong:
                i = wrong[0]
                raise GradzipError(f"all_to_all: rank {rank} expected {recv_sizes[i]} elements from rank {i}, "
                                   f"which sent {got[i].numel()}; pass the sizes each worker sends")
            return [t.clone() for t in got]

        return self._launch("all_to_all", list(tensors), nbytes, list, finish)

    def _reduce_scatter(self, tensor, nbytes):
        return self._launch("reduce_scatter", tensor, nbytes, _sum_in_rank_order,
                            lambda total: total[self.rank].clone())

    def _split(self, parts):
        parent = self._hub
        mine = next(i for i, p in enumerate(parts) if self.rank in p)

        def make(inputs):
            if any(x != inputs[0] for x in inputs):
                raise GradzipError(f"split: the workers gave different parts ({inputs[0]} and others); "
                                   "every worker must pass the same parts")
            hubs = [_Hub(len(p), parent.timeout_s) for p in inputs[0]]
            parent.children.extend(hubs)  # called with parent.cond held
            return hubs

        work = self._launch("split", parts, 0, make, lambda hubs: ThreadGroup(hubs[mine], sorted(parts[mine]).index(self.rank)))
        return work.wait()


def make_group(world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[ThreadGroup]:
    """The ``world_size`` worker handles of one new in-process group."""
    check_world_size(world_size)
    hub = _Hub(world_size, check_timeout(timeout_s))
    return [ThreadGroup(hub, r) for r in range(world_size)]


def simulate(world_size: int, fn: Callable[[ThreadGroup], Any], *,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run ``fn(comm)`` for ranks ``0..n-1`` on threads of this process; their results in
    rank order. If a worker raises, its peers are released and its exception re-raised
    (the root cause, not the peers' :class:`PeerFailure`). Never hangs on a stuck worker:
    its peers time out after ``timeout_s`` naming it, and ``GRACE_S`` after the first failure
    the workers still running are left behind (daemon threads) and the error is raised.
    Every other worker's thread has ended when it returns or raises (each is joined: a
    thread still freeing its state when the interpreter finalises can abort the process)."""
    groups = make_group(world_size, timeout_s)
    if not callable(fn):
        raise GradzipError(f"simulate() runs fn(comm) on every worker: fn must be callable, got {fn!r}")
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    finished: queue.SimpleQueue[int] = queue.SimpleQueue()

    def run(group: ThreadGroup) -> None:
        try:
            results[group.rank] = fn(group)
            group._hub.leave(group.rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors[group.rank] = exc
            group._hub.fail(group.rank, exc)
        finally:
            finished.put(group.rank)

    threads = [threading.Thread(target=run, args=(g,), name=f"gradzip-rank{g.rank}", daemon=True)
               for g in groups]
    for t in threads:
        t.start()
    running, give_up_at = set(range(world_size)), None
    while running:
        try:
            wait = None if give_up_at is None else max(0.0, give_up_at - time.monotonic())
            running.discard(finished.get(timeout=wait))
        except queue.Empty:
            break
        if give_up_at is None and any(e is not None for e in errors):
            give_up_at = time.monotonic() + GRACE_S
    for t, group in zip(threads, groups):
        if group.rank not in running:
            # Its function has returned, but the thread still frees its state (thread-local
            # tensors: kernels' scratch buffers, ...). Returning before it ends lets the caller
            # finalise the interpreter meanwhile: torch then releases the GIL while freeing a
            # tensor, the thread is ended when it takes the GIL back, inside a C++ destructor,
            # and the process aborts ("terminate called without an active exception").
            t.join(timeout_s)
    root_causes = [e for e in errors if e is not None and not isinstance(e, PeerFailure)]
    origin = groups[0]._hub.failure  # the first to fail: the others may relay its PeerFailure
    first = root_causes[0] if root_causes else origin[1] if origin is not None else \
        next((e for e in errors if e is not None), None)
    if first is not None:
        if running and hasattr(first, "add_note"):
            first.add_note(f"simulate: {ranks_text(running)} still running {GRACE_S:g} s after the first "
                           "failure; left behind (daemon threads)")
        _left_behind.extend(threads[r] for r in running)
        raise first
    return results
