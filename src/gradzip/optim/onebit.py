"""1-bit Adam, 0/1 Adam and 1-bit LAMB: Adam / LAMB whose momentum (or gradient) crosses
the network through a compressed allreduce with error feedback (docs/algorithms.md
§"Compressed adaptive optimizers", §"1-bit Adam, 0/1 Adam, 1-bit LAMB: the boxes").

What the three share (:class:`_CompressedAdaptive`):

- **No bias correction, ε outside the root**: the update is ``m / (√v + ε)`` (DeepSpeed's
  code, which ignores ``bias_correction``). ``bias_correction=True`` (the spec's [choice]
  "an option may add it") divides as Adam does: ``m̂ = m/(1−β1^t)``, ``v̂ = v/(1−β2^n)``
  with n the number of updates v has had, so once v is frozen its correction is frozen
  with it (``1−β2^{T_w}``; 0/1 Adam: its count of variance steps) and only m's goes on
  (→ 1). Every ``√v + ε`` of a box becomes ``√v̂ + ε`` (0/1 Adam's w, x and, for 1-bit
  LAMB, v_f's with its own count t); where a box sets m from a corrected quantity (0/1
  Adam's sync ``m ← −w̄/λ_Σ``) m is stored uncorrected, ``·(1−β1^t)``.
- **Decoupled weight decay, never communicated** (0/1 Adam's synchronised update u too,
  see :class:`ZeroOneAdam`): ``x ← x − η (m/(√v+ε) + λ·x)``.
- **The codec**: any gradzip codec; the default is ``scaled_sign:scale=rms``, DeepSpeed's
  1-bit codec (``‖y‖₂/√d · sgn⁺(y)``).
- **The momentum mask** (``momentum_mask``; DeepSpeed's ``exp_avg_mask``, an option
  beyond the boxes, off by default): a sign codec cannot send an exact 0, so a coordinate
  whose gradient is 0 (an unused embedding row, a constant input pixel, the key bias of
  softmax attention) receives ``±s`` from CAR on every compressed step while its v ≈ 0,
  and moves by ``η·s/ε`` per step: the run blows up (docs/adaptive.md). The mask zeroes
  those coordinates of CAR's output: ``"auto"`` keeps where ``v̂ > ε²`` (√v̂ ≤ ε: the
  update's denominator is ε's, the exact-gradient Adam update there is below η/2), a
  ``{parameter: mask}`` dict multiplies by the caller's masks (DeepSpeed's way). Where it
  acts: 1-bit Adam's ``m ← CAR(m)``, 0/1 Adam's ``ĝ = CAR(g_i)`` and ``w̄ = CAR(w)``
  (a masked coordinate returns to x_sync at each sync), 1-bit LAMB's ``m_ℓ ← M_ℓ / s_ℓ``.
  It is derived from v (in the state) or given again on construction: resumes stay exact.
- **The momentum bound** (``momentum_bound=True``, beyond the boxes, off by default): exact
  Adam keeps ``|m| ≤ κ·√v`` per coordinate, ``κ = (1−β1)/√((1−β2)(1−β1²/β2))`` (Cauchy–
  Schwarz on the two moving averages, m and v uncorrected; needs β1² < β2), so its update
  ``m/(√v+ε)`` stays below κ. A sign codec breaks that where a coordinate's scale is far
  below its slice's (``±s`` against a small √v), the mask above only where v ≈ 0. The bound
  clamps CAR's output to what exact Adam could hold: 1-bit Adam's and 1-bit LAMB's m to
  ``±κ√v``; 0/1 Adam's ĝ to ``±√(v/(1−β2))`` (a gradient exact v has seen), its w̄ to
  ``±κ√v·λ_Σ/c1`` (the m it implies, ``−w̄·c1/λ_Σ``, to ``±κ√v``; c1 = 1 without bias
  correction). Applied after the mask; derived from the state, so resumes stay exact.
- **CAR(y)**, the compressed allreduce, in one place (:meth:`_CompressedAdaptive._car`):
  ``PSync(y + e_w)`` returns ``mean_j C(y_j + e_w,j)``, the same on every worker, and the
  worker error ``e_w ← (y + e_w) − C(y + e_w)`` that the method keeps in its state
  (``state[p]["worker_error"]``). The exchange is the spec's: PSync with
  ``transport="twophase"`` (``transport="auto"``, the default, means that here; another
  ``transport`` pins CAR's exchange), whose server error is exchange state (in
  ``state_dict()``; 0/1 Adam's error reset clears it too). With one worker CAR is the
  identity (no compression at all).
- The dense (warm-up, variance) steps average the gradient with PSync over ``none``.
- ``state_dict()`` holds every moment, error, coefficient and schedule counter: a resume is
  bit-exact (DeepSpeed resets the errors and 0/1 Adam's schedules on load).

gradzip step t is DeepSpeed's call t+1 (DeepSpeed's first ``step()`` updates nothing).
Hyper-parameters ``betas`` and ``eps`` live in the param groups (like ``torch.optim.Adam``);
``momentum`` must stay 0 (β1 is the momentum here).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..errors import GradzipError
from ..nonfinite import NonFiniteAggregate
from ..replicas import parameter_digest
from ..validation import is_int, is_real, require
from .base import DistributedOptimizer
from .options import no_momentum, parse_betas  # noqa: F401 (parse_betas: the old name's home)

#: DeepSpeed's 1-bit codec: sign with the ℓ2-preserving scale.
DEFAULT_CODEC = "scaled_sign:scale=rms"


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t))


class _CompressedAdaptive(DistributedOptimizer):
    """What 1-bit Adam, 0/1 Adam and 1-bit LAMB share (module docstring)."""

    group_options = ("betas", "eps")
    complex_parameters = False   # their moments (v = g²) read real entries (optim.participation)

    @classmethod
    def default_lr(cls, options: dict) -> float:
        return 1e-3   # Adam's (Kingma & Ba); 0.1, momentum SGD's, diverges on digits

    def __init__(self, params, lr, *, betas: "tuple[float, float] | str | None" = None, beta1: float | None = None,
                 beta2: float | None = None, eps: float = 1e-8, compressor: str = DEFAULT_CODEC,
                 bias_correction: bool = False, momentum_mask: "str | dict | None" = None, momentum_bound: bool = False, **kwargs):
        name = type(self).__name__
        betas = parse_betas(name, betas, beta1=beta1, beta2=beta2)
        require(isinstance(bias_correction, bool), name, f"bias_correction must be True or False, got {bias_correction!r}")
        self.bias_correction = bias_correction
        require(is_real(eps) and 0 <= eps < math.inf, name, f"eps must be a finite number >= 0, got {eps!r}")
        no_momentum(name, kwargs.get("momentum", 0.0), kwargs.get("nesterov", False))
        super().__init__(params, lr, betas=betas, eps=float(eps), **kwargs)
        self.momentum_mask = self._checked_mask(momentum_mask)
        require(isinstance(momentum_bound, bool), name, f"momentum_bound must be True or False, got {momentum_bound!r}")
        self.momentum_bound = momentum_bound
        if momentum_bound:
            self._check_bound_betas(self.param_groups)
        self.dense = self.make_psync("none", salt=0)          # ḡ = mean_j g_j
        # CAR: the two-phase compressed allreduce (worker error here, server error in the
        # exchange); transport="auto" means that, another transport pins the exchange
        self.car = self.make_psync(compressor, salt=1,
                                   transport="twophase" if self.transport == "auto" else self.transport)

    # -- the two exchanges ---------------------------------------------------------------
    def _mean(self, tensors: Sequence[torch.Tensor], keys: Sequence[int]) -> list[torch.Tensor]:
        """``mean_j t_j`` in full precision (one worker: the tensors themselves)."""
        if self.comm.world_size == 1:
            return [t.clone() for t in tensors]
        return self.dense(tensors, self.steps, keys=keys, residual=False).aggregate

    def _car(self, tensors: Sequence[torch.Tensor], errors: Sequence[torch.Tensor | None],
             keys: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """``CAR(y)`` of every tensor with its worker error (None: zeros): returns the
        aggregates ``mean_j C(y_j + e_j)`` and the new worker errors ``(y + e) − C(y + e)``;
        the caller stores the errors once its step can no longer be undone. One worker: the
        tensors themselves and the errors unchanged (no compression)."""
        if self.comm.world_size == 1:
            return [t.clone() for t in tensors], list(errors)
        inputs = [y if e is None else y + e for y, e in zip(tensors, errors)]
        result = self.car(inputs, self.steps, keys=keys, residual=True)
        return result.aggregate, result.residual

    def _checked_mask(self, mask) -> "str | dict | None":
        """``None`` (also ``"off"``), ``"auto"``, or ``{parameter: mask}`` with every mask of
        its parameter's shape (stored as the parameter's dtype and device)."""
        name = type(self).__name__
        if mask is None or mask == "off":
            return None
        if mask == "auto":
            return "auto"
        require(isinstance(mask, dict), name, f"momentum_mask must be 'auto', 'off', None or a dict "
                f"{{parameter: mask tensor}}, got {mask!r}; CLI: --momentum-mask auto")
        mine = {id(p) for group in self.param_groups for p in group["params"]}
        out = {}
        for p, m in mask.items():
            require(isinstance(p, torch.Tensor) and id(p) in mine, name,
                    "momentum_mask's keys must be this optimizer's parameters; build the dict from the same "
                    "model.parameters() you pass to the optimizer")
            require(isinstance(m, torch.Tensor) and m.shape == p.shape, name,
                    f"momentum_mask for a parameter of shape {tuple(p.shape)} must be a tensor of that shape, got "
                    f"{tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__}")
            out[id(p)] = m.detach().to(dtype=p.dtype, device=p.device)
        return out

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "momentum_bound", False):   # checked first: a refused group is not added
            self._check_bound_betas([{"betas": param_group.get("betas", self.defaults["betas"])}])
        super().add_param_group(param_group)

    def _check_bound_betas(self, groups) -> None:
        for i, group in enumerate(groups):
            b1, b2 = group["betas"]
            require(b1 * b1 < b2, type(self).__name__,
                    f"momentum_bound needs beta1² < beta2 (exact Adam's |m| <= kappa·sqrt(v) is unbounded otherwise), "
                    f"got betas {group['betas']} in param_groups[{i}]; raise beta2 or turn momentum_bound off")

    @staticmethod
    def adam_kappa(betas: tuple[float, float]) -> float:
        """``κ = (1−β1)/√((1−β2)(1−β1²/β2))``: exact Adam's largest ``|m|/√v`` (module docstring);
        +inf where β1² ≥ β2 (β2 = 0 included): the ratio is unbounded there, which
        ``momentum_bound`` refuses, and with the bound off nothing is clamped."""
        b1, b2 = betas
        if b1 * b1 >= b2:
            return math.inf
        return (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))

    def _guarded(self, p: torch.Tensor, t: torch.Tensor, group: dict, c2: float, bound: float) -> torch.Tensor:
        """``t`` (a CAR output for ``p``), in place: times the momentum mask (``c2``: v's
        bias correction, ``v̂ = v / c2``), then, with ``momentum_bound``, clamped to
        ``±bound·√v`` (module docstring; ``bound`` is the caller's multiple of √v)."""
        if self.momentum_mask == "auto":
            t.mul_(self.state[p]["exp_avg_sq"] > group["eps"] ** 2 * c2)
        elif self.momentum_mask is not None and id(p) in self.momentum_mask:
            t.mul_(self.momentum_mask[id(p)])
        if self.momentum_bound:
            limit = self.state[p]["exp_avg_sq"].sqrt().mul_(bound)
            t.clamp_(min=limit.neg(), max=limit)
        return t

    def describe(self) -> dict:
        fields = super().describe()
        if isinstance(self.momentum_mask, dict):   # given masks: every worker must hold the same
            order = [id(p) for p in self._all_params()]
            fields["momentum_mask"] = {i: parameter_digest(self.momentum_mask[k])
                                       for i, k in enumerate(order) if k in self.momentum_mask}
        return fields

    def _reset_errors(self, params: Sequence[torch.Tensor]) -> None:
        """Every worker error ← 0 (0/1 Adam at the end of its variance phase)."""
        for p in params:
            self.state[p].pop("worker_error", None)
        self.car.server_errors.reset()

    # -- shared pieces of the boxes ------------------------------------------------------
    def _moments(self, p: torch.Tensor) -> dict:
        """``state[p]`` with ``exp_avg`` (m) and ``exp_avg_sq`` (v) created as zeros."""
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _corrections(self, group: dict, v_updates: int) -> tuple[float, float]:
        """``(1−β1^t, 1−β2^n)`` for m at this step and for a v updated ``n`` times, with
        ``bias_correction`` (module docstring); ``(1, 1)`` without (or for n = 0: v = 0)."""
        if not self.bias_correction:
            return 1.0, 1.0
        b1, b2 = group["betas"]
        return 1 - b1 ** self.steps, (1 - b2 ** v_updates) if v_updates else 1.0

    @staticmethod
    def _denominator(v: torch.Tensor, group: dict, c2: float = 1.0) -> torch.Tensor:
        """``√v̂ + ε``, ``v̂ = v / c2`` (c2 = 1: ``√v + ε``)."""
        return (v.sqrt() if c2 == 1.0 else v.div(c2).sqrt_()).add_(group["eps"])

    @staticmethod
    def _adam_direction(m: torch.Tensor, v: torch.Tensor, p: torch.Tensor, group: dict,
                        c: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """``m̂/(√v̂+ε) + λ·x``, ``m̂ = m/c[0]``, ``v̂ = v/c[1]`` (:meth:`_corrections`; the
        default (1, 1): no bias correction), ε outside the root, decoupled decay."""
        if c == (1.0, 1.0):
            d = m / (v.sqrt() + group["eps"])
        else:
            d = m.div(c[0]).div_(_CompressedAdaptive._denominator(v, group, c[1]))
        return d.add_(p, alpha=group["weight_decay"]) if group["weight_decay"] else d

    def _step(self, pairs: list, params: list) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss, pairs, params, skipped = self.begin_step(closure)
        if skipped:
            return loss
        try:
            self._step(pairs, params)
        except NonFiniteAggregate as overflow:   # a codec overflowed: undo + skip, or raise
            return self.codec_overflow(overflow, loss)
        return loss

    # -- state ---------------------------------------------------------------------------
    def _schedule(self) -> dict:
        """The method's counters beyond ``steps`` (saved in ``state_dict()``)."""
        return {}

    def _load_schedule(self, schedule: dict) -> None:
        pass

    def state_dict(self) -> dict:
        out = super().state_dict()
        out["gradzip"]["schedule"] = dict(self._schedule())
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        extra = state_dict.get("gradzip")
        schedule = extra.get("schedule") if isinstance(extra, dict) else None
        super().load_state_dict(state_dict)   # refuses another method / world size first
        if not isinstance(schedule, dict) or set(schedule) != set(self._schedule()):
            raise GradzipError(f"{type(self).__name__}.load_state_dict: the state has no valid 'schedule' entry "
                               "(saved by another gradzip version?); load a state saved by this method's state_dict()")
        self._load_schedule(schedule)


class OneBitAdam(_CompressedAdaptive):
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


class ZeroOneAdam(_CompressedAdaptive):
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


class OneBitLAMB(_CompressedAdaptive):
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
            x_norm, u_norm = _norm(p), _norm(u)
            r = min(max(x_norm / u_norm, self.min_coeff), self.max_coeff) if x_norm > 0 and u_norm > 0 else 1.0
            if r != 1.0:
                state["lamb_coeff"] = self.coeff_beta * state["lamb_coeff"] + (1 - self.coeff_beta) * r
            p.sub_(u, alpha=group["lr"] * r)

    def _scaling_coefficients(self, params) -> None:
        """``s_ℓ = mean_ℓ' ρ_ℓ' / ρ_ℓ``, ``ρ_ℓ = ‖m_ℓ‖/√d_ℓ`` (1 where ρ_ℓ = 0); once, at T_w + 1."""
        rho = [_norm(self.state[p]["exp_avg"]) / math.sqrt(max(p.numel(), 1)) for p in params]
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
                u_norm = _norm(u)
                q = min(1.0, _norm(u_p) / u_norm) if u_norm > 0 else 1.0
                f = f * q + (1 - q)
            f = min(max(f, self.factor_min), self.factor_max)
            prev = state["last_factor"]
            f = min(max(f, prev * (1 - self.factor_threshold)), prev * (1 + self.factor_threshold))
            state["last_factor"] = f
            p.sub_(u, alpha=group["lr"] * state["lamb_coeff"] * f)

    def metrics(self):
        return {"compressing": float(self.steps > self.freeze_step)}
