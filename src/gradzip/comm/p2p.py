"""Point-to-point messages between workers and a server on rank 0 (a star), on
``torch.distributed`` (gloo ``send`` / ``recv``): the transport of A-SGD's parameter server
(:mod:`gradzip.optim.asgd`, docs/algorithms.md §A-SGD).

Why point-to-point and not ``torch.distributed.rpc``: the RPC framework (TensorPipe) is no
longer developed in PyTorch and is missing from some builds, while gloo's ``send`` /
``recv`` (with ``recv`` from any source) is the same engine every collective here already
uses, with the same timeouts, launch (``torchrun``, ``gradzip train --workers N``) and
failure reports.

A message is a 1-D ``uint8`` tensor of any length. Two process groups of the same workers
keep the two directions apart, so that each is used by one thread at a time:

* *up* (worker → server): a fixed-size header (the length, tag 1) then the bytes (tag 2).
  On rank 0 one receiver thread (:meth:`TorchStar.serve`) takes them in arrival order,
  from any worker, and hands each to the server's handler;
* *down* (server → worker): the server's replies, sent under a lock (the receiver thread
  and rank 0's own training thread both reply), received by the worker with ``recv`` from
  rank 0.

Rank 0's own worker does not use the network: the server lives in its process.
``close()`` ends the receiver thread: every other worker sends a "bye", rank 0 joins the
thread once all have. Waits are bounded by the group's timeout (gloo raises, translated
to :class:`~gradzip.comm.PeerFailure` naming the peer).
"""
from __future__ import annotations

import datetime
import threading
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import GradzipError, first_line
from .base import PeerFailure
from .threads import ThreadGroup
from .torchdist import TorchGroup

_HEADER_TAG, _BODY_TAG, _REPLY_HEADER_TAG, _REPLY_BODY_TAG = 1, 2, 3, 4
_BYE = -1


