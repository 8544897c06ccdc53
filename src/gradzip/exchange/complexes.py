"""Complex tensors cross the exchange as their real views (``torch.view_as_real``: a
trailing dimension of 2), as torch's optimizers treat complex parameters: every codec,
transport, seed and bucket sees that real tensor, and the aggregates and residuals come back
complex (:func:`real_views` before the exchange, :func:`with_complex` around what it
returns)."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch


def real_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as its real view if it is complex, else itself (a view either way: an
    in-place change writes through)."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def real_views(tensors: Sequence[torch.Tensor]) -> tuple[Sequence[torch.Tensor], list[int]]:
    """``tensors`` with every complex one as its real view (module docstring), and the
    positions of those."""
    at = [i for i, t in enumerate(tensors) if t.is_complex()]
    return ([real_view(t) for t in tensors] if at else tensors), at


def as_complex(tensors, at: list[int]):
    """The real views at positions ``at`` of the list ``tensors`` as complex tensors again
    (copied where their layout cannot be viewed so); anything but a list as it is."""
    if not at or not isinstance(tensors, list):
        return tensors
    out = list(tensors)
    for i in at:
        t = out[i]
        if t.stride(-1) != 1 or t.storage_offset() % 2 or any(s % 2 for s in t.stride()[:-1]):
            t = t.clone(memory_format=torch.contiguous_format)
        out[i] = torch.view_as_complex(t)
    return out


class _ComplexPending:
    """An exchange with complex tensors in flight as their real views: its residuals and
    what ``wait()`` returns are complex again; everything else is the exchange's."""

    def __init__(self, pending, at: list[int]):
        self.pending, self.at = pending, at
        self.residual = as_complex(pending.residual, at)

    def __getattr__(self, name: str):
        return getattr(self.pending, name)

    def wait(self):
        result = self.pending.wait()
        return dataclasses.replace(result, aggregate=as_complex(result.aggregate, self.at),
                                   residual=as_complex(result.residual, self.at))


def with_complex(pending, at: list[int]):
    """``pending`` as it is, or (complex tensors at ``at``) wrapped to return them complex."""
    return _ComplexPending(pending, at) if at else pending
