"""``2bit``: MXNet's 2-bit threshold quantization, stateless (docs/algorithms.md
§codec: 2bit).

``Q(p) = t·sign(p)·[|p| >= t]``. MXNet's residual loop (``e += v``; ``e >= t`` sends +t and
``e -= t``; ``e <= -t`` sends -t and ``e += t``) is exactly error feedback ``p = e + v``,
``e = p − Q(p)`` around this stateless quantizer, so the residual is the method's error
memory, not the codec's. The comparison is done in the tensor's dtype (as MXNet compares
float32 gradients with a float32 threshold).

Wire: the codes packed four a byte in MXNet's layout (first value in the top two bits;
``11`` = +t, ``10`` = −t, ``00`` = 0), ``ceil(d/4)`` bytes. The threshold is a shared
setting, not sent. Summing: widened to codes in {−1, 0, 1} the packets sum exactly through
an allreduce in the narrowest exact width (docs/algorithms.md §Transports, "Summand
width"): int8 (``d`` bytes) for n ≤ 127 workers, int16 (``2d`` bytes) for n ≤ 32767, so
the exchange never falls back to an allgather because int8 would overflow.

Default threshold 0.01 **[choice]**: MXNet's 0.5 applies to batch-summed gradients,
gradzip quantizes mean gradients (docs/algorithms.md §codec: 2bit); the sweep that
chose it is in docs/benchmarks/accuracy.md, "BIT-SGD threshold on mean gradients".

Implementations (``Compressor.impl``): :class:`TwoBitReference` is the torch reference;
on the CPU the numba kernels of :mod:`gradzip.kernels.elementwise` (:class:`TwoBitNumba`)
encode (float32 and float64 inputs; codes and residual ``p − Q(p)`` in one pass, into the
``reuse`` packet's buffer), decode (any float dtype, into ``out``), sum (``summand``,
``aggregate``) and scale (``from_sum`` to float32), and do many slices at once; on CUDA the
Triton kernels of :mod:`gradzip.kernels.triton.bits` (:class:`TwoBitTriton`) do the same
per tensor, the aggregate of n packets in one pass. Each is tested bit-identical to the
reference (``gradzip.kernels.use("torch")`` runs it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .. import kernels
from ..kernels import elementwise as ek
from ..validation import is_real, require
from ._util import FUSED_DTYPES, decode_lut, encode_chunks, flat_input, fused_counts, fused_slices, laid_out, rows, value_table, wire_buffer
from .base import Compressor, Implementation, Packet, Slices, SumsOnImplementation, deliver
from .capabilities import Summing
from .bitpack import packed_nbytes
from .registry import register

PLUS = 3  # MXNet codes: 11 = +t, 10 = -t (negative << 1), 00 = 0 (01 unused, decodes to 0)
_SIGNS = (0, 0, -1, 1)  # value of each code divided by t


def ternary_codes(positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """uint8 MXNet codes from two disjoint boolean masks (+ and − entries)."""
    codes = negative.view(torch.uint8) << 1
    codes += positive.view(torch.uint8) * PLUS
    return codes


class TwoBitReference(Implementation):
    """2bit in torch code: the reference every kernel backend is tested bit-identical to."""

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        t = self.codec.threshold
        packed = encode_chunks(tensor.detach().reshape(-1), 2, lambda p: ternary_codes(p >= t, p <= -t))
        return Packet({"codes": packed}, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        values = decode_lut(packet.wire["codes"], 2, self.codec.values, packet.numel, packet.dtype)
        return deliver(values.view(packet.shape), out)

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        return decode_lut(packet.wire["codes"], 2, _SIGNS, packet.numel, self.codec.summand_dtype(world_size))

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        out = total.to(torch.float32) * (self.codec.threshold / world_size)
        return out.to(packet.dtype).view(packet.shape)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        """Sum the int codes exactly (int32), then scale once: equals the allreduce path."""
        total = torch.zeros(packets[0].numel, dtype=torch.int32, device=packets[0].wire["codes"].device)
        for p in packets:
            total += self.summand(p, len(packets))
        return self.from_sum(total, packets[0], len(packets))


class TwoBitNumba(TwoBitReference):
    """2bit on the CPU by the numba kernels of :mod:`gradzip.kernels.elementwise`."""

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        if tensor.dtype not in FUSED_DTYPES:
            return super().compress(tensor, seed, reuse)
        x, codes, t = self._input(tensor, reuse)
        ek.twobit_encode(kernels.array(x), t, kernels.array(codes))
        return Packet({"codes": codes}, tensor.shape, tensor.dtype)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        if tensor.dtype not in FUSED_DTYPES:
            return super().compress_residual(tensor, seed, out, reuse)
        x, codes, t = self._input(tensor, reuse)
        target = kernels.decode_target(out, tensor.shape, tensor.dtype)
        ek.twobit_encode_residual(kernels.array(x), t, kernels.array(value_table(self.codec.values, tensor.dtype)),
                                  kernels.array(codes), kernels.array(target.view(-1)))
        if target is not out:
            out.copy_(target)
        return Packet({"codes": codes}, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        if not packet.dtype.is_floating_point:
            return super().decompress(packet, out)
        target = kernels.decode_target(out, packet.shape, packet.dtype)
        ek.decode2(kernels.array(packet.wire["codes"].contiguous()),
                   kernels.array(value_table(self.codec.values, packet.dtype)), kernels.array(target.view(-1)))
        return target if target is out else deliver(target, out)

    # -- many slices (Slicing.compress_slices): one kernel call for all of them -------------
    def compress_slices(self, x: torch.Tensor, bounds, seeds, residual: torch.Tensor | None = None) -> Slices:
        if not (bounds and fused_slices([x, residual])):
            return super().compress_slices(x, bounds, seeds, residual)
        starts, stops, offsets, total = ek.slice_layout(bounds, 2)
        wire = torch.empty(total, dtype=torch.uint8)
        xs = kernels.array(x)
        ek.twobit_encode_many(xs, starts, stops, self._threshold(x.dtype),
                              kernels.array(value_table(self.codec.values, torch.float32)), kernels.array(wire),
                              offsets, xs[:0] if residual is None else kernels.array(residual), residual is not None)
        return laid_out(wire, offsets)

    def aggregate_slices(self, wires, bounds, out: torch.Tensor, templates) -> None:
        if not (bounds and fused_slices([out], wires)):
            return super().aggregate_slices(wires, bounds, out, templates)
        starts, stops, offsets, _ = ek.slice_layout(bounds, 2)
        ek.counts2_many(kernels.array(rows(wires)), offsets, self._step(len(wires)), kernels.array(out), starts, stops)

    def decode_slices(self, wire: torch.Tensor, bounds, out: torch.Tensor, templates) -> None:
        if not (bounds and fused_slices([out], [wire])):
            return super().decode_slices(wire, bounds, out, templates)
        starts, stops, offsets, _ = ek.slice_layout(bounds, 2)
        ek.decode2_many(kernels.array(wire), offsets, kernels.array(value_table(self.codec.values, torch.float32)),
                        kernels.array(out), starts, stops)

    def _input(self, tensor: torch.Tensor, reuse: Packet | None):
        """(flat contiguous input, codes buffer, the threshold rounded to the input's dtype as
        torch rounds it in ``p >= t``)."""
        x = flat_input(tensor)
        return x, wire_buffer(reuse, "codes", packed_nbytes(x.numel(), 2)), self._threshold(x.dtype)

    def _threshold(self, dtype: torch.dtype):
        """The threshold rounded to ``dtype`` as torch rounds it in ``p >= t`` (a kernel's scalar)."""
        return kernels.array(torch.tensor([self.codec.threshold], dtype=dtype))[0]

    # -- summing as int8 / int16 codes ---------------------------------------------------
    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        width = self.codec.summand_dtype(world_size)
        out = torch.empty(packet.numel, dtype=width)
        ek.decode2(kernels.array(packet.wire["codes"].contiguous()), kernels.array(value_table(_SIGNS, width)),
                   kernels.array(out))
        return out

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        if packet.dtype != torch.float32 or total.dtype not in (torch.int8, torch.int16, torch.int32):
            return super().from_sum(total, packet, world_size)
        out = torch.empty(packet.shape, dtype=torch.float32)
        ek.scale_counts(kernels.array(total.contiguous().view(-1)), self._step(world_size), kernels.array(out.view(-1)))
        return out

    def _step(self, world_size: int):
        """``t / n`` as the float32 scalar the reference multiplies by (for the fused kernels)."""
        return kernels.array(torch.tensor([self.codec.threshold / world_size], dtype=torch.float32))[0]

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        first = packets[0]
        if first.dtype == torch.float32:
            # the counts summed in the float32 output itself (exact: |count| <= n < 2**24),
            # then scaled in place: the bits of from_sum(int total), one buffer fewer
            out = fused_counts(packets, "codes", _SIGNS, ek.decode2, ek.accumulate2)
            flat = kernels.array(out.view(-1))
            ek.scale_counts(flat, self._step(len(packets)), flat)
            return out
        total = torch.zeros(first.numel, dtype=torch.int32)
        table = kernels.array(value_table(_SIGNS, torch.int32))
        for p in packets:
            ek.accumulate2(kernels.array(p.wire["codes"].contiguous()), table, kernels.array(total))
        return self.from_sum(total, first, len(packets))


class TwoBitTriton(TwoBitReference):
    """2bit on CUDA (or Triton's interpreter) by :mod:`gradzip.kernels.triton.bits`: the codes and
    the residual in one pass, the decode, the summand, and the aggregate of n packets in one
    pass over them."""

    kernel_modules = ("bits", "launch")

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        return self._encode(tensor, reuse, None)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        return self._encode(tensor, reuse, out)

    def _encode(self, tensor: torch.Tensor, reuse: Packet | None, residual: torch.Tensor | None) -> Packet:
        if not tensor.dtype.is_floating_point:
            return (super().compress(tensor, 0, reuse) if residual is None
                    else super().compress_residual(tensor, 0, residual, reuse))
        x = self.launch.flat(tensor)
        codes = self.launch.wire_buffer(reuse, "codes", packed_nbytes(x.numel(), 2), x.device)
        threshold = torch.tensor([self.codec.threshold], dtype=x.dtype).to(x.device)   # as torch rounds p >= t
        table = value_table(self.codec.values, x.dtype).to(x.device) if residual is not None else None
        self.bits.encode(x, 2, codes, threshold, residual, table)
        return Packet({"codes": codes}, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        codes = packet.wire["codes"]
        return self.bits.decode(codes, 2, value_table(self.codec.values, packet.dtype).to(codes.device), packet.shape, out)

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        codes = packet.wire["codes"]
        table = value_table(_SIGNS, self.codec.summand_dtype(world_size)).to(codes.device)
        return self.bits.decode(codes, 2, table, (packet.numel,), None)

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        if packet.dtype != torch.float32 or total.dtype not in (torch.int8, torch.int16, torch.int32):
            return super().from_sum(total, packet, world_size)
        return self.bits.from_counts(total, packet.shape, torch.float32, self.codec.threshold / world_size)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        if packets[0].dtype != torch.float32:
            return super().aggregate(packets)
        return self.bits.counts([p.wire["codes"] for p in packets], 2, packets[0].shape,
                             self.codec.threshold / len(packets))


@register
@dataclass(frozen=True)
class TwoBit(SumsOnImplementation, Summing, Compressor):
    name = "2bit"
    threshold: float = 0.01
    implementations = {"torch": TwoBitReference, "numba": TwoBitNumba, "triton": TwoBitTriton}

    def __post_init__(self):
        t = self.threshold
        require(
            is_real(t) and math.isfinite(t) and t > 0, "2bit",
            f"threshold must be a finite number > 0, got {t!r}",
        )

    @property
    def values(self) -> tuple:
        """The decoded value of each code (00, 01, 10, 11)."""
        t = self.threshold
        return (0.0, 0.0, -t, t)

    def summand_numel(self, packet: Packet, world_size: int) -> int:
        return packet.numel  # one int8 (int16) per entry

    # -- summing as int8 / int16 codes ---------------------------------------------------
    def sum_dtype(self, world_size: int, dtype: torch.dtype = torch.float32) -> torch.dtype | None:
        """int8 up to 127 workers, int16 up to 32767 (exact sums of codes in {−1, 0, 1})."""
        return torch.int8 if world_size <= 127 else torch.int16 if world_size <= 32767 else None

    def summand_dtype(self, world_size: int) -> torch.dtype:
        """The summand's dtype: :meth:`sum_dtype`, int8 where the codes do not sum."""
        return self.sum_dtype(world_size) or torch.int8
