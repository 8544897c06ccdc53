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
    import cases
    return cases.whole_and_resumed(comm, root, 5, algo="lars", options={"compressor": "topk:ratio=0.1"}, epochs=1,
                                   batch_size=64, lr=0.05, momentum=0.9, lr_scaling="linear", warmup_epochs=0.5,
                                   sam_rho=0.05, sharpness_rho=0.05, progress=False, checkpoint_every=4)


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


# -- the run's schedule (--lr-schedule: warm-up, then cosine decay) -------------------------

def test_schedule_factor_warms_up_then_decays_to_the_final_factor():
    from gradzip.optim import parse_schedule, schedule_factor
    cos = parse_schedule("cosine:warmup=4,final=0.1")
    assert [schedule_factor(t, 24, cos) for t in (1, 2, 4)] == pytest.approx([0.25, 0.5, 1.0])
    assert schedule_factor(14, 24, cos) == pytest.approx(0.55)    # half-way through the decay: (1 + m) / 2
    assert schedule_factor(24, 24, cos) == pytest.approx(0.1)
    factors = [schedule_factor(t, 24, cos) for t in range(4, 25)]
    assert all(a > b for a, b in zip(factors, factors[1:]))
    assert parse_schedule("cosine") == parse_schedule("cosine:warmup=0,final=0.1")
    assert schedule_factor(1, 10, parse_schedule("cosine:final=0")) == pytest.approx((1 + math.cos(math.pi / 10)) / 2)
    flat = parse_schedule("constant:warmup=2")
    assert [schedule_factor(t, 5, flat) for t in range(1, 6)] == [0.5, 1.0, 1.0, 1.0, 1.0]
    assert parse_schedule("constant").is_identity and not flat.is_identity
    assert parse_schedule(cos.spec()) == cos and cos.spec() == "cosine:warmup=4,final=0.1"


@pytest.mark.parametrize("spec, words", [
    ("linear", "must be one of constant, cosine"), ("cosine:warm=3", "cosine takes warmup and final"),
    ("cosine:warmup=-1", "warmup must be an integer"), ("cosine:warmup=1.5", "warmup must be an integer"),
    ("cosine:final=2", "final"), ("cosine:final=x", "final"), ("constant:final=0.1", "constant takes warmup"),
    ("cosine:warmup", "needs a value")])
def test_a_bad_schedule_is_one_line_naming_the_flag(spec, words):
    from gradzip.train.config import RunConfig, check_large_batch
    with pytest.raises(GradzipError) as exc:
        check_large_batch(RunConfig(lr_schedule=spec))
    assert str(exc.value).startswith("--lr-schedule") and words in str(exc.value) and "\n" not in str(exc.value)


def test_the_schedule_warmup_does_not_stack_with_another_warmup():
    from gradzip.train.config import RunConfig, check_large_batch
    with pytest.raises(GradzipError, match="--warmup-epochs"):
        check_large_batch(RunConfig(lr_schedule="cosine:warmup=5", lr_scaling="linear", warmup_epochs=1.0))
    with pytest.raises(GradzipError, match="--lr-warmup-steps"):
        check_large_batch(RunConfig(algo="dgc", options={"lr_warmup_steps": 5}, lr_schedule="cosine:warmup=5"))
    check_large_batch(RunConfig(lr_schedule="cosine", lr_scaling="linear", warmup_epochs=1.0))   # decay only


def scheduled_diloco_runs(comm, root):
    """DiLoCo (inner AdamW) under a warm-up + cosine schedule: a whole run, and one
    interrupted after step 7 and resumed from its checkpoint at step 6; their results."""
    import cases
    return cases.whole_and_resumed(comm, root, 7, algo="diloco", options={"H": 3, "outer_lr": 0.5}, epochs=2,
                                   batch_size=64, lr=0.004, progress=False, checkpoint_every=6, eval_every=4,
                                   lr_schedule="cosine:warmup=3,final=0.2")


def test_the_schedule_scales_the_inner_rate_and_resumes_exactly(tmp_path):
    """The schedule is a function of the step: a resumed run repeats the uninterrupted one
    bit for bit; it scales DiLoCo's inner AdamW rate (the history's ``lr``), never the
    outer rate, and ends at ``final`` x the rate."""
    import gradzip
    import cases
    from gradzip.optim import parse_schedule, schedule_factor
    whole, resumed = gradzip.simulate(2, lambda c: scheduled_diloco_runs(c, str(tmp_path)))[0]
    assert resumed["summary"]["resumed_from_step"] == 6
    cases.assert_bitwise_equal(whole["history"], resumed["history"], "history")
    total = whole["summary"]["steps"]
    sched = parse_schedule("cosine:warmup=3,final=0.2")
    for h in whole["history"]:   # the rate of the step just taken
        assert h["lr"] == pytest.approx(0.004 * schedule_factor(h["step"], total, sched))
    assert whole["history"][-1]["lr"] == pytest.approx(0.004 * 0.2)
    assert whole["summary"]["lr_schedule"] == "cosine:warmup=3,final=0.2"


def test_diloco_large_batch_scaling_scales_the_inner_rate_not_the_outer_one():
    """--lr-scaling is a rule for the method's rate: DiLoCo's inner one. With 2 workers,
    linear scaling of lr 0.002 is the run at lr 0.004, bit for bit (before, the loop
    overwrote the outer rate, 0.7, with the scaled inner rate)."""
    import gradzip
    import cases
    from gradzip.train.config import RunConfig
    from gradzip.train.loop import run_worker

    def run(**extra):
        base = dict(algo="diloco", options={"H": 4}, epochs=1, batch_size=64, progress=False)
        return gradzip.simulate(2, lambda comm: run_worker(comm, RunConfig(**base, **extra)))[0]["history"]

    scaled, plain = run(lr=0.002, lr_scaling="linear"), run(lr=0.004)
    cases.assert_bitwise_equal([h["test_loss"] for h in scaled], [h["test_loss"] for h in plain], "validation loss")
    assert scaled[-1]["lr"] == plain[-1]["lr"] == 0.004


def test_the_schedule_must_fit_the_run_and_a_cosine_run_resumes_at_its_own_length(tmp_path):
    import gradzip
    from gradzip.train.config import RunConfig
    from gradzip.train.loop import run_worker
    base = dict(algo="ssgd", epochs=1, batch_size=64, progress=False)
    with pytest.raises(GradzipError, match=r"warm-up \(500 steps\) must be shorter than the run"):
        gradzip.simulate(2, lambda c: run_worker(c, RunConfig(**base, lr_schedule="cosine:warmup=500")))
    ck = dict(base, lr_schedule="cosine", checkpoint_dir=str(tmp_path), resume=True)
    gradzip.simulate(2, lambda c: run_worker(c, RunConfig(**ck)))
    with pytest.raises(GradzipError, match="decays over the whole run.*resume with --epochs 1"):
        gradzip.simulate(2, lambda c: run_worker(c, RunConfig(**{**ck, "epochs": 2})))
