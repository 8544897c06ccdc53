"""Replicas that start different (issue 12, item 5): the first step's consistency check
compares the parameters' values and names the first that differs, with the fix
(``gradzip.broadcast_parameters``); resume of methods whose replicas differ is not refused."""
from __future__ import annotations

import pytest
import torch

import cases
import cases_optim
import gradzip
from gradzip.guards.consistency import InconsistentWorkers
from gradzip.errors import GradzipError
from gradzip.comm.launch import run_processes


@pytest.mark.parametrize("method", ["ssgd", "efsgd", "localsgd", "cdsgd"])
def test_different_starting_weights_are_refused_naming_the_parameter_and_the_fix(method):
    with pytest.raises(InconsistentWorkers,
                       match=r"'parameter #00000 values' differs .*shape \(6, 4\).*"
                             r"gradzip\.broadcast_parameters\(model\)"):
        gradzip.simulate(2, lambda c: cases_optim.step_from_per_rank_init(c, method))


def test_only_a_later_parameter_differing_is_named():
    def worker(comm):
        model = cases_optim.seeded_model(0)
        if comm.rank == 1:
            with torch.no_grad():
                model[2].bias[1] += 1e-7
        opt = gradzip.optim.SSGD(model.parameters(), comm=comm, lr=0.1)
        x, y = cases.regression_batch(1, comm.rank, comm.world_size)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    with pytest.raises(InconsistentWorkers, match=r"'parameter #00005 values' differs .*shape \(2,\)"):
        gradzip.simulate(2, worker)


@pytest.mark.parametrize("use_module", [True, False])
def test_broadcast_parameters_is_the_fix(use_module):
    outs = gradzip.simulate(3, lambda c: cases_optim.step_from_per_rank_init(
        c, "efsgd", broadcast=True, use_module=use_module))
    n_params = len(list(cases_optim.seeded_model(0).parameters()))
    for other in outs[1:]:
        for i, (a, b) in enumerate(zip(outs[0], other)):
            if use_module or i < n_params:  # buffers only travel with a module
                assert torch.equal(a, b)
    # rank 0's values won: its running mean is what everyone holds
    if use_module:
        assert torch.equal(outs[2][n_params], cases_optim.seeded_model(0)[1].running_mean)


def test_broadcast_parameters_in_a_world_of_one_and_bad_input():
    model = cases_optim.seeded_model(4)
    before = [p.detach().clone() for p in model.parameters()]
    gradzip.broadcast_parameters(model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(GradzipError, match="item #1 is a str"):
        gradzip.broadcast_parameters([torch.zeros(2), "x"])
    with pytest.raises(GradzipError, match="src must be a rank"):
        gradzip.broadcast_parameters(model, src=1)


@pytest.mark.parametrize("method, options", [("localsgd", {"lr": 0.1, "H": 4}),
                                             ("cser", {"lr": 0.1, "H": 4}),
                                             ("cdsgd", {"lr": 0.1, "warmup_steps": 1})])
def test_resume_of_differing_replicas_is_not_refused_and_exact(method, options):
    straight = gradzip.simulate(2, lambda c: cases.train_with_resume(c, method, options, 5, None)[0])
    resumed = gradzip.simulate(2, lambda c: cases_optim.resume_differing(c, method, options))
    assert not all(torch.equal(a, b) for a, b in zip(straight[0], straight[1]))  # they do differ
    for a_params, b_params in zip(straight, resumed):
        for a, b in zip(a_params, b_params):
            assert torch.equal(a, b)


def test_resume_into_a_replica_that_differs_is_refused():
    with pytest.raises(InconsistentWorkers, match=r"'parameter #00003 values' differs"):
        gradzip.simulate(2, cases_optim.resume_with_tampered_model)


@pytest.mark.slow
def test_broadcast_and_refusal_on_gloo():
    outs = run_processes(2, cases_optim.step_from_per_rank_init, "ssgd", True)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    with pytest.raises(GradzipError, match=r"broadcast_parameters"):
        run_processes(2, cases_optim.step_from_per_rank_init, "ssgd")
