"""CSEA: compression with error reset every step (Xie et al., NeurIPS 2020)."""
from __future__ import annotations

from ..compressors import Compressor
from .core.overlap import GradientExchange
from .core.ratios import DEFAULT_RC, codec_for_ratio, single_codec


class CSEA(GradientExchange):
    """CSEA (CSER slides Alg. 4 and 7; docs/algorithms.md §CSEA)::

        p_i = e_i − η d_i
        (p'_i, e_new) = PSync(p_i; C1)          # p'_i = mean_j C1(p_j) + e_new
        x_i ← x_i − e_i + p'_i;   e_i ← e_new

    Unlike EF-SGD, the error is *reset* into the local model: ``x_i − e_i`` is the same on
    every worker (it moves by ``mean_j C1(p_j)``), while the models ``x_i`` themselves differ
    by their errors (``replicas_differ``: the harness evaluates their average). With one
    worker, or with ``compressor="none"``, it is exactly SGD (up to float reassociation),
    which EF-SGD is not. ``d_i`` carries weight decay and local momentum, never
    synchronised; ``state[p]["error"]`` holds ``e_i``.

    ``rc``: target R_C = R_C1, giving ``compressor = randblock:in=rc`` (see
    :mod:`gradzip.optim.core.ratios`); ``"auto"`` without rc is rc = 16 (``randblock:in=16``).
    The exchange starts during backward (``overlap_backward``, :mod:`gradzip.optim.core.overlap`).
    """

    replicas_differ = True

    def __init__(self, params, lr, *, compressor: str | Compressor = "auto", rc: float | None = None, **kwargs):
        codec, self.rc = single_codec(type(self).__name__, compressor, rc, codec_for_ratio(DEFAULT_RC))
        super().__init__(params, lr, **kwargs)
        self.psync = self.make_psync(codec)

    def exchange_input(self, group, p):
        d = self.local_direction(p, group)
        e = self.state[p].get("error")
        return d.mul_(-group["lr"]) if e is None else e.sub(d, alpha=group["lr"])   # p = e − η d

    def apply_exchange(self, pairs, aggregates, residuals):
        for (_, p), agg, r in zip(pairs, aggregates, residuals):
            e = self.state[p].get("error")
            if e is not None:
                p.sub_(e)                                        # x ← x − e + p'
            p.add_(agg).add_(r)
            self.state[p]["error"] = r                           # e ← e_new
