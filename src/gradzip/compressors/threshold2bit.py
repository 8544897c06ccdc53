"""``2bit``: MXNet's 2-bit threshold quantization, stateless (docs/algorithms.md
§codec: 2bit).

``Q(p) = t·sign(p)·[|p| >= t]``. MXNet's residual loop (``e += v``; ``e >= t`` sends +t and
``e -= t``; ``e <= -t`` sends -t and ``e += t``) is exactly error feedback ``p = e + v``,
``e = p − Q(p)`` around this stateless quantizer, so the residual is the method's error
memory, not the codec's. The comparison is done in the tensor's dtype (as MXNet compares
float32 gradients with a float32 threshold).

Wire: the codes packed four a byte in MXNet's layout (first value in the top two bits;
``11`` = +t, ``10`` = −t, ``00`` = 0), ``ceil(d/4)`` bytes. The threshold is a shared
setting, not sent. Summing: widened to int8 codes in {−1, 0, 1} (``d`` bytes) the packets
sum exactly through an allreduce for n ≤ 127 workers.

Default threshold 0.01 **[choice]**: MXNet's 0.5 applies to batch-summed gradients,
gradzip quantizes mean gradients (docs/algorithms.md §codec: 2bit); the sweep that
chose it is in docs/benchmarks.md, "BIT-SGD threshold on mean gradients".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..validation import is_real, require
from ._util import decode_lut, encode_chunks
from .base import Compressor, Packet, deliver
from .registry import register

PLUS = 3  # MXNet codes: 11 = +t, 10 = -t (negative << 1), 00 = 0 (01 unused, decodes to 0)
_SIGNS = (0, 0, -1, 1)  # value of each code divided by t


def ternary_codes(positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """uint8 MXNet codes from two disjoint boolean masks (+ and − entries)."""
    codes = negative.view(torch.uint8) << 1
    codes += positive.view(torch.uint8) * PLUS
    return codes


@register
@dataclass(frozen=True)
class TwoBit(Compressor):
    name = "2bit"
    threshold: float = 0.01

    def __post_init__(self):
        t = self.threshold
        require(
            is_real(t) and math.isfinite(t) and t > 0, "2bit",
            f"threshold must be a finite number > 0, got {t!r}",
        )

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        t = self.threshold
        packed = encode_chunks(tensor.detach().reshape(-1), 2, lambda p: ternary_codes(p >= t, p <= -t))
        return Packet({"codes": packed}, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        t = self.threshold
        values = (0.0, 0.0, -t, t)
        return deliver(decode_lut(packet.wire["codes"], 2, values, packet.numel, packet.dtype).view(packet.shape), out)

    def summand_numel(self, packet: Packet, world_size: int) -> int:
        return packet.numel  # one int8 per entry

    # -- summing as int8 codes ---------------------------------------------------------
    def sum_dtype(self, world_size: int, dtype: torch.dtype = torch.float32) -> torch.dtype | None:
        return torch.int8 if world_size <= 127 else None

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        return decode_lut(packet.wire["codes"], 2, _SIGNS, packet.numel, torch.int8)

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        out = total.to(torch.float32) * (self.threshold / world_size)
        return out.to(packet.dtype).view(packet.shape)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        """Sum the int codes exactly (int32), then scale once: equals the allreduce path."""
        total = torch.zeros(packets[0].numel, dtype=torch.int32, device=packets[0].wire["codes"].device)
        for p in packets:
            total += self.summand(p, len(packets))
        return self.from_sum(total, packets[0], len(packets))
