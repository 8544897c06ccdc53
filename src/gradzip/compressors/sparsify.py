"""Sparsifiers: ``topk`` here, ``randomk`` and ``randblock`` in :mod:`.randomk`, and the helpers
they share (docs/algorithms.md §codec: topk, §codec: randomk, §codec: randblock).

* ``topk:ratio=ρ``: the ``k = max(1, ceil(ρd))`` entries of largest magnitude; wire = values
  (the tensor's dtype) + indices in the narrowest integer that holds ``d − 1``
  (:func:`~gradzip.compressors.base.index_dtype`: ``uint8`` for d ≤ 256, ``uint16`` for
  d ≤ 65536, ``int32`` above), so ``5k``, ``6k`` or ``8k`` bytes for float32. Does not sum
  (every worker keeps other indices); its aggregate scatter-adds all packets into one buffer.
* ``randomk:ratio=ρ[,unbiased=true]``: the k coordinates of smallest counter hash of the
  shared ``seed`` (:func:`gradzip.kernels.counter_rng.smallest_hashes`; same step and tensor
  -> same indices on every worker and device, hashed where the tensor lives); values scaled
  by ``d/k`` only when ``unbiased``. Wire = the values only (``4k`` bytes): every worker
  re-derives the indices (kept in ``meta``). Sums (the values, in float32).
* ``randblock``: one block chosen with the shared seed, sent dense; sums like ``randomk``.
  ``randblock:ratio=ρ``: a contiguous run of k entries of the flattened tensor at an offset
  uniform in ``[0, d − k]`` (the PowerSGD paper's "random block"). ``randblock:in=a,out=b,
  layer=c``: CSER's sparsifier: with probability ``1/c`` the tensor is sent at all
  (otherwise the wire is empty, 0 bytes, and it decodes to zeros); then ``i`` uniform in
  ``[0, a)`` and ``j`` in ``[0, b)`` pick rows ``i·⌈d0/a⌉ .. min(d0, (i+1)·⌈d0/a⌉)`` and the
  same along dim 1 with ``⌈d1/b⌉``, other dims whole (a 1-d tensor uses dim 0 only, a 0-d
  one is its single element). Since the ``a`` row blocks partition the rows (the last ones
  may be empty when ``a > d0``), the expected wire is exactly ``4d/(a·b·c)`` bytes (``4d/(a·c)``
  for a 1-d tensor). **[choice]** The CSER code instead uses ``round(d0/a)`` rows and picks
  among the non-empty blocks only, which sends more than ``1/a`` of a small tensor.
  Exactly one form may be given; missing ``in``/``out``/``layer`` are 1; nothing at all
  means ``ratio=0.01``.

``randblock``'s shared choice (a few integers) comes from a CPU generator (the same numbers
on every device).
Indices are at most int32 on the wire, so a tensor has fewer than 2**31 entries.

Implementations (``Compressor.impl``): the ``*Reference`` classes are the torch reference.
numba (CPU, float32 / float16 / bfloat16; gradzip/kernels/sparse.py, gradzip/kernels/draws.py):
``topk``'s candidate scan is one pass that also copies the tensor into the residual of
``compress_residual`` (then only the ``k`` sent entries of it are rewritten); ``randomk``'s
draw is one hashing pass, its residual a copy plus the ``k`` drawn entries;
``decompress(out=)`` zero-fills ``out`` and scatters into it; the aggregate adds every
packet into one buffer and divides it, in one kernel; ``reuse`` receives the wire. Triton
(CUDA; gradzip/kernels/triton/sparse.py): the same candidate scan and the draw hashed on the
device; the rest is torch on the device. The same wire, decoding, residual and aggregate
bit for bit on every path (tests/test_kernels_sparse.py, tests/test_kernels_triton.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..kernels import sparse as sparse_kernels
from ..validation import is_real, require
from . import _util
from ._util import largest, magnitude_keys, scatter_mean
from .base import Compressor, Implementation, OnImplementation, Packet, deliver, index_dtype, keep_count, wire_indices
from .registry import register


#: Largest ``in`` / ``out`` / ``layer`` of ``randblock``: more parts than a tensor can have
#: entries (fewer than 2**31, see above) change nothing, and the draws need int64 bounds.
MAX_PARTS = 2**31


def check_ratio(codec: str, ratio) -> None:
    require(is_real(ratio) and 0 < ratio <= 1, codec, f"ratio must be in (0, 1], got {ratio!r}")


def sum_dtype_of(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def topk_indices(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (ascending, int64) of the k entries of largest magnitude of a flat tensor, a tie
    going to the smaller index (:func:`._util.largest` of :func:`._util.magnitude_keys`).

    For a large tensor and small k, a selection over everything is slow; a threshold read
    off a strided 1/64 sample (with a margin) first keeps about 1.25k candidates (piece by
    piece where ``_util.piecewise``), and the selection runs on those (ties at the k-th
    magnitude are all candidates, so the answer is the same). If fewer than k pass (an
    unlucky sample) it falls back to all entries, so the result is always exact (NaN
    entries aside, which the threshold drops).
    """
    return _topk_select(flat, k)[0]


