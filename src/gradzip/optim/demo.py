"""DeMo: decoupled momentum; only its fast DCT components are exchanged, and the step is
their sign.

docs/algorithms.md §DeMo (Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization",
2024; the box follows the reference code bloc97/DeMo ``demo.py`` where the paper's is less
precise). Per parameter, with the local momentum ``δ_i`` (``state[p]["delta"]``, never
exchanged whole), every step::

    x ← x·(1 − ηλ)                                   # decoupled weight decay
    v_i = β·δ_i + η·g_i                              # the momentum, η inside (as the code)
    (Q, r_i) = PSync(v_i; C);  δ_i ← r_i             # C = dct: per chunk the top-k DCT coefficients;
                                                     # δ_i keeps what was not sent: v_i − C(v_i)
    x ← x − η·sign(Q)                                # Q: per coefficient the mean over the senders

``C`` is the ``dct`` codec (``compressor="dct:chunk=64,topk=32"``, the reference defaults;
any codec may replace it, its aggregate then Q). ``Q`` is the same on every worker, so the
replicas stay identical. The exchange is an allgather of the packets: the codec's aggregate
reads whole tensors, so the two-phase transport is not offered (``reads_packets``).
"""
from __future__ import annotations

import torch

from ..compressors import Compressor
from ..exchange.complexes import real_view
from ..guards.nonfinite import NonFiniteAggregate
from ..validation import is_real, require
from .core.base import DistributedOptimizer
from .core.options import no_momentum


class DeMo(DistributedOptimizer):
    """DeMo (module docstring)::

        DeMo(params, lr, *, compressor="dct:chunk=64,topk=32", compression_decay=0.999,
             weight_decay=0.0, comm=None)

    ``compression_decay`` β in [0, 1); ``weight_decay`` λ is decoupled (``x ← x·(1 − ηλ)``);
    ``momentum`` must stay 0 (β is DeMo's momentum). ``state_dict()`` holds every worker's
    δ: a resume is bit for bit."""

    reads_packets = True

    @classmethod
    def default_lr(cls, options: dict) -> float:
        """A sign step moves every coordinate by η: AdamW's 0.001."""
        return 1e-3

    def __init__(self, params, lr, *, compressor: "str | Compressor" = "dct:chunk=64,topk=32",
                 compression_decay: float = 0.999, **kwargs):
        name = type(self).__name__
        no_momentum(name, kwargs.get("momentum", 0.0), kwargs.get("nesterov", False),
                    fix=" (DeMo's momentum is compression_decay)")
        require(is_real(compression_decay) and 0 <= compression_decay < 1, name,
                f"compression_decay (β) must be a number in [0, 1), got {compression_decay!r}")
        super().__init__(params, lr, **kwargs)
        self.compression_decay = float(compression_decay)
        self.psync = self.make_psync(compressor)

    @torch.no_grad()
    def step(self, closure=None):
        loss, pairs, params, skipped = self.begin_step(closure)
        if skipped:
            return loss
        inputs = []
        for group, p in pairs:
            delta = self.state[p].get("delta")
            v = torch.zeros_like(p) if delta is None else delta.mul(self.compression_decay)
            inputs.append(v.add_(p.grad, alpha=group["lr"]))
        try:
            res = self.psync(inputs, self.steps, keys=self.keys(params))
        except NonFiniteAggregate as overflow:  # a codec overflowed: skip, or raise
            return self.codec_overflow(overflow, loss)
        for (group, p), q, r in zip(pairs, res.aggregate, res.residual):
            self.state[p]["delta"] = r
            lr, wd = group["lr"], group["weight_decay"]
            if wd:
                p.mul_(1.0 - lr * wd)
            real_view(p).add_(torch.sign(real_view(q)), alpha=-lr)   # complex: the sign of each real entry
        return loss
