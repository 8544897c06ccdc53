"""Worker functions of the auto:<codec> tests (tests/test_auto.py; docs/algorithms.md §Auto
codec choice): importable, so spawned gloo processes can run them."""
from __future__ import annotations

import copy
import math
import threading

import torch

from gradzip.exchange import calibration
from gradzip.exchange.planner import CodecCost, Link

#: A link no bytes cross (every unit whose codec sends fewer bytes takes it) and one that is free.
SLOW = Link(1e-9, 0.0)
FAST = Link(math.inf, 0.0)
#: bucket_bytes that cut MODEL into a unit of its large weight and units of its small tensors.
BUCKET_BYTES = 1024


def model() -> torch.nn.Module:
    """One large layer (64x32: a unit of its own at BUCKET_BYTES) and small ones (units of several
    tensors): the buckets of one model disagree. The same weights on every call."""
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return net


def batch(step: int, rank: int, per_worker: int = 8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(per_worker, 32, generator=g), torch.randn(per_worker, 2, generator=g)


#: Coding costs that make MODEL's units disagree on a 100 Mbit/s link: 1bit's per-call cost
#: outweighs what it saves on a unit of small tensors, not on the 64x32 weight.
FIXED_COSTS = {"1bit": CodecCost(300e-6, 2e-9), "topk:ratio=0.1": CodecCost(300e-6, 2e-9),
               "none": CodecCost(1e-6, 1e-10)}


def fixed_costs(codec, shapes, n, dtype=torch.float32, device="cpu", seed=0):
    """A stand-in for calibration.measure_codec: FIXED_COSTS, the same on every worker."""
    return FIXED_COSTS[codec.spec]


def extremes(comm, options: dict, method: str = "efsgd", codec: str = "1bit"):
    """Per extreme link, the parameters of auto:``codec`` and of the fixed run it must equal
    (``codec`` on SLOW, none on FAST)."""
    out = []
    for link, fixed in ((SLOW, codec), (FAST, "none")):
        out.append([train(comm, method, {**options, "link": link, "compressor": c})[0] for c in (f"auto:{codec}", fixed)])
    return out


def make(net, comm, method: str, options: dict):
    import gradzip

    return gradzip.optim.METHODS[method](net.parameters(), comm=comm, bucket_bytes=BUCKET_BYTES, **options)


def train(comm, method: str, options: dict, steps: int = 4, first: int = 0, net=None, opt=None):
    """``steps`` steps of ``method`` on MODEL; the parameters, the optimizer's state and its
    auto decisions (``describe()``'s ``exchange i auto`` fields)."""
    import gradzip

    if net is None:
        net = model()
        opt = make(net, comm, method, options)
    for t in range(first, first + steps):
        x, y = batch(t, comm.rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    if getattr(opt, "synchronize", None):
        opt.synchronize()
    decisions = {k: v for k, v in opt.describe().items() if k.endswith(" auto")}
    assert isinstance(opt, gradzip.optim.DistributedOptimizer)
    return [p.detach().clone() for p in net.parameters()], opt.state_dict(), decisions


def resume_without_probing(comm, method: str, options: dict, split: int = 3, steps: int = 3):
    """Straight: ``split + steps`` steps; resumed: a new model and optimizer load the state
    saved after ``split`` and run ``steps`` while a probe fails this worker (the decision must
    come from the state). Both results (:func:`train`'s)."""
    _guard_probes()
    net = model()
    opt = make(net, comm, method, options)
    train(comm, method, options, split, net=net, opt=opt)
    saved = copy.deepcopy((net.state_dict(), opt.state_dict()))
    straight = train(comm, method, options, steps, first=split, net=net, opt=opt)
    net2 = model()
    opt2 = make(net2, comm, method, options)
    net2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    _FORBIDDEN.on = True
    try:
        resumed = train(comm, method, options, steps, first=split, net=net2, opt=opt2)
    finally:
        _FORBIDDEN.on = False
    return straight, resumed


_FORBIDDEN = threading.local()   # .on: a codec probe on this thread (worker) fails


def _guard_probes() -> None:
    """calibration.measure_codec, failing on a worker that set ``_FORBIDDEN.on`` (installed once
    per process; the threads' test restores the original through monkeypatch)."""
    measure = calibration.measure_codec
    if getattr(measure, "guarded", False):
        return

    def guarded(*args, **kwargs):
        if getattr(_FORBIDDEN, "on", False):
            raise AssertionError("a resumed run probed instead of executing its saved decision")
        return measure(*args, **kwargs)

    guarded.guarded = True
    calibration.measure_codec = guarded


class Alternating:
    """A stand-in for calibration.measure_codec whose codec cost is cheap at a worker's
    even-numbered calibrations and prohibitive at its odd ones (each calibration asks for the
    codec, then none): with recalibrate_every=1 every unit switches at every step."""

    def __init__(self):
        self.calls = threading.local()

    def __call__(self, codec, shapes, n, dtype=torch.float32, device="cpu", seed=0):
        count = getattr(self.calls, "count", 0)
        self.calls.count = count + 1
        if codec.name == "none":
            return CodecCost(1e-6, 0.0)
        return CodecCost(0.0, 0.0) if (count // 2) % 2 == 0 else CodecCost(10.0, 0.0)


def ef_steps(comm, codec: str = "auto:1bit", steps: int = 4, lr: float = 0.1):
    """EF-SGD (no momentum) with auto recalibrated every step under :class:`Alternating`:
    per step, every tensor's (error before, η·gradient, error after, aggregate; an error
    not kept is zeros), the step's choices and which tensors keep no error."""
    import gradzip

    net = model()
    opt = gradzip.optim.EFSGD(net.parameters(), lr=lr, comm=comm, compressor=codec, bucket_bytes=BUCKET_BYTES,
                              link="100mbit", recalibrate_every=1)
    out = []
    for t in range(steps):
        x, y = batch(t, comm.rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        params = list(net.parameters())
        before = [opt.state[p].get("error", torch.zeros_like(p)).clone() for p in params]
        lrg = [p.grad.detach().clone() * lr for p in params]
        x0 = [p.detach().clone() for p in params]
        opt.step()
        after = [opt.state[p].get("error", torch.zeros_like(p)).clone() for p in params]
        sent = [a - p.detach() for a, p in zip(x0, params)]
        (decision,) = opt._exchanges[0].decisions.values()
        out.append((before, lrg, after, sent, decision.choices, ["error" not in opt.state[p] for p in params]))
    return out


def ddp_runs(comm, steps: int = 4):
    """The DDP hook with auto:1bit against the 1bit and none hooks, on the two extreme links:
    per link, the parameters of (auto, fixed)."""
    import cases_ddp
    import gradzip.ddp

    out = []
    for link, fixed in ((SLOW, "1bit"), (FAST, "none")):
        pair = []
        for codec in ("auto:1bit", fixed):
            net, ddp = cases_ddp.make_ddp()
            state = gradzip.ddp.hook(codec, model=ddp, link=link)
            ddp.register_comm_hook(state, gradzip.ddp.codec_hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            cases_ddp.train(comm, ddp, opt, steps)
            pair.append(cases_ddp.params(net))
            if codec.startswith("auto"):
                saved = state.state_dict()["auto"]
                assert saved and all(set(e["choices"]) == {fixed} for e in saved), saved
        out.append(pair)
    return out


def ddp_resume(comm, split: int = 3, steps: int = 3, link: Link | None = None, times: dict | None = None):
    """The DDP hook with auto:1bit (link measured): straight, ``split + steps`` steps; resumed,
    a new model, DDP and hook state load the state saved after ``split`` and run ``steps``
    while a codec probe fails this worker. Both parameter lists, and the decisions of each.
    ``link``: the link probe measures it (:func:`measured_link`), not this host's loopback;
    ``times``: the trial's step times (:func:`step_seconds`), not this host's."""
    import cases_ddp
    import gradzip.ddp
    from gradzip.exchange import PSync

    _guard_probes()
    if link is not None:
        calibration.measure_link = lambda comm, device="cpu": measured_link(comm, device, link)
    if times is not None:
        PSync._step_seconds = step_seconds(times)

    def build():
        net, ddp = cases_ddp.make_ddp()
        state = gradzip.ddp.hook("auto:1bit", model=ddp)
        ddp.register_comm_hook(state, gradzip.ddp.codec_hook)
        return net, ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.1)

    net, ddp, state, opt = build()
    cases_ddp.train(comm, ddp, opt, split)
    saved = copy.deepcopy((net.state_dict(), opt.state_dict(), state.state_dict()))
    cases_ddp.train(comm, ddp, opt, steps, first=split)
    net2, ddp2, state2, opt2 = build()
    net2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    state2.load_state_dict(saved[2])
    _FORBIDDEN.on = True
    try:
        cases_ddp.train(comm, ddp2, opt2, steps, first=split)
    finally:
        _FORBIDDEN.on = False
    return (cases_ddp.params(net), cases_ddp.params(net2), calibration.save(state.decisions),
            calibration.save(state2.decisions))


def ddp_recalibrated(comm, steps: int = 6, every: int = 2):
    """The DDP hook with auto:1bit on a declared 100 Mbit/s link, decided again every
    ``every`` steps: its decisions after ``steps`` steps (saved), and how many times the
    codec was probed."""
    import cases_ddp
    import gradzip.ddp

    probes = []
    measure = calibration.measure_codec

    def counted(*args, **kwargs):
        probes.append(1)
        return measure(*args, **kwargs)

    calibration.measure_codec = counted
    net, ddp = cases_ddp.make_ddp()
    state = gradzip.ddp.hook("auto:1bit", model=ddp, link="100mbit", recalibrate_every=every)
    ddp.register_comm_hook(state, gradzip.ddp.codec_hook)
    cases_ddp.train(comm, ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), steps)
    return calibration.save(state.decisions), len(probes), len(list(net.parameters()))


#: The link the trial tests measure (calibration.measure_link replaced by its ring times).
MEASURED = Link(100e6 / 8, 20e-6)


def measured_link(comm, device="cpu", link: Link = MEASURED):
    """A stand-in for calibration.measure_link: ``link``'s ring times, on every worker."""
    from gradzip.exchange.planner import collective_time

    return [collective_time(kind, nbytes, comm.world_size, link)
            for kind in ("allreduce", "allgather") for nbytes in calibration.LINK_PROBE_BYTES]


def step_seconds(times: dict[int, float]):
    """A stand-in for PSync._step_seconds: ``times[step]`` (worker-independent), known only
    once this process saw the exchanges of ``step`` and of a later step (as the clock)."""
    def seconds(self, step):
        seen = self._step_began
        return times.get(step) if step in seen and any(s > step for s in seen) else None
    return seconds


def nan_at(comm, link, bad_step: int = 3, bad_rank: int = 1, overlap: bool = True):
    """EF-SGD auto:1bit on ``link`` (declared: decided at the first step, no trial), the
    loss of rank ``bad_rank`` at ``bad_step`` times NaN; the first gradient check that reads
    a gradient counted. Returns (the exception's type and message, checks in the hooks)."""
    from gradzip.optim.core import overlap as hooks

    reads = []
    real = hooks.first_nonfinite
    hooks.first_nonfinite = lambda tensors: reads.append(len(tensors)) or real(tensors)
    try:
        net = model()
        opt = make(net, comm, "efsgd", {"lr": 0.1, "compressor": "auto:1bit", "link": link,
                                        "overlap_backward": overlap})
        for t in range(1, bad_step + 1):
            x, y = batch(t, comm.rank)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x), y)
            if t == bad_step and comm.rank == bad_rank:
                loss = loss * float("nan")
            loss.backward()
            opt.step()
    except Exception as error:   # NonFiniteGradient, or the peers' PeerFailure
        return type(error).__name__, str(error), len(reads)
    finally:
        hooks.first_nonfinite = real
    return None, "", len(reads)
