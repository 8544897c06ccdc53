"""A-SGD's parameter server and the links workers reach it by (docs/algorithms.md §A-SGD; the
method, :class:`gradzip.optim.ASGD`, is :mod:`.asgd`): :class:`ParameterServer` holds x, the
version τ, the workers' clocks, the server's momentum and the staleness statistics, applies
pushes (in arrival order or round robin) and answers pulls, under one lock;
:class:`LocalLink` calls it in the same process (rank 0; every worker of the in-process
group), :class:`RemoteLink` sends the same bytes over gloo point-to-point messages."""
from __future__ import annotations

import threading
from typing import Any

import torch

from .. import comm as comm_lib
from .. import seeds
from ..comm.p2p import TorchStar
from ..comm.threads import peer_failed
from ..compressors import Compressor, Packet
from ..errors import GradzipError

# header of a push, int64 words: rank, step, τ_i, number of param groups (their lrs follow, float64)
_PUSH_WORDS = 4

def codec_seed(codec: Compressor, seed: int, step: int, key: int, rank: int) -> int:
    """The seed worker ``rank`` compresses tensor ``key`` of step ``step`` with, which the
    server re-derives to decode it (shared-randomness codecs: the same on every worker)."""
    if codec.shared_randomness:
        return seeds.mix(seed, step, key)
    return seeds.mix(seed, step, key, rank + 1)


def raw_bytes(tensors) -> torch.Tensor:
    """The bytes of ``tensors``, concatenated (1-D uint8)."""
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