def _topk_select(flat: torch.Tensor, k: int, scan=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(indices, values)``: :func:`topk_indices`. ``scan`` (the fused paths):
    ``scan(threshold, expect) -> (indices, values)`` of the candidates, indices ascending
    (:func:`kernels.sparse.scan`); then the values of the selected entries come from the
    candidates' (no gather from ``flat``), else None."""
    numel = flat.numel()
    if numel < (1 << 15) or 8 * k > numel:
        return largest(magnitude_keys(flat), k), None
    sample = torch.abs(flat[::64])
    expect = k * sample.numel() / numel
    rank = min(sample.numel(), int(1.25 * expect + 3 * math.sqrt(expect)) + 8)
    threshold = torch.topk(sample, rank, sorted=False).values.min()
    if scan is None:
        candidates, found = _util.above_threshold(flat, threshold), None
    else:
        candidates, found = scan(threshold, 2 * k)
    if candidates.numel() < k:
        return largest(magnitude_keys(flat), k), None
    picked = flat.index_select(0, candidates) if found is None else found
    best = largest(magnitude_keys(picked), k)
    return candidates.index_select(0, best), None if found is None else found.index_select(0, best)


def scatter_decode(packet: Packet, out: torch.Tensor | None, added: bool) -> torch.Tensor:
    """The dense tensor of a (values, indices) packet: zeros with the values placed at their
    indices, each written once (``added=False``: top-k) or summed where indices repeat
    (``added=True``: DGC's padding). The torch reference."""
    values, indices = packet.wire["values"], wire_indices(packet)
    dense = torch.zeros(packet.numel, dtype=packet.dtype, device=values.device)
    scatter = dense.index_add_ if added else dense.index_copy_
    return deliver(scatter(0, indices.long(), values.to(packet.dtype)).view(packet.shape), out)


def place_decode(packet: Packet, out: torch.Tensor | None, indices: torch.Tensor, added: bool) -> bool:
    """:func:`scatter_decode` (``indices``: the packet's, int32) straight into ``out`` by the
    numba kernel; False where it does not take them (the caller runs the reference)."""
    values = packet.wire["values"]
    return (out is not None and sparse_kernels.supported(out) and out.dtype == packet.dtype == values.dtype
            and out.shape == packet.shape and out.is_contiguous()
            and indices.is_contiguous() and values.is_contiguous()
            and sparse_kernels.place(out.view(-1), indices, values, added=added))


def fits_out(out: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether a fused kernel can write ``tensor``'s residual or decoding into ``out``."""
    return out.shape == tensor.shape and out.dtype == tensor.dtype and out.is_contiguous()


def fused_scatter_mean(packets: Sequence[Packet], items) -> torch.Tensor | None:
    """``_util.scatter_mean`` in one numba kernel (zero, add every packet in rank order,
    divide), or None where the kernels do not take the packets (the caller runs the reference)."""
    first = packets[0]
    pairs = [items(p) for p in packets]
    if not (first.dtype in sparse_kernels.DTYPES and all(i.dtype in (torch.int32, torch.int64) for i, _ in pairs)):
        return None
    idx = torch.cat([i.reshape(-1) for i, _ in pairs]).to(torch.int32)
    vals = torch.cat([v.reshape(-1).to(torch.float32) for _, v in pairs])
    total = torch.empty(first.numel, dtype=torch.float32)
    if not sparse_kernels.mean_of(total, idx, vals, len(packets)):
        return None
    return total.to(first.dtype).view(first.shape)


class SparseNumba:
    """Mixin of a sparsifier's numba implementation: decode and aggregate of (values, indices)
    packets by :mod:`gradzip.kernels.sparse` (``ADDED``: decoding adds repeated indices)."""

    ADDED = False

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        if place_decode(packet, out, wire_indices(packet), self.ADDED):
            return out
        return super().decompress(packet, out)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        """One dense buffer, every packet's values index-added, divided by n."""
        fused = fused_scatter_mean(packets, lambda p: (wire_indices(p), p.wire["values"]))
        return super().aggregate(packets) if fused is None else fused


class TopKReference(Implementation):
    """topk in torch code: the reference every kernel backend is tested bit-identical to."""

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        flat = tensor.detach().reshape(-1)
        k = min(keep_count(self.codec.ratio, flat.numel()), flat.numel())
        idx = topk_indices(flat, k)
        wire = {"values": flat.index_select(0, idx), "indices": idx.to(index_dtype(flat.numel()))}
        return Packet(wire, tensor.shape, tensor.dtype)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        return scatter_decode(packet, out, added=False)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        """One dense buffer, every packet's values index-added, divided by n."""
        return scatter_mean(packets, lambda p: (wire_indices(p), p.wire["values"]), packets[0].numel)


class Scans:
    """Mixin of a sparsifier's kernel implementation: its candidate pass (``scan``, one pass over
    the tensor that also copies it into the residual when asked) and the fix of the residual
    at the sent entries (``fix_residual``)."""

    #: Input dtypes the scan takes (others: the reference).
    DTYPES = sparse_kernels.DTYPES

    def scan(self, flat, threshold, residual, expect):
        raise NotImplementedError

    def fix_residual(self, residual: torch.Tensor, flat: torch.Tensor, idx: torch.Tensor, added: bool) -> None:
        """``residual[i] = x[i] − d[i]`` at the sent ``idx``, the decoded ``d`` being ``x``
        (``index_copy_``) or ``0 + x`` (``added``: ``index_add_`` into zeros); elsewhere
        ``residual`` already holds ``x − 0 = x``."""
        raise NotImplementedError


class NumbaScans(Scans):
    """:class:`Scans` by the numba kernels of :mod:`gradzip.kernels.sparse`."""

    def scan(self, flat, threshold, residual, expect):
        return sparse_kernels.scan(flat, threshold, residual, expect)

    def fix_residual(self, residual, flat, idx, added) -> None:
        sparse_kernels.fix_residual(residual, flat, idx.to(torch.int32), added=added)


class TritonScans(Scans):
    """:class:`Scans` by the Triton kernel of :mod:`gradzip.kernels.triton.sparse` (the fix:
    torch at the k sent entries, the reference's own operations)."""

    kernel_modules = ("sparse",)

    def scan(self, flat, threshold, residual, expect):
        return self.sparse.scan(flat, threshold, residual, expect)

    def fix_residual(self, residual, flat, idx, added) -> None:
        sent = flat.index_select(0, idx)
        decoded = torch.zeros_like(sent).add_(sent) if added else sent
        residual.index_copy_(0, idx, sent - decoded)


class TopKScanned(TopKReference):
    """topk with its candidate pass by a kernel (:class:`Scans`, float32 and 16-bit inputs):
    one pass over the tensor, the residual copied in it and fixed at the k sent entries."""

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        if tensor.dtype not in self.DTYPES:
            return super().compress(tensor, seed, reuse)
        return self._compress_fused(tensor, reuse, None)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        """One pass over ``tensor`` (fused): the candidate scan copies it into ``out``, then
        the selected entries of ``out`` get ``x − x``."""
        if not (tensor.dtype in self.DTYPES and fits_out(out, tensor)):
            return super().compress_residual(tensor, seed, out, reuse)
        return self._compress_fused(tensor, reuse, out.view(-1))

    def _compress_fused(self, tensor: torch.Tensor, reuse: Packet | None, residual: torch.Tensor | None) -> Packet:
        flat = tensor.detach().reshape(-1).contiguous()
        k = min(keep_count(self.codec.ratio, flat.numel()), flat.numel())
        copied = []

        def scan(threshold, expect):
            copied.append(residual is not None)
            return self.scan(flat, threshold, residual if len(copied) == 1 else None, expect)

        idx, values = _topk_select(flat, k, scan)
        wire_values = _util.wire_buffer(reuse, "values", k, flat.dtype, flat.device)
        wire_idx = _util.wire_buffer(reuse, "indices", k, index_dtype(flat.numel()), flat.device)
        if values is None:
            torch.index_select(flat, 0, idx, out=wire_values)
        else:
            wire_values.copy_(values)
        wire_idx.copy_(idx)
        if residual is not None:
            if not copied:
                residual.copy_(flat)
            self.fix_residual(residual, flat, idx, added=False)
        return Packet({"values": wire_values, "indices": wire_idx}, tensor.shape, tensor.dtype)


class TopKNumba(SparseNumba, NumbaScans, TopKScanned):
    """topk on the CPU (float32, float16, bfloat16): the candidate scan, the residual, the
    decode and the aggregate by :mod:`gradzip.kernels.sparse`."""


class TopKTriton(TritonScans, TopKScanned):
    """topk on CUDA (float32, float16, bfloat16): the candidate scan by Triton; the selection
    among the candidates, the decode and the mean of n packets by torch on the device."""


@register
@dataclass(frozen=True)
class TopK(OnImplementation, Compressor):
    name = "topk"
    ratio: float = 0.01
    implementations = {"torch": TopKReference, "numba": TopKNumba, "triton": TopKTriton}

    def __post_init__(self):
        check_ratio("topk", self.ratio)
