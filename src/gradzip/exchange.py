"""PSync, the one communication primitive every method uses (docs/algorithms.md §PSync;
transport: §Transports).

``PSync(v; C)``: each worker compresses its tensors ``v_i`` with ``C``, the workers
exchange the packets, and each gets back ``mean_j C(v_j)`` (or the codec's own aggregate,
e.g. the majority vote of ``sign``) and its local residual ``r_i = v_i - C(v_i)``. Methods
with error memory use both (``v'_i = mean_j C(v_j) + r_i``); the others only the aggregate.

Transport (never changes the numbers a method sees):

* Compression is per tensor (layer-wise). Random choices use a seed derived from
  ``(seed, step, tensor key)``, plus the rank for codecs whose randomness is private
  (QSGD, TernGrad), so random-k / random-block pick the same coordinates on every worker.
* Collective choice, per tensor: allreduce of the codec's summand when packets sum in
  compressed form, else allgather of the packets, whichever puts fewer bytes on the wire
  for this world size (ring costs, ``gradzip.comm.base``); ties go to allreduce. E.g.
  ``2bit``: allgather of packed codes ((n-1)·d/4) below 8 workers, int8 allreduce
  (2(n-1)/n·d) from 8 on (exact for n <= 127; int16 up to 32767).
* ``transport=`` (:data:`gradzip.twophase.TRANSPORTS`): ``"allreduce"`` / ``"allgather"``
  pin the collective; ``"twophase"`` sends every tensor through the two-phase compressed
  allreduce of :mod:`gradzip.twophase` (per-slice compression and a server error: it
  changes the numbers); ``"auto"`` (default) takes the cheapest exact collective per tensor
  and two-phase only where the model says it costs at most half (``twophase.choose``).
  ``plan()`` says which, per tensor; the server errors are in ``state_dict()``.
* Small tensors are flattened into buckets of up to ``bucket_bytes`` per collective: one
  buffer per summand dtype for allreduce, raw bytes for allgather. Decoding is per tensor
  again. With integer summands, or on the in-process group, bucketing changes no bit; a
  float sum inside a real collective may associate differently (≈1 ulp).

``start()`` compresses and launches the collectives asynchronously and returns a
:class:`Pending`; ``Pending.wait()`` decodes. ``__call__`` does both.

Complex tensors travel as their real views (``torch.view_as_real``: float, last dimension
2), as torch's optimizers treat complex parameters: every codec, transport, seed and
bucket sees that real tensor, and the aggregates and residuals come back complex.

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

Memory across steps (what a PSync reuses, and why it is safe): once ``wait()`` has
decoded an exchange, its packets and its multi-tensor bucket buffers have left the
network, so the next ``start()`` writes into them instead of allocating: a packet goes to
the codec as ``compress(..., reuse=)`` for the tensor with the same key, shape and dtype,
a bucket buffer is refilled for a bucket of the same kind, dtype and size. Never reused:
a packet whose wire is its input tensor (``none``), and any packet or buffer that a
returned aggregate shares memory with (a cast's ``from_sum`` may return the summed buffer
itself, ``none``'s is a view of it), unless the caller opted in with
:attr:`PSync.reuse_aggregates` (it reads each aggregate before its next ``start()`` and
keeps none, as S-SGD); a residual is a new tensor (methods keep them) unless the caller
left a tensor it no longer needs in :attr:`PSync.residual_spares` (EF-SGD: its last
exchange input; never one it returned to the user). An
exchange still in flight (CD-SGD overlaps one with the next step) holds its own buffers:
only what ``wait()`` released is reused, so two exchanges in flight simply allocate. A
caller may read ``Pending.packets`` after ``wait()`` until its next ``start()`` (DGC does).
A one-tensor bucket is sent as that tensor (its summand, or a view of its packet's wire:
no copy into a bucket buffer), except a summand that is the caller's input (``none``'s is
its wire, uncopied): it is copied once into a bucket buffer, as several tensors are, since
the allreduce sums in place; other workers' wire tensors are views of the gathered
bytes (a copy only where their dtype's alignment needs it).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from . import seeds
from .comm import Group, Work, allgather_wire_bytes, allreduce_wire_bytes
from .compressors import Compressor, Packet, PerTensor, Slices, build
from .errors import GradzipError
from .nonfinite import NonFiniteAggregate, first_nonfinite
from . import twophase as tp

DEFAULT_BUCKET_BYTES = 4 << 20

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
    kind: str                      # "allreduce" or "allgather"
    dtype: torch.dtype             # of the flat buffer (uint8 for allgather)
    device: torch.device
    members: list[int] = field(default_factory=list)   # tensor positions
    sizes: list[int] = field(default_factory=list)     # buffer elements per member
    parts: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    work: Work | None = None
    buffer: torch.Tensor | None = None  # the flat buffer sent, when it is a reusable one
    private: bool = False          # a part shares memory with an input: never sent in place


@dataclass
class Pending:
    """An exchange in flight; ``wait()`` returns its :class:`Result`."""

    psync: "PSync"
    packets: list[Packet]
    buckets: list[_Bucket]
    residual: list[torch.Tensor] | None
    packet_bytes: int
    step: int = 0
    keys: Sequence[int] = ()
    recyclable: list[bool] = field(default_factory=list)  # packet i's wire is not its input
    twophase: list = field(default_factory=list)   # [_TwoPhaseBucket]: its tensors' packets[i] are None
    codecs: list = field(default_factory=list)     # packet i's codec (None: two-phase)
    reuse_aggregates: bool = False                 # PSync.reuse_aggregates when it started
    _result: Result | None = field(default=None, repr=False)

    def wait(self) -> Result:
        if self._result is None:
            self._result = self.psync._finish(self)
        return self._result


def real_views(tensors: Sequence[torch.Tensor]) -> tuple[Sequence[torch.Tensor], list[int]]:
    """``tensors`` with every complex one as its real view (module docstring), and the
    positions of those."""
    at = [i for i, t in enumerate(tensors) if t.is_complex()]
    return ([torch.view_as_real(t) if t.is_complex() else t for t in tensors] if at else tensors), at


def as_complex(tensors, at: list[int]):
    """The real views at positions ``at`` of the list ``tensors`` as complex tensors again
    (copied where their layout cannot be viewed so); anything but a list as it is."""
    if not at or not isinstance(tensors, list):
        return tensors
    out = list(tensors)
    for i in at:
        t = out[i]
        if t.stride(-1) != 1 or t.storage_offset() % 2 or any(s % 2 for s in t.stride()[:-1]):
            t = t.clone(memory_format=torch.contiguous_format)
        out[i] = torch.view_as_complex(t)
    return out


class _ComplexPending:
    """An exchange with complex tensors in flight as their real views: its residuals and
    what ``wait()`` returns are complex again; everything else is the exchange's."""

    def __init__(self, pending, at: list[int]):
        self.pending, self.at = pending, at
        self.residual = as_complex(pending.residual, at)

    def __getattr__(self, name: str):
        return getattr(self.pending, name)

    def wait(self) -> Result:
        result = self.pending.wait()
        return dataclasses.replace(result, aggregate=as_complex(result.aggregate, self.at),
                                   residual=as_complex(result.residual, self.at))


