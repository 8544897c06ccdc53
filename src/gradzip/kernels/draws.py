"""``randomk``'s draw on the CPU (docs/algorithms.md §codec: randomk): the entries whose
counter hash (:mod:`.counter_rng`) lies below a bound, in one numba pass that hashes a piece
of entries (a vectorised loop, the hash as 32-bit lanes: ``counter_rng.numba_hash``) and
then keeps those below the bound. :func:`gradzip.kernels.counter_rng.smallest_hashes` then
picks the k smallest: the same subset as its torch reference."""
from __future__ import annotations

import threading

import numpy as np
import torch

from . import counter_rng, njit as _njit

#: Entries hashed per piece (the hashes stay in L1).
PIECE = 4096
_ready: list[bool] = []
_lock = threading.Lock()


def _hash(j, k0, k1):
    """The hash of entry ``j`` (replaced by the numba intrinsic before the kernel compiles;
    this plain statement serves the kernel's ``py_func``)."""
    return np.uint32(counter_rng.keyed_hash(int(j), int(k0), int(k1)))


@_njit
def _below(k0, k1, n, bound, idx, found):
    cap = idx.size
    hs = np.empty(PIECE, np.uint32)
    lanes = np.arange(PIECE).astype(np.uint32)
    count = 0
    for base in range(0, n, PIECE):
        m = min(PIECE, n - base)
        b32 = np.uint32(base)
        for i in range(m):   # the hashes, a loop of their own (vectorised)
            hs[i] = _hash(lanes[i] + b32, k0, k1)
        for i in range(m):
            h = np.int64(hs[i])
            if h < bound:
                if count < cap:
                    idx[count] = base + i
                    found[count] = h
                count += 1
    return count


def below(seed: int, numel: int, bound: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, hashes)`` (int64, ascending) of the entries ``0 ... numel − 1`` whose hash is
    below ``bound`` (``numel <= 2^32``): :func:`gradzip.kernels.counter_rng.hashes_below`."""
    if not _ready:
        with _lock:
            if not _ready:
                globals()["_hash"] = counter_rng.numba_hash()   # numba resolves it when it compiles _below
                _ready.append(True)
    k0, k1 = counter_rng.keys(seed, 0)
    cap = min(numel, max(64, int(bound * numel / (1 << 32) * 1.25) + 64))
    for _ in range(2):
        idx, found = np.empty(cap, np.int64), np.empty(cap, np.int64)
        count = _below(np.uint64(k0), np.uint64(k1), numel, np.int64(bound), idx, found)
        if count <= cap:
            return torch.from_numpy(idx[:count]), torch.from_numpy(found[:count])
        cap = count
    raise AssertionError("unreachable: the second pass has room for every entry")
