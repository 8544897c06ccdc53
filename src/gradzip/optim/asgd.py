"""A-SGD: asynchronous SGD with a parameter server (docs/algorithms.md §A-SGD; Dean et al.
2012, Downpour; SSP: Ho et al. 2013).

The box::

    worker i (loop):  pull (x, τ_i);  g = ∇f(x; z_i)
                      p = e_i + g;  c = C(p);  e_i = p − dec(c)     # error feedback when C is biased
                      push (c, τ_i)
    server (on each push, in arrival order):
                      staleness s = τ − τ_i;  x ← x − η · dec(c)   # momentum, if any, on the server
                      τ ← τ + 1

**Where things run.** The server (:class:`ParameterServer`: the model x, the version τ,
the workers' clocks, the server's momentum buffers, the staleness statistics) lives in
rank 0's process, and rank 0 is also a worker. ``step()`` is one turn of the worker loop:
it pushes the gradient of the parameters the model holds (the last pull) and pulls the
server's new parameters into the model, so a training loop written for synchronous
``step()`` runs unchanged. On ``torch.distributed`` the other workers push and pull over
gloo point-to-point messages (:mod:`gradzip.comm.p2p`), and a receiver thread on rank 0
applies their pushes in arrival order; rank 0's own pushes are applied in its training
thread, under the same lock. On the in-process group (``gradzip.simulate``) every worker
calls the one shared server directly, and the server hears of the group's workers
(:meth:`~gradzip.comm.ThreadGroup.watch`): one that fails stops it at once, so a peer waiting
for its push raises a :class:`~gradzip.comm.PeerFailure` naming that rank and its error, not
after the whole timeout; one whose function returns pushes no more, as after ``close()``.
The messages are the same bytes in both: the codec's wire tensors (a short header: rank,
step, τ_i, learning rates), and the model's raw bytes back.

**Rules** (the spec's choices): each gradient is applied with the full η of the pushing
worker's param groups (Downpour; an LR scheduler on a worker changes its own pushes);
weight decay and momentum are the server's (``torch.optim.SGD``'s rule on dec(c), with x
the server's model); error feedback (``state[p]["error"]``) when the codec is biased (not
``none``, not unbiased). Every push is applied exactly once: τ counts them, and
x_0 − x is the sum of the applied updates. With one worker and the identity codec this is
SGD, bit for bit.

**Bounded staleness** (``staleness=S``, SSP): worker i's clock c_i counts its pushes; its
pull after push number c (the start of its computation for clock c) is answered only when
every worker's clock is at least c − S (S = 0: lock-step, each gradient still applied on
its own). ``staleness=None``: no bound. A worker that closed no longer holds others back.
A push's staleness is then at most (n − 1)(2S + 1): while a worker computes for clock c,
another can push its numbers c − S + 1 to c + S + 1.

**Order** (``order``): ``"arrival"`` (the algorithm: each push applied when it arrives) or
``"round_robin"``: pushes applied in the order rank 0, 1, …, n−1, 0, … whatever the
timing (an early push waits on the server, not on the network), and each pull answered
with x as it was right after the puller's own push. A deterministic schedule (staleness
n − 1 from the second round on): runs repeat bit for bit, for tests and studies.

**Evaluation and checkpoints** use the server's model: ``evaluation_parameters()``
(collective: rank 0 broadcasts the server's x) and ``state_dict()`` / ``load_state_dict()``
are taken at a *quiescent point*: both start with a barrier, so every worker has returned
from its ``step()`` (its push applied, its pull answered) and no push is in flight. Rank 0's
state holds the server (x, τ, clocks, momentum, statistics); every worker's holds its error
memory, clock and pulled version, and the model holds its last pull. What "exact resume"
means here: with one worker (or a fixed arrival order), the resumed run continues bit for
bit; with several, the arrival order after the resume depends on timing as in any run, so
what is exact is the state at the checkpoint and the conservation law after it.

**Non-finite gradients** (``nonfinite``): ``"raise"`` stops this worker before it pushes
(no collective); ``"skip"`` keeps its contract for every method, the same steps skipped on
every worker, so the workers agree at every step (one 8-byte control allgather: a
synchronisation point each step; with ``order="round_robin"`` the skipping run equals the
run without that step, bit for bit).

**Codecs** whose receiver needs more than the wire and the shared seed are refused:
``dgc`` (the selected count) and ``powersgd`` (its Q is shared state of a synchronous
exchange).
"""
from __future__ import annotations

