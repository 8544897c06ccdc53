"""Large-batch learning rates (docs/algorithms.md §Large-batch training, "Linear scaling with gradual warm-up")."""
import math

import pytest
import torch

from gradzip.errors import GradzipError
from gradzip.optim import LinearScalingWarmup, lr_at, scaled_lr


def test_scaling_rules():
    assert scaled_lr(0.1, 256, 32, "linear") == pytest.approx(0.8)
    assert scaled_lr(0.1, 256, 32, "sqrt") == pytest.approx(0.1 * math.sqrt(8))
    assert scaled_lr(0.1, 256, 32, "none") == 0.1
    with pytest.raises(GradzipError, match="base batch"):
        scaled_lr(0.1, 256, 0)
    with pytest.raises(GradzipError, match="linear"):
        scaled_lr(0.1, 256, 32, "cubic")


def test_warmup_ramps_from_base_to_target_then_stays():
    assert [lr_at(t, 0.1, 0.5, 4) for t in range(1, 7)] == pytest.approx([0.2, 0.3, 0.4, 0.5, 0.5, 0.5])
    assert lr_at(1, 0.1, 0.5, 0) == 0.5


def test_scheduler_sets_the_rule_before_every_step():
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    sched = LinearScalingWarmup(opt, global_batch=128, base_batch=32, warmup_steps=3)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.2, 0.3, 0.4, 0.4, 0.4])