class TorchStar:
    """One worker's end of a star on the workers of ``comm`` (a :class:`TorchGroup`),
    the server on rank 0. Collective to create (two new process groups)."""

    def __init__(self, comm: TorchGroup):
        if not isinstance(comm, TorchGroup):
            raise GradzipError(f"TorchStar needs a TorchGroup (torch.distributed), got {type(comm).__name__}")
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.timeout_s = comm.timeout_s
        ranks = list(comm._global_ranks)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self._up = dist.new_group(ranks=ranks, timeout=timeout)
        self._down = dist.new_group(ranks=ranks, timeout=timeout)
        self._server = ranks[0]
        self._global = ranks
        self._send_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None   # what ended the receiver thread early
        self.closed = False

    # -- worker side ------------------------------------------------------------------
    def send(self, message: torch.Tensor) -> None:
        """Send ``message`` (1-D uint8) to the server (not from rank 0)."""
        self._send(self._up, self._server, message, _HEADER_TAG, _BODY_TAG)

    def recv(self) -> torch.Tensor:
        """The server's next reply to this worker (blocks; bounded by the timeout)."""
        header = torch.zeros(1, dtype=torch.int64)
        self._guard(lambda: dist.recv(header, src=self._server, group=self._down, tag=_REPLY_HEADER_TAG),
                    "receive the parameter server's reply", (0,))
        body = torch.empty(int(header.item()), dtype=torch.uint8)
        if body.numel():
            self._guard(lambda: dist.recv(body, src=self._server, group=self._down, tag=_REPLY_BODY_TAG),
                        "receive the parameter server's reply", (0,))
        return body

    # -- server side (rank 0) -----------------------------------------------------------
    def serve(self, handler: Callable[[int, torch.Tensor], None]) -> None:
        """Start the receiver thread: ``handler(rank, message)`` for every message from
        another worker, in arrival order, until every one of them said bye."""
        if self.rank != 0:
            raise GradzipError("TorchStar.serve runs on rank 0, where the server lives")

        def loop() -> None:
            left = self.world_size - 1
            try:
                while left:
                    header = torch.zeros(1, dtype=torch.int64)
                    src = dist.recv(header, src=None, group=self._up, tag=_HEADER_TAG)
                    n = int(header.item())
                    if n == _BYE:
                        left -= 1
                        continue
                    body = torch.empty(n, dtype=torch.uint8)
                    if n:
                        dist.recv(body, src=src, group=self._up, tag=_BODY_TAG)
                    handler(self._global.index(src), body)
            except BaseException as exc:  # noqa: BLE001 - reported by the server's next wait
                self.failure = exc

        self._thread = threading.Thread(target=loop, name="gradzip-asgd-server", daemon=True)
        self._thread.start()

    def reply(self, rank: int, message: torch.Tensor) -> None:
        """Send ``message`` to worker ``rank`` (its next :meth:`recv`); any thread."""
        with self._send_lock:
            self._send(self._down, self._global[rank], message, _REPLY_HEADER_TAG, _REPLY_BODY_TAG)

    # -- both ---------------------------------------------------------------------------
    def close(self) -> None:
        """A worker other than rank 0 says bye; rank 0 waits for its receiver thread to
        have heard every bye. Call on every worker once it pushes no more (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self.rank != 0:
            header = torch.tensor([_BYE], dtype=torch.int64)
            self._guard(lambda: dist.send(header, dst=self._server, group=self._up, tag=_HEADER_TAG),
                        "say bye to the parameter server", (0,))
        elif self._thread is not None:
            self._thread.join(self.timeout_s)
            if self._thread.is_alive():
                raise PeerFailure(f"rank 0: the parameter server still waits for a worker's last push "
                                  f"{self.timeout_s:g} s after this worker closed (a peer is stuck or lost); "
                                  "change it with --timeout or timeout_s=", rank=0)

    def _send(self, group, dst: int, message: torch.Tensor, header_tag: int, body_tag: int) -> None:
        message = message.contiguous().reshape(-1)
        header = torch.tensor([message.numel()], dtype=torch.int64)
        peer = (self._global.index(dst),)
        self._guard(lambda: dist.send(header, dst=dst, group=group, tag=header_tag), "send a message", peer)
        if message.numel():
            self._guard(lambda: dist.send(message, dst=dst, group=group, tag=body_tag), "send a message", peer)

    def _guard(self, op, what: str, peers: tuple[int, ...]) -> None:
        try:
            op()
        except RuntimeError as exc:
            raise PeerFailure(f"rank {self.rank}: could not {what} (peer {', '.join(map(str, peers))}): "
                              f"{first_line(exc)} "
                              f"(timeout {self.timeout_s:g} s; change it with --timeout or timeout_s=)",
                              rank=self.rank, lost=peers) from exc


def shared_object(comm: ThreadGroup, make: Callable[[], object]) -> object:
    """On an in-process group: the one object ``make()`` built on rank 0, handed to every
    worker (the in-process counterpart of a server on rank 0: the workers call it directly,
    under its own lock). Collective: every worker must call it, in the same order."""
    if not isinstance(comm, ThreadGroup):
        raise GradzipError(f"shared_object needs a ThreadGroup (gradzip.simulate), got {type(comm).__name__}")
    fresh = comm.new_group()   # a new hub: the key of this one object
    hub = fresh._hub
    with hub.cond:
        box = _SHARED.setdefault(hub, {})
    if comm.rank == 0:
        obj = make()
        with hub.cond:
            box["object"] = obj
            hub.cond.notify_all()
        return obj
    with hub.cond:
        if not hub.cond.wait_for(lambda: "object" in box or hub.failure is not None, hub.timeout_s):
            raise PeerFailure(f"rank {comm.rank}: rank 0 did not build the shared parameter server within "
                              f"{hub.timeout_s:g} s; change it with --timeout or timeout_s=", rank=comm.rank, lost=(0,))
        if "object" not in box:
            raise PeerFailure(f"rank {comm.rank}: rank 0 failed before building the shared parameter server",
                              rank=comm.rank, lost=(0,))
        return box["object"]


_SHARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
