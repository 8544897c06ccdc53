"""--device and --amp (gradzip.train.device): the device a rank trains on, autocast, and
torch.amp.GradScaler around every gradzip method (unscaled before compression; a step with an
inf/NaN on any worker skipped on every worker, residuals, momentum and counters untouched)."""
from __future__ import annotations

import json

import pytest
import torch

import cases
import gradzip
from gradzip.cli import main
from gradzip.errors import GradzipError
from gradzip.train import device

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")


def _scaled_run(comm, method, options, *, bad_step=3, bad_rank=1, value=float("inf"), drop=False, steps=6):
    """cases.train_with_bad_gradient through Precision('fp16'): the loss scaled for backward,
    the gradient of ``bad_rank`` at ``bad_step`` poisoned after backward (the step left out
    altogether with ``drop``). (parameters, optimizer state, scale, steps, skipped)."""
    model = cases.tiny_model()
    cls = gradzip.optim.METHODS[method]
    opt = cls(model.parameters(), comm=comm, lr=0.05, **device.method_options("fp16", options, cls))
    precision = device.Precision("fp16", torch.device("cpu"), comm)
    for t in range(1, steps + 1):
        if drop and t == bad_step:
            continue
        x, y = cases.regression_batch(t, comm.rank, comm.world_size)
        opt.zero_grad()
        with precision.autocast():
            out = model(x)
        precision.backward(torch.nn.functional.mse_loss(out.float(), y))
        if t == bad_step and comm.rank == bad_rank:
            next(model.parameters()).grad.view(-1)[1] = value
        precision.step(opt)
    state = opt.state_dict()
    getattr(opt, "close", lambda: None)()
    return [p.detach().clone() for p in model.parameters()], state, precision.scaler.get_scale(), \
        opt.steps, opt.skipped_steps


#: one method per kind of state: momentum, residual, error reset, DGC's buffers, PowerSGD's Q,
#: CD-SGD's background exchange (the skip itself is the scaler's, the same for every method)
METHODS = ["ssgd", "efsgd", "cser", "dgc", "powersgd", "cdsgd"]


def test_an_inf_on_one_worker_skips_the_step_on_every_worker():
    """With fp16 autocast the forward differs from fp32 but not between the two runs: the run
    with the poisoned step ends bit for bit where the run without that step ends (powers of two
    scale exactly), and every worker's scaler backed off alike."""
    def pairs(comm):
        return {m: (_scaled_run(comm, m, o), _scaled_run(comm, m, o, drop=True)) for m, o in cases.SHORT_RUNS.items()
                if m in METHODS}

    per_rank = gradzip.simulate(2, pairs)
    for method in METHODS:
        scales = set()
        for rank_out in per_rank:
            (p_skip, s_skip, scale_skip, steps_skip, skipped), (p_drop, s_drop, scale_drop, steps_drop, none) = \
                rank_out[method]
            # (the scaler's first scale may overflow on its own, in both runs alike)
            assert skipped == none + 1 and steps_skip == steps_drop == 5 - none, method
            s_skip["gradzip"].pop("skipped_steps"), s_drop["gradzip"].pop("skipped_steps")
            cases.assert_bitwise_equal(p_skip, p_drop, f"{method} parameters")
            cases.assert_bitwise_equal(s_skip, s_drop, f"{method} state")
            assert scale_skip == scale_drop / 2, method
            scales.add(scale_skip)
        assert len(scales) == 1, method        # the same scale on every worker


def test_fp16_turns_the_exchange_during_backward_off_and_refuses_it_when_asked():
    assert device.method_options("fp16", {}, gradzip.optim.EFSGD) == {"overlap_backward": False}
    assert device.method_options("bf16", {}, gradzip.optim.EFSGD) == {}
    assert device.method_options("fp16", {"H": 2}, gradzip.optim.LocalSGD) == {"H": 2}
    with pytest.raises(GradzipError, match="drop --overlap-backward true"):
        device.method_options("fp16", {"overlap_backward": True}, gradzip.optim.SSGD)


def test_the_scaler_state_round_trips():
    a = device.Precision("fp16", torch.device("cpu"), None)
    a.scaler.scale(torch.ones(()))        # the scaler's state exists once it scaled something
    a.scaler.update(1024.0)
    b = device.Precision("fp16", torch.device("cpu"), None)
    b.load_state_dict(a.state_dict())
    assert b.scaler.get_scale() == 1024.0
    assert device.Precision("bf16", torch.device("cpu"), None).state_dict() is None


def test_devices():
    assert device.resolve_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(GradzipError, match="unknown device"):
        device.resolve_device("tpu")


@no_cuda
def test_auto_is_the_cpu_and_cuda_is_a_one_line_error_without_cuda(capsys):
    assert device.resolve_device("auto", 1) == torch.device("cpu")
    assert main(["train", "--device", "cuda", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda, but this torch sees no CUDA device" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_bf16_trains_digits_past_90_percent_with_two_workers(tmp_path):
    assert main(["train", "--algo", "efsgd", "--workers", "2", "--backend", "threads", "--epochs", "5", "--amp",
                 "bf16", "--quiet", "--no-plot", "--bandwidth", "none", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_test_accuracy"] > 0.9
    assert (summary["workers"], summary["device"], summary["amp"]) == (2, "cpu", "bf16")


# -- backend selection (issue 16, item 2) ---------------------------------------------------
def test_nccl_for_cuda_tensors_only_where_each_local_rank_has_its_own_gpu():
    from gradzip.comm.torchdist import choose_backend

    assert choose_backend(cuda=False, nccl=False, local_world_size=4, device_count=0) == "gloo"
    assert choose_backend(cuda=True, nccl=True, local_world_size=2, device_count=2) == "cpu:gloo,cuda:nccl"
    assert choose_backend(cuda=True, nccl=True, local_world_size=4, device_count=1) == "gloo"   # 4 ranks, 1 GPU
    assert choose_backend(cuda=True, nccl=False, local_world_size=1, device_count=1) == "gloo"


def test_an_error_of_a_missing_operation_names_backend_and_fix_and_others_pass():
    from gradzip.comm.torchdist import lacks_operation

    err = lacks_operation("allgather", RuntimeError("No backend type associated with device type cpu"), "nccl")
    assert isinstance(err, GradzipError) and str(err).startswith("nccl cannot run allgather") and "--device cpu" in str(err)
    assert lacks_operation("allreduce", RuntimeError("Connection closed by peer [127.0.0.1]:1234")) is None

