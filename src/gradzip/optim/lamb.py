"""LAMB: layer-wise adaptive moments (You et al. 2020, Algorithm 2, with bias correction;
docs/algorithms.md §Large-batch training, "LAMB"). A plain single-worker
``torch.optim.Optimizer``, usable alone or as the ``inner`` of :class:`gradzip.optim.Compressed`."""
from __future__ import annotations

import torch

from ..validation import is_real, refuses_unknown_options, require
from .core.eager import EagerOptimizer
from .lars import check_common, excluded
from .core.participation import require_dense


class LAMB(EagerOptimizer):
    """LAMB, per parameter tensor ``w`` with gradient ``g`` (betas β1, β2, ε, weight decay λ)::

        m ← β1·m + (1−β1)·g;   v ← β2·v + (1−β2)·g²
        m̂ = m / (1−β1^t);      v̂ = v / (1−β2^t)
        r = m̂ / (√v̂ + ε) + λ·w
        q = ‖w‖ / ‖r‖   if ‖w‖ > 0 and ‖r‖ > 0, else 1      # φ = identity, no clipping
        w ← w − η·q·r

    ``exclude_1d=True`` (default): 1-D tensors take ``q = 1`` and ``λ = 0``. No gradient
    clipping. State per parameter: ``step`` (t, from 1), ``exp_avg`` (m), ``exp_avg_sq`` (v).
    A parameter without a gradient is skipped (its t does not advance). A complex parameter
    is taken as its real view (``torch.view_as_real``), as torch's Adam does."""

    @refuses_unknown_options
    def __init__(self, params, lr: float, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, exclude_1d: bool = True):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, exclude_1d=exclude_1d)
        _check_lamb(defaults)
        defaults.update(lr=float(lr), eps=float(eps), weight_decay=float(weight_decay),
                        betas=(float(betas[0]), float(betas[1])))
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        try:
            _check_lamb(self.param_groups[-1], f"param_groups[{len(self.param_groups) - 1}].")
        except Exception:
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, p in enumerate(p for g in self.param_groups for p in g["params"]):   # before any update
            require_dense(p, "LAMB", index)
        for group in self.param_groups:
            (b1, b2), eps = group["betas"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, skip = p.grad, excluded(p, group)
                wd = 0.0 if skip else group["weight_decay"]
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if torch.is_complex(p):   # as torch's Adam: a complex tensor is its real view
                    p, g, m, v = (torch.view_as_real(t) for t in (p, g, m, v))
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                r = (m / (1 - b1 ** t)).div_((v / (1 - b2 ** t)).sqrt_().add_(eps))
                if wd:
                    r.add_(p, alpha=wd)
                if not skip:
                    w_norm = torch.linalg.vector_norm(p)
                    r_norm = torch.linalg.vector_norm(r)
                    q = torch.where((w_norm > 0) & (r_norm > 0), w_norm / r_norm, torch.ones_like(w_norm))
                    r.mul_(q)
                p.sub_(r, alpha=group["lr"])
        return loss


def _check_lamb(group: dict, where: str = "") -> None:
    check_common("LAMB", group.get("lr"), group.get("weight_decay"), group.get("eps"), group.get("exclude_1d"), where)
    betas = group.get("betas")
    ok = isinstance(betas, (tuple, list)) and len(betas) == 2 and all(is_real(b) and 0 <= b < 1 for b in betas)
    require(ok, "LAMB", f"{where}betas must be two numbers in [0, 1), e.g. (0.9, 0.999), got {betas!r}")
