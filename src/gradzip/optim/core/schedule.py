"""Large-batch learning rates: linear (or square-root) scaling with the global batch and
gradual warm-up (Goyal et al. 2017; docs/algorithms.md §Large-batch training, "Linear
scaling with gradual warm-up")::

    η* = η_base · B / B_base             (scaling="linear";  "sqrt": η_base · √(B / B_base))
    η_t = η_base + (η* − η_base) · t / T_w   for t = 1 … T_w,   then η*

Steps count from 1. :func:`lr_at` is the rule as a function of the step (the training
loop sets it before every step, so a resumed run needs no scheduler state);
:class:`LinearScalingWarmup` is the same rule as a torch LR scheduler for user code.
Momentum buffers are not reset.

The run's schedule (``--lr-schedule``, docs/algorithms.md §Large-batch training, "Warm-up
and cosine decay"): a factor on the rate above, a function of the step ``t`` (from 1) and
the run's length ``T`` (:func:`schedule_factor`)::

    f_t = t / W                                               for t ≤ W   (the warm-up)
    f_t = 1                                                   after it    ("constant")
    f_t = m + (1 − m) · (1 + cos(π · (t − W) / (T − W))) / 2    after it    ("cosine", down to m at T)

It multiplies the method's own learning rate (:meth:`DistributedOptimizer.lr_groups`: the
inner optimizer's for DiLoCo, never the outer rate), the same for every method.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...specs import split
from ...validation import is_int, is_real, require

SCALINGS = ("none", "linear", "sqrt")
SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class Schedule:
    """A parsed ``--lr-schedule``: ``name`` of :data:`SCHEDULES`, ``warmup`` steps ``W``, and
    ``final`` = ``m``, the cosine's last factor."""

    name: str = "constant"
    warmup: int = 0
    final: float = 0.1

    @property
    def is_identity(self) -> bool:
        """Whether every factor is 1 (the loop then leaves the rate alone)."""
        return self.name == "constant" and self.warmup == 0

    def spec(self) -> str:
        """The canonical spec string (what a summary records)."""
        if self.name == "constant":
            return f"constant:warmup={self.warmup}" if self.warmup else "constant"
        return f"cosine:warmup={self.warmup},final={self.final:g}"


def parse_schedule(spec: str) -> Schedule:
    """``"constant"``, ``"constant:warmup=W"`` or ``"cosine[:warmup=W][,final=m]"`` (W an
    integer >= 0, m in [0, 1], default 0.1); a :class:`GradzipError` naming the fault."""
    where = "--lr-schedule"
    require(isinstance(spec, str), where, f"must be a spec string such as 'cosine:warmup=100,final=0.1', got {spec!r}")
    name, _, options = split(spec)
    require(name in SCHEDULES, where, f"must be one of {', '.join(SCHEDULES)} (e.g. 'cosine:warmup=100,final=0.1'), "
                                      f"got {name!r}")
    valid = ("warmup", "final") if name == "cosine" else ("warmup",)
    values = {}
    for o in options:
        require(o.key in valid, where, f"{name} takes {' and '.join(valid)}, got {o.item!r}")
        require(o.has_value, where, f"{o.key} needs a value ({o.key}=...), got {o.item!r}")
        values[o.key] = o.value
    warmup = values.get("warmup", "0")
    require(warmup.isdigit(), where, f"warmup must be an integer number of steps >= 0, got {warmup!r}")
    try:
        final = float(values.get("final", "0.1"))
    except ValueError:
        final = math.nan
    require(0 <= final <= 1, where, f"final (the last step's factor on the rate) must be a number in [0, 1], "
                                    f"got {values.get('final')!r}")
    return Schedule(name, int(warmup), final)


def schedule_factor(step: int, total: int, schedule: Schedule) -> float:
    """``f_t`` at step ``step`` (from 1) of a run of ``total`` steps."""
    if step <= schedule.warmup:
        return step / schedule.warmup
    if schedule.name == "constant":
        return 1.0
    progress = min(1.0, (step - schedule.warmup) / max(1, total - schedule.warmup))
    return schedule.final + (1.0 - schedule.final) * (1.0 + math.cos(math.pi * progress)) / 2


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
