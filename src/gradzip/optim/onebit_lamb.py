"""1-bit LAMB (docs/algorithms.md §"1-bit Adam, 0/1 Adam, 1-bit LAMB: the boxes", 1-bit LAMB):
the shared machinery is :class:`gradzip.optim.onebit.CompressedAdaptive`."""
from __future__ import annotations

import math

import torch

from ..validation import is_int, is_real, require
from .onebit import DEFAULT_CODEC, CompressedAdaptive, norm

class OneBitLAMB(CompressedAdaptive):
    """1-bit LAMB (Li et al. 2022; DeepSpeed ``OnebitLamb``; docs/algorithms.md
    §"1-bit Adam, 0/1 Adam, 1-bit LAMB: the boxes", 1-bit LAMB). Per tensor ℓ: m, v, the
    fresh variance v_f, c̄ (EMA of the trust ratios, from 0), f_prev (from 1), s_ℓ::

        t ≤ T_w (LAMB on the mean gradient, no bias correction):
            m ← β1 m + (1−β1) ḡ;  v ← β2 v + (1−β2) ḡ⊙ḡ;  if t == T_w: v_f ← v
            u = m/(√v+ε) + λ·x
            r = clip(‖x‖/‖u‖, min_coeff, max_coeff) if ‖x‖, ‖u‖ > 0 else 1
            if r ≠ 1: c̄ ← β_c c̄ + (1−β_c) r
            x ← x − η r u
        once at t = T_w + 1: ρ_ℓ = ‖m_ℓ‖/√d_ℓ;  s_ℓ = mean_ℓ' ρ_ℓ' / ρ_ℓ  (1 where ρ_ℓ = 0)
        t > T_w:
            m_prev = m;  m_ℓ ← s_ℓ (β1 m_ℓ + (1−β1) g_i,ℓ);  M = CAR(concat_ℓ m_ℓ);  m_ℓ ← M_ℓ / s_ℓ
            per ℓ: ĝ = (m_ℓ − β1 m_prev,ℓ)/(1−β1);  v_f ← β2 v_f + (1−β2) ĝ⊙ĝ
                   u_p = m_ℓ/(√v+ε);  u = u_p + λ·x
                   f = max over elements of (√v+ε)/(√v_f+ε)
                   if λ > 0: q = min(1, ‖u_p‖/‖u‖); f ← f·q + (1−q)
                   f ← clip(f, factor_min, factor_max);  f ← clip(f, f_prev(1−θ_f), f_prev(1+θ_f));  f_prev ← f
                   x ← x − η (c̄·f) u

    All momenta go through ONE CAR over the concatenated model (one codec scale, hence the
    equalising s_ℓ); its worker error is kept per tensor (``state[p]["worker_error"]``).
    ``freeze_step`` T_w: DeepSpeed's default 100000.
    """

    def __init__(self, params, lr, *, freeze_step: int = 100000, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, betas: "tuple[float, float] | str | None" = None,
                 beta1: float | None = None, beta2: float | None = None, eps: float = 1e-8,
                 compressor: str = DEFAULT_CODEC, bias_correction: bool = False,
                 momentum_mask: "str | dict | None" = None, momentum_bound: bool = False, **kwargs):
        name = type(self).__name__
        require(is_int(freeze_step) and freeze_step >= 0, name,
                f"freeze_step must be an integer >= 0, got {freeze_step!r}")
        require(is_real(min_coeff) and is_real(max_coeff) and 0 < min_coeff <= max_coeff < math.inf, name,
                f"need 0 < min_coeff <= max_coeff (finite), got min_coeff={min_coeff!r}, max_coeff={max_coeff!r}")
        require(is_real(factor_min) and is_real(factor_max) and 0 < factor_min <= factor_max < math.inf, name,
                f"need 0 < factor_min <= factor_max (finite), got factor_min={factor_min!r}, "
                f"factor_max={factor_max!r}")
        require(is_real(coeff_beta) and 0 <= coeff_beta < 1, name, f"coeff_beta must be in [0, 1), got {coeff_beta!r}")
        require(is_real(factor_threshold) and 0 <= factor_threshold < 1, name,
                f"factor_threshold must be in [0, 1), got {factor_threshold!r}")
        super().__init__(params, lr, betas=betas, beta1=beta1, beta2=beta2, eps=eps, compressor=compressor,
                         bias_correction=bias_correction, momentum_mask=momentum_mask,
                         momentum_bound=momentum_bound, **kwargs)
        self.freeze_step = freeze_step
        self.max_coeff, self.min_coeff, self.coeff_beta = float(max_coeff), float(min_coeff), float(coeff_beta)
        self.factor_max, self.factor_min = float(factor_max), float(factor_min)
        self.factor_threshold = float(factor_threshold)

    def _lamb_state(self, p: torch.Tensor) -> dict:
        state = self._moments(p)
        if "fresh_exp_avg_sq" not in state:
            state["fresh_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["lamb_coeff"] = 0.0       # c̄
            state["last_factor"] = 1.0      # f_prev
        return state

    def _step(self, pairs, params):
        keys = self.keys(params)
        if self.steps <= self.freeze_step:
            self._warmup(pairs, params, keys)
        else:
            self._compressed(pairs, params)

    def _warmup(self, pairs, params, keys):
        means = self._mean([p.grad for p in params], keys)
        for (group, p), g in zip(pairs, means):
            state, (b1, b2) = self._lamb_state(p), group["betas"]
            state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
            state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
            if self.steps == self.freeze_step:
                state["fresh_exp_avg_sq"] = state["exp_avg_sq"].clone()
            u = self._adam_direction(state["exp_avg"], state["exp_avg_sq"], p, group,
                                     self._corrections(group, self.steps))
            x_norm, u_norm = norm(p), norm(u)
            r = min(max(x_norm / u_norm, self.min_coeff), self.max_coeff) if x_norm > 0 and u_norm > 0 else 1.0
            if r != 1.0:
                state["lamb_coeff"] = self.coeff_beta * state["lamb_coeff"] + (1 - self.coeff_beta) * r
            p.sub_(u, alpha=group["lr"] * r)

    def _scaling_coefficients(self, params) -> None:
        """``s_ℓ = mean_ℓ' ρ_ℓ' / ρ_ℓ``, ``ρ_ℓ = ‖m_ℓ‖/√d_ℓ`` (1 where ρ_ℓ = 0); once, at T_w + 1."""
        rho = [norm(self.state[p]["exp_avg"]) / math.sqrt(max(p.numel(), 1)) for p in params]
        mean = sum(rho) / len(rho) if rho else 0.0
        for p, r in zip(params, rho):
            self.state[p]["scaling_coeff"] = mean / r if r > 0 else 1.0

    def _compressed(self, pairs, params):
        for p in params:
            self._lamb_state(p)
        if any("scaling_coeff" not in self.state[p] for p in params):
            self._scaling_coefficients(params)   # from m of T_w alone: kept (equal) if this step is undone
        scaled = []
        for group, p in pairs:
            state, b1 = self.state[p], group["betas"][0]
            scaled.append(state["exp_avg"].mul(b1).add_(p.grad, alpha=1 - b1).mul_(state["scaling_coeff"]))
        errors = [self.state[p].get("worker_error") for p in params]
        flat_errors = None if all(e is None for e in errors) else torch.cat(
            [(e if e is not None else torch.zeros_like(p)).reshape(-1) for p, e in zip(params, errors)])
        synced, new_error = self._car([torch.cat([m.reshape(-1) for m in scaled])], [flat_errors], [0])
        offset = 0
        for group, p in pairs:
            state, (b1, b2) = self.state[p], group["betas"]
            n = p.numel()
            c1, c2 = self._corrections(group, self.freeze_step)
            m = self._guarded(p, synced[0][offset:offset + n].view_as(p).div(state["scaling_coeff"]), group, c2,
                              self.adam_kappa(group["betas"]))
            if new_error[0] is not None:
                state["worker_error"] = new_error[0][offset:offset + n].view_as(p).clone()
            offset += n
            g_hat = (m - state["exp_avg"].mul(b1)).div_(1 - b1)
            state["exp_avg"] = m
            state["fresh_exp_avg_sq"].mul_(b2).addcmul_(g_hat, g_hat, value=1 - b2)
            denom = self._denominator(state["exp_avg_sq"], group, c2)
            u_p = m / denom if c1 == 1.0 else m.div(c1).div_(denom)
            u = u_p.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else u_p
            fresh = self._denominator(state["fresh_exp_avg_sq"], group, self._corrections(group, self.steps)[1])
            f = float((denom / fresh).max()) if n else 1.0
            if group["weight_decay"] > 0:
                u_norm = norm(u)
                q = min(1.0, norm(u_p) / u_norm) if u_norm > 0 else 1.0
                f = f * q + (1 - q)
            f = min(max(f, self.factor_min), self.factor_max)
            prev = state["last_factor"]
            f = min(max(f, prev * (1 - self.factor_threshold)), prev * (1 + self.factor_threshold))
            state["last_factor"] = f
            p.sub_(u, alpha=group["lr"] * state["lamb_coeff"] * f)

    def metrics(self):
        return {"compressing": float(self.steps > self.freeze_step)}
