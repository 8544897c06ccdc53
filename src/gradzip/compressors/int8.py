"""``int8:block=B``: block-wise symmetric int8 quantisation (docs/algorithms.md §codec: int8),
the weights' codec of ZeRO++'s qwZ (``gradzip.integrations.fsdp.compress(..., weights="int8")``: the
quantized parameter all-gather, docs/algorithms.md §Sharded exchange).

Per block of ``B`` consecutive entries of the flattened tensor (the last block may be
shorter): the scale ``s = max|v|/127`` (float32) and the codes ``q = round(v/s)`` in
``[−127, 127]`` (round half to even; 0 where ``s = 0``); ``C(v) = s·q``, at most ``s/2``
from ``v`` per entry. Wire: ``d`` int8 codes and ``⌈d/B⌉`` float32 scales. Deterministic
(no randomness), biased (rounding), does not sum in compressed form (each worker has its
own scales).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..validation import is_int, require
from ._util import as_float32
from .base import Compressor, Packet, deliver
from .registry import register


@register
@dataclass(frozen=True)
class Int8(Compressor):
    name = "int8"
    block: int = 256

    def __post_init__(self):
        require(is_int(self.block) and self.block >= 1, "int8", f"block must be an integer >= 1, got {self.block!r}")

    def _blocks(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` zero-padded to whole blocks, one row per block."""
        rows = -(-flat.numel() // self.block)
        return F.pad(flat, (0, rows * self.block - flat.numel())).view(rows, self.block)

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        v = as_float32(tensor.detach())
        blocks = self._blocks(v)
        scales = blocks.abs().amax(dim=1).div_(127)
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(blocks / divisor[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:v.numel()]
        return Packet({"codes": codes.contiguous(), "scales": scales}, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        codes = packet.wire["codes"].to(torch.float32)
        dense = self._blocks(codes).mul_(packet.wire["scales"][:, None]).reshape(-1)[:packet.numel]
        return deliver(dense.to(packet.dtype).view(packet.shape), out)
