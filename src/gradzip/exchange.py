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
  (2(n-1)/n·d) from 8 on (exact for n <= 127).
* Small tensors are flattened into buckets of up to ``bucket_bytes`` per collective: one
  buffer per summand dtype for allreduce, raw bytes for allgather. Decoding is per tensor
  again. With integer summands, or on the in-process group, bucketing changes no bit; a
  float sum inside a real collective may associate differently (≈1 ulp).

``start()`` compresses and launches the collectives asynchronously and returns a
:class:`Pending`; ``Pending.wait()`` decodes. ``__call__`` does both.

Overflow guard (``check_finite=True``, what the optimizers set unless ``nonfinite="off"``):
a codec can turn finite inputs into Inf/NaN (fp16 above 65504, QSGD's norm of 1e20, a sum
of two 3e38). ``wait()`` checks the decoded aggregates (one sum per tensor, an exact look
only where a sum is not finite) and raises :class:`NonFiniteAggregate` naming the tensor.
The aggregate is the same on every worker, so every worker raises at the same exchange,
with no collective to agree.

Memory across steps (what a PSync reuses, and why it is safe): once ``wait()`` has
decoded an exchange, its packets and its multi-tensor bucket buffers have left the
network, so the next ``start()`` writes into them instead of allocating: a packet goes to
the codec as ``compress(..., reuse=)`` for the tensor with the same key, shape and dtype,
a bucket buffer is refilled for a bucket of the same kind, dtype and size. Never reused:
a packet whose wire is its input tensor (``none``), and any packet or buffer that a
returned aggregate shares memory with (a cast's ``from_sum`` may return the summed buffer
itself); residuals and aggregates are new tensors every step (methods keep them). An
exchange still in flight (CD-SGD overlaps one with the next step) holds its own buffers:
only what ``wait()`` released is reused, so two exchanges in flight simply allocate. A
caller may read ``Pending.packets`` after ``wait()`` until its next ``start()`` (DGC does).
A one-tensor bucket is sent as that tensor (its summand, or a view of its packet's wire:
no copy into a bucket buffer); other workers' wire tensors are views of the gathered
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
from .compressors import Compressor, Packet, PerTensor, build
from .nonfinite import NonFiniteAggregate, first_nonfinite

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
    codecs: list[Compressor] = field(default_factory=list)  # packet i's codec
    _result: Result | None = field(default=None, repr=False)

    def wait(self) -> Result:
        if self._result is None:
            self._result = self.psync._finish(self)
        return self._result


