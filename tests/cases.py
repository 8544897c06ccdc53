"""Worker functions shared by tests: importable, so spawned gloo processes can run them."""
from __future__ import annotations

import pytest
import torch

from checkpoint_diff import differences

from gradzip import kernels
from gradzip.comm import allgather_wire_bytes, allreduce_wire_bytes


_INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def sparse_index_dtype(numel: int) -> torch.dtype:
    """The wire dtype the sparse codecs' indices must take for a tensor of ``numel`` entries,
    stated here apart from the code: the narrowest integer holding ``numel - 1``."""
    return torch.uint8 if numel <= 256 else torch.uint16 if numel <= 65536 else torch.int32


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (-0.0 and every payload compared exactly), except that any
    NaN matches any NaN at the same place: torch itself gives a NaN of another sign or payload
    in its vector loop than in its scalar tail, so the fused kernels are held to the values,
    not to torch's NaN bits (tests/test_kernels_*.py)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = torch.isnan(b)
    if not torch.equal(torch.isnan(a), nan):
        return False
    as_int = _INT_OF[a.element_size()]
    ia, ib = a.detach().contiguous().view(as_int), b.detach().contiguous().view(as_int)
    return torch.equal(ia[~nan], ib[~nan])


def codec_outputs(codec, x: torch.Tensor, mode: str, n: int = 3, seed: int = 5) -> dict:
    """Everything ``codec`` computes for ``x`` under the kernel ``mode``, on ``x``'s device, into
    fresh buffers: the packet, the decoded tensor (also into ``out=``), the packet and residual
    of ``compress_residual``, the aggregate of ``n`` packets and of one, and where packets sum,
    the summand and the aggregate from the sum (wide and in the summand's own dtype)."""
    got = {}
    with kernels.use(mode):
        packet = got["packet"] = codec.compress(x, seed=seed)
        got["decoded"] = codec.decompress(packet)
        out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)
        got["decoded_out"] = codec.decompress(packet, out=out)
        assert got["decoded_out"] is out
        residual = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)
        got["packet_r"] = codec.compress_residual(x, seed, residual)
        got["residual"] = residual
        packets = [codec.compress(x * k if k else x, seed=seed + k) for k in range(n)]
        got["aggregate"] = codec.aggregate(packets)
        got["aggregate_of_one"] = codec.aggregate(packets[:1])
        if codec.sum_dtype(n, x.dtype) is not None:
            summands = [codec.summand(p, n) for p in packets]
            got["summand"] = summands[0]
            wide = summands[0].to(torch.int32) if not summands[0].is_floating_point() else summands[0].clone()
            for s in summands[1:]:
                wide += s
            got["from_sum_wide"] = codec.from_sum(wide, packets[0], n)
            if not summands[0].is_floating_point():
                got["from_sum_narrow"] = codec.from_sum(wide.to(summands[0].dtype), packets[0], n)
    return got


def same_packet(a, b) -> bool:
    """Two packets with the same wire names, shapes, dtypes and bits (:func:`same_bits`)."""
    return (a.wire.keys() == b.wire.keys() and a.shape == b.shape and a.dtype == b.dtype
            and all(same_bits(a.wire[k].cpu(), b.wire[k].cpu()) for k in a.wire))


def same_outputs(a: dict, b: dict) -> list[str]:
    """The keys of two :func:`codec_outputs` whose values differ (packets: :func:`same_packet`;
    tensors: :func:`same_bits`)."""
    assert a.keys() == b.keys()
    return [key for key in a if not (same_packet(a[key], b[key]) if key.startswith("packet")
                                     else same_bits(a[key].cpu(), b[key].cpu()))]


#: Values a codec must treat as torch does: zeros, infinities, NaNs, subnormals, values at
#: and around the 2bit thresholds, beyond float16's range.
SPECIAL = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1e-45, -1e-45, 1e-40, 0.01, -0.01,
           0.5, -0.5, 0.009999999776482582, -0.009999999776482582, 1e-8, 70000.0, -3e38]


