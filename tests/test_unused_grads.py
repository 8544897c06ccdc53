"""Gradients missing on some ranks (issue 12, item 1): a parameter whose ``.grad`` is None
on a rank counts as a zero gradient there (DDP's ``find_unused_parameters``), for every
method, on threads and on gloo processes; tensors are never mixed."""
from __future__ import annotations

import pytest
import torch

import cases
import cases_optim
import gradzip
from gradzip.comm.launch import run_processes


def _check(rank_outs):
    for rank_out in rank_outs:
        assert set(rank_out) == set(gradzip.optim.METHODS)
        for method, (missing, zeros) in rank_out.items():
            cases.assert_bitwise_equal(missing, zeros, f"{method} parameters")


@pytest.mark.parametrize("uses", [cases_optim.AB, cases_optim.COUNTS], ids=["A-vs-B", "different-counts"])
def test_missing_gradient_is_a_zero_gradient_for_every_method_on_threads(uses):
    _check(gradzip.simulate(len(uses), lambda c: cases_optim.partial_pairs(c, uses)))


def test_a_vs_b_ssgd_averages_each_tensor_with_zeros_and_replicas_agree():
    outs = gradzip.simulate(2, lambda c: cases_optim.train_partial(c, "ssgd", {}, cases_optim.AB[:2], steps=1))
    start = cases_optim.TwoBranch()
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a, b)
    # A moved by half of rank 0's gradient only (rank 1's A-gradient is zero): never by B's
    x0, y0 = cases.regression_batch(1, 0, 2)
    torch.nn.functional.mse_loss(start(x0[:, :4], ("A",)), y0).backward()
    torch.testing.assert_close(outs[0][0], start.A.detach() - 0.05 * start.A.grad / 2)


def test_frozen_parameters_are_left_alone_even_with_weight_decay():
    model = cases_optim.TwoBranch()
    model.B.requires_grad_(False)
    before = model.B.detach().clone()
    opt = gradzip.optim.SSGD(model.parameters(), lr=0.1, weight_decay=0.1, momentum=0.9)
    x, y = cases.regression_batch(1, 0, 1)
    torch.nn.functional.mse_loss(model(x[:, :4], ("A", "B")), y).backward()
    opt.step()
    assert torch.equal(model.B, before) and model.B.grad is None


@pytest.mark.slow
@pytest.mark.parametrize("uses", [cases_optim.AB[:2], cases_optim.COUNTS], ids=["A-vs-B", "different-counts"])
def test_missing_gradient_is_a_zero_gradient_on_gloo(uses):
    _check(run_processes(2, cases_optim.partial_pairs, uses))
