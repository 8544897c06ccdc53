"""The loss landscape around a model: its sharpness (docs/algorithms.md §Large-batch
training, "Sharpness"; the lecture's "sharpness-orig": Keskar et al. 2017, Jiang et al. 2020).
Exported as :func:`gradzip.sharpness`."""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from ..errors import GradzipError
from ..validation import is_int, is_real, require

DEFAULT_STEPS = 10
#: The random start's norm, as a fraction of the ball's radius ("a small random start").
START_FRACTION = 1e-3


def sharpness(model: torch.nn.Module, loss_fn: Callable, batches: Iterable, rho: float, *,
              steps: int = DEFAULT_STEPS, seed: int = 0) -> float:
    """``S_ρ(x) = max_{‖δ‖ ≤ ρ·(‖x‖ + 1)} L(x + δ) − L(x)``, ``L`` the mean of
    ``loss_fn(model(inputs), targets)`` over ``batches`` (a fixed training subset: an
    iterable of ``(inputs, targets)``), ``‖·‖`` over all parameters that require a gradient.

    Estimated by ``steps`` steps of projected, normalised gradient ascent from a random
    start of norm ``1e-3 · r`` (``r = ρ·(‖x‖ + 1)``, drawn from ``seed``): ``δ ← P(δ + α·∇/‖∇‖)``
    with **[choice]** ``α = 2r / steps`` (the ascent can cross the ball's diameter) and ``P``
    the projection onto the ball; the value is the largest ``L(x + δ) − L(x)`` seen (start,
    every step, the last point). Larger = sharper; report it with ρ. Evaluated in eval
    mode (no dropout noise); the model's parameters, gradients and mode are left as found."""
    require(is_real(rho) and 0 <= rho < float("inf"), "sharpness", f"rho must be a finite number >= 0, got {rho!r}")
    require(is_int(steps) and steps >= 1, "sharpness", f"steps must be an integer >= 1, got {steps!r}")
    data = list(batches)
    params = [p for p in model.parameters() if p.requires_grad]
    if not data or not params:
        raise GradzipError("sharpness: needs at least one batch (inputs, targets) and a parameter that requires a gradient")
    saved = [p.detach().clone() for p in params]
    was_training = model.training
    model.eval()
    try:
        base = _loss(model, loss_fn, data, params, grad=False)[0]
        radius = rho * (float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(s) for s in saved]))) + 1)
        if radius == 0:
            return 0.0
        generator = torch.Generator().manual_seed(int(seed))
        delta = [torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device) for p in params]
        delta = _scaled(delta, START_FRACTION * radius)
        alpha, best = 2 * radius / steps, -float("inf")
        for k in range(steps + 1):
            _place(params, saved, delta)
            value, grads = _loss(model, loss_fn, data, params, grad=k < steps)
            best = max(best, value - base)
            if k < steps:
                gnorm = _norm(grads)
                if gnorm > 0:
                    delta = [d.add(g, alpha=alpha / gnorm) for d, g in zip(delta, grads)]
                if _norm(delta) > radius:
                    delta = _scaled(delta, radius)
        return best
    finally:
        with torch.no_grad():
            for p, x in zip(params, saved):
                p.copy_(x)
        model.train(was_training)


def _loss(model, loss_fn, data, params, grad: bool) -> tuple[float, list[torch.Tensor] | None]:
    """Mean loss over the batches, and its gradient with respect to ``params`` (``.grad`` untouched)."""
    total, grads = 0.0, None
    for inputs, targets in data:
        with torch.set_grad_enabled(grad):
            loss = loss_fn(model(inputs), targets) / len(data)
        if grad:
            g = torch.autograd.grad(loss, params, allow_unused=True)
            g = [torch.zeros_like(p) if x is None else x for p, x in zip(params, g)]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        total += float(loss.detach())
    return total, grads


def _norm(tensors: list[torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])))


def _scaled(tensors: list[torch.Tensor], norm: float) -> list[torch.Tensor]:
    current = _norm(tensors)
    return [t.mul(norm / current) for t in tensors] if current > 0 else tensors


def _place(params, saved, delta) -> None:
    with torch.no_grad():
        for p, x, d in zip(params, saved, delta):
            p.copy_(x + d)
