"""``sign`` (signSGD with majority vote) and ``scaled_sign`` (EF-signSGD)
(docs/algorithms.md §codec: sign, scaled_sign).

Both send one bit per entry, ``v >= 0`` -> 1, packed MSB-first (``ceil(d/8)`` bytes); one
bit cannot say 0, so sign(0) is +1 here. ``sign`` decodes to ±1 and aggregates by majority
vote ``sign(Σ_j sign_j)`` (ties -> 0); as int8 ±1 its packets also sum exactly through an
allreduce for n <= 127, which the exchange picks from 16 workers on (``2bit``: from 8).
``scaled_sign`` decodes to ``(‖v‖₁/d)·sign(v)`` with the scale sent as float32 (4 more
bytes); its aggregate is the plain mean and it does not sum.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ._util import decode_lut, encode_chunks
from .base import Compressor, Packet, deliver
from .registry import register

_PM1 = (-1, 1)


def sign_bits(tensor: torch.Tensor, abs_sum: torch.Tensor | None = None) -> torch.Tensor:
    """Packed bits of ``tensor >= 0`` (flattened); adds ``Σ|v|`` into ``abs_sum`` if given
    (in the same pass over the tensor)."""

    def codes_of(part: torch.Tensor) -> torch.Tensor:
        if abs_sum is not None:
            abs_sum.add_(torch.abs(part).sum(dtype=abs_sum.dtype))
        return (part >= 0).view(torch.uint8)

    return encode_chunks(tensor.detach().reshape(-1), 1, codes_of)


@register
@dataclass(frozen=True)
class Sign(Compressor):
    name = "sign"

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        return Packet({"bits": sign_bits(tensor)}, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        return deliver(decode_lut(packet.wire["bits"], 1, _PM1, packet.numel, packet.dtype).view(packet.shape), out)

    def summand_numel(self, packet: Packet, world_size: int) -> int:
        return packet.numel  # one int8 per entry

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        """Majority vote: ``sign(Σ_j sign_j)``, 0 on a tie."""
        first = packets[0]
        total = torch.zeros(first.numel, dtype=torch.int32, device=first.wire["bits"].device)
        for p in packets:
            total += self.summand(p, len(packets))
        return self.from_sum(total, first, len(packets))

    def sum_dtype(self, world_size: int, dtype: torch.dtype = torch.float32) -> torch.dtype | None:
        return torch.int8 if world_size <= 127 else None

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        return decode_lut(packet.wire["bits"], 1, _PM1, packet.numel, torch.int8)

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        return torch.sign(total).to(packet.dtype).view(packet.shape)


@register
@dataclass(frozen=True)
class ScaledSign(Compressor):
    name = "scaled_sign"

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        v = tensor.detach().reshape(-1)
        l1 = torch.zeros((), dtype=torch.promote_types(v.dtype, torch.float32), device=v.device)
        bits = sign_bits(v, abs_sum=l1)
        scale = (l1 / max(v.numel(), 1)).to(torch.float32)  # ‖v‖₁ / d
        return Packet({"bits": bits, "scale": scale.reshape(1)}, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        scale = packet.wire["scale"].to(packet.dtype)
        dense = decode_lut(packet.wire["bits"], 1, _PM1, packet.numel, packet.dtype)
        return deliver(dense.mul_(scale).view(packet.shape), out)
