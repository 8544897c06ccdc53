"""NaN / Inf gradients (issue 7, part 3; optim/base.py ``nonfinite``): detected before
anything is compressed or sent; ``skip`` skips the step on every worker leaving residuals,
momentum and counters as if the step never happened; ``raise`` stops the run naming the
worker and parameter."""
from __future__ import annotations

import pytest
import torch

import cases
import gradzip
from gradzip.errors import GradzipError
from gradzip.comm.launch import run_processes
from gradzip.guards.nonfinite import NonFiniteGradient


def _all_ranks_raised(errors: list, n: int = 2, hang_guard_s: float = 120.0) -> int:
    """How many ranks raised, once all ``n`` did or ``hang_guard_s`` passed: simulate() returns
    GRACE_S after the first failure, and on a loaded machine a peer left running then still
    raises a moment later."""
    import time
    give_up = time.monotonic() + hang_guard_s
    while len(errors) < n and time.monotonic() < give_up:
        time.sleep(0.05)
    return len(errors)


def _same_except_skip_count(skipped, dropped, method):
    (p_skip, s_skip), (p_drop, s_drop) = skipped, dropped
    assert s_skip["gradzip"].pop("skipped_steps") == 1 and s_drop["gradzip"].pop("skipped_steps") == 0
    cases.assert_bitwise_equal(p_skip, p_drop, f"{method} parameters")
    cases.assert_bitwise_equal(s_skip, s_drop, f"{method} state")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_skip_is_the_step_left_out_for_every_method_on_threads(value):
    def pairs(comm):
        return {m: (cases.train_with_bad_gradient(comm, m, dict(o, nonfinite="skip"), value=value),
                    cases.train_with_bad_gradient(comm, m, o, drop=True)) for m, o in cases.SHORT_RUNS.items()}
    for rank_out in gradzip.simulate(3, pairs):
        assert set(rank_out) == set(gradzip.optim.METHODS)
        for method, (skipped, dropped) in rank_out.items():
            _same_except_skip_count(skipped, dropped, method)


@pytest.mark.slow
def test_skip_is_the_step_left_out_for_every_method_on_gloo():
    for rank_out in run_processes(2, cases.bad_gradient_pairs):
        for method, (skipped, dropped) in rank_out.items():
            _same_except_skip_count(skipped, dropped, method)


@pytest.mark.parametrize("codec", ["topk:ratio=0.3", "none"])
def test_raise_names_the_rank_and_parameter_and_changes_nothing(codec):
    """With ``none`` the gradients are not read before the exchange (EF-SGD's input keeps
    their NaN/Inf, the aggregate check finds it) and the error names them all the same."""
    with pytest.raises(NonFiniteGradient, match=r"EFSGD step 3: non-finite gradient .* on rank 1, "
                                                r"parameter #0 \(shape \(6, 4\)\).*--nonfinite skip"):
        gradzip.simulate(2, lambda comm: cases.raise_on_bad_gradient(comm, compressor=codec))
    # state untouched by the failed step: a world of one, checked before and after
    model = cases.tiny_model()
    opt = gradzip.optim.EFSGD(model.parameters(), lr=0.05, compressor=codec)
    assert opt.gradients_checked_by_exchange() == (codec == "none")
    for t in (1, 2):
        x, y = cases.regression_batch(t, 0, 1)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if t == 2:
            before = ([p.detach().clone() for p in model.parameters()], opt.state_dict())
            next(model.parameters()).grad[0, 0] = float("nan")
            with pytest.raises(NonFiniteGradient):
                opt.step()
            after = ([p.detach().clone() for p in model.parameters()], opt.state_dict())
            cases.assert_bitwise_equal(before, after)
        else:
            opt.step()


@pytest.mark.slow
def test_raise_on_gloo_reaches_the_launcher_as_the_root_cause():
    with pytest.raises(GradzipError, match="non-finite gradient .* on rank 1"):
        run_processes(2, cases.raise_on_bad_gradient)


def test_off_lets_the_nan_through():
    p, state = cases.train_with_bad_gradient(gradzip.comm.make_group(1)[0], "ssgd", {"nonfinite": "off"},
                                             bad_rank=0)
    assert torch.isnan(p[0]).any()


def test_bad_policy_is_refused():
    with pytest.raises(GradzipError, match="nonfinite must be one of raise, skip, off, got 'ignore'"):
        gradzip.optim.SSGD(cases.tiny_model().parameters(), lr=0.1, nonfinite="ignore")


