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

Over 450 lines on purpose: every kernel of the 1- and 2-bit codecs (encode, decode,
decode-and-add, the many-slice forms of the two-phase exchange) shares the packing
multipliers and loops here (``PACK8``/``PACK4``, the block loops), which the quantising
codecs' kernels import too; one family, one module.
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

#: One multiply packs a little-endian word of eight 0/1 bytes (byte k = code k, at bit 8k)
#: into its top byte, code 0 in the top bit: ``PACK8`` = Σ 2^(63 − 9k) moves code k to bit
#: 63 − k; every other product is a distinct power of two outside bits 56–63 (below them,
#: or past bit 63 and dropped), so nothing carries in. :data:`PACK4` = Σ 2^(30 − 10k) does
#: the same for four 2-bit codes (0..3) of a 32-bit word: code k to bits 30 − 2k and 31 − 2k,
#: the other products on disjoint bit pairs below bit 22 or dropped. Against the
#: shift-and-or chains they replace: 25% off the sign packer's time, 5–20% off 2bit's, in
#: AVX2 and in AVX-512 code (every pattern: tests/test_kernels_elementwise.py).
PACK8 = np.uint64(0x8040201008040201)
PACK4 = np.uint32(0x40100401)
TOP8 = np.uint64(56)
TOP4 = np.uint32(24)


