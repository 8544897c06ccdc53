"""Fused one-pass kernels of the elementwise codecs: ``sign`` / ``scaled_sign`` (1 bit an
entry) and ``2bit`` (docs/algorithms.md §codec: sign, scaled_sign, 2bit).

Each kernel reads its input once and writes its outputs once, into buffers the caller
owns (the packet's wire, reused across steps; the decode target ``out``; the
error-feedback residual): the codec's torch reference makes a pass per op into fresh
tensors. The bit layout is :mod:`gradzip.compressors.bitpack`'s (big-endian stream, the
first code in the top bits of the first byte; the unused low bits of a last partial byte
are 0).

Contract shared by every kernel: flat, contiguous numpy views (:func:`gradzip.kernels.array`);
values are compared and subtracted in the input's own dtype (float32 or float64, the
threshold already rounded to it, as torch rounds a Python scalar); decoded values come
from a small ``table`` in the output's dtype that the codec builds with torch exactly as
its reference path builds them (16-bit floats as uint16 bits), so the kernels never round
anything themselves and are bit-identical to the reference by construction. NaN compares
false (sign: bit 0; 2bit: code 0), as in torch. No fastmath.
"""
from __future__ import annotations

import numpy as np

from . import njit

# -- encoders ---------------------------------------------------------------------------
# Encoders work in blocks of _BLOCK entries: first one vectorizable pass that writes each
# entry's code as a byte into a small scratch (and the residual), then one that packs the
# bytes, read as little-endian 32-bit (2-bit codes) or 64-bit words (1-bit codes), into the
# wire bytes: twice the speed of packing code by code (LLVM vectorizes both loops). The
# entries after the last whole block go code by code. Little-endian machines only (the
# codecs check; every platform numba runs on is).

_BLOCK = 1024  # a multiple of 8
BLOCK = _BLOCK


def sign_encode(x, out):
    """``out`` (uint8, ceil(n/8)) = packed bits of ``x >= 0`` (:func:`sign_encode_l1` without
    the sums)."""
    _sign_encode(x, out, _NO_SUMS, False)


