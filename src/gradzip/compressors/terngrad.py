"""``terngrad``: TernGrad (Wen et al.; docs/algorithms.md §codec: terngrad).

``C(v) = s·sign(v)∘b`` with ``s = max|v|`` per tensor and ``b_j ~ Bernoulli(|v_j|/s)``
drawn from a generator seeded with ``seed``; unbiased, ``E[C(v)] = v``. Wire: ternary codes
in the ``2bit`` layout (``11`` = +s, ``10`` = −s, ``00`` = 0; ``ceil(d/4)`` bytes) and ``s``
in float32 (4 bytes). Does not sum in compressed form (each worker has its own ``s``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._util import as_float32, decode_lut, encode_chunks, generator
from .base import Compressor, Packet, deliver
from .registry import register

_SIGNS = (0.0, 0.0, -1.0, 1.0)


@register
@dataclass(frozen=True)
class TernGrad(Compressor):
    name = "terngrad"
    unbiased = True

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        v = as_float32(tensor.detach())
        low, high = torch.aminmax(v) if v.numel() else (v.new_zeros(()), v.new_zeros(()))
        s = torch.maximum(-low, high)  # max |v|
        gen = generator(seed, v.device)

        def codes_of(part: torch.Tensor) -> torch.Tensor:
            u = torch.rand(part.shape, generator=gen, device=part.device)
            keep = u.mul_(s) < torch.abs(part)  # P = |v|/s; never when s = 0 (so v != 0)
            codes = keep.view(torch.uint8) << 1  # 10 = -s
            codes |= (keep & (part > 0)).view(torch.uint8)  # 11 = +s
            return codes

        packed = encode_chunks(v, 2, codes_of)
        return Packet({"codes": packed, "scale": s.reshape(1)}, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        dense = decode_lut(packet.wire["codes"], 2, _SIGNS, packet.numel, torch.float32)
        return deliver(dense.mul_(packet.wire["scale"]).to(packet.dtype).view(packet.shape), out)
