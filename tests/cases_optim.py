"""Worker functions of the optimizer-level reliability tests (issue 12): importable, so
spawned gloo processes can run them."""
from __future__ import annotations

import torch

import cases


class TwoBranch(torch.nn.Module):
    """Parameters A and B of the same shape, plus a shared head; ``uses`` picks which of A,
    B a forward pass touches (the rest get no gradient on this rank)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.A = torch.nn.Parameter(torch.randn(4, 3, generator=g))
        self.B = torch.nn.Parameter(torch.randn(4, 3, generator=g))
        self.head = torch.nn.Parameter(torch.randn(3, 2, generator=g))

    def forward(self, x, uses):
        h = sum(x @ getattr(self, name) for name in uses)
        return torch.tanh(h) @ self.head


def train_partial(comm, method: str, options: dict, uses_per_rank, steps: int = 4, explicit_zeros=False):
    """``steps`` steps where rank r's loss touches only ``uses_per_rank[r]`` of A, B;
    ``explicit_zeros=True``: the missing gradients are set to zeros by hand (the reference
    semantics, DDP's find_unused_parameters). Final parameters."""
    import gradzip

    model = TwoBranch()
    opt = gradzip.optim.METHODS[method](model.parameters(), comm=comm, lr=0.05, **options)
    uses = uses_per_rank[comm.rank]
    for t in range(1, steps + 1):
        x, y = cases.regression_batch(t, comm.rank, comm.world_size)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x[:, :4], uses), y).backward()
        if explicit_zeros:
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        opt.step()
    if hasattr(opt, "close"):
        opt.close()
    return [p.detach().clone() for p in model.parameters()]


#: Rank 0 touches only A, rank 1 only B (the issue's scenario); rank 2 both.
AB = (("A",), ("B",), ("A", "B"))
#: Different tensor counts: rank 0 touches A only, rank 1 A and B.
COUNTS = (("A",), ("A", "B"))


def partial_pairs(comm, uses_per_rank, methods=tuple(cases.SHORT_RUNS)):
    """Per method: (run with missing gradients, run with explicit zero gradients)."""
    return {m: (train_partial(comm, m, cases.SHORT_RUNS[m], uses_per_rank),
                train_partial(comm, m, cases.SHORT_RUNS[m], uses_per_rank, explicit_zeros=True))
            for m in methods}


# -- the set of parameters taking part (issue 35, item 5) ------------------------------------
#: Before step 3, rank 0 freezes B and rank 1 freezes A (same shapes: averaged together before).
SWAPPED = {3: ((("B", False),), (("A", False),))}
#: Before step 3, rank 0 freezes A, rank 1 nothing (different counts: the collectives differ).
ONE_SIDED = {3: ((("A", False),), ())}
#: Every rank freezes B before step 2 and unfreezes it before step 4: a change made alike.
ALIKE = {2: ((("B", False),), (("B", False),)), 4: ((("B", True),), (("B", True),))}


def train_with_freezing(comm, method: str, options: dict, changes: dict, overlap=None, steps: int = 6):
    """``steps`` steps of ``method`` on :class:`TwoBranch` (both branches in every loss), with
    ``changes[t][rank]``: ``(name, requires_grad)`` pairs set before step t's backward.
    ``{"refused": message, "step": t, "untouched": the step changed no parameter}``, or
    ``{"params": final parameters, "B while frozen": B after steps 1 and 3}``."""
    import gradzip
    from gradzip.errors import GradzipError

    model = TwoBranch()
    extra = {} if overlap is None else {"overlap_backward": overlap}
    opt = gradzip.optim.METHODS[method](model.parameters(), comm=comm, lr=0.05, **options, **extra)
    seen_b = []
    try:
        for t in range(1, steps + 1):
            for name, flag in changes.get(t, ((),) * comm.world_size)[comm.rank]:
                getattr(model, name).requires_grad_(flag)
            x, y = cases.regression_batch(t, comm.rank, comm.world_size)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x[:, :4], ("A", "B")), y).backward()
            before = [p.detach().clone() for p in model.parameters()]
            try:
                opt.step()
            except GradzipError as error:
                untouched = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
                return {"refused": str(error), "step": t, "untouched": untouched}
            if t in (1, 3):
                seen_b.append(model.B.detach().clone())
    finally:
        if hasattr(opt, "close"):
            opt.close()
    return {"params": [p.detach().clone() for p in model.parameters()], "B while frozen": seen_b}


