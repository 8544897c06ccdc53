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

import time
from typing import Any

import torch

from .. import comm as comm_lib
from .. import seeds
from ..comm.p2p import TorchStar, shared_object
from ..compressors import Packet, build
from ..errors import GradzipError
from ..exchange import Timings
from ..guards.nonfinite import NonFiniteGradient, first_nonfinite
from ..validation import is_int, require
from .asgd_server import LocalLink, ParameterServer, RemoteLink, codec_seed, raw_bytes
from .core.base import DistributedOptimizer

#: The server's order of applying pushes: as they arrive (the algorithm), or "round_robin":
#: rank 0, 1, ..., n-1, 0, ... whatever the timing, each pull answered with x right after
#: the puller's push (deterministic: for tests and reproducible studies).
ORDERS = ("arrival", "round_robin")

#: Codecs A-SGD cannot send to a server (module docstring).
_REFUSED = {"dgc": "its packets carry the selected count outside the wire",
            "powersgd": "its Q is state shared by a synchronous exchange",
            "auto": "auto chooses per bucket of a synchronous PSync exchange, and pushes are point to point"}

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
        require(kwargs.get("transport", "auto") == "auto" and kwargs.get("hierarchy") in (None, 1)
                and kwargs.get("link") is None and kwargs.get("recalibrate_every") is None, name,
                "pushes go point to point to the parameter server, not through a PSync transport: leave "
                "transport, hierarchy, link and recalibrate_every (CLI --transport, --workers-per-node, --link, "
                "--recalibrate-every) unset")
        super().__init__(params, lr, **kwargs)
        self.staleness = staleness
        self.order = order
        self.codec = codec
        self.compressor = codec.spec
        self.error_feedback = codec.error_feedback_by_default
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
                return LocalLink(self._make_server(), timeout)

            def make() -> ParameterServer:   # on rank 0: a worker that fails or returns is the server's news
                server = self._make_server()
                comm.watch(server.worker_ended)
                return server
            return LocalLink(shared_object(comm, make), timeout)
        if isinstance(comm, comm_lib.TorchGroup):
            star = TorchStar(comm)
            return LocalLink(self._make_server(), timeout, star) if comm.rank == 0 else RemoteLink(star)
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
                             raw_bytes(t for pk in packets for t in pk.wire.values())])
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
