"""``1bit``: Seide et al.'s 1-bit quantization (docs/algorithms.md §codec: 1bit).

Matrix view ``tensor.reshape(shape[0], -1)`` (a 0-d or 1-d tensor is a single column of
``d`` entries). Per column: bit = (v >= 0); the two reconstruction values are the mean of
the column's non-negative entries and the mean of its negative entries (0 for a kind the
column does not have). Wire: the bits packed MSB-first (``ceil(d/8)`` bytes) and the two
means per column in float32 (``8·columns`` bytes). Does not sum in compressed form.

On the CPU the bits, their packing, the non-negative counts and the column sums are one
numba pass (:mod:`gradzip.kernels.quantize`), and decoding (or the residual) one more. The
column sums are added in the order docs/algorithms.md §codec: 1bit defines
(:func:`column_sums` is its torch statement, the reference path), so both paths give the
same means bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .. import kernels
from ..kernels import quantize
from . import _util
from ._util import MeanOfDecoded, _lut, decode_add_mean, decode_lut, encode_chunks, matrix_shape
from .base import Compressor, Implementation, OnImplementation, Packet, deliver
from .bitpack import packed_nbytes
from .registry import register


class OneBitReference(Implementation):
    """1bit in torch code: the reference every kernel backend is tested bit-identical to."""

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        rows, cols = matrix_shape(tensor.shape)
        flat = tensor.detach().reshape(-1)
        pos_n = torch.zeros(cols, dtype=torch.int64, device=flat.device)

        def codes_of(part: torch.Tensor) -> torch.Tensor:
            nonneg = (part >= 0).view(torch.uint8)
            if cols:  # (d0, 0, ...): nothing to count
                pos_n.add_(nonneg.view(-1, cols).sum(0, dtype=torch.int32))
            return nonneg

        bits = encode_chunks(flat, 1, codes_of, chunk=_piece(cols))
        return Packet({"bits": bits, "means": _means(column_sums(flat, cols), pos_n, rows)}, tensor.shape,
                      tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        rows, cols = matrix_shape(packet.shape)
        bits = packet.wire["bits"]
        pos, neg = packet.wire["means"].to(packet.dtype)
        if cols == 1:  # one column: decode straight through a (neg, pos) byte table
            table = torch.where(bit_table(bits.device), pos, neg)
            dense = torch.index_select(table, 0, bits.to(torch.int32)).view(-1)[: rows]
            return deliver(dense.view(packet.shape), out)
        bit = decode_lut(bits, 1, (0.0, 1.0), rows * cols, packet.dtype).view(rows, cols)
        return deliver(torch.lerp(neg, pos, bit, out=bit).view(packet.shape), out)  # exactly pos or neg


class OneBitNumba(OneBitReference):
    """1bit on the CPU: one numba pass for the bits, counts, column sums and means
    (:func:`gradzip.kernels.quantize.onebit_encode`), one for the decoding or the residual."""

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        _, cols = matrix_shape(tensor.shape)
        flat = tensor.detach().reshape(-1)
        if flat.dtype not in (torch.float32, torch.float64):
            flat = flat.to(torch.float32)  # exact: the same comparisons and sums
        wire = reuse.wire if reuse is not None else {}
        bits = kernels.reused(wire.get("bits"), packed_nbytes(flat.numel(), 1))
        means = kernels.reused(wire.get("means"), 2 * cols, torch.float32).view(2, cols)
        quantize.onebit_encode(flat.contiguous(), cols, bits, means)
        return Packet({"bits": bits, "means": means}, tensor.shape, tensor.dtype)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        if tensor.dtype != torch.float32 or not out.is_contiguous():
            return super().compress_residual(tensor, seed, out, reuse)
        packet = self.compress(tensor, seed, reuse)
        _, cols = matrix_shape(tensor.shape)
        pos, neg = packet.wire["means"]
        quantize.onebit_decode(packet.wire["bits"], max(cols, 1), pos.contiguous(), neg.contiguous(), out,
                               tensor.detach().reshape(-1).contiguous())
        return packet

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        _, cols = matrix_shape(packet.shape)
        pos, neg = packet.wire["means"].to(packet.dtype)
        # the values are exactly pos or neg: float32 holds them
        dense = quantize.decode_target(out, packet.shape, packet.dtype)
        quantize.onebit_decode(packet.wire["bits"], max(cols, 1), pos.float().contiguous(), neg.float().contiguous(),
                               dense)
        return dense if dense is out else deliver(dense.to(packet.dtype), out)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        if packets[0].dtype != torch.float32:
            return super().aggregate(packets)
        _, cols = matrix_shape(packets[0].shape)
        return decode_add_mean(self, packets, lambda p, total: quantize.onebit_decode(
            p.wire["bits"], max(cols, 1), p.wire["means"][0].contiguous(), p.wire["means"][1].contiguous(), total,
            add=True))


class OneBitTriton(MeanOfDecoded, OneBitReference):
    """1bit on CUDA (or Triton's interpreter): the lane sums, counts and bits in one pass
    (:func:`gradzip.kernels.triton.onebit.lanes`; the bits in a pass of their own where a line
    is not whole bytes), the fold to column means in torch (:func:`fold_lanes`); the decode, the
    residual and the mean of n packets in one pass (float32)."""

    kernel_modules = ("onebit", "bits", "mean", "launch")
    KIND, WIRE, SCALAR = "onebit", "bits", "means"

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        rows, cols = matrix_shape(tensor.shape)
        if not (cols and tensor.dtype.is_floating_point):
            return super().compress(tensor, seed, reuse)
        flat = self.launch.flat(tensor)
        bits = self.launch.wire_buffer(reuse, "bits", packed_nbytes(flat.numel(), 1), flat.device)
        means = self.launch.wire_buffer(reuse, "means", 2 * cols, flat.device, torch.float32).view(2, cols)
        lanes, counts, packed = self.onebit.lanes(flat, cols, bits)
        if not packed:
            self.bits.encode(flat, 1, bits)
        pos_n = counts.view(-1, cols).sum(0, dtype=torch.int64)
        means.copy_(_means(fold_lanes(lanes, cols), pos_n, rows))
        return Packet({"bits": bits, "means": means}, tensor.shape, tensor.dtype)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        if tensor.dtype != torch.float32 or not matrix_shape(tensor.shape)[1]:
            return super().compress_residual(tensor, seed, out, reuse)
        packet = self.compress(tensor, seed, reuse)
        self.mean_of([packet], out=out, x=self.launch.flat(tensor))
        return packet

    def mean_options(self, packet: Packet) -> dict:
        return {"cols": matrix_shape(packet.shape)[1]}


@register
@dataclass(frozen=True)
class OneBit(OnImplementation, Compressor):
    name = "1bit"
    implementations = {"torch": OneBitReference, "numba": OneBitNumba, "triton": OneBitTriton}


def _piece(cols: int) -> int:
    """Entries per piece of the CPU encoding: whole rows, a multiple of 8 entries."""
    return max(8, _util.CHUNK // max(cols, 1) // 8 * 8) * cols  # cols = 0: an empty tensor


def column_sums(flat: torch.Tensor, cols: int) -> torch.Tensor:
    """``(2, cols)`` float64: per column of the row-major matrix ``flat`` (``cols`` columns),
    the sum of its non-negative parts ``clamp(v, min=0)`` and of its negative parts
    ``clamp(v, max=0)``, in the order docs/algorithms.md §codec: 1bit defines: lines of
    ``w = quantize.lane_width(cols)`` entries (lane ``k`` belongs to column ``k mod cols``),
    blocks of ``quantize.LINES`` lines; in a block, float32 lanes from 0.0 add their clamped
    entries (rounded to float32) line by line (:func:`lane_sums`), then are widened and folded
    pairwise in float64 (lane ``k`` + lane ``k + w/2``, ..., down to ``cols`` lanes); the
    blocks' sums are added by :func:`_add_blocks` (:func:`fold_lanes`). The torch statement of
    what the fused kernels compute (the same bits)."""
    return fold_lanes(lane_sums(flat, cols), cols)


def lane_sums(flat: torch.Tensor, cols: int) -> torch.Tensor:
    """``(2, blocks, w)`` float32: each block's lanes of :func:`column_sums` (non-negative and
    negative parts), before the fold; ``(2, 1, 0)`` for no columns."""
    width = quantize.lane_width(cols)
    if not width:
        return torch.zeros(2, 1, 0, dtype=torch.float32, device=flat.device)
    lines = -(-flat.numel() // width)
    blocks = max(1, -(-lines // quantize.LINES))
    padded = torch.zeros(blocks * quantize.LINES * width, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat  # a missing entry adds +0.0: nothing (the lanes start at +0.0)
    grid = padded.view(blocks, quantize.LINES, width)
    lanes = torch.zeros(2, blocks, width, dtype=torch.float32, device=flat.device)
    for r in range(quantize.LINES):
        lanes[0] += torch.clamp(grid[:, r], min=0).to(torch.float32)
        lanes[1] += torch.clamp(grid[:, r], max=0).to(torch.float32)
    return lanes


def fold_lanes(lanes: torch.Tensor, cols: int) -> torch.Tensor:
    """:func:`column_sums` from its :func:`lane_sums`: widened to float64, folded pairwise to
    ``cols`` lanes, the blocks added by :func:`_add_blocks` (torch, on the lanes' device)."""
    if not cols:
        return torch.zeros(2, 0, dtype=torch.float64, device=lanes.device)
    lanes = lanes.double()
    while lanes.shape[2] > cols:
        half = lanes.shape[2] // 2
        lanes = lanes[:, :, :half] + lanes[:, :, half:]
    return torch.stack([_add_blocks(lanes[0]), _add_blocks(lanes[1])])


def _add_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """The ``(blocks, cols)`` block sums added pairwise into ``(cols,)``: while more than one
    row is left, row ``b`` += row ``b + ⌈count/2⌉`` (a middle row without a partner stays;
    ``gradzip.kernels.quantize._add_blocks`` in the fused pass)."""
    while blocks.shape[0] > 1:
        count, half = blocks.shape[0], (blocks.shape[0] + 1) // 2
        top = blocks[:half].clone()
        top[: count - half] += blocks[half:]
        blocks = top
    return blocks[0]


def _means(sums: torch.Tensor, pos_n: torch.Tensor, rows: int) -> torch.Tensor:
    """(2, cols) float32: the means of the non-negative and of the negative entries per
    column (float64 sums / counts, rounded once)."""
    return torch.stack([sums[0] / pos_n.clamp(min=1), sums[1] / (rows - pos_n).clamp(min=1)]).to(torch.float32)


def bit_table(device: torch.device) -> torch.Tensor:
    """(256, 8) bool: the bits of each byte, most significant first."""
    return _lut((False, True), 1, torch.bool, str(device))
