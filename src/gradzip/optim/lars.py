"""LARS: layer-wise adaptive rate scaling (You, Gitman, Ginsburg 2017; docs/algorithms.md
§Large-batch training, "LARS"). A plain single-worker ``torch.optim.Optimizer``: alone it
is LARS on this process's gradient; as the ``inner`` of :class:`gradzip.optim.Compressed`
it consumes the aggregated gradient (S-SGD exchange or any codec)."""
from __future__ import annotations

import torch

from ..validation import is_real, refuses_unknown_options, require
from .core.eager import EagerOptimizer
from .core.options import FLOAT32_MAX
from .core.participation import require_dense


def check_common(name: str, lr, weight_decay, eps, exclude_1d, where: str = "") -> None:
    """The checks LARS and LAMB share (``where`` prefixes the field, e.g. ``param_groups[1].``)."""
    require(is_real(lr) and 0 <= lr <= FLOAT32_MAX, name, f"{where}lr must be a finite number >= 0, got {lr!r}")
    require(is_real(weight_decay) and 0 <= weight_decay <= FLOAT32_MAX, name,
            f"{where}weight_decay must be a finite number >= 0, got {weight_decay!r}")
    require(is_real(eps) and 0 <= eps <= 1.0, name, f"{where}eps must be a number in [0, 1], got {eps!r}")
    require(isinstance(exclude_1d, bool), name, f"{where}exclude_1d must be True or False, got {exclude_1d!r}")


def excluded(p: torch.Tensor, group: dict) -> bool:
    """**[choice]** of the spec: tensors with one dimension or fewer (biases, norms) take no
    trust ratio and no weight decay when the group's ``exclude_1d`` is set."""
    return group["exclude_1d"] and p.dim() <= 1


class LARS(EagerOptimizer):
    """LARS, per parameter tensor ``w`` with gradient ``g`` (momentum m, weight decay λ,
    trust coefficient τ)::

        u = g + λ·w
        q = τ·‖w‖ / (‖g‖ + λ·‖w‖ + ε)   if ‖w‖ > 0 and ‖g‖ > 0, else 1
        b ← m·b + q·u                     # b = q·u on the first step
        w ← w − η·b

    ``exclude_1d=True`` (default): 1-D tensors take ``q = 1`` and ``λ = 0``. The momentum
    buffer is ``state[p]["momentum_buffer"]``. A parameter without a gradient is skipped
    (as ``torch.optim.SGD``)."""

    @refuses_unknown_options
    def __init__(self, params, lr: float, *, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8, exclude_1d: bool = True):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps, exclude_1d=exclude_1d)
        _check_lars("LARS", defaults)
        super().__init__(params, {k: (float(v) if k != "exclude_1d" else v) for k, v in defaults.items()})

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        _check_lars("LARS", self.param_groups[-1], f"param_groups[{len(self.param_groups) - 1}].",
                    on_error=self.param_groups.pop)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, p in enumerate(p for g in self.param_groups for p in g["params"]):   # before any update
            require_dense(p, "LARS", index)
        for group in self.param_groups:
            m, tau, eps = group["momentum"], group["trust_coefficient"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, skip = p.grad, excluded(p, group)
                wd = 0.0 if skip else group["weight_decay"]
                u = g.add(p, alpha=wd) if wd else g.clone()
                if not skip:
                    w_norm = torch.linalg.vector_norm(p)
                    g_norm = torch.linalg.vector_norm(g)
                    q = torch.where((w_norm > 0) & (g_norm > 0), tau * w_norm / (g_norm + wd * w_norm + eps),
                                    torch.ones_like(w_norm))
                    u.mul_(q)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = u
                else:
                    state["momentum_buffer"].mul_(m).add_(u)
                p.add_(state["momentum_buffer"], alpha=-group["lr"])
        return loss


def _check_lars(name: str, group: dict, where: str = "", on_error=None) -> None:
    try:
        check_common(name, group.get("lr"), group.get("weight_decay"), group.get("eps"), group.get("exclude_1d"), where)
        m, tau = group.get("momentum"), group.get("trust_coefficient")
        require(is_real(m) and 0 <= m < 1, name, f"{where}momentum must be in [0, 1), got {m!r}")
        require(is_real(tau) and 0 < tau <= FLOAT32_MAX, name,
                f"{where}trust_coefficient must be a finite number > 0 (the paper's 0.001), got {tau!r}")
    except Exception:
        if on_error is not None:
            on_error()
        raise
