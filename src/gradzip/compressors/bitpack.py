"""Bit packing for the wire: ``b``-bit codes (``0 <= code < 2**b``, ``b <= 8``) to ``uint8``.

Layout is a big-endian bit stream: the first code occupies the top bits of the first
byte. For ``b = 2`` this is MXNet's 2-bit layout (four codes a byte, first value in the
top two bits). ``ceil(count * b / 8)`` bytes.

Implementation: eight codes (one byte each) are read as one 64-bit word and merged
pairwise in three shift/mask/or rounds into one ``8b``-bit group (the eight codes in
stream order), which is then written out as ``b`` big-endian bytes; unpacking runs the
rounds backwards. Every step is a vectorized integer op over ``count / 8`` words (no
per-bit intermediate tensor), on whatever device the codes live. The word view assumes a
little-endian machine (x86, ARM, every CUDA device); elsewhere a slower per-bit path that
produces the same layout is used.
"""
from __future__ import annotations

import math
import sys

import torch

_LITTLE = sys.byteorder == "little"
_M8 = 0x00FF00FF00FF00FF  # low byte of every 16-bit lane
_M16 = 0x0000FFFF0000FFFF  # low half of every 32-bit lane
_M32 = 0xFFFFFFFF


def packed_nbytes(count: int, bits: int) -> int:
    return math.ceil(count * bits / 8)


def _words(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` (flat uint8) zero-padded to a multiple of 8 and viewed as int64 words."""
    pad = (-codes.numel()) % 8
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    elif codes.storage_offset() % 8:
        codes = codes.clone()
    return codes.view(torch.int64)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a flat integer tensor of ``bits``-bit codes into ``uint8``."""
    assert 1 <= bits <= 8
    codes = codes.reshape(-1).to(torch.uint8)
    count = codes.numel()
    if bits == 8:
        return codes.clone()
    if not _LITTLE:
        return _pack_slow(codes, bits)
    b = bits
    x = _words(codes)  # byte i of a word = code i of its group of eight
    lo = x & _M8  # codes 0, 2, 4, 6
    x = x >> 8
    x &= _M8  # codes 1, 3, 5, 7
    lo <<= b
    lo |= x  # 16-bit lanes: (c0 c1) (c2 c3) ...
    x = lo >> 16
    x &= _M16
    lo &= _M16
    lo <<= 2 * b
    lo |= x  # 32-bit lanes: (c0 c1 c2 c3) (c4 c5 c6 c7)
    x = lo >> 32
    lo &= _M32
    lo <<= 4 * b
    lo |= x  # one 8b-bit group, c0 in the top bits
    if b == 1:
        out = lo.to(torch.uint8)
    else:
        out = torch.empty((lo.numel(), b), dtype=torch.uint8, device=lo.device)
        for j in range(b):  # big-endian bytes of the group (b <= 7 column copies)
            shift = 8 * (b - 1 - j)
            out[:, j] = (lo >> shift) if shift else lo  # int64 -> uint8 keeps the low byte
    return out.reshape(-1)[: packed_nbytes(count, b)]


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` codes, as ``uint8``."""
    assert 1 <= bits <= 8
    packed = packed.reshape(-1)
    if bits == 8:
        return packed[:count].clone()
    if not _LITTLE:
        return _unpack_slow(packed, bits, count)
    b = bits
    groups = math.ceil(count / 8)
    need = groups * b
    if packed.numel() < need:
        packed = torch.cat([packed, packed.new_zeros(need - packed.numel())])
    cols = packed[:need].view(groups, b)
    y = cols[:, 0].to(torch.int64)
    for j in range(1, b):
        y <<= 8
        y |= cols[:, j]
    mb, m2b, m4b = (1 << b) - 1, (1 << 2 * b) - 1, (1 << 4 * b) - 1
    x = y & m4b  # codes 4..7
    x <<= 32
    y >>= 4 * b  # codes 0..3
    x |= y
    y = x & (m2b * 0x0000000100000001)  # second pair of each 32-bit lane
    y <<= 16
    x >>= 2 * b
    x &= m2b * 0x0000000100000001
    x |= y
    y = x & (mb * 0x0001000100010001)  # second code of each 16-bit lane
    y <<= 8
    x >>= b
    x &= mb * 0x0001000100010001
    x |= y
    return x.view(torch.uint8)[:count]


def _pack_slow(codes: torch.Tensor, bits: int) -> torch.Tensor:
    shifts = torch.arange(bits - 1, -1, -1, device=codes.device, dtype=torch.uint8)
    stream = ((codes.unsqueeze(1) >> shifts) & 1).reshape(-1)
    pad = (-stream.numel()) % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    weights = torch.arange(7, -1, -1, device=codes.device, dtype=torch.uint8)
    return (stream.view(-1, 8) << weights).sum(dim=1, dtype=torch.uint8)


def _unpack_slow(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    shifts = torch.arange(7, -1, -1, device=packed.device, dtype=torch.uint8)
    stream = ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[: count * bits]
    weights = (2 ** torch.arange(bits - 1, -1, -1, device=packed.device)).to(torch.uint8)
    return (stream.view(count, bits) * weights).sum(dim=1, dtype=torch.uint8)