def with_complex(pending, at: list[int]):
    """``pending`` as it is, or (complex tensors at ``at``) wrapped to return them complex."""
    return _ComplexPending(pending, at) if at else pending


class PSync:
    """Compress → exchange → decode for one worker (see the module docstring)."""

    def __init__(self, comm: Group, compressor: "str | Compressor | None" = "none", *,
                 seed: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, check_finite: bool = False,
                 transport: str = "auto", allow_twophase: bool = True, round_bytes: int | None = None):
        self.comm = comm
        self.transport = tp.check_transport(transport)
        #: two-phase: each phase's all-to-all in rounds of at most this many bytes per message
        #: (None: whole messages); see :func:`gradzip.twophase.rounds`
        self.round_bytes = tp.check_round_bytes(round_bytes)
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
        self.server_errors = tp.ServerErrors()   # the two-phase E_j (gradzip.twophase)
        self._sizer = None if isinstance(self.compressor, PerTensor) else tp.Sizer(self.compressor)
        self._plans: dict = {}
        self._layouts: dict = {}      # two-phase: numels of a bucket -> tp.Layout
        self.seed = int(seed)
        self.bucket_bytes = int(bucket_bytes)
        self.timings = Timings()
        self._owner = threading.get_ident()  # the training thread (see Timings)
        self.tracer = None      # a gradzip.trace.Tracer: spans for compress / communicate / decode
        self.bytes_sent = 0     # what this worker put on the wire, all exchanges so far
        self.payload_bytes = 0  # its compressed packets (sum of packet.nbytes)
        self._lock = threading.Lock()  # start() and wait() may run on different threads
        self._spare_packets: dict = {}  # key -> a waited packet (module docstring: memory)
        self._spare_buffers: dict = {}  # (kind, dtype, device, numel) -> [flat buffers]
        #: opt-in (module docstring, memory): the caller reads an exchange's aggregates
        #: before its next ``start()`` and keeps none, so their memory may be reused
        self.reuse_aggregates = False
        #: opt-in: key -> a tensor of the caller's that it no longer needs (e.g. EF-SGD's last
        #: exchange input); the next ``start()`` writes that key's residual into it (taken once)
        self.residual_spares: dict = {}

    def counters(self) -> dict:
        """Bytes and seconds so far (for a checkpoint): ``load_counters`` restores them."""
        return {"bytes_sent": self.bytes_sent, "payload_bytes": self.payload_bytes,
                "timings": dataclasses.asdict(self.timings)}

    def load_counters(self, counters: dict) -> None:
        self.bytes_sent = int(counters["bytes_sent"])
        self.payload_bytes = int(counters["payload_bytes"])
        self.timings = Timings(**counters["timings"])

    def state_dict(self) -> dict:
        """The exchange's own state: the two-phase server errors (``{"key:slice": E}``)."""
        return {"server_errors": self.server_errors.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.server_errors.load_state_dict(state.get("server_errors", {}))

    def plan(self, tensors: Sequence) -> list[str]:
        """The transport of each tensor (or shape; float32 assumed for shapes) of one
        exchange: the pinned one, or ``auto``'s per-bucket choice (``twophase.choose``);
        the same on every worker."""
        specs = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else (tuple(t), torch.float32)
                      for t in tensors)
        if specs not in self._plans:
            if self.transport != "auto":
                self._plans[specs] = [self.transport] * len(specs)
            elif self._sizer is None:   # a PerTensor policy: each packet routed by its own codec
                self._plans[specs] = ["auto"] * len(specs)
            else:
                self._plans[specs] = tp.choose(self.compressor, self._sizer, specs, self.comm.world_size,
                                               self.bucket_bytes, twophase=self.allow_twophase)
        return list(self._plans[specs])

    # -- the public calls ---------------------------------------------------------------
    def __call__(self, tensors: Sequence[torch.Tensor], step: int, *,
                 keys: Sequence[int] | None = None, residual: bool = True) -> Result:
        return self.start(tensors, step, keys=keys, residual=residual).wait()

    def start(self, tensors: Sequence[torch.Tensor], step: int, *,
              keys: Sequence[int] | None = None, residual: bool = True) -> Pending:
        """Compress ``tensors`` and launch their collectives; ``keys`` identify each tensor
        across steps (default: its position) for the shared random seeds."""
        tensors, complex_at = real_views(tensors)
        keys = range(len(tensors)) if keys is None else keys
        began = time.perf_counter()
        keys = list(keys)
        codecs = [self.codec_for(key, t) for key, t in zip(keys, tensors)]
        plan = self.plan(tensors)
        two = [i for i, kind in enumerate(plan) if kind == "twophase"]
        exact = [i for i, kind in enumerate(plan) if kind != "twophase"]
        residuals = [None] * len(tensors) if residual else None
        packets: list = [None] * len(tensors)
        spares = self._take_spares([tensors[i] for i in exact], [keys[i] for i in exact])
        for i, old in zip(exact, spares):
            t, key, codec = tensors[i], keys[i], codecs[i]
            if residual:  # one fused pass where the codec has one (Compressor.compress_residual)
                residuals[i] = self._residual_buffer(key, t)
                packets[i] = codec.compress_residual(t.detach(), self._seed(step, key, codec), residuals[i], reuse=old)
            else:
                packets[i] = codec.compress(t.detach(), self._seed(step, key, codec), reuse=old)
        recyclable = [p is not None and _storages(p.wire.values()).isdisjoint(_storages([t]))
                      for p, t in zip(packets, tensors)]
        buckets = self._launch(packets, codecs, plan if self.transport != "auto" else ["auto"] * len(plan),
                               tensors)
        payload = sum(p.nbytes for p in packets if p is not None)
        twophase = []
        if two:
            twophase = _two_phase_start(self, [tensors[i] for i in two], two, [keys[i] for i in two], step,
                                        residuals)
            payload += sum(b.payload for b in twophase)
        self.payload_bytes += payload
        ended = time.perf_counter()
        self._add_compress(ended - began)
        if self.tracer is not None:
            self.tracer.add("compress", began, ended, bytes=payload)
        return with_complex(Pending(self, packets, buckets, residuals, payload, step, keys, recyclable, twophase,
                                    [c if p is not None else None for c, p in zip(codecs, packets)],
                                    self.reuse_aggregates), complex_at)

    @property
    def guards_inputs(self) -> bool:
        """Whether the aggregate check (``check_finite``) also raises on a NaN/Inf in any
        worker's input (module docstring, overflow guard): one codec that propagates
        non-finite values, on an exact transport."""
        codec = self.compressor
        return (self.check_finite and not isinstance(codec, PerTensor) and codec.propagates_nonfinite
                and self.transport != "twophase")

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

    # -- internals ------------------------------------------------------------------------
    def _take_spares(self, tensors: Sequence[torch.Tensor], keys: list) -> list[Packet | None]:
        """The waited packet of each key, where its shape and dtype match (else None)."""
        with self._lock:
            spares = [self._spare_packets.pop(key, None) for key in keys]
        return [old if old is not None and old.shape == t.shape and old.dtype == t.dtype else None
                for old, t in zip(spares, tensors)]

    def _residual_buffer(self, key: int, t: torch.Tensor) -> torch.Tensor:
        """Where the residual of ``t`` goes: the caller's spare for ``key``
        (:attr:`residual_spares`) where it fits (shape, dtype, device, contiguous, not
        ``t``'s memory), else a new tensor."""
        with self._lock:
            spare = self.residual_spares.pop(key, None)
        if (spare is not None and spare.shape == t.shape and spare.dtype == t.dtype and spare.device == t.device
                and spare.is_contiguous() and _storages([spare]).isdisjoint(_storages([t]))):
            return spare
        return torch.empty_like(t, memory_format=torch.contiguous_format)

    def _release(self, pending: Pending, out: list[torch.Tensor]) -> None:
        """After ``wait()``: keep its packets and bucket buffers for the next ``start()``,
        except what a returned aggregate shares memory with, unless the exchange was started
        with :attr:`reuse_aggregates` (module docstring: memory)."""
        pinned = set() if pending.reuse_aggregates else _storages(t for t in out if t is not None)
        with self._lock:
            for key, packet, ok in zip(pending.keys, pending.packets, pending.recyclable):
                if ok and packet is not None and _storages(packet.wire.values()).isdisjoint(pinned):
                    self._spare_packets[key] = packet
            for bucket in pending.buckets:
                buf = bucket.buffer
                if buf is not None and _storages([buf]).isdisjoint(pinned):
                    spare = self._spare_buffers.setdefault((bucket.kind, buf.dtype, buf.device, buf.numel()), [])
                    if len(spare) < 2:
                        spare.append(buf)

    def _bucket_buffer(self, bucket: _Bucket, parts: list[torch.Tensor]) -> torch.Tensor:
        """The flat buffer a bucket sends: its one part as it is, or the parts copied into a
        spare buffer of this size (a new one when none is spare); a ``private`` bucket (a part
        is an input's memory, e.g. ``none``'s summand) is always copied: a collective may
        write into what it sends."""
        if len(parts) == 1 and not bucket.private:
            return parts[0]
        if not parts:
            return torch.empty(0, dtype=bucket.dtype, device=bucket.device)
        numel = sum(p.numel() for p in parts)
        with self._lock:
            spare = self._spare_buffers.get((bucket.kind, bucket.dtype, bucket.device, numel))
            buf = spare.pop() if spare else None
        if buf is None:
            buf = torch.empty(numel, dtype=bucket.dtype, device=bucket.device)
        bucket.buffer = buf.copy_(parts[0]) if len(parts) == 1 else torch.cat(parts, out=buf)
        return buf

    def _twophase_layout(self, numels: tuple[int, ...]) -> tp.Layout:
        """The slices of a two-phase bucket of tensors of ``numels`` entries (cached)."""
        layout = self._layouts.get(numels)
        if layout is None:
            layout = self._layouts[numels] = tp.Layout(numels, self.comm.world_size)
        return layout

    def _seed(self, step: int, key: int, codec: Compressor | None = None) -> int:
        if (codec or self.compressor).shared_randomness:
            return mix_seed(self.seed, step, key)
        return mix_seed(self.seed, step, key, self.comm.rank + 1)

    def route(self, packet: Packet, pinned: str = "auto",
              codec: Compressor | None = None) -> tuple[str, list[torch.Tensor]]:
        """The collective for one packet (made by ``codec``, default: the PSync's) and the
        flat tensors it contributes: the codec's summand for allreduce, the raw bytes of its
        wire tensors for allgather, whichever puts fewer bytes on the wire for this world
        size (ties: allreduce), or the ``pinned`` one."""
        codec, n = codec or self.compressor, self.comm.world_size
        sum_dtype = codec.sum_dtype(n, packet.dtype)
        if sum_dtype is not None and pinned == "allreduce":
            return "allreduce", [codec.summand(packet, n).reshape(-1)]
        if sum_dtype is not None and pinned != "allgather":
            # sized without building the summand where the codec can (an int8 per entry for 2bit)
            numel, summand = codec.summand_numel(packet, n), None
            if numel is None:
                summand = codec.summand(packet, n).reshape(-1)
                numel = summand.numel()
            if allreduce_wire_bytes(numel * _itemsize(sum_dtype), n) <= allgather_wire_bytes(packet.nbytes, n):
                return "allreduce", [summand if summand is not None else codec.summand(packet, n).reshape(-1)]
        return "allgather", [w.reshape(-1).view(torch.uint8) for w in packet.wire.values()]

    def _launch(self, packets: list[Packet | None], codecs: list[Compressor],
                plan: list[str], tensors: Sequence[torch.Tensor]) -> list[_Bucket]:
        open_buckets: dict[tuple, _Bucket] = {}
        buckets: list[_Bucket] = []
        for i, packet in enumerate(packets):
            if packet is None:   # two-phase (gradzip.twophase)
                continue
            kind, flat = self.route(packet, plan[i], codecs[i])
            key = (kind, flat[0].dtype, flat[0].device) if flat else (kind, torch.uint8, _device(packet))
            nbytes = sum(f.numel() * f.element_size() for f in flat)
            bucket = open_buckets.get(key)
            if bucket is None or (bucket.nbytes + nbytes > self.bucket_bytes and bucket.members):
                bucket = open_buckets[key] = _Bucket(kind, key[1], key[2])
                buckets.append(bucket)
            bucket.members.append(i)
            bucket.private = bucket.private or (kind == "allreduce" and not _storages(flat).isdisjoint(
                _storages([tensors[i]])))
            bucket.sizes.append(sum(f.numel() for f in flat))
            bucket.parts.extend(flat)
            bucket.nbytes += nbytes
        for bucket in buckets:
            buffer = self._bucket_buffer(bucket, bucket.parts)
            bucket.parts = []
            collective = self.comm.allreduce if bucket.kind == "allreduce" else self.comm.allgather
            bucket.work = collective(buffer, async_op=True)
            self.bytes_sent += bucket.work.nbytes
        return buckets

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
        sent, errors = 0, {}
        for tb in pending.twophase:
            sent += _two_phase_finish(self, tb, out, errors)
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
            offset = 0
            for i, size in zip(bucket.members, bucket.sizes):
                packet, codec = pending.packets[i], pending.codecs[i]
                if bucket.kind == "allreduce":
                    total = gathered[offset:offset + size]
                    out[i] = codec.from_sum(total, packet, n)
                else:
                    chunk = gathered.reshape(n, -1)[:, offset:offset + size]
                    out[i] = codec.aggregate([packet.from_raw(row) for row in chunk])
                offset += size
            decoded = time.perf_counter()
            self._add_compress(decoded - decoding)
            if self.tracer is not None:
                self.tracer.add("decode", decoding, decoded)
        if self.check_finite:
            bad = first_nonfinite(out)
            if bad >= 0:
                spec = (pending.codecs[bad] or self.compressor).spec
                raise NonFiniteAggregate(
                    f"the {spec} exchange of tensor #{bad} (shape {tuple(out[bad].shape)}) decoded a "
                    f"non-finite aggregate (NaN or Inf) from finite inputs: the codec or the sum over "
                    f"{n} workers overflowed; stopped on every worker before it was applied", bad)
        self.server_errors.errors.update(errors)   # only once the aggregate passed the check
        self._release(pending, out)
        return Result(out, pending.residual, sent, pending.packet_bytes)


