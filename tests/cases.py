"""Worker functions shared by tests: importable, so spawned gloo processes can run them."""
from __future__ import annotations

import torch

from gradzip.comm import allgather_wire_bytes, allreduce_wire_bytes


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
