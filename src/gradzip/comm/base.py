"""The communication interface every method talks to (DESIGN.md, "comm").

A :class:`Group` is one worker's handle on a set of ``world_size`` workers. Collectives
take a tensor and return a :class:`Work` when ``async_op=True`` (``work.wait()`` gives the
result), else the result. Every collective adds to ``bytes_sent`` the bytes it puts on
the wire for *this* worker, under the bandwidth-optimal (ring) algorithms that NCCL and
gloo use for large messages:

* allreduce of ``B`` bytes: reduce-scatter + allgather, ``2 (n - 1) / n * B`` sent;
* allgather of ``B`` bytes from each worker: ``(n - 1) * B`` sent (every chunk forwarded);
* broadcast of ``B`` bytes: ``B`` sent by the source (pipelined), 0 by the others.

A world of one sends nothing. Empty tensors are not communicated at all.
"""
from __future__ import annotations

import abc
from typing import Any, Callable

import torch


class Work:
    """A pending collective: ``wait()`` blocks until it is done and returns its result."""

    __slots__ = ("_wait", "_result", "_done", "nbytes")

    def __init__(self, wait: Callable[[], Any], nbytes: int):
        self._wait = wait
        self._result = None
        self._done = False
        self.nbytes = nbytes  # bytes this worker put on the wire for this collective

    @classmethod
    def completed(cls, result: Any, nbytes: int = 0) -> "Work":
        work = cls(lambda: result, nbytes)
        return work

    def wait(self) -> Any:
        if not self._done:
            self._result = self._wait()
            self._done = True
            self._wait = None
        return self._result


def allreduce_wire_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one worker sends in a ring allreduce of ``nbytes``."""
    return 2 * (world_size - 1) * nbytes // world_size


def allgather_wire_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one worker sends in a ring allgather of ``nbytes`` per worker."""
    return (world_size - 1) * nbytes


class Group(abc.ABC):
    """One worker's view of a communication group."""

    rank: int
    world_size: int

    def __init__(self) -> None:
        self.bytes_sent = 0

    # -- public collectives (count bytes, skip empty tensors) ----------------------------
    def allreduce(self, tensor: torch.Tensor, async_op: bool = False):
        """Sum ``tensor`` over all workers, in place; the result is ``tensor``."""
        nbytes = allreduce_wire_bytes(_nbytes(tensor), self.world_size)
        work = self._counted(nbytes, tensor, lambda: self._allreduce(tensor, nbytes))
        return work if async_op else work.wait()

    def allgather(self, tensor: torch.Tensor, async_op: bool = False):
        """Every worker's ``tensor`` (same shape on all), stacked in rank order: ``(n, *shape)``."""
        nbytes = allgather_wire_bytes(_nbytes(tensor), self.world_size)
        if tensor.numel() == 0 or self.world_size == 1:
            gathered = tensor.unsqueeze(0).expand(self.world_size, *tensor.shape).clone()
            work = Work.completed(gathered)
        else:
            work = self._counted(nbytes, tensor, lambda: self._allgather(tensor, nbytes))
        return work if async_op else work.wait()

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """Overwrite ``tensor`` on every worker with ``src``'s, in place."""
        nbytes = _nbytes(tensor) if (self.rank == src and self.world_size > 1) else 0
        work = self._counted(nbytes, tensor, lambda: self._broadcast(tensor, src, nbytes))
        return work if async_op else work.wait()

    def barrier(self) -> None:
        self.allreduce(torch.zeros(1))

    def new_group(self) -> "Group":
        """A new group of the same workers with its own collective order, e.g. for
        exchanges that run on a background thread while this group is used by the
        training loop. Collective: every worker must call it, in the same order."""
        raise NotImplementedError(f"{type(self).__name__} cannot create a new group")

    def _counted(self, nbytes: int, tensor: torch.Tensor, launch: Callable[[], Work]) -> Work:
        if tensor.numel() == 0 or self.world_size == 1:
            return Work.completed(tensor, 0)
        self.bytes_sent += nbytes
        return launch()

    # -- what an implementation provides (async, returns Work) ---------------------------
    @abc.abstractmethod
    def _allreduce(self, tensor: torch.Tensor, nbytes: int) -> Work: ...

    @abc.abstractmethod
    def _allgather(self, tensor: torch.Tensor, nbytes: int) -> Work: ...

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int, nbytes: int) -> Work: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
