"""``dct:chunk=s,topk=k``: DeMo's "fast components" (docs/algorithms.md §codec: dct): the
tensor cut into chunks, each chunk's 2-D DCT, the ``k`` coefficients of largest magnitude
per chunk; decoded by the inverse DCT. DeMo's codec (§DeMo; Peng, Quesnelle, Kingma 2024,
reference code bloc97/DeMo).

Matrix view ``rows × cols`` (a 0-d tensor is 1 × 1, a vector of d entries 1 × d, a tensor
of more dimensions ``shape[0] × the rest``). Each side is cut into chunks of ``c`` = the
largest divisor of its length that is at most ``s`` (the length itself when it is at most
``s``), so a matrix is an ``(rows/c1) × (cols/c2)`` grid of ``c1 × c2`` chunks, taken in
row-major order. A chunk ``X`` goes to its coefficients ``Y = D_c1 · X · D_c2ᵀ`` with
``D_n`` the orthonormal DCT-II matrix (``D[u, j] = √(2/n)·cos(π(2j + 1)u / 2n)``, row 0
``√(1/n)``), flattened row-major (coefficient ``(u, v)`` at ``u·c2 + v``). Per chunk the
``k' = min(k, c1·c2)`` coefficients of largest magnitude are kept (ties to the smaller
index), listed in ascending index order. Decoding places them into zeros and applies
``X = D_c1ᵀ · Y · D_c2``.

Wire: per chunk ``k'`` values (the tensor's dtype) and ``k'`` indices inside the chunk in
the narrowest integer holding ``c1·c2 − 1`` (``topk``'s rule): ``(4 + w)·k'`` bytes a chunk
for float32. Biased (DeMo keeps the rest in its momentum); does not sum. The aggregate is
DeMo's: per coefficient the mean over the workers that sent it (0 where none did), then the
inverse DCT; workers whose choices agree therefore average exactly, and a coefficient one
worker alone sends arrives whole.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..validation import is_int, require
from ._util import magnitude_keys, matrix_shape
from .base import Compressor, Packet, deliver, index_dtype, wire_indices
from .registry import register

#: The largest chunk side: a chunk's ``c1·c2`` coefficients are indexed below 2**20 (the selection's keys).
MAX_CHUNK = 1024
_INDEX_BITS = 20


def chunk_size(n: int, target: int) -> int:
    """The largest divisor of ``n`` that is at most ``target`` (``n`` when ``n <= target``)."""
    if n <= target:
        return n
    return max(d for d in range(1, target + 1) if n % d == 0)


@functools.lru_cache(maxsize=None)
def _dct(n: int, device: str) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``D_n`` (float64 formula, rounded once to float32)."""
    j = torch.arange(n, dtype=torch.float64)
    u = j[:, None]
    d = torch.cos(math.pi * (2 * j[None, :] + 1) * u / (2 * n)) * math.sqrt(2 / n)
    d[0] = math.sqrt(1 / n)
    return d.to(torch.float32).to(device)


@register
@dataclass(frozen=True)
class DCT(Compressor):
    name = "dct"
    chunk: int = 64
    topk: int = 32

    def __post_init__(self):
        require(is_int(self.chunk) and 1 <= self.chunk <= MAX_CHUNK, "dct",
                f"chunk must be an integer in [1, {MAX_CHUNK}], got {self.chunk!r}")
        require(is_int(self.topk) and self.topk >= 1, "dct", f"topk must be an integer >= 1, got {self.topk!r}")

    def layout(self, shape) -> tuple[int, int, int, int]:
        """``(rows, cols, c1, c2)`` of a tensor of ``shape``."""
        rows, cols = matrix_shape(shape)
        return rows, cols, chunk_size(rows, self.chunk), chunk_size(cols, self.chunk)

    def _coefficients(self, x: torch.Tensor, shape) -> torch.Tensor:
        """``(chunks, c1·c2)`` float32 DCT coefficients of ``x`` (module docstring)."""
        rows, cols, c1, c2 = self.layout(shape)
        chunks = x.reshape(rows // c1, c1, cols // c2, c2).permute(0, 2, 1, 3)
        y = _dct(c1, str(x.device)) @ chunks @ _dct(c2, str(x.device)).t()
        return y.reshape(-1, c1 * c2)

    def _inverse(self, y: torch.Tensor, packet: Packet) -> torch.Tensor:
        """The tensor (packet's shape and dtype) of ``(chunks, c1·c2)`` coefficients ``y``."""
        rows, cols, c1, c2 = self.layout(packet.shape)
        chunks = y.reshape(rows // c1, cols // c2, c1, c2)
        x = _dct(c1, str(y.device)).t() @ chunks @ _dct(c2, str(y.device))
        return x.permute(0, 2, 1, 3).reshape(packet.shape).to(packet.dtype)

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        rows, cols, c1, c2 = self.layout(tensor.shape)
        if rows * cols == 0:
            empty = torch.zeros(0, dtype=tensor.dtype, device=tensor.device)
            return Packet({"values": empty, "indices": empty.to(torch.uint8)}, tensor.shape, tensor.dtype)
        y = self._coefficients(tensor.detach().to(torch.float32), tensor.shape)
        k = min(self.topk, c1 * c2)
        position = torch.arange(c1 * c2, device=y.device)
        keys = (magnitude_keys(y).to(torch.int64) << _INDEX_BITS) | ((1 << _INDEX_BITS) - 1 - position)
        idx = torch.topk(keys, k, dim=1).indices.sort(dim=1).values
        values = y.gather(1, idx).to(tensor.dtype)
        return Packet({"values": values.reshape(-1), "indices": idx.reshape(-1).to(index_dtype(c1 * c2))},
                      tensor.shape, tensor.dtype)

    def _placed(self, packets: Sequence[Packet]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum, count) per coefficient, ``(chunks, c1·c2)`` float32, over ``packets`` in order."""
        rows, cols, c1, c2 = self.layout(packets[0].shape)
        n = c1 * c2
        chunks = rows * cols // n if n else 0
        device = packets[0].wire["values"].device
        total = torch.zeros(chunks * n, dtype=torch.float32, device=device)
        count = torch.zeros(chunks * n, dtype=torch.float32, device=device)
        for p in packets:
            k = p.wire["values"].numel() // max(chunks, 1)
            flat = (wire_indices(p).long().view(chunks, k) + torch.arange(chunks, device=device)[:, None] * n).view(-1)
            total.index_add_(0, flat, p.wire["values"].to(torch.float32))
            count.index_add_(0, flat, torch.ones(flat.numel(), device=device))
        return total.view(chunks, n), count.view(chunks, n)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        if packet.numel == 0:
            return deliver(torch.zeros(packet.shape, dtype=packet.dtype), out)
        total, _ = self._placed([packet])
        return deliver(self._inverse(total, packet), out)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        """Per coefficient the mean over the workers that sent it (0 where none did), then
        the inverse DCT (module docstring)."""
        if packets[0].numel == 0:
            return torch.zeros(packets[0].shape, dtype=packets[0].dtype)
        total, count = self._placed(packets)
        mean = torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))
        return self._inverse(mean, packets[0])
