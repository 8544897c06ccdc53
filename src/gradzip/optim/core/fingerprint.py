"""Has a tensor's content changed since a moment ago? A cheap fingerprint that answers it
without trusting the version counter (docs/algorithms.md §Overlap with backward).

The backward overlap (:mod:`gradzip.optim.core.overlap`) starts a parameter's exchange from its
gradient as the gradient hook sees it; an edit between ``backward()`` and ``step()`` must
send the edited gradient instead. Torch's version counter sees in-place edits of the
gradient tensor, but not those made through ``p.grad.data`` (another tensor object with a
counter of its own), through ``p.grad.data = ...`` (new memory under the same object), or
outside torch (numpy views, DLPack). :func:`fingerprint` reads the values themselves:
taken in the hook and again at ``step()``, a difference means the gradient changed.

What it is, where numba runs (CPU; contiguous tensors of 4- or 8-byte entries): the one-pass
integer digest of :mod:`gradzip.kernels.digest` (three position-weighted sums of the
tensor's 32-bit words), which the exchange can also make while it copies the gradient into
its bucket (``PSync.start(digest_inputs=True)``: no second read in backward). Elsewhere
(CUDA, 16-bit entries, ``GRADZIP_KERNELS=torch``): two passes over the tensor's memory, the
cost of two ``sum()`` calls, returned as raw bytes (compare with ``torch.equal``; equal values
give equal bytes):

* the sum of the entries' bit patterns as integers, modulo 2^32 (2^64 for 8-byte
  entries): a change of one entry's bits always changes it, and so does any edit that
  moves the bit patterns one way (scaling, clamping, zeroing, adding noise);
* position-weighted sums of the values, one per row of 1024 entries (weights in [0.5, 1.5),
  fixed; in float32 for 16-bit values, which costs their conversion): a sign flip or a
  permutation, which keeps the integer sum, changes them.

Either is missed only by an edit that moves entries' bits in compensating ways in every
one of its sums. Complex tensors are read as their real view (``torch.view_as_real``). The
same tensor (device, dtype, layout) always takes the same one of the two.

For a small tensor the half-dozen torch calls of a fingerprint cost more than its bytes:
:func:`snapshot` keeps a copy of the bytes of a tensor of up to :data:`SMALL` entries (exact:
any edit is seen) and the fingerprint of a larger one, and :func:`changed` compares a whole
set of snapshots with the tensors' current bytes and fingerprints in one ``torch.equal``
per device (a model of 400 small layers: one cat of their current bytes instead of 400
fingerprints).
"""
from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors

from ...kernels import digest
from ...kernels.digest import SMALL   # up to this many entries a snapshot is a copy of the bytes

#: Entries per weighted row (the weights are this long, per dtype and device).
ROW = 1024
_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
_weights: dict = {}


def _row_weights(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    w = _weights.get((dtype, device))
    if w is None:
        g = torch.Generator().manual_seed(0x66696E67)   # fixed: the same weights in every process
        w = _weights[(dtype, device)] = (torch.rand(ROW, generator=g, dtype=torch.float64) + 0.5).to(device=device, dtype=dtype)
    return w


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor that changes when ``t``'s values do (module docstring): equal values,
    equal bytes."""
    if digest.applies(t):
        return digest.digest(t)
    flat = t.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    flat = flat.reshape(-1)
    n = flat.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=flat.device)
    width = flat.element_size()
    bits = flat.view(_INT[width]).sum(dtype=torch.int64 if width == 8 else torch.int32)
    parts = [bits.reshape(1).view(torch.uint8)]
    values = flat if width >= 4 else flat.float()   # 16-bit sums would round a swap away
    w, rows = _row_weights(values.dtype, values.device), n // ROW
    if rows:
        parts.append(torch.mv(values[:rows * ROW].view(rows, ROW), w).view(torch.uint8))
    if n % ROW:
        parts.append(torch.dot(values[rows * ROW:], w[:n % ROW]).reshape(1).view(torch.uint8))
    return torch.cat(parts)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as flat bytes (a view where ``t`` is contiguous)."""
    flat = t.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    return flat.reshape(-1).view(torch.uint8)


def _flat_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The values of ``tensors`` (one dtype and device) back to back as bytes: a new tensor,
    made in one call (``torch._utils._flatten_dense_tensors``, as DDP's buckets)."""
    return _bytes(_flatten_dense_tensors(tensors))


def snapshot(t: "torch.Tensor | list[torch.Tensor]") -> torch.Tensor:
    """What :func:`changed` compares ``t`` with later: a copy of its bytes (up to
    :data:`SMALL` entries) or its :func:`fingerprint`; for a list of small tensors of one
    dtype and device, a copy of all their bytes made in one call."""
    if isinstance(t, (list, tuple)):   # (a list of one: the flatten is a view of it, so a copy)
        flat = _flat_bytes(list(t))
        return flat.clone() if len(t) == 1 else flat
    return _bytes(t).clone() if t.numel() <= SMALL else fingerprint(t)


def changed(pairs) -> bool:
    """Whether any tensor of ``pairs`` (``(tensor or list of tensors, its snapshot taken
    earlier)``) holds other values now: one comparison per device."""
    then: dict = {}
    now: dict = {}
    for t, taken in pairs:
        then.setdefault(taken.device, []).append(taken)
        if isinstance(t, (list, tuple)):
            current = _flat_bytes(list(t))
        else:
            current = _bytes(t) if t.numel() <= SMALL else fingerprint(t)
        now.setdefault(taken.device, []).append(current)
    return any(not torch.equal(torch.cat(then[d]), torch.cat(now[d])) for d in then)
