"""A-SGD with a parameter server (gradzip.optim.asgd; docs/algorithms.md §A-SGD): one worker
is SGD; with n workers every push is applied exactly once (the version counter, and the sum
of applied updates equals x_0 − x); SSP bounds the clocks' spread; the deterministic
round_robin order; checkpoints at a quiescent point; the real gloo path; the training loop."""
from __future__ import annotations

import time

import pytest
import torch

import gradzip
from gradzip.guards.nonfinite import NonFiniteGradient
from gradzip import compressors, seeds
from gradzip.errors import GradzipError
from gradzip.comm.launch import run_processes
from gradzip.optim import ASGD
from gradzip.optim.asgd_server import codec_seed
from gradzip.train.config import RunConfig
from gradzip.train.loop import run_worker


def _grad(rank: int, step: int, shape=(5,)) -> torch.Tensor:
    """A gradient of small dyadic values: every sum of them is exact in float32, whatever
    the order, so conservation can be checked bit for bit."""
    g = torch.arange(shape[0], dtype=torch.float32) - 2 + rank
    return (g * ((step % 3) + 1)) / 4


@pytest.mark.parametrize("options", [dict(), dict(momentum=0.9, weight_decay=0.01),
                                     dict(momentum=0.9, nesterov=True)])
def test_one_worker_with_the_identity_codec_is_sgd_bit_for_bit(options):
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)
    ref.load_state_dict(model.state_dict())
    opt = ASGD(model.parameters(), lr=0.1, **options)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1, **options)
    for _ in range(6):
        x = torch.randn(8, 6)
        for m, o in ((model, opt), (ref, sgd)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), torch.zeros(8, 3)).backward()
            o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert opt.metrics()["staleness_max"] == 0 and opt.server.version == 6


def _conservation_worker(comm, steps: int, options: dict):
    p = torch.nn.Parameter(torch.zeros(5))
    opt = ASGD([p], lr=0.5, comm=comm, **options)
    pushed = torch.zeros(5)
    for t in range(steps):
        p.grad = _grad(comm.rank, t)
        before = opt.state[p].get("error", torch.zeros(5)).clone()
        opt.step()
        # what this push sent: dec(c) = (e + g) − e_new (error feedback), g without it
        pushed += before + _grad(comm.rank, t) - opt.state[p].get("error", torch.zeros(5))
    final = opt.evaluation_parameters()[0]
    stats = opt.metrics()
    opt.close()
    return pushed, final, stats


@pytest.mark.parametrize("options", [dict(), dict(compressor="topk:ratio=0.4"),
                                     dict(compressor="topk:ratio=0.4", staleness=0),
                                     dict(order="round_robin", staleness=1)])
def test_every_push_is_applied_exactly_once(options):
    n, steps = 4, 7
    out = gradzip.simulate(n, lambda c: _conservation_worker(c, steps, options))
    total = sum(pushed for pushed, _, _ in out)
    for _, final, stats in out:
        assert stats["server_version"] == n * steps
        assert stats["pushes_per_worker"] == [steps] * n
        assert torch.equal(torch.zeros(5) - final, 0.5 * total)   # x_0 − x = η Σ dec(c), exactly


def test_staleness_bound_holds_and_matters():
    """SSP: after every step, no worker's clock is more than S ahead of the slowest one;
    without the bound the fast workers run ahead of a slow one."""
    def worker(comm, staleness):
        p = torch.nn.Parameter(torch.zeros(3))
        opt = ASGD([p], lr=0.1, comm=comm, staleness=staleness)
        gaps = []
        for t in range(8):
            if comm.rank == 0:
                time.sleep(0.02)   # the slow worker
            p.grad = torch.ones(3)
            opt.step()
            gaps.append(opt.clock - min(opt.server.clocks))
        opt.close()
        return max(gaps)
    assert max(gradzip.simulate(3, lambda c: worker(c, 1))) <= 1
    assert max(gradzip.simulate(3, lambda c: worker(c, 0))) == 0
    assert max(gradzip.simulate(3, lambda c: worker(c, None))) > 1


def test_round_robin_order_is_deterministic_and_stale_by_n_minus_one():
    def worker(comm):
        model = torch.nn.Linear(4, 2)   # worker threads share torch's global generator: set x_0 from our own
        init = torch.Generator().manual_seed(comm.rank)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=init))
        gradzip.broadcast_parameters(model, comm)
        opt = ASGD(model.parameters(), lr=0.1, comm=comm, compressor="qsgd", order="round_robin", momentum=0.5)
        data = torch.Generator().manual_seed(comm.rank)
        for t in range(5):
            if comm.rank == (t % 3):
                time.sleep(0.01)   # a different worker late every step
            opt.zero_grad()
            model(torch.randn(4, 4, generator=data)).pow(2).sum().backward()
            opt.step()
        out = [t.clone() for t in opt.evaluation_parameters()], opt.metrics()
        opt.close()
        return out
    a, b = gradzip.simulate(3, worker)[0], gradzip.simulate(3, worker)[0]
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    assert a[1]["staleness_max_per_worker"] == [2, 2, 2]
    assert a[1]["staleness_mean_per_worker"] == [8 / 5, 9 / 5, 10 / 5]


