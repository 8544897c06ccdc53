"""A ``torch.distributed`` process group: gloo for CPU tensors, NCCL for CUDA tensors.

Launch with ``torchrun`` (or ``gradzip train --workers N``, which spawns local processes)
and initialise with :func:`init_from_env`; ``TorchGroup()`` then wraps the default group
(or any process group you pass). Collectives use ``async_op=True`` under the hood.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ..errors import GradzipError
from .base import Group, Work

# all_gather_single is the newer name of all_gather_into_tensor (same signature).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchGroup(Group):
    """This process's handle on a ``torch.distributed`` group (the default one if None)."""

    def __init__(self, group: "dist.ProcessGroup | None" = None):
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise GradzipError(
                "torch.distributed is not initialised; launch with torchrun (or gradzip train "
                "--workers N) and call gradzip.comm.init_from_env(), or use gradzip.simulate"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def new_group(self) -> "TorchGroup":
        ranks = list(range(self.world_size)) if self.group is None else dist.get_process_group_ranks(self.group)
        return TorchGroup(dist.new_group(ranks=ranks))

    def _allreduce(self, tensor, nbytes):
        handle = dist.all_reduce(tensor, group=self.group, async_op=True)
        return Work(lambda: (handle.wait(), tensor)[1], nbytes)

    def _allgather(self, tensor, nbytes):
        flat = tensor.contiguous().reshape(-1)
        out = flat.new_empty(self.world_size * flat.numel())
        handle = _all_gather_flat(out, flat, group=self.group, async_op=True)
        return Work(lambda: (handle.wait(), out.view(self.world_size, *tensor.shape))[1], nbytes)

    def _broadcast(self, tensor, src, nbytes):
        handle = dist.broadcast(tensor, src=_global_rank(self.group, src), group=self.group, async_op=True)
        return Work(lambda: (handle.wait(), tensor)[1], nbytes)


def _global_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def init_from_env(timeout_s: float = 300.0) -> TorchGroup:
    """Initialise the default group from torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT): gloo for CPU tensors, plus NCCL for CUDA tensors when CUDA
    is available. Returns the group's handle; a no-op if already initialised."""
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise GradzipError(
                f"cannot join a process group: environment variable(s) {', '.join(missing)} not set; "
                "launch with torchrun or gradzip train --workers N"
            )
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return TorchGroup()
