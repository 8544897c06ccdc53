"""Who talks to whom: one :class:`Group` interface, two implementations.

* :class:`TorchGroup`: a ``torch.distributed`` process group (gloo / NCCL);
* :class:`ThreadGroup`: N workers on threads of this process (:func:`simulate`).

Both raise :class:`PeerFailure` (one class) when a peer dies, leaves or is stuck, naming it.
"""
from __future__ import annotations

import torch.distributed as dist

from .base import PeerFailure, Group, Work, all_to_all_wire_bytes, allgather_wire_bytes, allreduce_wire_bytes
from .threads import ThreadGroup, make_group, simulate
from .torchdist import TorchGroup, init_from_env


def default() -> Group:
    """The default ``torch.distributed`` group when one is initialised, else a world of one."""
    if dist.is_available() and dist.is_initialized():
        return TorchGroup()
    return make_group(1)[0]


__all__ = [
    "Group", "Work", "TorchGroup", "ThreadGroup", "PeerFailure", "simulate", "make_group",
    "default", "init_from_env", "allreduce_wire_bytes", "allgather_wire_bytes", "all_to_all_wire_bytes",
]