import threading
import time
from typing import Any

import torch

from .. import comm as comm_lib
from .. import seeds
from ..comm.p2p import TorchStar, shared_object
from ..comm.threads import peer_failed
from ..compressors import Compressor, Packet, build
from ..errors import GradzipError
from ..exchange import Timings
from ..nonfinite import NonFiniteGradient, first_nonfinite
from ..validation import is_int, require
from .base import DistributedOptimizer

#: The server's order of applying pushes: as they arrive (the algorithm), or "round_robin":
#: rank 0, 1, ..., n-1, 0, ... whatever the timing, each pull answered with x right after
#: the puller's push (deterministic: for tests and reproducible studies).
ORDERS = ("arrival", "round_robin")

#: Codecs A-SGD cannot send to a server (module docstring).
_REFUSED = {"dgc": "its packets carry the selected count outside the wire",
            "powersgd": "its Q is state shared by a synchronous exchange"}

# header of a push, int64 words: rank, step, τ_i, number of param groups (their lrs follow, float64)
_PUSH_WORDS = 4


def codec_seed(codec: Compressor, seed: int, step: int, key: int, rank: int) -> int:
    """The seed worker ``rank`` compresses tensor ``key`` of step ``step`` with, which the
    server re-derives to decode it (shared-randomness codecs: the same on every worker)."""
    if codec.shared_randomness:
        return seeds.mix(seed, step, key)
    return seeds.mix(seed, step, key, rank + 1)


def _raw(tensors) -> torch.Tensor:
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
        return torch.cat([head.view(torch.uint8), _raw(self.x)])

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


class _LocalLink:
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


class _RemoteLink:
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