def _storages(tensors) -> set[int]:
    """The storages ``tensors`` live in (two tensors share memory iff these sets meet)."""
    return {t.untyped_storage().data_ptr() for t in tensors}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _device(packet: Packet) -> torch.device:
    for t in packet.wire.values():
        return t.device
    return torch.device("cpu")


@dataclass
class _TwoPhaseBucket:
    """Two-phase tensors launched together (one dtype and device): one all-to-all message
    per peer, every slice of them compressed by one codec call (``twophase.Layout``)."""

    positions: list[int]                 # in the exchange's tensor list
    keys: list[int]
    shapes: list[torch.Size]
    dtype: torch.dtype
    device: torch.device
    step: int
    payload: int                         # the packets' bytes (as predicted, then as made)
    layout: tp.Layout | None = None
    sent: Slices | None = None           # phase 1's packets, destination by destination
    sizes: list[int] = field(default_factory=list)   # bytes of phase 1's message to each peer
    work: Work | None = None

    def templates(self, j: int) -> list[Packet] | None:
        """This worker's own packets of the slices for destination ``j`` (the layout of every
        packet of those slices: ``Compressor.aggregate_slices``), None from a fused codec."""
        packets, first = self.sent.packets, self.layout.first
        return None if packets is None else packets[first[j]:first[j + 1]]


