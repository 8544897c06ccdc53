"""PSync, the one communication primitive every method uses (docs/algorithms.md §PSync;
transport: §Transports).

``PSync(v; C)``: each worker compresses its tensors ``v_i`` with ``C``, the workers
exchange the packets, and each gets back ``mean_j C(v_j)`` (or the codec's own aggregate,
e.g. the majority vote of ``sign``) and its local residual ``r_i = v_i - C(v_i)``. Methods
with error memory use both (``v'_i = mean_j C(v_j) + r_i``); the others only the aggregate.

PSync executes a plan (:func:`plan`, :mod:`gradzip.exchange.planner`): the tensors in launch order
(descending key, ≈ the order backward delivers gradients), cut into buckets of up to
``bucket_bytes`` of their own bytes, each on its route. :meth:`PSync.exchange_plan` is the
plan of an exchange; ``describe()`` reports it, ``bench.costs`` prices it.

* Compression on the exact transports is per tensor (layer-wise). Random choices use a seed
  derived from ``(seed, step, tensor key)``, plus the rank for codecs whose randomness is
  private (QSGD, TernGrad), so random-k / random-block pick the same coordinates on every
  worker.
* Routes: the allreduce of the codec's summand when packets sum in compressed form, else
  the allgather of the packets, whichever puts fewer bytes on the wire for this world size
  (ties go to allreduce); e.g. ``2bit``: allgather of packed codes ((n-1)·d/4) below 8
  workers, int8 allreduce (2(n-1)/n·d) from 8 on (int16 from 128). ``transport=``
  (:data:`TRANSPORTS`): ``"allreduce"`` / ``"allgather"`` pin the collective;
  ``"twophase"`` sends every bucket through the two-phase compressed allreduce of
  :mod:`gradzip.exchange.twophase` (slices of the bucket, a server error: it changes the numbers);
  ``"auto"`` (default) takes the exact routes and two-phase only where the link model says
  it costs at most half (``link``; :data:`gradzip.exchange.planner.DEFAULT_LINK` when None).
* ``compressor="auto:<codec>"`` (docs/algorithms.md §Auto codec choice): each unit of the
  plan goes with the codec or uncompressed, by rank 0's decision from costs every worker
  measured (:mod:`gradzip.exchange.calibration`), made at the first exchange of a set of tensors (and
  again every ``recalibrate_every`` steps); ``link``: declared, or None to measure it. The
  decisions are the exchange's state (``state_dict()``), so a resume executes them unprobed.
* One collective per bucket and route: one buffer per summand dtype for allreduce, raw bytes
  for allgather. Decoding is per tensor again. With integer summands, or on the in-process
  group, bucketing changes no bit on the exact transports; a float sum inside a real
  collective may associate differently (≈1 ulp).

``start()`` compresses and launches the collectives asynchronously, bucket by bucket, and
returns a :class:`Pending`; ``Pending.wait()`` decodes. ``__call__`` does both.

Complex tensors travel as their real views (``torch.view_as_real``: float, last dimension
2), as torch's optimizers treat complex parameters: every codec, transport, seed and
bucket sees that real tensor, and the aggregates and residuals come back complex (:mod:`.complexes`).

Overflow guard (``check_finite=True``, what the optimizers set unless ``nonfinite="off"``):
a codec can turn finite inputs into Inf/NaN (fp16 above 65504, QSGD's norm of 1e20, a sum
of two 3e38). ``wait()`` checks the decoded aggregates (one sum per tensor, an exact look
only where a sum is not finite) and raises :class:`NonFiniteAggregate` naming the tensor.
The aggregate is the same on every worker, so every worker raises at the same exchange,
with no collective to agree. Where the codec carries every NaN/Inf of any worker's input
into the aggregate (``none``, ``fp16``, ``bf16``: ``Compressor.propagates_nonfinite``) on an
exact transport, the same check also finds a non-finite *input* (:attr:`PSync.guards_inputs`):
a method may then leave its gradients unread before the exchange and tell the two causes
apart only when it raised (``NonFiniteGuard.codec_overflow``).

Memory across steps (what a PSync reuses, and why it is safe) is :mod:`.memory`'s.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .. import seeds
from ..comm import Group, Work
from ..compressors import Auto, Compressor, Packet, PerTensor, build
from ..errors import GradzipError
from ..guards.nonfinite import NonFiniteAggregate, first_nonfinite
from . import calibration
from .planner import (DEFAULT_BUCKET_BYTES, DEFAULT_LINK, TRANSPORTS, Bucket, CodecCost, Link, Plan, as_link,
                      check_transport, plan)
from .complexes import real_views, with_complex
from .memory import Spares, storage, storages
from .twophase import ServerErrors, TwoPhase, check_round_bytes, phase2_seed

__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_LINK", "TRANSPORTS", "Link", "Pending", "Plan", "PSync", "Result",
           "Timings", "mix_seed", "plan"]

#: The codecs' seed derivation (:func:`gradzip.seeds.mix`), under the name callers know.
mix_seed = seeds.mix


@dataclass
class Timings:
    """Seconds of codec work (compress, decode, packing: ``compress_s``) and of waiting on
    collectives (``communicate_s``), wherever they ran; and the part of each that blocked
    the training thread (the thread that created the exchange): ``inline_compress_s`` and
    ``wait_s``. For a method that exchanges inside ``step()`` the two pairs are equal; a
    method that overlaps the exchange with the next computation blocks for less."""

    compress_s: float = 0.0
    communicate_s: float = 0.0
    wait_s: float = 0.0
    inline_compress_s: float = 0.0

    def __add__(self, other: "Timings") -> "Timings":
        return Timings(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclass
class Result:
    """What one PSync returns to this worker, in the order of the input tensors."""

    aggregate: list[torch.Tensor]          # mean_j C(v_j) (or the codec's aggregate)
    residual: list[torch.Tensor] | None    # v_i - C(v_i), when asked for
    bytes_sent: int                        # what this exchange put on the wire for this worker
    packet_bytes: int                      # this worker's compressed payload (sum of packet.nbytes)


@dataclass
class _Bucket:
    """An exact bucket in flight: one collective over its members' summands or packets."""

    kind: str                      # "allreduce" or "allgather"
    members: list[int]             # tensor positions
    sizes: list[int]               # buffer elements per member
    work: Work
    buffer: torch.Tensor | None = None  # the flat buffer sent, when it is a reusable one