def test_cli_skip_counts_skipped_steps():
    # every gradient finite: nothing skipped, and the summary says so
    from gradzip.train.config import RunConfig
    from gradzip.train.loop import run_worker

    cfg = RunConfig(epochs=1, progress=False, nonfinite="skip")
    out = gradzip.simulate(2, lambda c: run_worker(c, cfg))[0]
    assert out["summary"]["skipped_steps"] == 0 and out["summary"]["steps"] == 22


def test_a_sum_that_overflows_is_not_taken_for_a_nan():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = gradzip.optim.SSGD([p], lr=0.1)
    p.grad = torch.tensor([3e38, 3e38, 0.0, 1.0])  # finite values whose float32 sum is inf
    opt.step()
    assert opt.steps == 1 and torch.isfinite(p).all()
    p.grad = torch.tensor([float("inf"), float("-inf"), 0.0, 1.0])  # a sum of NaN
    with pytest.raises(NonFiniteGradient, match="parameter #0"):
        opt.step()


# -- issue 12, item 4: what the codec produces is guarded too ------------------------------
import cases_optim  # noqa: E402


@pytest.mark.parametrize("name", sorted(cases_optim.OVERFLOWS))
def test_codec_overflow_raises_on_every_rank_before_the_model_changes(name):
    errors = []

    def worker(comm):
        try:
            return cases_optim.train_with_overflow(comm, name, "raise")
        except NonFiniteGradient as exc:
            errors.append(str(exc))
            raise
    with pytest.raises(NonFiniteGradient, match=r"step 3: .*non-finite aggregate.*overflowed"):
        gradzip.simulate(2, worker)
    assert _all_ranks_raised(errors) == 2  # every rank stopped at the same exchange, none named a "gone" peer


@pytest.mark.parametrize("name", sorted(cases_optim.OVERFLOWS))
def test_codec_overflow_skip_is_the_step_left_out_on_every_rank(name):
    def pair(comm):
        return (cases_optim.train_with_overflow(comm, name, "skip"),
                cases_optim.train_with_overflow(comm, name, "skip", drop=True))
    for (p_skip, s_skip, n_skip), (p_drop, s_drop, n_drop) in gradzip.simulate(2, pair):
        assert (n_skip, n_drop) == (1, 0)
        assert all(bool(torch.isfinite(p).all()) for p in p_skip)
        s_skip["gradzip"].pop("skipped_steps"), s_drop["gradzip"].pop("skipped_steps")
        for s in (s_skip, s_drop):  # the skipped step's packets were sent: bytes differ, as documented
            s["gradzip"].pop("exchanges")
        cases.assert_bitwise_equal(p_skip, p_drop, f"{name} parameters")
        cases.assert_bitwise_equal(s_skip, s_drop, f"{name} state")


def test_codec_overflow_in_a_method_that_cannot_undo_raises_under_skip():
    def worker(comm):
        model = cases.tiny_model()
        opt = gradzip.optim.LocalSGD(model.parameters(), comm=comm, lr=1.0, H=1, nonfinite="skip")
        with torch.no_grad():
            next(model.parameters()).fill_(3e38)
        x, y = cases.regression_batch(1, comm.rank, comm.world_size)
        model.zero_grad()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    with pytest.raises(NonFiniteGradient, match="cannot undo"):
        gradzip.simulate(2, worker)


def test_exchange_guard_costs_nothing_when_off():
    psync = gradzip.PSync(gradzip.comm.make_group(1)[0], "fp16")
    assert not psync.check_finite
    assert not bool(torch.isfinite(psync([torch.full((3,), 1e5)], 1).aggregate[0]).all())


def test_codec_overflow_under_raise_leaves_model_and_state_as_before_the_step():
    def worker(comm):
        model = cases.tiny_model()
        opt = gradzip.optim.SSGD(model.parameters(), comm=comm, lr=0.1, momentum=0.9, compressor="fp16")
        for t in (1, 2):
            x, y = cases.regression_batch(t, comm.rank, comm.world_size)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if t == 2:
                before = ([p.detach().clone() for p in model.parameters()], opt.state_dict())
                next(model.parameters()).grad.fill_(1e5)
                with pytest.raises(NonFiniteGradient, match="SSGD step 2: the fp16 exchange of tensor #0"):
                    opt.step()
                after = ([p.detach().clone() for p in model.parameters()], opt.state_dict())
                for s in (before[1], after[1]):
                    s["gradzip"].pop("exchanges")
                cases.assert_bitwise_equal(before, after)
            else:
                opt.step()
        return "ok"
    assert gradzip.simulate(2, worker) == ["ok", "ok"]


