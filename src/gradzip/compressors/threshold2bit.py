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

On the CPU the fused kernels of :mod:`gradzip.kernels.elementwise` encode (float32 and
float64 inputs; codes and residual ``p − Q(p)`` in one pass, into the ``reuse`` packet's
buffer), decode (any float dtype, into ``out``), sum (``summand``, ``aggregate``) and
scale (``from_sum`` to float32); the torch code beside them is the reference they are
tested bit-identical to (``gradzip.kernels.use("torch")`` runs it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .. import kernels
from ..kernels import elementwise as ek
from ..validation import is_real, require
from ._util import (FUSED_DTYPES, decode_lut, encode_chunks, flat_input, fused, fused_counts, fused_slices,
                    laid_out, rows, value_table, wire_buffer)
from .base import Compressor, Packet, Slices, deliver
from .bitpack import packed_nbytes
from .registry import register

PLUS = 3  # MXNet codes: 11 = +t, 10 = -t (negative << 1), 00 = 0 (01 unused, decodes to 0)
_SIGNS = (0, 0, -1, 1)  # value of each code divided by t


def ternary_codes(positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """uint8 MXNet codes from two disjoint boolean masks (+ and − entries)."""
    codes = negative.view(torch.uint8) << 1
    codes += positive.view(torch.uint8) * PLUS
    return codes


@register
@dataclass(frozen=True)
class TwoBit(Compressor):
    name = "2bit"
    threshold: float = 0.01

    def __post_init__(self):
        t = self.threshold
        require(
            is_real(t) and math.isfinite(t) and t > 0, "2bit",
            f"threshold must be a finite number > 0, got {t!r}",
        )

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        if fused(tensor) and tensor.dtype in FUSED_DTYPES:
            x, codes, t = self._fused_input(tensor, reuse)
            ek.twobit_encode(kernels.array(x), t, kernels.array(codes))
            return Packet({"codes": codes}, tensor.shape, tensor.dtype)
        t = self.threshold
        packed = encode_chunks(tensor.detach().reshape(-1), 2, lambda p: ternary_codes(p >= t, p <= -t))
        return Packet({"codes": packed}, tensor.shape, tensor.dtype)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        if fused(tensor) and tensor.dtype in FUSED_DTYPES:
            x, codes, t = self._fused_input(tensor, reuse)
            target = kernels.decode_target(out, tensor.shape, tensor.dtype)
            ek.twobit_encode_residual(kernels.array(x), t, kernels.array(value_table(self._values, tensor.dtype)),
                                      kernels.array(codes), kernels.array(target.view(-1)))
            if target is not out:
                out.copy_(target)
            return Packet({"codes": codes}, tensor.shape, tensor.dtype)
        return super().compress_residual(tensor, seed, out, reuse)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        if fused(packet.wire["codes"]) and packet.dtype.is_floating_point:
            target = kernels.decode_target(out, packet.shape, packet.dtype)
            ek.decode2(kernels.array(packet.wire["codes"].contiguous()),
                       kernels.array(value_table(self._values, packet.dtype)), kernels.array(target.view(-1)))
            return target if target is out else deliver(target, out)
        return deliver(decode_lut(packet.wire["codes"], 2, self._values, packet.numel, packet.dtype).view(packet.shape), out)

    # -- many slices (Compressor.compress_slices): one kernel call for all of them -------------
    def compress_slices(self, x: torch.Tensor, bounds, seeds, residual: torch.Tensor | None = None) -> Slices:
        if not (bounds and fused_slices([x, residual])):
            return super().compress_slices(x, bounds, seeds, residual)
        starts, stops, offsets, total = ek.slice_layout(bounds, 2)
        wire = torch.empty(total, dtype=torch.uint8)
        xs = kernels.array(x)
        ek.twobit_encode_many(xs, starts, stops, self._threshold(x.dtype),
                              kernels.array(value_table(self._values, torch.float32)), kernels.array(wire), offsets,
                              xs[:0] if residual is None else kernels.array(residual), residual is not None)
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
        ek.decode2_many(kernels.array(wire), offsets, kernels.array(value_table(self._values, torch.float32)),
                        kernels.array(out), starts, stops)

    @property
    def _values(self) -> tuple:
        """The decoded value of each code (00, 01, 10, 11)."""
        t = self.threshold
        return (0.0, 0.0, -t, t)

    def _fused_input(self, tensor: torch.Tensor, reuse: Packet | None):
        """(flat contiguous input, codes buffer, the threshold rounded to the input's dtype as
        torch rounds it in ``p >= t``)."""
        x = flat_input(tensor)
        return x, wire_buffer(reuse, "codes", packed_nbytes(x.numel(), 2)), self._threshold(x.dtype)

    def _threshold(self, dtype: torch.dtype):
        """The threshold rounded to ``dtype`` as torch rounds it in ``p >= t`` (a kernel's scalar)."""
        return kernels.array(torch.tensor([self.threshold], dtype=dtype))[0]

    def summand_numel(self, packet: Packet, world_size: int) -> int:
        return packet.numel  # one int8 (int16) per entry

    # -- summing as int8 / int16 codes ---------------------------------------------------
    def sum_dtype(self, world_size: int, dtype: torch.dtype = torch.float32) -> torch.dtype | None:
        """int8 up to 127 workers, int16 up to 32767 (exact sums of codes in {−1, 0, 1})."""
        return torch.int8 if world_size <= 127 else torch.int16 if world_size <= 32767 else None

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        width = self.sum_dtype(world_size) or torch.int8
        if fused(packet.wire["codes"]):
            out = torch.empty(packet.numel, dtype=width)
            ek.decode2(kernels.array(packet.wire["codes"].contiguous()), kernels.array(value_table(_SIGNS, width)),
                       kernels.array(out))
            return out
        return decode_lut(packet.wire["codes"], 2, _SIGNS, packet.numel, width)

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        if fused(total) and packet.dtype == torch.float32 and total.dtype in (torch.int8, torch.int16, torch.int32):
            out = torch.empty(packet.shape, dtype=torch.float32)
            ek.scale_counts(kernels.array(total.contiguous().view(-1)), self._step(world_size), kernels.array(out.view(-1)))
            return out
        out = total.to(torch.float32) * (self.threshold / world_size)
        return out.to(packet.dtype).view(packet.shape)

    def _step(self, world_size: int):
        """``t / n`` as the float32 scalar the reference multiplies by (for the fused kernels)."""
        return kernels.array(torch.tensor([self.threshold / world_size], dtype=torch.float32))[0]

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        """Sum the int codes exactly (int32), then scale once: equals the allreduce path."""
        first = packets[0]
        if fused(*(p.wire["codes"] for p in packets)) and first.dtype == torch.float32:
            # the counts summed in the float32 output itself (exact: |count| <= n < 2**24),
            # then scaled in place: the bits of from_sum(int total), one buffer fewer
            out = fused_counts(packets, "codes", _SIGNS, ek.decode2, ek.accumulate2)
            flat = kernels.array(out.view(-1))
            ek.scale_counts(flat, self._step(len(packets)), flat)
            return out
        if fused(*(p.wire["codes"] for p in packets)):
            total = torch.zeros(packets[0].numel, dtype=torch.int32)
            table = kernels.array(value_table(_SIGNS, torch.int32))
            for p in packets:
                ek.accumulate2(kernels.array(p.wire["codes"].contiguous()), table, kernels.array(total))
            return self.from_sum(total, packets[0], len(packets))
        total = torch.zeros(packets[0].numel, dtype=torch.int32, device=packets[0].wire["codes"].device)
        for p in packets:
            total += self.summand(p, len(packets))
        return self.from_sum(total, packets[0], len(packets))