@dataclass
class _TwoPhaseBucket:
    """A two-phase bucket in flight: its members (positions, shapes) and its exchange."""

    members: list[int]
    shapes: list[torch.Size]
    exchange: TwoPhase


@dataclass
class Pending:
    """An exchange in flight; ``wait()`` returns its :class:`Result`."""

    psync: "PSync"
    packets: list[Packet | None]                   # per tensor (None: two-phase)
    buckets: list[_Bucket]
    residual: list[torch.Tensor] | None
    packet_bytes: int
    keys: Sequence[int] = ()
    recyclable: list[bool] = field(default_factory=list)  # packet i's wire is not its input
    twophase: list[_TwoPhaseBucket] = field(default_factory=list)
    codecs: list = field(default_factory=list)     # packet i's codec (None: two-phase)
    reuse_aggregates: bool = False                 # PSync.reuse_aggregates when it started
    #: per tensor, asked with ``start(digest_inputs=True)``: the digest
    #: (:func:`gradzip.kernels.digest.digest`) of an input its bucket copied as it is (``none``
    #: on an allreduce), made in that copy; None for the others
    digests: list = field(default_factory=list)
    _result: Result | None = field(default=None, repr=False)

    def wait(self) -> Result:
        if self._result is None:
            self._result = self.psync._finish(self)
        return self._result


