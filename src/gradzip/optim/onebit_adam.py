"""1-bit Adam (docs/algorithms.md §"1-bit Adam, 0/1 Adam, 1-bit LAMB: the boxes", 1-bit Adam): the
shared machinery (compressed allreduce with error feedback, masks, bounds, state) is
:class:`gradzip.optim.onebit.CompressedAdaptive`."""
from __future__ import annotations

from ..validation import is_int, require
from .onebit import DEFAULT_CODEC, CompressedAdaptive

class OneBitAdam(CompressedAdaptive):
    """1-bit Adam (Tang et al. 2021; DeepSpeed ``OnebitAdam``; docs/algorithms.md
    §"1-bit Adam, 0/1 Adam, 1-bit LAMB: the boxes", 1-bit Adam)::

        t ≤ T_w:  ḡ = mean_j g_j;  m ← β1 m + (1−β1) ḡ;  v ← β2 v + (1−β2) ḡ⊙ḡ
                  x ← x − η (m/(√v+ε) + λ·x)
        t > T_w:  m ← β1 m + (1−β1) g_i;  m ← CAR(m)          # identical on every worker
                  x ← x − η (m/(√v+ε) + λ·x)                   # v frozen at T_w

    ``freeze_step`` T_w (DeepSpeed's default 100000: set it to the warm-up you want, e.g.
    15-25% of the run). With the identity codec (``none``) and T_w ≥ the run's length it is
    Adam without bias correction on the mean gradient; with one worker, Adam whose v stops
    at T_w. The worker error of the compressed stage is ``state[p]["worker_error"]``.
    """

    def __init__(self, params, lr, *, freeze_step: int = 100000, betas: "tuple[float, float] | str | None" = None,
                 beta1: float | None = None, beta2: float | None = None, eps: float = 1e-8,
                 compressor: str = DEFAULT_CODEC, bias_correction: bool = False,
                 momentum_mask: "str | dict | None" = None, momentum_bound: bool = False, **kwargs):
        require(is_int(freeze_step) and freeze_step >= 0, type(self).__name__,
                f"freeze_step must be an integer >= 0, got {freeze_step!r}")
        super().__init__(params, lr, betas=betas, beta1=beta1, beta2=beta2, eps=eps, compressor=compressor,
                         bias_correction=bias_correction, momentum_mask=momentum_mask,
                         momentum_bound=momentum_bound, **kwargs)
        self.freeze_step = freeze_step

    def _step(self, pairs, params):
        keys = self.keys(params)
        if self.steps <= self.freeze_step:   # warm-up: Adam on the mean gradient
            means = self._mean([p.grad for p in params], keys)
            for (group, p), g in zip(pairs, means):
                state, (b1, b2) = self._moments(p), group["betas"]
                state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                c = self._corrections(group, self.steps)
                p.sub_(self._adam_direction(state["exp_avg"], state["exp_avg_sq"], p, group, c), alpha=group["lr"])
            return
        local = []
        for group, p in pairs:
            b1 = group["betas"][0]
            local.append(self._moments(p)["exp_avg"].mul(b1).add_(p.grad, alpha=1 - b1))
        synced, errors = self._car(local, [self.state[p].get("worker_error") for p in params], keys)
        for (group, p), m, e in zip(pairs, synced, errors):   # nothing changed before the exchange
            state = self.state[p]
            c = self._corrections(group, self.freeze_step)
            state["exp_avg"] = m = self._guarded(p, m, group, c[1], self.adam_kappa(group["betas"]))
            if e is not None:
                state["worker_error"] = e
            p.sub_(self._adam_direction(m, state["exp_avg_sq"], p, group, c), alpha=group["lr"])

    def metrics(self):
        return {"compressing": float(self.steps > self.freeze_step)}
