"""``sign`` (signSGD with majority vote; docs/algorithms.md §codec: sign, scaled_sign), and
what ``scaled_sign`` (:mod:`.scaled_sign`) shares with it: the bits, the ℓ1 norm in its
defined order, the rms scale.

One bit per entry, ``v >= 0`` -> 1, packed MSB-first (``ceil(d/8)`` bytes); one bit cannot
say 0, so sign(0) is +1 here. ``sign`` decodes to ±1 and aggregates by majority vote
``sign(Σ_j sign_j)`` (ties -> 0); as int8 ±1 its packets also sum exactly through an
allreduce for n <= 127, which the exchange picks from 16 workers on (``2bit``: from 8).

Implementations: :class:`SignReference` (torch); :class:`SignNumba`, the kernels of
:mod:`gradzip.kernels.elementwise` on the CPU (encode: float32 and float64 inputs, the bits
and the residual in one pass into the ``reuse`` packet's buffer, 16-bit inputs the bits;
decode into ``out``; votes; many slices at once); :class:`SignTriton`, the kernels of
:mod:`gradzip.kernels.triton.bits` on CUDA (every float dtype; the vote of n packets in one
pass). Each is tested bit-identical to the reference (``gradzip.kernels.use("torch")`` runs
it). ``‖v‖₁`` (:func:`l1_norm`) is summed in the order docs/algorithms.md §codec: sign,
scaled_sign defines, on every device and path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .. import kernels
from ..kernels import elementwise as ek
from ..kernels.sparse import INF_BITS
from ._util import FUSED_DTYPES, decode_lut, encode_chunks, flat_input, fused_counts, fused_slices, laid_out, rows, value_table, wire_buffer
from .base import Compressor, Implementation, Packet, Slices, SumsOnImplementation, deliver
from .capabilities import Summing
from .bitpack import packed_nbytes
from .registry import register

PM1 = (-1, 1)
_SIGN3 = (-1, 0, 1)


def _fused_bits(tensor: torch.Tensor, reuse: Packet | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat contiguous input, its bits buffer: the ``reuse`` packet's when it fits)."""
    x = flat_input(tensor)
    return x, wire_buffer(reuse, "bits", packed_nbytes(x.numel(), 1))


#: 16-bit floats: their bits are encoded by a fused kernel too (compares only); their scale
#: (``scaled_sign``) and residual (a rounded difference) stay torch code.
BITS16 = (torch.float16, torch.bfloat16)


def _encode_fused(tensor: torch.Tensor, reuse: Packet | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat input, its packed bits of ``x >= 0``) by the fused kernel of its dtype."""
    x, bits = _fused_bits(tensor, reuse)
    if x.dtype in BITS16:
        ek.sign_encode_bits(kernels.array(x), INF_BITS[x.dtype], kernels.array(bits))
    else:
        ek.sign_encode(kernels.array(x), kernels.array(bits))
    return x, bits


def _decode_fused(packet: Packet, table: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``table[bit]`` for every entry, written into ``out`` (see ``Compressor.decompress``)."""
    target = kernels.decode_target(out, packet.shape, packet.dtype)
    ek.decode1(kernels.array(packet.wire["bits"].contiguous()), kernels.array(table),
               kernels.array(target.view(-1)))
    return target if target is out else deliver(target, out)


def _residual_fused(tensor: torch.Tensor, table: torch.Tensor, bits: torch.Tensor, x: torch.Tensor,
                    out: torch.Tensor) -> None:
    """bits of ``x >= 0`` into ``bits`` and ``x − table[bit]`` into ``out``, one pass."""
    target = kernels.decode_target(out, tensor.shape, tensor.dtype)
    ek.sign_encode_residual(kernels.array(x), kernels.array(table), kernels.array(bits),
                            kernels.array(target.view(-1)))
    if target is not out:
        out.copy_(target)


def sign_bits(tensor: torch.Tensor) -> torch.Tensor:
    """Packed bits of ``tensor >= 0`` (flattened)."""
    return encode_chunks(tensor.detach().reshape(-1), 1, lambda part: (part >= 0).view(torch.uint8))


