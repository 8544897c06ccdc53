"""The model to evaluate for any method: :func:`evaluation_model` (docs/algorithms.md,
"Evaluation"; README "Use gradzip in your own training script").

What a worker should evaluate depends on the method, not on the script: a synchronous
method's replicas are equal (evaluate any); local SGD, QSparse, CSEA, CSER keep replicas
that differ between synchronisations (:attr:`DistributedOptimizer.replicas_differ`:
evaluate the workers' average); OD-SGD / CD-SGD keep a global model beside the local one
(:meth:`DistributedOptimizer.evaluation_parameters`: evaluate that). This returns a copy
holding that model, the same on every worker, and leaves the model, the optimizer's
residuals and its byte counters as they were.
"""
from __future__ import annotations

from copy import deepcopy

import torch

from .. import comm as comm_lib
from ..errors import GradzipError

EVAL_ON = ("auto", "average", "local")


def evaluation_model(model: torch.nn.Module, optimizer: "torch.optim.Optimizer | None" = None,
                     comm: "comm_lib.Group | None" = None, eval_on: str = "auto") -> torch.nn.Module:
    """The model to evaluate, the same on every worker, without touching training state:
    ``model`` itself where that is already so, else a copy. The copy holds the optimizer's
    evaluation parameters where it has any (CD-SGD / OD-SGD's global model, matched to the
    model's parameters by identity, so the optimizer may hold them in any order or only some),
    else the model's own; averaged over the workers (one allreduce of parameters and float
    buffers) for ``"average"``, or for ``"auto"`` when the method's replicas differ
    (``optimizer.replicas_differ``); otherwise rank 0's float buffers (BatchNorm statistics)
    and, where replicas differ, its parameters (one broadcast).

    ``optimizer``: a gradzip method, or None / a plain torch optimizer (a DDP hook run: the
    replicas are equal). ``comm``: the optimizer's group by default, else the default
    ``torch.distributed`` group when one is initialised. Collective when there are several
    workers: every rank must call it, e.g. at the end of every epoch."""
    if eval_on not in EVAL_ON:
        raise GradzipError(f"evaluation_model: eval_on must be 'auto', 'average' or 'local', got {eval_on!r}")
    if not isinstance(model, torch.nn.Module):
        raise GradzipError(f"evaluation_model: model must be a torch.nn.Module, got {type(model).__name__}; "
                           "pass the model the optimizer trains (model.module for a DDP-wrapped one)")
    group = comm_lib.resolve(comm if comm is not None else getattr(optimizer, "comm", None), "evaluation_model")
    evaluation_parameters = getattr(optimizer, "evaluation_parameters", None)
    override = evaluation_parameters() if evaluation_parameters is not None else None  # waits for CD-SGD's exchange
    replicas_differ = bool(getattr(optimizer, "replicas_differ", False))
    average = eval_on == "average" or (eval_on == "auto" and replicas_differ)
    several = group.world_size > 1
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    from_rank0 = several and not average and (replicas_differ or bool(buffers))
    if override is None and not (average and several) and not from_rank0:
        return model
    position = {id(p): i for i, p in enumerate(model.parameters())}
    copy = deepcopy(model)
    params = list(copy.parameters())
    with torch.no_grad():
        if override is not None:
            trained = [p for g in optimizer.param_groups for p in g["params"]]
            for p, value in zip(trained, override):
                if id(p) in position:
                    params[position[id(p)]].copy_(value)
        if several and (average or from_rank0):
            tensors = ([] if from_rank0 and not replicas_differ else params) \
                + [b for b in copy.buffers() if b.is_floating_point()]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            if average:
                group.allreduce(flat).div_(group.world_size)
            else:
                group.broadcast(flat, src=0)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
    return copy
