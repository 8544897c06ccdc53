"""QSparse-local-SGD: local steps, compressed model-difference sync with error feedback."""
from __future__ import annotations

import torch

from ..compressors import Compressor
from ..guards.nonfinite import NonFiniteAggregate
from ..validation import require
from .core.base import DistributedOptimizer
from .core.ratios import DEFAULT_RC, check_period, check_rc, derive_periodic, is_auto


class QSparseLocalSGD(DistributedOptimizer):
    """QSparse-local-SGD (Basu et al. 2019; CSER slides Alg. 3; docs/algorithms.md
    §QSparse-local-SGD)::

        x_i ← x_i − η d_i                       # local step
        if t mod H == 0:
            p_i = e_i + x_i − x̂;  p'_i = C(p_i);  e_i = p_i − p'_i
            x̂ ← x̂ + mean_j p'_j;  x_i ← x̂

    State per parameter: ``state[p]["synced"]`` = x̂, the last synchronised model (the same
    on every worker; taken from the model at the first step), ``state[p]["error"]`` = e_i
    (error *feedback*: kept and added to the next difference). The local models differ
    between synchronisations (``replicas_differ``). ``d_i`` carries weight decay and local
    momentum, never synchronised. With H = 1 and ``compressor="none"`` it is S-SGD.

    ``rc``: target ``R_C = H·R_C1``, deriving the codec (and H unless given) as in
    :mod:`gradzip.optim.core.ratios`; ``"auto"``/``None`` without rc take the rc = 16 setting
    (H = 4, ``randblock:in=4``).
    """

    replicas_differ = True

    def __init__(self, params, lr, *, compressor: str | Compressor = "auto", H: int | None = None,
                 rc: float | None = None, **kwargs):
        name = type(self).__name__
        rc = check_rc(name, rc)
        if H is not None:
            check_period(name, H)
        if rc is not None and not is_auto(compressor):
            require(False, name, f"give either rc (codec derived from it) or compressor, not both; "
                                 f"got rc={rc:g} and compressor={compressor!r}")
        codec, H_auto = derive_periodic(name, DEFAULT_RC if rc is None else rc, H)
        super().__init__(params, lr, **kwargs)
        self.H = H if H is not None else H_auto
        self.rc = rc
        self.psync = self.make_psync(codec if is_auto(compressor) else compressor)

    def exchanges_at(self, step: int) -> bool:
        """Only every H steps (the set's agreement: :mod:`gradzip.optim.core.participation`)."""
        return step % self.H == 0

    @torch.no_grad()
    def step(self, closure=None):
        loss, pairs, params, skipped = self.begin_step(closure)
        if skipped:
            return loss
        try:
            self.irreversible()  # the local step changes the model before the synchronisation
            for group, p in pairs:
                state = self.state[p]
                if "synced" not in state:
                    state["synced"] = p.detach().clone()
                p.sub_(self.local_direction(p, group), alpha=group["lr"])   # local step
            if self.steps % self.H == 0:
                diffs = []
                for p in params:
                    state = self.state[p]
                    diff = p - state["synced"]
                    diffs.append(diff.add_(state["error"]) if "error" in state else diff)  # p = e + x − x̂
                res = self.psync(diffs, self.steps, keys=self.keys(params))
                for p, agg, r in zip(params, res.aggregate, res.residual):
                    state = self.state[p]
                    state["error"] = r                                      # e = p − C(p)
                    state["synced"].add_(agg)                               # x̂ ← x̂ + mean_j C(p_j)
                    p.copy_(state["synced"])                                # x_i ← x̂
        except NonFiniteAggregate as overflow:  # a codec overflowed: undo + skip, or raise
            return self.codec_overflow(overflow, loss)
        return loss

    def metrics(self) -> dict[str, float]:
        return {"H": self.H}