class SignReference(Implementation):
    """sign in torch code: the reference every kernel backend is tested bit-identical to."""

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        return Packet({"bits": sign_bits(tensor)}, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        return deliver(decode_lut(packet.wire["bits"], 1, PM1, packet.numel, packet.dtype).view(packet.shape), out)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        """Majority vote: ``sign(Σ_j sign_j)``, 0 on a tie."""
        first = packets[0]
        total = torch.zeros(first.numel, dtype=torch.int32, device=first.wire["bits"].device)
        for p in packets:
            total += self.summand(p, len(packets))
        return self.from_sum(total, first, len(packets))

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        out = decode_lut(packet.wire["bits"], 1, PM1, packet.numel, torch.int8)
        width = self.codec.summand_dtype(world_size)
        return out if width == torch.int8 else out.to(width)

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        return torch.sign(total).to(packet.dtype).view(packet.shape)


class SignNumba(SignReference):
    """sign on the CPU by the numba kernels of :mod:`gradzip.kernels.elementwise`."""

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        if tensor.dtype not in FUSED_DTYPES + BITS16:
            return super().compress(tensor, seed, reuse)
        return Packet({"bits": _encode_fused(tensor, reuse)[1]}, tensor.shape, tensor.dtype)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        if tensor.dtype not in FUSED_DTYPES:
            return super().compress_residual(tensor, seed, out, reuse)
        x, bits = _fused_bits(tensor, reuse)
        _residual_fused(tensor, value_table(PM1, tensor.dtype), bits, x, out)
        return Packet({"bits": bits}, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        if not packet.dtype.is_floating_point:
            return super().decompress(packet, out)
        return _decode_fused(packet, value_table(PM1, packet.dtype), out)

    # -- many slices (Slicing.compress_slices): one kernel call for all of them -------------
    def compress_slices(self, x: torch.Tensor, bounds, seeds, residual: torch.Tensor | None = None) -> Slices:
        if not (bounds and fused_slices([x, residual])):
            return super().compress_slices(x, bounds, seeds, residual)
        starts, stops, offsets, total = ek.slice_layout(bounds, 1)
        wire = torch.empty(total, dtype=torch.uint8)
        encode_slices(x, starts, stops, wire, offsets, residual, pm1_tables(1, len(bounds)))
        return laid_out(wire, offsets)

    def aggregate_slices(self, wires, bounds, out: torch.Tensor, templates) -> None:
        if not (bounds and fused_slices([out], wires)):
            return super().aggregate_slices(wires, bounds, out, templates)
        starts, stops, offsets, _ = ek.slice_layout(bounds, 1)
        ek.votes1_many(kernels.array(rows(wires)), offsets, kernels.array(value_table(_SIGN3, torch.float32)),
                       kernels.array(out), starts, stops)

    def decode_slices(self, wire: torch.Tensor, bounds, out: torch.Tensor, templates) -> None:
        if not (bounds and fused_slices([out], [wire])):
            return super().decode_slices(wire, bounds, out, templates)
        starts, stops, offsets, _ = ek.slice_layout(bounds, 1)
        ek.decode1_many(kernels.array(wire), offsets, pm1_tables(1, len(bounds))[0], kernels.array(out), starts, stops)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        first = packets[0]
        if first.dtype == torch.float32:
            # the votes counted in the float32 output itself (exact: |count| <= n < 2**24),
            # then replaced by their sign in place: the bits of from_sum(int total)
            out = fused_counts(packets, "bits", PM1, ek.decode1, ek.accumulate1)
            flat = kernels.array(out.view(-1))
            ek.sign_of_counts(flat, kernels.array(value_table(_SIGN3, torch.float32)), flat)
            return out
        total = torch.zeros(first.numel, dtype=torch.int32)
        table = kernels.array(value_table(PM1, torch.int32))
        for p in packets:
            ek.accumulate1(kernels.array(p.wire["bits"].contiguous()), table, kernels.array(total))
        return self.from_sum(total, first, len(packets))

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        out = torch.empty(packet.numel, dtype=torch.int8)
        ek.decode1(kernels.array(packet.wire["bits"].contiguous()), kernels.array(value_table(PM1, torch.int8)),
                   kernels.array(out))
        width = self.codec.summand_dtype(world_size)
        return out if width == torch.int8 else out.to(width)

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        if not packet.dtype.is_floating_point or total.dtype not in (torch.int8, torch.int32):
            return super().from_sum(total, packet, world_size)
        out = torch.empty(packet.shape, dtype=packet.dtype)
        ek.sign_of_counts(kernels.array(total.contiguous().view(-1)), kernels.array(value_table(_SIGN3, packet.dtype)),
                          kernels.array(out.view(-1)))
        return out


class SignTriton(SignReference):
    """sign on CUDA (or Triton's interpreter) by :mod:`gradzip.kernels.triton.bits`: the bits and
    the residual in one pass, the decode, the summand, and the vote of n packets in one pass
    over them."""

    kernel_modules = ("bits", "launch")

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        if not tensor.dtype.is_floating_point:
            return super().compress(tensor, seed, reuse)
        x = self.launch.flat(tensor)
        bits = self.launch.wire_buffer(reuse, "bits", packed_nbytes(x.numel(), 1), x.device)
        self.bits.encode(x, 1, bits)
        return Packet({"bits": bits}, tensor.shape, tensor.dtype)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        if not tensor.dtype.is_floating_point:
            return super().compress_residual(tensor, seed, out, reuse)
        x = self.launch.flat(tensor)
        bits = self.launch.wire_buffer(reuse, "bits", packed_nbytes(x.numel(), 1), x.device)
        self.bits.encode(x, 1, bits, residual=out, table=value_table(PM1, x.dtype).to(x.device))
        return Packet({"bits": bits}, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        if not packet.dtype.is_floating_point:
            return super().decompress(packet, out)
        bits = packet.wire["bits"]
        return self.bits.decode(bits, 1, value_table(PM1, packet.dtype).to(bits.device), packet.shape, out)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        if packets[0].dtype != torch.float32:
            return super().aggregate(packets)
        return self.bits.counts([p.wire["bits"] for p in packets], 1, packets[0].shape, None)

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        bits = packet.wire["bits"]
        table = value_table(PM1, self.codec.summand_dtype(world_size)).to(bits.device)
        return self.bits.decode(bits, 1, table, (packet.numel,), None)

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        if not packet.dtype.is_floating_point or total.dtype not in (torch.int8, torch.int16, torch.int32):
            return super().from_sum(total, packet, world_size)
        return self.bits.from_counts(total, packet.shape, packet.dtype, None)


@register
@dataclass(frozen=True)
class Sign(SumsOnImplementation, Summing, Compressor):
    name = "sign"
    implementations = {"torch": SignReference, "numba": SignNumba, "triton": SignTriton}

    def summand_numel(self, packet: Packet, world_size: int) -> int:
        return packet.numel  # one int8 per entry

    def sum_dtype(self, world_size: int, dtype: torch.dtype = torch.float32) -> torch.dtype | None:
        """int8 up to 127 workers, int16 up to 32767 (exact sums of ±1 codes; spec
        "Summand width")."""
        return torch.int8 if world_size <= 127 else torch.int16 if world_size <= 32767 else None

    def summand_dtype(self, world_size: int) -> torch.dtype:
        """The summand's dtype: :meth:`sum_dtype`, int8 where the codes do not sum."""
        return self.sum_dtype(world_size) or torch.int8


def l1_norm(flat: torch.Tensor) -> torch.Tensor:
    """``‖v‖₁`` of a flat tensor as a float64 0-d tensor, summed in the order docs/algorithms.md
    §codec: sign, scaled_sign defines (blocks of 64 rows of 1024 entries, 1024 float64 lanes
    summed row by row, the lanes pairwise, the block sums again so), on every device: the
    torch reference of :func:`gradzip.kernels.elementwise.l1_of` and
    :func:`gradzip.kernels.triton.norms.ordered_sum`, bit for bit."""
    lanes, rows = ek.BLOCK, ek.ROWS
    v = flat.detach()
    while True:
        numel, size = v.numel(), rows * lanes
        full, blocks = numel // size, max(1, -(-numel // size))
        acc = torch.zeros(blocks, lanes, dtype=torch.float64, device=v.device)
        grid = v[:full * size].view(full, rows, lanes)
        tail = torch.zeros(blocks - full, rows, lanes, dtype=torch.float64, device=v.device)   # + 0.0 changes no sum
        tail.view(-1)[:numel - full * size] = torch.abs(v[full * size:])
        for r in range(rows):   # |x| exactly widened to float64 by the in-place add
            acc[:full] += torch.abs(grid[:, r])
            acc[full:] += tail[:, r]
        half = lanes // 2
        while half:
            acc = acc[:, :half] + acc[:, half:2 * half]
            half //= 2
        v = acc.view(-1)
        if blocks == 1:
            return v[0]


def _l1_scale(l1: float, numel: int, reuse: Packet | None) -> torch.Tensor:
    """The ``scale`` wire (float32, 1 entry): ``‖v‖₁ / d`` from the fused path's ``l1``, rounded
    as the reference rounds ``(l1_norm(v) / d).to(float32)`` (a float64 quotient, then float32)."""
    scale = wire_buffer(reuse, "scale", 1, torch.float32)
    scale.copy_(torch.tensor([l1 / max(numel, 1)], dtype=torch.float64))
    return scale


def rms_scale(flat: torch.Tensor) -> torch.Tensor:
    """``‖v‖₂/√d`` of a flat tensor as a float32 0-d tensor (0 for an empty one), the norm
    taken in float32 or wider (one function for the torch and the fused path)."""
    wide = torch.promote_types(flat.dtype, torch.float32)
    norm = torch.linalg.vector_norm(flat, dtype=wide) if flat.numel() else torch.zeros((), dtype=wide)
    return (norm / math.sqrt(max(flat.numel(), 1))).to(torch.float32)


PM1_F32 = np.array(PM1, np.float32)


def pm1_tables(workers: int, slices: int) -> np.ndarray:
    """``sign``'s decoded −1, +1 (float32) for every worker and slice."""
    return np.ascontiguousarray(np.broadcast_to(PM1_F32, (workers, slices, 2)))


def encode_slices(x, starts, stops, wire, offsets, residual, tables) -> None:
    """The bits of every slice into ``wire``; with ``residual``, ``x − tables[0, m, bit]`` too."""
    if residual is None:
        ek.sign_encode_slices(kernels.array(x), starts, stops, kernels.array(wire), offsets)
    else:
        ek.sign_encode_residual_slices(kernels.array(x), starts, stops, tables[0], kernels.array(wire), offsets,
                                     kernels.array(residual))


