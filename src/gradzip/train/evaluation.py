"""What the harness evaluates, and how: the model every worker agrees on (rank 0's, or the
workers' average for methods whose replicas differ), on the test set split among the
workers, so that no worker waits in a collective while another evaluates the whole set
(``--timeout`` bounds waiting in collectives: docs/reliability.md)."""
from __future__ import annotations

from copy import deepcopy

import torch
import torch.nn.functional as F

from .. import optim
from ..comm import Group
from ..errors import GradzipError


@torch.no_grad()
def evaluation_sums(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1024) -> tuple[int, float]:
    """(correct predictions, summed cross-entropy) of ``model`` on ``(x, y)``."""
    model.eval()
    correct, loss = 0, 0.0
    for i in range(0, len(x), batch):
        out = model(x[i:i + batch])
        loss += F.cross_entropy(out, y[i:i + batch], reduction="sum").item()
        correct += (out.argmax(1) == y[i:i + batch]).sum().item()
    model.train()
    return correct, loss


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1024) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on ``(x, y)``."""
    correct, loss = evaluation_sums(model, x, y, batch)
    return correct / len(x), loss / len(x)


def evaluate_shared(model: torch.nn.Module, comm: Group, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """:func:`evaluate` of a model that is the same on every worker, each worker taking an
    equal share of ``(x, y)`` (one allreduce of two numbers): no worker waits in a
    collective while another evaluates the whole set. Collective."""
    if comm.world_size == 1:
        return evaluate(model, x, y)
    lo, hi = len(x) * comm.rank // comm.world_size, len(x) * (comm.rank + 1) // comm.world_size
    correct, loss = evaluation_sums(model, x[lo:hi], y[lo:hi]) if hi > lo else (0, 0.0)
    total = comm.allreduce(torch.tensor([float(correct), loss], dtype=torch.float64)).tolist()
    return total[0] / len(x), total[1] / len(x)


def evaluation_model(model: torch.nn.Module, opt: optim.DistributedOptimizer, comm: Group,
                     eval_on: str) -> torch.nn.Module:
    """The model to evaluate, the same on every worker, without touching training state:
    the optimizer's evaluation parameters if it has any, else the model's own; averaged
    over the workers (one allreduce of parameters and float buffers) for ``"average"``, or
    for ``"auto"`` when the method's replicas differ; otherwise rank 0's (its float buffers,
    such as BatchNorm statistics, and, where replicas differ, its parameters: one
    broadcast). Collective when there are several workers: every rank must call it."""
    if eval_on not in ("auto", "average", "local"):
        raise GradzipError(f"eval_on must be 'auto', 'average' or 'local', got {eval_on!r}")
    override = opt.evaluation_parameters()
    average = eval_on == "average" or (eval_on == "auto" and opt.replicas_differ)
    several = comm.world_size > 1
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    from_rank0 = several and not average and (opt.replicas_differ or buffers)
    if override is None and not (average and several) and not from_rank0:
        return model
    copy = deepcopy(model)
    params = list(copy.parameters())
    with torch.no_grad():
        if override is not None:
            for p, value in zip(params, override):
                p.copy_(value)
        if several and (average or from_rank0):
            tensors = ([] if from_rank0 and not opt.replicas_differ else params) \
                + [b for b in copy.buffers() if b.is_floating_point()]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            if average:
                comm.allreduce(flat).div_(comm.world_size)
            else:
                comm.broadcast(flat, src=0)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
    return copy
