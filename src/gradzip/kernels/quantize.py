"""Fused kernels of the quantising codecs ``1bit``, ``qsgd`` and ``terngrad``: each encode
is one pass (codes, bit packing and, when asked, the error-feedback residual
``v − C(v)``), each decode one pass into the caller's buffer.

Every kernel is bit-identical to its codec's torch reference for finite tensors: the same
float32 operations in the same order (no fastmath, so no fused multiply-add), the uniforms of
:mod:`.counter_rng` computed inline (in 32-bit vector lanes), the codes
packed MSB-first in the layout of :mod:`gradzip.compressors.bitpack`. The reductions run
in the kernels too: terngrad's ``max|v|`` (exact in any order), qsgd's norm and 1bit's
column sums in the orders docs/algorithms.md defines, which the codecs' torch paths follow. (A NaN or Inf, which the optimizers stop before compressing unless
``nonfinite="off"``: the reference casts NaN to uint8, which is unspecified; the kernels
write in-range codes.)

The kernels work on flat numpy views (:func:`gradzip.kernels.array`) of contiguous float32
tensors. Entry ``j`` of a kernel's slice has counter ``j`` (callers slice at counter-block
boundaries, see ``counter_rng.BLOCK``). Work is done in pieces of :data:`PIECE` entries
(1bit: :data:`ONEBIT_PIECE`): codes first into a small scratch (a loop LLVM vectorises), then packed.

Why one module of over 450 lines: the three codecs' kernels call the same packing and
byte-order helpers, which :func:`_compile_helpers` turns into numba functions in this
module's namespace on first use, and numba resolves a kernel's callees from its own
module's globals when it compiles it; kernels in another module would need their own
compiled copies of every helper (and their own lazy compilation).
"""
from __future__ import annotations

import functools
import threading

import numpy as np
import torch

from . import array
from . import decode_target as _decode_target
from . import elementwise as ek
from .elementwise import PACK4, PACK8, TOP4, TOP8
from . import njit as _njit
from . import counter_rng

#: Entries per piece of the stochastic codecs (a multiple of 8: pieces pack to whole bytes).
#: Their encode keeps four scratch arrays of a piece; at 4096 entries it ran 1.5–1.9× slower
#: than at 1024 (16M entries, 1 thread, AVX2 and AVX-512 code alike: the uniforms and the
#: codes then no longer overlap), which also serves their decoders.
PIECE = 1024
#: The same for 1bit's passes (two scratch arrays), which prefer longer pieces: at 1024 its
#: encode ran ~1.4× slower at 1M entries than at 4096.
ONEBIT_PIECE = 4096
#: 1bit's column sums (docs/algorithms.md §codec: 1bit, "Summation order"): at least this
#: many float64 lanes a line, and lines a block.
LANES = 1024
LINES = 64


def lane_width(cols: int) -> int:
    """Entries of a line of 1bit's column sums: ``cols·m``, ``m`` the least power of two with
    ``cols·m ≥`` :data:`LANES` (0 for no columns)."""
    m = 1
    while 0 < cols * m < LANES:
        m *= 2
    return cols * m
_helpers_ready: list[bool] = []
_helpers_lock = threading.Lock()


def _compile_helpers() -> None:
    """Turn the packing helpers the kernels call into numba functions (numba resolves a
    kernel's globals when it compiles it); once, lazily, like the kernels themselves, and
    safely when worker threads make their first calls together."""
    if _helpers_ready:
        return
    with _helpers_lock:
        import numba
        g = globals()
        for name in ("_merge", "_split", "_bswap", "_pack_words", "_unpack1", "_unpack_words", "_onebit_run",
                     "_pack2", "_unpack2", "_fold_lanes", "_fold_pairwise", "_pack1",
                     "_onebit_sums", "_add_blocks"):
            if not hasattr(g[name], "py_func"):  # not compiled by a thread before us
                g[name] = numba.njit(cache=True, nogil=True, inline="always")(g[name])
        g["_uniform"] = counter_rng.numba_uniform()  # (cached: the same object every time)
        g["_store_be64"], g["_load_be64"] = _byte_intrinsics()
        _helpers_ready.append(True)


def njit(fn):
    """:func:`gradzip.kernels.njit`, with the packing helpers compiled first."""
    compiled = _njit(fn)

    @functools.wraps(fn)
    def run(*args):
        _compile_helpers()
        return compiled(*args)

    run.py_func = fn
    return run


