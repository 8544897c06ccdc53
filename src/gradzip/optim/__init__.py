"""The methods, one module each; each ``step()`` is its algorithm box (spec, "Methods")."""
from .base import COMMON_OPTIONS, DistributedOptimizer, method_options
from .bitsgd import BitSGD
from .efsgd import EFSGD
from .ssgd import SSGD

#: CLI name -> method class (``gradzip train --algo NAME``).
METHODS = {"ssgd": SSGD, "efsgd": EFSGD, "bitsgd": BitSGD}

__all__ = ["DistributedOptimizer", "method_options", "COMMON_OPTIONS", "SSGD", "EFSGD", "BitSGD", "METHODS"]
