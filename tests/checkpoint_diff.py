"""Where two checkpoints differ, bit for bit (test and benchmark tooling, not shipped in
the package): the resume tests and ``benchmarks/fault_campaign.py`` compare whole
checkpoints with :func:`differences`."""
from __future__ import annotations

from typing import Any

import torch

#: Keys of a checkpoint that hold clock readings, which differ between runs of the same numbers.
CLOCK_KEYS = ("timings", "wall_time_s", "compute_s", "step_s", "previous")


def differences(a: Any, b: Any, where: str = "checkpoint") -> list[str]:
    """Where two checkpoints (or any nests of dicts, lists and tensors) differ, bit for bit
    (a NaN equals a NaN), leaving out clock readings (:data:`CLOCK_KEYS`, ``time_*_s``).
    Empty: the same training state."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape):
            return [where]
        bits = (lambda t: t.reshape(-1).view(torch.uint8)) if a.is_floating_point() else (lambda t: t)
        return [] if torch.equal(bits(a), bits(b)) else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        keys = [k for k in {**a, **b} if not _is_clock(k)]
        return [d for k in keys for d in (differences(a[k], b[k], f"{where}.{k}") if k in a and k in b
                                          else [f"{where}.{k}"])]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [where]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    same = a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)
    return [] if same else [where]


def _is_clock(key: Any) -> bool:
    return isinstance(key, str) and (key in CLOCK_KEYS or (key.startswith("time_") and key.endswith("_s")))
