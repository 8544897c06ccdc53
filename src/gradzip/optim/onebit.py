"""1-bit Adam, 0/1 Adam and 1-bit LAMB: Adam / LAMB whose momentum (or gradient) crosses
the network through a compressed allreduce with error feedback (docs/algorithms.md
§"Compressed adaptive optimizers", §"1-bit Adam, 0/1 Adam, 1-bit LAMB: the boxes").

What the three share (:class:`CompressedAdaptive`):

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
- **CAR(y)**, the compressed allreduce, in one place (:meth:`CompressedAdaptive._car`):
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
from ..guards.nonfinite import NonFiniteAggregate
from ..guards.replicas import parameter_digest
from ..validation import is_real, require
from .core.base import DistributedOptimizer
from .core.options import no_momentum, parse_betas  # noqa: F401 (parse_betas: the old name's home)

#: DeepSpeed's 1-bit codec: sign with the ℓ2-preserving scale.
DEFAULT_CODEC = "scaled_sign:scale=rms"


def norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t))


class CompressedAdaptive(DistributedOptimizer):
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
            d = m.div(c[0]).div_(CompressedAdaptive._denominator(v, group, c[1]))
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


def __getattr__(name: str):
    """The three methods under this module's name, as before they had modules of their own."""
    from importlib import import_module
    homes = {"OneBitAdam": "onebit_adam", "ZeroOneAdam": "zeroone_adam", "OneBitLAMB": "onebit_lamb"}
    if name in homes:
        return getattr(import_module(f"{__package__}.{homes[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
