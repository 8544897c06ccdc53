"""gradzip: communication-efficient distributed data-parallel training for PyTorch.

``gradzip.compressors.build("topk:ratio=0.01")``, ``gradzip.optim.EFSGD(...)``,
``gradzip.simulate(n, fn)``; see docs/architecture.md for the architecture and
docs/algorithms.md for the algorithms.
"""
from .version import __version__
from . import comm, compressors, exchange, optim
from .comm import simulate
from .errors import GradzipError
from .nonfinite import NonFiniteGradient
from .exchange import PSync
from .compressors import PerTensor
from .replicas import broadcast_parameters
from .landscape import sharpness
from .evaluation import evaluation_model

__all__ = ["comm", "compressors", "exchange", "optim", "simulate", "PSync", "PerTensor", "GradzipError", "NonFiniteGradient",
           "broadcast_parameters", "evaluation_model", "sharpness", "__version__"]