@njit
def _qsgd_encode(v, scale, levels, bits, k0, k1, packed, residual, step):
    """QSGD codes ``s ± ξ`` (the sign of ``v``), ``ξ = min(⌊|v|·scale + u⌋, s)``, packed with
    ``bits`` bits into ``packed``; if ``residual`` has ``v``'s size, ``v − (code − s)·step``
    into it. ``|v|·scale + u`` is never negative, so ``⌊·⌋`` is a truncation to int32 (taken
    after the ``min``, which keeps it in range). Two piece loops, as :func:`_terngrad_encode`."""
    n = v.size
    codes = np.empty(PIECE, np.uint8)
    us = np.empty(PIECE, np.float32)
    idx = np.arange(PIECE).astype(np.uint32)
    merged = np.empty(PIECE // 8, np.uint64)
    sf = np.float32(levels)
    want = residual.size == n
    for base in range(0, 0 if want else n, PIECE):
        m = min(PIECE, n - base)
        vb = v[base:base + m]
        b32 = np.uint32(base)  # (< 2^32: the kernel runs on one counter block)
        for i in range(m):  # the counter-based uniforms (counter_rng), a loop of their own
            us[i] = _uniform(idx[i] + b32, k0, k1)  # 32-bit indices: ~30% faster than intp
        for i in range(m):
            a = vb[i]
            y = np.float32(abs(a) * scale) + us[i]
            xi = np.float32(np.int32(y if y < sf else sf))  # ⌊·⌋ as an integer-valued float32
            codes[i] = np.uint8(np.int32(sf + xi if a >= 0 else sf - xi))  # exact: ≤ 254, float lanes
        _pack_words(codes, m, bits, packed, base // 8 * bits, merged)
    for base in range(0, n if want else 0, PIECE):
        m = min(PIECE, n - base)
        vb = v[base:base + m]
        b32 = np.uint32(base)
        for i in range(m):
            us[i] = _uniform(idx[i] + b32, k0, k1)
        for i in range(m):
            a = vb[i]
            y = np.float32(abs(a) * scale) + us[i]
            xi = np.float32(np.int32(y if y < sf else sf))
            codes[i] = np.uint8(np.int32(sf + xi if a >= 0 else sf - xi))
        _pack_words(codes, m, bits, packed, base // 8 * bits, merged)
        rb = residual[base:base + m]
        for i in range(m):
            rb[i] = vb[i] - (np.float32(codes[i]) - sf) * step


@njit
def _qsgd_decode(packed, count, levels, bits, step, out, add):
    """``out[j] = (code_j − s)·step``; with ``add``, ``out[j] += that``."""
    codes = np.empty(PIECE, np.uint8)
    sf = np.float32(levels)
    for base in range(0, count, PIECE):
        m = min(PIECE, count - base)
        _unpack_words(packed, base // 8 * bits, bits, m, codes)
        ob = out[base:base + m]
        if add:
            for i in range(m):
                ob[i] = ob[i] + (np.float32(codes[i]) - sf) * step
        else:
            for i in range(m):
                ob[i] = (np.float32(codes[i]) - sf) * step


@njit
def _terngrad_encode(v, s, k0, k1, packed, residual):
    """TernGrad codes ``11`` (+s), ``10`` (−s) where ``u·s < |v|``, else ``00``, four a byte;
    if ``residual`` has ``v``'s size, ``v − sign·s`` into it (sign of the code). Two piece
    loops written out, without and with the residual: one loop with a residual branch ran
    ~20% slower, and so did a shared inline helper for the codes."""
    n = v.size
    codes = np.empty(PIECE, np.uint8)
    us = np.empty(PIECE, np.float32)
    idx = np.arange(PIECE).astype(np.uint32)
    want = residual.size == n
    for base in range(0, 0 if want else n, PIECE):
        m = min(PIECE, n - base)
        vb = v[base:base + m]
        b32 = np.uint32(base)  # (< 2^32: the kernel runs on one counter block)
        for i in range(m):  # the counter-based uniforms (counter_rng), a loop of their own
            us[i] = _uniform(idx[i] + b32, k0, k1)  # 32-bit indices: ~30% faster than intp
        for i in range(m):
            a = vb[i]
            keep = np.uint8(np.float32(us[i] * s) < abs(a))
            codes[i] = (keep << np.uint8(1)) | (keep & np.uint8(a > 0))
        _pack2(codes, m, packed, base // 4)
    for base in range(0, n if want else 0, PIECE):
        m = min(PIECE, n - base)
        vb = v[base:base + m]
        b32 = np.uint32(base)
        for i in range(m):
            us[i] = _uniform(idx[i] + b32, k0, k1)
        for i in range(m):
            a = vb[i]
            keep = np.uint8(np.float32(us[i] * s) < abs(a))
            codes[i] = (keep << np.uint8(1)) | (keep & np.uint8(a > 0))
        _pack2(codes, m, packed, base // 4)
        rb = residual[base:base + m]
        for i in range(m):
            c = codes[i]
            sign = np.float32(1.0) if c == 3 else (np.float32(-1.0) if c == 2 else np.float32(0.0))
            rb[i] = vb[i] - sign * s


@njit
def _terngrad_add(packed, count, s, out):
    """``out[j] += sign(code_j)·s`` with the table (0, 0, −1, 1)."""
    codes = np.empty(PIECE, np.uint8)
    for base in range(0, count, PIECE):
        m = min(PIECE, count - base)
        _unpack2(packed, base // 4, m, codes)
        ob = out[base:base + m]
        for i in range(m):
            c = codes[i]
            sign = np.float32(1.0) if c == 3 else (np.float32(-1.0) if c == 2 else np.float32(0.0))
            ob[i] = ob[i] + sign * s


@njit
def _onebit_encode(v, cols, width, packed, means):
    """:func:`_onebit_sums` of ``v``, then ``means`` (float32, ``2 × cols``, flat) = each
    column's mean of its non-negative and of its negative entries (float64 sum / count,
    rounded once; 0 for a kind the column lacks): 1bit's whole compress."""
    n = v.size
    rows = n // cols if cols else 0
    lines = -(-n // width) if width else 0
    blocks = max(1, -(-lines // LINES))
    psums = np.zeros(blocks * cols, np.float64)
    nsums = np.zeros(blocks * cols, np.float64)
    nonneg = np.zeros(cols, np.int64)
    _onebit_sums(v, cols, width, packed, nonneg, psums, nsums)
    _add_blocks(psums, blocks, cols)
    _add_blocks(nsums, blocks, cols)
    for c in range(cols):
        pos = nonneg[c]
        means[c] = np.float32(psums[c] / np.float64(max(pos, 1)))
        means[cols + c] = np.float32(nsums[c] / np.float64(max(rows - pos, 1)))


def _add_blocks(sums, blocks, cols):
    """The ``blocks × cols`` block sums (flat) added pairwise into ``sums[:cols]``: while
    more than one row is left, row ``b`` += row ``b + ⌈count/2⌉`` (a middle row without a
    partner stays): ``gradzip.compressors.onebit._add_blocks``."""
    count = blocks
    while count > 1:
        half = (count + 1) // 2
        for t in range((count - half) * cols):
            sums[t] = sums[t] + sums[half * cols + t]
        count = half


def _onebit_sums(v, cols, width, packed, nonneg, psums, nsums):
    """1-bit codes ``v ≥ 0`` packed MSB-first into ``packed`` (``v``: the row-major ``rows ×
    cols`` matrix, flat, float32 or float64; compared in its own dtype); ``nonneg[c]`` += the
    column's count of them; ``psums``, ``nsums`` (``blocks × cols`` float64, flat): each
    block's column sums of the non-negative and of the negative parts, in the order
    docs/algorithms.md §codec: 1bit defines: lines of ``width`` entries (lane ``k`` is column
    ``k mod cols``), blocks of :data:`LINES` lines, float32 lanes adding the clamped entries
    (rounded to float32) line by line from 0.0, then widened and folded pairwise in float64
    to the columns (:func:`_fold_lanes`). Codes, counts and sums in one loop over a run of
    consecutive lanes (vectorised), then the piece is packed."""
    n = v.size
    codes = np.empty(ONEBIT_PIECE, np.uint8)
    lanes_p = np.zeros(width, np.float32)
    lanes_n = np.zeros(width, np.float32)
    wide = np.empty(2 * width, np.float64)
    counts = np.zeros(width, np.int32)  # at most a count of lines: < 2^31 up to 2^41 entries
    zero = np.float32(0.0)
    k = 0  # the lane of the next entry
    line = 0  # lines done in the current block
    b = 0  # the current block
    for base in range(0, n, ONEBIT_PIECE):
        m = min(ONEBIT_PIECE, n - base)
        vb = v[base:base + m]
        i = 0
        while i < m:
            run = min(m - i, width - k)
            xt = vb[i:i + run]
            pt = lanes_p[k:k + run]
            nt = lanes_n[k:k + run]
            ct = counts[k:k + run]
            dt = codes[i:i + run]
            for t in range(run):
                a = xt[t]
                ge = a >= 0
                f = np.float32(a)
                pt[t] += zero if f < zero else f  # torch's clamp(min=0)
                nt[t] += zero if f > zero else f  # clamp(max=0)
                dt[t] = ge
                ct[t] += ge
            i += run
            k += run
            if k == width:
                k = 0
                line += 1
                if line == LINES:
                    _fold_lanes(lanes_p, lanes_n, wide, cols, psums, nsums, b)
                    line = 0
                    b += 1
        _pack1(codes, m, packed, base // 8)
    if line or k:  # the partial last block (its missing entries add nothing)
        _fold_lanes(lanes_p, lanes_n, wide, cols, psums, nsums, b)
    for t in range(width):
        nonneg[t % cols] += counts[t]


def _fold_lanes(lanes_p, lanes_n, wide, cols, psums, nsums, b):
    """Block ``b``'s float32 lanes widened and folded pairwise in float64 (lane ``t`` + lane
    ``t + h``, ``h`` halving down to ``cols``: the same column) into ``psums``/``nsums[b·cols:]``;
    the lanes reset to 0.0. ``wide``: float64 scratch of twice the lanes."""
    size = lanes_p.size
    wp = wide[:size]
    wn = wide[size:]
    for t in range(size):
        wp[t] = lanes_p[t]
        wn[t] = lanes_n[t]
    _fold_pairwise(wp, size, cols)  # size = cols·2^j: each half holds the same columns
    _fold_pairwise(wn, size, cols)
    for t in range(cols):
        psums[b * cols + t] = wp[t]
        nsums[b * cols + t] = wn[t]
    lanes_p[:] = 0.0
    lanes_n[:] = 0.0


def _fold_pairwise(acc, size, width):
    """``acc[:size]`` added pairwise down to ``width`` entries (``size = width·2^j``): entry
    ``t`` += entry ``t + h`` for ``h = size/2``, then ``size/4``, ..., ``width``."""
    while size > width:
        h = size // 2
        for t in range(h):
            acc[t] = acc[t] + acc[t + h]
        size = h


def _pack1(codes, m, packed, at):
    """Pack the 1-bit ``codes[:m]`` (``codes`` an ONEBIT_PIECE scratch) MSB-first into ``packed[at:]``
    (:mod:`gradzip.compressors.bitpack`'s layout): each byte from one little-endian 64-bit
    word of eight 0/1 codes (vectorised, as the sign encoder packs)."""
    words = codes.view(np.uint64)
    full = m // 8
    out = packed[at:at + full]
    for g in range(full):
        out[g] = np.uint8((words[g] * PACK8) >> TOP8)
    rest = m - 8 * full
    if rest:  # the last, partial byte: codes past m are 0
        y = 0
        for t in range(rest):
            y |= int(codes[8 * full + t]) << (7 - t)
        packed[at + full] = np.uint8(y)


@njit
def _abs_max_bits(bits):
    """The largest ``bits_j & 0x7FFFFFFF`` of float32 bit patterns (int32): the bits of
    ``max_j |v_j|``, since non-negative floats order as their bits; a NaN lies above +inf,
    so any NaN gives a NaN; +0.0 for a zero or empty tensor. Exact in any order (an integer
    max, which LLVM vectorises without fastmath)."""
    top = np.int32(0)
    for i in range(bits.size):
        top = max(top, np.int32(bits[i] & np.int32(0x7FFFFFFF)))
    return top


@njit
def _square_sum_blocks(v, lanes, rows, partials):
    """``partials[b]`` = Σ v_j² over block ``b`` of ``rows`` lines of ``lanes`` entries: each
    square rounded to float32 (as torch's ``v * v``), widened, added into float64 lane
    ``j mod lanes`` from 0.0 line by line, the lanes then added pairwise: scaled_sign's ℓ1
    order (:func:`.elementwise.abs_sum_blocks`) applied to the squares."""
    n = v.size
    acc = np.zeros(lanes, np.float64)
    size = rows * lanes
    for b in range(max(1, -(-n // size))):
        acc[:] = 0.0
        first = b * size
        for s in range(first, min(n, first + size), lanes):
            row = v[s:min(n, s + lanes)]  # a partial last line: its missing entries add nothing
            for k in range(row.size):
                a = row[k]
                acc[k] += np.float64(a * a)
        _fold_pairwise(acc, lanes, 1)
        partials[b] = acc[0]


@njit
def _onebit_decode(packed, cols, pos, neg, v, mode, out):
    """``out[j] = pos[c]`` where bit ``j`` is set, ``neg[c]`` elsewhere (``c = j mod cols``);
    ``mode`` 1: ``v[j] − that`` instead (the residual; ``v`` has ``out``'s size); ``mode`` 2:
    ``out[j] + that`` (``v`` is ``out``). Both values are loaded before the choice, so it is
    a vector blend, not a branch on random bits."""
    n = out.size
    codes = np.empty(ONEBIT_PIECE, np.uint8)
    c = 0  # the column of the piece's first entry
    for base in range(0, n, ONEBIT_PIECE):
        m = min(ONEBIT_PIECE, n - base)
        _unpack1(packed, base // 8, m, codes)
        i = 0
        while i < m:  # one run of a row's columns at a time (the whole piece for one column)
            run = m - i if cols == 1 else min(m - i, cols - c)
            _onebit_run(codes[i:i + run], pos[c:c + run] if cols > 1 else pos, neg[c:c + run] if cols > 1 else neg,
                        v[base + i:base + i + run], mode, out[base + i:base + i + run], cols == 1)
            i += run
            c = (c + run) % cols


def _uniform(j, k0, k1):
    """``u_j`` from the block's keys (:func:`.counter_rng.numba_uniform` in the compiled
    kernels; this plain statement serves the kernels' ``py_func``)."""
    return np.float32(counter_rng.uniform_from_keys(int(j), int(k0), int(k1)))


def _onebit_run(ct, pt, nt, vt, mode, ot, one):
    """:func:`_onebit_decode` on one run (``one``: a single column, ``pt``/``nt`` its means)."""
    if one:
        p0 = pt[0]
        q0 = nt[0]
        if mode == 1:
            for t in range(ct.size):
                ot[t] = vt[t] - (p0 if ct[t] else q0)
        elif mode == 2:
            for t in range(ct.size):
                ot[t] = vt[t] + (p0 if ct[t] else q0)
        else:
            for t in range(ct.size):
                ot[t] = p0 if ct[t] else q0
        return
    if mode == 1:
        for t in range(ct.size):
            p = pt[t]
            q = nt[t]
            ot[t] = vt[t] - (p if ct[t] else q)
    elif mode == 2:
        for t in range(ct.size):
            p = pt[t]
            q = nt[t]
            ot[t] = vt[t] + (p if ct[t] else q)
    else:
        for t in range(ct.size):
            p = pt[t]
            q = nt[t]
            ot[t] = p if ct[t] else q


_M8 = np.uint64(0x00FF00FF00FF00FF)  # low byte of every 16-bit lane
_M16 = np.uint64(0x0000FFFF0000FFFF)  # low half of every 32-bit lane
_M32 = np.uint64(0xFFFFFFFF)


def _pack2(codes, m, packed, at):
    """:func:`_pack1` for 2-bit codes (terngrad's): each byte from one little-endian 32-bit
    word of four codes, a loop LLVM vectorises (the general 64-bit merge is serial; this ran
    ~6x faster)."""
    words = codes.view(np.uint32)
    full = m // 4
    out = packed[at:at + full]
    for k in range(full):
        out[k] = np.uint8((words[k] * PACK4) >> TOP4)
    rest = m - 4 * full
    if rest:  # the last, partial byte: codes past m are 0
        y = 0
        for t in range(rest):
            y |= int(codes[4 * full + t]) << (6 - 2 * t)
        packed[at + full] = np.uint8(y)


def _unpack2(packed, at, m, codes):
    """:func:`_unpack` for 2-bit codes: each byte into one little-endian word of four codes
    (vectorised, like :func:`_pack2`)."""
    words = codes.view(np.uint32)
    groups = (m + 3) // 4
    whole = min(groups, packed.size - at)
    src = packed[at:at + whole]
    for k in range(whole):
        b = np.uint32(src[k])
        words[k] = ((b >> np.uint32(6)) | ((b << np.uint32(4)) & np.uint32(0x300))
                    | ((b << np.uint32(14)) & np.uint32(0x30000)) | ((b & np.uint32(3)) << np.uint32(24)))
    for k in range(whole, groups):  # bytes past the end of packed read as 0
        words[k] = np.uint32(0)


def _pack_words(codes, m, bits, packed, at, merged):
    """Pack ``bits``-bit codes, a width known only at run time (qsgd's), MSB-first
    (:mod:`gradzip.compressors.bitpack`'s layout): each group of eight codes merged
    (:func:`_merge`) into the top of a 64-bit word and stored as 8 big-endian bytes at its
    own offset (:func:`_store_be64`, unaligned): its ``bits`` bytes, then zeros that the
    next group's store overwrites (one store per group instead of a branch and a store per
    byte; ~2x faster), the groups merged first into the scratch ``merged`` (``m/8`` words),
    a loop LLVM vectorises. Groups whose 8 bytes would pass the end of ``packed`` are written
    byte by byte. Pieces are written in order, so a store's zeros past the piece are
    overwritten by the next piece."""
    words = codes.view(np.uint64)
    full = m // 8
    top = np.uint64(64 - 8 * bits)
    room = packed.size - at
    safe = min(full, (room - 8) // bits + 1) if room >= 8 else 0
    for g in range(safe):  # the merges first, a loop of their own (vectorised)
        merged[g] = _merge(words[g], bits) << top
    for g in range(safe):
        _store_be64(packed, at + g * bits, merged[g])
    for g in range(safe, full):
        lo = _merge(words[g], bits) << top
        o = at + g * bits
        for t in range(bits):
            packed[o + t] = np.uint8(lo >> np.uint64(56 - 8 * t))
    rest = m - 8 * full
    if rest:  # the last, partial group: codes past m are 0
        lo = _merge(words[full] & ((np.uint64(1) << np.uint64(8 * rest)) - np.uint64(1)), bits)
        o = at + full * bits
        for t in range((rest * bits + 7) // 8):
            packed[o + t] = np.uint8((lo >> np.uint64(8 * (bits - 1 - t))) & np.uint64(0xFF))


def _unpack_words(packed, at, bits, m, codes):
    """:func:`_unpack` for a width known only at run time (qsgd's): each group read as the 8
    big-endian bytes at its offset (:func:`_load_be64`, unaligned) and shifted down to its
    ``bits`` bytes; the groups near the end of ``packed`` byte by byte (past it read as 0)."""
    words = codes.view(np.uint64)
    groups = (m + 7) // 8
    top = np.uint64(64 - 8 * bits)
    room = packed.size - at
    safe = min(groups, (room - 8) // bits + 1) if room >= 8 else 0
    for g in range(safe):  # the loads, then the splits in a loop of their own (vectorised)
        words[g] = _load_be64(packed, at + g * bits) >> top
    for g in range(safe):
        words[g] = _split(words[g], bits)
    for g in range(safe, groups):
        o = at + g * bits
        y = np.uint64(0)
        for t in range(bits):
            y = (y << np.uint64(8)) | (np.uint64(packed[o + t]) if o + t < packed.size else np.uint64(0))
        words[g] = _split(y, bits)


def _store_be64(packed, offset, value):
    """``packed[offset:offset + 8]`` = the uint64 ``value``, big-endian (in the compiled
    kernels an unaligned store of the byte-swapped word: :func:`_byte_intrinsics`)."""
    packed[offset:offset + 8] = np.frombuffer(int(value).to_bytes(8, "big"), np.uint8)


def _load_be64(packed, offset):
    """``packed[offset:offset + 8]`` read as a big-endian uint64 (:func:`_store_be64` backwards)."""
    return np.uint64(int.from_bytes(packed[offset:offset + 8].tobytes(), "big"))


@functools.cache
def _byte_intrinsics():
    """Numba intrinsics for :func:`_store_be64` and :func:`_load_be64`: one unaligned 8-byte
    store or load and ``llvm.bswap`` (numba has no unaligned access; a slice and ``view``
    per group ran 5x slower than the byte loop). The caller keeps ``offset + 8`` within
    the array."""
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic
    from numba.np.arrayobj import make_array

    i64 = ir.IntType(64)

    def address(context, builder, arrty, arr, offset):
        data = make_array(arrty)(context, builder, arr).data
        return builder.bitcast(builder.gep(data, [offset]), i64.as_pointer())

    def bswap(builder, value):
        return builder.call(builder.module.declare_intrinsic("llvm.bswap", [i64]), [value])

    @intrinsic
    def store_be64(typingctx, packed, offset, value):
        def codegen(context, builder, sig, args):
            ptr = address(context, builder, sig.args[0], args[0], args[1])
            builder.store(bswap(builder, args[2]), ptr, align=1)
            return context.get_dummy_value()
        return types.void(packed, types.intp, types.uint64), codegen

    @intrinsic
    def load_be64(typingctx, packed, offset):
        def codegen(context, builder, sig, args):
            return bswap(builder, builder.load(address(context, builder, sig.args[0], args[0], args[1]), align=1))
        return types.uint64(packed, types.intp), codegen

    return store_be64, load_be64


def _bswap(x):
    """The bytes of ``x`` reversed (LLVM makes it one instruction)."""
    x = ((x & _M8) << np.uint64(8)) | ((x >> np.uint64(8)) & _M8)
    x = ((x & _M16) << np.uint64(16)) | ((x >> np.uint64(16)) & _M16)
    return (x << np.uint64(32)) | (x >> np.uint64(32))


def _merge(x, bits):
    """Eight codes (the bytes of little-endian ``x``) as one group, the first code on top."""
    b = np.uint64(bits)
    lo = x & _M8
    x = (x >> np.uint64(8)) & _M8
    lo = (lo << b) | x
    x = (lo >> np.uint64(16)) & _M16
    lo = ((lo & _M16) << (b * np.uint64(2))) | x
    x = lo >> np.uint64(32)
    return ((lo & _M32) << (b * np.uint64(4))) | x


def _split(y, bits):
    """:func:`_merge` backwards: the group ``y`` as a word of eight code bytes."""
    b = np.uint64(bits)
    low1 = np.uint64((1 << bits) - 1) * np.uint64(0x0001000100010001)
    low2 = np.uint64((1 << 2 * bits) - 1) * np.uint64(0x0000000100000001)
    low4 = np.uint64((1 << 4 * bits) - 1)
    x = (y & low4) << np.uint64(32)  # codes 4..7 to the high half
    x |= y >> (b * np.uint64(4))  # codes 0..3
    y = (x & low2) << np.uint64(16)
    x = (x >> (b * np.uint64(2))) & low2
    x |= y
    y = (x & low1) << np.uint64(8)
    x = (x >> b) & low1
    return x | y


def _unpack1(packed, at, m, codes):
    """``codes[:m]`` = the 1-bit codes packed MSB-first from ``packed[at:]`` (:func:`_pack1`
    backwards; bytes past the end of ``packed`` read as 0): each byte spread into two
    little-endian 32-bit words of four codes, a loop LLVM vectorises (as :func:`_unpack2`)."""
    words = codes.view(np.uint32)
    groups = (m + 7) // 8
    whole = min(groups, packed.size - at)
    src = packed[at:at + whole]
    one = np.uint32(1)
    for g in range(whole):
        b = np.uint32(src[g])
        words[2 * g] = (((b >> np.uint32(7)) & one) | (((b >> np.uint32(6)) & one) << np.uint32(8))
                        | (((b >> np.uint32(5)) & one) << np.uint32(16)) | (((b >> np.uint32(4)) & one) << np.uint32(24)))
        words[2 * g + 1] = (((b >> np.uint32(3)) & one) | (((b >> np.uint32(2)) & one) << np.uint32(8))
                            | (((b >> np.uint32(1)) & one) << np.uint32(16)) | ((b & one) << np.uint32(24)))
    for g in range(2 * whole, 2 * groups):
        words[g] = np.uint32(0)


# -- the calls the codecs make (torch tensors in, Python numbers) ----------------------------
def decode_target(out: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Where a fused decode (always float32) writes: ``out`` when the packet's ``dtype`` is
    float32 and ``out`` fits (:func:`gradzip.kernels.decode_target`), else a float32 scratch
    to convert."""
    return _decode_target(out if dtype == torch.float32 else None, shape, torch.float32)


def _blocks(seed: int, numel: int):
    """``(start, stop, k0, k1)`` for each counter block of ``numel`` entries (one unless
    ``numel > 2^32``; one empty block for ``numel = 0``), keys as numpy uint64."""
    block = counter_rng.BLOCK
    for start in range(0, max(numel, 1), block):
        k0, k1 = counter_rng.keys(seed, start // block)
        yield start, min(numel, start + block), np.uint64(k0), np.uint64(k1)


def _residual_arrays(residual: torch.Tensor | None):
    """The residual's flat numpy view, or an empty array (the kernels' "not asked")."""
    if residual is None:
        return np.empty(0, np.float32)
    return array(residual.view(-1))


def qsgd_encode(v: torch.Tensor, scale: float, levels: int, bits: int, seed: int,
                packed: torch.Tensor, residual: torch.Tensor | None, step: float) -> None:
    """QSGD's codes of the flat contiguous float32 ``v`` into ``packed``; ``residual``: see
    :func:`_qsgd_encode`."""
    values, out, res = array(v), array(packed), _residual_arrays(residual)
    for start, stop, k0, k1 in _blocks(seed, v.numel()):
        _qsgd_encode(values[start:stop], np.float32(scale), levels, bits, k0, k1,
                     out[start // 8 * bits:], res[start:stop] if res.size else res, np.float32(step))


def qsgd_decode(packed: torch.Tensor, levels: int, bits: int, step: float, out: torch.Tensor,
                add: bool = False) -> None:
    """``out`` (contiguous float32) = the values of QSGD codes ``packed`` (``add``: ``+=``)."""
    _qsgd_decode(array(packed), out.numel(), levels, bits, np.float32(step), array(out.view(-1)), add)


def terngrad_encode(v: torch.Tensor, s: float, seed: int, packed: torch.Tensor,
                    residual: torch.Tensor | None) -> None:
    """TernGrad's codes of the flat contiguous float32 ``v`` into ``packed``."""
    values, out, res = array(v), array(packed), _residual_arrays(residual)
    for start, stop, k0, k1 in _blocks(seed, v.numel()):
        _terngrad_encode(values[start:stop], np.float32(s), k0, k1, out[start // 4:],
                         res[start:stop] if res.size else res)


def terngrad_decode(packed: torch.Tensor, s: float, out: torch.Tensor, add: bool = False) -> None:
    """``out`` (contiguous float32) = the values of TernGrad codes ``packed`` (``add``: ``+=``);
    without ``add`` through 2bit's table decode, the table ``(0, 0, −1, 1)·s`` (the products
    the kernel makes)."""
    if not add:
        ek.decode2(array(packed), np.float32([0.0, 0.0, -1.0, 1.0]) * np.float32(s), array(out.view(-1)))
        return
    _terngrad_add(array(packed), out.numel(), np.float32(s), array(out.view(-1)))


def onebit_encode(v: torch.Tensor, cols: int, packed: torch.Tensor, means: torch.Tensor) -> None:
    """1-bit codes of the flat contiguous float32 / float64 ``v`` (``cols`` columns) into
    ``packed``, the column means (``2 × cols`` float32, contiguous) into ``means``:
    :func:`_onebit_encode`, one pass over ``v``."""
    _onebit_encode(array(v), cols, lane_width(cols), array(packed), array(means.view(-1)))


def abs_max(v: torch.Tensor) -> float:
    """``max_j |v_j|`` of the flat contiguous float32 ``v`` (:func:`_abs_max_bits`): a float32
    value as a Python float; +0.0 for a zero or empty tensor, NaN if ``v`` holds one."""
    return float(np.int32(_abs_max_bits(array(v).view(np.int32))).view(np.float32))


def square_sum(v: torch.Tensor) -> float:
    """``Σ v_j²`` of the flat contiguous float32 ``v`` in the order docs/algorithms.md §codec:
    qsgd defines (:func:`_square_sum_blocks`, the block sums then added as scaled_sign adds
    its ℓ1 block sums: :func:`.elementwise.l1_of`)."""
    x = array(v)
    partials = np.empty(max(1, -(-x.size // ek.L1_BLOCK)), np.float64)
    _square_sum_blocks(x, ek.BLOCK, ek.ROWS, partials)
    return ek.l1_of(partials)


def onebit_decode(packed: torch.Tensor, cols: int, pos: torch.Tensor, neg: torch.Tensor,
                  out: torch.Tensor, v: torch.Tensor | None = None, add: bool = False) -> None:
    """``out`` = the decoded 1-bit tensor (``pos``/``neg``: float32 per column); with ``v``,
    ``v − decoded`` (the residual); with ``add``, ``out += decoded``."""
    flat = array(out.view(-1))
    mode = 1 if v is not None else (2 if add else 0)
    if cols == 1 and mode == 0 and pos.numel() == 1:  # one column: the sign codec's decode through the table (neg, pos)
        ek.decode1(array(packed), np.concatenate([array(neg), array(pos)]), flat)
        return
    _onebit_decode(array(packed), cols, array(pos), array(neg), flat if v is None else array(v), mode, flat)
