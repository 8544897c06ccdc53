"""Who talks to whom: one :class:`Group` interface, two implementations.

* :class:`TorchGroup`: a ``torch.distributed`` process group (gloo / NCCL);
* :class:`ThreadGroup`: N workers on threads of this process (:func:`simulate`).

Both raise :class:`PeerFailure` (one class) when a peer dies, leaves or is stuck, naming it.
"""
from __future__ import annotations

import torch.distributed as dist

from ..errors import GradzipError
from .base import PeerFailure, Group, Work, all_to_all_wire_bytes, allgather_wire_bytes, allreduce_wire_bytes
from .threads import ThreadGroup, make_group, simulate
from .torchdist import TorchGroup, init_from_env


def default() -> Group:
    """The default ``torch.distributed`` group when one is initialised, else a world of one."""
    if dist.is_available() and dist.is_initialized():
        return TorchGroup()
    return make_group(1)[0]


def resolve(comm: "Group | None", who: str) -> Group:
    """What ``comm=`` means for ``who`` (a constructor or function taking it): a
    :class:`Group` as it is, None the :func:`default` group; anything else raises a one-line
    :class:`GradzipError` naming what to pass (a ``torch.distributed`` process group is
    wrapped by :class:`TorchGroup`)."""
    if comm is None:
        return default()
    if isinstance(comm, Group):
        return comm
    hint = ("wrap it: comm=gradzip.comm.TorchGroup(group)" if isinstance(comm, dist.ProcessGroup)
            else "pass the group gradzip.simulate gives each worker, gradzip.comm.TorchGroup() for the "
                 "initialised torch.distributed group, or None for the default group")
    raise GradzipError(f"{who}: comm must be a gradzip.comm.Group, got {type(comm).__name__} {comm!r:.60}; {hint}")


__all__ = [
    "Group", "Work", "TorchGroup", "ThreadGroup", "PeerFailure", "simulate", "make_group",
    "default", "resolve", "init_from_env", "allreduce_wire_bytes", "allgather_wire_bytes", "all_to_all_wire_bytes",
]
