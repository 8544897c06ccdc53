"""``scaled_sign`` (EF-signSGD; docs/algorithms.md §codec: sign, scaled_sign): the bits of
``sign`` (:mod:`.sign`), decoded to ``(‖v‖₁/d)·sign(v)`` with the scale sent as float32 (4 more
bytes); its aggregate is the plain mean and it does not sum. ``scaled_sign:scale=rms`` uses
the ℓ2-preserving scale ``‖v‖₂/√d`` instead (1-bit Adam's codec, docs/algorithms.md
§"1-bit Adam, 0/1 Adam, 1-bit LAMB: the boxes"); the bits are the same.

Implementations: :class:`ScaledSignReference` (torch); :class:`ScaledSignNumba` on the CPU
(float32 / float64 inputs: the bits, the ℓ1 block sums and the residual in one pass, into the
``reuse`` packet's buffer; 16-bit inputs: the bits; the decode of 32/64-bit packets; many
slices at once); :class:`ScaledSignTriton` on CUDA (the bits and the ℓ1 sums in one pass, the
residual in one more, the decode, the mean of n packets in one pass). ``‖v‖₁`` is summed in
the order docs/algorithms.md §codec: sign, scaled_sign defines on every path
(:func:`.sign.l1_norm` is its torch statement); ``‖v‖₂/√d`` (``scale=rms``) is a torch
reduction shared by every path (:func:`.sign.rms_scale`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .. import kernels
from ..kernels import elementwise as ek
from ..validation import require
from ._util import FUSED_DTYPES, MeanOfDecoded, decode_lut, fused_slices, laid_out, rows, value_table, wire_buffer
from .base import Compressor, Implementation, OnImplementation, Packet, Slices, deliver
from .bitpack import packed_nbytes
from .registry import register
from .sign import BITS16, PM1, PM1_F32, _decode_fused, _encode_fused, _fused_bits, _l1_scale, _residual_fused, encode_slices, l1_norm, rms_scale, sign_bits


class ScaledSignReference(Implementation):
    """scaled_sign in torch code: the reference every kernel backend is tested bit-identical to."""

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        v = tensor.detach().reshape(-1)
        return Packet({"bits": sign_bits(v), "scale": self.scale(v).reshape(1)}, tensor.shape, tensor.dtype)

    def scale(self, v: torch.Tensor) -> torch.Tensor:
        """The scale of the flat ``v`` by torch code: ``‖v‖₂/√d`` or ``‖v‖₁/d`` (float32 0-d)."""
        return rms_scale(v) if self.codec.scale == "rms" else (l1_norm(v) / max(v.numel(), 1)).to(torch.float32)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        scale = packet.wire["scale"].to(packet.dtype)
        dense = decode_lut(packet.wire["bits"], 1, PM1, packet.numel, packet.dtype)
        return deliver(dense.mul_(scale).view(packet.shape), out)


class ScaledSignNumba(ScaledSignReference):
    """scaled_sign on the CPU by the numba kernels of :mod:`gradzip.kernels.elementwise`."""

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        if tensor.dtype in BITS16:
            x, bits = _encode_fused(tensor, reuse)
            scale = wire_buffer(reuse, "scale", 1, torch.float32)
            scale.copy_(self.scale(x).reshape(1))
            return Packet({"bits": bits, "scale": scale}, tensor.shape, tensor.dtype)
        if tensor.dtype not in FUSED_DTYPES:
            return super().compress(tensor, seed, reuse)
        if self.codec.scale == "rms":
            x, bits, scale = self._fused_scale(tensor, reuse)
            ek.sign_encode(kernels.array(x), kernels.array(bits))
        else:   # the bits and the l1 block sums in one pass
            x, bits = _fused_bits(tensor, reuse)
            partials = kernels.array(torch.empty(max(1, -(-x.numel() // ek.L1_BLOCK)), dtype=torch.float64))
            ek.sign_encode_l1(kernels.array(x), kernels.array(bits), partials)
            scale = _l1_scale(ek.l1_of(kernels.array(x), partials), x.numel(), reuse)
        return Packet({"bits": bits, "scale": scale}, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        # 32/64-bit only: torch's bf16 ±1·NaN has another NaN sign in its vector loop than in
        # its scalar tail, so a 2-entry table cannot reproduce it
        if packet.dtype not in FUSED_DTYPES:
            return super().decompress(packet, out)
        scale = packet.wire["scale"].to(packet.dtype)
        return _decode_fused(packet, value_table(PM1, packet.dtype).mul_(scale), out)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        if tensor.dtype not in FUSED_DTYPES:
            return super().compress_residual(tensor, seed, out, reuse)
        x, bits, scale = self._fused_scale(tensor, reuse)
        table = value_table(PM1, tensor.dtype).mul_(scale.to(tensor.dtype))  # decompress's values
        _residual_fused(tensor, table, bits, x, out)
        return Packet({"bits": bits, "scale": scale}, tensor.shape, tensor.dtype)

    def _fused_scale(self, tensor: torch.Tensor, reuse: Packet | None):
        """(flat input, bits buffer, scale wire ``‖v‖₁/d`` or ``‖v‖₂/√d`` as the reference
        computes it)."""
        x, bits = _fused_bits(tensor, reuse)
        if self.codec.scale == "rms":
            scale = wire_buffer(reuse, "scale", 1, torch.float32)
            scale.copy_(rms_scale(x).reshape(1))
        else:
            scale = _l1_scale(ek.l1_of(kernels.array(x)), x.numel(), reuse)
        return x, bits, scale

    # -- many slices (Slicing.compress_slices): one kernel call for all of them -------------
    # each packet: its bits, then its float32 scale (4 bytes), as Packet.raw lays them out
    def compress_slices(self, x: torch.Tensor, bounds, seeds, residual: torch.Tensor | None = None) -> Slices:
        if not (bounds and fused_slices([x, residual])):
            return super().compress_slices(x, bounds, seeds, residual)
        starts, stops, offsets, total = ek.slice_layout(bounds, 1, 4)
        scales = self._slice_scales(x, starts, stops)
        wire = torch.empty(total, dtype=torch.uint8)
        encode_slices(x, starts, stops, wire, offsets, residual, scales[None, :, None] * PM1_F32)
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
        if self.codec.scale == "rms":
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


class ScaledSignTriton(MeanOfDecoded, ScaledSignReference):
    """scaled_sign on CUDA (or Triton's interpreter) by :mod:`gradzip.kernels.triton.bits` and
    :mod:`gradzip.kernels.triton.norms`."""

    kernel_modules = ("bits", "norms", "mean", "launch")
    KIND, WIRE, SCALAR = "signs", "bits", "scale"

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        if not tensor.dtype.is_floating_point:
            return super().compress(tensor, seed, reuse)
        x, bits, scale = self._buffers(tensor, reuse)
        if self.codec.scale == "rms":
            scale.copy_(rms_scale(x).reshape(1))
            self.bits.encode(x, 1, bits)
        else:   # the bits and the l1 block sums in one pass, the scale by the last fold
            self.norms.ordered_sum(x, final=self.norms.MEAN, out=scale, packed=bits)
        return Packet({"bits": bits, "scale": scale}, tensor.shape, tensor.dtype)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        if not tensor.dtype.is_floating_point:
            return super().compress_residual(tensor, seed, out, reuse)
        x, bits, scale = self._buffers(tensor, reuse)
        if self.codec.scale == "rms":
            scale.copy_(rms_scale(x).reshape(1))
        else:
            self.norms.ordered_sum(x, final=self.norms.MEAN, out=scale)
        table = value_table(PM1, x.dtype).to(x.device).mul_(scale.to(x.dtype))   # decompress's values
        self.bits.encode(x, 1, bits, residual=out, table=table)
        return Packet({"bits": bits, "scale": scale}, tensor.shape, tensor.dtype)

    def _buffers(self, tensor: torch.Tensor, reuse: Packet | None):
        x = self.launch.flat(tensor)
        bits = self.launch.wire_buffer(reuse, "bits", packed_nbytes(x.numel(), 1), x.device)
        return x, bits, self.launch.wire_buffer(reuse, "scale", 1, x.device, torch.float32)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        if not packet.dtype.is_floating_point:
            return super().decompress(packet, out)
        bits = packet.wire["bits"]
        table = value_table(PM1, packet.dtype).to(bits.device).mul_(packet.wire["scale"].to(packet.dtype))
        return self.bits.decode(bits, 1, table, packet.shape, out)


@register
@dataclass(frozen=True)
class ScaledSign(OnImplementation, Compressor):
    """``scale``: ``l1`` (``‖v‖₁/d``, the default, also when not given) or ``rms``
    (``‖v‖₂/√d``: the decoded tensor keeps ``v``'s ℓ2 norm; 1-bit Adam / LAMB)."""

    name = "scaled_sign"
    scale: Optional[str] = None
    implementations = {"torch": ScaledSignReference, "numba": ScaledSignNumba, "triton": ScaledSignTriton}

    def __post_init__(self):
        require(self.scale in (None, "l1", "rms"), "scaled_sign",
                f"scale must be l1 or rms, got {self.scale!r}")


def _scale_offsets(starts: np.ndarray, stops: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return offsets + (stops - starts + 7) // 8


def _scale_tables(matrix: np.ndarray, starts, stops, offsets) -> np.ndarray:
    """Each worker's (row's) decoded −, + value of each slice: ``−1·s``, ``1·s`` (float32), the
    values ``decompress``'s table holds, from the scales in the wire bytes."""
    raw = np.empty((matrix.shape[0], starts.size, 4), np.uint8)
    ek.take_bytes(matrix, _scale_offsets(starts, stops, offsets), raw)
    return raw.view(np.float32) * PM1_F32


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
