"""``int8:block=B`` and ``int4:block=B``: block-wise symmetric integer quantisation
(docs/algorithms.md §codec: int8, §codec: int4). ``int8`` is the weights' codec of ZeRO++'s
qwZ (``gradzip.integrations.fsdp.compress(..., weights="int8")``: the quantized parameter all-gather,
docs/algorithms.md §Sharded exchange); ``int4`` is streaming DiLoCo's 4-bit outer gradients
(``DiLoCo(..., compressor="int4")``, §DiLoCo).

Per block of ``B`` consecutive entries of the flattened tensor (the last block may be
shorter): the scale ``s = max|v|/L`` (float32; ``L`` = 127 for int8, 7 for int4) and the
codes ``q = round(v/s)`` in ``[−L, L]`` (round half to even; 0 where ``s = 0``);
``C(v) = s·q``, at most ``s/2`` from ``v`` per entry. Wire: the codes (int8: ``d`` int8;
int4: ``q + 8`` in 4 bits, two a byte, first in the high half, ``⌈d/2⌉`` bytes) and
``⌈d/B⌉`` float32 scales. Deterministic (no randomness), biased (rounding), does not sum in
compressed form (each worker has its own scales).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..validation import is_int, require
from ._util import as_float32
from .base import Compressor, Packet, deliver
from .bitpack import pack_bits, unpack_bits
from .registry import register


@dataclass(frozen=True)
class BlockQuantizer(Compressor):
    """What int8 and int4 share: the blocks, scales and codes (module docstring); a
    subclass sets ``LEVELS`` (L) and how the codes travel (:meth:`_wire_codes`,
    :meth:`_read_codes`)."""

    LEVELS: ClassVar[int] = 127
    block: int = 256

    def __post_init__(self):
        require(is_int(self.block) and self.block >= 1, self.name, f"block must be an integer >= 1, got {self.block!r}")

    def _blocks(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` zero-padded to whole blocks, one row per block."""
        rows = -(-flat.numel() // self.block)
        return F.pad(flat, (0, rows * self.block - flat.numel())).view(rows, self.block)

    def _wire_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """The flat int8 codes in ``[−L, L]`` as they travel."""
        raise NotImplementedError

    def _read_codes(self, wire: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` codes of a wire tensor, as float32."""
        raise NotImplementedError

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        v = as_float32(tensor.detach())
        blocks = self._blocks(v)
        scales = blocks.abs().amax(dim=1).div_(self.LEVELS)
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(blocks / divisor[:, None]).clamp_(-self.LEVELS, self.LEVELS).to(torch.int8)
        codes = codes.reshape(-1)[:v.numel()]
        return Packet({"codes": self._wire_codes(codes), "scales": scales}, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        codes = self._read_codes(packet.wire["codes"], packet.numel)
        dense = self._blocks(codes).mul_(packet.wire["scales"][:, None]).reshape(-1)[:packet.numel]
        return deliver(dense.to(packet.dtype).view(packet.shape), out)


@register
@dataclass(frozen=True)
class Int8(BlockQuantizer):
    name = "int8"
    LEVELS = 127

    def _wire_codes(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.contiguous()

    def _read_codes(self, wire: torch.Tensor, count: int) -> torch.Tensor:
        return wire.to(torch.float32)


@register
@dataclass(frozen=True)
class Int4(BlockQuantizer):
    name = "int4"
    LEVELS = 7
    #: A code travels as ``q + OFFSET`` in [1, 15] (0 unused), four bits.
    OFFSET: ClassVar[int] = 8

    def _wire_codes(self, codes: torch.Tensor) -> torch.Tensor:
        return pack_bits((codes + self.OFFSET).to(torch.uint8), 4)

    def _read_codes(self, wire: torch.Tensor, count: int) -> torch.Tensor:
        return unpack_bits(wire, 4, count).to(torch.float32).sub_(self.OFFSET)
