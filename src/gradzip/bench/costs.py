"""The alpha-beta network model of ring collectives (one full-duplex link of ``B``
bytes/s per worker, ``alpha`` seconds per message step):

* allreduce of ``S`` bytes: ``2(n-1)`` steps of ``S/n`` bytes,
  ``T = 2(n-1)·alpha + 2(n-1)/n · S / B``;
* allgather of ``S`` bytes from each worker: ``n-1`` steps of ``S`` bytes,
  ``T = (n-1)·alpha + (n-1) · S / B``;
* broadcast, pipelined: ``T = (n-1)·alpha + S / B``.

The byte counts are :func:`gradzip.comm.base.allreduce_wire_bytes` /
``allgather_wire_bytes``, the ones every run reports.
"""
from __future__ import annotations

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
