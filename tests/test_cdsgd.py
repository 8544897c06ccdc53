import copy
import time

import pytest
import torch

import gradzip
from gradzip.comm import Work, allgather_wire_bytes, allreduce_wire_bytes
from gradzip.comm.base import Group
from gradzip.errors import GradzipError
from gradzip.comm.launch import run_processes
from gradzip.optim import CDSGD, CPSGD, ODSGD
from gradzip.train.config import RunConfig
from gradzip.train.loop import run_worker

import cases


def two_bit(p, t):
    return torch.where(p >= t, t, torch.where(p <= -t, -t, 0.0))


def reference(n, steps, *, lr, local_lr, k, warmup, threshold, momentum=0.0, wd=0.0):
    """The spec's update equations, by hand, for n workers on the quadratics."""
    problems = [cases.quadratic_problem(r) for r in range(n)]
    grad = lambda r, x: problems[r][0].T @ (problems[r][0] @ x - problems[r][1])
    x = [cases.quadratic_start() for _ in range(n)]
    buf = None

    def global_opt(model, agg):
        nonlocal buf
        u = agg + wd * model
        buf = u.clone() if buf is None else momentum * buf + u
        return model - lr * (buf if momentum else u)

    for _ in range(warmup):
        agg = sum(grad(r, x[r]) for r in range(n)) / n
        x = [global_opt(x[0], agg)] * n
    W, e = x[0].clone(), [torch.zeros_like(x[0]) for _ in range(n)]
    for t in range(1, steps - warmup + 1):
        G = [grad(r, x[r]) for r in range(n)]
        sent = []
        for r in range(n):
            if t % k == 0:
                sent.append(G[r])
            else:
                p = e[r] + G[r]
                sent.append(two_bit(p, threshold))
                e[r] = p - sent[r]
        x = [W - local_lr * G[r] for r in range(n)]
        W = global_opt(W, sum(sent) / n)
    return x, W


