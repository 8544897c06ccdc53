"""The alpha-beta network model of ring collectives (one full-duplex link of ``B``
bytes/s per worker, ``alpha`` seconds per message step):

* allreduce of ``S`` bytes: ``2(n-1)`` steps of ``S/n`` bytes,
  ``T = 2(n-1)·alpha + 2(n-1)/n · S / B``;
* allgather of ``S`` bytes from each worker: ``n-1`` steps of ``S`` bytes,
  ``T = (n-1)·alpha + (n-1) · S / B``;
* broadcast, pipelined: ``T = (n-1)·alpha + S / B``.

The byte counts are :func:`gradzip.comm.base.allreduce_wire_bytes` /
``allgather_wire_bytes``, the ones every run reports.

Below them, one PSync exchange priced per transport from its codec and tensor shapes
(spec "Transports of PSync"): the exact ones (:func:`exact_cost`: allreduce of summands,
int8 / int16 for small-integer codes, or allgather of packets), two-phase
(:func:`twophase_bytes`, :func:`twophase_cost`), what ``transport="auto"`` picks
(:func:`auto_cost`) and the hierarchical exchange (:func:`hierarchical_cost`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..comm.base import allgather_wire_bytes, allreduce_wire_bytes
from ..errors import GradzipError


def allreduce_time(nbytes: int, n: int, bandwidth_Bps: float, alpha_s: float = 0.0) -> float:
    """Seconds for a ring allreduce of ``nbytes`` among ``n`` workers."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * alpha_s + allreduce_wire_bytes(nbytes, n) / bandwidth_Bps


def allgather_time(nbytes: int, n: int, bandwidth_Bps: float, alpha_s: float = 0.0) -> float:
    """Seconds for a ring allgather of ``nbytes`` from each of ``n`` workers."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * alpha_s + allgather_wire_bytes(nbytes, n) / bandwidth_Bps


def collective_time(kind: str, nbytes: int, n: int, bandwidth_Bps: float, alpha_s: float = 0.0) -> float:
    """Seconds for one collective of ``kind`` (allreduce, allgather, broadcast, all_to_all)."""
    if kind == "allreduce":
        return allreduce_time(nbytes, n, bandwidth_Bps, alpha_s)
    if kind == "allgather":
        return allgather_time(nbytes, n, bandwidth_Bps, alpha_s)
    if kind == "all_to_all":  # nbytes: what this worker sends, one message per peer
        return 0.0 if n <= 1 else (n - 1) * alpha_s + nbytes / bandwidth_Bps
    if kind == "broadcast":  # pipelined: the message crosses each link once
        return 0.0 if n <= 1 else (n - 1) * alpha_s + nbytes / bandwidth_Bps
    raise GradzipError(f"unknown collective {kind!r}")


# ----------------------------------------------------------------------------- PSync transports
#
# The cost of one PSync exchange (spec "Transports of PSync") per transport, from the codec
# and the tensors' shapes alone: what the model needs to price a transport the recording
# group never saw (two-phase, hierarchical) and to pick the one ``transport="auto"`` picks.
# Bytes are per worker and exact for codecs whose packet size is a function of the element
# count (every codec but DGC's estimated threshold); ``codec.wire_nbytes`` gives them.

#: ``transport="auto"`` takes two-phase only where it costs at most this fraction of the
#: cheapest exact transport (spec: "two-phase is picked only where it costs <= 1/2").
TWOPHASE_FACTOR = 0.5
#: The summand widths the spec allows for small-integer codes: the narrowest exact one.
INT8_MAX_WORKERS, INT16_MAX_WORKERS = 127, 32767


def slice_sizes(d: int, parts: int) -> list[int]:
    """Element counts of ``torch.tensor_split(arange(d), parts)``: the first ``d mod parts``
    slices one element longer (some are 0 when ``d < parts``)."""
    base, extra = divmod(d, parts)
    return [base + 1 if j < extra else base for j in range(parts)]


_WIRE: dict = {}   # (codec spec, shape) -> wire bytes: the projection asks for the same sizes often


def wire_nbytes(codec, shape) -> int:
    """``codec.wire_nbytes(shape)``, remembered."""
    key = (codec.spec, tuple(shape))
    if key not in _WIRE:
        _WIRE[key] = codec.wire_nbytes(tuple(shape))
    return _WIRE[key]


def packet_bytes(codec, numel: int) -> int:
    """Wire bytes of ``codec``'s packet for a float32 tensor of ``numel`` elements (0 for none)."""
    return wire_nbytes(codec, (numel,)) if numel > 0 else 0


def summand_width(codec, n: int) -> int | None:
    """Bytes per summand element of an exact allreduce among ``n`` workers, or None when the
    packets do not sum. Small-integer codes (2bit, sign: int8 up to 127 workers) sum as
    int16 up to 32767 workers (spec "Summand width") even where this codec version
    declares no dtype above 127."""
    dtype = codec.sum_dtype(n)
    if dtype is not None:
        return torch.empty((), dtype=dtype).element_size()
    if n <= INT16_MAX_WORKERS and codec.sum_dtype(2) == torch.int8:
        return 2
    return None


