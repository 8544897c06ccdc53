"""``sign`` (signSGD with majority vote) and ``scaled_sign`` (EF-signSGD)
(docs/algorithms.md §codec: sign, scaled_sign).

Both send one bit per entry, ``v >= 0`` -> 1, packed MSB-first (``ceil(d/8)`` bytes); one
bit cannot say 0, so sign(0) is +1 here. ``sign`` decodes to ±1 and aggregates by majority
vote ``sign(Σ_j sign_j)`` (ties -> 0); as int8 ±1 its packets also sum exactly through an
allreduce for n <= 127, which the exchange picks from 16 workers on (``2bit``: from 8).
``scaled_sign`` decodes to ``(‖v‖₁/d)·sign(v)`` with the scale sent as float32 (4 more
bytes); its aggregate is the plain mean and it does not sum. ``scaled_sign:scale=rms`` uses
the ℓ2-preserving scale ``‖v‖₂/√d`` instead (1-bit Adam's codec, docs/algorithms.md
§"1-bit Adam, 0/1 Adam, 1-bit LAMB: the boxes"); the bits are the same.

On the CPU the fused kernels of :mod:`gradzip.kernels.elementwise` encode (float32 and
float64 inputs: bits, ``scaled_sign``'s ℓ1 block sums and the residual in one pass, into
the ``reuse`` packet's buffer; float16 / bfloat16 inputs: the bits), decode (any float
dtype, into ``out``) and aggregate; the torch code below them is the reference they are
tested bit-identical to (``gradzip.kernels.use("torch")`` runs it). ``‖v‖₁`` is summed in
the order docs/algorithms.md §codec: sign, scaled_sign defines (:func:`l1_norm` on the
torch path, the same sums in the kernel); ``‖v‖₂/√d`` (``scale=rms``) is a torch reduction
shared by both paths.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .. import kernels
from ..kernels import elementwise as ek
from ..kernels.sparse import INF_BITS
from ._util import (FUSED_DTYPES, decode_lut, encode_chunks, flat_input, fused, fused_counts, fused_slices,
                    laid_out, rows, value_table, wire_buffer)
from .base import Compressor, Packet, Slices, deliver
from .bitpack import packed_nbytes
from .registry import register
from ..validation import require

_PM1 = (-1, 1)
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


def _counts_of(packets: Sequence[Packet]) -> torch.Tensor | None:
    """Σ_j sign_j (int32) over the packets by the fused kernel, or None (torch path)."""
    first = packets[0]
    if not fused(*(p.wire["bits"] for p in packets)):
        return None
    total = torch.zeros(first.numel, dtype=torch.int32)
    table = kernels.array(value_table(_PM1, torch.int32))
    for p in packets:
        ek.accumulate1(kernels.array(p.wire["bits"].contiguous()), table, kernels.array(total))
    return total


def sign_bits(tensor: torch.Tensor) -> torch.Tensor:
    """Packed bits of ``tensor >= 0`` (flattened)."""
    return encode_chunks(tensor.detach().reshape(-1), 1, lambda part: (part >= 0).view(torch.uint8))


@register
@dataclass(frozen=True)
class Sign(Compressor):
    name = "sign"

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        if fused(tensor) and tensor.dtype in FUSED_DTYPES + BITS16:
            return Packet({"bits": _encode_fused(tensor, reuse)[1]}, tensor.shape, tensor.dtype)
        return Packet({"bits": sign_bits(tensor)}, tensor.shape, tensor.dtype)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        if fused(tensor) and tensor.dtype in FUSED_DTYPES:
            x, bits = _fused_bits(tensor, reuse)
            _residual_fused(tensor, value_table(_PM1, tensor.dtype), bits, x, out)
            return Packet({"bits": bits}, tensor.shape, tensor.dtype)
        return super().compress_residual(tensor, seed, out, reuse)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        if fused(packet.wire["bits"]) and packet.dtype.is_floating_point:
            return _decode_fused(packet, value_table(_PM1, packet.dtype), out)
        return deliver(decode_lut(packet.wire["bits"], 1, _PM1, packet.numel, packet.dtype).view(packet.shape), out)

    # -- many slices (Compressor.compress_slices): one kernel call for all of them -------------
    def compress_slices(self, x: torch.Tensor, bounds, seeds, residual: torch.Tensor | None = None) -> Slices:
        if not (bounds and fused_slices([x, residual])):
            return super().compress_slices(x, bounds, seeds, residual)
        starts, stops, offsets, total = ek.slice_layout(bounds, 1)
        wire = torch.empty(total, dtype=torch.uint8)
        _encode_slices(x, starts, stops, wire, offsets, residual, _pm1_tables(1, len(bounds)))
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
        ek.decode1_many(kernels.array(wire), offsets, _pm1_tables(1, len(bounds))[0], kernels.array(out), starts, stops)

    def summand_numel(self, packet: Packet, world_size: int) -> int:
        return packet.numel  # one int8 per entry

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        """Majority vote: ``sign(Σ_j sign_j)``, 0 on a tie."""
        first = packets[0]
        if fused(*(p.wire["bits"] for p in packets)) and first.dtype == torch.float32:
            # the votes counted in the float32 output itself (exact: |count| <= n < 2**24),
            # then replaced by their sign in place: the bits of from_sum(int total)
            out = fused_counts(packets, "bits", _PM1, ek.decode1, ek.accumulate1)
            flat = kernels.array(out.view(-1))
            ek.sign_of_counts(flat, kernels.array(value_table(_SIGN3, torch.float32)), flat)
            return out
        total = _counts_of(packets)
        if total is not None:
            return self.from_sum(total, first, len(packets))
        total = torch.zeros(first.numel, dtype=torch.int32, device=first.wire["bits"].device)
        for p in packets:
            total += self.summand(p, len(packets))
        return self.from_sum(total, first, len(packets))

    def sum_dtype(self, world_size: int, dtype: torch.dtype = torch.float32) -> torch.dtype | None:
        """int8 up to 127 workers, int16 up to 32767 (exact sums of ±1 codes; spec
        "Summand width")."""
        return torch.int8 if world_size <= 127 else torch.int16 if world_size <= 32767 else None

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        if fused(packet.wire["bits"]):
            out = torch.empty(packet.numel, dtype=torch.int8)
            ek.decode1(kernels.array(packet.wire["bits"].contiguous()), kernels.array(value_table(_PM1, torch.int8)),
                       kernels.array(out))
        else:
            out = decode_lut(packet.wire["bits"], 1, _PM1, packet.numel, torch.int8)
        width = self.sum_dtype(world_size) or torch.int8
        return out if width == torch.int8 else out.to(width)

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        if (fused(total) and packet.dtype.is_floating_point
                and total.dtype in (torch.int8, torch.int32)):
            out = torch.empty(packet.shape, dtype=packet.dtype)
            ek.sign_of_counts(kernels.array(total.contiguous().view(-1)), kernels.array(value_table(_SIGN3, packet.dtype)),
                              kernels.array(out.view(-1)))
            return out
        return torch.sign(total).to(packet.dtype).view(packet.shape)


def l1_norm(flat: torch.Tensor) -> torch.Tensor:
    """``‖v‖₁`` of a flat tensor as a float64 0-d tensor, summed in the order docs/algorithms.md
    §codec: sign, scaled_sign defines (blocks of 64 rows of 1024 entries, 1024 float64 lanes
    summed row by row, the lanes pairwise, the block sums again so): the torch reference of
    :func:`gradzip.kernels.elementwise.l1_of`, bit for bit, on the CPU. On another device,
    where no fused kernel runs, one float64 reduction in the device's own order (the defined
    order's ~75 small ops per tensor cost more than the codec there): equal to the CPU's to
    float64 rounding, not bit for bit."""
    if flat.device.type != "cpu":
        return torch.sum(torch.abs(flat.detach()), dtype=torch.float64)
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


@register
@dataclass(frozen=True)
class ScaledSign(Compressor):
    """``scale``: ``l1`` (``‖v‖₁/d``, the default, also when not given) or ``rms``
    (``‖v‖₂/√d``: the decoded tensor keeps ``v``'s ℓ2 norm; 1-bit Adam / LAMB)."""

    name = "scaled_sign"
    scale: Optional[str] = None

    def __post_init__(self):
        require(self.scale in (None, "l1", "rms"), "scaled_sign",
                f"scale must be l1 or rms, got {self.scale!r}")

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        if fused(tensor) and tensor.dtype in BITS16:
            x, bits = _encode_fused(tensor, reuse)
            scale = wire_buffer(reuse, "scale", 1, torch.float32)
            scale.copy_(self._reference_scale(x).reshape(1))
            return Packet({"bits": bits, "scale": scale}, tensor.shape, tensor.dtype)
        if fused(tensor) and tensor.dtype in FUSED_DTYPES:
            if self.scale == "rms":
                x, bits, scale = self._fused_scale(tensor, reuse)
                ek.sign_encode(kernels.array(x), kernels.array(bits))
            else:   # the bits and the l1 block sums in one pass
                x, bits = _fused_bits(tensor, reuse)
                partials = kernels.array(torch.empty(max(1, -(-x.numel() // ek.L1_BLOCK)), dtype=torch.float64))
                ek.sign_encode_l1(kernels.array(x), kernels.array(bits), partials)
                scale = _l1_scale(ek.l1_of(kernels.array(x), partials), x.numel(), reuse)
            return Packet({"bits": bits, "scale": scale}, tensor.shape, tensor.dtype)
        v = tensor.detach().reshape(-1)
        return Packet({"bits": sign_bits(v), "scale": self._reference_scale(v).reshape(1)}, tensor.shape, tensor.dtype)

    def _reference_scale(self, v: torch.Tensor) -> torch.Tensor:
        """The scale of the flat ``v`` by torch code: ``‖v‖₂/√d`` or ``‖v‖₁/d`` (float32 0-d)."""
        return rms_scale(v) if self.scale == "rms" else (l1_norm(v) / max(v.numel(), 1)).to(torch.float32)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        scale = packet.wire["scale"].to(packet.dtype)
        # 32/64-bit only: torch's bf16 ±1·NaN has another NaN sign in its vector loop than in
        # its scalar tail, so a 2-entry table cannot reproduce it
        if fused(packet.wire["bits"]) and packet.dtype in FUSED_DTYPES:
            return _decode_fused(packet, value_table(_PM1, packet.dtype).mul_(scale), out)
        dense = decode_lut(packet.wire["bits"], 1, _PM1, packet.numel, packet.dtype)
        return deliver(dense.mul_(scale).view(packet.shape), out)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        if fused(tensor) and tensor.dtype in FUSED_DTYPES:
            x, bits, scale = self._fused_scale(tensor, reuse)
            table = value_table(_PM1, tensor.dtype).mul_(scale.to(tensor.dtype))  # decompress's values
            _residual_fused(tensor, table, bits, x, out)
            return Packet({"bits": bits, "scale": scale}, tensor.shape, tensor.dtype)
        return super().compress_residual(tensor, seed, out, reuse)

    def _fused_scale(self, tensor: torch.Tensor, reuse: Packet | None):
        """(flat input, bits buffer, scale wire ``‖v‖₁/d`` or ``‖v‖₂/√d`` as the reference
        computes it)."""
        x, bits = _fused_bits(tensor, reuse)
        if self.scale == "rms":
            scale = wire_buffer(reuse, "scale", 1, torch.float32)
            scale.copy_(rms_scale(x).reshape(1))
        else:
            scale = _l1_scale(ek.l1_of(kernels.array(x)), x.numel(), reuse)
        return x, bits, scale

    # -- many slices (Compressor.compress_slices): one kernel call for all of them -------------
    # each packet: its bits, then its float32 scale (4 bytes), as Packet.raw lays them out
    def compress_slices(self, x: torch.Tensor, bounds, seeds, residual: torch.Tensor | None = None) -> Slices:
        if not (bounds and fused_slices([x, residual])):
            return super().compress_slices(x, bounds, seeds, residual)
        starts, stops, offsets, total = ek.slice_layout(bounds, 1, 4)
        scales = self._slice_scales(x, starts, stops)
        wire = torch.empty(total, dtype=torch.uint8)
        _encode_slices(x, starts, stops, wire, offsets, residual, scales[None, :, None] * _PM1_F32)
        ek.place_bytes(scales.view(np.uint8).reshape(-1, 4), kernels.array(wire), _scale_offsets(starts, stops, offsets))
        return laid_out(wire, offsets)

    def aggregate_slices(self, wires, bounds, out: torch.Tensor, templates) -> None:
        if not (bounds and fused_slices([out], wires)):
            return super().aggregate_slices(wires, bounds, out, templates)
        starts, stops, offsets, _ = ek.slice_layout(bounds, 1, 4)
        matrix = kernels.array(rows(wires))
        ek.mean1_many(matrix, offsets, _scale_tables(matrix, starts, stops, offsets), kernels.array(out), starts,
                      stops, np.float32(len(wires)))

    def decode_slices(self, wire: torch.Tensor, bounds, out: torch.Tensor, templates) -> None:
        if not (bounds and fused_slices([out], [wire])):
            return super().decode_slices(wire, bounds, out, templates)
        starts, stops, offsets, _ = ek.slice_layout(bounds, 1, 4)
        packed = kernels.array(wire)
        ek.decode1_many(packed, offsets, _scale_tables(packed[None], starts, stops, offsets)[0], kernels.array(out),
                        starts, stops)

    def _slice_scales(self, x: torch.Tensor, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """The float32 scale of every slice, bit for bit :meth:`_fused_scale`'s: ``‖v‖₂/√d``
        by one torch norm per run of equally long adjacent slices (a row-wise norm of a
        matrix runs the same loop per row as the norm of one row), ``‖v‖₁/d`` in the
        defined order (:func:`gradzip.kernels.elementwise.l1_of`)."""
        if self.scale == "rms":
            return _rms_scales(x, starts, stops)
        lengths = stops - starts
        blocks = np.maximum(1, -(-lengths // ek.L1_BLOCK))
        first = np.zeros(blocks.size, np.int64)
        np.cumsum(blocks[:-1], out=first[1:])
        partials = np.empty(int(blocks.sum()), np.float64)
        ek.abs_sum_blocks_many(kernels.array(x), starts, stops, partials, first)
        l1 = partials[first]
        for m in np.flatnonzero(blocks > 1):   # slices over one ℓ1 block: their block sums folded
            l1[m] = ek.l1_of(partials[first[m]:first[m] + blocks[m]])
        return (l1 / np.maximum(lengths, 1)).astype(np.float32)


_PM1_F32 = np.array(_PM1, np.float32)


def _pm1_tables(workers: int, slices: int) -> np.ndarray:
    """``sign``'s decoded −1, +1 (float32) for every worker and slice."""
    return np.ascontiguousarray(np.broadcast_to(_PM1_F32, (workers, slices, 2)))


def _scale_offsets(starts: np.ndarray, stops: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return offsets + (stops - starts + 7) // 8


def _scale_tables(matrix: np.ndarray, starts, stops, offsets) -> np.ndarray:
    """Each worker's (row's) decoded −, + value of each slice: ``−1·s``, ``1·s`` (float32), the
    values ``decompress``'s table holds, from the scales in the wire bytes."""
    raw = np.empty((matrix.shape[0], starts.size, 4), np.uint8)
    ek.take_bytes(matrix, _scale_offsets(starts, stops, offsets), raw)
    return raw.view(np.float32) * _PM1_F32


def _encode_slices(x, starts, stops, wire, offsets, residual, tables) -> None:
    """The bits of every slice into ``wire``; with ``residual``, ``x − tables[0, m, bit]`` too."""
    if residual is None:
        ek.sign_encode_slices(kernels.array(x), starts, stops, kernels.array(wire), offsets)
    else:
        ek.sign_encode_residual_slices(kernels.array(x), starts, stops, tables[0], kernels.array(wire), offsets,
                                     kernels.array(residual))


def _rms_scales(x: torch.Tensor, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """:func:`rms_scale` of every slice ``x[a:b]`` (float32; see ``ScaledSign._slice_scales``):
    the norms of each run of adjacent equally long slices (in the order of their starts) by
    one row-wise norm, then each divided by ``√size`` in float32 (as torch divides a float32
    tensor by a Python float)."""
    order = np.argsort(starts, kind="stable")
    norms = torch.empty(order.size, dtype=torch.float32)
    roots = np.empty(order.size, np.float32)
    i = 0
    while i < order.size:
        a, size = int(starts[order[i]]), int(stops[order[i]] - starts[order[i]])
        j = i + 1
        while j < order.size and starts[order[j]] == a + (j - i) * size and stops[order[j]] - starts[order[j]] == size:
            j += 1
        torch.linalg.vector_norm(x[a:a + (j - i) * size].view(j - i, size), dim=1, dtype=torch.float32,
                                 out=norms[i:j])
        roots[i:j] = math.sqrt(size)
        i = j
    out = np.empty(order.size, np.float32)
    out[order] = norms.numpy() / roots
    return out