@pytest.mark.parametrize("momentum, wd", [(0.0, 0.0), (0.9, 0.01)])
@pytest.mark.parametrize("overlap", [True, False])
def test_matches_hand_written_update_equations(momentum, wd, overlap):
    opts = dict(lr=0.05, local_lr=0.02, k=3, warmup_steps=2, compressor="2bit:threshold=0.05",
                momentum=momentum, weight_decay=wd, overlap=overlap)
    outs = gradzip.simulate(2, lambda c: cases.run_delayed(c, "cdsgd", opts, 10))
    x_ref, W_ref = reference(2, 10, lr=0.05, local_lr=0.02, k=3, warmup=2, threshold=0.05,
                             momentum=momentum, wd=wd)
    for rank, (history, _) in enumerate(outs):
        local, W = history[-1]
        torch.testing.assert_close(local, x_ref[rank], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(W, W_ref, rtol=1e-6, atol=1e-6)


def test_default_local_lr_is_lr_over_workers():
    outs = gradzip.simulate(2, lambda c: cases.run_delayed(c, "cdsgd", dict(lr=0.08, k=2), 4))
    x_ref, _ = reference(2, 4, lr=0.08, local_lr=0.04, k=2, warmup=0, threshold=0.01)
    torch.testing.assert_close(outs[1][0][-1][0], x_ref[1], rtol=1e-6, atol=1e-6)


def test_k1_equals_odsgd_exactly():
    opts = dict(lr=0.05, momentum=0.9, warmup_steps=1)
    cd = gradzip.simulate(3, lambda c: cases.run_delayed(c, "cdsgd", dict(opts, k=1), 7))
    od = gradzip.simulate(3, lambda c: cases.run_delayed(c, "odsgd", opts, 7))
    for (a, _), (b, _) in zip(cd, od):
        for (xa, Wa), (xb, Wb) in zip(a, b):
            assert torch.equal(xa, xb) and cases.same(Wa, Wb)


def test_warmup_covering_the_run_is_ssgd():
    opts = dict(lr=0.05, momentum=0.9, weight_decay=0.01)
    cases.assert_same_runs(cases.simulate_method(2, "cdsgd", dict(opts, warmup_steps=10), steps=6),
                           cases.simulate_method(2, "ssgd", opts, steps=6))


def test_overlap_changes_no_number_on_threads():
    for (over, _), (sync, _) in gradzip.simulate(2, cases.delayed_overlap_and_sync):
        for (xa, Wa), (xb, Wb) in zip(over, sync):
            assert torch.equal(xa, xb) and cases.same(Wa, Wb)


@pytest.mark.slow
def test_global_models_bitwise_identical_across_three_gloo_processes():
    outs = run_processes(3, cases.delayed_overlap_and_sync)
    for step in range(9):
        W0 = outs[0][0][0][step][1]
        for (over, _), (sync, _) in outs:
            assert cases.same(over[step][1], W0) and cases.same(sync[step][1], W0)
            assert torch.equal(over[step][0], sync[step][0])  # overlap changes no number


@pytest.mark.parametrize("n", [2, 4])
def test_bytes_follow_warmup_then_k_step_mix(n):
    d, steps, warmup, k = 6, 13, 3, 4
    _, sent = gradzip.simulate(n, lambda c: cases.run_delayed(
        c, "cdsgd", dict(lr=0.05, k=k, warmup_steps=warmup), steps))[0]
    post = steps - warmup
    corrections = post // k
    fp32 = allreduce_wire_bytes(4 * d, n)
    two_bit = allgather_wire_bytes(2, n)  # ceil(6/4) = 2 packed bytes (allgather below 8 workers)
    assert sent == warmup * fp32 + corrections * fp32 + (post - corrections) * two_bit


class DelayedGroup(Group):
    """An in-process group whose collectives complete ``delay`` seconds after launch
    (a slow network), to make overlap visible in a trace."""

    def __init__(self, inner, delay):
        super().__init__()
        self.inner, self.delay = inner, delay
        self.rank, self.world_size = inner.rank, inner.world_size

    def _delayed(self, work):
        ready = time.perf_counter() + self.delay

        def wait():
            result = work.wait()
            time.sleep(max(0.0, ready - time.perf_counter()))
            return result
        return Work(wait, work.nbytes)

    def _allreduce(self, tensor, nbytes):
        return self._delayed(self.inner._allreduce(tensor, nbytes))

    def _allgather(self, tensor, nbytes):
        return self._delayed(self.inner._allgather(tensor, nbytes))

    def _broadcast(self, tensor, src, nbytes):
        return self._delayed(self.inner._broadcast(tensor, src, nbytes))

    def new_group(self):
        return DelayedGroup(self.inner.new_group(), self.delay)


def test_trace_shows_exchange_of_step_t_overlapping_compute_of_step_t_plus_1():
    cfg = RunConfig(algo="cdsgd", epochs=1, trace=True, progress=False, model="mlp:hidden=512x512")
    events = gradzip.simulate(2, lambda c: run_worker(DelayedGroup(c, 0.05), cfg))[0]["trace"]
    main = [e for e in events if e["tid"] == "gradzip-rank0" or e["tid"] == "MainThread"]
    computes = sorted((e["ts"], e["ts"] + e["dur"]) for e in main if e["name"] == "compute")
    background = [e for e in events if e["tid"].startswith("gradzip-exchange")]
    exchanges = sorted((e["ts"], e["ts"] + e["dur"]) for e in background if e["name"] == "communicate")
    assert exchanges, "no exchange spans on the communication thread's track"
    overlapping = sum(any(s < c1 and c0 < e for c0, c1 in computes) for s, e in exchanges)
    # every exchange could overlap, but a loaded machine may starve the communication
    # thread for long stretches; a run without overlap has none at all (below)
    assert overlapping >= 1, (overlapping, len(exchanges))


def test_no_overlap_without_overlap():
    cfg = RunConfig(algo="cdsgd", options={"overlap": False}, epochs=1, trace=True, progress=False)
    events = gradzip.simulate(2, lambda c: run_worker(DelayedGroup(c, 0.005), cfg))[0]["trace"]
    assert not [e for e in events if e["tid"].startswith("gradzip-exchange")]


@pytest.mark.parametrize("overlap", [True, False])
def test_state_dict_resume_is_exact(overlap):
    opts = dict(lr=0.05, momentum=0.9, k=3, warmup_steps=2, compressor="2bit:threshold=0.05", overlap=overlap)

    def run(comm, split):
        x = torch.nn.Parameter(cases.quadratic_start())
        A, b = cases.quadratic_problem(comm.rank)
        opt = CDSGD([x], comm=comm, **opts)
        for t in range(1, 11):
            if t == split:
                saved = copy.deepcopy(opt.state_dict())
                x = torch.nn.Parameter(torch.zeros(6))       # a fresh model: the state restores it
                opt = CDSGD([x], comm=comm, **opts)
                opt.load_state_dict(saved)
            opt.zero_grad()
            (0.5 * (A @ x - b).pow(2).sum()).backward()
            opt.step()
        state = opt.state_dict()
        return x.detach().clone(), opt.evaluation_parameters()[0].clone(), state

    straight = gradzip.simulate(2, lambda c: run(c, None))
    resumed = gradzip.simulate(2, lambda c: run(c, 6))
    for (xa, Wa, sa), (xb, Wb, _) in zip(straight, resumed):
        assert torch.equal(xa, xb) and torch.equal(Wa, Wb)
        st = sa["state"][0]
        assert {"global_model", "residual", "global_momentum_buffer"} <= set(st)
        assert sa["gradzip"]["steps"] == 10 and len(sa["gradzip"]["local_model"]) == 1


def test_cpsgd_is_cdsgd_and_cli_names():
    assert CPSGD is CDSGD
    assert {"odsgd", "cdsgd", "cpsgd"} <= set(gradzip.optim.METHODS)
    opts = gradzip.optim.method_options(CDSGD)
    assert {"k", "local_lr", "warmup_steps", "compressor", "overlap"} <= set(opts)


@pytest.mark.parametrize("options, message", [
    (dict(k=0), "k must be"), (dict(warmup_steps=-1), "warmup_steps"), (dict(local_lr=-0.1), "local_lr"),
    (dict(compressor="2bit:threshold=0"), "threshold"),
])
def test_bad_options(options, message):
    with pytest.raises(GradzipError, match=message):
        CDSGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, **options)
    if "compressor" not in options and "k" not in options:
        with pytest.raises(GradzipError, match=message):
            ODSGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, **options)