def sign_encode(x, out):
    """``out`` (uint8, ceil(n/8)) = packed bits of ``x >= 0`` (:func:`sign_encode_l1` without
    the sums)."""
    starts, stops, offsets = whole(x.size)
    sign_encode_many(x, starts, stops, out, offsets, _NO_SUMS, False, _NO_TABLES, x[:0], False)


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
            out[s // 8 + i] = (words[i] * PACK8) >> TOP8
    for k in range(blocked, n):   # the entries after the last whole block, code by code
        v = x[k]
        bit = np.uint8((v <= inf) | (v == 0x8000))
        if k % 8 == 0:
            out[k >> 3] = 0
        out[k >> 3] |= bit << (7 - (k & 7))


def sign_encode_residual(x, table, out, res):
    """:func:`sign_encode`, and ``res = x − table[bit]`` (``table``: the decoded −, + value)."""
    starts, stops, offsets = whole(x.size)
    sign_encode_residual_slices(x, starts, stops, table.reshape(1, 2), out, offsets, res)


def sign_encode_residual_slices(x, starts, stops, tables, packed, offsets, residual):
    """:func:`sign_encode_residual` of every slice ``x[starts[m]:stops[m]]`` (the *many*
    contract: its codes from byte ``offsets[m]`` of ``packed``, its residual at the same
    positions of ``residual``, ``tables[m]`` its decoded −, + value): the same bytes and
    values as one call per slice."""
    sign_encode_many(x, starts, stops, packed, offsets, _NO_SUMS, False, tables, residual, True)


def whole(n):
    """(starts, stops, offsets) of one slice covering ``n`` entries, for a ``*_many`` kernel."""
    return np.zeros(1, np.int64), np.full(1, n, np.int64), np.zeros(1, np.int64)


def twobit_encode(x, t, out):
    """``out`` (uint8, ceil(n/4)) = MXNet 2-bit codes of ``x`` (``x >= t``: 11, ``x <= −t``:
    10, else 00), four a byte, first in the top bits."""
    starts, stops, offsets = whole(x.size)
    twobit_encode_many(x, starts, stops, t, _NO_TABLE, out, offsets, x[:0], False)


def twobit_encode_residual(x, t, table, out, res):
    """:func:`twobit_encode`, and ``res = x − table[code]`` (``table``: the 4 decoded values)."""
    starts, stops, offsets = whole(x.size)
    twobit_encode_many(x, starts, stops, t, table, out, offsets, res, True)


_NO_TABLE = np.zeros(4, np.float32)


@njit
def twobit_encode_many(x, starts, stops, t, table, packed, offsets, residual, with_residual):
    """:func:`twobit_encode` (``with_residual``: :func:`twobit_encode_residual`) of every
    slice ``x[starts[m]:stops[m]]`` (the *many* contract of :func:`sign_encode_residual_slices`;
    one threshold ``t`` and one ``table`` for all)."""
    mt = -t
    zero, minus, plus = table[0], table[2], table[3]  # selects, not a gather: LLVM vectorizes them
    for m in range(starts.size):
        x_ = x[starts[m]:stops[m]]
        out = packed[offsets[m]:]
        n = x_.size
        blocked = n // _BLOCK * _BLOCK
        tmp = np.empty(_BLOCK, np.uint8)
        words = tmp.view(np.uint32)
        if with_residual:
            res = residual[starts[m]:stops[m]]
            for s in range(0, blocked, _BLOCK):
                for k in range(_BLOCK):
                    v = x_[s + k]
                    ge = v >= t
                    le = v <= mt
                    res[s + k] = v - (plus if ge else (minus if le else zero))
                    tmp[k] = 3 * ge + 2 * le
                for i in range(_BLOCK // 4):  # four codes, the bytes of a little-endian word -> one byte
                    out[s // 4 + i] = (words[i] * PACK4) >> TOP4
            for k in range(blocked, n):
                v = x_[k]
                res[k] = v - (plus if v >= t else (minus if v <= mt else zero))
        else:
            for s in range(0, blocked, _BLOCK):
                for k in range(_BLOCK):
                    v = x_[s + k]
                    tmp[k] = 3 * (v >= t) + 2 * (v <= mt)
                for i in range(_BLOCK // 4):  # four codes, the bytes of a little-endian word -> one byte
                    out[s // 4 + i] = (words[i] * PACK4) >> TOP4
        full = n // 4  # the entries after the last whole block, code by code
        for i in range(blocked // 4, full):
            b = 0
            for j in range(4):
                v = x_[i * 4 + j]
                b = (b << 2) | (3 * (v >= t) + 2 * (v <= mt))
            out[i] = b
        rem = n - full * 4
        if rem:
            b = 0
            for j in range(rem):
                v = x_[full * 4 + j]
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


def abs_sum_blocks(x, partials):
    """``partials[b]`` = the ℓ1 sum of block ``b`` of ``x`` (float32 or float64), in the
    defined order; ``partials`` has ``max(1, ceil(n / L1_BLOCK))`` entries (0.0 for n = 0)."""
    starts, stops, offsets = whole(x.size)
    abs_sum_blocks_many(x, starts, stops, partials, offsets)


@njit
def abs_sum_blocks_many(x, starts, stops, partials, offsets):
    """:func:`abs_sum_blocks` of every slice ``x[starts[m]:stops[m]]``, its partials from
    ``partials[offsets[m]]`` on."""
    acc = np.zeros(_BLOCK, np.float64)
    for m in range(starts.size):
        x_ = x[starts[m]:stops[m]]
        n = x_.size
        for b in range(max(1, -(-n // L1_BLOCK))):
            acc[:] = 0.0
            first = b * L1_BLOCK
            for s in range(first, min(n, first + L1_BLOCK), _BLOCK):
                row = x_[s:min(n, s + _BLOCK)]   # a partial last row: its missing entries add +0.0
                for k in range(row.size):
                    acc[k] += abs(np.float64(row[k]))
            h = _BLOCK // 2
            while h:
                for k in range(h):
                    acc[k] = acc[k] + acc[k + h]
                h //= 2
            partials[offsets[m] + b] = acc[0]


def sign_encode_slices(x, starts, stops, packed, offsets):
    """:func:`sign_encode` of every slice (the *many* contract of :func:`sign_encode_residual_slices`)."""
    sign_encode_many(x, starts, stops, packed, offsets, _NO_SUMS, False, _NO_TABLES, x[:0], False)


def sign_encode_l1(x, out, partials):
    """:func:`sign_encode` and :func:`abs_sum_blocks`'s ``partials`` of the whole ℓ1 blocks,
    in one pass (the partial last one: the caller runs :func:`abs_sum_blocks` on it)."""
    starts, stops, offsets = whole(x.size)
    sign_encode_many(x, starts, stops, out, offsets, partials, True, _NO_TABLES, x[:0], False)


_NO_SUMS = np.empty(0, np.float64)
_NO_TABLES = np.zeros((1, 2), np.float32)


@njit
def sign_encode_many(x, starts, stops, packed, offsets, partials, sums, tables, residual, with_residual):
    """:func:`sign_encode` of every slice ``x[starts[m]:stops[m]]`` (the *many* contract of
    :func:`sign_encode_residual_slices`); ``sums`` (one slice only): also the ℓ1 partials of
    its whole blocks into ``partials`` (:func:`sign_encode_l1`); ``with_residual``: also
    ``residual = x − tables[m, bit]``."""
    tmp = np.empty(_BLOCK, np.uint8)
    words = tmp.view(np.uint64)
    acc = np.zeros(_BLOCK, np.float64)
    for m in range(starts.size):
        x_ = x[starts[m]:stops[m]]
        res = residual[starts[m]:stops[m]] if with_residual else residual
        out = packed[offsets[m]:]
        neg, pos = tables[m if with_residual else 0, 0], tables[m if with_residual else 0, 1]
        n = x_.size
        blocked = n // _BLOCK * _BLOCK
        # one block loop per mode (sums and residual never come together): a loop that tests
        # the mode inside ran ~30% (bits) to ~45% (bits + sums) slower
        mode = 2 if with_residual else (1 if sums else 0)
        for s in range(0, blocked if mode == 0 else 0, _BLOCK):   # the bits
            blk = x_[s:s + _BLOCK]
            for k in range(_BLOCK):
                tmp[k] = blk[k] >= 0
            for i in range(_BLOCK // 8):  # eight 0/1 bytes of a little-endian word -> one byte
                out[s // 8 + i] = (words[i] * PACK8) >> TOP8
        for s in range(0, blocked if mode == 1 else 0, _BLOCK):   # the bits and the ℓ1 lanes
            blk = x_[s:s + _BLOCK]
            for k in range(_BLOCK):
                v = blk[k]
                tmp[k] = v >= 0
                acc[k] += abs(np.float64(v))
            for i in range(_BLOCK // 8):
                out[s // 8 + i] = (words[i] * PACK8) >> TOP8
            if (s // _BLOCK) % ROWS == ROWS - 1:   # the last row of an ℓ1 block
                h = _BLOCK // 2
                while h:
                    for k in range(h):
                        acc[k] = acc[k] + acc[k + h]
                    h //= 2
                partials[s // L1_BLOCK] = acc[0]
                acc[:] = 0.0
        for s in range(0, blocked if mode == 2 else 0, _BLOCK):   # the bits and the residual
            blk = x_[s:s + _BLOCK]
            for k in range(_BLOCK):
                v = blk[k]
                ge = v >= 0
                res[s + k] = v - (pos if ge else neg)
                tmp[k] = ge
            for i in range(_BLOCK // 8):
                out[s // 8 + i] = (words[i] * PACK8) >> TOP8
        if with_residual:
            for k in range(blocked, n):
                v = x_[k]
                res[k] = v - (pos if v >= 0 else neg)
        full = n // 8  # the entries after the last whole block, code by code
        for i in range(blocked // 8, full):
            b = 0
            for j in range(8):
                b = (b << 1) | (x_[i * 8 + j] >= 0)
            out[i] = b
        rem = n - full * 8
        if rem:
            b = 0
            for j in range(rem):
                b = (b << 1) | (x_[full * 8 + j] >= 0)
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


def decode1(packed, table, out):
    """``out[i] = table[bit i]`` for the ``out.size`` first bits of ``packed``. In blocks
    (see the encoders): each byte spread into the eight bytes of a little-endian word, then
    one select per entry (vectorized)."""
    starts, stops, offsets = whole(out.size)
    decode1_many(packed, offsets, table.reshape(1, 2), out, starts, stops)


@njit
def decode1_many(packed, offsets, tables, out, starts, stops):
    """:func:`decode1` of every slice: the bits from byte ``offsets[m]`` of ``packed`` into
    ``out[starts[m]:stops[m]]`` through ``tables[m]``."""
    tmp = np.empty(_BLOCK, np.uint8)
    words = tmp.view(np.uint64)
    for m in range(starts.size):
        src = packed[offsets[m]:]
        dst = out[starts[m]:stops[m]]
        n = dst.size
        zero, one = tables[m, 0], tables[m, 1]
        blocked = n // _BLOCK * _BLOCK
        for s in range(0, blocked, _BLOCK):
            for i in range(_BLOCK // 8):
                b = np.uint64(src[s // 8 + i])
                w = (b >> 7) & 1
                for j in range(1, 8):
                    w |= ((b >> (7 - j)) & 1) << (8 * j)
                words[i] = w
            for k in range(_BLOCK):
                dst[s + k] = one if tmp[k] else zero
        for k in range(blocked, n):
            dst[k] = tables[m, (src[k >> 3] >> (7 - (k & 7))) & 1]


def decode2(packed, table, out):
    """``out[i] = table[code i]`` for the ``out.size`` first 2-bit codes of ``packed``. In
    blocks: each byte spread into the four bytes of a little-endian word, then two selects
    per entry (vectorized; a table gather is not)."""
    starts, stops, offsets = whole(out.size)
    decode2_many(packed, offsets, table, out, starts, stops)


@njit
def decode2_many(packed, offsets, table, out, starts, stops):
    """:func:`decode2` of every slice: the codes from byte ``offsets[m]`` of ``packed`` into
    ``out[starts[m]:stops[m]]`` (one ``table`` for all)."""
    t0, t1, t2, t3 = table[0], table[1], table[2], table[3]
    tmp = np.empty(_BLOCK, np.uint8)
    words = tmp.view(np.uint32)
    for m in range(starts.size):
        src = packed[offsets[m]:]
        dst = out[starts[m]:stops[m]]
        n = dst.size
        blocked = n // _BLOCK * _BLOCK
        for s in range(0, blocked, _BLOCK):
            for i in range(_BLOCK // 4):
                b = np.uint32(src[s // 4 + i])
                words[i] = (b >> 6) | (((b >> 4) & 3) << 8) | (((b >> 2) & 3) << 16) | ((b & 3) << 24)
            for k in range(_BLOCK):
                c = tmp[k]
                dst[s + k] = (t3 if c & 1 else t2) if c >> 1 else (t1 if c & 1 else t0)
        for k in range(blocked, n):
            dst[k] = table[(src[k >> 2] >> (6 - 2 * (k & 3))) & 3]


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


# -- many slices of n workers (the two-phase exchange, gradzip.exchange.twophase) -------------------
# ``wires``: one row per worker, each holding that worker's packets of the same slices at the
# same byte ``offsets``; slice m's aggregate goes to ``out[starts[m]:stops[m]]``. Each is
# the codec's own aggregate of the decoded packets, in the same float operations.


def slice_layout(bounds, bits: int, trailer: int = 0):
    """(starts, stops, byte offsets, total bytes) of packets of ``bits``-bit codes of the
    slices ``bounds`` back to back, each followed by ``trailer`` bytes (``scaled_sign``'s
    scale), as int64 numpy arrays."""
    ab = np.array(bounds, np.int64).reshape(-1, 2)
    starts, stops = np.ascontiguousarray(ab[:, 0]), np.ascontiguousarray(ab[:, 1])
    sizes = (stops - starts) * bits // 8 + ((stops - starts) * bits % 8 > 0) + trailer
    offsets = np.zeros(sizes.size, np.int64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    return starts, stops, offsets, int(sizes.sum())


@njit
def mean1_many(wires, offsets, tables, out, starts, stops, count):
    """``scaled_sign``'s mean: worker i's entry decodes to ``tables[i, m, bit]``, summed in
    worker order in the output's dtype (``d_0 + d_1 + …``), then divided by ``count`` (the
    worker count, in that dtype): ``Compressor.aggregate``'s ``clone, add_, div_``."""
    for m in range(starts.size):
        dst = out[starts[m]:stops[m]]
        first = offsets[m]
        for k in range(dst.size):
            byte, shift = first + (k >> 3), 7 - (k & 7)
            acc = tables[0, m, (wires[0, byte] >> shift) & 1]
            for i in range(1, wires.shape[0]):
                acc = acc + tables[i, m, (wires[i, byte] >> shift) & 1]
            dst[k] = acc / count


@njit
def votes1_many(wires, offsets, table, out, starts, stops):
    """``sign``'s majority vote: ``table[sign(Σ_i ±1) + 1]`` (``table``: −1, 0, +1)."""
    for m in range(starts.size):
        dst = out[starts[m]:stops[m]]
        first = offsets[m]
        for k in range(dst.size):
            byte, shift = first + (k >> 3), 7 - (k & 7)
            c = 0
            for i in range(wires.shape[0]):
                c += 2 * ((wires[i, byte] >> shift) & 1) - 1
            dst[k] = table[1 + (c > 0) - (c < 0)]


@njit
def counts2_many(wires, offsets, step, out, starts, stops):
    """``2bit``'s mean: ``float32(Σ_i code_i) * step`` (codes −1, 0, +1; ``step`` the float32
    ``t / n``), as :func:`accumulate2` then :func:`scale_counts`."""
    for m in range(starts.size):
        dst = out[starts[m]:stops[m]]
        first = offsets[m]
        for k in range(dst.size):
            byte, shift = first + (k >> 2), 6 - 2 * (k & 3)
            c = 0
            for i in range(wires.shape[0]):
                code = (wires[i, byte] >> shift) & 3
                c += (code == 3) - (code == 2)
            dst[k] = np.float32(c) * step


@njit
def place_bytes(src, dst, offsets):
    """``dst[offsets[m]:offsets[m] + w] = src[m]`` for the rows of ``src`` (uint8, w wide)."""
    for m in range(src.shape[0]):
        for b in range(src.shape[1]):
            dst[offsets[m] + b] = src[m, b]


@njit
def take_bytes(wires, offsets, dst):
    """``dst[i, m] = wires[i, offsets[m]:offsets[m] + w]`` (``dst``: uint8, rows × slices × w)."""
    for i in range(wires.shape[0]):
        for m in range(offsets.size):
            for b in range(dst.shape[2]):
                dst[i, m, b] = wires[i, offsets[m] + b]