def _two_phase_start(psync: PSync, tensors, positions, keys, step, residuals) -> list[_TwoPhaseBucket]:
    """Phase 1 (gradzip.twophase): compress every slice (residual into ``residuals``) and
    launch one all-to-all per bucket of up to ``bucket_bytes`` of packets."""
    codec, comm = psync.compressor, psync.comm
    n, rank = comm.world_size, comm.rank
    buckets: list[_TwoPhaseBucket] = []
    members: list[list[torch.Tensor]] = []
    current = None
    for t, pos, key in zip(tensors, positions, keys):
        nbytes = psync._sizer.slices(t.numel(), n, t.dtype)   # sized before compressing
        if (current is None or current.dtype != t.dtype or current.device != t.device
                or (current.payload + nbytes > psync.bucket_bytes and current.positions)):
            current = _TwoPhaseBucket([], [], [], t.dtype, t.device, step, 0)
            buckets.append(current)
            members.append([])
        current.positions.append(pos)
        current.keys.append(key)
        current.shapes.append(t.shape)
        current.payload += nbytes
        members[-1].append(t.detach().reshape(-1))
    for bucket, flats in zip(buckets, members):
        layout = bucket.layout = psync._twophase_layout(tuple(f.numel() for f in flats))
        x = torch.cat(flats) if len(flats) > 1 else flats[0]
        r = None if residuals is None else torch.empty(layout.total, dtype=bucket.dtype, device=bucket.device)
        bases = [psync._seed(step, key) for key in bucket.keys]
        seeds = [tp.phase1_seed(bases[k], j) for j in range(n) for k in layout.members[j]]
        bucket.sent = codec.compress_slices(x, layout.bounds, seeds, r)
        if r is not None:
            for pos, shape, a, f in zip(bucket.positions, bucket.shapes, layout.offsets, flats):
                residuals[pos] = r[a:a + f.numel()].view(shape)
        nbytes = bucket.sent.nbytes
        bucket.sizes = [sum(nbytes[layout.first[j]:layout.first[j + 1]]) for j in range(n)]
        bucket.payload = sum(bucket.sizes)
        messages = list(torch.split(bucket.sent.wire, bucket.sizes))
        bucket.work = comm.all_to_all(messages, [bucket.sizes[rank]] * n, async_op=True,
                                      rounds=tp.rounds(bucket.sizes, bucket.sent.wire, psync.round_bytes))
        psync.bytes_sent += bucket.work.nbytes
    return buckets


