"""The communication interface every method talks to (docs/architecture.md, "Layers").

A :class:`Group` is one worker's handle on a set of ``world_size`` workers. Collectives
take a tensor and return a :class:`Work` when ``async_op=True`` (``work.wait()`` gives the
result), else the result. Every collective adds to ``bytes_sent`` the bytes it puts on
the wire for *this* worker, under the bandwidth-optimal (ring) algorithms that NCCL and
gloo use for large messages:

* allreduce of ``B`` bytes: reduce-scatter + allgather, ``2 (n - 1) / n * B`` sent;
* allgather of ``B`` bytes from each worker: ``(n - 1) * B`` sent (every chunk forwarded);
* broadcast of ``B`` bytes: ``B`` sent by the source (pipelined), 0 by the others;
* all-to-all: the bytes of the messages to the ``n - 1`` other workers (its own stays).

A world of one sends nothing. Empty tensors are not communicated at all.
"""
from __future__ import annotations

import abc
import numbers
import threading
from typing import Any, Callable

import torch

from ..errors import GradzipError
from ..validation import is_int, is_real

#: Seconds a collective waits for its peers unless told otherwise (``timeout_s=``, the
#: CLI's ``--timeout``): every group, the launcher and the CLI default to it.
DEFAULT_TIMEOUT_S = 300.0

#: Where a collective's timeout is set; every timeout message ends with this hint.
TIMEOUT_HINT = "change it with --timeout or timeout_s="


