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


# -- in the training loop and the CLI ------------------------------------------------------

def large_batch_runs(comm, root):
    """LARS with top-k, linear scaling + warm-up and SAM: a whole run, and one interrupted
    after step 5 and resumed from its checkpoint at step 4; their results."""
    from gradzip.train.config import RunConfig
    from gradzip.train.loop import run_worker

    import cases
    base = dict(algo="lars", options={"compressor": "topk:ratio=0.1"}, epochs=1, batch_size=64, lr=0.05,
                momentum=0.9, lr_scaling="linear", warmup_epochs=0.5, sam_rho=0.05, sharpness_rho=0.05,
                progress=False, checkpoint_every=4)
    whole = run_worker(comm, RunConfig(**base, checkpoint_dir=f"{root}/whole"))
    cut = RunConfig(**base, checkpoint_dir=f"{root}/cut", resume=True)
    with pytest.raises(cases.Interrupted):
        run_worker(comm, cut, after_step=cases.interrupt_after(5))
    return whole, run_worker(comm, cut)


def test_large_batch_options_in_the_loop_resume_exactly(tmp_path):
    import gradzip
    import cases
    whole, resumed = gradzip.simulate(2, lambda c: large_batch_runs(c, str(tmp_path)))[0]
    assert resumed["summary"]["resumed_from_step"] == 4
    cases.assert_bitwise_equal(whole["history"], resumed["history"], "history")
    assert whole["summary"]["lr_peak"] == pytest.approx(0.1) and whole["summary"]["global_batch"] == 128
    assert whole["history"][-1]["lr"] == pytest.approx(0.1)   # past the warm-up: the scaled rate
    assert whole["summary"]["sharpness"] == resumed["summary"]["sharpness"] > 0


def test_cli_large_batch_flags(tmp_path):
    import json
    from gradzip.cli import main
    assert main(["train", "--algo", "lamb", "--compressor", "topk:ratio=0.05", "--lr", "0.01", "--workers", "2",
                 "--backend", "threads", "--epochs", "1", "--lr-scaling", "sqrt", "--base-batch", "32",
                 "--warmup-epochs", "0.5", "--sam-rho", "0.05", "--quiet", "--no-plot", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["lr_peak"] == pytest.approx(0.01 * 2 ** 0.5) and summary["sam_rho"] == 0.05
    assert summary["final_test_accuracy"] > 0.5
    assert main(["train", "--warmup-epochs", "1", "--quiet"]) == 2   # a warm-up needs a scaling


def test_dgc_lr_warmup_and_the_large_batch_warmup_are_not_stacked():
    """DGC's ``lr_warmup_steps`` multiplies the rate the loop sets: with ``--warmup-epochs``
    too the two ramps would multiply (a quadratic ramp nobody asked for): refused, naming
    the fix; with ``--lr-scaling`` alone DGC's ramp climbs to the scaled rate (accepted)."""
    from gradzip.train.config import RunConfig, check_large_batch
    both = RunConfig(algo="dgc", options={"lr_warmup_steps": 5}, lr_scaling="linear", warmup_epochs=1.0)
    with pytest.raises(GradzipError) as exc:
        check_large_batch(both)
    text = str(exc.value)
    assert "--lr-warmup-steps" in text and "--warmup-epochs" in text and "\n" not in text
    check_large_batch(RunConfig(algo="dgc", options={"lr_warmup_steps": 5}, lr_scaling="linear"))
    check_large_batch(RunConfig(algo="dgc", options={"lr_warmup_steps": 0}, lr_scaling="linear", warmup_epochs=1.0))
