"""Launching the Triton kernels, their buffers, and the packing of b-bit codes that several
codec families share (:mod:`gradzip.compressors.bitpack`'s layout: a big-endian bit stream,
the first code in the top bits of the first byte, a last partial byte padded with 0)."""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .. import decode_target, reused

#: Entries per program of the elementwise kernels.
BLOCK = 1024
#: Packets per launch of the n-packet aggregates (a tuple argument: one compiled kernel per
#: count up to this; more packets take several launches, the partial sum kept in the output).
MAX_PACKETS = 8


def run(kernel, grid, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)`` with multiply-add contraction off (the spec's float
    operations one at a time, as the interpreter and torch compute them). Every kernel marks
    its sizes ``do_not_specialize``: one compiled variant per dtype and constexprs, not one
    per size class."""
    kernel[grid](*args, enable_fp_fusion=False, **meta)


def blocks(n: int, block: int = BLOCK) -> tuple[int]:
    """The 1-d grid covering ``n`` entries (one program for an empty tensor: its writes masked)."""
    return (max(1, triton.cdiv(n, block)),)


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, contiguous (a copy only when it is not) and flat."""
    return tensor.detach().contiguous().reshape(-1)


def wire_buffer(reuse, name: str, numel: int, device: torch.device, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """The ``name`` wire tensor of the ``reuse`` packet where it fits, else a new one."""
    return reused(None if reuse is None else reuse.wire.get(name), numel, dtype, device)


def target(out: torch.Tensor | None, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where a kernel writes a tensor the caller asked into ``out``: ``out`` itself where it is
    contiguous and fits, else a new one (:func:`finish` then copies)."""
    return decode_target(out, torch.Size(shape), dtype, device)


def finish(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``result``, copied into ``out`` where the kernel could not write there itself."""
    if out is None or result is out:
        return result
    if out.shape != result.shape or out.dtype != result.dtype:
        raise ValueError(f"needs a {result.dtype} tensor of shape {tuple(result.shape)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    return out.copy_(result)


def over_packets(kernel, n: int, columns: Sequence[Sequence[torch.Tensor]], *args, **meta) -> None:
    """Launch an n-packet kernel over ``n`` entries, the packets in chunks of at most
    :data:`MAX_PACKETS`: per chunk, one tuple per column of ``columns`` (each a per-packet
    list: wires, scales, ...), then ``args``; ``NP`` (the chunk's packets), ``FIRST``, ``LAST``
    (its place: the partial result stays in the kernel's output between chunks) and
    ``BLOCK`` as constexprs."""
    count = len(columns[0])
    for start in range(0, count, MAX_PACKETS):
        chunk = [tuple(column[start:start + MAX_PACKETS]) for column in columns]
        run(kernel, blocks(n), *chunk, *args, NP=len(chunk[0]), FIRST=start == 0,
            LAST=start + MAX_PACKETS >= count, BLOCK=BLOCK, **meta)


@triton.jit
def pack(codes, BITS: tl.constexpr, GROUPS: tl.constexpr):
    """``GROUPS·8`` codes (int32 or int64, each < 2**BITS, flat) as ``(GROUPS, BITS)`` bytes
    (int64): each group of eight codes merged into one ``8·BITS``-bit word, first code on
    top, then its big-endian bytes. Integer sums of disjoint bits: exact in any order."""
    c2 = tl.reshape(codes.to(tl.int64), (GROUPS, 8))
    shifts = ((7 - tl.arange(0, 8)) * BITS).to(tl.int64)
    word = tl.sum(c2 << shifts[None, :], axis=1)
    byte = (tl.arange(0, 8)).to(tl.int64)
    shift = tl.where(byte < BITS, (BITS - 1 - byte) * 8, 0)   # bytes past BITS: not stored
    return (word[:, None] >> shift[None, :]) & 0xFF


@triton.jit
def store_packed(packed_ptr, codes, group0, nbytes, BITS: tl.constexpr, GROUPS: tl.constexpr):
    """Write the bytes of ``codes`` (``GROUPS`` groups of eight, the first group the stream's
    ``group0``-th) into ``packed_ptr``, the bytes at or past ``nbytes`` not written."""
    out = pack(codes, BITS, GROUPS)
    col = tl.arange(0, 8)
    at = (group0 + tl.arange(0, GROUPS)).to(tl.int64)[:, None] * BITS + col[None, :]
    tl.store(packed_ptr + at, out.to(tl.uint8), mask=(col[None, :] < BITS) & (at < nbytes))


@triton.jit
def load_codes(packed_ptr, offs, nbytes, BITS: tl.constexpr):
    """The ``BITS``-bit codes of the entries ``offs`` (int64) of a packed stream (int32): the
    bytes holding each code read (a code never straddles bytes for BITS in 1, 2, 4, 8;
    other widths read the two bytes around it), bytes past ``nbytes`` as 0."""
    bit = offs * BITS
    first = bit // 8
    hi = tl.load(packed_ptr + first, mask=first < nbytes, other=0).to(tl.int32)
    if 8 % BITS == 0:
        return (hi >> (8 - BITS - (bit % 8)).to(tl.int32)) & ((1 << BITS) - 1)
    lo = tl.load(packed_ptr + first + 1, mask=first + 1 < nbytes, other=0).to(tl.int32)
    pair = (hi << 8) | lo
    return (pair >> (16 - BITS - (bit % 8)).to(tl.int32)) & ((1 << BITS) - 1)


@triton.jit
def widen16(v):
    """A 16-bit float tensor exactly widened to float32 (compares and differences of 16-bit
    floats are done so: torch computes 16-bit arithmetic in float32 and rounds once, and
    the interpreter has no bfloat16 arithmetic); other dtypes as they are."""
    if v.dtype == tl.bfloat16:   # through its bits (the interpreter flushes bfloat16 subnormals)
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    if v.dtype.primitive_bitwidth == 16:
        return v.to(tl.float32)
    return v


@triton.jit
def narrow(v, dtype: tl.constexpr):
    """``v`` (float32 for a 16-bit ``dtype``) rounded to ``dtype``, to nearest even: bfloat16
    through its bits (``(b + 0x7FFF + lsb) >> 16``, a NaN to the quiet NaN), since the
    interpreter truncates a float32 to bfloat16; other dtypes by ``.to``."""
    if dtype == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(v != v, (b >> 16) | 0x40, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return v.to(dtype)