@pytest.mark.parametrize("overlap", [True, False])
def test_codec_overflow_in_the_background_exchange_of_cdsgd_raises_on_every_rank(overlap):
    errors = []

    def worker(comm):
        x = torch.nn.Parameter(torch.zeros(6))
        opt = gradzip.optim.ODSGD([x], comm=comm, lr=1e-6, warmup_steps=1, overlap=overlap, nonfinite="skip")
        try:
            for t in range(1, 5):
                x.grad = torch.full((6,), 3e38 if t == 2 else 1.0)
                opt.step()
            opt.synchronize()
        except NonFiniteGradient as exc:
            errors.append(str(exc))
            raise
    with pytest.raises(NonFiniteGradient, match="non-finite aggregate.*cannot undo"):
        gradzip.simulate(2, worker)
    assert _all_ranks_raised(errors) == 2


# -- issue 13, item 1: a skipped step is explicit control flow in every step() -------------
def test_every_step_is_its_own_function_no_wrapper_installed():
    import inspect
    for name, cls in gradzip.optim.METHODS.items():
        step = next(c.__dict__["step"] for c in cls.__mro__ if "step" in c.__dict__)
        layers = [step]
        while hasattr(layers[-1], "__wrapped__"):  # torch.no_grad's wrappers
            layers.append(layers[-1].__wrapped__)
        body = layers[-1]
        wrappers = [f.__code__.co_filename for f in layers[:-1]]
        assert not any("gradzip" in f for f in wrappers), f"{name}: step() wrapped by gradzip ({wrappers})"
        assert "if skipped:" in inspect.getsource(body), f"{name}: step() does not return a skipped step itself"

    def own_step(self, closure=None):
        return "stepped"

    class Subclass(gradzip.optim.DistributedOptimizer):
        step = own_step
    assert Subclass.step is own_step


def test_begin_step_returns_skipped_and_the_step_returns_by_itself():
    class Probe(gradzip.optim.DistributedOptimizer):
        def step(self, closure=None):
            loss, pairs, params, skipped = self.begin_step(closure)
            return ("skipped" if skipped else "stepped", loss, len(pairs), len(params))

    x = torch.nn.Parameter(torch.zeros(3))
    opt = Probe([x], lr=0.1, nonfinite="skip")
    x.grad = torch.ones(3)
    assert opt.step(lambda: 7.0) == ("stepped", 7.0, 1, 1) and opt.steps == 1
    x.grad = torch.full((3,), float("nan"))
    assert opt.step(lambda: 8.0) == ("skipped", 8.0, 1, 1)
    assert (opt.steps, opt.skipped_steps) == (1, 1)


# -- issue 14: S-SGD's exact exchange finds a bad gradient in the aggregate it checks anyway --
def _ssgd_nan_on_rank_1(comm, overlap: bool, codec: str, value: float):
    """Rank 1's first gradient holds ``value`` at step 2 under nonfinite='raise': returns
    the error's text, after checking that model and state are as before the step."""
    model = cases.tiny_model()
    opt = gradzip.optim.SSGD(model.parameters(), comm=comm, lr=0.1, momentum=0.9, compressor=codec,
                             overlap_backward=overlap)
    for t in (1, 2):
        x, y = cases.regression_batch(t, comm.rank, comm.world_size)
        opt.zero_grad()
        if t == 2:
            before = ([p.detach().clone() for p in model.parameters()], opt.state_dict())
            model[0].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([2]), value)
                                          if comm.rank == 1 else g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if t == 2:
            with pytest.raises(NonFiniteGradient) as error:
                opt.step()
            after = ([p.detach().clone() for p in model.parameters()], opt.state_dict())
            for s in (before[1], after[1]):
                s["gradzip"].pop("exchanges")
            cases.assert_bitwise_equal(before, after)
            return str(error.value)
        opt.step()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("codec,value", [("none", float("nan")), ("fp16", float("inf")), ("none", float("-inf"))])
def test_ssgd_bad_gradient_found_in_the_aggregate_stops_every_rank_naming_it(overlap, codec, value):
    """S-SGD with ``none`` / ``fp16`` / ``bf16`` does not read its gradients before the
    exchange under "raise": the codec carries a NaN/Inf into the aggregate PSync checks
    anyway; then every rank (not only the bad one) raises, naming rank 1 and parameter #0,
    the step undone."""
    for text in gradzip.simulate(2, lambda comm: _ssgd_nan_on_rank_1(comm, overlap, codec, value)):
        assert "SSGD step 2: non-finite gradient (NaN or Inf) on rank 1, parameter #0 (shape (6, 4))" in text
        assert "found in the aggregate" in text


