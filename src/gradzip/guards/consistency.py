"""Do all workers run the same configuration? One small collective answers it.

Workers launched separately (``torchrun`` on several nodes, each parsing its own command
line, each with its own installed version) can disagree on a setting: a different codec
spec, period or learning rate makes a run diverge silently, a different parameter shape
makes collectives hang or fail with a size error that names nothing. :func:`verify`
compares a digest of the settings across the group: one 8-byte allgather when they agree;
when they do not, every worker gathers every worker's settings (two more small
collectives) and raises the same :class:`InconsistentWorkers`, naming the first field
that differs and its value on each worker.

The collectives go through :meth:`Group.allgather_control` (coordination traffic, not a
method's exchange).

(The other way to run one configuration twice, a gradzip optimizer over the parameters of
a ``DistributedDataParallel`` module that still allreduces them, is refused by
:mod:`gradzip.guards.double_sync`.)
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Mapping

import torch

from ..errors import GradzipError


class InconsistentWorkers(GradzipError):
    """Workers of one group run with different settings."""


def _canonical(fields: Mapping[str, Any]) -> bytes:
    return json.dumps({k: str(v) for k, v in fields.items()}, sort_keys=True).encode()


def verify(comm, fields: Mapping[str, Any], what: str = "configuration",
           fixes: Mapping[str, str] | None = None) -> None:
    """Raise :class:`InconsistentWorkers` on every worker unless every worker passed equal
    ``fields`` (compared by ``str(value)``). Collective: every worker must call it.
    ``fixes``: field-name prefix -> the advice the message ends with when that field is the
    first that differs (default: start every worker with the same settings)."""
    if comm is None or comm.world_size == 1:
        return
    blob = _canonical(fields)
    digest = int.from_bytes(hashlib.sha256(blob).digest()[:8], "little", signed=True)
    digests = comm.allgather_control(torch.tensor([digest], dtype=torch.int64)).reshape(-1).tolist()
    if len(set(digests)) == 1:
        return
    sizes = comm.allgather_control(torch.tensor([len(blob)], dtype=torch.int64)).reshape(-1).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    rows = comm.allgather_control(padded)
    everyone = [json.loads(bytes(rows[r, :sizes[r]].tolist()).decode()) for r in range(comm.world_size)]
    raise InconsistentWorkers(describe_difference(everyone, what, fixes))


def describe_difference(everyone: list[dict[str, str]], what: str = "configuration",
                        fixes: Mapping[str, str] | None = None) -> str:
    """The message for workers whose settings differ: the first differing field (in sorted
    order) with each worker's value, grouped by value, and the fix (``fixes``, by prefix)."""
    fixes = fixes or {}
    # fields with their own fix (e.g. parameter values) come after the plain settings: a
    # different shape or codec is the cause to name, not the values that follow from it
    names = differing(everyone, later=lambda n: any(n.startswith(p) for p in fixes))
    if not names:
        return f"workers run with different {what} (digests differ)"
    name = names[0]
    by_value: dict[str, list[int]] = {}
    for rank, w in enumerate(everyone):
        by_value.setdefault(w.get(name, NOT_SET), []).append(rank)
    listed = "; ".join(f"{_ranks(r)}: {v}" for v, r in by_value.items())
    fix = next((text for prefix, text in fixes.items() if name.startswith(prefix)),
               "Start every worker with the same settings and gradzip version.")
    return f"workers run with different {what}: {name!r} differs{more_fields(names)} — {listed}. {fix}"


#: How a field one side lacks is shown.
NOT_SET = "<not set>"


def differing(everyone: list[Mapping[str, Any]], later: Callable[[str], bool] | None = None) -> list[str]:
    """The fields whose values differ among ``everyone`` (a field one lacks differs), in
    the order to name them: sorted, the fields for which ``later(name)`` holds after the
    others (what follows from another setting comes after the setting that caused it)."""
    names = set().union(*everyone)
    changed = [n for n in names if any(w.get(n, NOT_SET) != everyone[0].get(n, NOT_SET) for w in everyone)]
    return sorted(changed, key=lambda n: (bool(later and later(n)), n))


def more_fields(names: list[str]) -> str:
    """`` (and N more fields)`` after the first of ``names``; empty for one."""
    others = len(names) - 1
    return f" (and {others} more field{'s' * (others > 1)})" if others else ""


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))
