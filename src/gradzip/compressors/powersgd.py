"""``powersgd``: low-rank gradient compression (Vogels et al., NeurIPS 2019), the one-round codec
(docs/algorithms.md §codec: powersgd), and the linear algebra that the ``PowerSGD`` method and the DDP hook share.

The full PowerSGD algorithm (docs/algorithms.md §PowerSGD) is stateful (a warm-started
``Q`` per matrix, error feedback) and needs two allreduce rounds (``P = mean_j M_j Q``,
then ``Q = mean_j M_jᵀ P̂``). The single ``compress`` / ``decompress`` interface of a codec
cannot express that, so the two-round algorithm lives in
:class:`gradzip.optim.PowerSGD` (per tensor) and :func:`gradzip.integrations.ddp.powersgd_hook`
(per DDP bucket); both use the helpers below.

**The codec** ``powersgd:rank=r,min_compression_rate=2`` **[choice]** is the one-round,
stateless half of a power iteration, usable wherever any codec is (EF-SGD, the generic DDP
hook): the tensor is viewed as ``M`` (``rows = shape[0]``, ``cols`` = the rest), a random
orthonormal ``Q`` (``cols × r'``, ``r' = min(r, rows, cols)``) is drawn from the shared seed
(the same on every worker for the same step and tensor), and the packet is ``P = M Q``
(``4·r'·rows`` bytes). It decodes to ``P Qᵀ``, the projection of ``M``'s rows onto
``span(Q)``. Because ``Q`` is shared the map is linear, so packets sum in compressed form:
``mean_j P_j Qᵀ = (mean_j P_j) Qᵀ`` goes through one allreduce of the ``P``'s. It is
biased (``E[Q Qᵀ] = (r'/cols) I``), so use it with error feedback. Tensors with one
dimension, and matrices where ``(rows + cols)·r'·min_compression_rate >= rows·cols``
(PyTorch's rule; the codec only sends ``P``, but keeps the rule so it compresses exactly
the tensors the method and the hook compress), go dense: the packet is the tensor itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..validation import is_int, is_real, require
from ._util import matrix_shape, shared_generator
from .base import Compressor, Packet, deliver
from .capabilities import Summing
from .registry import register


def effective_rank(shape, rank: int) -> int:
    rows, cols = matrix_shape(shape)
    return min(rows, cols, rank)


def should_compress(shape, rank: int, min_compression_rate: float) -> bool:
    """PyTorch's ``_should_compress``: a tensor with more than one dimension whose
    ``rows·cols`` exceeds ``(rows + cols)·r'·min_compression_rate``."""
    if len(shape) < 2:
        return False
    rows, cols = matrix_shape(shape)
    r = effective_rank(shape, rank)
    return (rows + cols) * r * min_compression_rate < rows * cols


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalise the columns of each matrix of a ``(batch, n, r)`` tensor in place, as
    PyTorch's ``powerSGD_hook`` does: Gram-Schmidt for ``r <= 2`` or half precision, else QR.
    A zero column becomes 0 when ``epsilon`` is 0 (division by zero gives NaN otherwise:
    it is replaced by 0 here, where PyTorch would propagate NaN on the CPU)."""
    assert matrices.dim() == 3 and matrices.shape[2] <= matrices.shape[1]
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            col = matrices[:, :, i : i + 1]
            norm = torch.norm(col, dim=1, keepdim=True)
            if epsilon == 0:
                col.div_(norm)
                col.nan_to_num_(0.0, 0.0, 0.0)
            else:
                col.div_(norm + epsilon)
            if i + 1 < rank:
                rest = matrices[:, :, i + 1 :]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        q, _ = torch.linalg.qr(matrices)
        matrices.copy_(q)
    return matrices


def random_q(cols: int, rank: int, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """An orthonormal ``cols × rank`` matrix from a standard normal draw with ``seed`` (a
    CPU generator, so the same numbers on every worker and device)."""
    q = torch.randn(1, cols, rank, generator=shared_generator(seed), dtype=torch.float32)
    return orthogonalize(q)[0].to(device=device, dtype=dtype)


@register
@dataclass(frozen=True)
class PowerSGDCompressor(Summing, Compressor):
    name = "powersgd"
    shared_randomness = True
    rank: int = 1
    min_compression_rate: float = 2.0

    def __post_init__(self):
        require(is_int(self.rank) and self.rank >= 1, "powersgd",
                f"rank must be an integer >= 1, got {self.rank!r}")
        rate = self.min_compression_rate
        require(is_real(rate) and rate >= 0, "powersgd",
                f"min_compression_rate must be >= 0, got {self.min_compression_rate!r}")

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        if not should_compress(tensor.shape, self.rank, self.min_compression_rate):
            return Packet({"values": tensor.detach().reshape(-1).clone()}, tensor.shape, tensor.dtype,
                          meta={"q": None, "device": tensor.device})
        rows, cols = matrix_shape(tensor.shape)
        r = effective_rank(tensor.shape, self.rank)
        acc = torch.promote_types(tensor.dtype, torch.float32)
        q = random_q(cols, r, seed, acc, tensor.device)
        p = tensor.detach().reshape(rows, cols).to(acc).contiguous() @ q
        return Packet({"p": p.reshape(-1)}, tensor.shape, tensor.dtype, meta={"q": q, "device": tensor.device})

    def _decode(self, flat: torch.Tensor, packet: Packet) -> torch.Tensor:
        q = packet.meta["q"]
        if q is None:
            return flat.to(packet.dtype).view(packet.shape)
        rows = matrix_shape(packet.shape)[0]
        return (flat.view(rows, -1) @ q.T).to(packet.dtype).view(packet.shape)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        return deliver(self._decode(next(iter(packet.wire.values())), packet), out)

    def sum_dtype(self, world_size: int, dtype: torch.dtype = torch.float32) -> torch.dtype | None:
        return torch.promote_types(dtype, torch.float32)

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        flat = next(iter(packet.wire.values()))
        return flat.to(torch.promote_types(flat.dtype, torch.float32), copy=True)

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        return self._decode(total / world_size, packet)

    def wire_nbytes(self, shape) -> int:
        if not should_compress(shape, self.rank, self.min_compression_rate):
            return 4 * math.prod(shape)
        return 4 * effective_rank(shape, self.rank) * matrix_shape(shape)[0]