@pytest.mark.parametrize("spec", [s for s in compressors.names() if s not in ("dgc", "powersgd")])
def test_the_server_decodes_every_codec_as_the_worker_encoded_it(spec):
    codec = compressors.build(spec)
    g = torch.linspace(-1, 1, 24).reshape(4, 6) ** 3
    p = torch.nn.Parameter(torch.zeros(4, 6))
    opt = ASGD([p], lr=1.0, compressor=spec)
    p.grad = g.clone()
    opt.step()
    seed = codec_seed(codec, seeds.exchange_seed(0, 0), 1, 0, 0)
    assert torch.equal(-p.detach(), codec.decompress(codec.compress(g, seed)).float())


def test_options_and_codecs_it_refuses_name_the_fix():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(GradzipError, match="staleness must be None .* integer >= 0"):
        ASGD(p, lr=0.1, staleness=-1)
    with pytest.raises(GradzipError, match="order must be one of arrival, round_robin"):
        ASGD(p, lr=0.1, order="fifo")
    with pytest.raises(GradzipError, match="dgc.*cannot be pushed.*use another codec"):
        ASGD(p, lr=0.1, compressor="dgc")
    opt = ASGD(p, lr=0.1)
    with pytest.raises(GradzipError, match="no 'asgd' entry"):
        opt.load_state_dict(torch.optim.SGD(p, lr=0.1).state_dict() | {"gradzip": opt.state_dict()["gradzip"]})
    opt.close()
    p[0].grad = torch.ones(2)
    with pytest.raises(GradzipError, match=r"step\(\) after close"):
        opt.step()


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _resume_worker(comm, split: int | None, steps: int, options: dict):
    """``steps`` steps; with ``split``, a checkpoint (model + optimizer, at a quiescent
    point) after ``split`` steps, and the rest run by a new model and optimizer from it."""
    def build():   # the same start on every worker (threads share torch's global generator)
        model = torch.nn.Linear(5, 3)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        return model, ASGD(model.parameters(), lr=0.05, comm=comm, momentum=0.9, **options)

    def run(model, opt, steps_range):
        for t in steps_range:
            g = torch.Generator().manual_seed(100 * comm.rank + t)
            opt.zero_grad()
            model(torch.randn(6, 5, generator=g)).pow(2).mean().backward()
            opt.step()

    model, opt = build()
    run(model, opt, range(split if split is not None else steps))
    if split is not None:
        saved = {"model": model.state_dict(), "opt": opt.state_dict()}
        opt.close()
        model, opt = build()
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        run(model, opt, range(split, steps))
    final = [t.clone() for t in opt.evaluation_parameters()]
    out = final, opt.metrics(), [opt.state[p].get("error") for p in model.parameters()]
    opt.close()
    return out


@pytest.mark.parametrize("options", [dict(compressor="topk:ratio=0.3"), dict(compressor="qsgd")])
def test_resume_from_a_quiescent_checkpoint_continues_identically_for_one_worker(options):
    whole = gradzip.simulate(1, lambda c: _resume_worker(c, None, 8, options))[0]
    resumed = gradzip.simulate(1, lambda c: _resume_worker(c, 3, 8, options))[0]
    for a, b in zip(whole[0] + whole[2], resumed[0] + resumed[2]):
        assert _same(a, b)
    assert whole[1] == resumed[1]


def test_resume_with_n_workers_conserves_and_round_robin_is_identical():
    n = 3
    resumed = gradzip.simulate(n, lambda c: _resume_worker(c, 4, 9, dict(compressor="topk:ratio=0.3")))
    assert resumed[0][1]["server_version"] == n * 9 and resumed[0][1]["pushes_per_worker"] == [9] * n
    rr = dict(compressor="topk:ratio=0.3", order="round_robin")
    whole = gradzip.simulate(n, lambda c: _resume_worker(c, None, 9, rr))
    cut = gradzip.simulate(n, lambda c: _resume_worker(c, 4, 9, rr))
    for w, r in zip(whole, cut):
        for a, b in zip(w[0] + w[2], r[0] + r[2]):
            assert _same(a, b)
        assert w[1] == r[1]


def test_the_training_loop_runs_asgd_and_reports_staleness_per_worker():
    cfg = RunConfig(algo="asgd", options={"staleness": 2, "compressor": "topk:ratio=0.1"}, epochs=1,
                    batch_size=64, progress=False)
    out = gradzip.simulate(2, lambda c: run_worker(c, cfg))
    summary = out[0]["summary"]
    assert summary["server_version"] == 2 * summary["steps"]
    assert len(summary["staleness_mean_per_worker"]) == 2 and len(summary["staleness_max_per_worker"]) == 2
    # SSP S: while a worker computes for clock c, another pushes numbers c − S + 1 .. c + S + 1 at most
    assert summary["staleness_max"] <= (2 - 1) * (2 * 2 + 1)
    assert summary["final_test_accuracy"] > 0.2