class PSync:
    """Compress → exchange → decode for one worker (see the module docstring)."""

    def __init__(self, comm: Group, compressor: "str | Compressor | None" = "none", *,
                 seed: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, check_finite: bool = False):
        self.comm = comm
        self.check_finite = bool(check_finite)  # raise NonFiniteAggregate (module docstring)
        self.compressor = build(compressor)   # a codec, or a PerTensor policy: see codec_for
        #: key -> parameter name, for a PerTensor policy's name rules (set by the owner:
        #: the optimizer from its named parameters, the DDP hook from its model)
        self.names: dict[int, str] = {}
        self._codecs: dict = {}                # (key, shape, dtype) -> the policy's codec
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

    def counters(self) -> dict:
        """Bytes and seconds so far (for a checkpoint): ``load_counters`` restores them."""
        return {"bytes_sent": self.bytes_sent, "payload_bytes": self.payload_bytes,
                "timings": dataclasses.asdict(self.timings)}

    def load_counters(self, counters: dict) -> None:
        self.bytes_sent = int(counters["bytes_sent"])
        self.payload_bytes = int(counters["payload_bytes"])
        self.timings = Timings(**counters["timings"])

    # -- the public calls ---------------------------------------------------------------
    def __call__(self, tensors: Sequence[torch.Tensor], step: int, *,
                 keys: Sequence[int] | None = None, residual: bool = True) -> Result:
        return self.start(tensors, step, keys=keys, residual=residual).wait()

    def start(self, tensors: Sequence[torch.Tensor], step: int, *,
              keys: Sequence[int] | None = None, residual: bool = True) -> Pending:
        """Compress ``tensors`` and launch their collectives; ``keys`` identify each tensor
        across steps (default: its position) for the shared random seeds."""
        keys = range(len(tensors)) if keys is None else keys
        began = time.perf_counter()
        keys = list(keys)
        codecs = [self.codec_for(key, t) for key, t in zip(keys, tensors)]
        residuals = None
        spares = self._take_spares(tensors, keys)
        if residual:  # one fused pass where the codec has one (Compressor.compress_residual)
            residuals = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
            packets = [codec.compress_residual(t.detach(), self._seed(step, key, codec), r, reuse=old)
                       for codec, t, key, r, old in zip(codecs, tensors, keys, residuals, spares)]
        else:
            packets = [codec.compress(t.detach(), self._seed(step, key, codec), reuse=old)
                       for codec, t, key, old in zip(codecs, tensors, keys, spares)]
        recyclable = [_storages(p.wire.values()).isdisjoint(_storages([t])) for p, t in zip(packets, tensors)]
        buckets = self._launch(packets, codecs)
        payload = sum(p.nbytes for p in packets)
        self.payload_bytes += payload
        ended = time.perf_counter()
        self._add_compress(ended - began)
        if self.tracer is not None:
            self.tracer.add("compress", began, ended, bytes=payload)
        return Pending(self, packets, buckets, residuals, payload, step, keys, recyclable, codecs)

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

    def _release(self, pending: Pending, out: list[torch.Tensor]) -> None:
        """After ``wait()``: keep its packets and bucket buffers for the next ``start()``,
        except what a returned aggregate shares memory with (module docstring: memory)."""
        pinned = _storages(t for t in out if t is not None)
        with self._lock:
            for key, packet, ok in zip(pending.keys, pending.packets, pending.recyclable):
                if ok and _storages(packet.wire.values()).isdisjoint(pinned):
                    self._spare_packets[key] = packet
            for bucket in pending.buckets:
                buf = bucket.buffer
                if buf is not None and _storages([buf]).isdisjoint(pinned):
                    spare = self._spare_buffers.setdefault((bucket.kind, buf.dtype, buf.device, buf.numel()), [])
                    if len(spare) < 2:
                        spare.append(buf)

    def _bucket_buffer(self, bucket: _Bucket, parts: list[torch.Tensor]) -> torch.Tensor:
        """The flat buffer a bucket sends: its one part as it is, or the parts copied into a
        spare buffer of this size (a new one when none is spare)."""
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return torch.empty(0, dtype=bucket.dtype, device=bucket.device)
        numel = sum(p.numel() for p in parts)
        with self._lock:
            spare = self._spare_buffers.get((bucket.kind, bucket.dtype, bucket.device, numel))
            buf = spare.pop() if spare else None
        if buf is None:
            buf = torch.empty(numel, dtype=bucket.dtype, device=bucket.device)
        bucket.buffer = torch.cat(parts, out=buf)
        return buf

    def _seed(self, step: int, key: int, codec: Compressor) -> int:
        if codec.shared_randomness:
            return mix_seed(self.seed, step, key)
        return mix_seed(self.seed, step, key, self.comm.rank + 1)

    def route(self, packet: Packet, codec: Compressor | None = None) -> tuple[str, list[torch.Tensor]]:
        """The collective for one packet (made by ``codec``, default: the PSync's) and the
        flat tensors it contributes: the codec's summand for allreduce, the raw bytes of its
        wire tensors for allgather, whichever puts fewer bytes on the wire for this world
        size (ties: allreduce)."""
        codec, n = codec or self.compressor, self.comm.world_size
        sum_dtype = codec.sum_dtype(n, packet.dtype)
        if sum_dtype is not None:
            # sized without building the summand where the codec can (an int8 per entry for 2bit)
            numel, summand = codec.summand_numel(packet, n), None
            if numel is None:
                summand = codec.summand(packet, n).reshape(-1)
                numel = summand.numel()
            if allreduce_wire_bytes(numel * _itemsize(sum_dtype), n) <= allgather_wire_bytes(packet.nbytes, n):
                return "allreduce", [summand if summand is not None else codec.summand(packet, n).reshape(-1)]
        return "allgather", [w.reshape(-1).view(torch.uint8) for w in packet.wire.values()]

    def _launch(self, packets: list[Packet], codecs: list[Compressor]) -> list[_Bucket]:
        open_buckets: dict[tuple, _Bucket] = {}
        buckets: list[_Bucket] = []
        for i, (packet, codec) in enumerate(zip(packets, codecs)):
            kind, flat = self.route(packet, codec)
            key = (kind, flat[0].dtype, flat[0].device) if flat else (kind, torch.uint8, _device(packet))
            nbytes = sum(f.numel() * f.element_size() for f in flat)
            bucket = open_buckets.get(key)
            if bucket is None or (bucket.nbytes + nbytes > self.bucket_bytes and bucket.members):
                bucket = open_buckets[key] = _Bucket(kind, key[1], key[2])
                buckets.append(bucket)
            bucket.members.append(i)
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
        sent = 0
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
                    out[i] = codec.aggregate([packet.like(_unpack_wire(packet, row)) for row in chunk])
                offset += size
            decoded = time.perf_counter()
            self._add_compress(decoded - decoding)
            if self.tracer is not None:
                self.tracer.add("decode", decoding, decoded)
        if self.check_finite:
            bad = first_nonfinite(out)
            if bad >= 0:
                packet = pending.packets[bad]
                raise NonFiniteAggregate(
                    f"the {pending.codecs[bad].spec} exchange of tensor #{bad} (shape {tuple(packet.shape)}) decoded a "
                    f"non-finite aggregate (NaN or Inf) from finite inputs: the codec or the sum over "
                    f"{n} workers overflowed; stopped on every worker before it was applied", bad)
        self._release(pending, out)
        return Result(out, pending.residual, sent, pending.packet_bytes)


def _unpack_wire(template: Packet, raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """Another worker's wire tensors from its raw bytes, laid out like ``template``'s: views
    of ``raw`` (read-only for the codec's aggregate), a copy only where the offset is not a
    multiple of the dtype's size (a dtype view needs that alignment)."""
    wire, offset = {}, 0
    for name, t in template.wire.items():
        nbytes = t.numel() * t.element_size()
        piece = raw[offset:offset + nbytes]
        if piece.storage_offset() % t.element_size():
            piece = piece.clone()
        wire[name] = piece.view(t.dtype).view(t.shape)
        offset += nbytes
    return wire


def _storages(tensors) -> set[int]:
    """The storages ``tensors`` live in (two tensors share memory iff these sets meet)."""
    return {t.untyped_storage().data_ptr() for t in tensors}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _device(packet: Packet) -> torch.device:
    for t in packet.wire.values():
        return t.device
    return torch.device("cpu")