class PSync:
    """Compress → exchange → decode for one worker, along the exchange's plan (see the
    module docstring)."""

    def __init__(self, comm: Group, compressor: "str | Compressor | None" = "none", *,
                 seed: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, check_finite: bool = False,
                 transport: str = "auto", allow_twophase: bool = True, round_bytes: int | None = None,
                 link: "str | Link | None" = None, recalibrate_every: int | None = None):
        self.comm = comm
        self.transport = check_transport(transport)
        #: two-phase: each phase's all-to-all in rounds of at most this many bytes per message
        #: (None: whole messages); see :func:`gradzip.exchange.twophase.rounds`
        self.round_bytes = check_round_bytes(round_bytes)
        #: the link ``auto`` prices transports on (:func:`gradzip.exchange.planner.as_link`)
        self.link = as_link(link)
        #: auto:<codec>: the declared link (None: measured at the calibration)
        self.declared_link = None if link is None else self.link
        #: auto:<codec>: decide again at the first exchange ``recalibrate_every`` steps after a decision
        self.recalibrate_every = calibration.check_recalibrate_every(recalibrate_every)
        # False: "auto" stays exact (a method that reads the packets, e.g. DGC's selection)
        self.allow_twophase = bool(allow_twophase)
        if transport == "twophase" and not allow_twophase:
            raise GradzipError("transport='twophase' is not available to this exchange (its method reads the "
                               "whole-tensor packets); use transport='auto', 'allreduce' or 'allgather'")
        self.check_finite = bool(check_finite)  # raise NonFiniteAggregate (module docstring)
        self.compressor = build(compressor)   # a codec, or a PerTensor policy: see codec_for
        #: key -> parameter name, for a PerTensor policy's name rules (set by the owner:
        #: the optimizer from its named parameters, the DDP hook from its model)
        self.names: dict[int, str] = {}
        self._codecs: dict = {}                # (key, shape, dtype) -> the policy's codec
        if isinstance(self.compressor, PerTensor):   # per-tensor codecs travel on the exact transports
            if transport not in ("auto", "allgather"):
                raise GradzipError(f"transport={transport!r} needs one codec for every tensor; a PerTensor policy "
                                   "travels on the exact transports: use transport='auto' or 'allgather'")
            self.allow_twophase = False
        elif transport == "allreduce" and self.compressor.sum_dtype(comm.world_size, torch.float32) is None:
            raise GradzipError(f"transport='allreduce': {self.compressor.spec} packets do not sum in compressed form "
                               f"on {comm.world_size} workers; use transport='auto', 'allgather' or 'twophase'")
        elif transport == "twophase" and self.compressor.shared_randomness:
            # their hidden choices (indices, blocks) come from the seed, which the second
            # compression changes, and their allreduce is already flat (the spec: nothing to gain)
            raise GradzipError(f"transport='twophase' with {self.compressor.spec}: its packets sum in compressed form "
                               "(the allreduce is already flat in the number of workers) and its choices come from "
                               "the shared seed, which two-phase's second compression changes; use transport='auto' "
                               "or 'allreduce'")
        self.server_errors = ServerErrors()   # the two-phase E_j (gradzip.exchange.twophase)
        self._plans: dict = {}
        #: auto:<codec>: rank 0's decision per set of tensors ((shapes, dtypes), keys), in the order made
        self.decisions: dict[tuple, calibration.Decision] = {}
        self._source_cache: dict[tuple, list[tuple]] = {}   # key -> _sources(key), until a decision is made
        #: bumped whenever a decision is made or loaded (the backward hooks' plans key on it)
        self.plan_version = 0
        #: auto:<codec>'s trial: when this process's first exchange of each of the last steps began (perf_counter),
        #: and the seconds its decisions' probes took in each step (not a cost of the choices timed)
        self._step_began: dict[int, float] = {}
        self._probing: dict[int, float] = {}
        self.seed = int(seed)
        self.bucket_bytes = int(bucket_bytes)
        self.timings = Timings()
        self._owner = threading.get_ident()  # the training thread (see Timings)
        self.tracer = None      # a gradzip.trace.Tracer: spans for compress / communicate / decode
        self.bytes_sent = 0     # what this worker put on the wire, all exchanges so far
        self.payload_bytes = 0  # its compressed packets (sum of packet.nbytes)
        self.memory = Spares()  # what waited exchanges leave for the next start() (.memory)
        #: opt-in (module docstring, memory): the caller reads an exchange's aggregates
        #: before its next ``start()`` and keeps none, so their memory may be reused
        self.reuse_aggregates = False
        #: opt-in: key -> a tensor of the caller's that it no longer needs (e.g. EF-SGD's last
        #: exchange input); the next ``start()`` writes that key's residual into it (taken once)
        self.residual_spares = self.memory.residuals
        #: opt-in: the caller reads a residual of None as zeros, so a tensor whose codec is
        #: lossless (``none``: ``Compressor.lossless``) gets None instead of a residual
        #: computed as ``v − v`` (no pass over its memory, no memory kept)
        self.omit_zero_residuals = False

    def counters(self) -> dict:
        """Bytes and seconds so far (for a checkpoint): ``load_counters`` restores them."""
        return {"bytes_sent": self.bytes_sent, "payload_bytes": self.payload_bytes,
                "timings": dataclasses.asdict(self.timings)}

    def load_counters(self, counters: dict) -> None:
        self.bytes_sent = int(counters["bytes_sent"])
        self.payload_bytes = int(counters["payload_bytes"])
        self.timings = Timings(**counters["timings"])

    def state_dict(self) -> dict:
        """The exchange's own state: the two-phase server errors (``{"key:slice": E}``) and,
        for auto:<codec>, its decisions (``"auto"``: one entry per set of tensors)."""
        state = {"server_errors": self.server_errors.state_dict()}
        if self.decisions:
            state["auto"] = calibration.save(self.decisions)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.server_errors.load_state_dict(state.get("server_errors", {}))
        if isinstance(self.compressor, Auto):   # the decisions resume as they were (no probe)
            self.decisions.clear()
            self.decisions.update(calibration.load(state.get("auto", [])))
            self._source_cache.clear()
            self.plan_version += 1

    # -- the plan -----------------------------------------------------------------------
    def exchange_plan(self, tensors: Sequence, keys: Sequence[int] | None = None,
                      step: int | None = None) -> tuple[list[int], Plan]:
        """The plan of an exchange of ``tensors`` (tensors, or shapes: float32) with ``keys``
        (default: their positions), and its order: the positions of the tensors in launch
        order (descending key). The same on every worker; cached. auto:<codec>: the plan of
        the decision for these tensors; ``step`` given (a call every worker makes at the same
        point: the exchange's start, the first hook of a step), the decision is made first
        where none is, or where ``recalibrate_every`` says so (collective); without a
        decision, the rule's on the declared link with free coding (what ``describe()``
        shows before the first exchange). Each tensor executes the latest decision covering it
        (:meth:`_sources`): a set's own, or others' (DDP's rebuilt buckets)."""
        keys = list(range(len(tensors))) if keys is None else list(keys)
        specs = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else (tuple(t), torch.float32)
                 for t in tensors]
        specs = [(shape + (2,), dtype.to_real()) if dtype.is_complex else (shape, dtype)   # their real views
                 for shape, dtype in specs]
        order = sorted(range(len(specs)), key=lambda i: -keys[i])
        ordered = tuple(specs[i] for i in order)
        key = (ordered, tuple(keys[i] for i in order))
        if not isinstance(self.compressor, Auto):
            return self._cached_plan(specs, keys, order, ordered, None)
        if step is not None:
            device = next((t.device for t in tensors if isinstance(t, torch.Tensor)), torch.device("cpu"))
            for source in self._sources(key):
                self._calibrate(source, device, step)
        sources = self._sources(key)
        if sources == [key]:
            return self._cached_plan(specs, keys, order, ordered, self.decisions.get(key))
        return self._superseded_plan(specs, keys, order, ordered, sources)

    def _cached_plan(self, specs, keys, order, ordered, decision) -> tuple[list[int], Plan]:
        """The plan of one set of tensors (``specs``, ``keys``: as given; ``order``: launch order,
        ``ordered``: its specs in it) by its own decision (auto:<codec>; None: the rule's)."""
        cached = (tuple(specs), tuple(keys), decision)
        if cached not in self._plans:
            codecs = [self.codec_for(keys[i], torch.empty(specs[i][0], dtype=specs[i][1], device="meta"))
                      for i in order]
            self._plans[cached] = order, (self._plan(ordered, codecs) if decision is None else
                                          self._plan(ordered, codecs, decision.link, choices=decision.choices))
        return self._plans[cached]

    def _sources(self, key: tuple) -> list[tuple]:
        """auto:<codec>: the sets of tensors whose decisions the tensors of ``key`` execute: per
        tensor, in launch order, the set of the latest decision covering it (by step; of one
        step, the one made last); ``[key]`` where that is ``key``'s own for each, or where
        some tensor has none (a decision for ``key`` is then due). So DDP's buckets, rebuilt
        after its first step, execute per tensor the decisions made for its initial buckets at
        step 1, and so does a resumed run, whose first step runs the initial buckets again
        (docs/algorithms.md §Auto codec choice, "Resume"); a set decided before others that
        cover its tensors executes theirs."""
        known = self._source_cache.get(key)
        if known is not None:
            return known
        wanted, latest = set(key[1]), {}
        for other, decision in self.decisions.items():
            for tensor in wanted.intersection(other[1]):
                if tensor not in latest or decision.step >= self.decisions[latest[tensor]].step:
                    latest[tensor] = other
        if len(latest) < len(wanted) or all(source == key for source in latest.values()):
            sources = [key]
        else:
            sources = list(dict.fromkeys(latest[tensor] for tensor in key[1]))
        self._source_cache[key] = sources
        return sources

    def _superseded_plan(self, specs, keys, order, ordered, sources: list[tuple]) -> tuple[list[int], Plan]:
        """The plan of a set whose tensors execute other sets' decisions (:meth:`_sources`): each
        tensor with the codec its source's plan gives it, in buckets of this set; on the exact
        routes (the DDP hook's only ones) per tensor the numbers of the source's plan, bit for
        bit."""
        cached = (tuple(specs), tuple(keys), tuple(self.decisions[s] for s in sources))
        if cached not in self._plans:
            codec_of = {}
            for source_specs, source_keys in sources:   # each in launch order: its plan's order too
                _, source_plan = self._cached_plan(source_specs, source_keys, list(range(len(source_keys))),
                                                   source_specs, self.decisions[(source_specs, source_keys)])
                codec_of.update(zip(source_keys, source_plan.codecs))
            self._plans[cached] = order, self._plan(ordered, [codec_of[keys[i]] for i in order])
        return self._plans[cached]

    def prepare(self, tensors: Sequence, keys: Sequence[int] | None, step: int) -> None:
        """Make the exchange's decision for these tensors where it is due (auto:<codec>;
        collective): what the backward hooks call before they cut the step into buckets; nothing
        for any other codec (no decision: its plan is the same at every step)."""
        if isinstance(self.compressor, Auto):
            self.exchange_plan(tensors, keys, step)

    def _plan(self, specs, codecs, link: Link | None = None, costs: dict[str, CodecCost] | None = None,
              choices: Sequence[str] | None = None) -> Plan:
        return plan([s for s, _ in specs], codecs, self.comm.world_size, transport=self.transport,
                    bucket_bytes=self.bucket_bytes, link=link or self.link, dtypes=[d for _, d in specs],
                    twophase=self.allow_twophase, codec_costs=costs, choices=choices)

    def _probe(self) -> tuple[Group, int]:
        """The group auto's link probe and decode timing run on, and how many such groups
        share the probed link at once (the hierarchical exchange: its group across nodes)."""
        return self.comm, 1

    def _calibrate(self, key: tuple, device: torch.device, step: int) -> None:
        """auto:<codec>: rank 0's decision for the tensors of ``key`` (docs/algorithms.md §Auto
        codec choice), where none is or ``recalibrate_every`` steps have passed since the
        last, or the next step of its trial (:meth:`_advance_trial`); the units that switch are
        logged. Counted as communication."""
        began = time.perf_counter()
        if step not in self._step_began:   # the trial's clock: the last exchanges only
            self._step_began[step] = began
            if len(self._step_began) > calibration.RETRIED_EXCHANGES + 2:
                oldest = min(self._step_began)
                del self._step_began[oldest]
                self._probing.pop(oldest, None)
        old = self.decisions.get(key)
        if old is not None and old.on_trial:
            self._advance_trial(key, old, step)
            return
        if old is not None and (self.recalibrate_every is None or step - old.step < self.recalibrate_every):
            return
        specs, _ = key
        codecs = [self.compressor] * len(specs)
        # one link probe for every set of tensors: reuse the last measured link, except where it is a
        # recalibration (then the first set due this step probes again)
        latest = max((d for d in self.decisions.values() if d.measured), key=lambda d: d.step, default=None)
        reuse = latest if latest is not None and (old is None or latest.step == step) else None
        link = self.declared_link or (reuse.link if reuse is not None else None)
        probe, share = self._probe()
        decision = calibration.decide(
            self.comm, self.compressor, [s for s, _ in specs], [d for _, d in specs],
            lambda link, costs: self._plan(specs, codecs, link, costs), step, link=link, probe=probe,
            uplink_share=share, device=device, seed=self.seed)
        if reuse is not None and self.declared_link is None:
            decision = dataclasses.replace(decision, measured=True)
        decision = calibration.on_trial(decision)
        # the trial's first period leaves the probes out: every decision of the step (DDP decides per bucket)
        self._probing[step] = self._probing.get(step, 0.0) + time.perf_counter() - began
        if old is not None:
            for change in calibration.switches(old, decision):
                calibration.log.warning("%s exchange (seed %d), step %d: %s", self.compressor.spec, self.seed, step,
                                        change)
        self.decisions[key] = decision
        self._source_cache.clear()
        self.plan_version += 1
        self.count_wait(began, time.perf_counter())

    def _advance_trial(self, key: tuple, decision: calibration.Decision, step: int) -> None:
        """The trial of ``decision`` at the first exchange of ``step``
        (:func:`gradzip.exchange.calibration.advance`; its verdict is collective and counts
        as communication, and is logged)."""
        began = time.perf_counter()
        new = calibration.advance(self.comm, decision, step, self._step_seconds)
        self.decisions[key] = new
        if new.choices != decision.choices:
            self.plan_version += 1
        if new.verdict is not None:
            calibration.log.info("%s exchange (seed %d), step %d: %s", self.compressor.spec, self.seed, step,
                                 new.describe())
            self.count_wait(began, time.perf_counter())

    def _step_seconds(self, step: int) -> float | None:
        """Seconds from the first exchange of ``step`` to the first of the next step this
        exchange ran at, less what the step's decisions took (their probes: not the cost of
        the choices the trial times); None: not both seen by this process."""
        later = [s for s in self._step_began if s > step]
        if step not in self._step_began or not later:
            return None
        return self._step_began[min(later)] - self._step_began[step] - self._probing.get(step, 0.0)

    def describe_decisions(self) -> str | None:
        """auto:<codec>: every decision in one line (``describe()``'s ``exchange i auto``), or
        ``"not decided yet"``; None for any other codec."""
        if not isinstance(self.compressor, Auto):
            return None
        return " | ".join(d.describe() for d in self.decisions.values()) or "not decided yet"

    def routes(self, tensors: Sequence, keys: Sequence[int] | None = None) -> list[str]:
        """The route of each tensor (or shape) of an exchange, in the order given."""
        order, p = self.exchange_plan(tensors, keys)
        out = [""] * len(order)
        for route, i in zip(p.routes(), order):
            out[i] = route
        return out

    # -- the public calls ---------------------------------------------------------------
    def __call__(self, tensors: Sequence[torch.Tensor], step: int, *,
                 keys: Sequence[int] | None = None, residual: bool = True) -> Result:
        return self.start(tensors, step, keys=keys, residual=residual).wait()

    def start(self, tensors: Sequence[torch.Tensor], step: int, *, keys: Sequence[int] | None = None,
              residual: bool = True, plan: Plan | None = None, digest_inputs: bool = False) -> Pending:
        """Compress ``tensors`` and launch their collectives, bucket by bucket of the
        exchange's plan; ``keys`` identify each tensor across steps (default: its position)
        for the shared random seeds and the launch order. ``plan``: a plan of these tensors
        in the order given (``Plan.select`` of the exchange's plan: a bucket launched on its
        own, as the backward hooks do). ``digest_inputs``: ``Pending.digests`` holds the
        digest of each input of more than :data:`~gradzip.kernels.digest.SMALL`
        entries that a bucket copies as it is, made in that copy (the backward overlap's edit
        guard reads the gradient no second time in backward)."""
        tensors, complex_at = real_views(tensors)
        keys = list(range(len(tensors)) if keys is None else keys)
        began = time.perf_counter()
        if plan is None:
            order, plan = self.exchange_plan(tensors, keys, step)
            began = time.perf_counter()   # a calibration counts as communication
        else:
            order = list(range(len(tensors)))
        residuals = [None] * len(tensors) if residual else None
        pending = Pending(self, [None] * len(tensors), [], residuals, 0, keys, [False] * len(tensors),
                          codecs=[None] * len(tensors), reuse_aggregates=self.reuse_aggregates,
                          digests=[None] * len(tensors) if digest_inputs else [])
        for bucket in plan.buckets:
            members = [order[i] for i in bucket.tensors]
            codecs = [plan.codecs[i] for i in bucket.tensors]
            if bucket.route == "twophase":
                pending.twophase.append(self._start_twophase(codecs[0], tensors, members, keys, step, residuals))
                pending.packet_bytes += pending.twophase[-1].exchange.sent.wire.numel()
            else:
                self._start_exact(bucket, members, codecs, tensors, keys, step, pending)
        self.payload_bytes += pending.packet_bytes
        ended = time.perf_counter()
        self._add_compress(ended - began)
        if self.tracer is not None:
            self.tracer.add("compress", began, ended, bytes=pending.packet_bytes)
        return with_complex(pending, complex_at)

    @property
    def guards_inputs(self) -> bool:
        """Whether the aggregate check (``check_finite``) also raises on a NaN/Inf in any
        worker's input (module docstring, overflow guard): one codec that propagates
        non-finite values, on an exact transport."""
        codec = self.compressor
        return (self.check_finite and not isinstance(codec, PerTensor) and codec.propagates_nonfinite
                and self.transport != "twophase")

    def plan_guards_inputs(self, plan: Plan) -> bool:
        """:attr:`guards_inputs` for one plan of this exchange: every codec it sends with
        propagates non-finite values (an auto:<codec> decision's, a PerTensor policy's, e.g.
        auto's units all uncompressed), every bucket on an exact route."""
        return (self.check_finite and bool(plan.codecs) and all(c.propagates_nonfinite for c in plan.codecs)
                and all(b.route in ("allreduce", "allgather") for b in plan.buckets))

    def codec_for(self, key: int, tensor: torch.Tensor) -> Compressor:
        """The codec of the tensor with ``key``: the PSync's codec, or what its
        :class:`~gradzip.compressors.PerTensor` policy picks by the key's parameter name
        (:attr:`names`) and the tensor's shape (once per key, shape and dtype)."""
        policy = self.compressor
        if not isinstance(policy, PerTensor):
            return policy
        cached = (key, tuple(tensor.shape), tensor.dtype)
        codec = self._codecs.get(cached)
        if codec is None:
            codec = self._codecs[cached] = policy.resolve(self.names.get(key), tensor)
        return codec

    # -- internals: starting a bucket -------------------------------------------------------
    def _start_exact(self, bucket: Bucket, members: list[int], codecs: list[Compressor], tensors, keys, step: int,
                     pending: Pending) -> None:
        """Compress the bucket's tensors with their codecs (the plan's; their residuals too,
        when asked) and launch its collective: the members' summands (allreduce) or raw
        packets (allgather), back to back."""
        parts, sizes, private = [], [], False
        for codec, run in itertools.groupby(zip(members, codecs), key=lambda member: member[1]):
            run = [i for i, _ in run]   # the next members with one codec
            if bucket.route == "allreduce" and codec.sends_input and not self._returns_residual(pending, codec):
                sent = self._send_as_they_are(codec, run, tensors, pending, parts, sizes)
            else:
                sent = self._compress_each(bucket, codec, run, tensors, keys, step, pending, parts, sizes)
            private = private or sent
        device = tensors[members[0]].device
        digests = [] if pending.digests and bucket.route == "allreduce" else None
        buffer, reusable = self.memory.bucket_buffer(bucket.route, bucket.dtype, device, parts, private, digests)
        for i, part, made in zip(members, parts, digests or ()):
            t = tensors[i]
            if made is not None and part.data_ptr() == t.data_ptr() and part.numel() == t.numel() and t.is_contiguous():
                pending.digests[i] = made   # the input itself was copied (none): its digest
        collective = self.comm.allreduce if bucket.route == "allreduce" else self.comm.allgather
        work = collective(buffer, async_op=True)
        self.bytes_sent += work.nbytes
        pending.buckets.append(_Bucket(bucket.route, members, sizes, work, buffer if reusable else None))

    def _compress_each(self, bucket: Bucket, codec: Compressor, members: list[int], tensors, keys, step: int,
                       pending: Pending, parts: list, sizes: list) -> bool:
        """Compress ``members`` one by one with ``codec`` (their residuals too, when asked);
        their summands (allreduce) or raw wire bytes (allgather) onto ``parts``, each one's
        number of entries onto ``sizes``. Returns whether a summand is an input's memory
        (the bucket is then copied: a collective may write into what it sends)."""
        n, private = self.comm.world_size, False
        spares = self.memory.packets([tensors[i] for i in members], [keys[i] for i in members])
        for i, old in zip(members, spares):
            t, key = tensors[i], keys[i]
            home = storage(t)   # the input's memory
            pending.codecs[i] = codec
            if self._returns_residual(pending, codec):
                # one fused pass where the codec has one (Compressor.compress_residual)
                pending.residual[i] = self.memory.residual(key, t)
                packet = codec.compress_residual(t.detach(), self._seed(step, key, codec), pending.residual[i],
                                                 reuse=old)
            else:
                packet = codec.compress(t.detach(), self._seed(step, key, codec), reuse=old)
            pending.packets[i] = packet
            pending.recyclable[i] = home not in storages(packet.wire.values())
            pending.packet_bytes += packet.nbytes
            if bucket.route == "allreduce":
                summand = codec.summand(packet, n).reshape(-1)
                private = private or storage(summand) == home
                parts.append(summand)
                sizes.append(summand.numel())
            else:
                flat = [w.reshape(-1).view(torch.uint8) for w in packet.wire.values()]
                parts.extend(flat)
                sizes.append(sum(f.numel() for f in flat))
        return private

    def _returns_residual(self, pending: Pending, codec: Compressor) -> bool:
        """Whether ``codec``'s members get a residual tensor: asked for, and not the zero one of a
        lossless codec that the caller reads as None (:attr:`omit_zero_residuals`)."""
        return pending.residual is not None and not (codec.lossless and self.omit_zero_residuals)

    @staticmethod
    def _send_as_they_are(codec: Compressor, members: list[int], tensors, pending: Pending, parts: list,
                          sizes: list) -> bool:
        """:meth:`_compress_each` for a codec that sends its input as it is on an allreduce
        (``Compressor.sends_input``: ``none``), in one pass over the members: its packet wraps
        the input, its summand is the input, flat; no seed, no spare packet, no residual (zero,
        omitted), never recycled (the wire is the input). Returns True: the summands are the
        inputs' memory. (``members``: one run, not empty.)"""
        packets = [codec.compress(tensors[i]) for i in members]   # its wire: the input, detached
        inputs = [packet.wire["x"] for packet in packets]
        flats = [t.reshape(-1) for t in inputs]
        counts = [f.numel() for f in flats]
        for i, packet in zip(members, packets):
            pending.codecs[i] = codec
            pending.packets[i] = packet
        pending.packet_bytes += sum(counts) * inputs[0].element_size()
        parts.extend(flats)
        sizes.extend(counts)
        return True

    def _start_twophase(self, codec: Compressor, tensors, members: list[int], keys, step: int,
                        residuals) -> _TwoPhaseBucket:
        """Phase 1 of a two-phase bucket (:class:`gradzip.exchange.twophase.TwoPhase`) with ``codec``;
        the residual of each member is its part of the bucket's residual."""
        flats = [tensors[i].detach().reshape(-1) for i in members]
        x = torch.cat(flats) if len(flats) > 1 else flats[0]
        r = None if residuals is None else torch.empty_like(x)
        key = keys[members[0]]
        exchange = TwoPhase.start(codec, self.comm, x, key, step, self._seed(step, key, codec), r,
                                  self.round_bytes)
        self.bytes_sent += exchange.work.nbytes
        if r is not None:
            at = 0
            for i, f in zip(members, flats):
                residuals[i] = r[at:at + f.numel()].view(tensors[i].shape)
                at += f.numel()
        return _TwoPhaseBucket(members, [tensors[i].shape for i in members], exchange)

    def _seed(self, step: int, key: int, codec: Compressor | None = None) -> int:
        codec = codec or self.compressor
        if not codec.uses_seed:
            return 0
        if codec.shared_randomness:
            return mix_seed(self.seed, step, key)
        return mix_seed(self.seed, step, key, self.comm.rank + 1)

    # -- internals: finishing --------------------------------------------------------------
    def count_wait(self, began: float, ended: float) -> None:
        """Count ``[began, ended]`` (perf_counter) as time blocked on this exchange's network:
        a method's own small collective issued behind its buckets (gloo runs a group's
        collectives in order, so it waits for them) belongs to communication, not update."""
        self.timings.communicate_s += ended - began
        if threading.get_ident() == self._owner:
            self.timings.wait_s += ended - began
        if self.tracer is not None:   # a "wait" span, as CD-SGD's wait for its exchange
            self.tracer.add("wait", began, ended)

    def _add_compress(self, seconds: float) -> None:
        self.timings.compress_s += seconds
        if threading.get_ident() == self._owner:
            self.timings.inline_compress_s += seconds

    def _finish(self, pending: Pending) -> Result:
        n = self.comm.world_size
        out: list[torch.Tensor | None] = [None] * len(pending.packets)
        finite: set[int] = set()   # the members whose decode found their aggregate finite
        sent, errors = 0, {}
        for tb in pending.twophase:
            sent += self._finish_twophase(tb, pending.keys, out, errors)
        for bucket in pending.buckets:
            began = time.perf_counter()
            gathered = bucket.work.wait()
            decoding = time.perf_counter()
            self.timings.communicate_s += decoding - began
            if threading.get_ident() == self._owner:
                self.timings.wait_s += decoding - began
            if self.tracer is not None:
                self.tracer.add("communicate", began, decoding, kind=bucket.kind, bytes=bucket.work.nbytes)
            sent += bucket.work.nbytes
            self._decode_bucket(bucket, gathered, pending, out, finite)
            decoded = time.perf_counter()
            self._add_compress(decoded - decoding)
            if self.tracer is not None:
                self.tracer.add("decode", decoding, decoded)
        if self.check_finite:
            unchecked = [i for i in range(len(out)) if i not in finite]
            bad = first_nonfinite([out[i] for i in unchecked])
            if bad >= 0:
                bad = unchecked[bad]
                spec = (pending.codecs[bad] or self.compressor).spec
                raise NonFiniteAggregate(
                    f"the {spec} exchange of tensor #{bad} (shape {tuple(out[bad].shape)}) decoded a "
                    f"non-finite aggregate (NaN or Inf) from finite inputs: the codec or the sum over "
                    f"{n} workers overflowed; stopped on every worker before it was applied", bad)
        self.server_errors.errors.update(errors)   # only once the aggregate passed the check
        self.memory.release(pending, out)
        return Result(out, pending.residual, sent, pending.packet_bytes)

    def _decode_bucket(self, bucket: _Bucket, gathered: torch.Tensor, pending: Pending, out: list,
                       finite: set) -> None:
        """Each member's aggregate from what its bucket's collective returned: from the sum
        (one ``from_sums`` call per run of members with one codec), or from every worker's
        packet; into ``finite`` the members whose decode found them finite on the way
        (``from_sums_checked``: ``none``'s division), which the aggregate check skips."""
        n = self.comm.world_size
        offset = 0
        for codec, run in itertools.groupby(zip(bucket.members, bucket.sizes), key=lambda m: pending.codecs[m[0]]):
            members, sizes = zip(*run)
            packets = [pending.packets[i] for i in members]
            end = offset + sum(sizes)
            if bucket.kind == "allreduce":
                aggregates, checked = codec.from_sums_checked(gathered[offset:end], packets, list(sizes), n)
                if checked:
                    finite.update(members)
            else:   # every worker's packets: row j of the gathered bytes is worker j's
                parts = gathered.reshape(n, -1)[:, offset:end].split(list(sizes), dim=1)
                aggregates = [codec.aggregate([packet.from_raw(row) for row in part])
                              for packet, part in zip(packets, parts)]
            for i, aggregate in zip(members, aggregates):
                out[i] = aggregate
            offset = end

    def _finish_twophase(self, tb: _TwoPhaseBucket, keys, out: list, errors: dict) -> int:
        """Phase 2 of a two-phase bucket; its members' aggregates into ``out``, its new
        server error into ``errors``. Returns the bytes both rounds sent."""
        ex, rank = tb.exchange, self.comm.rank
        flat, error, nbytes = ex.finish(self.server_errors.errors.get((ex.key, rank)),
                                        phase2_seed(self.seed, ex.step, ex.key, rank), self.count_wait,
                                        self._add_compress)
        self.bytes_sent += nbytes - ex.work.nbytes   # phase 1 was counted when it started
        if error is not None:
            errors[(ex.key, rank)] = error
        at = 0
        for i, shape in zip(tb.members, tb.shapes):
            out[i] = flat[at:at + shape.numel()].view(shape)
            at += shape.numel()
        return nbytes


