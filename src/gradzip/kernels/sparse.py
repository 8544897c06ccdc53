"""Fused kernels of the sparsifiers (``topk``, ``dgc``, ``randomk``; compressors/sparsify.py,
compressors/dgc.py): the candidate scan, the residual, the decode and the aggregate, each
one pass over the dense tensor.

* :func:`scan`: the entries with ``|x| >= threshold``, ascending indices (int32) and raw
  values, written into reused scratch buffers; with ``residual``, the same pass copies
  ``x`` into it (a sparsifier's residual is ``x`` with the sent entries replaced, which
  :func:`fix_residual` then does for the few sent entries only).
* :func:`place`: ``out`` zero-filled, then the values scattered into it: copied
  (``index_copy_``, ``topk`` / ``randomk``) or added (``index_add_``, ``dgc``, whose
  padding repeats an index with value 0).
* :func:`mean_of`: every packet's values added into one zero-filled buffer, in packet
  order, then divided by ``n`` (``_util.scatter_mean``).

Bit-identical to the torch reference, which computes in the tensor's dtype: float32
arithmetic here is the same IEEE operations in the same order (fastmath off). 16-bit
floats are uint16 bit patterns (:func:`gradzip.kernels.array`); every kernel on them
needs no rounding: comparisons of magnitudes are comparisons of ``bits & 0x7FFF`` (NaN
excluded), ``0 + v`` is ``v`` (``-0`` becomes ``+0``), ``v − v`` is ``+0`` or NaN. Where a
16-bit result would need rounding (two non-zero values added into one slot), the kernel
says so and the caller takes the reference path. Which NaN bit pattern a NaN result gets
is the one thing left free (torch itself gives different ones on its vector and scalar
paths). Indices out of range make a kernel return -1 before writing anything out of
bounds; the caller then runs the reference, which raises.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from . import array, njit

#: 16-bit dtypes: the magnitude bits of +inf (the largest non-NaN magnitude) and the NaN
#: a 16-bit ``v − v`` of a non-finite ``v`` gets.
INF_BITS = {torch.float32: 0x7F800000, torch.float16: 0x7C00, torch.bfloat16: 0x7F80}
NAN_BITS = {torch.float16: 0x7E00, torch.bfloat16: 0x7FC0}
#: The dtypes the fused kernels take (others: the reference path).
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Entries per chunk of the scan (its flags stay in L1).
CHUNK = 4096
#: Per dtype: the (signed) integer type of its bits, and the mask of the magnitude bits.
BITS = {torch.float32: (np.int32, 0x7FFFFFFF), torch.float16: (np.int16, 0x7FFF),
        torch.bfloat16: (np.int16, 0x7FFF)}


def supported(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors' dtype (float32, float16, bfloat16)."""
    return all(t.dtype in DTYPES for t in tensors)


