"""A tensor's memory digested in one pass, alone or while it is being copied: the edit guard of
the backward overlap (:mod:`gradzip.optim.core.fingerprint`; docs/algorithms.md §PSync,
"Overlap with backward").

The guard digests a gradient when its exchange reads it (in backward) and again at
``step()``; a difference means it was edited in between. Where the exchange copies the
gradient anyway (``none``'s bucket: the gradient is copied into the buffer the allreduce
sends), :func:`copy_parts` digests it in that copy, which costs no more than the copy
(docs/benchmarks/auto.md); :func:`digest` is the one-pass digest at ``step()``.

What it is: the tensor's memory read as 32-bit words, cut in rows of 1024 (``w_rj``, row ``r``,
column ``j``; the last row shorter), three sums modulo 2^32, with fixed column weights ``a_j``
(odd), ``b_j`` and a row weight ``c_r = (r · 0x9E3779B9) | 1`` (odd):

* ``s = Σ w_rj``: a change of one word always changes it, and so does any edit that moves
  the bit patterns one way (scaling, clamping, zeroing, noise);
* ``t = Σ_r c_r · Σ_j a_j · w_rj``: position-weighted, so a permutation (which keeps ``s``)
  changes it, inside a row (``a``) or across rows (``c``);
* ``u = Σ_r c_r · Σ_j b_j · (w_rj >> 16)``: sign flips that cancel in ``s`` and ``t`` (``[1, -1]``
  flipped: each flip moves a word by 2^31, which odd weights keep at 2^31) move ``u`` by 2^15
  times the difference of two weights ``b``.

Integer sums: exact in any order, so the loops vectorize (weights read from two tables of
1024, not computed per entry: the digest costs about one ``sum()``) and the digest made in a
copy equals the one made alone, bit for bit. An edit is missed only if it keeps all three,
which needs word changes that compensate each other in three independent weightings.

The kernels run where numba does (:func:`gradzip.kernels.enabled`: CPU) on contiguous
tensors of 4- or 8-byte entries (float32, float64, complex64 as its real view, int32, int64);
:func:`applies` says where; elsewhere the guard uses its torch fingerprint.
"""
from __future__ import annotations

import numpy as np
import torch

from . import array, enabled, njit

#: Up to this many entries a tensor's guard keeps a copy of its bytes instead of a digest
#: (cheaper than a kernel call; exact), and :func:`copy_parts` digests nothing.
SMALL = 4096


ROW = 1024


def _column_weights():
    """``a`` (odd) and ``b``: fixed, the same in every process."""
    j = np.arange(ROW, dtype=np.uint64)
    a = ((j * 0x85EBCA6B + 0x27D4EB2F) % 2**32).astype(np.uint32) | np.uint32(1)
    b = ((j * 0xC2B2AE35 + 0x165667B1) % 2**32).astype(np.uint32)
    return a, b


_A, _B = _column_weights()


@njit
def _copy_digest(w, dst, a, b):
    """The sums of ``w``, copying it into ``dst`` on the way where ``dst`` is as long (else
    ``dst`` is empty: the digest alone). Rows of 1024 in a loop of fixed length over
    contiguous words and weights, so that LLVM vectorizes it."""
    u32 = np.uint32
    s = u32(0)
    t = u32(0)
    u = u32(0)
    copy = dst.size == w.size
    n = w.size
    for r in range((n + 1023) // 1024):
        base = r * 1024
        width = min(1024, n - base)
        rs = u32(0)
        rt = u32(0)
        ru = u32(0)
        if copy and width == 1024:
            for j in range(1024):
                x = w[base + j]
                dst[base + j] = x
                rs = u32(rs + x)
                rt = u32(rt + u32(x * a[j]))
                ru = u32(ru + u32(u32(x >> u32(16)) * b[j]))
        elif width == 1024:
            for j in range(1024):
                x = w[base + j]
                rs = u32(rs + x)
                rt = u32(rt + u32(x * a[j]))
                ru = u32(ru + u32(u32(x >> u32(16)) * b[j]))
        else:   # the last row, shorter
            for j in range(width):
                x = w[base + j]
                if copy:
                    dst[base + j] = x
                rs = u32(rs + x)
                rt = u32(rt + u32(x * a[j]))
                ru = u32(ru + u32(u32(x >> u32(16)) * b[j]))
        c = u32(u32(u32(r) * u32(0x9E3779B9)) | u32(1))
        s = u32(s + rs)
        t = u32(t + u32(c * rt))
        u = u32(u + u32(c * ru))
    return s, t, u


def applies(t: torch.Tensor) -> bool:
    """Whether :func:`digest` runs for ``t`` (a numba kernel: CPU, contiguous, 4- or 8-byte
    entries or a complex view of them, not empty)."""
    size = t.element_size() // (2 if t.is_complex() else 1)
    return size in (4, 8) and t.numel() > 0 and t.is_contiguous() and enabled(t)


def _words(t: torch.Tensor):
    flat = t.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    return array(flat.reshape(-1).view(torch.int32)).view("uint32")


def _bytes(sums) -> torch.Tensor:
    return torch.tensor([int(v) for v in sums], dtype=torch.int64).view(torch.uint8)


def digest(t: torch.Tensor) -> torch.Tensor:
    """``t``'s digest (module docstring) as 24 bytes; where :func:`applies` says so."""
    words = _words(t)
    return _bytes(_copy_digest(words, words[:0], _A, _B))


def copy_parts(parts: list[torch.Tensor], out: torch.Tensor, digest_above: int) -> list[torch.Tensor | None]:
    """``torch.cat(parts, out=out)`` (flat parts of ``out``'s dtype, back to back), and the
    :func:`digest` of each part of more than ``digest_above`` entries where it applies, made
    in its copy (None for the others: copied as a run, by one ``cat``)."""
    digests: list[torch.Tensor | None] = [None] * len(parts)
    at, run, run_at = 0, [], 0

    def flush(end: int) -> None:
        if run:
            torch.cat(run, out=out[run_at:end]) if len(run) > 1 else out[run_at:end].copy_(run[0])
            run.clear()

    for j, part in enumerate(parts):
        n = part.numel()
        if n > digest_above and applies(part) and out.dtype == part.dtype:
            flush(at)
            digests[j] = _bytes(_copy_digest(_words(part), _words(out[at:at + n]), _A, _B))
        else:
            if not run:
                run_at = at
            run.append(part)
        at += n
    flush(at)
    return digests
