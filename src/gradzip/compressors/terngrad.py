"""``terngrad``: TernGrad (Wen et al.; docs/algorithms.md §codec: terngrad).

``C(v) = s·sign(v)∘b`` with ``s = max|v|`` per tensor and ``b_j = [u_j·s < |v_j|]``, a
Bernoulli(|v_j|/s) draw from the counter-based uniforms ``u_j = hash(seed, j)``
(:mod:`gradzip.kernels.counter_rng`; they replaced ``torch.rand(generator=...)``); unbiased,
``E[C(v)] = v``. Wire: ternary codes in the ``2bit`` layout (``11`` = +s, ``10`` = −s,
``00`` = 0; ``ceil(d/4)`` bytes) and ``s`` in float32 (4 bytes). Does not sum in compressed
form (each worker has its own ``s``). On the CPU the codes, their packing and the residual
are one numba pass (:mod:`gradzip.kernels.quantize`), bit-identical to
:class:`TernGradReference` (``GRADZIP_KERNELS=torch``). ``s`` is exact in any order: a
numba integer max of the bit patterns in the fused path (:func:`.quantize.abs_max`), torch's
``aminmax`` in the reference (:func:`abs_max`), +0.0 for a zero tensor on both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .. import kernels
from ..kernels import counter_rng, quantize
from ._util import EncodesResidual, MeanOfDecoded, as_float32, decode_add_mean, decode_lut, encode_chunks
from .base import Compressor, Implementation, OnImplementation, Packet, deliver
from .bitpack import packed_nbytes
from .registry import register

#: The decoded value of each 2-bit code over ``s`` (00, 01, 10, 11).
SIGNS = (0.0, 0.0, -1.0, 1.0)


class TernGradReference(Implementation):
    """terngrad in torch code: the reference every kernel backend is tested bit-identical to."""

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        v = as_float32(tensor.detach())
        s = abs_max(v)
        done = [0]  # entries coded so far: the counter of the next piece's first entry

        def codes_of(part: torch.Tensor) -> torch.Tensor:
            u = counter_rng.uniforms(seed, done[0], part.numel(), part.device)
            done[0] += part.numel()
            keep = u.mul_(s) < torch.abs(part)  # P = |v|/s; never when s = 0 (so v != 0)
            codes = keep.view(torch.uint8) << 1  # 10 = -s
            codes |= (keep & (part > 0)).view(torch.uint8)  # 11 = +s
            return codes

        packed = encode_chunks(v, 2, codes_of)
        return Packet({"codes": packed, "scale": s.reshape(1)}, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        dense = decode_lut(packet.wire["codes"], 2, SIGNS, packet.numel, torch.float32)
        return deliver(dense.mul_(packet.wire["scale"]).to(packet.dtype).view(packet.shape), out)


class TernGradNumba(EncodesResidual, TernGradReference):
    """terngrad on the CPU: an integer-max pass for ``s``, one numba pass for the codes, their
    packing and the residual (:mod:`gradzip.kernels.quantize`)."""

    def _encode(self, tensor: torch.Tensor, seed: int, reuse: Packet | None,
                residual: torch.Tensor | None) -> Packet:
        v = as_float32(tensor.detach()).contiguous()
        s = quantize.abs_max(v)  # one integer-max pass: exact, no order to define
        wire = reuse.wire if reuse is not None else {}
        codes = kernels.reused(wire.get("codes"), packed_nbytes(v.numel(), 2))
        scale = kernels.reused(wire.get("scale"), 1, torch.float32).fill_(s)
        quantize.terngrad_encode(v, s, seed, codes, residual)
        return Packet({"codes": codes, "scale": scale}, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        dense = quantize.decode_target(out, packet.shape, packet.dtype)
        quantize.terngrad_decode(packet.wire["codes"], packet.wire["scale"].item(), dense)
        return dense if dense is out else deliver(dense.to(packet.dtype), out)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        if packets[0].dtype != torch.float32:
            return super().aggregate(packets)
        return decode_add_mean(self, packets, lambda p, total: quantize.terngrad_decode(
            p.wire["codes"], p.wire["scale"].item(), total, add=True))


class TernGradTriton(MeanOfDecoded, EncodesResidual, TernGradReference):
    """terngrad on CUDA (or Triton's interpreter): ``s`` by an integer-max pass
    (:func:`gradzip.kernels.triton.norms.abs_max`), the codes, their packing and the residual by
    one more (:mod:`gradzip.kernels.triton.quantize`), ``s`` never leaving the device; the
    decode, and the mean of n packets in one pass over them."""

    kernel_modules = ("quantize", "norms", "mean", "launch")
    KIND, WIRE, SCALAR = "terngrad", "codes", "scale"

    def _encode(self, tensor: torch.Tensor, seed: int, reuse: Packet | None,
                residual: torch.Tensor | None) -> Packet:
        v = as_float32(tensor.detach()).contiguous()
        scale = self.norms.abs_max(v, self.launch.wire_buffer(reuse, "scale", 1, v.device, torch.float32))
        codes = self.launch.wire_buffer(reuse, "codes", packed_nbytes(v.numel(), 2), v.device)
        self.quantize.terngrad_encode(v, scale, seed, codes, residual)
        return Packet({"codes": codes, "scale": scale}, tensor.shape, tensor.dtype)

    def mean_options(self, packet: Packet) -> dict:
        return {"bits": 2}


@register
@dataclass(frozen=True)
class TernGrad(OnImplementation, Compressor):
    name = "terngrad"
    unbiased = True
    implementations = {"torch": TernGradReference, "numba": TernGradNumba, "triton": TernGradTriton}


def abs_max(v: torch.Tensor) -> torch.Tensor:
    """``s = max_j |v_j|`` of the flat float32 ``v`` as a 0-d tensor, by torch (the reference
    of :func:`gradzip.kernels.quantize.abs_max`): +0.0 for a zero or empty tensor (``aminmax``
    alone gives −0.0 or +0.0 there, by its order), NaN if ``v`` holds one."""
    low, high = torch.aminmax(v) if v.numel() else (v.new_zeros(()), v.new_zeros(()))
    return torch.maximum(-low, high).abs_()  # ≥ 0 always: abs_ only turns −0.0 into +0.0
