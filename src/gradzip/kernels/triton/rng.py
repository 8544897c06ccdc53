"""The counter-based uniforms of :mod:`gradzip.kernels.counter_rng` in Triton: ``u_j`` from the
entry's index in its counter block and the block's keys, in uint32 arithmetic (products
modulo 2**32), the same bits as the Python, torch and numba statements of the rule."""
from __future__ import annotations

import triton
import triton.language as tl

from .. import counter_rng

_M1 = tl.constexpr(counter_rng.M1)
_M2 = tl.constexpr(counter_rng.M2)


@triton.jit
def keyed_hash(j, k0, k1):
    """The 32-bit hash of the entries ``j`` (any integer tensor, taken mod 2**32) of the block
    with keys ``k0, k1`` (``counter_rng.keyed_hash``)."""
    x = j.to(tl.uint32) ^ k0.to(tl.uint32)
    x = x ^ (x >> 16)
    x = x * _M1
    x = x ^ k1.to(tl.uint32)
    x = x ^ (x >> 15)
    x = x * _M2
    return x ^ (x >> 15)


@triton.jit
def uniform(j, k0, k1):
    """``u_j = (hash >> 8)·2**-24`` in float32 (exact: fewer than 2**24 values)."""
    return (keyed_hash(j, k0, k1) >> 8).to(tl.float32) * 5.9604644775390625e-08
