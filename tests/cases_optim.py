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
