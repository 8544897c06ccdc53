"""The mean of an allreduced sum, in place, and whether it is finite: one pass where torch
makes two (``div_``, then the sum that :func:`gradzip.guards.nonfinite.all_finite` reads).
What the DDP hook does with a bucket it sends uncompressed (docs/ddp.md, "The generic hook").

The kernel reads each entry's bits before dividing (a sum is finite iff its mean is:
dividing by ``n >= 1`` neither makes nor removes an Inf or a NaN) and keeps the smallest of
``~bits & EXPONENT``, which is 0 exactly where an exponent is all ones; integer ``min`` and
IEEE division vectorize without reassociating anything, so the mean is ``div_``'s bit for
bit (tests/test_kernels_average.py).
"""
from __future__ import annotations

import numpy as np
import torch

from . import array, enabled, njit

_EXPONENT = {torch.float32: np.uint32(0x7F800000), torch.float64: np.uint64(0x7FF0000000000000)}
_BITS = {torch.float32: np.uint32, torch.float64: np.uint64}


@njit
def _mean_checked(values, bits, exponent, n):
    lowest = exponent
    for i in range(values.size):
        lowest = min(lowest, ~bits[i] & exponent)
        values[i] = values[i] / n
    return lowest != 0


def mean_in_place(total: torch.Tensor, n: int) -> bool:
    """``total.div_(n)``; whether every entry is finite. One numba pass for a contiguous
    float32 / float64 CPU tensor where the numba kernels run, torch's two elsewhere."""
    if total.dtype in _EXPONENT and total.is_contiguous() and total.numel() and enabled(total):
        flat = array(total.view(-1))
        return bool(_mean_checked(flat, flat.view(_BITS[total.dtype]), _EXPONENT[total.dtype], flat.dtype.type(n)))
    total.div_(n)   # then the sum trick (as gradzip.guards.nonfinite.all_finite): exact where it overflows
    return bool(torch.isfinite(total.sum())) or bool(torch.isfinite(total).all())
