"""An in-process group: N workers on threads of this process (``gradzip.simulate``).

The same math as a real process group, for tests and quick experiments. Each collective
is a rendezvous: a worker deposits its tensor and gets a :class:`Work` at once (the call
never blocks, so collectives are asynchronous like ``async_op=True`` in torch); the last
worker to arrive computes the result, summing in rank order, so every worker gets the
same bits. A worker that fails (raises) breaks the group: every peer waiting on it gets a
:class:`PeerFailure` naming the lost rank instead of hanging, and ``simulate`` re-raises
the original error.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from ..errors import GradzipError
from .base import Group, Work

DEFAULT_TIMEOUT_S = 300.0


class PeerFailure(RuntimeError):
    """A peer of this worker failed or never arrived at a collective."""


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

    def fail(self, rank: int, exc: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = (rank, exc)
            self.cond.notify_all()

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
            if slot.arrived == self.world_size:
                slot.result = combine(slot.inputs)
                slot.inputs = None
                self.cond.notify_all()
            return slot

    def collect(self, seq: int, rank: int, slot: _Slot) -> Any:
        with self.cond:
            self.cond.wait_for(
                lambda: slot.inputs is None or self.failure is not None, self.timeout_s
            )
            if slot.inputs is not None:
                self._check_failure(rank)
                missing = [r for r, v in enumerate(slot.inputs) if v is None]
                raise PeerFailure(
                    f"rank {rank} waited {self.timeout_s:.0f} s in collective #{seq} "
                    f"({slot.kind}) for rank(s) {missing}, which never arrived"
                )
            slot.fetched += 1
            if slot.fetched == self.world_size:
                del self.slots[seq]
            return slot.result

    def _check_failure(self, rank: int) -> None:
        if self.failure is not None and self.failure[0] != rank:
            lost, exc = self.failure
            raise PeerFailure(f"rank {rank}: peer rank {lost} failed ({type(exc).__name__}: {exc})")


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

    def new_group(self) -> "ThreadGroup":
        timeout = self._hub.timeout_s
        work = self._launch("new_group", True, 0, lambda _: _Hub(self.world_size, timeout),
                            lambda hub: ThreadGroup(hub, self.rank))
        return work.wait()

    def _allreduce(self, tensor, nbytes):
        return self._launch("allreduce", tensor, nbytes, _sum_in_rank_order, tensor.copy_)

    def _allgather(self, tensor, nbytes):
        return self._launch("allgather", tensor, nbytes, torch.stack, torch.Tensor.clone)

    def _broadcast(self, tensor, src, nbytes):
        return self._launch(f"broadcast(src={src})", tensor, nbytes,
                            lambda xs: xs[src].clone(), tensor.copy_)


def make_group(world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[ThreadGroup]:
    """The ``world_size`` worker handles of one new in-process group."""
    if not isinstance(world_size, int) or world_size < 1:
        raise GradzipError(f"the number of workers must be an integer >= 1, got {world_size!r}")
    hub = _Hub(world_size, timeout_s)
    return [ThreadGroup(hub, r) for r in range(world_size)]


def simulate(world_size: int, fn: Callable[[ThreadGroup], Any], *,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run ``fn(comm)`` for ranks ``0..n-1`` on threads of this process; their results in
    rank order. If a worker raises, its peers are released and its exception re-raised."""
    groups = make_group(world_size, timeout_s)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def run(group: ThreadGroup) -> None:
        try:
            results[group.rank] = fn(group)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors[group.rank] = exc
            group._hub.fail(group.rank, exc)

    threads = [threading.Thread(target=run, args=(g,), name=f"gradzip-rank{g.rank}", daemon=True)
               for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    root_causes = [e for e in errors if e is not None and not isinstance(e, PeerFailure)]
    first = root_causes[0] if root_causes else next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
