"""``dgc``: Deep Gradient Compression's top-k by a sampled threshold (Lin et al., ICLR 2018).

``dgc:ratio=ρ,sample_ratio=s`` (defaults ρ = 0.001, s = 0.01; docs/algorithms.md
§codec: dgc and §DGC). Instead of an exact ``torch.topk`` over the whole tensor, the threshold is
read off a strided sample (stride ``⌈1/s⌉``, random start), then refined until the
number of entries at or above it lands in ``[0.8k, 1.3k]`` (``k = max(1, ⌈ρd⌉)``), as the
reference code (synxlin/deep-gradient-compression) does with its ``compress_lower_bound``
/ ``compress_upper_bound``. **[choice]** How it refines, so that the common case is one
pass over the tensor: the first threshold is the sample's magnitude at the rank that
should select about ``1.5k`` entries (the sample's ``⌈1.5·ρ·sample⌉``-th largest), and the
pass collects the candidates (indices and magnitudes) at or above it. Too few (under
``0.8k``, an unlucky sample): the threshold moves down the sorted sample to the rank the
count calls for (×0.8 beyond the sample) and the pass is repeated. Too many (over
``1.3k``): the threshold is raised among the candidates alone, to their ``1.05k``-th
largest magnitude, without touching the tensor again. (The reference instead multiplies
the threshold by 1.3 or 0.8 and re-scans the whole tensor each time.) After
:data:`MAX_REFINE` rounds, with ties that no threshold separates, or for a tensor too
small to sample (fewer than :data:`MIN_SAMPLE` sampled entries, or ``k > d/4``), the exact
top-k is used instead. So the selection always holds between ``0.8k`` and ``1.3k`` entries
before the codec trims it to ``k``.

Wire: exactly ``k`` float values + ``k`` indices in ``topk``'s index dtype (the narrowest
integer that holds ``d − 1``: ``5k``, ``6k`` or ``8k`` bytes for float32, as ``topk``; the
same on every worker so packets go through allgather without a size exchange). When
more than ``k`` entries pass, the ``k`` largest of those candidates are kept (an exact
top-k over at most ``1.3k`` values, as the reference does); when fewer pass, the slots
left over are padding: index of the first selected entry, value 0, which adds nothing
(decoding scatter-*adds*). ``packet.meta["selected"]`` is the number of real entries
(the achieved density is ``selected / d``); :func:`selected_indices` returns them, which
is what DGC's momentum factor masking zeroes.

Fused path (as ``topk``'s, compressors/sparsify.py): every candidate pass is the numba
scan of gradzip/kernels/sparse.py, the first one also copying the tensor into the
residual of ``compress_residual``; the refinement, trimming and padding are the same torch
code on the (small) candidate set, so the wire is the reference's bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..validation import is_real, require
from . import _util
from ._util import generator, largest, magnitude_keys, scatter_mean
from .base import Compressor, Implementation, OnImplementation, Packet, index_dtype, keep_count, wire_indices
from .sparsify import NumbaScans, SparseNumba, TritonScans, fits_out, scatter_decode
from .registry import register

#: Refinement rounds of the sampled threshold before falling back to the exact top-k.
MAX_REFINE = 20
#: The achieved selection must land in [LOWER·k, UPPER·k] before truncation to k.
LOWER, UPPER = 0.8, 1.3
#: Below this many sampled entries the sample says too little: exact top-k instead.
MIN_SAMPLE = 64
#: The first threshold aims at AIM·k entries: more than 1.3k are trimmed among the
#: candidates without another pass over the tensor, fewer than 0.8k need another pass.
AIM = 1.5


def _candidates(flat: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, magnitudes) of the entries with ``|x| >= threshold`` (one pass)."""
    idx = _util.above_threshold(flat, threshold)
    return idx, torch.abs(flat.index_select(0, idx))


def sampled_threshold_select(flat: torch.Tensor, k: int, sample_ratio: float, seed: int = 0,
                             stats: dict | None = None) -> torch.Tensor:
    """Indices (int64, unordered) of between ``0.8k`` and ``1.3k`` entries of ``flat`` of
    largest magnitude, selected by a threshold estimated on a strided sample and refined
    (see the module docstring). ``stats`` (optional) receives ``passes`` (full passes over
    the tensor), ``rounds`` (refinements) and ``exact`` (the fallback was used)."""
    return _select(flat, k, sample_ratio, seed, stats)[0]