def freezing_runs(comm, changes: dict, runs):
    """``train_with_freezing`` for every ``(method, overlap)`` of ``runs``."""
    return {(m, o): train_with_freezing(comm, m, cases.SHORT_RUNS[m], changes, overlap=o) for m, o in runs}


# -- codec overflow (issue 12, item 4) -----------------------------------------------------
#: (method, options, lr, finite gradient value that the codec or the sum turns into Inf /
#: NaN, ranks whose gradient holds it)
OVERFLOWS = {
    "ssgd@fp16": ("ssgd", {"compressor": "fp16", "momentum": 0.9}, 1e-6, 1e5, (0,)),
    "ssgd@qsgd": ("ssgd", {"compressor": "qsgd"}, 1e-6, 1e20, (0,)),
    "ssgd@terngrad": ("ssgd", {"compressor": "terngrad"}, 1e-6, 3e38, (0, 1)),
    # both ranks: one rank's P = M·Q of a 3e38 matrix is 2.5e38 for this seed (finite: whether it
    # overflows alone depends on Q); the sum of two is 5e38, an overflow whatever the CPU's matmul
    "ssgd@powersgd": ("ssgd", {"compressor": "powersgd"}, 1e-6, 3e38, (0, 1)),
    "powersgd": ("powersgd", {"start_iter": 0, "momentum": 0.9}, 1e-6, 3e38, (0,)),
    "efsgd@fp16": ("efsgd", {"compressor": "fp16", "momentum": 0.9}, 1.0, 1e5, (0,)),
    "dgc": ("dgc", {"ratio": 0.3, "momentum": 0.9}, 1e-6, 3e38, (0, 1)),
}


def train_with_overflow(comm, name: str, nonfinite: str = "raise", drop: bool = False, bad_step: int = 3,
                        steps: int = 5):
    """``steps`` steps where some ranks' gradient at ``bad_step`` holds a large finite value
    in every coordinate of the first tensor (``drop``: that step left out instead).
    (final parameters, final state_dict, skipped steps)."""
    import gradzip

    method, options, lr, value, ranks = OVERFLOWS[name]
    model = cases.tiny_model()
    opt = gradzip.optim.METHODS[method](model.parameters(), comm=comm, lr=lr, nonfinite=nonfinite, **options)
    for t in range(1, steps + 1):
        if drop and t == bad_step:
            continue
        x, y = cases.regression_batch(t, comm.rank, comm.world_size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if t == bad_step and comm.rank in ranks:
            next(model.parameters()).grad.fill_(value)
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict(), opt.skipped_steps


# -- replicas that start different (issue 12, item 5) --------------------------------------
def seeded_model(seed: int) -> torch.nn.Module:
    """A small network with a buffer (batch norm), built from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    with torch.no_grad():
        for t in list(model.parameters()) + [model[1].running_mean]:
            t.copy_(torch.randn(t.shape, generator=g))
    return model


def step_from_per_rank_init(comm, method: str = "ssgd", broadcast: bool = False, use_module: bool = True):
    """One step of ``method`` from weights seeded by the rank (``broadcast``: after
    ``gradzip.broadcast_parameters``); the parameters and buffers afterwards."""
    import gradzip

    model = seeded_model(comm.rank).eval()  # eval: the batch-norm buffers keep the broadcast values
    if broadcast:
        gradzip.broadcast_parameters(model if use_module else model.parameters(), comm=comm)
    opt = gradzip.optim.METHODS[method](model.parameters(), comm=comm, lr=0.1)
    x, y = cases.regression_batch(1, comm.rank, comm.world_size)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


def resume_differing(comm, method: str, options: dict, split: int = 3, steps: int = 5):
    """``cases.train_with_resume`` (the saved models differ per rank for local SGD / CSER
    between synchronisations)."""
    return cases.train_with_resume(comm, method, options, steps, split)[0]


def resume_with_tampered_model(comm):
    """S-SGD resumed at step 3 where rank 1's model was altered: the first step after the
    load must refuse."""
    import copy

    import gradzip

    model = cases.tiny_model()
    opt = gradzip.optim.SSGD(model.parameters(), comm=comm, lr=0.1)
    for t in range(1, 5):
        if t == 3:
            saved = copy.deepcopy(opt.state_dict())
            if comm.rank == 1:
                with torch.no_grad():
                    model[2].bias.add_(1.0)
            opt = gradzip.optim.SSGD(model.parameters(), comm=comm, lr=0.1)
            opt.load_state_dict(saved)
        x, y = cases.regression_batch(t, comm.rank, comm.world_size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
