"""``torch.optim.Optimizer`` without the import its dynamo guard costs on first use.

torch wraps ``add_param_group``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` in
``torch._disable_dynamo``, whose first call imports ``torch._dynamo``: about as long as
``import torch`` itself, in every process that builds an optimizer (docs/benchmarks/startup.md).
While ``torch._dynamo`` is not imported nothing can be compiling, so the wrapper would
change nothing: :class:`EagerOptimizer` then calls the function it wraps; once it is imported
(``torch.compile``), the wrapper itself. gradzip's optimizers (every method, LARS, LAMB, SAM)
derive from it.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch


def _eager(method: Callable) -> Callable:
    """``method`` (one of ``torch.optim.Optimizer``'s, wrapped by ``torch._disable_dynamo``)
    as the function it wraps while ``torch._dynamo`` is not imported, else as it is."""
    inner = getattr(method, "__wrapped__", method)

    @functools.wraps(inner)
    def call(*args, **kwargs):
        return (method if "torch._dynamo" in sys.modules else inner)(*args, **kwargs)
    return call


_add_param_group = _eager(torch.optim.Optimizer.add_param_group)
_zero_grad = _eager(torch.optim.Optimizer.zero_grad)
_state_dict = _eager(torch.optim.Optimizer.state_dict)
_load_state_dict = _eager(torch.optim.Optimizer.load_state_dict)


class EagerOptimizer(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` whose four dynamo-guarded methods skip the guard while
    ``torch._dynamo`` is not imported (module docstring); otherwise the same."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _add_param_group(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _zero_grad(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return _state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _load_state_dict(self, state_dict)