class PeerFailure(RuntimeError):
    """A peer of this worker died, left, or is stuck, so a collective cannot complete.

    The message names this worker's rank, the lost peer(s), the collective and the timeout.
    ``rank`` is the rank that raised it, ``lost`` the ranks it blames (empty when it could
    not tell) and ``collective`` the collective that failed (e.g. ``"allreduce #57"``).
    Raised by every :class:`Group` implementation (threads and ``torch.distributed``).
    """

    def __init__(self, message: str, *, rank: int | None = None, lost: tuple[int, ...] = (),
                 collective: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.lost = tuple(lost)
        self.collective = collective


def ranks_text(ranks) -> str:
    """``"rank 2"`` or ``"ranks 0, 3"``: ranks named in a message."""
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def check_world_size(n: Any, what: str = "workers") -> int:
    """``n`` unless it is not an integer >= 1 (a bool is not a count): :class:`GradzipError`."""
    if not is_int(n) or n < 1:
        raise GradzipError(f"the number of {what} must be an integer >= 1, got {n!r}")
    return n


def check_timeout(timeout_s: Any) -> float:
    """``timeout_s`` as a float, or :class:`GradzipError` unless it is a number of seconds
    in ``(0, threading.TIMEOUT_MAX]`` (every group checks its timeout with it)."""
    if not is_real(timeout_s, numbers.Real) or not 0 < timeout_s <= threading.TIMEOUT_MAX:
        raise GradzipError(f"timeout_s must be a number of seconds > 0 and <= {threading.TIMEOUT_MAX:g}, "
                           f"got {timeout_s!r}")
    return float(timeout_s)


class Work:
    """A pending collective: ``wait()`` blocks until it is done and returns its result.

    ``chain``: how a backend runs a function as soon as the collective completes (given
    ``fn``, a torch future of ``fn(result)``; :meth:`then`), None where it cannot."""

    __slots__ = ("_wait", "_result", "_done", "nbytes", "_chain")

    def __init__(self, wait: Callable[[], Any], nbytes: int,
                 chain: "Callable[[Callable[[Any], Any]], torch.futures.Future] | None" = None):
        self._wait = wait
        self._result = None
        self._done = False
        self.nbytes = nbytes  # bytes this worker put on the wire for this collective
        self._chain = chain

    def then(self, fn: Callable[[Any], Any]) -> "Work":
        """A :class:`Work` whose ``wait()`` returns ``fn(result)``. Where the backend says
        when the collective completes (``torch.distributed``'s futures), ``fn`` runs then, on
        the backend's thread, while the caller goes on (as a DDP hook's ``then`` callback);
        elsewhere inside ``wait()``. Errors of the collective are raised by ``wait()`` as
        without it, before ``fn``'s own."""
        if self._chain is None:
            return Work(lambda: fn(self.wait()), self.nbytes)
        done = self._chain(fn)
        return Work(lambda: (self.wait(), done.wait())[1], self.nbytes)

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


def all_to_all_wire_bytes(message_nbytes, rank: int) -> int:
    """Bytes one worker sends in an all-to-all of these per-destination messages (its own,
    ``[rank]``, stays)."""
    return sum(b for j, b in enumerate(message_nbytes) if j != rank)


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

    def allgather_control(self, tensor: torch.Tensor) -> torch.Tensor:
        """A small allgather that coordinates the workers (settings digests, "is any
        gradient non-finite?") rather than exchanging a method's data. Bytes count in
        ``bytes_sent`` like any collective; a group that only models traffic (the
        timeline model's recording group) may answer it locally."""
        return self.allgather(tensor)

    def claim(self, tensors, owner: str) -> None:
        """Record that this worker's ``owner`` (e.g. an optimizer) updates ``tensors``. Workers
        in separate processes cannot share a tensor: nothing to check here; an in-process group
        refuses a tensor another of its workers claimed (:class:`~gradzip.comm.ThreadGroup`)."""

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

    # -- all-to-all (the two-phase transport's exchange) --------------------------------
    def all_to_all(self, tensors, recv_sizes=None, async_op: bool = False, rounds: int = 1):
        """Send ``tensors[j]`` (1-D, one dtype, any length) to worker ``j``; the result is the
        list of the ``n`` tensors received, ``[i]`` from worker ``i`` (``[rank]``: this worker's
        own, a copy). ``recv_sizes[i]``: how many elements worker ``i`` sends here; None: the
        workers first exchange their sizes (one int64 per peer, counted). Bytes counted: the
        messages to the other workers (:func:`all_to_all_wire_bytes`).

        ``rounds`` > 1: the same exchange as that many all-to-alls, round ``r`` carrying
        entries ``[L·r/R, L·(r+1)/R)`` of every message of ``L`` entries, issued at once and
        put back together (the same result and bytes). Every worker must pass the same
        ``rounds``. On links that several exchanges share, rounds keep the directions of an
        exchange within a round of each other (docs/benchmarks/transports-and-nodes.md, "Two-phase
        across nodes: what the uplink runs say"); each round costs a call."""
        if not is_int(rounds) or rounds < 1:
            raise GradzipError(f"all_to_all: rounds must be an integer >= 1, got {rounds!r}")
        n = self.world_size
        tensors = [t.reshape(-1) for t in tensors]
        if len(tensors) != n or len({t.dtype for t in tensors}) > 1:
            raise GradzipError(f"all_to_all takes one tensor per worker ({n}), all of one dtype; got "
                               f"{len(tensors)} of dtypes {sorted({str(t.dtype) for t in tensors})}")
        if recv_sizes is None:
            sizes = self.all_to_all([torch.tensor([t.numel()], dtype=torch.int64) for t in tensors], [1] * n)
            recv_sizes = [int(s) for s in torch.cat(sizes).tolist()]
        recv_sizes = [int(s) for s in recv_sizes]
        if len(recv_sizes) != n or min(recv_sizes) < 0:
            raise GradzipError(f"all_to_all: recv_sizes must be {n} counts >= 0, got {recv_sizes!r}")
        nbytes = all_to_all_wire_bytes([_nbytes(t) for t in tensors], self.rank)
        if n == 1:
            work = Work.completed([tensors[0].clone()], 0)
        else:
            self.bytes_sent += nbytes
            work = (self._all_to_all(tensors, recv_sizes, nbytes) if rounds == 1
                    else self._all_to_all_rounds(tensors, recv_sizes, nbytes, int(rounds)))
        return work if async_op else work.wait()

    def _all_to_all_rounds(self, tensors: list[torch.Tensor], recv_sizes: list[int], nbytes: int,
                           rounds: int) -> Work:
        """:meth:`all_to_all` in ``rounds`` calls of :meth:`_all_to_all`, launched in order."""
        def piece(length: int, r: int) -> tuple[int, int]:
            return length * r // rounds, length * (r + 1) // rounds

        works = []
        for r in range(rounds):
            sent = [t[slice(*piece(t.numel(), r))] for t in tensors]
            sizes = [b - a for a, b in (piece(size, r) for size in recv_sizes)]
            works.append(self._all_to_all(sent, sizes, 0))

        def wait():
            parts = [work.wait() for work in works]
            return [torch.cat([part[i] for part in parts]) for i in range(len(recv_sizes))]

        return Work(wait, nbytes)

    def _all_to_all(self, tensors: list[torch.Tensor], recv_sizes: list[int], nbytes: int) -> Work:
        raise NotImplementedError(f"{type(self).__name__} has no all_to_all")

    # -- the hierarchical exchange's collectives (spec "Hierarchical exchange") ----------
    def reduce_scatter(self, tensor: torch.Tensor, mean: bool = False, async_op: bool = False):
        """``tensor`` of shape ``(world_size, *s)`` summed over the workers (``mean``: divided
        by ``world_size``); this worker gets row ``rank`` of the sum, shape ``s``. Ring
        bytes: ``(n - 1) / n`` of the tensor."""
        n = self.world_size
        if tensor.dim() < 1 or tensor.shape[0] != n:
            raise GradzipError(f"reduce_scatter takes a tensor of shape (world_size={n}, ...), got "
                               f"{tuple(tensor.shape)}; stack one row per worker")
        nbytes = (n - 1) * _nbytes(tensor) // n
        if tensor.numel() == 0 or n == 1:
            row = tensor[self.rank].clone()
            work = Work.completed(row.div_(n) if mean else row)
        else:
            self.bytes_sent += nbytes
            inner = self._reduce_scatter(tensor.contiguous(), nbytes)
            work = Work(lambda: inner.wait().div_(n) if mean else inner.wait(), nbytes)
        return work if async_op else work.wait()

    def split(self, parts) -> "Group":
        """The group of the workers in this worker's part of ``parts``: disjoint lists of
        this group's ranks that cover it, the same on every worker (ranks in the new group
        in ascending order of these ranks, as torch.distributed numbers them). Collective: every worker calls it with the same ``parts``,
        e.g. ``[[0, 1], [2, 3]]`` (two nodes of two) or ``[[0, 2], [1, 3]]`` (equal local ranks)."""
        parts = [list(p) for p in parts]
        flat = sorted(r for p in parts for r in p)
        if flat != list(range(self.world_size)) or any(not p for p in parts):
            raise GradzipError(f"split takes disjoint, non-empty lists of the ranks 0..{self.world_size - 1} "
                               f"covering the group, got {parts}")
        return self._split(parts)

    def _reduce_scatter(self, tensor: torch.Tensor, nbytes: int) -> Work:
        raise NotImplementedError(f"{type(self).__name__} has no reduce_scatter")

    def _split(self, parts: list[list[int]]) -> "Group":
        raise NotImplementedError(f"{type(self).__name__} cannot split into subgroups")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