def test_ssgd_sum_of_finite_gradients_that_overflows_is_still_a_codec_overflow():
    def worker(comm):
        p = torch.nn.Parameter(torch.zeros(4))
        opt = gradzip.optim.SSGD([p], comm=comm, lr=0.1)
        p.grad = torch.tensor([3e38, 0.0, 1.0, 2.0])   # finite on both ranks; the sum is inf
        with pytest.raises(NonFiniteGradient, match="the none exchange of tensor #0 .* decoded a non-finite"):
            opt.step()
        return torch.equal(p.detach(), torch.zeros(4)) and opt.steps == 0
    assert gradzip.simulate(2, worker) == [True, True]


@pytest.mark.parametrize("overlap", [True, False])
def test_ssgd_guard_reads_no_gradient_before_its_exchange(overlap, monkeypatch):
    """One read pass fewer per step: under "raise" the hooks and begin_step leave the
    gradients to the exchange's aggregate check (only there is first_nonfinite called)."""
    import gradzip.optim.core.guard
    import gradzip.optim.core.overlap
    calls = []

    def counting(tensors):
        calls.append(len(tensors))
        return gradzip.guards.nonfinite.first_nonfinite(tensors)
    for module in (gradzip.optim.core.guard, gradzip.optim.core.overlap):
        monkeypatch.setattr(module, "first_nonfinite", counting)
    model = cases.tiny_model()
    opt = gradzip.optim.SSGD(model.parameters(), lr=0.1, overlap_backward=overlap)
    x, y = cases.regression_batch(1, 0, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert calls == [] and opt.steps == 1
    opt.nonfinite = "skip"   # skip still checks the gradients first (the workers agree before)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert calls


@pytest.mark.parametrize("method, options", [("ssgd", {}), ("efsgd", {"compressor": "none"})])
def test_a_nan_written_after_backward_raises_where_the_exchange_checks_the_gradients(method, options):
    """S-SGD and EF-SGD with ``none`` leave the gradients unread before the exchange
    (``gradients_checked_by_exchange``); a gradient made non-finite after its hook (here by
    ``clip_grad_norm_`` of an infinite norm, which turns every gradient into NaN) is found
    at ``step()`` and, under ``"raise"``, raises on that worker: it is not skipped."""

    def train(comm):
        model = cases.tiny_model()
        opt = gradzip.optim.METHODS[method](model.parameters(), comm=comm, lr=0.05, **options)
        assert opt.gradients_checked_by_exchange()
        for t in (1, 2):
            x, y = cases.regression_batch(t, comm.rank, comm.world_size)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if t == 2:
                next(model.parameters()).grad.view(-1)[1] = float("inf")   # after its hook
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

    with pytest.raises(NonFiniteGradient,
                       match=r"step 2: non-finite gradient .* on rank 0, parameter #0 .*exchanges begun in backward"):
        gradzip.simulate(1, train)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_first_nonfinite_finds_the_first_bad_tensor_among_small_large_and_mixed_dtypes(bad):
    """Small tensors are checked in batches (per dtype and device), large ones summed alone,
    complex ones by both parts, integer ones never bad; the position is the first bad one,
    whichever kind it is; an overflowing norm or sum alone is no NaN."""
    from gradzip.guards.nonfinite import SMALL, first_nonfinite

    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(k, generator=gen).to(dtype) for k, dtype in
               [(3, torch.float32), (SMALL + 1, torch.float32), (5, torch.bfloat16), (7, torch.float64),
                (2, torch.float32), (SMALL * 2, torch.bfloat16)]]
    tensors.append(torch.randn(4, generator=gen, dtype=torch.complex64))
    tensors.append(torch.arange(6))
    tensors.append(torch.full((9,), 3e38))   # its L1 norm overflows: finite all the same
    assert first_nonfinite(tensors) == -1
    for i in range(len(tensors) - 2):
        for j in range(i, len(tensors) - 2):
            edited = [t.clone() for t in tensors]
            for k in {i, j}:   # the first bad one is i (j, a later one, too)
                (torch.view_as_real(edited[k]) if edited[k].is_complex() else edited[k]).view(-1)[-1] = bad
            assert first_nonfinite(edited) == i, (i, j)