class ASGD(DistributedOptimizer):
    """A-SGD with a parameter server (module docstring; docs/algorithms.md §A-SGD).

    ``staleness``: the SSP bound S (an integer >= 0), or None for none. ``compressor``: the
    codec of the pushes (error feedback when it is biased). ``order``: ``"arrival"`` or the
    deterministic ``"round_robin"`` (module docstring). ``momentum``, ``nesterov``,
    ``weight_decay`` are applied on the server. ``step()`` pushes and pulls (it blocks
    while SSP holds this worker back); ``close()`` (or ``with``) tells the server this
    worker is done: call it on every worker after its last step (the training loop does).
    """

    collective_exchanges = False   # pushes and pulls go point to point to the server
    complex_parameters = False   # its server updates real entries (optim.participation)

    def __init__(self, params, lr, *, staleness: int | None = None, compressor: str = "none",
                 order: str = "arrival", **kwargs):
        name = type(self).__name__
        require(staleness is None or (is_int(staleness) and staleness >= 0), name,
                f"staleness must be None (no bound) or an integer >= 0, got {staleness!r}")
        require(order in ORDERS, name, f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        codec = build(compressor)
        if codec.name in _REFUSED:
            raise GradzipError(f"{name}: compressor {codec.spec!r} cannot be pushed to a parameter server "
                               f"({_REFUSED[codec.name]}); use another codec, e.g. topk:ratio=0.01")
        require(kwargs.get("transport", "auto") == "auto" and kwargs.get("hierarchy") in (None, 1), name,
                "pushes go point to point to the parameter server, not through a PSync transport: leave "
                "transport and hierarchy (CLI --transport, --workers-per-node) unset")
        super().__init__(params, lr, **kwargs)
        self.staleness = staleness
        self.order = order
        self.codec = codec
        self.compressor = codec.spec
        self.error_feedback = not (codec.name == "none" or codec.unbiased)
        self._codec_seed = seeds.exchange_seed(self.seed, 0)
        self._clock = 0          # this worker's pushes
        self._pulled_version = 0  # τ_i: the server's version of the parameters the model holds
        self._own = [0, 0, 0]   # this worker's pushes, staleness sum, max (from the replies)
        self._push_bytes = 0     # this worker's push messages (header + packets)
        self._payload_bytes = 0  # their packets (sum of packet.nbytes)
        self._pull_bytes = 0
        self._wire_sent = 0     # this worker's pushes that crossed a network
        self._timings = Timings()
        self._closed = False
        self._served = tuple(self._keys[p] for _, p in self.participating())   # the server's parameters
        self._link = self._connect()

    # -- counters (read-only; per worker, so not settings: describe() leaves them out) -------
    @property
    def clock(self) -> int:
        """This worker's pushes (its SSP clock)."""
        return self._clock

    @property
    def pulled_version(self) -> int:
        """τ_i: the server's version of the parameters the model holds (the last pull)."""
        return self._pulled_version

    @property
    def push_bytes(self) -> int:
        """Bytes of this worker's push messages (header + packets), wherever the server is."""
        return self._push_bytes

    @property
    def pull_bytes(self) -> int:
        """Bytes of the server's replies to this worker."""
        return self._pull_bytes

    # -- set-up ---------------------------------------------------------------------------
    def _connect(self):
        comm, timeout = self.comm, getattr(self.comm, "timeout_s", None)
        if isinstance(comm, comm_lib.ThreadGroup):
            timeout = comm._hub.timeout_s
            if comm.world_size == 1:
                return _LocalLink(self._make_server(), timeout)

            def make() -> ParameterServer:   # on rank 0: a worker that fails or returns is the server's news
                server = self._make_server()
                comm.watch(server.worker_ended)
                return server
            return _LocalLink(shared_object(comm, make), timeout)
        if isinstance(comm, comm_lib.TorchGroup):
            star = TorchStar(comm)
            return _LocalLink(self._make_server(), timeout, star) if comm.rank == 0 else _RemoteLink(star)
        raise GradzipError(f"ASGD needs a ThreadGroup or a TorchGroup, got {type(comm).__name__}")

    def _make_server(self) -> ParameterServer:
        pairs = self.participating()
        index = {id(g): i for i, g in enumerate(self.param_groups)}
        hyper = [{k: g[k] for k in ("momentum", "nesterov", "weight_decay")} for g in self.param_groups]
        return ParameterServer([p for _, p in pairs], [index[id(g)] for g, _ in pairs], hyper,
                               self.comm.world_size, self.staleness, self.codec, self._codec_seed, self.order)

    @property
    def server(self) -> ParameterServer | None:
        """The server, where this worker's process holds it (rank 0; every worker in process)."""
        return self._link.server

    # -- the worker loop ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Push this worker's gradient (compressed, with error feedback), then pull the
        server's parameters into the model (waiting for SSP if needed)."""
        if self._closed:
            raise GradzipError("ASGD.step() after close(): this worker told the server it was done")
        self._link.check(self.comm.rank)
        loss, pairs, params, skipped = self.begin_step(closure)
        if skipped:
            return loss
        self._check_served(params)
        began = time.perf_counter()
        packets, residuals = [], []
        for key, (group, p) in enumerate(pairs):
            seed = codec_seed(self.codec, self._codec_seed, self.steps, key, self.comm.rank)
            if self.error_feedback:
                error = self.state[p].get("error")
                v = p.grad if error is None else error.add(p.grad)
                residual = torch.empty_like(v, memory_format=torch.contiguous_format)
                packets.append(self.codec.compress_residual(v, seed, residual))
                residuals.append((p, residual))
            else:
                packets.append(self.codec.compress(p.grad, seed))
        self._refuse_overflow(packets)
        for p, residual in residuals:
            self.state[p]["error"] = residual                         # e_i = p − dec(c)
        head = torch.tensor([self.comm.rank, self.steps, self._pulled_version, len(self.param_groups)],
                            dtype=torch.int64)
        lrs = torch.tensor([g["lr"] for g in self.param_groups], dtype=torch.float64)
        message = torch.cat([head.view(torch.uint8), lrs.view(torch.uint8),
                             _raw(t for pk in packets for t in pk.wire.values())])
        sent = time.perf_counter()
        self._add(compress=sent - began)
        if self._tracer is not None:
            self._tracer.add("compress", began, sent, bytes=sum(pk.nbytes for pk in packets))
        reply, wire = self._link.exchange(self.comm.rank, self._clock + 1, message)
        pulled = time.perf_counter()
        self._add(communicate=pulled - sent)
        if self._tracer is not None:
            self._tracer.add("communicate", sent, pulled, kind="push+pull", bytes=wire)
        self._clock += 1
        self._push_bytes += message.numel()
        self._payload_bytes += sum(pk.nbytes for pk in packets)
        self._pull_bytes += reply.numel()
        self._wire_sent += wire
        self._load_reply(reply, params)
        return loss

    def exchanges_at(self, step: int) -> bool:
        """Never a collective: the pushes go to the server, which holds the parameters
        that took part when it was built; :meth:`_check_served` compares against those."""
        return False

    def _check_served(self, params: list[torch.Tensor]) -> None:
        """Refuse (one line, nothing pushed) a set of parameters taking part other than the
        server's: a parameter frozen or unfrozen since the optimizer was built."""
        keys = tuple(self._keys[p] for p in params)
        if keys != self._served:
            self.steps -= 1   # this step never happened
            changed = sorted(set(keys) ^ set(self._served))
            raise GradzipError(
                f"ASGD: parameter(s) #{', #'.join(map(str, changed))} were frozen or unfrozen (requires_grad) after "
                f"the optimizer was built; its parameter server holds the {len(self._served)} parameters that took "
                "part then: set requires_grad before building the optimizer, alike on every worker")

    def _refuse_overflow(self, packets: list[Packet]) -> None:
        """The server applies every push as it comes, so a packet that decodes to NaN/Inf
        from a finite gradient (a codec overflow: fp16 above 65504, ...) is refused here,
        before it is pushed and before the error memory changes (``nonfinite="off"``: not
        checked). A-SGD cannot skip a push (the server and its clocks count each one), so
        ``"skip"`` raises too."""
        if self.nonfinite == "off" or self.codec.name == "none":
            return
        bad = first_nonfinite([self.codec.decompress(pk) for pk in packets])
        if bad >= 0:
            self.steps -= 1
            raise NonFiniteGradient(
                f"ASGD step {self.steps + 1}: the {self.codec.spec} packet of tensor #{bad} decodes to NaN or Inf "
                "from a finite gradient (the codec overflowed); nothing was pushed and the error memory is "
                "unchanged. Lower the learning rate, clip gradients or pick a codec with a wider range "
                "(A-SGD cannot skip a push: its server applies every one)")

    def _load_reply(self, reply: torch.Tensor, params: list[torch.Tensor]) -> None:
        version, staleness = reply[:16].view(torch.int64).tolist()
        self._pulled_version = version
        self._own[0] += 1
        self._own[1] += staleness
        self._own[2] = max(self._own[2], staleness)
        offset = 16
        for p in params:
            n = p.numel() * p.element_size()
            p.copy_(reply[offset:offset + n].view(p.dtype).view(p.shape))
            offset += n

    def close(self) -> None:
        """This worker pushes no more: it stops holding the others back (SSP); on a process
        group, rank 0 waits for the other workers' last pushes. Idempotent."""
        if not self._closed:
            self._closed = True
            self._link.leave(self.comm.rank)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- quiescent points -------------------------------------------------------------------
    def quiesce(self) -> None:
        """A barrier: once every worker is here, every push was applied and answered.
        Collective (every worker calls it between two steps)."""
        if self.comm.world_size > 1:
            self.comm.barrier()
        self._link.check(self.comm.rank)

    def evaluation_parameters(self) -> list[torch.Tensor]:
        """The server's model, on every worker (evaluation uses it). Collective: a barrier,
        then rank 0 broadcasts the server's x (on the in-process group too)."""
        self.quiesce()
        out = []
        server = self.server
        for k, p in enumerate(p for _, p in self.participating()):
            t = server.x[k].clone() if (server is not None and self.comm.rank == 0) else torch.empty_like(p)
            if self.comm.world_size > 1:
                self.comm.broadcast(t, src=0)
            out.append(t)
        by_param = dict(zip((p for _, p in self.participating()), out))
        return [by_param.get(p, p.detach().clone()) for g in self.param_groups for p in g["params"]]

    def replicas_identical(self) -> bool:
        """The workers hold their own last pulls once a step was taken."""
        return self.steps == 0

    def state_dict(self) -> dict:
        """At a quiescent point (a barrier first: collective on several workers): this
        worker's error memory, clock and pulled version; rank 0's holds the server too."""
        self.quiesce()
        out = super().state_dict()
        own = {"clock": self._clock, "pulled_version": self._pulled_version, "own": list(self._own),
               "push_bytes": self._push_bytes, "payload_bytes": self._payload_bytes, "pull_bytes": self._pull_bytes,
               "wire_sent": self._wire_sent + self._link.sent,
               "timings": [self._timings.compress_s, self._timings.communicate_s]}
        if self.comm.rank == 0 and self.server is not None:
            own["server"] = self.server.state_dict()
        out["asgd"] = own
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """The inverse of :meth:`state_dict` (collective on several workers: a barrier
        after loading, so no worker pushes before the server is restored)."""
        state_dict = dict(state_dict)
        own = state_dict.pop("asgd", None)
        if not isinstance(own, dict):
            raise GradzipError("ASGD.load_state_dict: this state has no 'asgd' entry (the server, clocks and "
                               "versions); load a state saved by ASGD.state_dict()")
        super().load_state_dict(state_dict)
        if self.comm.rank == 0 and self.server is not None:
            if "server" not in own:
                raise GradzipError("ASGD.load_state_dict: rank 0 needs the state rank 0 saved (it holds the "
                                   "parameter server); load each rank's own state")
            self.server.load_state_dict(own["server"])
        self._clock, self._pulled_version = int(own["clock"]), int(own["pulled_version"])
        self._own = list(own["own"])
        self._push_bytes, self._payload_bytes, self._pull_bytes = own["push_bytes"], own["payload_bytes"], own["pull_bytes"]
        self._wire_sent = own["wire_sent"]
        self._link.sent = 0
        self._timings = Timings(compress_s=own["timings"][0], communicate_s=own["timings"][1],
                                wait_s=own["timings"][1], inline_compress_s=own["timings"][0])
        if self.comm.world_size > 1:
            self.comm.barrier()

    # -- accounting ----------------------------------------------------------------------------
    def _add(self, compress: float = 0.0, communicate: float = 0.0) -> None:
        t = self._timings
        t.compress_s += compress
        t.inline_compress_s += compress
        t.communicate_s += communicate
        t.wait_s += communicate

    @property
    def timings(self) -> Timings:
        """Codec work (compress, serialise) and the push + pull wait (for a worker in the
        server's process: the server's apply and the SSP wait)."""
        return Timings(**vars(self._timings))

    @property
    def bytes_sent(self) -> int:
        """Bytes this process put on a network: a worker's pushes; rank 0 (the server's
        process): its replies to the other workers (its own pushes stay in the process).
        On the in-process group every push counts, as if each worker had a link."""
        if isinstance(self.comm, comm_lib.ThreadGroup):
            return self._push_bytes
        return self._wire_sent + self._link.sent

    @property
    def compression_ratio(self) -> float:
        dense = self._clock * sum(p.numel() * p.element_size() for _, p in self.participating())
        return dense / self._payload_bytes if self._payload_bytes else float("inf")

    def metrics(self) -> dict[str, Any]:
        """Staleness: the server's per-worker statistics where this process holds the server,
        else this worker's own (from the server's replies); push and pull bytes."""
        out = {"push_bytes": self._push_bytes, "pull_bytes": self._pull_bytes}
        if self.server is not None:
            out.update(self.server.statistics())
        else:
            n, total, worst = self._own
            out.update(staleness_mean=total / n if n else 0.0, staleness_max=worst)
        return out