def codec_input(shape, dtype, seed, special=True, layout="contiguous", ties=False, device="cpu") -> torch.Tensor:
    """A codec test tensor: N(0, 0.02) entries, 30% of them :data:`SPECIAL` values when
    ``special``, every fourth equal to the second when ``ties``; ``layout``: ``transposed``
    or ``strided`` (the same shape, not contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.02
    flat = x.view(-1)
    if special and flat.numel():
        picks = torch.randint(len(SPECIAL), (flat.numel(),), generator=gen)
        where = torch.rand(flat.numel(), generator=gen) < 0.3
        flat[where] = torch.tensor(SPECIAL, dtype=torch.float64)[picks[where]]
    if ties and flat.numel() > 4:
        flat[::4] = flat[1]
    x = x.to(dtype).to(device)
    if layout == "transposed" and x.dim() >= 2:
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "strided" and x.dim() >= 1:
        return torch.stack([x, x], dim=-1)[..., 0]
    return x


def collectives(comm):
    n, r = comm.world_size, comm.rank
    x = torch.arange(5, dtype=torch.float32) * (r + 1)
    summed = comm.allreduce(x.clone())
    codes = torch.tensor([r, -r, 1], dtype=torch.int8)
    summed8 = comm.allreduce(codes.clone(), async_op=True).wait()
    gathered = comm.allgather(torch.full((2, 3), r, dtype=torch.uint8))
    b = torch.full((4,), float(r))
    comm.broadcast(b, src=n - 1)
    return {"sum": summed, "sum8": summed8, "gathered": gathered, "bcast": b, "bytes": comm.bytes_sent}


def check_collectives(out, rank, n):
    tri = n * (n + 1) / 2
    assert torch.equal(out["sum"], torch.arange(5, dtype=torch.float32) * tri)
    assert out["sum8"].tolist() == [n * (n - 1) // 2, -(n * (n - 1) // 2), n]
    assert out["gathered"].shape == (n, 2, 3)
    assert [out["gathered"][j, 0, 0].item() for j in range(n)] == list(range(n))
    assert torch.equal(out["bcast"], torch.full((4,), float(n - 1)))
    expected = allreduce_wire_bytes(20, n) + allreduce_wire_bytes(3, n) + allgather_wire_bytes(6, n)
    expected += 16 if (rank == n - 1 and n > 1) else 0
    assert out["bytes"] == expected


def leave_marks(comm, path):
    """Print a line (not flushed) and register an atexit hook that would write a file."""
    import atexit
    import pathlib

    atexit.register(lambda: pathlib.Path(f"{path}.{comm.rank}").write_text("finalised"))
    print(f"rank {comm.rank} was here")
    return comm.rank


def fail_on_rank(comm, bad):
    if comm.rank == bad:
        raise RuntimeError("deliberate failure")
    return comm.rank


# -- exchange ----------------------------------------------------------------------------
EXCHANGE_CODECS = ["none", "fp16", "2bit:threshold=0.5", "sign", "topk:ratio=0.1",
                   "randomk:ratio=0.2", "qsgd", "randblock:ratio=0.3"]
SHAPES = [(7, 5), (13,), (3, 2, 2, 2), ()]


def worker_tensors(rank: int, shapes=SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(s, generator=g) for s in shapes]


def exchange_all(comm, codecs=tuple(EXCHANGE_CODECS), step=3):
    """PSync of this rank's tensors with every codec: aggregates, residuals, bytes."""
    from gradzip.exchange import PSync

    out = {}
    for spec in codecs:
        psync = PSync(comm, spec, seed=11)
        res = psync(worker_tensors(comm.rank), step)
        out[spec] = (res.aggregate, res.residual, res.bytes_sent)
    return out


