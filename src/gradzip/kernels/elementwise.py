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

from . import njit

# -- encoders ---------------------------------------------------------------------------


@njit
def sign_encode(x, out):
    """``out`` (uint8, ceil(n/8)) = packed bits of ``x >= 0``."""
    n = x.size
    full = n // 8
    for i in range(full):
        base = i * 8
        b = 0
        for j in range(8):
            b = (b << 1) | (x[base + j] >= 0)
        out[i] = b
    rem = n - full * 8
    if rem:
        b = 0
        for j in range(rem):
            b = (b << 1) | (x[full * 8 + j] >= 0)
        out[full] = b << (8 - rem)


@njit
def sign_encode_residual(x, table, out, res):
    """:func:`sign_encode`, and ``res = x − table[bit]`` (``table``: the decoded −, + value)."""
    n = x.size
    full = n // 8
    neg, pos = table[0], table[1]
    for i in range(full):
        base = i * 8
        b = 0
        for j in range(8):
            v = x[base + j]
            ge = v >= 0
            res[base + j] = v - (pos if ge else neg)
            b = (b << 1) | ge
        out[i] = b
    rem = n - full * 8
    if rem:
        b = 0
        for j in range(rem):
            v = x[full * 8 + j]
            ge = v >= 0
            res[full * 8 + j] = v - (pos if ge else neg)
            b = (b << 1) | ge
        out[full] = b << (8 - rem)


@njit
def twobit_encode(x, t, out):
    """``out`` (uint8, ceil(n/4)) = MXNet 2-bit codes of ``x`` (``x >= t``: 11, ``x <= −t``:
    10, else 00), four a byte, first in the top bits."""
    n = x.size
    full = n // 4
    mt = -t
    for i in range(full):
        base = i * 4
        b = 0
        for j in range(4):
            v = x[base + j]
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
    full = n // 4
    mt = -t
    zero, minus, plus = table[0], table[2], table[3]  # selects, not a gather: LLVM vectorizes them
    for i in range(full):
        base = i * 4
        b = 0
        for j in range(4):
            v = x[base + j]
            ge = v >= t
            le = v <= mt
            res[base + j] = v - (plus if ge else (minus if le else zero))
            b = (b << 2) | (3 * ge + 2 * le)
        out[i] = b
    rem = n - full * 4
    if rem:
        b = 0
        for j in range(rem):
            v = x[full * 4 + j]
            ge = v >= t
            le = v <= mt
            res[full * 4 + j] = v - (plus if ge else (minus if le else zero))
            b = (b << 2) | (3 * ge + 2 * le)
        out[full] = b << (2 * (4 - rem))


# -- decoders ---------------------------------------------------------------------------


@njit
def decode1(packed, table, out):
    """``out[i] = table[bit i]`` for the ``out.size`` first bits of ``packed``."""
    n = out.size
    full = n // 8
    zero, one = table[0], table[1]
    for i in range(full):
        b = packed[i]
        base = i * 8
        for j in range(8):
            out[base + j] = one if (b >> (7 - j)) & 1 else zero
    for k in range(full * 8, n):
        out[k] = table[(packed[k >> 3] >> (7 - (k & 7))) & 1]


@njit
def decode2(packed, table, out):
    """``out[i] = table[code i]`` for the ``out.size`` first 2-bit codes of ``packed``."""
    n = out.size
    full = n // 4
    for i in range(full):  # unrolled by hand: LLVM then vectorizes the four gathers
        b = packed[i]
        base = i * 4
        out[base] = table[b >> 6]
        out[base + 1] = table[(b >> 4) & 3]
        out[base + 2] = table[(b >> 2) & 3]
        out[base + 3] = table[b & 3]
    for k in range(full * 4, n):
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
