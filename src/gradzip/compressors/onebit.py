"""``1bit``: Seide et al.'s 1-bit quantization (docs/algorithms.md §codec: 1bit).

Matrix view ``tensor.reshape(shape[0], -1)`` (a 0-d or 1-d tensor is a single column of
``d`` entries). Per column: bit = (v >= 0); the two reconstruction values are the mean of
the column's non-negative entries and the mean of its negative entries (0 for a kind the
column does not have). Wire: the bits packed MSB-first (``ceil(d/8)`` bytes) and the two
means per column in float32 (``8·columns`` bytes). Does not sum in compressed form.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _util
from ._util import _lut, decode_lut, encode_chunks, matrix_shape
from .base import Compressor, Packet, deliver
from .registry import register


@register
@dataclass(frozen=True)
class OneBit(Compressor):
    name = "1bit"

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        rows, cols = matrix_shape(tensor.shape)
        flat = tensor.detach().reshape(-1)
        # column sums of the non-negative / negative entries and the non-negative counts,
        # accumulated over pieces of whole rows (a multiple of 8 entries each)
        sums = torch.zeros(2, cols, dtype=torch.float32, device=flat.device)
        pos_n = torch.zeros(cols, dtype=torch.int64, device=flat.device)

        def codes_of(part: torch.Tensor) -> torch.Tensor:
            m = part.view(-1, cols) if cols else part.view(0, 0)  # (d0, 0, ...): nothing to code
            nonneg = (m >= 0).view(torch.uint8)
            sums[0] += m.clamp(min=0).sum(0, dtype=torch.float32)  # zeros add nothing
            sums[1] += m.clamp(max=0).sum(0, dtype=torch.float32)
            pos_n.add_(nonneg.sum(0, dtype=torch.int32))
            return nonneg

        piece_rows = max(8, _util.CHUNK // max(cols, 1) // 8 * 8)  # cols = 0: an empty tensor
        bits = encode_chunks(flat, 1, codes_of, chunk=piece_rows * cols)
        means = torch.stack([sums[0] / pos_n.clamp(min=1), sums[1] / (rows - pos_n).clamp(min=1)])
        return Packet({"bits": bits, "means": means}, tensor.shape, tensor.dtype)

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


def bit_table(device: torch.device) -> torch.Tensor:
    """(256, 8) bool: the bits of each byte, most significant first."""
    return _lut((False, True), 1, torch.bool, str(device))