def _summand_numel(codec, shape, n: int) -> int:
    key = ("summand", codec.spec, tuple(shape), n)
    if key not in _WIRE:
        packet = codec.compress(torch.zeros(tuple(shape)))
        numel = codec.summand_numel(packet, n)
        _WIRE[key] = codec.summand(packet, n).numel() if numel is None else numel
    return _WIRE[key]


def exact_route(codec, shape, n: int, pinned: str | None = None) -> tuple[str, int]:
    """PSync's exact route for one tensor: ``("allreduce", summand bytes)`` or
    ``("allgather", packet bytes)``, whichever puts fewer ring bytes on the wire (ties:
    allreduce), with the spec's summand width. ``pinned`` (``transport=`` "allreduce" /
    "allgather"): that route, an allreduce only where the packets sum."""
    packet = wire_nbytes(codec, shape)
    width = summand_width(codec, n) if pinned != "allgather" else None
    if width is not None:
        summand = _summand_numel(codec, shape, n) * width
        if pinned == "allreduce" or allreduce_wire_bytes(summand, n) <= allgather_wire_bytes(packet, n):
            return "allreduce", summand
    return "allgather", packet


def twophase_bytes(codec, shapes, n: int) -> tuple[int, int]:
    """Per worker, the two phases of one two-phase bucket holding tensors of ``shapes``:
    ``(all-to-all, allgather)`` bytes of the busiest worker. Worker j sends each peer its
    slice of every tensor, ``sum_{i != j} sum_t |C(v_t[S_i])|`` (phase 1), then its
    recompressed slice ``ĉ_j`` to each of the ``n-1`` others, ``(n-1) · sum_t |C(S_j)|``
    (phase 2; PSync sends one message per peer, no padding: ``gradzip.twophase.wire_bytes``).
    The busiest worker holds the longest slice, worker 0. Together about
    ``2(n-1)/n × packet``."""
    if n <= 1:
        return 0, 0
    per_slice = [0] * n
    for shape in shapes:
        d = math.prod(shape)
        sizes = slice_sizes(d, n)
        for j, m in enumerate(sizes):
            per_slice[j] += packet_bytes(codec, m)
    busiest = max(range(n), key=lambda j: (n - 2) * per_slice[j])
    return sum(per_slice) - per_slice[busiest], (n - 1) * per_slice[busiest]


def alltoall_time(nbytes: int, n: int, bandwidth_Bps: float, alpha_s: float = 0.0) -> float:
    """Seconds for a pairwise all-to-all in which a worker sends ``nbytes`` in all (``n-1``
    messages) over its full-duplex link."""
    if n <= 1:
        return 0.0
    return (n - 1) * alpha_s + nbytes / bandwidth_Bps


@dataclass
class ExchangeCost:
    """One PSync exchange priced for one transport: seconds, bytes a worker sends (over the
    link that limits it: the node uplink for a hierarchical one) and the transport."""

    transport: str
    seconds: float
    wire_bytes: float
    intra_bytes: float = 0.0   # hierarchical: bytes on the fast links inside a node


