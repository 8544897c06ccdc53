"""The mean of an allreduced sum, made in place, and whether it is finite: one pass
(docs/algorithms.md §codec: none, fp16, bf16; §Non-finite gradients and the settings check).

An uncompressed exchange (the ``none`` codec's ``from_sums``, the DDP hook's uncompressed
buckets) ends with ``total /= n``, and the non-finite check then reads the mean once more:
two passes over the bucket where PyTorch's ``allreduce_hook`` makes one.
:func:`mean_in_place` makes both in one where numba runs (CPU, contiguous float32 or
float64): each entry divided by ``n`` in its own dtype (an IEEE division, as torch's
``div_``: the mean is bit-identical to it) and added to one accumulator. The accumulation
alone may be reordered (fast-math flag ``reassoc`` and nothing else, so LLVM vectorizes the
sum; no ``nnan``/``ninf``: NaN and Inf still propagate; no ``arcp``: no reciprocal), which
changes nothing but the rounding of a sum that only says finite or not. A sum is finite iff
every entry is, unless it overflows; a non-finite sum gets the exact look
(``isfinite().all()``). Elsewhere (other dtypes, devices, ``GRADZIP_KERNELS=torch``):
``div_`` then the sum, the same answers.
"""
from __future__ import annotations

import torch

from . import array, enabled, njit


@njit(fastmath={"reassoc"})
def _divide_and_sum(x, n):
    s = x.dtype.type(0.0)
    for i in range(x.size):
        v = x[i] / n
        x[i] = v
        s += v
    return s


def mean_in_place(total: torch.Tensor, n: int) -> bool:
    """``total.div_(n)`` (bit for bit), and whether every entry of the result is finite."""
    if total.dtype in (torch.float32, torch.float64) and total.is_contiguous() and enabled(total):
        values = array(total.detach().reshape(-1))
        summed = _divide_and_sum(values, values.dtype.type(n))
        if summed - summed == 0.0:   # finite (NaN and ±Inf make NaN)
            return True
    else:
        total.div_(n)
        if not (total.is_floating_point() or total.is_complex()) or bool(torch.isfinite(total.sum())):
            return True
    return bool(torch.isfinite(total).all())
