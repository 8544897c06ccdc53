"""SAM: sharpness-aware minimization (Foret et al. 2021; docs/algorithms.md §Large-batch
training, "SAM") around any optimizer: a gradzip method (its exchange, any codec) or a
plain torch optimizer."""
from __future__ import annotations

import contextlib

import torch

from ..errors import GradzipError
from ..validation import is_real, refuses_unknown_options, require
from .core.eager import EagerOptimizer
from .core.options import FLOAT32_MAX


class SAM(EagerOptimizer):
    """SAM with radius ``rho`` around ``inner``; ``step(closure)`` needs the closure (two
    forward/backward passes on the same batch)::

        g_i = ∇f(x; z_i);  ε_i = ρ · g_i / ‖g_i‖     # ‖·‖ over all parameters; local, no communication
        g̃_i = ∇f(x + ε_i; z_i)                       # second pass at the perturbed point
        x ← inner's step with g̃_i in place of g_i     # its exchange (any codec), then its update

    **[choice]** of the spec: the ascent uses this worker's own gradient (m-sharpness with
    m = the worker's batch), so SAM adds no communication. ``adaptive=True`` is ASAM:
    ``ε_i = ρ · w² ⊙ g_i / ‖w ⊙ g_i‖``. A zero norm gives ``ε = 0``.

    The closure runs forward and backward and returns the loss; SAM clears the gradients
    before each pass. Both passes run with the inner method's gradient hooks idle
    (``inner.accumulate()``, so no exchange starts from the ascent gradient); the
    parameters are put back bit for bit (from a copy, not by subtracting ε) before
    ``inner.step()``, which then exchanges the second pass's gradients. ``step`` returns
    the first pass's loss. ``param_groups`` are the inner's (one list: LR schedulers work);
    ``state_dict()`` is the inner's (SAM keeps no state of its own)."""

    @refuses_unknown_options
    def __init__(self, inner: torch.optim.Optimizer, *, rho: float = 0.05, adaptive: bool = False):
        if not isinstance(inner, torch.optim.Optimizer) or isinstance(inner, SAM):
            raise GradzipError(f"SAM: inner must be a torch optimizer or a gradzip method (not SAM), "
                               f"got {type(inner).__name__}")
        require(is_real(rho) and 0 <= rho <= FLOAT32_MAX, "SAM", f"rho must be a finite number >= 0, got {rho!r}")
        require(isinstance(adaptive, bool), "SAM", f"adaptive must be True or False, got {adaptive!r}")
        super().__init__([p for g in inner.param_groups for p in g["params"]], {})
        self.param_groups = inner.param_groups
        self.defaults = inner.defaults
        self.inner = inner
        self.rho = float(rho)
        self.adaptive = adaptive

    def _quiet(self):
        """The inner method's hooks idle (``accumulate``), or nothing for a torch optimizer."""
        accumulate = getattr(self.inner, "accumulate", None)
        return accumulate() if callable(accumulate) else contextlib.nullcontext()

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def perturbation(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """``ε_i`` from the parameters' current gradients (a missing one counts as zero)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if self.adaptive:
            scaled = [p * g for p, g in zip(params, grads)]
            directions = [p * s for p, s in zip(params, scaled)]          # w² ⊙ g
        else:
            scaled = directions = grads
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(s.float()) for s in scaled]))
        if norm == 0:
            return [torch.zeros_like(p) for p in params]
        return [d.mul(self.rho / norm) for d in directions]

    def step(self, closure=None):
        if closure is None:
            raise GradzipError("SAM.step needs a closure (forward + backward, returning the loss): SAM takes two "
                               "passes per step, e.g. opt.step(lambda: (loss := f(model(x), y)).backward() or loss)")
        params = self._params()
        self.zero_grad(set_to_none=True)
        with self._quiet(), torch.enable_grad():
            loss = closure()
        with torch.no_grad():
            saved = [p.detach().clone() for p in params]
            for p, e in zip(params, self.perturbation(params)):
                p.add_(e)
        self.zero_grad(set_to_none=True)
        try:
            with self._quiet(), torch.enable_grad():
                closure()
        finally:
            with torch.no_grad():
                for p, x in zip(params, saved):
                    p.copy_(x)
        self.inner.step()
        return loss

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)
        self.param_groups = self.inner.param_groups
