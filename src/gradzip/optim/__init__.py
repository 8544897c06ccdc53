"""The methods, one module each; each ``step()`` is its algorithm box (spec, "Methods")."""
from .base import DistributedOptimizer
from .bitsgd import BitSGD
from .efsgd import EFSGD
from .ssgd import SSGD

#: CLI name -> method class (``gradzip train --algo NAME``).
METHODS = {"ssgd": SSGD, "efsgd": EFSGD, "bitsgd": BitSGD}

__all__ = ["DistributedOptimizer", "SSGD", "EFSGD", "BitSGD", "METHODS"]
