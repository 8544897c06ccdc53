"""BIT-SGD: MXNet's 2-bit compression with a residual on the raw gradient."""
from __future__ import annotations

import math

from ..compressors import build
from ..validation import is_real, require
from .core.overlap import GradientExchange


class BitSGD(GradientExchange):
    """BIT-SGD (docs/algorithms.md §BIT-SGD; the baseline of the CD-SGD papers)::

        p_i = e_i + g_i;   q_i = 2bit_t(p_i);   e_i = p_i − q_i
        x ← GlobalOpt(x, mean_j q_j)     # momentum SGD + weight decay, after the reduction

    What MXNet's parameter server does with ``--gc-type 2bit``: the residual
    (``state[p]["residual"]``) lives on the raw gradient (no learning rate inside), and
    learning rate, weight decay and momentum act on the aggregate, identically on every
    worker, so the model stays bitwise identical. It is CD-SGD without the local update
    and without the k-step correction. ``threshold`` is compared with *mean* gradients
    (MXNet compares 0.5 with batch-summed ones); see docs/algorithms.md §codec: 2bit. The
    exchange starts during backward (``overlap_backward``, :mod:`gradzip.optim.core.overlap`).
    """

    def __init__(self, params, lr, *, threshold: float | None = None, **kwargs):
        ok = threshold is None or (is_real(threshold)
                                   and math.isfinite(threshold) and threshold > 0)
        require(ok, "BitSGD", f"threshold must be > 0 and finite, got {threshold!r}")
        spec = "2bit" if threshold is None else f"2bit:threshold={threshold}"
        super().__init__(params, lr, **kwargs)
        self.psync = self.make_psync(build(spec))

    def exchange_input(self, group, p):
        residual = self.state[p].get("residual")
        return p.grad.clone() if residual is None else residual + p.grad      # p = e + g

    def apply_exchange(self, pairs, aggregates, residuals):
        for (group, p), agg, res in zip(pairs, aggregates, residuals):
            self.state[p]["residual"] = res
            self.global_update(p, agg, group)
