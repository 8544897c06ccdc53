"""gradzip.evaluation_model: the model to evaluate for any method, training state untouched."""
from __future__ import annotations

import pytest
import torch

import gradzip
from gradzip.optim import CDSGD, LocalSGD


def _filled(rank: int) -> torch.nn.Module:
    """The same values on every thread (no global RNG: the workers run concurrently), + rank."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape).mul(0.1).add(i + rank))
    return model


def test_differing_replicas_are_averaged_and_training_state_is_untouched():
    def fn(comm):
        model = _filled(comm.rank)
        opt = LocalSGD(model.parameters(), lr=0.1, H=4, comm=comm)
        own = [p.clone() for p in model.parameters()]
        sent = opt.bytes_sent
        evaluated = gradzip.evaluation_model(model, opt)          # comm: the optimizer's
        untouched = all(torch.equal(a, b) for a, b in zip(own, model.parameters()))
        return [p.clone() for p in evaluated.parameters()], untouched, opt.bytes_sent == sent, evaluated is model

    results = gradzip.simulate(3, fn)
    base = _filled(0)
    for avg, untouched, no_bytes, same in results:
        assert untouched and no_bytes and not same
        for p, q in zip(avg, base.parameters()):
            torch.testing.assert_close(p, q + 1.0)                # mean of +0, +1, +2
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[2][0]))


def test_the_global_model_of_cdsgd_lands_on_the_right_parameters_in_any_optimizer_order():
    """The optimizer holds the parameters in reverse order: its global model still goes to
    the right tensors (matched by identity, not by position)."""
    def fn(comm):
        model = _filled(0)
        params = list(model.parameters())[::-1]
        opt = CDSGD(params, lr=0.1, k=2, warmup_steps=0, overlap=False, comm=comm)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(5, 3, generator=torch.Generator().manual_seed(comm.rank))).sum().backward()
            opt.step()
        evaluated = gradzip.evaluation_model(model, opt)
        glob = opt.evaluation_parameters()
        expected = {id(p): g for p, g in zip(params, glob)}
        ok = all(torch.equal(e, expected[id(p)]) for e, p in zip(evaluated.parameters(), model.parameters()))
        differs = any(not torch.equal(e, p) for e, p in zip(evaluated.parameters(), model.parameters()))
        return ok, differs

    for ok, differs in gradzip.simulate(2, fn):
        assert ok and differs


def test_a_plain_torch_optimizer_or_none_evaluates_the_model_itself_and_bad_input_is_named():
    model = torch.nn.Linear(2, 2)
    assert gradzip.evaluation_model(model) is model
    assert gradzip.evaluation_model(model, torch.optim.SGD(model.parameters(), lr=0.1)) is model
    with pytest.raises(gradzip.GradzipError, match="eval_on must be"):
        gradzip.evaluation_model(model, eval_on="mean")
    with pytest.raises(gradzip.GradzipError, match="model.module"):
        gradzip.evaluation_model(list(model.parameters()))