def _select(flat: torch.Tensor, k: int, sample_ratio: float, seed: int = 0, stats: dict | None = None,
            scan=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(indices, values)``: :func:`sampled_threshold_select`. ``scan`` (the fused path):
    ``scan(threshold, expect) -> (indices, values)`` of the candidates
    (:func:`kernels.sparse.scan`, int32 indices in its scratch); the values of the selection
    then come with it (None on the exact path and without ``scan``)."""
    numel = flat.numel()
    # capped at numel + 1 (a sample of at most one entry: the exact path either way), so a
    # tiny sample_ratio (1/s beyond int64, or inf) cannot overflow randint
    stride = max(1, math.ceil(min(1.0 / sample_ratio, numel + 1)))
    start = int(torch.randint(stride, (1,), generator=generator(seed))) if stride > 1 else 0
    sample = torch.abs(flat[start::stride])
    lo_count, hi_count = math.ceil(LOWER * k), math.floor(UPPER * k)
    passes = rounds = 0
    raw = None

    def candidates(threshold: float):
        nonlocal raw
        if scan is None:
            return _candidates(flat, threshold)
        idx, raw = scan(threshold, 2 * k)
        return idx, torch.abs(raw)

    exact = sample.numel() < MIN_SAMPLE or k >= numel or 4 * k > numel
    if not exact:
        # the sample's largest magnitudes, sorted: the threshold at sample rank j selects
        # about j·numel/sample entries; aim at AIM·k (too many is cheap to fix, too few is not)
        top = sample.numel() * k / numel
        ranked = torch.topk(sample, min(sample.numel(), math.ceil(4 * AIM * top) + 16), sorted=True).values
        j = max(1, min(ranked.numel(), math.ceil(AIM * top)))
        threshold = float(ranked[j - 1])
        idx, vals = candidates(threshold)
        passes = 1
        while idx.numel() < lo_count:   # too few: a lower threshold, another pass
            rounds += 1
            if rounds > MAX_REFINE or threshold <= 0 or not math.isfinite(threshold):
                exact = True
                break
            j_new = max(j + 1, round(j * AIM * k / max(idx.numel(), 1)))
            if j_new <= ranked.numel():
                j, lower = j_new, float(ranked[j_new - 1])
            else:
                lower = threshold * LOWER
            threshold = min(lower, threshold * (1 - 1e-6))
            idx, vals = candidates(threshold)
            passes += 1
        if not exact and idx.numel() > hi_count:   # too many: raise it among the candidates
            rounds += 1
            threshold = float(torch.topk(vals, round(1.05 * k), sorted=False).values.min())
            keep = vals >= threshold
            idx = idx[keep]
            raw = raw[keep] if raw is not None else None
            exact = idx.numel() > hi_count   # ties at the threshold
    if stats is not None:
        stats.update(passes=passes, rounds=rounds, exact=exact)
    if exact:
        return largest(magnitude_keys(flat), min(k, numel)), None
    return idx, raw


class DGCReference(Implementation):
    """dgc in torch code: the reference every kernel backend is tested bit-identical to."""

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        flat = tensor.detach().reshape(-1)
        numel = flat.numel()
        k = min(keep_count(self.codec.ratio, numel), numel)
        idx = sampled_threshold_select(flat, k, self.codec.sample_ratio, seed)
        if idx.numel() > k:   # keep the k largest candidates (in index order: ties to the smaller)
            idx = idx.index_select(0, largest(magnitude_keys(flat.index_select(0, idx)), k))
        selected = idx.numel()
        values = flat.index_select(0, idx)
        if selected < k:      # pad: index of a selected entry, value 0 (adds nothing)
            pad = k - selected
            idx = torch.cat([idx, idx[:1].expand(pad) if selected else idx.new_zeros(pad)])
            values = torch.cat([values, values.new_zeros(pad)])
        wire = {"values": values, "indices": idx.to(index_dtype(numel))}
        return Packet(wire, tensor.shape, tensor.dtype, meta={"selected": selected})

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        return scatter_decode(packet, out, added=True)   # padding repeats an index with value 0

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        """One dense buffer, every packet's values index-added, divided by n."""
        return scatter_mean(packets, lambda p: (wire_indices(p), p.wire["values"]), packets[0].numel)


class DGCScanned(DGCReference):
    """dgc with its candidate passes by a kernel (:class:`.sparsify.Scans`, float32 and 16-bit
    inputs), the first also copying the tensor into the residual; the refinement, trimming and
    padding are the reference's torch code on the (small) candidate set."""

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        if tensor.dtype not in self.DTYPES:
            return super().compress(tensor, seed, reuse)
        return self._compress_fused(tensor, seed, reuse, None)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        """One pass over ``tensor`` (fused): the first candidate scan copies it into ``out``,
        then the selected entries of ``out`` get ``x − (0 + x)``."""
        if not (tensor.dtype in self.DTYPES and fits_out(out, tensor)):
            return super().compress_residual(tensor, seed, out, reuse)
        return self._compress_fused(tensor, seed, reuse, out.view(-1))

    def _compress_fused(self, tensor: torch.Tensor, seed: int, reuse: Packet | None,
                        residual: torch.Tensor | None) -> Packet:
        flat = tensor.detach().reshape(-1).contiguous()
        numel = flat.numel()
        k = min(keep_count(self.codec.ratio, numel), numel)
        copied = []

        def scan(threshold, expect):
            copied.append(residual is not None)
            return self.scan(flat, threshold, residual if len(copied) == 1 else None, expect)

        idx, values = _select(flat, k, self.codec.sample_ratio, seed, scan=scan)
        if idx.numel() > k:   # keep the k largest candidates (in index order: ties to the smaller)
            picked = flat.index_select(0, idx) if values is None else values
            best = largest(magnitude_keys(picked), k)
            idx = idx.index_select(0, best)
            values = None if values is None else values.index_select(0, best)
        selected = idx.numel()
        wire_values = _util.wire_buffer(reuse, "values", k, flat.dtype, flat.device)
        wire_idx = _util.wire_buffer(reuse, "indices", k, index_dtype(numel), flat.device)
        if values is None:
            torch.index_select(flat, 0, idx, out=wire_values[:selected])
        else:
            wire_values[:selected].copy_(values)
        wire_idx[:selected].copy_(idx)
        if selected < k:      # pad: index of a selected entry, value 0 (adds nothing)
            wire_idx[selected:].fill_(int(idx[0]) if selected else 0)
            wire_values[selected:].zero_()
        if residual is not None:
            if not copied:
                residual.copy_(flat)
            self.fix_residual(residual, flat, idx, added=True)
        return Packet({"values": wire_values, "indices": wire_idx}, tensor.shape, tensor.dtype,
                      meta={"selected": selected})





class DGCNumba(SparseNumba, NumbaScans, DGCScanned):
    """dgc on the CPU: every candidate pass by the numba scan, the decode and the aggregate by
    :mod:`gradzip.kernels.sparse`."""

    ADDED = True


class DGCTriton(TritonScans, DGCScanned):
    """dgc on CUDA: every candidate pass by the Triton scan; the rest torch on the device."""


@register
@dataclass(frozen=True)
class DGCCompressor(OnImplementation, Compressor):
    name = "dgc"
    ratio: float = 0.001
    sample_ratio: float = 0.01
    implementations = {"torch": DGCReference, "numba": DGCNumba, "triton": DGCTriton}

    def __post_init__(self):
        for key in ("ratio", "sample_ratio"):
            value = getattr(self, key)
            require(is_real(value) and 0 < value <= 1, "dgc", f"{key} must be in (0, 1], got {value!r}")

    def wire_nbytes(self, shape) -> int:
        numel = math.prod(shape)
        return (4 + index_dtype(numel).itemsize) * min(keep_count(self.ratio, numel), numel)


def selected_indices(packet: Packet) -> torch.Tensor:
    """The int64 indices of the entries a ``dgc`` packet really selected (no padding)."""
    return packet.wire["indices"][: packet.meta["selected"]].long()
