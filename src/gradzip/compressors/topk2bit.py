"""``topk2bit:ratio=ρ``: top-k whose values travel in two bits each (docs/algorithms.md
§codec: topk2bit), SparseLoCo's "Top-k + 2-bit quantization" (§SparseLoCo).

The ``k = max(1, ⌈ρd⌉)`` entries of largest magnitude are chosen exactly as ``topk`` chooses
them (:func:`gradzip.compressors.sparsify.topk_indices`: ties to the smaller index,
ascending). Their values ``w`` are known to have magnitudes between ``τ = min|w|`` and
``M = max|w|``, so two bits suffice for a sign and one magnitude bit: with ``r = M − τ``,
``lo = τ + r/4``, ``mid = τ + r/2``, ``hi = τ + 3r/4`` (float32, one rounding per operation),
value ``w_j`` sends the code ``2·[w_j < 0] + [|w_j| ≥ mid]`` and decodes to ``±lo`` or ``±hi``
(its sign; ``hi`` where the bit is 1). Every decoded magnitude is within ``r/4`` of the
value's. Wire: the indices (``topk``'s widths), the codes (2 bits each, the first value in
a byte's top bits, ``⌈k/4⌉`` bytes) and ``τ, M`` as two float32: ``(w + 0.25)·k + 8`` bytes
for index width ``w``. Deterministic; biased (use it with error feedback, as SparseLoCo
does); does not sum (workers keep different indices): the aggregate scatter-adds the
decoded packets in rank order and divides by n, as ``topk``'s does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ._util import scatter_mean
from .base import Compressor, Packet, deliver, index_dtype, keep_count, wire_indices
from .bitpack import pack_bits, unpack_bits
from .registry import register
from .sparsify import check_ratio, topk_indices


def levels(bounds: torch.Tensor) -> torch.Tensor:
    """``[lo, hi, −lo, −hi]`` (float32, indexed by the code) from ``bounds = [τ, M]``."""
    tau, top = bounds[0], bounds[1]
    r = top - tau
    lo, hi = tau + 0.25 * r, tau + 0.75 * r
    return torch.stack([lo, hi, -lo, -hi])


@register
@dataclass(frozen=True)
class TopK2Bit(Compressor):
    name = "topk2bit"
    ratio: float = 0.02

    def __post_init__(self):
        check_ratio("topk2bit", self.ratio)

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        flat = tensor.detach().reshape(-1)
        k = min(keep_count(self.ratio, flat.numel()), flat.numel())
        idx = topk_indices(flat, k)
        w = flat.index_select(0, idx).to(torch.float32)
        a = w.abs()
        bounds = torch.stack(torch.aminmax(a)) if k else torch.zeros(2)
        tau, top = bounds[0], bounds[1]
        mid = tau + 0.5 * (top - tau)
        codes = (w < 0).to(torch.uint8) * 2 + (a >= mid).to(torch.uint8)
        wire = {"indices": idx.to(index_dtype(flat.numel())), "codes": pack_bits(codes, 2), "bounds": bounds}
        return Packet(wire, tensor.shape, tensor.dtype)

    def _values(self, packet: Packet) -> torch.Tensor:
        """The decoded values of the packet's k entries, in its dtype."""
        k = packet.wire["indices"].numel()
        codes = unpack_bits(packet.wire["codes"], 2, k).long()
        return levels(packet.wire["bounds"]).index_select(0, codes).to(packet.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        values, indices = self._values(packet), wire_indices(packet)
        dense = torch.zeros(packet.numel, dtype=packet.dtype, device=values.device)
        return deliver(dense.index_copy_(0, indices.long(), values).view(packet.shape), out)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        """One dense buffer, every packet's decoded values index-added, divided by n."""
        return scatter_mean(packets, lambda p: (wire_indices(p).long(), self._values(p)), packets[0].numel)
