"""``qsgd``: QSGD with ``s`` levels (Alistarh et al.; docs/algorithms.md §codec: qsgd).

``C(v)_j = ‖v‖₂ · sign(v_j) · ξ_j / s`` where ``ξ_j`` rounds ``s·|v_j|/‖v‖₂`` down or up at
random with the probabilities that make it unbiased (``ξ = min(floor(r + u), s)``), so
``E[C(v)] = v``. A zero vector encodes to zeros. Wire: the norm in float32 (4 bytes) and
the codes ``sign·ξ + s`` in [0, 2s], packed with ``b = ceil(log2(2s + 1))`` bits:
``ceil(d·b/8) + 4`` bytes.

The uniforms are counter-based, ``u_j = hash(seed, j)`` (:mod:`gradzip.kernels.counter_rng`;
they replaced ``torch.rand(generator=...)``, which alone ran at a tenth of memory speed):
the same draws on every device, and computed inside the fused kernel. On the CPU the codes,
their packing and the residual are one numba pass (:mod:`gradzip.kernels.quantize`), after
one read pass for the norm, summed in a defined order (:func:`l2_norm`, the torch statement
of the kernel's sum); :class:`QSGDReference` (``GRADZIP_KERNELS=torch``) gives the same bits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .. import kernels
from ..kernels import counter_rng, quantize
from ..validation import is_int, require
from .sign import l1_norm
from ._util import EncodesResidual, MeanOfDecoded, as_float32, decode_add_mean, decode_chunks, encode_chunks
from .base import Compressor, Implementation, OnImplementation, Packet, deliver
from .bitpack import packed_nbytes
from .registry import register


class QSGDReference(Implementation):
    """qsgd in torch code: the reference every kernel backend is tested bit-identical to."""

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        s = self.codec.levels
        v = as_float32(tensor.detach())
        norm = l2_norm(v)
        scale = torch.where(norm > 0, s / norm, torch.zeros_like(norm))  # no host sync
        done = [0]  # entries coded so far: the counter of the next piece's first entry

        def codes_of(part: torch.Tensor) -> torch.Tensor:
            u = counter_rng.uniforms(seed, done[0], part.numel(), part.device)
            done[0] += part.numel()
            xi = torch.abs(part).mul_(scale).add_(u).floor_().clamp_(max=s)  # floor(r + u)
            return xi.copysign_(part).add_(s).to(torch.uint8)

        wire = {"norm": norm.reshape(1), "codes": encode_chunks(v, self.codec.bits, codes_of)}
        return Packet(wire, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        s = self.codec.levels
        step = packet.wire["norm"] / s

        def fill(codes: torch.Tensor, out: torch.Tensor) -> None:
            out.copy_(codes).sub_(s).mul_(step)  # (code - s)·‖v‖/s

        dense = decode_chunks(packet.wire["codes"], self.codec.bits, packet.numel, torch.float32, fill)
        return deliver(dense.to(packet.dtype).view(packet.shape), out)


class QSGDNumba(EncodesResidual, QSGDReference):
    """qsgd on the CPU: one read pass for the norm, one numba pass for the codes, their packing
    and the residual (:mod:`gradzip.kernels.quantize`)."""

    def _encode(self, tensor: torch.Tensor, seed: int, reuse: Packet | None,
                residual: torch.Tensor | None) -> Packet:
        s, bits = self.codec.levels, self.codec.bits
        v = as_float32(tensor.detach()).contiguous()
        # the reference's float32 scalars in numpy float32 (IEEE: the same bits, no torch op)
        norm = np.float32(math.sqrt(quantize.square_sum(v)))  # l2_norm's bits
        scale = np.float32(s) / norm if norm > 0 else np.float32(0.0)
        wire = reuse.wire if reuse is not None else {}
        codes = kernels.reused(wire.get("codes"), packed_nbytes(v.numel(), bits))
        norm_ = kernels.reused(wire.get("norm"), 1, torch.float32).fill_(float(norm))
        quantize.qsgd_encode(v, scale, s, bits, seed, codes, residual, _step(norm, s))
        return Packet({"norm": norm_, "codes": codes}, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        s = self.codec.levels
        dense = quantize.decode_target(out, packet.shape, packet.dtype)
        quantize.qsgd_decode(packet.wire["codes"], s, self.codec.bits, _step(packet.wire["norm"].item(), s), dense)
        return dense if dense is out else deliver(dense.to(packet.dtype), out)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        if packets[0].dtype != torch.float32:
            return super().aggregate(packets)
        s, bits = self.codec.levels, self.codec.bits
        return decode_add_mean(self, packets, lambda p, total: quantize.qsgd_decode(
            p.wire["codes"], s, bits, _step(p.wire["norm"].item(), s), total, add=True))


class QSGDTriton(MeanOfDecoded, EncodesResidual, QSGDReference):
    """qsgd on CUDA (or Triton's interpreter): the norm by one ordered read pass
    (:func:`gradzip.kernels.triton.norms.ordered_sum`), the codes, their packing and the residual
    by one more (:mod:`gradzip.kernels.triton.quantize`), the norm never leaving the device;
    the decode, and the mean of n packets in one pass over them."""

    kernel_modules = ("quantize", "norms", "mean", "launch")
    KIND, WIRE, SCALAR = "qsgd", "codes", "norm"

    def _encode(self, tensor: torch.Tensor, seed: int, reuse: Packet | None,
                residual: torch.Tensor | None) -> Packet:
        s, bits = self.codec.levels, self.codec.bits
        v = as_float32(tensor.detach()).contiguous()
        norm = self.launch.wire_buffer(reuse, "norm", 1, v.device, torch.float32)
        codes = self.launch.wire_buffer(reuse, "codes", packed_nbytes(v.numel(), bits), v.device)
        self.norms.ordered_sum(v, square=True, final=self.norms.ROOT, out=norm)   # l2_norm's bits
        self.quantize.qsgd_encode(v, norm, s, bits, seed, codes, residual)
        return Packet({"norm": norm, "codes": codes}, tensor.shape, tensor.dtype)

    def mean_options(self, packet: Packet) -> dict:
        return {"levels": self.codec.levels, "bits": self.codec.bits}


@register
@dataclass(frozen=True)
class QSGD(OnImplementation, Compressor):
    name = "qsgd"
    unbiased = True
    levels: int = 16
    implementations = {"torch": QSGDReference, "numba": QSGDNumba, "triton": QSGDTriton}

    def __post_init__(self):
        s = self.levels
        require(
            is_int(s) and 1 <= s <= 127, "qsgd",
            f"levels must be an integer in [1, 127], got {s!r}",
        )

    @property
    def bits(self) -> int:
        return (2 * self.levels).bit_length()  # = ceil(log2(2s + 1))


def _step(norm: float, levels: int) -> np.float32:
    """``‖v‖/s`` rounded to float32, as the reference's ``norm / s`` (a float32 tensor by an
    int) rounds it: what a code step is worth."""
    return np.float32(norm) / np.float32(levels)


def l2_norm(v: torch.Tensor) -> torch.Tensor:
    """``‖v‖₂`` of the flat float32 ``v`` as a float32 0-d tensor, in the order docs/algorithms.md
    §codec: qsgd defines: the float32 squares ``v * v`` summed in float64 in scaled_sign's ℓ1
    order (:func:`.sign.l1_norm` of the squares), the square root taken in float64 and
    rounded once to float32. On the CPU the torch reference of
    :func:`gradzip.kernels.quantize.square_sum`, bit for bit; elsewhere ``l1_norm``'s device
    order (equal to rounding). A square above float32's range is +inf, as torch's own
    float32 norm makes it (QSGD overflows at 1e20, which the optimizers then catch)."""
    return torch.sqrt(l1_norm(v * v)).to(torch.float32)
