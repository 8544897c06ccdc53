"""EF-SGD: compression with error feedback."""
from __future__ import annotations

import torch

from .base import DistributedOptimizer


class EFSGD(DistributedOptimizer):
    """EF-SGD (Karimireddy et al. 2019; CSER slides Alg. 2; spec "Methods: EF-SGD")::

        p_i = e_i + η d_i;   p'_i = C(p_i);   e_i = p_i − p'_i;   x ← x − mean_j p'_j

    The error ``e_i`` (``state[p]["error"]``, gradzip's sign convention: what is still owed
    to the model) holds everything compression dropped and is added back next step. The
    model is identical on all workers. With the identity codec it is S-SGD; with one
    worker and a lossy codec it is not SGD (the error delays updates). 1-bit SGD is
    ``EFSGD(compressor="1bit")``, EF-signSGD ``EFSGD(compressor="scaled_sign")``.
    """

    def __init__(self, params, lr, *, compressor="topk:ratio=0.01", **kwargs):
        super().__init__(params, lr, **kwargs)
        self.psync = self.make_psync(compressor)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._evaluate(closure)
        self.steps += 1
        pairs = self.params_with_grad()
        params = [p for _, p in pairs]
        corrected = []
        for group, p in pairs:
            d = self.local_direction(p, group)
            error = self.state[p].get("error")
            corrected.append(d.mul_(group["lr"]) if error is None else error.add(d, alpha=group["lr"]))
        result = self.psync(corrected, self.steps, keys=self.keys(params))
        for p, agg, err in zip(params, result.aggregate, result.residual):
            self.state[p]["error"] = err
            p.sub_(agg)
        return loss
