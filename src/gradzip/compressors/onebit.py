"""``1bit``: Seide et al.'s 1-bit quantization (docs/algorithms.md §codec: 1bit).

Matrix view ``tensor.reshape(shape[0], -1)`` (a 0-d or 1-d tensor is a single column of
``d`` entries). Per column: bit = (v >= 0); the two reconstruction values are the mean of
the column's non-negative entries and the mean of its negative entries (0 for a kind the
column does not have). Wire: the bits packed MSB-first (``ceil(d/8)`` bytes) and the two
means per column in float32 (``8·columns`` bytes). Does not sum in compressed form.

On the CPU the bits, their packing and the non-negative counts are one numba pass
(:mod:`gradzip.kernels.quantize`), and decoding (or the residual) one more. The column sums
depend on the order of a float sum, so both paths compute them with the same torch
reduction over the same pieces (:func:`_add_sums`); for float32 the fused pass also writes
the clamped values that reduction adds up (bit for bit torch's clamps) into reused scratch,
so the sums read them from cache, the price of bit-identical means.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..kernels import quantize
from . import _util
from ._util import _lut, decode_lut, encode_chunks, matrix_shape
from .base import Packet, deliver
from .bitpack import packed_nbytes
from .registry import register


@register
@dataclass(frozen=True)
class OneBit(_util.DecodeAddMean):
    name = "1bit"

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        if kernels.enabled(tensor):
            return self._encode(tensor, reuse)
        rows, cols = matrix_shape(tensor.shape)
        flat = tensor.detach().reshape(-1)
        sums = torch.zeros(2, cols, dtype=torch.float32, device=flat.device)
        pos_n = torch.zeros(cols, dtype=torch.int64, device=flat.device)

        def codes_of(part: torch.Tensor) -> torch.Tensor:
            m = _add_sums(part, cols, sums)
            nonneg = (m >= 0).view(torch.uint8)
            pos_n.add_(nonneg.sum(0, dtype=torch.int32))
            return nonneg

        bits = encode_chunks(flat, 1, codes_of, chunk=_piece(cols))
        return Packet({"bits": bits, "means": _means(sums, pos_n, rows)}, tensor.shape, tensor.dtype)

    def _encode(self, tensor: torch.Tensor, reuse: Packet | None) -> Packet:
        """The fused compress: the column sums by the reference's own torch reduction (over
        the same pieces, so the same bits: float sums depend on their order), the bits and
        the non-negative counts (exact integers) in one kernel pass."""
        rows, cols = matrix_shape(tensor.shape)
        flat = tensor.detach().reshape(-1)
        sums = torch.zeros(2, cols, dtype=torch.float32)
        chunk = _piece(cols)
        if flat.numel() <= chunk or not _util.piecewise(flat):  # encode_chunks' pieces
            chunk = max(flat.numel(), 1)
        wire = reuse.wire if reuse is not None else {}
        bits = kernels.reused(wire.get("bits"), packed_nbytes(flat.numel(), 1))
        pos_n = torch.zeros(cols, dtype=torch.int64)
        size = min(chunk, flat.numel())
        if flat.dtype == torch.float32:  # the kernel writes the clamps the sums add up
            pos, neg = torch.empty(2, size).unbind()
        else:  # (torch's clamps in the input's dtype: what the reference sums)
            scratch = torch.empty(size, dtype=flat.dtype)
        for start in range(0, flat.numel(), chunk):  # each piece read from memory once
            part = flat[start : start + chunk]
            if flat.dtype == torch.float32:
                quantize.onebit_encode(part.contiguous(), max(cols, 1), bits[start // 8 :], pos_n,
                                       pos[: part.numel()], neg[: part.numel()])
                _add_column_sums(pos[: part.numel()], neg[: part.numel()], cols, sums)
            else:
                _add_sums(part, cols, sums, scratch)
                quantize.onebit_encode(part.to(torch.float32).contiguous(), max(cols, 1), bits[start // 8 :], pos_n)
        means = kernels.reused(wire.get("means"), 2 * cols, torch.float32).view(2, cols)
        return Packet({"bits": bits, "means": means.copy_(_means(sums, pos_n, rows))}, tensor.shape, tensor.dtype)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        if tensor.dtype != torch.float32 or not kernels.enabled(tensor, out) or not out.is_contiguous():
            return super().compress_residual(tensor, seed, out, reuse)
        packet = self._encode(tensor, reuse)
        _, cols = matrix_shape(tensor.shape)
        pos, neg = packet.wire["means"]
        quantize.onebit_decode(packet.wire["bits"], max(cols, 1), pos.contiguous(), neg.contiguous(), out,
                               tensor.detach().reshape(-1).contiguous())
        return packet

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        rows, cols = matrix_shape(packet.shape)
        bits = packet.wire["bits"]
        pos, neg = packet.wire["means"].to(packet.dtype)
        if kernels.enabled(bits):  # the values are exactly pos or neg: float32 holds them
            dense = quantize.decode_target(out, packet.shape, packet.dtype)
            quantize.onebit_decode(bits, max(cols, 1), pos.float().contiguous(), neg.float().contiguous(), dense)
            return dense if dense is out else deliver(dense.to(packet.dtype), out)
        if cols == 1:  # one column: decode straight through a (neg, pos) byte table
            table = torch.where(bit_table(bits.device), pos, neg)
            dense = torch.index_select(table, 0, bits.to(torch.int32)).view(-1)[: rows]
            return deliver(dense.view(packet.shape), out)
        bit = decode_lut(bits, 1, (0.0, 1.0), rows * cols, packet.dtype).view(rows, cols)
        return deliver(torch.lerp(neg, pos, bit, out=bit).view(packet.shape), out)  # exactly pos or neg

    def _decode_add(self, packet: Packet, total: torch.Tensor) -> None:
        _, cols = matrix_shape(packet.shape)
        pos, neg = packet.wire["means"]
        quantize.onebit_decode(packet.wire["bits"], max(cols, 1), pos.contiguous(), neg.contiguous(), total, add=True)


def _piece(cols: int) -> int:
    """Entries per piece of the CPU encoding: whole rows, a multiple of 8 entries."""
    return max(8, _util.CHUNK // max(cols, 1) // 8 * 8) * cols  # cols = 0: an empty tensor


def _add_sums(part: torch.Tensor, cols: int, sums: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Add a piece's column sums of its non-negative entries to ``sums[0]`` and of its
    negative entries to ``sums[1]`` (float32; the one reduction both paths use); returns
    the piece as a ``rows × cols`` matrix. ``scratch`` (the piece's dtype, at least its
    size): where the clamped copies go instead of two fresh tensors (the same values)."""
    m = part.view(-1, cols) if cols else part.view(0, 0)  # (d0, 0, ...): nothing to code
    pos = neg = None
    if scratch is not None:
        pos = neg = scratch[: m.numel()].view(m.shape)
    sums[0] += torch.clamp(m, min=0, out=pos).sum(0, dtype=torch.float32)  # zeros add nothing
    sums[1] += torch.clamp(m, max=0, out=neg).sum(0, dtype=torch.float32)
    return m


def _add_column_sums(pos: torch.Tensor, neg: torch.Tensor, cols: int, sums: torch.Tensor) -> None:
    """:func:`_add_sums` of a float32 piece whose clamps (``pos``, ``neg``, flat) the fused
    kernel wrote: the same reduction of the same values."""
    shape = (-1, cols) if cols else (0, 0)
    sums[0] += pos.view(shape).sum(0, dtype=torch.float32)
    sums[1] += neg.view(shape).sum(0, dtype=torch.float32)


def _means(sums: torch.Tensor, pos_n: torch.Tensor, rows: int) -> torch.Tensor:
    """(2, cols): the means of the non-negative and of the negative entries per column."""
    return torch.stack([sums[0] / pos_n.clamp(min=1), sums[1] / (rows - pos_n).clamp(min=1)])


def bit_table(device: torch.device) -> torch.Tensor:
    """(256, 8) bool: the bits of each byte, most significant first."""
    return _lut((False, True), 1, torch.bool, str(device))
