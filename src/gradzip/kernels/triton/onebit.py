"""Triton kernels of ``1bit`` (docs/algorithms.md §codec: 1bit): the lane sums of the column
means in their defined order, the non-negative counts and (where a line is whole bytes) the
bits in one pass; the decode, the residual and the mean of n packets in one pass.

The lanes (``gradzip.compressors.onebit.lane_sums``): program ``(b, t)`` owns lanes ``t·T ...``
of block ``b`` and adds, line by line in order, each line's clamped entries (rounded to
float32) into float32 lanes from 0.0; the pairwise fold to the columns and the addition of
the blocks run in torch on the lanes (``onebit.fold_lanes``, the reference's own code).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from ..quantize import LINES, lane_width
from .launch import BLOCK, blocks, chunks, finish, load_codes, run, store_packed, target, widen16

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


@triton.jit(do_not_specialize=["n", "nbytes", "cols"])
def _decode(ptrs, means, out_ptr, x_ptr, count_ptr, n, nbytes, cols, NP: tl.constexpr, MODE: tl.constexpr,
            FIRST: tl.constexpr, LAST: tl.constexpr, BLOCK: tl.constexpr):
    """Entry j of packet i decodes to its column's non-negative mean where its bit is 1, else
    the negative mean (``means[i]``: ``(2, cols)`` float32). MODE 0: the decoded packets added
    in worker order (the first not added to anything), divided by the count on the last
    chunk when more than one; 1: ``x − decoded`` (one packet)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    col = offs % cols
    if not FIRST:
        acc = tl.load(out_ptr + offs, mask=inside, other=0.0)
    for i in tl.static_range(NP):
        p = tl.load(means[i] + col, mask=inside, other=0.0)
        q = tl.load(means[i] + cols + col, mask=inside, other=0.0)
        d = tl.where(load_codes(ptrs[i], offs, nbytes, 1) == 1, p, q)
        if FIRST and i == 0:
            acc = d
        else:
            acc = acc + d
    if MODE == 1:
        acc = tl.load(x_ptr + offs, mask=inside, other=0.0) - acc
    elif LAST:
        acc = tl.math.div_rn(acc, tl.load(count_ptr))
    tl.store(out_ptr + offs, acc, mask=inside)


def decode(wires: Sequence[torch.Tensor], means: Sequence[torch.Tensor], shape, cols: int,
           out: torch.Tensor | None = None, x: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of the decoded float32 packets (their bits and ``(2, cols)`` float32 means; one
    packet: its decode, not divided); with ``x`` (one packet, flat contiguous float32): ``x −``
    its decode. Into ``out`` where it fits."""
    device = wires[0].device
    result = target(out, shape, torch.float32, device)
    n = result.numel()
    count = torch.tensor([len(wires)], dtype=torch.float32, device=device)
    pairs = [(w.contiguous(), m.contiguous()) for w, m in zip(wires, means)]
    for first, last, chunk in chunks(pairs):
        run(_decode, blocks(n), tuple(w for w, _ in chunk), tuple(m for _, m in chunk), result,
            result if x is None else x, count, n, pairs[0][0].numel(), max(cols, 1), NP=len(chunk),
            MODE=0 if x is None else 1, FIRST=first, LAST=last and len(pairs) > 1, BLOCK=BLOCK)
    return finish(result, out)