class ParameterServer:
    """The server of the box: x, τ, the clocks, momentum, staleness statistics. Thread-safe
    (one lock); :meth:`push` applies one worker's message, :meth:`pull` answers a pull."""

    def __init__(self, params: list[torch.Tensor], groups: list[int], hyper: list[dict], world_size: int,
                 staleness: int | None, codec: Compressor, seed: int, order: str = "arrival"):
        self.x = [p.detach().clone() for p in params]
        self.groups = groups          # param group of each tensor
        self.hyper = hyper            # per group: momentum, nesterov, weight_decay (the creator's)
        self.momentum: list[torch.Tensor | None] = [None] * len(params)
        self.world_size = world_size
        self.staleness = staleness
        self.order = order
        self.codec = codec
        self.seed = seed
        self.version = 0
        self.clocks = [0] * world_size
        self.left: set[int] = set()
        self.stale_sum = [0] * world_size
        self.stale_max = [0] * world_size
        self.last_staleness = [0] * world_size
        self.failure: BaseException | None = None
        self.failed_rank: int | None = None   # the worker that failed with it, where known
        self.cond = threading.Condition()
        self._templates: dict[int, Packet] = {}
        self.order = order
        self.turn = 0                                   # round_robin: the rank whose push is next
        self._queued: list[list] = [[] for _ in range(world_size)]   # round_robin: pushes before their turn
        self._snapshots: list[torch.Tensor | None] = [None] * world_size  # round_robin: x after each one's push

    # -- a push ---------------------------------------------------------------------------
    def push(self, message: torch.Tensor) -> int:
        """Decode and apply one push (arrival order is the order of this lock); the rank."""
        words = message[:8 * _PUSH_WORDS].view(torch.int64).tolist()
        rank, step, tau_i, ngroups = words
        head = 8 * (_PUSH_WORDS + ngroups)
        lrs = message[8 * _PUSH_WORDS:head].view(torch.float64).tolist()
        decoded = self._decode(message[head:], rank, step)
        with self.cond:
            if self.order == "arrival":
                self._apply_push(rank, tau_i, lrs, decoded)
            else:
                self._queued[rank].append((tau_i, lrs, decoded))
                self._apply_due()
            self.cond.notify_all()
        return rank

    def _apply_push(self, rank: int, tau_i: int, lrs: list[float], decoded: list[torch.Tensor]) -> None:
        """The server's part of the box for one push (lock held)."""
        s = self.version - tau_i
        for k, d in enumerate(decoded):
            self._apply(k, d, lrs[self.groups[k]])
        self.version += 1
        self.clocks[rank] += 1
        self.stale_sum[rank] += s
        self.stale_max[rank] = max(self.stale_max[rank], s)
        self.last_staleness[rank] = s

    def _apply_due(self) -> None:
        """round_robin: apply the queued pushes whose turn it is (ranks in cyclic order,
        skipping closed workers); each worker's pull then gets x as it was right after its
        push. Lock held."""
        while self._queued[self.turn]:
            rank = self.turn
            self._apply_push(rank, *self._queued[rank].pop(0))
            self._snapshots[rank] = self._reply_now(rank)
            self._advance()

    def _advance(self) -> None:
        for _ in range(self.world_size):
            self.turn = (self.turn + 1) % self.world_size
            if self.turn not in self.left:
                return

    def _decode(self, payload: torch.Tensor, rank: int, step: int) -> list[torch.Tensor]:
        out, offset = [], 0
        for key, x in enumerate(self.x):
            template = self._template(key, x, rank, step)
            wire = {}
            for name, t in template.wire.items():
                n = t.numel() * t.element_size()
                piece = payload[offset:offset + n]
                if piece.numel() != n:
                    raise GradzipError(f"ASGD: a push from rank {rank} is shorter than the {self.codec.spec} "
                                       "packets of the model; every worker must run the same model and codec")
                wire[name] = piece.clone().view(t.dtype).view(t.shape)
                offset += n
            out.append(self.codec.decompress(template.like(wire)))
        if offset != payload.numel():
            raise GradzipError(f"ASGD: a push from rank {rank} is longer than the {self.codec.spec} packets "
                               "of the model; every worker must run the same model and codec")
        return out

    def _template(self, key: int, x: torch.Tensor, rank: int, step: int) -> Packet:
        """A packet laid out as the worker's (wire names, dtypes, shapes) with the metadata
        the receiver re-derives from the shared seed (random-k's indices)."""
        if not self.codec.shared_randomness and key in self._templates:
            return self._templates[key]
        packet = self.codec.compress(torch.zeros_like(x), codec_seed(self.codec, self.seed, step, key, rank))
        if not self.codec.shared_randomness:
            self._templates[key] = packet
        return packet

    def _apply(self, k: int, d: torch.Tensor, lr: float) -> None:
        """``x ← x − η · dir``: torch.optim.SGD's rule (dampening 0) on the decoded gradient."""
        h, x = self.hyper[self.groups[k]], self.x[k]
        u = d.to(x.dtype)
        if h["weight_decay"]:
            u = u.add(x, alpha=h["weight_decay"])
        m = h["momentum"]
        if m:
            buf = self.momentum[k]
            self.momentum[k] = buf = u.clone() if buf is None else buf.mul_(m).add_(u)
            u = u.add(buf, alpha=m) if h["nesterov"] else buf
        x.add_(u, alpha=-lr)

    # -- a pull ---------------------------------------------------------------------------
    def may_pull(self, rank: int) -> bool:
        """SSP: ``min_j c_j ≥ c_rank − S`` over the workers that have not closed."""
        if self.staleness is None:
            return True
        live = [c for j, c in enumerate(self.clocks) if j not in self.left]
        return not live or min(live) >= self.clocks[rank] - self.staleness

    def applied(self, rank: int, clock: int) -> bool:
        """Whether ``rank``'s push number ``clock`` was applied and its pull may be answered."""
        return self.clocks[rank] >= clock and self.may_pull(rank)

    def reply(self, rank: int) -> torch.Tensor:
        """The answer to ``rank``'s pull (lock held): τ, the staleness its last push was
        applied with, x's bytes; under round_robin, as they were right after that push."""
        if self.order != "arrival":
            return self._snapshots[rank]
        return self._reply_now(rank)

    def _reply_now(self, rank: int) -> torch.Tensor:
        head = torch.tensor([self.version, self.last_staleness[rank]], dtype=torch.int64)
        return torch.cat([head.view(torch.uint8), raw_bytes(self.x)])

    def pull(self, rank: int, clock: int, timeout_s: float) -> torch.Tensor:
        """Wait until ``rank``'s push number ``clock`` is applied and SSP lets it pull, then
        its reply."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.failure is not None or self.applied(rank, clock), timeout_s):
                behind = [j for j, c in enumerate(self.clocks) if j != rank and j not in self.left
                          and c < max(clock - (self.staleness or 0), clock if self.order != "arrival" else 0)]
                raise comm_lib.PeerFailure(
                    f"rank {rank}: ASGD (staleness={self.staleness}, order={self.order}): waited {timeout_s:g} s "
                    f"for rank(s) {', '.join(map(str, behind)) or '?'} to push; a peer is stuck or lost; "
                    "change it with --timeout or timeout_s=", rank=rank, lost=tuple(behind))
            self._check_failure(rank)
            return self.reply(rank)

    def leave(self, rank: int) -> None:
        """Worker ``rank`` pushes no more: it holds no one back."""
        with self.cond:
            self.left.add(rank)
            if self.order != "arrival" and self.turn == rank and len(self.left) < self.world_size:
                self._advance()
                self._apply_due()
            self.cond.notify_all()

    def fail(self, exc: BaseException, rank: int | None = None) -> None:
        """The server stops: every wait ends, raising a :class:`PeerFailure` that names
        ``exc`` (and ``rank``, the worker that failed with it, where given)."""
        with self.cond:
            if self.failure is None:
                self.failure, self.failed_rank = exc, rank
            self.cond.notify_all()

    def worker_ended(self, rank: int, exc: BaseException | None) -> None:
        """On the in-process group (:meth:`~gradzip.comm.ThreadGroup.watch`): the worker of
        ``rank`` failed with ``exc``, so the others' waits end at once naming it, as the
        group's collectives do; or (``exc`` None) its function returned: it pushes no more,
        as after ``close()``."""
        if exc is None:
            self.leave(rank)
        else:
            self.fail(exc, rank)

    def _check_failure(self, rank: int) -> None:
        if self.failure is None:
            return
        if self.failed_rank is not None and self.failed_rank != rank:
            raise peer_failed(rank, self.failed_rank, self.failure) from self.failure
        raise comm_lib.PeerFailure(f"rank {rank}: the parameter server stopped: "
                                   f"{type(self.failure).__name__}: {self.failure}", rank=rank) from self.failure

    # -- statistics and state ---------------------------------------------------------------
    def statistics(self) -> dict[str, Any]:
        with self.cond:
            pushes = sum(self.clocks)
            return {"server_version": self.version,
                    "staleness_mean": sum(self.stale_sum) / pushes if pushes else 0.0,
                    "staleness_max": max(self.stale_max),
                    "staleness_mean_per_worker": [s / c if c else 0.0 for s, c in zip(self.stale_sum, self.clocks)],
                    "staleness_max_per_worker": list(self.stale_max),
                    "pushes_per_worker": list(self.clocks)}

    def state_dict(self) -> dict[str, Any]:
        with self.cond:
            return {"x": [t.clone() for t in self.x],
                    "momentum": [None if b is None else b.clone() for b in self.momentum],
                    "version": self.version, "clocks": list(self.clocks), "stale_sum": list(self.stale_sum),
                    "stale_max": list(self.stale_max), "last_staleness": list(self.last_staleness),
                    "turn": self.turn, "snapshots": [None if t is None else t.clone() for t in self._snapshots]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["x"]) != len(self.x) or any(a.shape != b.shape for a, b in zip(state["x"], self.x)):
            raise GradzipError("ASGD.load_state_dict: the saved server model has other tensors than this "
                               "optimizer's parameters; resume with the model that saved it")
        if len(state["clocks"]) != self.world_size:
            raise GradzipError(f"ASGD.load_state_dict: the saved server has {len(state['clocks'])} workers' clocks, "
                               f"the group has {self.world_size} workers; resume with as many workers as saved it")
        with self.cond:
            for x, saved in zip(self.x, state["x"]):
                x.copy_(saved)
            self.momentum = [None if b is None else b.clone() for b in state["momentum"]]
            self.version = int(state["version"])
            self.clocks = list(state["clocks"])
            self.stale_sum = list(state["stale_sum"])
            self.stale_max = list(state["stale_max"])
            self.last_staleness = list(state["last_staleness"])
            self.turn = int(state["turn"])
            self._snapshots = [None if t is None else t.clone() for t in state["snapshots"]]
            self._queued = [[] for _ in range(self.world_size)]
            self.left.clear()


class LocalLink:
    """The worker's way to a server in its own process (the in-process group, a world of
    one, rank 0 of a process group)."""

    def __init__(self, server: ParameterServer, timeout_s: float, star: TorchStar | None = None):
        self.server, self.timeout_s, self.star = server, timeout_s, star
        self.sent = 0                  # bytes of replies rank 0 put on the network
        self._owed: dict[int, int] = {}   # remote rank -> the push count its pull waits for (rank 0 of a process group)
        if star is not None:
            star.serve(self._remote_push)

    def exchange(self, rank: int, clock: int, message: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Push ``message`` (this worker's push number ``clock``), then pull: (reply, bytes
        put on a network: none)."""
        self.server.push(message)
        self._flush()
        return self.server.pull(rank, clock, self.timeout_s), 0

    def _remote_push(self, rank: int, message: torch.Tensor) -> None:
        try:
            with self.server.cond:   # its earlier pushes are all applied or queued: this is the next
                server = self.server
                self._owed[rank] = server.clocks[rank] + len(server._queued[rank]) + 1
            self.server.push(message)
            self._flush()
        except BaseException as exc:  # noqa: BLE001 - the server stops; rank 0's next step says why
            self.server.fail(exc)
            raise

    def _flush(self) -> None:
        """Answer the remote pulls SSP now allows (from whichever thread applied a push)."""
        if self.star is None:
            return
        with self.server.cond:
            ready = sorted(r for r, clock in self._owed.items() if self.server.applied(r, clock))
            replies = [(r, self.server.reply(r)) for r in ready]
            for r, reply in replies:
                del self._owed[r]
                self.sent += reply.numel()   # counted before it goes: a quiescent point may follow its arrival
        for r, reply in replies:
            self.star.reply(r, reply)

    def leave(self, rank: int) -> None:
        self.server.leave(rank)
        self._flush()
        if self.star is not None:
            self.star.close()
            if self.star.failure is not None:
                self.server.fail(self.star.failure)

    def check(self, rank: int) -> None:
        """Raise if the server stopped (its receiver thread failed)."""
        if self.star is not None and self.star.failure is not None:
            self.server.fail(self.star.failure)
        self.server._check_failure(rank)


class RemoteLink:
    """A worker of a process group other than rank 0: messages to and from rank 0."""

    server = None
    sent = 0

    def __init__(self, star: TorchStar):
        self.star = star

    def exchange(self, rank: int, clock: int, message: torch.Tensor) -> tuple[torch.Tensor, int]:
        self.star.send(message)
        return self.star.recv(), message.numel()

    def leave(self, rank: int) -> None:
        self.star.close()

    def check(self, rank: int) -> None:
        pass
