"""Random sparsifiers: ``randomk`` and ``randblock`` (docs/algorithms.md §codec: randomk,
§codec: randblock): their choices come from the shared seed, so their packets sum in
compressed form (the values only). ``topk`` and the helpers they share are in
:mod:`.sparsify`; the rules of each codec are its class docstring's and the spec's."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..kernels import counter_rng, draws
from ..kernels import sparse as sparse_kernels
from ..validation import is_int, require
from . import _util
from ._util import scatter_mean, shared_generator
from .base import Compressor, Implementation, OnImplementation, Packet, deliver, keep_count
from .capabilities import Summing
from .registry import register
from .sparsify import MAX_PARTS, check_ratio, fits_out, fused_scatter_mean, place_decode, sum_dtype_of

class RandomKReference(Implementation):
    """randomk in torch code: the reference every kernel backend is tested bit-identical to."""

    def indices(self, numel: int, seed: int, device) -> torch.Tensor:
        """The k-subset (ascending int64 on ``device``): the k entries of smallest counter hash
        (:func:`gradzip.kernels.counter_rng.smallest_hashes`), hashed by torch."""
        return counter_rng.smallest_hashes(seed, numel, self.codec.count(numel), device)

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        flat = tensor.detach().reshape(-1)
        idx = self.indices(flat.numel(), seed, flat.device)
        values = self._gather(flat, idx, reuse)
        if self.codec.unbiased:
            values.mul_(flat.numel() / max(idx.numel(), 1))
        return Packet({"values": values}, tensor.shape, tensor.dtype, meta={"indices": idx})

    def _gather(self, flat: torch.Tensor, idx: torch.Tensor, reuse: Packet | None) -> torch.Tensor:
        return flat.index_select(0, idx)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        return deliver(self.codec.scatter(packet.wire["values"], packet), out)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        return scatter_mean(packets, lambda p: (p.meta["indices"], p.wire["values"]), packets[0].numel)


class RandomKNumba(RandomKReference):
    """randomk on the CPU: the draw by one numba pass (:func:`gradzip.kernels.draws.below`), the
    gather into the ``reuse`` packet's buffer, the residual as a copy plus the k drawn entries,
    the decode and the aggregate by :mod:`gradzip.kernels.sparse`."""

    def indices(self, numel: int, seed: int, device) -> torch.Tensor:
        return counter_rng.smallest_hashes(seed, numel, self.codec.count(numel), device, draws.below)

    def _gather(self, flat: torch.Tensor, idx: torch.Tensor, reuse: Packet | None) -> torch.Tensor:
        if not sparse_kernels.supported(flat):
            return flat.index_select(0, idx)
        values = _util.wire_buffer(reuse, "values", idx.numel(), flat.dtype)
        return torch.index_select(flat, 0, idx, out=values)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        """Fused: ``out`` = a copy of ``tensor`` (one pass), then ``x − d`` at the k drawn
        entries only (``d`` the decoded value: ``x``, or the scaled value when ``unbiased``,
        for float32; a scaled 16-bit value needs a rounded difference: the reference)."""
        if not (sparse_kernels.supported(tensor) and fits_out(out, tensor)
                and (not self.codec.unbiased or tensor.dtype == torch.float32)):
            return super().compress_residual(tensor, seed, out, reuse)
        packet = self.compress(tensor, seed, reuse)
        flat = tensor.detach().reshape(-1).contiguous()
        residual = out.view(-1).copy_(flat)
        sparse_kernels.fix_residual(residual, flat, packet.meta["indices"].to(torch.int32), added=False,
                                    values=packet.wire["values"] if self.codec.unbiased else None)
        return packet

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        if place_decode(packet, out, packet.meta["indices"].to(torch.int32), added=False):
            return out
        return super().decompress(packet, out)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        fused = fused_scatter_mean(packets, lambda p: (p.meta["indices"], p.wire["values"]))
        return super().aggregate(packets) if fused is None else fused


class RandomKTriton(RandomKReference):
    """randomk on CUDA: the draw hashed on the device (:func:`gradzip.kernels.triton.sparse.below`),
    never on the CPU; the gather, the residual (a copy plus the k drawn entries), the decode
    and the mean of n packets by torch on the device."""

    kernel_modules = ("sparse",)

    def indices(self, numel: int, seed: int, device) -> torch.Tensor:
        return counter_rng.smallest_hashes(seed, numel, self.codec.count(numel), device, self.sparse.below)

    def _gather(self, flat: torch.Tensor, idx: torch.Tensor, reuse: Packet | None) -> torch.Tensor:
        values = _util.wire_buffer(reuse, "values", idx.numel(), flat.dtype, flat.device)
        return torch.index_select(flat, 0, idx, out=values)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        """``out`` = a copy of ``tensor``, then ``x − d`` at the k drawn entries only (``d`` the
        decoded value, in ``tensor``'s dtype: the reference's ``tensor − decompress``)."""
        if not fits_out(out, tensor):
            return super().compress_residual(tensor, seed, out, reuse)
        packet = self.compress(tensor, seed, reuse)
        flat = tensor.detach().reshape(-1)
        idx = packet.meta["indices"]
        residual = out.view(-1).copy_(flat)
        residual.index_copy_(0, idx, flat.index_select(0, idx) - packet.wire["values"].to(tensor.dtype))
        return packet


@register
@dataclass(frozen=True)
class RandomK(OnImplementation, Summing, Compressor):
    name = "randomk"
    shared_randomness = True
    ratio: float = 0.01
    unbiased: bool = False
    implementations = {"torch": RandomKReference, "numba": RandomKNumba, "triton": RandomKTriton}

    def __post_init__(self):
        check_ratio("randomk", self.ratio)
        require(isinstance(self.unbiased, bool), "randomk", f"unbiased must be true or false, got {self.unbiased!r}")

    def count(self, numel: int) -> int:
        """k: how many of ``numel`` entries are sent."""
        return min(keep_count(self.ratio, numel), numel)

    def indices(self, numel: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The sorted int64 indices every worker derives from the shared ``seed``: the k
        entries of smallest counter hash (docs/algorithms.md §codec: randomk), the same on
        every device and backend."""
        device = torch.device(device)
        return self.impl(device).indices(numel, seed, device)

    def scatter(self, values: torch.Tensor, packet: Packet) -> torch.Tensor:
        """Zeros with ``values`` at the packet's indices, the packet's shape and dtype."""
        out = torch.zeros(packet.numel, dtype=packet.dtype, device=values.device)
        return out.index_copy_(0, packet.meta["indices"], values.to(packet.dtype)).view(packet.shape)

    def sum_dtype(self, world_size: int, dtype: torch.dtype = torch.float32) -> torch.dtype | None:
        return sum_dtype_of(dtype)

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        return packet.wire["values"].to(sum_dtype_of(packet.dtype), copy=True)

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        return self.scatter(total / world_size, packet)


