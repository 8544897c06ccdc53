"""The alpha-beta network model of ring collectives (one full-duplex link of ``B``
bytes/s per worker, ``alpha`` seconds per message step), and one PSync exchange priced by
its plan (:func:`gradzip.exchange.plan`: the same buckets and routes PSync executes, so the
model cannot drift from the run):

* allreduce of ``S`` bytes: ``2(n-1)`` steps of ``S/n`` bytes,
  ``T = 2(n-1)·alpha + 2(n-1)/n · S / B``;
* allgather of ``S`` bytes from each worker: ``n-1`` steps of ``S`` bytes,
  ``T = (n-1)·alpha + (n-1) · S / B``;
* all-to-all / broadcast in which a worker sends ``S`` in all: ``T = (n-1)·alpha + S / B``.

The byte counts are :func:`gradzip.comm.base.allreduce_wire_bytes` /
``allgather_wire_bytes``, the ones every run reports. :func:`exchange_cost` prices one
exchange for a transport (``exact``: the exact routes only, ``auto``, ``twophase``,
``allreduce``, ``allgather``); :func:`hierarchical_cost` the hierarchical exchange.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..compressors import build
from ..errors import GradzipError
from ..exchange.planner import DEFAULT_BUCKET_BYTES, Link, Plan, collective_time as _collective_time, plan, slice_bounds


def collective_time(kind: str, nbytes: int, n: int, bandwidth_Bps: float, alpha_s: float = 0.0) -> float:
    """Seconds for one collective of ``kind`` (allreduce, allgather, broadcast, all_to_all)
    (:func:`gradzip.exchange.planner.collective_time` on a link of ``bandwidth_Bps``, ``alpha_s``)."""
    return _collective_time(kind, nbytes, n, Link(bandwidth_Bps, alpha_s))


def allreduce_time(nbytes: int, n: int, bandwidth_Bps: float, alpha_s: float = 0.0) -> float:
    """Seconds for a ring allreduce of ``nbytes`` among ``n`` workers."""
    return collective_time("allreduce", nbytes, n, bandwidth_Bps, alpha_s)


def allgather_time(nbytes: int, n: int, bandwidth_Bps: float, alpha_s: float = 0.0) -> float:
    """Seconds for a ring allgather of ``nbytes`` from each of ``n`` workers."""
    return collective_time("allgather", nbytes, n, bandwidth_Bps, alpha_s)


def slice_sizes(d: int, parts: int) -> list[int]:
    """Element counts of ``torch.tensor_split(arange(d), parts)``."""
    return [b - a for a, b in slice_bounds(d, parts)]


@dataclass
class ExchangeCost:
    """One PSync exchange priced for one transport: seconds, bytes a worker sends (the mean
    over workers, over the link that limits it: the node uplink for a hierarchical one), the
    routes it takes (``"+"``-joined) and its plan."""

    transport: str
    seconds: float
    wire_bytes: float
    intra_bytes: float = 0.0   # hierarchical: bytes on the fast links inside a node
    plan: Plan | None = None


#: The transports the model prices: PSync's, plus ``exact`` (``auto`` without two-phase).
TRANSPORTS = ("exact", "auto", "twophase", "allreduce", "allgather")


def _routes(p: Plan) -> str:
    return "+".join(dict.fromkeys(p.routes())) or "allreduce"


def exchange_cost(transport: str, codec, shapes, n: int, bandwidth_Bps: float, alpha_s: float,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> ExchangeCost:
    """One PSync exchange of ``shapes`` with ``codec`` among ``n`` workers on links of
    ``bandwidth_Bps``: its plan for ``transport`` (:data:`TRANSPORTS`), priced."""
    return hierarchical_cost(transport, codec, shapes, n, 1, bandwidth_Bps, alpha_s, bandwidth_Bps,
                             bucket_bytes=bucket_bytes)


def hierarchical_cost(transport: str, codec, shapes, n: int, k: int, bandwidth_Bps: float, alpha_s: float,
                      intra_Bps: float, intra_alpha_s: float = 0.0, intra_width: int = 4,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> ExchangeCost:
    """The exchange's plan with ``k`` workers per node (spec "Hierarchical exchange"), ``n/k``
    nodes, each node's ``k`` workers behind one uplink of ``bandwidth_Bps`` (the node's k
    cross-node exchanges share it), links of ``intra_Bps`` inside a node (``intra_width``
    bytes per element: 4 for fp32, 2 for fp16). ``k = 1`` is :func:`exchange_cost`."""
    if transport not in TRANSPORTS:
        raise GradzipError(f"unknown transport {transport!r} for the model; valid: {', '.join(TRANSPORTS)}")
    if k < 1 or n % k:
        raise GradzipError(f"{k} workers per node do not divide {n} workers; give a divisor of the worker count")
    p = plan(shapes, build(codec), n, transport="auto" if transport == "exact" else transport,
             bucket_bytes=bucket_bytes, hierarchy=k if k > 1 else None, link=Link(bandwidth_Bps, alpha_s),
             twophase=transport != "exact", intra="fp16" if intra_width == 2 else "fp32",
             intra_link=Link(intra_Bps, intra_alpha_s))
    if k == 1:
        return ExchangeCost(_routes(p), p.seconds, p.bytes_per_worker, 0.0, p)
    inner = [q for b in p.buckets for q in b.inner]
    routes = "+".join(dict.fromkeys(r for q in inner for r in q.routes())) or "allreduce"
    intra = sum(b.intra_bytes for b in p.buckets)
    return ExchangeCost(routes, p.seconds, p.bytes_per_worker - intra, intra, p)