# -- issue 12, item 3: hyper-parameters captured at submit time --------------------------
class LatePool:
    """Stands in for the exchange thread at its slowest: a submitted exchange runs only when
    its result is asked for (after the user's ``scheduler.step()``), a schedule the real
    thread may take on a loaded machine."""

    def submit(self, fn, *args):
        pool = self

        class Late:
            def result(self):
                return fn(*args)
        return Late()

    def shutdown(self, wait=True):
        pass


SCHEDULES = {
    "lambda-1/t": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (e + 1)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6),
}


def scheduled_run(comm, schedule: str, overlap: bool, split=None, steps: int = 9, late=True):
    """CD-SGD on the quadratic with an LR schedule stepped after every ``opt.step()``;
    ``split``: save model, optimizer and scheduler there and continue in fresh ones.
    (local model, global model, global momentum) at the end."""
    opts = dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True, k=3, warmup_steps=2,
                compressor="2bit:threshold=0.05", overlap=overlap)
    A, b = cases.quadratic_problem(comm.rank)

    def fresh(start):
        x = torch.nn.Parameter(start)
        opt = CDSGD([x], comm=comm, **opts)
        if late and opt._pool is not None:
            opt._pool.shutdown()
            opt._pool = LatePool()
        return x, opt, SCHEDULES[schedule](opt)

    x, opt, sched = fresh(cases.quadratic_start())
    for t in range(1, steps + 1):
        if t == split:
            saved = copy.deepcopy((opt.state_dict(), sched.state_dict()))
            x, opt, sched = fresh(torch.zeros(6))
            opt.load_state_dict(saved[0])
            sched.load_state_dict(saved[1])
        opt.zero_grad()
        (0.5 * (A @ x - b).pow(2).sum()).backward()
        opt.step()
        sched.step()
    W = opt.evaluation_parameters()[0].clone()
    return x.detach().clone(), W, opt.state[x]["global_momentum_buffer"].clone()


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_scheduler_overlap_on_equals_off_bit_for_bit(schedule):
    on = gradzip.simulate(2, lambda c: scheduled_run(c, schedule, True))
    off = gradzip.simulate(2, lambda c: scheduled_run(c, schedule, False))
    real_thread = gradzip.simulate(2, lambda c: scheduled_run(c, schedule, True, late=False))
    for a, b, c in zip(on, off, real_thread):
        for u, v, w in zip(a, b, c):
            assert torch.equal(u, v) and torch.equal(u, w)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("overlap", [True, False])