@register
@dataclass(frozen=True)
class RandBlock(Summing, Compressor):
    name = "randblock"
    shared_randomness = True
    ratio: float | None = None
    in_: int | None = None
    out: int | None = None
    layer: int | None = None

    def __post_init__(self):
        blocks = {"in": self.in_, "out": self.out, "layer": self.layer}
        given = {k: v for k, v in blocks.items() if v is not None}
        if self.ratio is None and not given:
            object.__setattr__(self, "ratio", 0.01)
        if self.ratio is not None:
            require(
                not given, "randblock",
                "give either ratio=ρ or in=a,out=b,layer=c, not both; got ratio="
                f"{self.ratio!r} and " + ", ".join(f"{k}={v!r}" for k, v in given.items()),
            )
            check_ratio("randblock", self.ratio)
            return
        for key, value in blocks.items():
            require(
                value is None or (is_int(value) and 1 <= value <= MAX_PARTS), "randblock",
                f"{key} must be an integer >= 1 and <= 2**31, got {value!r}",
            )
        for field in ("in_", "out", "layer"):
            if getattr(self, field) is None:
                object.__setattr__(self, field, 1)

    # -- the shared choice -------------------------------------------------------------
    def block(self, shape: torch.Size, seed: int) -> tuple[tuple[int, ...], tuple[slice, ...] | None]:
        """(view shape, slices into that view), or slices ``None`` when not sent; the same
        for every worker given the same shape and ``seed``."""
        gen = shared_generator(seed)
        numel = math.prod(shape)
        if self.ratio is not None:
            k = min(keep_count(self.ratio, numel), numel)
            off = int(torch.randint(numel - k + 1, (1,), generator=gen))
            return (numel,), (slice(off, off + k),)
        sent, i, j = (int(torch.randint(high, (1,), generator=gen)) for high in (self.layer, self.in_, self.out))
        if sent != 0:  # probability 1 - 1/c
            return tuple(shape), None
        slices = []
        for dim, pick, parts in ((0, i, self.in_), (1, j, self.out))[: len(shape)]:
            size = math.ceil(shape[dim] / parts)
            slices.append(slice(min(pick * size, shape[dim]), min((pick + 1) * size, shape[dim])))
        return tuple(shape), tuple(slices)

    def wire_nbytes(self, shape) -> int:
        """Expected wire bytes for float32 (rounded): ``4k``, or ``4d/(a·b·c)`` (see module)."""
        numel = math.prod(shape)
        if self.ratio is not None:
            return 4 * min(keep_count(self.ratio, numel), numel)
        parts = self.layer * (self.in_ if len(shape) >= 1 else 1) * (self.out if len(shape) >= 2 else 1)
        return round(4 * numel / parts)

    # -- the codec -----------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        view, slices = self.block(tensor.shape, seed)
        meta = {"view": view, "block": slices, "device": tensor.device}
        wire = {}
        if slices is not None:
            part = tensor.detach().reshape(view)[slices]
            wire["values"] = part.clone(memory_format=torch.contiguous_format).view(-1)
        return Packet(wire, tensor.shape, tensor.dtype, meta=meta)

    def _place(self, values: torch.Tensor | None, packet: Packet, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(packet.meta["view"], dtype=dtype, device=packet.meta["device"])
        slices = packet.meta["block"]
        if slices is not None and values is not None:
            target = out[slices]
            target.copy_(values.view(target.shape))
        return out

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        return deliver(self._place(packet.wire.get("values"), packet, packet.dtype).view(packet.shape), out)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        first = packets[0]
        acc = sum_dtype_of(first.dtype)
        total = self._place(None, first, acc)
        for p in packets:
            if p.meta["block"] is not None:
                target = total[p.meta["block"]]
                target += p.wire["values"].view(target.shape)
        return total.div_(len(packets)).to(first.dtype).view(first.shape)

    def sum_dtype(self, world_size: int, dtype: torch.dtype = torch.float32) -> torch.dtype | None:
        return sum_dtype_of(dtype)

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        acc = sum_dtype_of(packet.dtype)
        if "values" not in packet.wire:
            return torch.zeros(0, dtype=acc, device=packet.meta["device"])
        return packet.wire["values"].to(acc, copy=True)

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        return self._place((total / world_size).to(packet.dtype), packet, packet.dtype).view(packet.shape)
