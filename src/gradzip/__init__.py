"""gradzip: communication-efficient distributed data-parallel training for PyTorch.

``gradzip.compressors.build("topk:ratio=0.01")``, ``gradzip.optim.EFSGD(...)``,
``gradzip.simulate(n, fn)``; see docs/architecture.md for the architecture and
docs/algorithms.md for the algorithms.
"""
import importlib

from .version import __version__
from . import _moved
from . import comm, compressors, exchange, optim
from .comm import simulate
from .errors import GradzipError
from .guards.nonfinite import NonFiniteGradient
from .exchange import PSync
from .compressors import PerTensor
from .guards.replicas import broadcast_parameters
from .optim.landscape import sharpness
from .optim.evaluation import evaluation_model

__all__ = ["comm", "compressors", "exchange", "optim", "simulate", "PSync", "PerTensor", "GradzipError", "NonFiniteGradient",
           "broadcast_parameters", "evaluation_model", "sharpness", "__version__"]

_moved.install()   # the old module paths (gradzip.ddp, gradzip.hierarchy, ...) keep importing


def __getattr__(name: str):
    """``gradzip.<a moved module's old name>`` (``gradzip.lightning``, ``gradzip.ddp``, ...)."""
    if _moved.new_name(f"gradzip.{name}") is not None:
        return importlib.import_module(f"gradzip.{name}")
    raise AttributeError(f"module 'gradzip' has no attribute {name!r}")
