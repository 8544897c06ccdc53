"""S-SGD: synchronous data parallel, optionally with a codec and no error memory."""
from __future__ import annotations

import torch

from ..nonfinite import NonFiniteAggregate
from .base import DistributedOptimizer


class SSGD(DistributedOptimizer):
    """S-SGD (docs/algorithms.md §S-SGD): ``x ← x − η · aggregate_j C(d_j)``.

    With ``compressor="none"`` this is plain synchronous SGD: every worker applies the
    all-reduced mean of its direction ``d_i`` (gradient, weight decay, local momentum).
    With a codec and no error memory it is the unbiased-compressor family:
    ``"qsgd"``, ``"terngrad"``, ``"randomk:ratio=0.01,unbiased=true"``, and ``"sign"``
    (signSGD with majority vote; with momentum it is Signum). The model stays bitwise
    identical on every worker.
    """

    def __init__(self, params, lr, *, compressor="none", **kwargs):
        super().__init__(params, lr, **kwargs)
        self.psync = self.make_psync(compressor)

    @torch.no_grad()
    def step(self, closure=None):
        loss, pairs, params, skipped = self.begin_step(closure)
        if skipped:
            return loss
        try:
            directions = [self.local_direction(p, g) for g, p in pairs]
            result = self.psync(directions, self.steps, keys=self.keys(params), residual=False)
            for (group, p), agg in zip(pairs, result.aggregate):
                p.add_(agg, alpha=-group["lr"])
        except NonFiniteAggregate as overflow:  # a codec overflowed: undo + skip, or raise
            return self.codec_overflow(overflow, loss)
        return loss
