"""Triton kernel of ``1bit``'s encode (docs/algorithms.md §codec: 1bit): the lane sums of the
column means in their defined order, the non-negative counts and (where a line is whole
bytes) the bits in one pass (the decode, the residual and the mean of n packets: :mod:`.mean`).

The lanes (``gradzip.compressors.onebit.lane_sums``): program ``(b, t)`` owns lanes ``t·T ...``
of block ``b`` and adds, line by line in order, each line's clamped entries (rounded to
float32) into float32 lanes from 0.0; the pairwise fold to the columns and the addition of
the blocks run in torch on the lanes (``onebit.fold_lanes``, the reference's own code).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quantize import LINES, lane_width
from .launch import run, store_packed, widen16

#: Lanes per program of the lane sums.
TILE = 1024
_LINES = tl.constexpr(LINES)


@triton.jit(do_not_specialize=["n", "width", "nblocks"])
def _lanes(x_ptr, lanes_ptr, counts_ptr, packed_ptr, n, width, nblocks, PACK: tl.constexpr, TILE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    lane = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    used = lane < width
    pos = tl.zeros((TILE,), tl.float32)
    neg = tl.zeros((TILE,), tl.float32)
    count = tl.zeros((TILE,), tl.int32)
    lines = tl.minimum(_LINES, tl.cdiv(n - b * _LINES * width, width))   # lines past the end add nothing: skipped
    for r in range(lines):
        offs = (b * _LINES + r) * width + lane
        inside = used & (offs < n)
        v = widen16(tl.load(x_ptr + offs, mask=inside, other=0))
        ge = (v >= 0) & inside
        f = v.to(tl.float32)
        pos = pos + tl.where(f < 0, 0.0, f)   # clamp(v, min=0): NaN stays NaN
        neg = neg + tl.where(f > 0, 0.0, f)   # clamp(v, max=0)
        count += ge.to(tl.int32)
        if PACK:   # a line is whole bytes: its bits straight from here
            store_packed(packed_ptr, ge.to(tl.int32), (b * _LINES + r) * width // 8 + tl.program_id(1) * (TILE // 8),
                         tl.minimum((n + 7) // 8, ((b * _LINES + r) * width + width) // 8), 1, TILE // 8)
    tl.store(lanes_ptr + b * width + lane, pos, mask=used)
    tl.store(lanes_ptr + (nblocks + b) * width + lane, neg, mask=used)
    tl.atomic_add(counts_ptr + lane, count, mask=used)


def lanes(v: torch.Tensor, cols: int, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(lane sums ``(2, blocks, w)`` float32, non-negative count per lane (int32, ``w``), whether
    the bits of ``v >= 0`` were packed into ``packed`` in the same pass) of the flat contiguous
    ``v`` of ``cols`` columns (``cols >= 1``)."""
    width = lane_width(cols)
    nblocks = max(1, triton.cdiv(triton.cdiv(v.numel(), width), LINES))
    sums = torch.empty(2, nblocks, width, dtype=torch.float32, device=v.device)
    counts = torch.zeros(width, dtype=torch.int32, device=v.device)
    pack = width % 8 == 0
    run(_lanes, (nblocks, triton.cdiv(width, TILE)), v, sums, counts, packed, v.numel(), width, nblocks,
        PACK=pack, TILE=TILE)
    return sums, counts, pack
