"""Make every worker's replica start from the same values: :func:`broadcast_parameters`.

Workers that build their model independently (a seed that differs per rank, a checkpoint
loaded on one rank only) start from different weights, and a synchronous method keeps them
different forever: each applies the same averaged update to its own weights. The
optimizers refuse such a start on their first step (:meth:`DistributedOptimizer.describe`
digests the parameters' values, :func:`parameter_digest`); this copies rank ``src``'s
values to every worker.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

import torch

from .. import comm as comm_lib
from ..errors import GradzipError


def broadcast_parameters(module_or_params: "torch.nn.Module | Iterable[torch.Tensor]",
                         comm: "comm_lib.Group | None" = None, src: int = 0) -> None:
    """Copy rank ``src``'s parameters (and, for a module, its buffers: batch-norm statistics)
    into every worker's, in place. Collective: every worker calls it with the same model
    structure. ``comm=None``: the default torch.distributed group when one is initialised,
    else a world of one (nothing to do)."""
    group = comm_lib.resolve(comm, "broadcast_parameters")
    if isinstance(module_or_params, torch.nn.Module):
        tensors = list(module_or_params.parameters()) + list(module_or_params.buffers())
    elif isinstance(module_or_params, torch.Tensor):
        tensors = [module_or_params]
    else:
        tensors = list(module_or_params)
    bad = next((i for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor)), None)
    if bad is not None:
        raise GradzipError(f"broadcast_parameters: item #{bad} is a {type(tensors[bad]).__name__}, not a "
                           "tensor; pass a torch.nn.Module or an iterable of its parameters")
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < group.world_size:
        raise GradzipError(f"broadcast_parameters: src must be a rank in [0, {group.world_size}), got {src!r}")
    if group.world_size == 1:
        return
    with torch.no_grad():
        for t in tensors:
            group.broadcast(t.data, src=src)


def parameter_digest(p: torch.Tensor) -> str:
    """A digest of a tensor's bytes (its values, bit for bit): 16 hex digits of SHA-256."""
    flat = p.detach().reshape(-1).contiguous().cpu()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"").hexdigest()[:16]
