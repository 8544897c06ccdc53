"""Which parameters a method holds and which take part in a step (gradzip.optim.core.participation;
issue 35): a parameter listed twice is held and updated once, with the backward overlap on
or off alike (item 4); a parameter frozen on some workers only is named on every worker
before anything is mixed or aborts (item 5); a sparse gradient is refused in one line
(item 12)."""
from __future__ import annotations

import warnings

import pytest
import torch

import cases
import cases_optim
import gradzip
from gradzip.errors import GradzipError
from gradzip.comm.launch import run_processes
from gradzip.optim import METHODS


def _with_overlap(method: str) -> list:
    """The ``overlap_backward`` settings ``method`` takes ([None]: it has no such option)."""
    return [True, False] if METHODS[method].overlaps_backward else [None]


def _train(comm, model, params: list, method: str, overlap, steps: int) -> None:
    """``steps`` steps of ``method`` (``cases.SHORT_RUNS`` options; ``overlap``: its
    ``overlap_backward``, None: unset) over ``params`` of ``model``, on the regression task."""
    extra = {} if overlap is None else {"overlap_backward": overlap}
    opt = METHODS[method](params, comm=comm, lr=0.05, **cases.SHORT_RUNS[method], **extra)
    for t in range(1, steps + 1):
        x, y = cases.regression_batch(t, comm.rank, comm.world_size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    if hasattr(opt, "close"):
        opt.close()


def train_listed(comm, method: str, twice: bool, overlap, steps: int = 4):
    """The tiny model, its first weight and last bias listed a second time at the end of the
    parameter list when ``twice`` (:func:`_train`). Final parameters."""
    model = cases.tiny_model()
    params = list(model.parameters())
    _train(comm, model, params + [params[0], params[3]] if twice else params, method, overlap, steps)
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


# -- the same set on every worker (item 5) ---------------------------------------------------
SYNCHRONOUS = [m for m in sorted(cases.SHORT_RUNS) if m != "asgd"]
RUNS = [(m, o) for m in SYNCHRONOUS for o in _with_overlap(m)]


@pytest.mark.parametrize("changes, named", [
    (cases_optim.SWAPPED, "'frozen parameters' differs — rank 0: [1]; rank 1: [0]"),
    (cases_optim.ONE_SIDED, "'frozen parameters' differs — rank 0: [0]; rank 1: []"),
], ids=["swapped-same-shapes", "one-sided-other-counts"])
def test_a_set_changed_on_some_ranks_only_is_named_on_every_rank_nothing_updated(changes, named):
    """Issue 35 item 5: rank 0 freezing B while rank 1 froze A (same shapes) averaged their
    gradients together; different counts were a raw RuntimeError (threads) or a SIGABRT
    (gloo). Now every method stops on every rank, at the first step that exchanges the
    set, naming each rank's frozen parameters, before that step changed anything."""
    outs = gradzip.simulate(2, lambda c: cases_optim.freezing_runs(c, changes, RUNS))
    for rank_out in outs:
        assert set(rank_out) == set(RUNS)
        for run, out in rank_out.items():
            assert "refused" in out, f"{run} trained on: {out}"
            assert named in out["refused"] and "\n" not in out["refused"], (run, out["refused"])
            assert out["untouched"], run


def test_a_set_changed_alike_on_every_rank_trains_on_and_the_overlap_changes_no_bit():
    """Freezing B on every rank before step 2 and unfreezing it before step 4 is a change
    the workers agree on: every method trains on, B stays as it was while frozen, and the
    backward overlap (which exchanges such a step again over the new set) gives the bits of
    ``overlap_backward=False``."""
    outs = gradzip.simulate(2, lambda c: cases_optim.freezing_runs(c, cases_optim.ALIKE, RUNS))
    for rank_out in outs:
        for (method, overlap), out in rank_out.items():
            assert "params" in out, f"{method} overlap_backward={overlap}: {out}"
            after_1, after_3 = out["B while frozen"]
            assert torch.equal(after_1, after_3), method
            if overlap:
                cases.assert_bitwise_equal(out["params"], rank_out[(method, False)]["params"], method)


def test_asgd_refuses_a_set_changed_after_it_was_built_in_one_line():
    """A-SGD's server holds the parameters that took part when it was built (no collective
    per step to agree on another set): a change is refused on the worker that made it."""
    outs = gradzip.simulate(2, lambda c: cases_optim.freezing_runs(c, cases_optim.ALIKE, [("asgd", None)]))
    for rank_out in outs:
        out = rank_out[("asgd", None)]
        assert out["step"] == 2 and out["untouched"]
        assert "parameter(s) #1 were frozen or unfrozen (requires_grad) after the optimizer was built" in out["refused"]


@pytest.mark.slow
def test_a_set_changed_on_one_gloo_rank_is_named_instead_of_aborting():
    """On gloo, collectives of different sizes abort the process (SIGABRT): the agreement
    comes before them, on the backward overlap's path and on the one-call path."""
    runs = [("efsgd", True), ("efsgd", False), ("powersgd", None)]
    for rank_out in run_processes(2, cases_optim.freezing_runs, cases_optim.ONE_SIDED, runs):
        for run, out in rank_out.items():
            assert "'frozen parameters' differs — rank 0: [0]; rank 1: []" in out.get("refused", ""), (run, out)
            assert out["untouched"], run


# -- complex parameters (item 6) ----------------------------------------------------------------
#: The methods whose box reads real entries (their ``complex_parameters`` is False).
COMPLEX_REFUSED = ["asgd", "dgc", "onebitadam", "onebitlamb", "powersgd", "zerooneadam"]
COMPLEX_TAKEN = [m for m in sorted(cases.SHORT_RUNS) if m not in COMPLEX_REFUSED]


class ComplexModel(torch.nn.Module):
    """A complex weight ``z`` (3 x 2) and a real bias; ``real_view=True``: the same model with
    ``z`` held as a real parameter of shape (3, 2, 2), used through ``torch.view_as_complex``
    (what torch's optimizers do with a complex parameter inside)."""

    def __init__(self, real_view: bool):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        z = torch.randn(3, 2, 2, generator=g) * 0.5
        self.z = torch.nn.Parameter(z if real_view else torch.view_as_complex(z))
        self.bias = torch.nn.Parameter(torch.randn(2, generator=g))

    def forward(self, x):
        z = self.z if self.z.is_complex() else torch.view_as_complex(self.z)
        h = x[:, :3].to(z.dtype) @ z
        return h.real + 0.5 * h.imag + self.bias


def train_complex(comm, method: str, real_view: bool, overlap, steps: int = 5):
    model = ComplexModel(real_view)
    _train(comm, model, list(model.parameters()), method, overlap, steps)
    z = model.z.detach()
    return [torch.view_as_real(z) if z.is_complex() else z, model.bias.detach()]


@pytest.mark.parametrize("method", COMPLEX_TAKEN)
def test_a_complex_parameter_trains_as_its_real_view(method):
    """Issue 35 item 6: a complex parameter went wrong silently (the imaginary part dropped)
    or raised raw errors; a method whose box allows it now gives, on 2 workers and either
    path, the numbers of the real view (torch's own treatment of complex parameters): bit
    for bit where its box only scales and adds (EF-SGD, BIT-SGD, local SGD, the torch
    optimizers inside Compressed), to float rounding where it adds with a factor
    (``add_(x, alpha=)`` rounds the complex product differently from two real ones)."""
    for overlap in _with_overlap(method):
        pairs = gradzip.simulate(2, lambda c: (train_complex(c, method, False, overlap),
                                               train_complex(c, method, True, overlap)))
        for as_complex, as_real in pairs:
            for a, b in zip(as_complex, as_real):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{method} overlap_backward={overlap}")


def test_which_methods_take_complex_parameters_is_a_class_attribute():
    assert [m for m in sorted(METHODS) if not METHODS[m].complex_parameters] == COMPLEX_REFUSED


@pytest.mark.parametrize("method", COMPLEX_REFUSED)
def test_a_method_whose_box_reads_real_entries_refuses_a_complex_parameter_in_one_line(method):
    with pytest.raises(GradzipError) as error:
        METHODS[method](ComplexModel(real_view=False).parameters(), lr=0.05)
    message = str(error.value)
    assert "\n" not in message and "parameter #0 (shape (3, 2)) is torch.complex64" in message
    assert "torch.view_as_complex" in message


def test_the_plain_lamb_and_lars_take_a_complex_parameter_as_torch_adam_does():
    """LAMB dropped the imaginary part of v = g² (``0.99684-0j`` where Adam's rule gives
    ``0.999-0.001j``); LAMB and LARS now equal themselves on the real view."""
    for optimizer in (gradzip.optim.LAMB, gradzip.optim.LARS):
        finals = []
        for real_view in (False, True):
            model = ComplexModel(real_view)
            opt = optimizer(model.parameters(), lr=0.01, weight_decay=0.01, exclude_1d=False)
            for t in range(1, 4):
                x, y = cases.regression_batch(t, 0, 1)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            z = model.z.detach()
            finals.append(torch.view_as_real(z) if z.is_complex() else z)
        torch.testing.assert_close(finals[0], finals[1], rtol=1e-6, atol=1e-7, msg=optimizer.__name__)


def test_a_nan_in_the_imaginary_part_is_seen():
    from gradzip.guards.nonfinite import first_nonfinite
    assert first_nonfinite([torch.ones(2, dtype=torch.complex64),
                            torch.tensor([1 + 1j, complex(0.0, float("nan"))])]) == 1


@pytest.mark.parametrize("n, options", [(3, {"transport": "twophase"}), (4, {"hierarchy": 2}),
                                        (3, {"transport": "allgather", "compressor": "sign"})],
                         ids=["twophase", "hierarchy", "allgather"])
def test_every_transport_carries_a_complex_tensor_as_its_real_view(n, options):
    def run(comm, real_view):
        model = ComplexModel(real_view)
        opt = gradzip.optim.EFSGD(model.parameters(), comm=comm, lr=0.05,
                                  **{"compressor": "2bit:threshold=0.05", **options})
        for t in range(1, 4):
            x, y = cases.regression_batch(t, comm.rank, comm.world_size)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        z = model.z.detach()
        return torch.view_as_real(z) if z.is_complex() else z
    for a, b in gradzip.simulate(n, lambda c: (run(c, False), run(c, True))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