def test_scheduler_resume_is_bit_exact(schedule, overlap):
    """Resumed (overlapped or not) == uninterrupted == uninterrupted without overlap."""
    straight = gradzip.simulate(2, lambda c: scheduled_run(c, schedule, overlap))
    resumed = gradzip.simulate(2, lambda c: scheduled_run(c, schedule, overlap, split=5))
    synchronous = gradzip.simulate(2, lambda c: scheduled_run(c, schedule, False))
    for a, b, c in zip(straight, resumed, synchronous):
        for u, v, w in zip(a, b, c):
            assert torch.equal(u, v) and torch.equal(v, w)


# -- issue 12, item 17: the pool belongs to the optimizer, not to its wrappers -------------
def test_a_wrapper_collected_while_the_optimizer_steps_leaves_the_pool_running():
    import gc

    x = torch.nn.Parameter(cases.quadratic_start())
    A, b = cases.quadratic_problem(0)
    opt = CDSGD([x], lr=0.05, k=2, warmup_steps=1)

    class Copying:  # Lightning's LightningOptimizer: the optimizer's __dict__, a class inheriting its
        def __init__(self, optimizer):
            self.__dict__ = {k: v for k, v in optimizer.__dict__.items() if k != "step"}
            self.__class__ = type("LightningCDSGD", (Copying, optimizer.__class__), {})

    class Inheriting(CDSGD):  # a subclass instance sharing the pool, never stepped itself
        def __init__(self, optimizer):
            self.__dict__.update(optimizer.__dict__)

    for make in (Copying, Inheriting):
        for t in range(1, 5):
            wrapper = make(opt)
            opt.zero_grad()
            (0.5 * (A @ x - b).pow(2).sum()).backward()
            opt.step()
            del wrapper
            gc.collect()
    opt.synchronize()
    assert not opt._pool._shutdown


def test_close_and_context_manager_stop_the_thread_and_keep_the_numbers():
    def run(use_with):
        x = torch.nn.Parameter(cases.quadratic_start())
        A, b = cases.quadratic_problem(0)
        with CDSGD([x], lr=0.05, k=2, warmup_steps=1) as opt:
            for t in range(1, 7):
                if t == 4 and not use_with:
                    opt.close()
                    assert opt._pool is None
                opt.zero_grad()
                (0.5 * (A @ x - b).pow(2).sum()).backward()
                opt.step()
        assert opt._pool is None
        return x.detach().clone()
    assert torch.equal(run(True), run(False))


def test_collecting_the_optimizer_stops_its_thread():
    import gc
    import threading

    x = torch.nn.Parameter(cases.quadratic_start())
    opt = CDSGD([x], lr=0.05)
    x.grad = torch.ones(6)
    opt.step()
    opt.synchronize()
    pool = opt._pool
    del opt
    gc.collect()
    assert pool._shutdown


def test_leaving_the_with_block_on_an_error_does_not_wait_and_stops_the_thread():
    x = torch.nn.Parameter(cases.quadratic_start())
    with pytest.raises(ValueError, match="user error"):
        with CDSGD([x], lr=0.05) as opt:
            x.grad = torch.ones(6)
            opt.step()
            raise ValueError("user error")
    assert opt._pool is None


@pytest.mark.parametrize("overlap", [True, False])
def test_the_gradient_copies_are_reused_across_steps(overlap):
    """G_i goes to the exchange in a buffer per parameter that every step reuses (a fresh
    clone each step cost the training thread page faults); the next backward, which
    overwrites p.grad, leaves the exchange's copy alone (the numbers: the tests above)."""
    def worker(comm):
        model = torch.nn.Linear(4, 2)
        gradzip.broadcast_parameters(model, comm=comm)
        handed = []
        with CDSGD(model.parameters(), lr=0.1, k=2, overlap=overlap, comm=comm) as opt:
            exchange = opt._exchange
            opt._exchange = lambda pairs, grads, *rest: (handed.append(list(grads)), exchange(pairs, grads, *rest))
            for _ in range(3):
                opt.zero_grad()
                model(torch.ones(3, 4)).sum().backward()
                opt.step()
        return handed

    for handed in gradzip.simulate(2, worker):
        assert len(handed) == 3
        assert all(a is b for a, b in zip(handed[0], handed[2]))
