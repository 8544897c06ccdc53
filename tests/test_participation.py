"""Which parameters a method holds and which take part in a step (gradzip.optim.participation;
issue 35): a parameter listed twice is held and updated once, with the backward overlap on
or off alike (item 4); a sparse gradient is refused in one line (item 12)."""
from __future__ import annotations

import warnings

import pytest
import torch

import cases
import gradzip
from gradzip.errors import GradzipError
from gradzip.optim import METHODS


def _with_overlap(method: str) -> list:
    """The ``overlap_backward`` settings ``method`` takes ([None]: it has no such option)."""
    return [True, False] if METHODS[method].overlaps_backward else [None]


def train_listed(comm, method: str, twice: bool, overlap, steps: int = 4):
    """``steps`` steps of ``method`` on the tiny model, its first weight and last bias listed
    a second time at the end of the parameter list when ``twice``. Final parameters."""
    model = cases.tiny_model()
    params = list(model.parameters())
    if twice:
        params += [params[0], params[3]]
    extra = {} if overlap is None else {"overlap_backward": overlap}
    opt = METHODS[method](params, comm=comm, lr=0.05, **cases.SHORT_RUNS[method], **extra)
    for t in range(1, steps + 1):
        x, y = cases.regression_batch(t, comm.rank, comm.world_size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    if hasattr(opt, "close"):
        opt.close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("method", sorted(cases.SHORT_RUNS))
def test_a_parameter_listed_twice_is_updated_once_on_either_path(method):
    """Issue 35 item 4: ``EFSGD([a, a])`` was never updated with ``overlap_backward=True``
    and updated twice with ``False``; now held once (one warning), and every method gives
    the bits of the list without the repeat, on 2 workers, either path."""
    for overlap in _with_overlap(method):
        once = gradzip.simulate(2, lambda c: train_listed(c, method, False, overlap))
        with pytest.warns(UserWarning, match=r"more than once .* held once and updated once"):
            twice = gradzip.simulate(2, lambda c: train_listed(c, method, True, overlap))
        for rank_once, rank_twice in zip(once, twice):
            cases.assert_bitwise_equal(rank_once, rank_twice, f"{method} overlap_backward={overlap}")


def test_the_warning_points_at_the_callers_line_and_names_are_kept_in_step():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = gradzip.optim.SSGD([("a", a), ("b", b), ("a again", a)], lr=0.1)
    ours = [w for w in caught if "held once" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__
    assert opt.param_groups[0]["params"] == [a, b] and opt.param_groups[0]["param_names"] == ["a", "b"]
    inner = torch.optim.AdamW([a, b, a, b])
    with pytest.warns(UserWarning, match="inner param_groups"):
        gradzip.optim.Compressed(inner)
    assert inner.param_groups[0]["params"] == [a, b]   # the shared groups hold each once


SPARSE_METHODS = sorted(METHODS)


@pytest.mark.parametrize("method", SPARSE_METHODS)
def test_a_sparse_gradient_is_refused_in_one_line_with_nothing_changed(method):
    """Issue 35 item 12: ``nn.Embedding(sparse=True)`` raised raw errors in most methods (and
    went through by accident in others); every method now refuses it in one line naming
    the parameter and the fix, on either path, before anything changed."""
    for overlap in _with_overlap(method):
        emb = torch.nn.Embedding(5, 3, sparse=True)
        head = torch.nn.Linear(3, 1)
        extra = {} if overlap is None else {"overlap_backward": overlap}
        opt = METHODS[method]([*emb.parameters(), *head.parameters()], lr=0.05, **extra)
        before = [p.detach().clone() for p in (*emb.parameters(), *head.parameters())]
        with pytest.raises(GradzipError) as error:
            head(emb(torch.tensor([1, 2]))).sum().backward()
            opt.step()
        message = str(error.value)
        assert "\n" not in message and "parameter #0 (shape (5, 3)) has a sparse gradient" in message
        assert "sparse=False" in message
        assert opt.steps == 0
        assert all(torch.equal(p, q) for p, q in zip(before, (*emb.parameters(), *head.parameters())))
        if hasattr(opt, "close"):
            opt.close()


@pytest.mark.parametrize("optimizer", [gradzip.optim.LARS, gradzip.optim.LAMB])
def test_the_plain_optimizers_refuse_a_sparse_gradient_in_one_line(optimizer):
    emb = torch.nn.Embedding(5, 3, sparse=True)
    opt = optimizer(emb.parameters(), lr=0.01)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(GradzipError, match=rf"{optimizer.__name__}: parameter #0 .* sparse gradient .* sparse=False"):
        opt.step()
