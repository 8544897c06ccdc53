"""Local SGD: local steps, the workers' models averaged every H steps."""
from __future__ import annotations

import torch

from ..guards.nonfinite import NonFiniteAggregate
from .core.base import DistributedOptimizer
from .core.ratios import check_period


class LocalSGD(DistributedOptimizer):
    """Local SGD / periodic model averaging (docs/algorithms.md §Local SGD)::

        x_i ← x_i − η d_i                 # local step (d_i: gradient, weight decay, local momentum)
        if t mod H == 0:  x_i ← mean_j x_j

    The average is one allreduce of the parameters (PSync with ``none``). Momentum buffers
    stay local and are never averaged (as in the CSER reference code). Between
    synchronisations the workers' models differ (``replicas_differ``: the harness evaluates
    their average). With ``H = 1`` it is S-SGD up to float reassociation. Measured R_C is H.
    """

    replicas_differ = True

    def __init__(self, params, lr, *, H: int = 8, **kwargs):
        check_period(type(self).__name__, H)
        super().__init__(params, lr, **kwargs)
        self.H = H
        self.psync = self.make_psync("none")

    def exchanges_at(self, step: int) -> bool:
        """Only every H steps (the set's agreement: :mod:`gradzip.optim.core.participation`)."""
        return step % self.H == 0

    @torch.no_grad()
    def step(self, closure=None):
        loss, pairs, params, skipped = self.begin_step(closure)
        if skipped:
            return loss
        try:
            self.irreversible()  # the local step changes the model before the averaging
            for group, p in pairs:
                p.sub_(self.local_direction(p, group), alpha=group["lr"])
            if self.steps % self.H == 0:
                result = self.psync(params, self.steps, keys=self.keys(params), residual=False)
                for p, mean in zip(params, result.aggregate):
                    p.copy_(mean)
        except NonFiniteAggregate as overflow:  # a codec overflowed: undo + skip, or raise
            return self.codec_overflow(overflow, loss)
        return loss

    def metrics(self) -> dict[str, float]:
        return {"H": self.H}
