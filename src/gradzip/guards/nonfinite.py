"""One concept, used by the exchange, the optimizers and the DDP hooks: what happens when a
gradient, or what a codec made of it, holds a NaN or Inf (docs/algorithms.md §Non-finite
gradients and the settings check).

- :data:`NONFINITE_POLICIES`: ``"raise"`` (stop, naming where), ``"skip"`` (leave the step
  out on every worker), ``"off"`` (let the values through, e.g. for AMP's ``GradScaler``).
- :class:`NonFiniteGradient`: what a user sees (a worker's gradient, or a codec overflow).
- :class:`NonFiniteAggregate`: an exchange decoded a non-finite aggregate from finite inputs
  (internal to the layers; the optimizers turn it into a skipped step or a
  :class:`NonFiniteGradient`).
- :func:`first_nonfinite` / :func:`all_finite`: the one check, with the sum trick.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..errors import GradzipError

#: What a step does when some worker's gradient (or a decoded aggregate) holds a NaN or Inf.
NONFINITE_POLICIES = ("raise", "skip", "off")


class NonFiniteGradient(GradzipError):
    """A worker's gradient held a NaN or Inf (``nonfinite="raise"``): raised on that worker
    before anything was compressed, sent or updated (its peers then stop with a
    ``PeerFailure`` naming it). Also raised on every worker at once when an exchange decoded
    a non-finite aggregate from finite gradients (a codec overflow), the step undone where
    the method allows it (:meth:`gradzip.optim.DistributedOptimizer.irreversible`); and by
    the DDP hooks on every rank."""


class NonFiniteAggregate(GradzipError):
    """An exchange decoded a non-finite aggregate (the codec overflowed); raised on every
    worker at the same exchange. ``index``: the first such tensor's position."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


#: Up to this many entries a tensor's check is one of a batch (``torch._foreach_norm``, one call
#: for all such tensors of a dtype and device); a larger one is summed on its own, which
#: reads memory faster than the batched norm.
SMALL = 4096


def first_nonfinite(tensors: Sequence[torch.Tensor]) -> int:
    """Position of the first tensor holding a NaN or Inf, or -1: one sum per tensor (a sum is
    finite iff every element is, unless it overflows; a complex tensor's over its real view,
    both parts; small tensors' L1 norms in one batched call), an exact look only where it
    is not. Integer tensors are always finite."""
    if not tensors:
        return -1
    if _sums_finite([(torch.view_as_real(t) if t.is_complex() else t).detach() for t in tensors]):
        return -1
    return next((i for i, t in enumerate(tensors) if not bool(torch.isfinite(t).all())), -1)


def _sums_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether the sum (an L1 norm for small ones, batched) of every floating tensor is finite."""
    batches: dict = {}
    sums = []
    for t in tensors:
        if not t.is_floating_point():
            continue
        if t.numel() <= SMALL:
            batches.setdefault((t.dtype, t.device), []).append(t)
        else:
            sums.append(t.sum().float())
    checks = [torch.stack(torch._foreach_norm(batch, 1)) for batch in batches.values()]
    if sums:
        checks.append(torch.stack(sums))
    return all(bool(torch.isfinite(c).all()) for c in checks)


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite (:func:`first_nonfinite` finds none)."""
    return first_nonfinite(tensors) < 0
