"""What a PSync keeps across steps so that an exchange writes into the memory of the last one
instead of allocating (a fresh 64 MB tensor costs page faults worth a tenth of a copy).

Once ``wait()`` has
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
exchange input; never one it returned to the user), and no tensor at all where the codec
is lossless and the caller reads None as zeros (:attr:`PSync.omit_zero_residuals`). An
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

import threading
from typing import Sequence

import torch

from ..compressors import Packet
from ..kernels.digest import SMALL, copy_parts


def storage(t: torch.Tensor) -> int:
    """The address of the storage ``t`` lives in (two tensors share memory iff these are
    equal), from its own address and offset (no storage object is made: this runs for every
    tensor of every exchange)."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


def storages(tensors) -> set[int]:
    """The storages ``tensors`` live in (:func:`storage` of each): two sets of tensors share
    memory iff these sets meet."""
    return {storage(t) for t in tensors}


class Spares:
    """One PSync's spare packets (by key), bucket buffers (by kind, dtype, device and size)
    and the caller's residual spares (``residuals``: key -> tensor), under one lock:
    ``start()`` and ``wait()`` may run on different threads (module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._packets: dict = {}   # key -> a waited packet
        self._buffers: dict = {}   # (kind, dtype, device, numel) -> [flat buffers]
        self.residuals: dict = {}  # key -> a tensor the caller no longer needs (PSync.residual_spares)

    def packets(self, tensors: Sequence[torch.Tensor], keys: list) -> list[Packet | None]:
        """The waited packet of each key, where its shape and dtype match (else None)."""
        with self._lock:
            spares = [self._packets.pop(key, None) for key in keys]
        return [old if old is not None and old.shape == t.shape and old.dtype == t.dtype else None
                for old, t in zip(spares, tensors)]

    def residual(self, key: int, t: torch.Tensor) -> torch.Tensor:
        """Where the residual of ``t`` goes: the caller's spare for ``key``
        (:attr:`residuals`) where it fits (shape, dtype, device, contiguous, not
        ``t``'s memory), else a new tensor. (EF-SGD also writes an input computed from ``t``
        there, when no residual took its spare.)"""
        with self._lock:
            spare = self.residuals.pop(key, None)
        if (spare is not None and spare.shape == t.shape and spare.dtype == t.dtype and spare.device == t.device
                and spare.is_contiguous() and storage(spare) != storage(t)):
            return spare
        return torch.empty_like(t, memory_format=torch.contiguous_format)

    def bucket_buffer(self, kind: str, dtype: torch.dtype, device: torch.device, parts: list[torch.Tensor],
                       private: bool, digests: list | None = None) -> tuple[torch.Tensor, bool]:
        """The flat buffer a bucket sends, and whether it is one of these spares (reusable):
        its one part as it is, or the parts copied into a spare buffer of this size (a new
        one when none is spare); a ``private`` bucket (a part is an input's memory, e.g.
        ``none``'s summand) is always copied: a collective may write into what it sends.
        ``digests`` (a list): filled with each part's digest made in its copy, where
        :func:`gradzip.kernels.digest.copy_parts` makes one (None where not, or not copied)."""
        if len(parts) == 1 and not private:
            if digests is not None:
                digests.append(None)
            return parts[0], False
        if not parts:
            return torch.empty(0, dtype=dtype, device=device), False
        numel = sum(p.numel() for p in parts)
        with self._lock:
            spare = self._buffers.get((kind, dtype, device, numel))
            buf = spare.pop() if spare else None
        if buf is None:
            buf = torch.empty(numel, dtype=dtype, device=device)
        if digests is not None:
            digests.extend(copy_parts(parts, buf, SMALL))
            return buf, True
        return (buf.copy_(parts[0]) if len(parts) == 1 else torch.cat(parts, out=buf)), True

    def release(self, pending, out: list[torch.Tensor]) -> None:
        """After ``wait()``: keep its packets and bucket buffers for the next ``start()``,
        except what a returned aggregate shares memory with, unless the exchange was started
        with ``reuse_aggregates`` (module docstring)."""
        pinned = set() if pending.reuse_aggregates else storages(t for t in out if t is not None)
        with self._lock:
            for key, packet, ok in zip(pending.keys, pending.packets, pending.recyclable):
                if ok and packet is not None and storages(packet.wire.values()).isdisjoint(pinned):
                    self._packets[key] = packet
            for bucket in pending.buckets:
                buf = bucket.buffer
                if buf is not None and storages([buf]).isdisjoint(pinned):
                    spare = self._buffers.setdefault((bucket.kind, buf.dtype, buf.device, buf.numel()), [])
                    if len(spare) < 2:
                        spare.append(buf)
