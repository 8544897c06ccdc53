"""S-SGD: synchronous data parallel, optionally with a codec and no error memory."""
from __future__ import annotations

from .core.overlap import GradientExchange


class SSGD(GradientExchange):
    """S-SGD (docs/algorithms.md §S-SGD): ``x ← x − η · aggregate_j C(d_j)``.

    With ``compressor="none"`` this is plain synchronous SGD: every worker applies the
    all-reduced mean of its direction ``d_i`` (gradient, weight decay, local momentum).
    With a codec and no error memory it is the unbiased-compressor family:
    ``"qsgd"``, ``"terngrad"``, ``"randomk:ratio=0.01,unbiased=true"``, and ``"sign"``
    (signSGD with majority vote; with momentum it is Signum). The model stays bitwise
    identical on every worker. The exchange starts during backward (``overlap_backward``,
    :mod:`gradzip.optim.core.overlap`).
    """

    exchange_residual = False
    inputs_keep_gradient_nonfinite = True   # d = g (+ λx, + momentum) keeps a NaN/Inf of g

    def __init__(self, params, lr, *, compressor="none", **kwargs):
        super().__init__(params, lr, **kwargs)
        self.psync = self.make_psync(compressor)
        # each aggregate is applied at once and never kept: its memory (the `none` bucket
        # buffer) serves the next step (gradzip.exchange, "Memory across steps")
        self.psync.reuse_aggregates = True

    def exchange_input(self, group, p):
        if not group["weight_decay"] and not group["momentum"]:
            return p.grad   # d = g: no copy (PSync reads it at once; a later change is caught)
        return self.local_direction(p, group)

    def apply_exchange(self, pairs, aggregates, residuals):
        self.descend(pairs, aggregates)   # x ← x − η mean_j g_j: one call per learning rate