# -- the kernels (plain loops over flat arrays; numba compiles one version per dtype) ----------
@njit
def _scan(x, mask, lo, hi, idx, val, res, tab):
    # x: the bits as signed integers (int32 or int16); an entry passes iff
    # lo <= (x & mask) <= hi (non-negative magnitudes: signed compares, which vectorize;
    # unsigned ones do not). Per chunk of CHUNK entries: a vectorized pass writes one flag
    # byte per entry (and copies into res); another packs them into bits (8 flag bytes, a
    # little-endian word, times a magic number: entry j of the 8 -> bit j), so that 64
    # entries are one word; a zero word costs one test, the set bits of the others are
    # visited lowest first (isolate the lowest bit, its index by a de Bruijn multiply and
    # the 64-entry table ``tab``, clear it): no branch per entry, and no chain of loads
    # through the count (twice the speed of storing 8 candidates per flag word at 1%).
    n = x.size
    cap = idx.size
    copy = res.size == n
    flags = np.zeros(CHUNK, np.uint8)
    words = flags.view(np.uint64)
    packed = np.zeros(CHUNK // 8, np.uint8)
    groups = packed.view(np.uint64)
    magic = np.uint64(0x0102040810204080)
    top = np.uint64(56)
    one = np.uint64(1)
    count = 0
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        size = stop - start
        chunk = x[start:stop]
        if copy:
            dst = res[start:stop]
            for i in range(size):
                v = chunk[i]
                dst[i] = v
                m = v & mask
                flags[i] = (m >= lo) & (m <= hi)
        else:
            for i in range(size):
                m = chunk[i] & mask
                flags[i] = (m >= lo) & (m <= hi)
        if size < CHUNK:
            for i in range(size, CHUNK):
                flags[i] = 0
        for w in range(CHUNK // 8):
            packed[w] = (words[w] * magic) >> top
        for g in range(CHUNK // 64):
            bits = groups[g]
            base = 64 * g
            while bits:
                t = base + tab[((bits & (~bits + one)) * _DEBRUIJN) >> _DEBRUIJN_SHIFT]
                if count < cap:   # else the scratch is full: count only (the caller scans again)
                    idx[count] = start + t
                    val[count] = chunk[t]
                count += 1
                bits &= bits - one
    return count


#: The de Bruijn sequence of the scan's bit index: ``(b * _DEBRUIJN) >> 58`` is distinct for
#: the 64 one-bit words ``b``; :data:`_BIT_INDEX` maps it back to the bit's index.
_DEBRUIJN, _DEBRUIJN_SHIFT = np.uint64(0x03F79D71B4CB0A89), np.uint64(58)
_BIT_INDEX = np.zeros(64, np.int64)
_BIT_INDEX[[((1 << i) * 0x03F79D71B4CB0A89 % 2**64) >> 58 for i in range(64)]] = np.arange(64)


@njit
def _fix_float(res, x, idx, added):
    n = x.size
    for j in range(idx.size):
        if idx[j] < 0 or idx[j] >= n:
            return -1
    zero = np.float32(0.0)
    for j in range(idx.size):
        i = idx[j]
        v = x[i]
        if added:
            res[i] = v - (zero + v)
        else:
            res[i] = v - v
    return 0


@njit
def _fix_sub(res, x, idx, val):
    n = x.size
    for j in range(idx.size):
        if idx[j] < 0 or idx[j] >= n:
            return -1
    for j in range(idx.size):
        i = idx[j]
        res[i] = x[i] - val[j]
    return 0


@njit
def _fix_bits(res, x, idx, added, inf, nan):
    n = x.size
    for j in range(idx.size):
        if idx[j] < 0 or idx[j] >= n:
            return -1
    for j in range(idx.size):
        i = idx[j]
        v = x[i]
        if v & 0x7FFF >= inf:
            res[i] = nan
        elif added and v == 0x8000:   # -0 − (0 + -0) = -0 − +0 = -0
            res[i] = 0x8000
        else:
            res[i] = 0
    return 0


@njit
def _place_float(out, idx, val, added):
    n = out.size
    for j in range(idx.size):
        if idx[j] < 0 or idx[j] >= n:
            return -1
    zero = np.float32(0.0)
    for i in range(n):
        out[i] = zero
    if added:
        for j in range(idx.size):
            out[idx[j]] += val[j]
    else:
        for j in range(idx.size):
            out[idx[j]] = val[j]
    return 0


@njit
def _place_bits(out, idx, val, added, inf):
    n = out.size
    for j in range(idx.size):
        if idx[j] < 0 or idx[j] >= n:
            return -1
    for i in range(n):
        out[i] = 0
    if added:
        for j in range(idx.size):
            i = idx[j]
            v = val[j]
            s = out[i]
            if v & 0x7FFF == 0:          # s + ±0 = s (s is never -0 here)
                continue
            if s != 0:                    # two non-zero values: a rounded sum
                return 1
            out[i] = v                    # +0 + v = v (v non-zero, NaN stays NaN)
    else:
        for j in range(idx.size):
            out[idx[j]] = val[j]
    return 0


@njit
def _mean_float(total, idx, val, n):
    size = total.size
    for j in range(idx.size):
        if idx[j] < 0 or idx[j] >= size:
            return -1
    zero = np.float32(0.0)
    for i in range(size):
        total[i] = zero
    for j in range(idx.size):
        total[idx[j]] += val[j]
    d = np.float32(n)
    for i in range(size):
        total[i] = total[i] / d
    return 0


# -- scratch buffers, one set per thread (workers of gradzip.simulate run on threads) ---------
_scratch = threading.local()


#: Scratch entries a thread keeps between calls (16 MiB with float32 values); a larger
#: candidate set (a threshold of 0 over a mostly-zero tensor) gets a buffer of its own.
KEEP = 1 << 21


def _buffers(capacity: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Reused (int32 indices, values) scratch of at least ``capacity`` entries."""
    if capacity > KEEP:
        return torch.empty(capacity, dtype=torch.int32), torch.empty(capacity, dtype=dtype)
    held = getattr(_scratch, "bufs", None)
    if held is None:
        held = _scratch.bufs = {}
    idx, val = held.get(dtype, (None, None))
    if idx is None or idx.numel() < capacity:
        size = min(KEEP, max(capacity, 2 * (0 if idx is None else idx.numel()), 1024))
        idx, val = torch.empty(size, dtype=torch.int32), torch.empty(size, dtype=dtype)
        held[dtype] = (idx, val)
    return idx, val


def magnitude_bounds(thr: torch.Tensor) -> tuple[int, int]:
    """``(lo, hi)``: ``|x| >= thr`` (``thr`` a 0-d tensor of ``x``'s dtype) iff the magnitude
    bits ``m`` of ``x`` have ``lo <= m <= hi``: at most those of +inf (NaN never passes),
    at least those of ``thr`` (0 for a negative ``thr``); a NaN ``thr``: nothing passes."""
    int_type = torch.int32 if thr.dtype == torch.float32 else torch.int16
    _, mask = BITS[thr.dtype]
    bits = int(thr.view(int_type)) & (2 * mask + 1)
    inf = INF_BITS[thr.dtype]
    if bits & mask > inf:
        return 1, 0
    return (0 if bits > mask else bits), inf


def scan(flat: torch.Tensor, threshold, residual: torch.Tensor | None = None,
         expect: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, values)`` of the entries of the contiguous ``flat`` with
    ``|x| >= threshold`` (ascending int32 indices, raw values), as ``_util.above_threshold``
    and ``flat.index_select`` give them. ``threshold``: a number or a 0-d tensor, cast to
    ``flat``'s dtype as torch's comparison casts it. ``residual`` (flat, contiguous, same
    dtype): receives a copy of ``flat`` in the same pass. The results are views of this
    thread's scratch buffers, valid until its next :func:`scan`. ``expect``: the count
    expected (sizes the scratch; a larger count costs a second pass)."""
    if isinstance(threshold, torch.Tensor):
        thr = threshold.to(flat.dtype)
    else:   # a Python number: cast as torch casts the scalar of a comparison
        thr = torch.tensor(float(threshold), dtype=torch.float64).to(flat.dtype)
    signed, mask = BITS[flat.dtype]
    lo, hi = magnitude_bounds(thr)
    x = array(flat).view(signed)
    res = array(residual).view(signed) if residual is not None else x[:0]
    idx, val = _buffers(max(expect, 1) + 8, flat.dtype)
    for _ in range(2):
        count = _scan(x, signed(mask), signed(lo), signed(hi), idx.numpy(), array(val).view(signed), res,
                      _BIT_INDEX)
        if count + 8 <= idx.numel():
            return idx[:count], val[:count]
        idx, val = _buffers(count + count // 4 + 8, flat.dtype)
        res = x[:0]   # copied already
    raise AssertionError("unreachable: the second scan has room for every candidate")


def fix_residual(residual: torch.Tensor, flat: torch.Tensor, indices: torch.Tensor, added: bool,
                 values: torch.Tensor | None = None) -> None:
    """``residual[i] = x[i] − d[i]`` at the sent ``indices`` (int32), where the decoded ``d``
    is ``x`` itself (``added=False``: ``index_copy_``) or ``0 + x`` (``added=True``:
    ``index_add_`` into zeros), or (float32 only) the sent ``values`` copied there;
    elsewhere ``residual`` already holds ``x − 0 = x``."""
    r, x, i = array(residual), array(flat), indices.numpy()
    if values is not None:
        if flat.dtype != torch.float32 or added:
            raise ValueError("fix_residual(values=) takes float32 and index_copy_ decoding only")
        status = _fix_sub(r, x, i, array(values))
    elif flat.dtype == torch.float32:
        status = _fix_float(r, x, i, added)
    else:
        status = _fix_bits(r, x, i, added, np.uint16(INF_BITS[flat.dtype]), np.uint16(NAN_BITS[flat.dtype]))
    if status:
        raise IndexError(f"index out of range for a tensor of {flat.numel()} entries")


def place(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, added: bool) -> bool:
    """``out`` (flat, contiguous) zero-filled, then ``values`` copied (``index_copy_``) or added
    (``index_add_``) at ``indices`` (int32, contiguous), in one kernel. False (``out``
    unspecified) where the reference must do it: an index out of range (it raises), or two
    non-zero 16-bit values added into one entry (a rounded sum)."""
    o, i, v = array(out), indices.numpy(), array(values)
    if out.dtype == torch.float32:
        return _place_float(o, i, v, added) == 0
    return _place_bits(o, i, v, added, np.uint16(INF_BITS[out.dtype])) == 0


def mean_of(total: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, n: int) -> bool:
    """``total`` (flat float32) = zeros, ``values`` (float32) added at ``indices`` (int32) in
    order, divided by ``n``: ``_util.scatter_mean`` in one kernel. False: an index is out
    of range (``total`` unspecified; the reference raises)."""
    return _mean_float(total.numpy(), indices.numpy(), values.numpy(), n) == 0
