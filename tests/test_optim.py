
import pytest
import torch

import gradzip
from gradzip.errors import GradzipError
from gradzip.comm.launch import run_processes
from gradzip.optim import BitSGD, EFSGD, SSGD

import cases


def reference_sgd(steps, n, **sgd_options):
    """Single-process torch.optim.SGD on the concatenated batch of all n workers."""
    model = cases.tiny_model()
    opt = torch.optim.SGD(model.parameters(), **sgd_options)
    for t in range(1, steps + 1):
        x = torch.cat([cases.regression_batch(t, r, n)[0] for r in range(n)])
        y = torch.cat([cases.regression_batch(t, r, n)[1] for r in range(n)])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("options", [dict(lr=0.1), dict(lr=0.1, momentum=0.9, weight_decay=0.01),
                                     dict(lr=0.05, momentum=0.9, nesterov=True)])
def test_ssgd_equals_single_process_sgd_on_concatenated_batch(n, options):
    outs = gradzip.simulate(n, lambda c: cases.train_method(c, "ssgd", options, steps=6))
    expected = reference_sgd(6, n, **options)
    for params in outs:
        for p, e in zip(params, expected):
            torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 3])
def test_efsgd_with_identity_codec_is_ssgd(n):
    opts = dict(lr=0.1, momentum=0.9)
    cases.assert_same_runs(cases.simulate_method(n, "efsgd", dict(opts, compressor="none")),
                           cases.simulate_method(n, "ssgd", opts), atol=1e-7)