GLOO_OPTIONS = (dict(staleness=0, compressor="topk:ratio=0.4"), dict(order="round_robin"))


def _gloo_worker(comm, steps: int):
    return [_conservation_worker(comm, steps, options) for options in GLOO_OPTIONS]


@pytest.mark.slow
def test_real_gloo_path_conserves_and_evaluates_the_servers_model():
    n, steps = 2, 6
    out = run_processes(n, _gloo_worker, steps)   # one process group: torch's first optimizer costs seconds
    for k in range(len(GLOO_OPTIONS)):
        runs = [o[k] for o in out]
        total = sum(pushed for pushed, _, _ in runs)
        for _, final, _ in runs:
            assert torch.equal(torch.zeros(5) - final, 0.5 * total)   # every rank evaluates the server's x
        server = runs[0][2]
        assert server["server_version"] == n * steps and server["pushes_per_worker"] == [steps] * n
        assert all("staleness_mean" in r[2] for r in runs[1:])   # the other workers' own statistics


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_a_codec_overflow_is_refused_before_the_push(nonfinite):
    """fp16 turns a finite 1e6 into Inf: the worker raises before pushing (the server's
    version and model stay), naming the tensor; "off" pushes it."""
    model = torch.nn.Linear(3, 1)
    opt = ASGD(model.parameters(), lr=0.1, compressor="fp16", nonfinite=nonfinite)
    before = [p.detach().clone() for p in model.parameters()]
    model.weight.grad = torch.full((1, 3), 1e6)
    model.bias.grad = torch.zeros(1)
    with pytest.raises(NonFiniteGradient, match="tensor #0 decodes to NaN or Inf"):
        opt.step()
    assert opt.steps == 0 and opt.metrics()["server_version"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    off = ASGD(model.parameters(), lr=0.1, compressor="fp16", nonfinite="off")
    off.step()
    assert not torch.isfinite(model.weight).all()


@pytest.mark.parametrize("option", [dict(transport="twophase"), dict(hierarchy=2)])
def test_transport_and_hierarchy_are_refused(option):
    with pytest.raises(GradzipError, match="point to point to the parameter server"):
        ASGD(torch.nn.Linear(2, 1).parameters(), lr=0.1, **option)


def _nan_on_rank_1(comm, errors: dict, options: dict, catch: bool):
    """Five steps; rank 1's third gradient is NaN (``nonfinite="raise"``). Each rank's error
    is recorded in ``errors``; with ``catch`` rank 1 swallows its own and returns."""
    p = torch.nn.Parameter(torch.zeros(5))
    opt = ASGD([p], lr=0.5, comm=comm, **options)
    try:
        for t in range(5):
            p.grad = _grad(comm.rank, t)
            if comm.rank == 1 and t == 2:
                p.grad[0] = float("nan")
            opt.step()
    except BaseException as exc:
        errors[comm.rank] = exc
        if not (catch and comm.rank == 1):
            raise
        return None
    opt.close()
    return opt.clock


def _wait_for(errors: dict, ranks, hang_guard_s: float = 120.0) -> None:
    """Until every rank of ``ranks`` recorded its error (simulate() returns GRACE_S after the
    first failure; a peer still waiting then records its own a moment later)."""
    give_up = time.monotonic() + hang_guard_s
    while not set(ranks) <= set(errors) and time.monotonic() < give_up:
        time.sleep(0.05)


@pytest.mark.parametrize("options", [dict(order="round_robin"), dict(staleness=0)])
def test_a_peer_waiting_on_the_server_learns_at_once_that_a_worker_failed(options):
    """Issue 35 item 8: rank 1 stops on a NaN before its push; rank 0, whose pull waits for
    that push (round_robin's turn, or the SSP bound), is released at once with a PeerFailure
    naming rank 1 and its NonFiniteGradient, not after the whole timeout ("waited 60 s for
    rank(s) 1 to push"); simulate() raises the NaN, the root cause."""
    errors: dict = {}
    with pytest.raises(NonFiniteGradient, match="on rank 1"):
        gradzip.simulate(2, lambda comm: _nan_on_rank_1(comm, errors, options, catch=False), timeout_s=60)
    _wait_for(errors, (0, 1))
    peer = errors.get(0)
    assert isinstance(peer, gradzip.comm.PeerFailure), peer
    assert peer.lost == (1,) and "peer rank 1 failed (NonFiniteGradient: ASGD step 3" in str(peer), peer


@pytest.mark.parametrize("options", [dict(order="round_robin"), dict(staleness=0)])
def test_a_worker_whose_function_returned_holds_no_one_back(options):
    """A worker function that returns (here: having caught its own error) pushes no more,
    as if it had called close(): the server stops waiting for it and the others finish."""
    errors: dict = {}
    clocks = gradzip.simulate(2, lambda comm: _nan_on_rank_1(comm, errors, options, catch=True), timeout_s=60)
    assert clocks == [5, None] and set(errors) == {1}
