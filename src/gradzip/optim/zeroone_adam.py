"""0/1 Adam (docs/algorithms.md §"1-bit Adam, 0/1 Adam, 1-bit LAMB: the boxes", 0/1 Adam): the
shared machinery is :class:`gradzip.optim.onebit.CompressedAdaptive`."""
from __future__ import annotations

import math

import torch

from ..validation import is_int, require
from .onebit import DEFAULT_CODEC, CompressedAdaptive

class ZeroOneAdam(CompressedAdaptive):
    """0/1 Adam (Lu et al. 2023; DeepSpeed ``ZeroOneAdam``; docs/algorithms.md
    §"1-bit Adam, 0/1 Adam, 1-bit LAMB: the boxes", 0/1 Adam). Options (DeepSpeed's
    defaults): ``var_freeze_step`` T_v, ``var_update_scaler`` κ, ``local_step_scaler`` S,
    ``local_step_clipper`` H_max::

        Phase A, t ≤ T_v (every step communicates):
            if t mod I_v == 0:  ḡ = mean_j g_j;  v ← β2 v + (1−β2) ḡ⊙ḡ;  m ← β1 m + (1−β1) ḡ
                                c_v += 1; if c_v == κ: c_v = 0; I_v ← 2·I_v
            else:               ĝ = CAR(g_i);  m ← β1 m + (1−β1) ĝ       # v unchanged
            x ← x − η (m/(√v+ε) + λ·x)
        end of step T_v: worker errors ← 0 (once)
        Phase B, t > T_v, s = t − T_v (local steps, v frozen):
            m ← β1 m + (1−β1) g_i;  d = m/(√v+ε)
            x ← x − η (d + λ·x);  x_sync ← (1 − ηλ) x_sync;  u ← u − η d;  λ_Σ ← λ_Σ + η
            if s mod I_u == 0:  w = u ⊙ (√v+ε);  w̄ = CAR(w)
                                m ← −w̄/λ_Σ;  x ← x_sync + w̄/(√v+ε);  x_sync ← x;  u ← 0;  λ_Σ ← 0
            c_u += 1; if c_u == S: c_u = 0; I_u ← min(H_max, 2·I_u)

    Weight decay is decoupled and never communicated, in Phase B too: it is not part of
    ``u`` (the spec box's ``d = m/(√v+ε) + λ·x`` and DeepSpeed fold ``λ·x`` into u, so
    ``m ← −w̄/λ_Σ`` gains ``λ·x·(√v+ε)`` at every sync and the decay compounds through m,
    about ``λ/(1−β1)``: issue 17); each local step decays x and, identically on every
    worker, ``x_sync``. With the identity codec and I_u = 1 Phase B is Adam with v frozen
    (the test limit of 1-bit Adam). ``x_sync`` (the last synchronised x,
    ``state[p]["x_sync"]``) is stored rather than ``x − u`` so replicas stay bitwise
    identical; between syncs the workers' models differ (``replicas_differ``). With one
    worker ĝ = g_i. State: ``exp_avg``, ``exp_avg_sq``, ``update`` (u), ``lr_sum`` (λ_Σ),
    ``x_sync``, ``worker_error`` per parameter; I_v, c_v, I_u, c_u in the schedule.
    """

    replicas_differ = True

    def __init__(self, params, lr, *, var_freeze_step: int = 100000, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16, betas: "tuple[float, float] | str | None" = None,
                 beta1: float | None = None, beta2: float | None = None, eps: float = 1e-8,
                 compressor: str = DEFAULT_CODEC, bias_correction: bool = False,
                 momentum_mask: "str | dict | None" = None, momentum_bound: bool = False, **kwargs):
        name = type(self).__name__
        require(is_int(var_freeze_step) and var_freeze_step >= 0, name,
                f"var_freeze_step must be an integer >= 0, got {var_freeze_step!r}")
        for key, value in (("var_update_scaler", var_update_scaler), ("local_step_scaler", local_step_scaler),
                           ("local_step_clipper", local_step_clipper)):
            require(is_int(value) and value >= 1, name, f"{key} must be an integer >= 1, got {value!r}")
        super().__init__(params, lr, betas=betas, beta1=beta1, beta2=beta2, eps=eps, compressor=compressor,
                         bias_correction=bias_correction, momentum_mask=momentum_mask,
                         momentum_bound=momentum_bound, **kwargs)
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self._counters = {"var_interval": 1, "var_counter": 0, "local_interval": 1, "local_counter": 0}
        if self.bias_correction:   # v's number of updates (only then in the schedule: old states load)
            self._counters["var_updates"] = 0

    def _schedule(self):
        return self._counters

    def _load_schedule(self, schedule):
        self._counters = {k: int(v) for k, v in schedule.items()}

    def replicas_identical(self) -> bool:
        return self.steps <= self.var_freeze_step   # Phase A: every step synchronises x

    def _step(self, pairs, params):
        keys = self.keys(params)
        if self.steps <= self.var_freeze_step:
            self._phase_a(pairs, params, keys)
            if self.steps == self.var_freeze_step:
                self._reset_errors(params)
            return
        self._phase_b(pairs, params, keys)

    def _phase_a(self, pairs, params, keys):
        c = self._counters
        variance_step = self.steps % c["var_interval"] == 0
        if variance_step:
            grads = self._mean([p.grad for p in params], keys)
            if self.bias_correction:
                c["var_updates"] += 1
        else:
            grads, errors = self._car([p.grad for p in params],
                                      [self.state[p].get("worker_error") for p in params], keys)
            for p, e in zip(params, errors):
                if e is not None:
                    self.state[p]["worker_error"] = e
        for (group, p), g in zip(pairs, grads):
            state, (b1, b2) = self._moments(p), group["betas"]
            corr = self._corrections(group, c.get("var_updates", 0))
            if variance_step:
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
            else:
                g = self._guarded(p, g, group, corr[1], 1 / math.sqrt(1 - b2))
            state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
            p.sub_(self._adam_direction(state["exp_avg"], state["exp_avg_sq"], p, group, corr), alpha=group["lr"])
        if variance_step:
            c["var_counter"] += 1
            if c["var_counter"] == self.var_update_scaler:
                c["var_counter"], c["var_interval"] = 0, 2 * c["var_interval"]

    def _phase_b(self, pairs, params, keys):
        c = self._counters
        self.irreversible()   # the local step changes the model before the sync's exchange
        for group, p in pairs:
            state, b1 = self._moments(p), group["betas"][0]
            if "x_sync" not in state:   # the first local step: x is the synchronised model
                state["x_sync"] = p.detach().clone()
                state["update"] = torch.zeros_like(p)
                state["lr_sum"] = 0.0
            state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
            d = self._adam_direction(state["exp_avg"], state["exp_avg_sq"], p, dict(group, weight_decay=0.0),
                                     self._corrections(group, c.get("var_updates", 0)))
            if group["weight_decay"]:   # decoupled, local, never in u: x ← x − η(d + λx), x_sync ← (1 − ηλ) x_sync
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["x_sync"].mul_(1 - group["lr"] * group["weight_decay"])
            p.sub_(d, alpha=group["lr"])
            state["update"].sub_(d, alpha=group["lr"])
            state["lr_sum"] += group["lr"]
        if (self.steps - self.var_freeze_step) % c["local_interval"] == 0:
            corrs = [self._corrections(g, c.get("var_updates", 0)) for g, _ in pairs]
            denoms = [self._denominator(self.state[p]["exp_avg_sq"], g, c2) for (g, p), (_, c2) in zip(pairs, corrs)]
            w = [self.state[p]["update"] * den for p, den in zip(params, denoms)]
            synced, errors = self._car(w, [self.state[p].get("worker_error") for p in params], keys)
            for (group, p), den, wbar, e, (c1, c2) in zip(pairs, denoms, synced, errors, corrs):
                state = self.state[p]
                wbar = self._guarded(p, wbar, group, c2, self.adam_kappa(group["betas"]) * state["lr_sum"] / c1)
                if state["lr_sum"] > 0:   # λ_Σ = 0 only with lr 0, where nothing moved
                    state["exp_avg"] = wbar.div(-state["lr_sum"])
                    if c1 != 1.0:         # m̂ = −w̄/λ_Σ, stored uncorrected
                        state["exp_avg"].mul_(c1)
                p.copy_(state["x_sync"] + wbar / den)
                state["x_sync"] = p.detach().clone()
                state["update"].zero_()
                state["lr_sum"] = 0.0
                if e is not None:
                    state["worker_error"] = e
        c["local_counter"] += 1
        if c["local_counter"] == self.local_step_scaler:
            c["local_counter"], c["local_interval"] = 0, min(self.local_step_clipper, 2 * c["local_interval"])

    def metrics(self):
        c = self._counters
        return {"var_interval": float(c["var_interval"]), "local_interval": float(c["local_interval"])}