def _two_phase_finish(psync: PSync, bucket: _TwoPhaseBucket, out: list, errors: dict) -> int:
    """Phase 2: decode + aggregate this worker's slices, add the server error, compress
    again (the new server error into ``errors``), send to every peer; then decode every
    slice into ``out``. Returns the bytes sent by both rounds."""
    codec, comm, layout = psync.compressor, psync.comm, bucket.layout
    n, rank = comm.world_size, comm.rank
    began = time.perf_counter()
    received = bucket.work.wait()
    decoding = time.perf_counter()
    psync.count_wait(began, decoding)
    sent = bucket.work.nbytes
    mine, packed = layout.members[rank], layout.packed[rank]
    s = torch.empty(packed[-1][1] if packed else 0, dtype=bucket.dtype, device=bucket.device)
    codec.aggregate_slices(received, packed, s, bucket.templates(rank))
    keys = [bucket.keys[k] for k in mine]
    for key, (a, b) in zip(keys, packed):   # none held before a slice's first exchange (or after a reset),
        old = psync.server_errors.errors.get((key, rank))   # nor for a tensor whose size changed under its key
        if old is not None and old.numel() == b - a:        # (1-bit LAMB's flat tensor, after a change of the
            s[a:b].add_(old)                                # parameters taking part)
    e = torch.empty_like(s)
    back = codec.compress_slices(s, packed, [tp.phase2_seed(psync.seed, bucket.step, key, rank) for key in keys], e)
    for key, (a, b) in zip(keys, packed):
        errors[(key, rank)] = e[a:b]
    compressed = time.perf_counter()
    psync._add_compress(compressed - decoding)
    work = comm.all_to_all([back.wire] * n, bucket.sizes, async_op=True,
                           rounds=tp.rounds(bucket.sizes, back.wire, psync.round_bytes))
    psync.bytes_sent += work.nbytes
    sent += work.nbytes
    gathered = work.wait()
    decoding = time.perf_counter()
    psync.count_wait(compressed, decoding)
    flat = torch.empty(layout.total, dtype=bucket.dtype, device=bucket.device)
    for j in range(n):
        codec.decode_slices(gathered[j], layout.blocks[j], flat, bucket.templates(j))
    for pos, shape, a in zip(bucket.positions, bucket.shapes, layout.offsets):
        out[pos] = flat[a:a + shape.numel()].view(shape)
    psync._add_compress(time.perf_counter() - decoding)
    return sent
