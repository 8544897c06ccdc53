"""Triton kernels of the sparsifiers: the one pass over the dense tensor that each needs.

* :func:`scan`: ``topk``'s and ``dgc``'s candidates, the entries with ``|x| >= threshold``
  (indices and raw values), compacted through one atomic counter per program (and, asked,
  ``x`` copied into the residual in the same pass); they come back sorted by index, so the
  selection that follows (``compressors._util.largest``) sees them as the reference does.
* :func:`below`: ``randomk``'s draw, the entries whose counter hash (:mod:`.rng`) lies below a
  bound, hashed on the device (no memory read), compacted the same way.

Magnitudes compare as integers (the bits with the sign cleared, NaN never passing), as the
numba scan does (:func:`gradzip.kernels.sparse.magnitude_bounds`). Decoding and the mean of n
packets scatter k values per packet: torch's ``index_copy_`` / ``index_add_``, in packet order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import counter_rng
from ..sparse import BITS, magnitude_bounds
from .launch import run
from .rng import keyed_hash

#: Entries per program of the scans.
SCAN = 4096


@triton.jit(do_not_specialize=["lo", "hi", "mask", "n", "cap"])
def _scan(bits_ptr, lo, hi, mask, count_ptr, idx_ptr, val_ptr, res_ptr, n, cap, COPY: tl.constexpr,
          BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    b = tl.load(bits_ptr + offs, mask=inside, other=0)
    if COPY:
        tl.store(res_ptr + offs, b, mask=inside)
    m = b & mask
    flag = (m >= lo) & (m <= hi) & inside
    at = tl.atomic_add(count_ptr, tl.sum(flag.to(tl.int32), 0)) + tl.cumsum(flag.to(tl.int32), 0) - 1
    keep = flag & (at < cap)
    tl.store(idx_ptr + at, offs, mask=keep)
    tl.store(val_ptr + at, b, mask=keep)


def scan(flat: torch.Tensor, threshold, residual: torch.Tensor | None = None,
         expect: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, values)`` of the entries of the contiguous ``flat`` (float32 / 16-bit) with
    ``|x| >= threshold`` (a number or a 0-d tensor, cast to ``flat``'s dtype as torch's
    comparison casts it), indices ascending (int64); ``residual``: a copy of ``flat`` in the
    same pass. ``expect``: the count expected (a larger count costs a second pass)."""
    if isinstance(threshold, torch.Tensor):
        thr = threshold.to(flat.dtype).cpu()
    else:
        thr = torch.tensor(float(threshold), dtype=torch.float64).to(flat.dtype)
    signed, mask = BITS[flat.dtype]
    int_type = torch.int32 if signed == BITS[torch.float32][0] else torch.int16
    lo, hi = magnitude_bounds(thr)
    bits = flat.view(int_type)
    n = flat.numel()
    count = torch.zeros(1, dtype=torch.int32, device=flat.device)
    cap = max(expect, 1) + 8
    res = residual.view(int_type) if residual is not None else bits
    for _ in range(2):
        idx = torch.empty(cap, dtype=torch.int64, device=flat.device)
        val = torch.empty(cap, dtype=int_type, device=flat.device)
        count.zero_()
        run(_scan, (max(1, triton.cdiv(n, SCAN)),), bits, lo, hi, mask, count, idx, val, res, n, cap,
            COPY=residual is not None, BLOCK=SCAN)
        found = int(count.item())
        if found <= cap:
            order = torch.argsort(idx[:found])
            return idx[:found].index_select(0, order), val[:found].index_select(0, order).view(flat.dtype)
        cap, res = found, bits   # copied already
    raise AssertionError("unreachable: the second scan has room for every candidate")


@triton.jit(do_not_specialize=["k0", "k1", "bound", "n", "cap"])
def _below(k0, k1, bound, count_ptr, idx_ptr, hash_ptr, n, cap, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    h = keyed_hash(offs, k0, k1).to(tl.int64)
    flag = (h < bound) & (offs < n)
    at = tl.atomic_add(count_ptr, tl.sum(flag.to(tl.int32), 0)) + tl.cumsum(flag.to(tl.int32), 0) - 1
    keep = flag & (at < cap)
    tl.store(idx_ptr + at, offs, mask=keep)
    tl.store(hash_ptr + at, h, mask=keep)


def below(seed: int, numel: int, bound: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, hashes)`` (int64, any order) of the entries ``0 ... numel − 1`` whose hash is
    below ``bound`` (``numel <= 2^32``): :func:`gradzip.kernels.counter_rng.hashes_below` on
    the device."""
    k0, k1 = counter_rng.keys(seed, 0)
    count = torch.zeros(1, dtype=torch.int32, device=device)
    cap = min(numel, max(64, int(bound * numel / (1 << 32) * 1.25) + 64))
    for _ in range(2):
        idx = torch.empty(cap, dtype=torch.int64, device=device)
        found = torch.empty(cap, dtype=torch.int64, device=device)
        count.zero_()
        run(_below, (max(1, triton.cdiv(numel, SCAN)),), k0, k1, bound, count, idx, found, numel, cap, BLOCK=SCAN)
        got = int(count.item())
        if got <= cap:
            return idx[:got], found[:got]
        cap = got
    raise AssertionError("unreachable: the second pass has room for every entry")