# -- methods -----------------------------------------------------------------------------
def regression_batch(step: int, rank: int, world_size: int, per_worker: int = 6):
    """This worker's shard of the global batch of a step (the concatenation over ranks)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(per_worker * world_size, 4, generator=g)
    y = torch.randn(per_worker * world_size, 2, generator=g)
    lo = rank * per_worker
    return x[lo:lo + per_worker], y[lo:lo + per_worker]


def train_resumable(comm, make_opt, steps: int, saved: dict | None = None) -> dict:
    """Steps 1..``steps`` of ``make_opt(model)`` on the regression task (:func:`tiny_model`,
    the MSE of :func:`regression_batch`), continuing after ``saved`` (a previous return value,
    loaded into new objects) when given: ``{"model", "opt", "done"}`` state dicts, to compare
    an uninterrupted run with a resumed one bit for bit."""
    model = tiny_model()
    opt = make_opt(model)
    first = 1
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        first = saved["done"] + 1
    for t in range(first, steps + 1):
        opt.zero_grad()
        x, y = regression_batch(t, comm.rank, comm.world_size)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {"model": model.state_dict(), "opt": opt.state_dict(), "done": steps}


def trained_parameters(comm, make_opt, steps: int) -> list[torch.Tensor]:
    """The parameters of :func:`tiny_model`, in order, after steps 1..``steps`` of
    :func:`train_resumable` (a method's trajectory, to compare with another's)."""
    return list(train_resumable(comm, make_opt, steps)["model"].values())


def tiny_model() -> torch.nn.Module:
    """The same small network on every call, without touching the global RNG (threads)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def train_method(comm, method: str, options: dict, steps: int = 5):
    """``steps`` steps of a method on the regression task; the final parameters."""
    import gradzip

    model = tiny_model()
    opt = gradzip.optim.METHODS[method](model.parameters(), comm=comm, **options)
    for t in range(1, steps + 1):
        x, y = regression_batch(t, comm.rank, comm.world_size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def simulate_method(n: int, method: str, options: dict, steps: int = 5):
    """:func:`train_method` on ``n`` in-process workers: every rank's final parameters."""
    import gradzip

    return gradzip.simulate(n, lambda c: train_method(c, method, options, steps=steps))


def assert_same_runs(outs_a, outs_b, rtol: float = 1e-6, atol: float = 1e-6):
    """Every rank's parameters of two runs equal up to float32 reassociation."""
    for a_params, b_params in zip(outs_a, outs_b):
        for a, b in zip(a_params, b_params):
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def train_with_resume(comm, method: str, options: dict, steps: int, split: int | None):
    """``train_method``, but at step ``split`` the model and optimizer are saved and training
    continues in fresh ones loaded from that state; (final parameters, final state_dict)."""
    import copy

    import gradzip

    model = tiny_model()
    make = lambda m: gradzip.optim.METHODS[method](m.parameters(), comm=comm, **options)
    opt = make(model)
    for t in range(1, steps + 1):
        if t == split:
            saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
            model = tiny_model()
            model.load_state_dict(saved_model)
            opt = make(model)
            opt.load_state_dict(saved_opt)
        x, y = regression_batch(t, comm.rank, comm.world_size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()], opt.state_dict()


METHOD_RUNS = {
    "ssgd": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    "ssgd-sign": {"lr": 0.01, "compressor": "sign"},
    "efsgd-topk": {"lr": 0.1, "compressor": "topk:ratio=0.3", "momentum": 0.5},
    "bitsgd": {"lr": 0.1, "threshold": 0.05, "momentum": 0.9, "nesterov": True},
}


def train_all_methods(comm):
    return {name: train_method(comm, name.split("-")[0], opts) for name, opts in METHOD_RUNS.items()}


# -- the CSER family (issue 5) -----------------------------------------------------------
def cser_family_invariant(comm, method: str, options: dict, steps: int = 9):
    """Per step: this worker's ``x_i − e_i`` and its model ``x_i`` (CSEA, CSER, CSER-PL on the
    regression task)."""
    import gradzip

    model = tiny_model()
    opt = gradzip.optim.METHODS[method](model.parameters(), comm=comm, **options)
    shifted, models = [], []
    for t in range(1, steps + 1):
        x, y = regression_batch(t, comm.rank, comm.world_size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        params = [p.detach().clone() for p in model.parameters()]
        models.append(params)
        shifted.append([p - opt.state[q]["error"] for p, q in zip(params, model.parameters())])
    return {"shifted": shifted, "models": models, "bytes": opt.bytes_sent}


def cser_family_runs(comm, runs):
    """:func:`cser_family_invariant` for each ``(method, options)`` of ``runs``."""
    return [cser_family_invariant(comm, method, options) for method, options in runs]


# -- CD-SGD / OD-SGD ---------------------------------------------------------------------
def quadratic_problem(rank: int, dim: int = 6):
    """Worker ``rank``'s quadratic f_i(x) = 0.5 ||A_i x - b_i||^2 (deterministic gradients)."""
    g = torch.Generator().manual_seed(77 + rank)
    return torch.randn(dim, dim, generator=g) / dim ** 0.5, torch.randn(dim, generator=g)


def quadratic_start(dim: int = 6) -> torch.Tensor:
    return torch.randn(dim, generator=torch.Generator().manual_seed(3))


def run_delayed(comm, method: str, options: dict, steps: int):
    """``steps`` steps of OD/CD-SGD on the quadratic; per step: (local model, global model)."""
    import gradzip

    x = torch.nn.Parameter(quadratic_start())
    A, b = quadratic_problem(comm.rank)
    opt = gradzip.optim.METHODS[method]([x], comm=comm, **options)
    history = []
    for _ in range(steps):
        opt.zero_grad()
        (0.5 * (A @ x - b).pow(2).sum()).backward()
        opt.step()
        W = opt.evaluation_parameters()
        history.append((x.detach().clone(), None if W is None else W[0].clone()))
    return history, opt.bytes_sent


def delayed_overlap_and_sync(comm):
    opts = dict(lr=0.05, momentum=0.9, k=3, warmup_steps=2, compressor="2bit:threshold=0.05")
    return (run_delayed(comm, "cdsgd", dict(opts, overlap=True), 9),
            run_delayed(comm, "cdsgd", dict(opts, overlap=False), 9))


def same(a, b) -> bool:
    """Bitwise equal tensors, or both None."""
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


# -- reliability: exact resume, non-finite gradients (issue 7) ---------------------------
#: Every method, with periods that do not line up with the checkpoints (every 8 steps) or
#: the interruption (after step 27): 22 steps per epoch with 2 workers on digits.
RESUME_RUNS = {
    "ssgd": {}, "efsgd": {}, "bitsgd": {"threshold": 0.02}, "localsgd": {"H": 5},
    "qsparse": {"H": 5}, "csea": {}, "cser": {"H": 6}, "cserpl": {"H": 6},
    "dgc": {"warmup_steps": 10, "ratio": 0.01}, "powersgd": {"start_iter": 10, "rank": 2},
    "odsgd": {"warmup_steps": 5}, "cdsgd": {"warmup_steps": 5, "k": 3}, "cpsgd": {"k": 4},
    "lars": {"compressor": "topk:ratio=0.1"}, "lamb": {}, "adamw": {"compressor": "topk:ratio=0.1"},
    "diloco": {"inner": "sgd", "H": 6, "fragments": 2, "delay": 1, "alpha": 0.5, "compressor": "topk:ratio=0.3"},
    "sparseloco": {"inner": "sgd", "H": 7, "compressor": "topk:ratio=0.3"},
    "demo": {"compressor": "dct:chunk=8,topk=4"},
    "asgd": {"order": "round_robin", "compressor": "topk:ratio=0.1"},  # the deterministic schedule
    # eps 1e-3: digits' constant pixels leave v ≈ 0 where the 1-bit momentum is not 0 (docs/adaptive.md)
    "onebitadam": {"freeze_step": 20, "eps": 1e-3}, "onebitlamb": {"freeze_step": 20, "eps": 1e-3},
    "zerooneadam": {"var_freeze_step": 20, "var_update_scaler": 3, "local_step_scaler": 5, "eps": 1e-3},
}
#: Common settings other than resume_runs' own, per method (Adam-type methods take no momentum).
RESUME_COMMON = {"lamb": {"momentum": 0.0}, "adamw": {"momentum": 0.0}, "demo": {"momentum": 0.0, "lr": 0.002},
                 **{m: {"momentum": 0.0, "lr": 0.002} for m in ("onebitadam", "onebitlamb", "zerooneadam")}}
INTERRUPT_AFTER = 27


class Interrupted(Exception):
    """Raised by every rank after the same step: the run stops as if preempted."""


def interrupt_after(steps: int):
    def hook(done: int) -> None:
        if done == steps:
            raise Interrupted(done)
    return hook


def whole_and_resumed(comm, root: str, interrupt_at: int, **config) -> tuple[dict, dict]:
    """``RunConfig(**config)`` run whole with checkpoints in ``root/whole``, and run in
    ``root/cut`` interrupted after ``interrupt_at`` steps then resumed: both results."""
    from gradzip.train.config import RunConfig
    from gradzip.train.loop import run_worker

    whole = run_worker(comm, RunConfig(**config, checkpoint_dir=f"{root}/whole"))
    cut = RunConfig(**config, checkpoint_dir=f"{root}/cut", resume=True)
    with pytest.raises(Interrupted):
        run_worker(comm, cut, after_step=interrupt_after(interrupt_at))
    return whole, run_worker(comm, cut)


def resume_runs(comm, root: str, methods=tuple(RESUME_RUNS), epochs: int = 2):
    """Per method: an uninterrupted run writing checkpoints into ``root/<m>-whole``, and a
    run interrupted after :data:`INTERRUPT_AFTER` steps then resumed in
    ``root/<m>-resumed``; their histories and the resumed run's ``resumed_from_step``."""
    from gradzip.train.config import RunConfig
    from gradzip.train.loop import run_worker

    out = {}
    for name in methods:
        common = {"momentum": 0.5, "weight_decay": 1e-4, "lr": 0.05, **RESUME_COMMON.get(name, {})}
        base = RunConfig(algo=name, options=RESUME_RUNS[name], epochs=epochs, progress=False, checkpoint_every=8,
                         **common)
        whole = run_worker(comm, RunConfig(**{**vars(base), "checkpoint_dir": f"{root}/{name}-whole"}))
        cut = RunConfig(**{**vars(base), "checkpoint_dir": f"{root}/{name}-resumed", "resume": True})
        try:
            run_worker(comm, cut, after_step=interrupt_after(INTERRUPT_AFTER))
            raise AssertionError("the interruption did not happen")
        except Interrupted:
            pass
        resumed = run_worker(comm, cut)
        out[name] = {"whole": whole["history"], "resumed": resumed["history"],
                     "resumed_from": resumed["summary"]["resumed_from_step"],
                     "steps": (whole["summary"]["steps"], resumed["summary"]["steps"])}
    return out


def assert_bitwise_equal(a, b, where="state"):
    """Nested dicts / lists / tensors equal bit for bit, clock readings left out
    (:func:`checkpoint_diff.differences`)."""
    diff = differences(a, b, where)
    assert not diff, f"differ at {', '.join(diff[:5])}" + (f" and {len(diff) - 5} more" if len(diff) > 5 else "")


#: Options for every method on the regression task, with short periods so that a 6-step
#: run crosses synchronisations, warm-ups and corrections.
SHORT_RUNS = {
    "ssgd": {"momentum": 0.9}, "efsgd": {"compressor": "topk:ratio=0.3"}, "bitsgd": {"threshold": 0.05},
    "localsgd": {"H": 2}, "qsparse": {"H": 2, "compressor": "topk:ratio=0.3"},
    "csea": {"compressor": "topk:ratio=0.3"}, "cser": {"H": 2, "c1": "topk:ratio=0.3", "c2": "topk:ratio=0.5"},
    "cserpl": {"H": 2, "c1": "topk:ratio=0.3"}, "dgc": {"warmup_steps": 2, "ratio": 0.3, "momentum": 0.9},
    "powersgd": {"start_iter": 2, "momentum": 0.9}, "odsgd": {"warmup_steps": 1},
    "cdsgd": {"warmup_steps": 1, "k": 2, "compressor": "2bit:threshold=0.05"}, "cpsgd": {"k": 3},
    "lars": {"momentum": 0.9, "compressor": "topk:ratio=0.3"}, "lamb": {"compressor": "topk:ratio=0.3"},
    "adamw": {"weight_decay": 0.01},
    "diloco": {"H": 4, "fragments": 2, "delay": 1, "alpha": 0.5, "inner": "sgd", "compressor": "topk:ratio=0.3"},
    "sparseloco": {"H": 2, "inner": "sgd", "compressor": "topk:ratio=0.3"},
    "demo": {"compressor": "dct:chunk=2,topk=2"},
    "asgd": {"order": "round_robin", "compressor": "topk:ratio=0.3", "momentum": 0.9},  # deterministic order
    "onebitadam": {"freeze_step": 2}, "onebitlamb": {"freeze_step": 2},
    "zerooneadam": {"var_freeze_step": 4, "var_update_scaler": 1, "local_step_scaler": 1},
}


def train_with_bad_gradient(comm, method: str, options: dict, *, bad_step: int = 3, bad_rank: int = 1,
                            value: float = float("nan"), drop: bool = False, steps: int = 6):
    """``steps`` steps of ``method`` on the regression task where rank ``bad_rank``'s
    gradient at ``bad_step`` holds ``value`` in one coordinate; ``drop=True``: that step
    is left out altogether instead. (final parameters, final state_dict)."""
    import gradzip

    model = tiny_model()
    opt = gradzip.optim.METHODS[method](model.parameters(), comm=comm, lr=0.05, **options)
    for t in range(1, steps + 1):
        if drop and t == bad_step:
            continue
        x, y = regression_batch(t, comm.rank, comm.world_size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if t == bad_step and comm.rank == bad_rank:
            next(model.parameters()).grad.view(-1)[1] = value
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def bad_gradient_pairs(comm, methods=tuple(SHORT_RUNS)):
    """Per method: (run skipping the bad step, run without that step)."""
    return {m: (train_with_bad_gradient(comm, m, dict(SHORT_RUNS[m], nonfinite="skip")),
                train_with_bad_gradient(comm, m, SHORT_RUNS[m], drop=True)) for m in methods}


def raise_on_bad_gradient(comm, method: str = "efsgd", **options):
    """A NaN on rank 1 under nonfinite='raise': rank 1 raises; its state before the step
    is returned by the others' error path (they see a PeerFailure). ``options`` replace
    the method's short-run options (e.g. its compressor)."""
    return train_with_bad_gradient(comm, method, {**SHORT_RUNS[method], **options})


def different_settings(comm, field: str):
    """An optimizer whose ``field`` differs on rank 1 (lr, compressor, shapes, world...)."""
    import gradzip

    options = dict(SHORT_RUNS["efsgd"])
    model = tiny_model()
    if field == "lr":
        lr = 0.1 if comm.rank != 1 else 0.2
    else:
        lr = 0.1
    if field == "compressor" and comm.rank == 1:
        options["compressor"] = "topk:ratio=0.5"
    if field == "shape" and comm.rank == 1:
        model = torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    opt = gradzip.optim.METHODS["efsgd"](model.parameters(), comm=comm, lr=lr, **options)
    x, y = regression_batch(1, comm.rank, comm.world_size)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return "stepped"


def repeat_runs(comm, root: str, tag: str, methods=("efsgd", "cdsgd", "powersgd", "dgc", "cser")):
    """One 1-epoch run per method, checkpoint at the end in ``root/<tag>-<method>``; the
    histories."""
    from gradzip.train.config import RunConfig
    from gradzip.train.loop import run_worker

    return {m: run_worker(comm, RunConfig(algo=m, options=RESUME_RUNS[m], epochs=1, progress=False, momentum=0.5,
                                          checkpoint_dir=f"{root}/{tag}-{m}"))["history"] for m in methods}


def chained_allreduce(comm, early: bool):
    """``Work.then`` on an allreduce: ``fn`` runs once the sum is there. ``early``: a backend
    with futures (torch.distributed), where it runs before ``wait()`` is called (waited for
    here up to 10 s; on the backend's thread, or at once where the sum is already there);
    else inside ``wait()``, on the caller's thread."""
    import threading
    import time

    ran = []
    tensor = torch.full((4,), float(comm.rank + 1))

    def mean(total):
        ran.append(threading.get_ident())
        return total.div_(comm.world_size).sum().item()

    work = comm.allreduce(tensor, async_op=True).then(mean)
    deadline = time.monotonic() + 10
    while early and not ran and time.monotonic() < deadline:
        time.sleep(0.01)
    before_wait = bool(ran)
    value = work.wait()
    return {"value": value, "tensor": tensor, "ran_before_wait": before_wait,
            "on_caller": ran == [threading.get_ident()], "calls": len(ran)}
