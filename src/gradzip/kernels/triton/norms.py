"""Triton kernels of the ordered float sums of the codecs, and the exact ``max |v|``.

* ``‖v‖₁`` (``scaled_sign``) and ``Σ v²`` (``qsgd``'s norm) in the order docs/algorithms.md
  §codec: sign, scaled_sign defines: blocks of :data:`ROWS` rows of :data:`LANES` entries,
  float64 lanes each adding its row's entries in row order from 0.0, then folded pairwise
  (lane k + lane k + 512, then + 256, ..., + 1; each pair by ``tl.split``: two operands, no
  order left to a compiler); the block sums again the same way until one is left. One
  program per block. :func:`sign_l1` also packs the sign bits of the rows it reads: one pass.
* ``max |v|`` (``terngrad``'s scale): the integer maximum of the float32 bit patterns
  ``bits & 0x7FFFFFFF`` (exact in any order, NaN above +inf), by ``tl.max`` and an atomic max.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..elementwise import BLOCK as LANES, ROWS
from .launch import run, store_packed, widen16

#: Entries of a block of the ordered sums.
SPAN = LANES * ROWS
_LANES = tl.constexpr(LANES)
_ROWS = tl.constexpr(ROWS)
_STEPS = tl.constexpr(LANES.bit_length() - 1)

#: What the last fold writes beside the float64 sum: nothing, ``float32(sum / d)`` (the ℓ1
#: scale) or ``float32(sqrt(sum))`` (qsgd's ‖v‖₂).
NONE, MEAN, ROOT = 0, 1, 2


@triton.jit
def fold(acc, STEPS: tl.constexpr):
    """``acc`` (``2**STEPS`` lanes) added pairwise down to one lane: lane k + lane k + half,
    then the same on the low half, ...; each addition of two operands by ``tl.split``."""
    for _ in tl.static_range(STEPS):
        half: tl.constexpr = acc.shape[0] // 2
        low, high = tl.split(tl.permute(tl.reshape(acc, (2, half)), (1, 0)))
        acc = low + high
    return tl.sum(acc, 0)   # one lane left: its value


@triton.jit(do_not_specialize=["n", "d"])
def _block_sums(x_ptr, partials_ptr, packed_ptr, final_ptr, n, d, SQUARE: tl.constexpr, PACK: tl.constexpr,
                FINAL: tl.constexpr):
    """``partials[b]`` = block b's sum of ``|v|`` (or ``v·v``, rounded in the input's dtype);
    ``PACK``: the bits ``v >= 0`` of its rows into ``packed``; ``FINAL`` (a one-program
    launch): also ``final[0]`` (:data:`MEAN` or :data:`ROOT` of the sum, float32)."""
    b = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, _LANES)
    acc = tl.zeros((_LANES,), tl.float64)
    rows = tl.minimum(_ROWS, tl.cdiv(n - b * _ROWS * _LANES, _LANES))   # rows past the end add +0.0: skipped
    for r in range(rows):
        offs = (b * _ROWS + r) * _LANES + lanes
        inside = offs < n
        v = widen16(tl.load(x_ptr + offs, mask=inside, other=0))   # |v| of a 16-bit v: exact in float32
        if SQUARE:
            w = v * v
        else:
            w = tl.abs(v)
        acc = acc + w.to(tl.float64)
        if PACK:
            store_packed(packed_ptr, tl.where(inside, (v >= 0).to(tl.int32), 0), (b * _ROWS + r) * (_LANES // 8),
                         (n + 7) // 8, 1, _LANES // 8)
    total = fold(acc, _STEPS)
    tl.store(partials_ptr + b, total)
    if FINAL == 1:
        tl.store(final_ptr, (total / d.to(tl.float64)).to(tl.float32))
    if FINAL == 2:
        tl.store(final_ptr, tl.sqrt(total).to(tl.float32))


def ordered_sum(x: torch.Tensor, square: bool = False, final: int = NONE, out: torch.Tensor | None = None,
                packed: torch.Tensor | None = None) -> torch.Tensor:
    """The ordered sum (module docstring) of the flat contiguous ``x``: a float64 0-d tensor on
    its device. ``final``: also write ``float32(sum / d)`` (:data:`MEAN`, ``d = max(1, n)``) or
    ``float32(sqrt(sum))`` (:data:`ROOT`) into ``out[0]`` (float32); ``packed``: the sign bits
    of ``x`` packed there in the same pass."""
    n = x.numel()
    level = x
    first = True
    while True:
        count = max(1, triton.cdiv(level.numel(), SPAN))
        partials = torch.empty(count, dtype=torch.float64, device=x.device)
        last = count == 1
        run(_block_sums, (count,), level, partials, packed if first and packed is not None else partials,
            out if last and final else partials, level.numel(), max(n, 1),
            SQUARE=square and first, PACK=first and packed is not None, FINAL=final if last else NONE)
        if last:
            return partials[0]
        level, first = partials, False


@triton.jit(do_not_specialize=["n"])
def _abs_max(x_ptr, top_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(x_ptr + offs, mask=offs < n, other=0) & 0x7FFFFFFF
    tl.atomic_max(top_ptr, tl.max(bits, 0))


def abs_max(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``max_j |x_j|`` of the flat contiguous float32 ``x`` into the 1-entry float32 ``out`` (+0.0
    for an empty or zero tensor, a NaN if ``x`` holds one); returns ``out``."""
    top = out.view(torch.int32).zero_()
    block = 4096
    run(_abs_max, (max(1, triton.cdiv(x.numel(), block)),), x.view(torch.int32), top, x.numel(), BLOCK=block)
    return out