def test_efsgd_with_one_worker_and_topk_is_not_sgd_but_conserves_the_error():
    model = cases.tiny_model()
    opt = EFSGD(model.parameters(), lr=0.1, compressor="topk:ratio=0.3")
    x, y = cases.regression_batch(1, 0, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    for p, b, g in zip(model.parameters(), before, grads):
        moved = b - p.detach()                    # mean_j p'_j (one worker: C(p))
        err = opt.state[p]["error"]
        torch.testing.assert_close(moved + err, 0.1 * g, rtol=1e-6, atol=1e-7)  # p = C(p) + e
        assert (err != 0).any()                   # something was held back: not SGD


def bitsgd_reference(n, steps, lr, threshold, momentum, wd):
    """BIT-SGD by hand: residual on raw grads, 2-bit, mean, momentum SGD after the mean."""
    models = [cases.tiny_model() for _ in range(n)]
    residual = [[torch.zeros_like(p) for p in models[0].parameters()] for _ in range(n)]
    buf = [None] * len(list(models[0].parameters()))
    for t in range(1, steps + 1):
        quantized = []
        for r, m in enumerate(models):
            x, y = cases.regression_batch(t, r, n)
            m.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            qs = []
            for i, p in enumerate(m.parameters()):
                acc = residual[r][i] + p.grad
                q = torch.where(acc >= threshold, threshold, torch.where(acc <= -threshold, -threshold, 0.0))
                residual[r][i] = acc - q
                qs.append(q)
            quantized.append(qs)
        with torch.no_grad():
            for i, params in enumerate(zip(*[m.parameters() for m in models])):
                mean = sum(q[i] for q in quantized) / n
                u = mean + wd * params[0]
                buf[i] = u.clone() if buf[i] is None else buf[i] * momentum + u
                for p in params:
                    p.sub_(lr * buf[i])
    return [p.detach() for p in models[0].parameters()]


def test_bitsgd_matches_hand_written_reference():
    opts = dict(lr=0.1, threshold=0.05, momentum=0.9, weight_decay=0.01)
    outs = gradzip.simulate(2, lambda c: cases.train_method(c, "bitsgd", opts, steps=5))
    expected = bitsgd_reference(2, 5, 0.1, 0.05, 0.9, 0.01)
    for p, e in zip(outs[0], expected):
        torch.testing.assert_close(p, e, rtol=1e-6, atol=1e-6)


def test_replicas_stay_bitwise_identical_on_threads():
    outs = gradzip.simulate(3, cases.train_all_methods)
    for name in cases.METHOD_RUNS:
        for other in outs[1:]:
            for a, b in zip(outs[0][name], other[name]):
                assert torch.equal(a, b), name


@pytest.mark.slow
def test_replicas_bitwise_identical_and_agree_with_threads_on_gloo():
    procs = run_processes(3, cases.train_all_methods)
    threads = gradzip.simulate(3, cases.train_all_methods)
    for name in cases.METHOD_RUNS:
        for other in procs[1:]:
            for a, b in zip(procs[0][name], other[name]):
                assert torch.equal(a, b), name
        for a, b in zip(procs[0][name], threads[0][name]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("method, options", [
    ("efsgd", dict(lr=0.1, compressor="topk:ratio=0.3", momentum=0.9)),
    ("bitsgd", dict(lr=0.1, threshold=0.05, momentum=0.9)),
    ("ssgd", dict(lr=0.1, compressor="qsgd", momentum=0.9)),
])
def test_state_dict_resume_is_exact(method, options):
    straight = gradzip.simulate(2, lambda c: cases.train_with_resume(c, method, options, 6, split=None))
    resumed = gradzip.simulate(2, lambda c: cases.train_with_resume(c, method, options, 6, split=4))
    for (pa, sa), (pb, _) in zip(straight, resumed):
        for a, b in zip(pa, pb):
            assert torch.equal(a, b)
    residual_key = {"efsgd": "error", "bitsgd": "residual"}.get(method)
    if residual_key:
        assert all(residual_key in s for s in straight[0][1]["state"].values())
    assert straight[0][1]["gradzip"]["steps"] == 6


def test_lr_scheduler_drives_the_learning_rate():
    model = cases.tiny_model()
    opt = SSGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.0)
    x, y = cases.regression_batch(1, 0, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    sched.step()  # lr is now 0: the next step must not move the model
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("make, message", [
    (lambda ps: SSGD(ps, lr=-1), "lr must be"),
    (lambda ps: SSGD(ps, lr=0.1, momentum=1.0), "momentum must be in"),
    (lambda ps: SSGD(ps, lr=0.1, nesterov=True), "nesterov=True needs momentum"),
    (lambda ps: EFSGD(ps, lr=0.1, weight_decay=-1), "weight_decay"),
    (lambda ps: EFSGD(ps, lr=0.1, compressor="topk:ratio=0"), "ratio"),
    (lambda ps: SSGD(ps, lr=0.1, compressor="zip"), "valid names"),
    (lambda ps: BitSGD(ps, lr=0.1, threshold=0), "threshold must be > 0"),
])
def test_bad_options_raise_a_clear_error(make, message):
    with pytest.raises(GradzipError, match=message):
        make(cases.tiny_model().parameters())


def test_loading_another_methods_state_is_refused():
    model = cases.tiny_model()
    state = SSGD(model.parameters(), lr=0.1).state_dict()
    with pytest.raises(GradzipError, match="saved by SSGD"):
        EFSGD(model.parameters(), lr=0.1).load_state_dict(state)


def test_efsgd_rc_derives_the_error_reset_methods_codec():
    params = cases.tiny_model().parameters()
    assert str(EFSGD(params, lr=0.1).psync.compressor) == "topk:ratio=0.01"
    assert EFSGD(cases.tiny_model().parameters(), lr=0.1, rc=64).psync.compressor.in_ == 64
    with pytest.raises(GradzipError, match="either rc"):
        EFSGD(cases.tiny_model().parameters(), lr=0.1, rc=64, compressor="topk:ratio=0.1")
    with pytest.raises(GradzipError, match="rc"):
        EFSGD(cases.tiny_model().parameters(), lr=0.1, rc=0)


# -- issue 12, item 9: load_state_dict refuses what it cannot use; add_param_group ----------
def _two_workers_state(comm):
    model = cases.tiny_model()
    opt = EFSGD(model.parameters(), comm=comm, lr=0.1, compressor="topk:ratio=0.3")
    x, y = cases.regression_batch(1, comm.rank, comm.world_size)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return opt.state_dict()


def test_a_state_from_another_world_size_is_refused():
    state = gradzip.simulate(2, _two_workers_state)[0]
    with pytest.raises(GradzipError, match=r"'world_size' is 2 in this state, the group has 1 workers"):
        EFSGD(cases.tiny_model().parameters(), lr=0.1, compressor="topk:ratio=0.3").load_state_dict(state)


def test_a_plain_torch_state_is_refused():
    model = cases.tiny_model()
    state = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).state_dict()
    with pytest.raises(GradzipError, match=r"no 'gradzip' entry .*torch\.optim"):
        SSGD(model.parameters(), lr=0.1).load_state_dict(state)


@pytest.mark.parametrize("field, value, message", [
    ("lr", float("nan"), r"param_groups\[0\]\.lr must be a finite number"),
    ("momentum", 5, r"param_groups\[0\]\.momentum must be in \[0, 1\), got 5"),
    ("weight_decay", -1.0, r"param_groups\[0\]\.weight_decay"),
    ("nesterov", "yes", r"param_groups\[0\]\.nesterov must be True or False"),
])
def test_param_group_hyperparameters_that_fail_the_constructor_checks_are_refused(field, value, message):
    model = cases.tiny_model()
    state = SSGD(model.parameters(), lr=0.1).state_dict()
    state["param_groups"][0][field] = value
    opt = SSGD(model.parameters(), lr=0.1)
    with pytest.raises(GradzipError, match=message):
        opt.load_state_dict(state)
    assert opt.param_groups[0]["lr"] == 0.1  # nothing loaded


def test_a_powersgd_state_of_another_rank_is_refused():
    def state(rank):
        model = torch.nn.Linear(32, 32)
        opt = gradzip.optim.PowerSGD(model.parameters(), lr=0.1, rank=rank, start_iter=0)
        model(torch.ones(2, 32)).sum().backward()
        opt.step()
        return model, opt.state_dict()
    model, saved = state(2)
    with pytest.raises(GradzipError, match=r"'q' of parameter #0 \(shape \(32, 32\)\) has shape \(32, 2\) "
                                           r"\(rank 2\), this optimizer's rank=4 needs \(32, 4\)"):
        gradzip.optim.PowerSGD(model.parameters(), lr=0.1, rank=4, start_iter=0).load_state_dict(saved)
    gradzip.optim.PowerSGD(model.parameters(), lr=0.1, rank=2, start_iter=0).load_state_dict(saved)


def test_add_param_group_mid_run_as_torch_does():
    def run(comm, add_at):
        torch.manual_seed(0)
        first, second = cases.tiny_model(), torch.nn.Linear(4, 2)
        with torch.no_grad():
            second.weight.fill_(0.1), second.bias.fill_(0.2)
        opt = EFSGD(first.parameters(), comm=comm, lr=0.1, compressor="topk:ratio=0.3", momentum=0.9)
        if add_at == 0:
            opt.add_param_group({"params": second.parameters(), "lr": 0.05})
        for t in range(1, 5):
            if t == add_at:
                opt.add_param_group({"params": second.parameters(), "lr": 0.05})
            x, y = cases.regression_batch(t, comm.rank, comm.world_size)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(first(x), y)
            if t >= add_at:
                loss = loss + torch.nn.functional.mse_loss(second(x), y)
            loss.backward()
            opt.step()
        assert opt.param_groups[1]["momentum"] == 0.9 and opt.param_groups[1]["lr"] == 0.05
        return [p.detach().clone() for p in list(first.parameters()) + list(second.parameters())]
    outs = gradzip.simulate(2, lambda c: run(c, 3))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert not torch.equal(outs[0][-1], torch.full((2,), 0.2))  # the added group trained
    with pytest.raises(GradzipError, match=r"param_groups\[1\]\.momentum must be in \[0, 1\), got 5"):
        SSGD(cases.tiny_model().parameters(), lr=0.1).add_param_group(
            {"params": torch.nn.Linear(2, 2).parameters(), "momentum": 5})


def test_torch_optimizer_methods_skip_the_dynamo_wrapper_only_while_dynamo_is_not_imported(monkeypatch):
    """``torch._disable_dynamo`` wraps add_param_group, zero_grad, state_dict and
    load_state_dict; its first call imports torch._dynamo (as long as ``import torch``).
    gradzip calls the wrapped function while nothing could be compiling (torch._dynamo not
    imported), the wrapper once it is."""
    import functools
    import sys

    from gradzip.optim.core import eager

    called = []

    def inner(x):
        called.append(("inner", x))

    @functools.wraps(inner)
    def wrapper(x):
        called.append(("wrapper", x))

    assert eager._zero_grad.__wrapped__ is torch.optim.Optimizer.zero_grad.__wrapped__   # torch's own function
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = SSGD([p], lr=0.1)
    opt.zero_grad()
    assert p.grad is None and opt.state_dict()["param_groups"][0]["lr"] == 0.1
    guarded = eager._eager(wrapper)
    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    guarded(1)
    monkeypatch.setitem(sys.modules, "torch._dynamo", object())
    guarded(2)
    assert called == [("inner", 1), ("wrapper", 2)]