@njit
def sign_encode_bits(x, inf, out):
    """:func:`sign_encode` of 16-bit floats given as their uint16 bits
    (:func:`gradzip.kernels.array`): ``x >= 0`` is ``bits <= inf`` (+0 up to +inf, the bits
    of +inf in ``inf``; NaN lies above) or ``bits == 0x8000`` (−0): compares, no rounding."""
    n = x.size
    blocked = n // _BLOCK * _BLOCK
    tmp = np.empty(_BLOCK, np.uint8)
    words = tmp.view(np.uint64)
    for s in range(0, blocked, _BLOCK):
        blk = x[s:s + _BLOCK]
        for k in range(_BLOCK):
            v = blk[k]
            tmp[k] = (v <= inf) | (v == 0x8000)
        for i in range(_BLOCK // 8):  # eight 0/1 bytes of a little-endian word -> one byte
            u = words[i]
            b = u & 1
            for j in range(1, 8):
                b = (b << 1) | ((u >> (8 * j)) & 1)
            out[s // 8 + i] = b
    for k in range(blocked, n):   # the entries after the last whole block, code by code
        v = x[k]
        bit = np.uint8((v <= inf) | (v == 0x8000))
        if k % 8 == 0:
            out[k >> 3] = 0
        out[k >> 3] |= bit << (7 - (k & 7))

@njit
def sign_encode_residual(x, table, out, res):
    """:func:`sign_encode`, and ``res = x − table[bit]`` (``table``: the decoded −, + value)."""
    n = x.size
    neg, pos = table[0], table[1]
    blocked = n // _BLOCK * _BLOCK
    tmp = np.empty(_BLOCK, np.uint8)
    words = tmp.view(np.uint64)
    for s in range(0, blocked, _BLOCK):
        for k in range(_BLOCK):
            v = x[s + k]
            ge = v >= 0
            res[s + k] = v - (pos if ge else neg)
            tmp[k] = ge
        for i in range(_BLOCK // 8):  # eight 0/1 bytes of a little-endian word -> one byte
            u = words[i]
            b = u & 1
            for j in range(1, 8):
                b = (b << 1) | ((u >> (8 * j)) & 1)
            out[s // 8 + i] = b
    for k in range(blocked, n):
        v = x[k]
        res[k] = v - (pos if v >= 0 else neg)
    full = n // 8  # the entries after the last whole block, code by code
    for i in range(blocked // 8, full):
        b = 0
        for j in range(8):
            b = (b << 1) | (x[i * 8 + j] >= 0)
        out[i] = b
    rem = n - full * 8
    if rem:
        b = 0
        for j in range(rem):
            b = (b << 1) | (x[full * 8 + j] >= 0)
        out[full] = b << (8 - rem)


@njit
def twobit_encode(x, t, out):
    """``out`` (uint8, ceil(n/4)) = MXNet 2-bit codes of ``x`` (``x >= t``: 11, ``x <= −t``:
    10, else 00), four a byte, first in the top bits."""
    n = x.size
    mt = -t
    blocked = n // _BLOCK * _BLOCK
    tmp = np.empty(_BLOCK, np.uint8)
    words = tmp.view(np.uint32)
    for s in range(0, blocked, _BLOCK):
        for k in range(_BLOCK):
            v = x[s + k]
            tmp[k] = 3 * (v >= t) + 2 * (v <= mt)
        for i in range(_BLOCK // 4):  # four codes, the bytes of a little-endian word -> one byte
            u = words[i]
            out[s // 4 + i] = ((u & 3) << 6) | (((u >> 8) & 3) << 4) | (((u >> 16) & 3) << 2) | ((u >> 24) & 3)
    full = n // 4  # the entries after the last whole block, code by code
    for i in range(blocked // 4, full):
        b = 0
        for j in range(4):
            v = x[i * 4 + j]
            b = (b << 2) | (3 * (v >= t) + 2 * (v <= mt))
        out[i] = b
    rem = n - full * 4
    if rem:
        b = 0
        for j in range(rem):
            v = x[full * 4 + j]
            b = (b << 2) | (3 * (v >= t) + 2 * (v <= mt))
        out[full] = b << (2 * (4 - rem))


@njit
def twobit_encode_residual(x, t, table, out, res):
    """:func:`twobit_encode`, and ``res = x − table[code]`` (``table``: the 4 decoded values)."""
    n = x.size
    mt = -t
    zero, minus, plus = table[0], table[2], table[3]  # selects, not a gather: LLVM vectorizes them
    blocked = n // _BLOCK * _BLOCK
    tmp = np.empty(_BLOCK, np.uint8)
    words = tmp.view(np.uint32)
    for s in range(0, blocked, _BLOCK):
        for k in range(_BLOCK):
            v = x[s + k]
            ge = v >= t
            le = v <= mt
            res[s + k] = v - (plus if ge else (minus if le else zero))
            tmp[k] = 3 * ge + 2 * le
        for i in range(_BLOCK // 4):  # four codes, the bytes of a little-endian word -> one byte
            u = words[i]
            out[s // 4 + i] = ((u & 3) << 6) | (((u >> 8) & 3) << 4) | (((u >> 16) & 3) << 2) | ((u >> 24) & 3)
    for k in range(blocked, n):
        v = x[k]
        res[k] = v - (plus if v >= t else (minus if v <= mt else zero))
    full = n // 4  # the entries after the last whole block, code by code
    for i in range(blocked // 4, full):
        b = 0
        for j in range(4):
            v = x[i * 4 + j]
            b = (b << 2) | (3 * (v >= t) + 2 * (v <= mt))
        out[i] = b
    rem = n - full * 4
    if rem:
        b = 0
        for j in range(rem):
            v = x[full * 4 + j]
            b = (b << 2) | (3 * (v >= t) + 2 * (v <= mt))
        out[full] = b << (2 * (4 - rem))


# -- the l1 norm of scaled_sign, in its defined order ----------------------------------
# docs/algorithms.md §codec: sign, scaled_sign, "Summation order": the tensor in blocks of
# ROWS rows of _BLOCK entries (the last block and its last row partial); in a block,
# _BLOCK float64 lanes, lane k summing |x[r·_BLOCK + k]| over the rows r in order from
# 0.0; the lanes then added pairwise (k + k+512, then + 256, ..., + 1); the block sums are
# summed the same way (blocks of them, ...) until one is left. Both paths compute exactly
# this (sign.l1_norm is the torch one), so the scale is bit-identical; a row's lane update
# is one vectorized loop over the row the encoder reads anyway.

ROWS = 64
#: Entries of an ℓ1 block.
L1_BLOCK = ROWS * _BLOCK


@njit
def abs_sum_blocks(x, partials):
    """``partials[b]`` = the ℓ1 sum of block ``b`` of ``x`` (float32 or float64), in the
    defined order; ``partials`` has ``max(1, ceil(n / L1_BLOCK))`` entries (0.0 for n = 0)."""
    n = x.size
    acc = np.zeros(_BLOCK, np.float64)
    for b in range(max(1, -(-n // L1_BLOCK))):
        acc[:] = 0.0
        first = b * L1_BLOCK
        for s in range(first, min(n, first + L1_BLOCK), _BLOCK):
            row = x[s:min(n, s + _BLOCK)]   # a partial last row: its missing entries add +0.0
            for k in range(row.size):
                acc[k] += abs(np.float64(row[k]))
        h = _BLOCK // 2
        while h:
            for k in range(h):
                acc[k] = acc[k] + acc[k + h]
            h //= 2
        partials[b] = acc[0]


def sign_encode_l1(x, out, partials):
    """:func:`sign_encode` and :func:`abs_sum_blocks`'s ``partials`` of the whole ℓ1 blocks,
    in one pass (the partial last one: the caller runs :func:`abs_sum_blocks` on it)."""
    _sign_encode(x, out, partials, True)


_NO_SUMS = np.empty(0, np.float64)


@njit
def _sign_encode(x, out, partials, sums):
    # the packed bits of x >= 0 into out; with sums, the ℓ1 partials of the whole blocks
    n = x.size
    blocked = n // _BLOCK * _BLOCK
    tmp = np.empty(_BLOCK, np.uint8)
    words = tmp.view(np.uint64)
    acc = np.zeros(_BLOCK, np.float64)
    for s in range(0, blocked, _BLOCK):
        blk = x[s:s + _BLOCK]
        for k in range(_BLOCK):
            tmp[k] = blk[k] >= 0
        if sums:
            for k in range(_BLOCK):
                acc[k] += abs(np.float64(blk[k]))
        for i in range(_BLOCK // 8):  # eight 0/1 bytes of a little-endian word -> one byte
            u = words[i]
            b = u & 1
            for j in range(1, 8):
                b = (b << 1) | ((u >> (8 * j)) & 1)
            out[s // 8 + i] = b
        if sums and (s // _BLOCK) % ROWS == ROWS - 1:   # the last row of an ℓ1 block
            h = _BLOCK // 2
            while h:
                for k in range(h):
                    acc[k] = acc[k] + acc[k + h]
                h //= 2
            partials[s // L1_BLOCK] = acc[0]
            acc[:] = 0.0
    full = n // 8  # the entries after the last whole block, code by code
    for i in range(blocked // 8, full):
        b = 0
        for j in range(8):
            b = (b << 1) | (x[i * 8 + j] >= 0)
        out[i] = b
    rem = n - full * 8
    if rem:
        b = 0
        for j in range(rem):
            b = (b << 1) | (x[full * 8 + j] >= 0)
        out[full] = b << (8 - rem)


def l1_of(x, partials=None) -> float:
    """The ℓ1 norm of the flat float32 / float64 numpy array ``x`` in the defined order;
    ``partials`` (``max(1, ceil(n / L1_BLOCK))`` float64 entries): its block sums already
    computed (:func:`sign_encode_l1`, whose partial last block this completes)."""
    n = x.size
    if partials is None:
        partials = np.empty(max(1, -(-n // L1_BLOCK)), np.float64)
        abs_sum_blocks(x, partials)
    elif n % L1_BLOCK or n == 0:
        abs_sum_blocks(x[n // L1_BLOCK * L1_BLOCK:], partials[n // L1_BLOCK:])
    while partials.size > 1:
        folded = np.empty(-(-partials.size // L1_BLOCK), np.float64)
        abs_sum_blocks(partials, folded)
        partials = folded
    return float(partials[0])

# -- decoders ---------------------------------------------------------------------------


@njit
def decode1(packed, table, out):
    """``out[i] = table[bit i]`` for the ``out.size`` first bits of ``packed``. In blocks
    (see the encoders): each byte spread into the eight bytes of a little-endian word, then
    one select per entry (vectorized)."""
    n = out.size
    zero, one = table[0], table[1]
    blocked = n // _BLOCK * _BLOCK
    tmp = np.empty(_BLOCK, np.uint8)
    words = tmp.view(np.uint64)
    for s in range(0, blocked, _BLOCK):
        for i in range(_BLOCK // 8):
            b = np.uint64(packed[s // 8 + i])
            w = (b >> 7) & 1
            for j in range(1, 8):
                w |= ((b >> (7 - j)) & 1) << (8 * j)
            words[i] = w
        for k in range(_BLOCK):
            out[s + k] = one if tmp[k] else zero
    for k in range(blocked, n):
        out[k] = table[(packed[k >> 3] >> (7 - (k & 7))) & 1]


@njit
def decode2(packed, table, out):
    """``out[i] = table[code i]`` for the ``out.size`` first 2-bit codes of ``packed``. In
    blocks: each byte spread into the four bytes of a little-endian word, then two selects
    per entry (vectorized; a table gather is not)."""
    n = out.size
    t0, t1, t2, t3 = table[0], table[1], table[2], table[3]
    blocked = n // _BLOCK * _BLOCK
    tmp = np.empty(_BLOCK, np.uint8)
    words = tmp.view(np.uint32)
    for s in range(0, blocked, _BLOCK):
        for i in range(_BLOCK // 4):
            b = np.uint32(packed[s // 4 + i])
            words[i] = (b >> 6) | (((b >> 4) & 3) << 8) | (((b >> 2) & 3) << 16) | ((b & 3) << 24)
        for k in range(_BLOCK):
            c = tmp[k]
            out[s + k] = (t3 if c & 1 else t2) if c >> 1 else (t1 if c & 1 else t0)
    for k in range(blocked, n):
        out[k] = table[(packed[k >> 2] >> (6 - 2 * (k & 3))) & 3]


@njit
def accumulate1(packed, table, total):
    """``total[i] += table[bit i]`` (an int32 running sum of decoded 1-bit codes)."""
    n = total.size
    full = n // 8
    for i in range(full):
        b = packed[i]
        base = i * 8
        for j in range(8):
            total[base + j] += table[(b >> (7 - j)) & 1]
    for k in range(full * 8, n):
        total[k] += table[(packed[k >> 3] >> (7 - (k & 7))) & 1]


@njit
def accumulate2(packed, table, total):
    """``total[i] += table[code i]`` (an int32 running sum of decoded 2-bit codes)."""
    n = total.size
    full = n // 4
    for i in range(full):
        b = packed[i]
        base = i * 4
        for j in range(4):
            total[base + j] += table[(b >> (6 - 2 * j)) & 3]
    for k in range(full * 4, n):
        total[k] += table[(packed[k >> 2] >> (6 - 2 * (k & 3))) & 3]


@njit
def scale_counts(total, s, out):
    """``out = float32(total) * s`` (``s`` a float32: torch's ``total.to(float32) * scalar``).
    numba may form the product in float64: exact for |total| < 2**24 (any count of <= 127
    workers), so its one rounding to float32 is float32's own."""
    for i in range(out.size):
        out[i] = total[i] * s


@njit
def sign_of_counts(total, table, out):
    """``out = table[sign(total) + 1]`` (``table``: the −1, 0, +1 of the output dtype)."""
    for i in range(out.size):
        v = total[i]
        out[i] = table[1 + (v > 0) - (v < 0)]