def _buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Greedy buckets of tensor positions, as PSync fills them: up to ``bucket_bytes``."""
    out, total = [], 0
    for i, size in enumerate(sizes):
        if not out or (total + size > bucket_bytes and out[-1]):
            out.append([])
            total = 0
        out[-1].append(i)
        total += size
    return out


def exact_cost(codec, shapes, n: int, bandwidth_Bps: float, alpha_s: float,
               bucket_bytes: int = 4 << 20, pinned: str | None = None) -> ExchangeCost:
    """The exact transports of one exchange: every tensor on its :func:`exact_route`
    (``pinned``: PSync's ``transport="allreduce"`` / ``"allgather"``), bucketed per
    collective kind as PSync does."""
    routes = [exact_route(codec, s, n, pinned) for s in shapes]
    seconds = wire = 0.0
    for kind in ("allreduce", "allgather"):
        sizes = [b for k, b in routes if k == kind]
        for bucket in _buckets(sizes, bucket_bytes) if sizes else []:
            nbytes = sum(sizes[i] for i in bucket)
            seconds += collective_time(kind, nbytes, n, bandwidth_Bps, alpha_s)
            wire += (allreduce_wire_bytes if kind == "allreduce" else allgather_wire_bytes)(nbytes, n)
    kinds = {k for k, _ in routes}
    return ExchangeCost(kinds.pop() if len(kinds) == 1 else "allreduce+allgather", seconds, wire)


def twophase_cost(codec, shapes, n: int, bandwidth_Bps: float, alpha_s: float,
                  bucket_bytes: int = 4 << 20) -> ExchangeCost:
    """The two-phase transport of one exchange: per bucket (greedy on packet bytes) an
    all-to-all and a ring allgather, :func:`twophase_bytes` each."""
    sizes = [wire_nbytes(codec, s) for s in shapes]
    seconds = wire = 0.0
    for bucket in _buckets(sizes, bucket_bytes):
        p1, p2 = twophase_bytes(codec, [shapes[i] for i in bucket], n)
        if n > 1:
            seconds += alltoall_time(p1, n, bandwidth_Bps, alpha_s) + (n - 1) * alpha_s + p2 / bandwidth_Bps
        wire += p1 + p2
    return ExchangeCost("twophase", seconds, wire)


def auto_cost(codec, shapes, n: int, bandwidth_Bps: float, alpha_s: float,
              bucket_bytes: int = 4 << 20) -> ExchangeCost:
    """``transport="auto"``: per bucket, two-phase where it costs at most
    :data:`TWOPHASE_FACTOR` of the exact transports, else the exact ones."""
    sizes = [wire_nbytes(codec, s) for s in shapes]
    picks, seconds, wire = [], 0.0, 0.0
    for bucket in _buckets(sizes, bucket_bytes):
        part = [shapes[i] for i in bucket]
        exact = exact_cost(codec, part, n, bandwidth_Bps, alpha_s, bucket_bytes)
        two = twophase_cost(codec, part, n, bandwidth_Bps, alpha_s, bucket_bytes)
        best = two if two.seconds <= TWOPHASE_FACTOR * exact.seconds else exact
        picks.append(best.transport)
        seconds += best.seconds
        wire += best.wire_bytes
    names = list(dict.fromkeys(picks))
    return ExchangeCost("+".join(names) if names else "allreduce", seconds, wire)


def allreduce_cost(codec, shapes, n: int, bandwidth_Bps: float, alpha_s: float,
                   bucket_bytes: int = 4 << 20) -> ExchangeCost:
    """``transport="allreduce"``: every tensor whose packets sum on an allreduce."""
    return exact_cost(codec, shapes, n, bandwidth_Bps, alpha_s, bucket_bytes, pinned="allreduce")


def allgather_cost(codec, shapes, n: int, bandwidth_Bps: float, alpha_s: float,
                   bucket_bytes: int = 4 << 20) -> ExchangeCost:
    """``transport="allgather"``: every packet on an allgather."""
    return exact_cost(codec, shapes, n, bandwidth_Bps, alpha_s, bucket_bytes, pinned="allgather")


TRANSPORTS = {"exact": exact_cost, "twophase": twophase_cost, "auto": auto_cost,
              "allreduce": allreduce_cost, "allgather": allgather_cost}


def exchange_cost(transport: str, codec, shapes, n: int, bandwidth_Bps: float, alpha_s: float,
                  bucket_bytes: int = 4 << 20) -> ExchangeCost:
    """One PSync exchange of ``shapes`` with ``codec`` among ``n`` workers on links of
    ``bandwidth_Bps``: ``transport`` exact (allreduce / allgather), twophase or auto."""
    if transport not in TRANSPORTS:
        raise GradzipError(f"unknown transport {transport!r} for the model; valid: {', '.join(TRANSPORTS)}")
    return TRANSPORTS[transport](codec, shapes, n, bandwidth_Bps, alpha_s, bucket_bytes)


def hierarchical_cost(transport: str, codec, shapes, n: int, k: int, bandwidth_Bps: float, alpha_s: float,
                      intra_Bps: float, intra_alpha_s: float = 0.0, intra_width: int = 4,
                      bucket_bytes: int = 4 << 20) -> ExchangeCost:
    """The hierarchical exchange (spec "Hierarchical exchange") with ``k`` workers per node,
    ``n/k`` nodes, each node's ``k`` workers behind one uplink of ``bandwidth_Bps``, fast
    links of ``intra_Bps`` inside a node (``intra_width`` bytes per element: 4 for fp32, 2
    for fp16):

    * inside the node a ring reduce-scatter of every tensor: ``(k-1)/k · width · d`` bytes;
    * across nodes PSync of shard ℓ (``tensor_split(arange(d), k)[ℓ]`` of every tensor)
      among the ``n/k`` workers of local rank ℓ, with ``transport``; the ``k`` exchanges
      of a node run at once and share its uplink: each gets ``bandwidth_Bps / k``;
    * inside the node a ring allgather of the fp32 aggregate shards: ``(k-1)/k · 4d``.

    ``k = 1`` is :func:`exchange_cost`."""
    if k < 1 or n % k:
        raise GradzipError(f"{k} workers per node do not divide {n} workers; give a divisor of the worker count")
    if k == 1:
        return exchange_cost(transport, codec, shapes, n, bandwidth_Bps, alpha_s, bucket_bytes)
    total = sum(math.prod(s) for s in shapes)
    shard_shapes = [(m,) for s in shapes for m in [slice_sizes(math.prod(s), k)[0]]]  # shard 0: the longest
    across = exchange_cost(transport, codec, shard_shapes, n // k, bandwidth_Bps / k, alpha_s, bucket_bytes)
    scatter = (k - 1) * intra_width * total / k
    gather = (k - 1) * 4 * total / k
    inside = 2 * (k - 1) * intra_alpha_s + (scatter + gather) / intra_Bps
    return ExchangeCost(across.transport, across.seconds + inside, across.wire_bytes, scatter + gather)
