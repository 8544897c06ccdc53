"""``none``, ``fp16``, ``bf16``: send the tensor as it is, or cast to 16 bits
(docs/algorithms.md §codec: none, fp16, bf16: identity, 4d bytes; cast, 2d bytes; all
three sum in compressed form).

Casting packets sum in their 16-bit dtype after dividing by ``n`` first, so the sum of n
workers cannot overflow where each term fits;
``from_sum`` then already holds the mean. ``none`` sums in the tensor's own dtype and
divides after the sum (``sum_dtype(n, dtype)`` is that dtype), as an uncompressed
allreduce does.

The casts are torch's own (``Tensor.copy_`` casts at the speed of a plain copy when it
writes into an existing buffer; only the allocation of a fresh wire costs): ``compress``
casts into the ``reuse`` packet's wire and ``decompress(out=)`` straight into ``out``. On
CUDA (:class:`CastTriton`) the summand (``x/n`` cast back) and the mean of n packets are one
pass each (:mod:`gradzip.kernels.triton.cast`, :mod:`~gradzip.kernels.triton.mean`); elsewhere torch,
the reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch._utils import _unflatten_dense_tensors

from ..kernels.sums import mean_in_place
from .base import Compressor, Implementation, Packet, deliver
from .capabilities import Summing
from .registry import register


@register
@dataclass(frozen=True)
class NoCompression(Summing, Compressor):
    """Identity: the wire is the tensor itself (no copy: the one codec whose wire shares
    memory with its input, see base); the allreduce sums it in its own dtype."""

    name = "none"
    uses_seed = False
    sends_input = True
    propagates_nonfinite = True   # a NaN/Inf summand makes the sum, hence the mean, non-finite
    lossless = True               # the residual v − C(v) of a finite v is zero

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        return Packet({"x": tensor.detach()}, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        return deliver(packet.wire["x"].view(packet.shape), out)  # read-only view (see base: memory rules)

    def sum_dtype(self, world_size: int, dtype: torch.dtype = torch.float32) -> torch.dtype | None:
        return dtype

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        """The wire itself, flat (no copy): it may be the caller's tensor, so it is read-only
        like the wire; PSync copies it into its bucket buffer before the in-place allreduce."""
        return packet.wire["x"].reshape(-1)

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        return total.div_(world_size).view(packet.shape)  # total: PSync's own buffer, of the packet's dtype

    def from_sums(self, total, packets, sizes, world_size):
        total.div_(world_size)   # every member's from_sum at once: the same division, elementwise
        return _members(total, packets, sizes)

    def from_sums_checked(self, total, packets, sizes, world_size):
        """:meth:`from_sums`, and the members' finiteness from the division's own pass
        (:func:`gradzip.kernels.sums.mean_in_place`)."""
        finite = mean_in_place(total, world_size)
        return _members(total, packets, sizes), finite


def _members(total: torch.Tensor, packets, sizes) -> list[torch.Tensor]:
    """The members' aggregates: views of their parts of the bucket's ``total``, in their shapes
    (one call where each wire has its packet's shape, as ``compress`` makes it: a bucket of
    hundreds of biases pays no view per member in Python)."""
    wires = [packet.wire["x"] for packet in packets]
    if all(w.shape == packet.shape for w, packet in zip(wires, packets)):
        return list(_unflatten_dense_tensors(total, wires))
    return [part.view(packet.shape) for part, packet in zip(total.split(sizes), packets)]


class CastReference(Implementation):
    """A cast's summand and mean of n packets in torch: the reference."""

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        # Divide (in float32) before the sum, then cast: n terms of x/n cannot overflow.
        return (packet.wire["x"].reshape(-1).float() / world_size).to(self.codec.wire_dtype)

    def aggregate(self, packets) -> torch.Tensor:
        return Compressor.aggregate(self.codec, packets)


class CastTriton(CastReference):
    """A cast's summand and mean of n float32 packets, one pass each, by Triton (CUDA):
    :mod:`gradzip.kernels.triton.cast` and :mod:`gradzip.kernels.triton.mean`."""

    kernel_modules = ("cast", "mean")

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        return self.cast.summand(packet.wire["x"], world_size)

    def aggregate(self, packets) -> torch.Tensor:
        if packets[0].dtype != torch.float32:
            return super().aggregate(packets)
        return self.mean.mean("cast", [p.wire["x"] for p in packets], None, packets[0].shape)


@dataclass(frozen=True)
class _Cast(Summing, Compressor):
    """Cast to ``wire_dtype`` on the wire, back to the packet's dtype on decode."""

    wire_dtype: ClassVar[torch.dtype]
    uses_seed = False
    propagates_nonfinite = True   # the casts keep NaN and ±Inf; x/n of Inf is Inf
    implementations = {"torch": CastReference, "triton": CastTriton}

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        old = reuse.wire.get("x") if reuse is not None else None
        if (old is not None and old.dtype == self.wire_dtype and old.numel() == tensor.numel()
                and old.is_contiguous() and old.device == tensor.device):
            x = old.view(tensor.shape).copy_(tensor.detach())  # the same cast as .to(), no allocation
        else:
            x = tensor.detach().to(self.wire_dtype, copy=True)
        return Packet({"x": x}, tensor.shape, tensor.dtype)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        """Decoded straight into ``out``, then ``out = tensor − out`` in place: no temporary."""
        packet = self.compress(tensor, seed, reuse)
        torch.sub(tensor, self.decompress(packet, out=out), out=out)
        return packet

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None and out.shape == packet.shape and out.dtype == packet.dtype:
            return out.copy_(packet.wire["x"].view(packet.shape))  # cast straight into out
        return deliver(packet.wire["x"].to(packet.dtype).view(packet.shape), out)

    def sum_dtype(self, world_size: int, dtype: torch.dtype = torch.float32) -> torch.dtype | None:
        return self.wire_dtype

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        return self.impl(packet.wire["x"].device).summand(packet, world_size)

    def aggregate(self, packets) -> torch.Tensor:
        """The mean of the decoded packets (``Compressor.aggregate``), in one pass on CUDA."""
        return self.impl(packets[0].wire["x"].device).aggregate(packets)

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        return total.to(packet.dtype).view(packet.shape)  # already the mean


@register
@dataclass(frozen=True)
class FP16(_Cast):
    name = "fp16"
    wire_dtype = torch.float16


@register
@dataclass(frozen=True)
class BF16(_Cast):
    name = "bf16"
    wire_dtype = torch.bfloat16
