"""Large-batch learning rates: linear (or square-root) scaling with the global batch and
gradual warm-up (Goyal et al. 2017; docs/algorithms.md §Large-batch training, "Linear
scaling with gradual warm-up")::

    η* = η_base · B / B_base             (scaling="linear";  "sqrt": η_base · √(B / B_base))
    η_t = η_base + (η* − η_base) · t / T_w   for t = 1 … T_w,   then η*

Steps count from 1. :func:`lr_at` is the rule as a function of the step (the training
loop sets it before every step, so a resumed run needs no scheduler state);
:class:`LinearScalingWarmup` is the same rule as a torch LR scheduler for user code.
Momentum buffers are not reset.
"""
from __future__ import annotations

import math

import torch

from ...validation import is_int, is_real, require

SCALINGS = ("none", "linear", "sqrt")


def scaled_lr(base_lr: float, global_batch: int, base_batch: int, scaling: str = "linear") -> float:
    """``η*`` for a global batch of ``global_batch`` samples (``"none"``: ``base_lr``)."""
    require(scaling in SCALINGS, "lr scaling", f"must be one of {', '.join(SCALINGS)}, got {scaling!r}")
    require(is_int(global_batch) and global_batch >= 1, "lr scaling",
            f"the global batch must be an integer >= 1, got {global_batch!r}")
    require(is_int(base_batch) and base_batch >= 1, "lr scaling",
            f"the base batch must be an integer >= 1 (--base-batch), got {base_batch!r}")
    require(is_real(base_lr) and base_lr >= 0 and math.isfinite(base_lr), "lr scaling",
            f"the base learning rate must be a finite number >= 0, got {base_lr!r}")
    ratio = global_batch / base_batch
    return float(base_lr) * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[scaling]


def lr_at(step: int, base_lr: float, target_lr: float, warmup_steps: int) -> float:
    """``η_t`` at step ``step`` (from 1): the ramp from ``base_lr`` to ``target_lr`` over
    ``warmup_steps`` steps, then ``target_lr``."""
    require(is_int(warmup_steps) and warmup_steps >= 0, "warm-up",
            f"the warm-up must be an integer number of steps >= 0, got {warmup_steps!r}")
    if step >= warmup_steps:
        return float(target_lr)
    return base_lr + (target_lr - base_lr) * step / warmup_steps


class LinearScalingWarmup(torch.optim.lr_scheduler.LRScheduler):
    """:func:`lr_at` over every param group (``η_base``: the group's learning rate when the
    scheduler is built); call ``step()`` after every ``optimizer.step()``, as any torch
    scheduler. ``global_batch``: samples per step over all workers; ``base_batch``: the
    batch ``η_base`` was tuned for."""

    def __init__(self, optimizer, *, global_batch: int, base_batch: int, scaling: str = "linear",
                 warmup_steps: int = 0, last_epoch: int = -1):
        scaled_lr(1.0, global_batch, base_batch, scaling)   # the checks
        lr_at(1, 0.0, 0.0, warmup_steps)
        self.factor = scaled_lr(1.0, global_batch, base_batch, scaling)
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        step = self.last_epoch + 1   # the lr of the optimizer's next step
        return [lr_at(step, base, base * self.factor, self.warmup_steps) for base in self.base_lrs]
