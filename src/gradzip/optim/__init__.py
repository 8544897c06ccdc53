"""The methods, one module each; each ``step()`` is its algorithm box (docs/algorithms.md, "Methods")."""
from .core.base import DistributedOptimizer
from .core.options import COMMON_OPTIONS, method_options
from .asgd import ASGD
from .bitsgd import BitSGD
from .cdsgd import CDSGD, CPSGD, ODSGD
from .csea import CSEA
from .dgc import DGC
from .diloco import DiLoCo, DiLoCoMethod
from .sparseloco import SparseLoCo, SparseLoCoMethod
from .demo import DeMo
from .cser import CSER, CSERPL
from .efsgd import EFSGD
from .localsgd import LocalSGD
from .onebit_adam import OneBitAdam
from .onebit_lamb import OneBitLAMB
from .zeroone_adam import ZeroOneAdam
from .powersgd import PowerSGD
from .qsparse import QSparseLocalSGD
from .ssgd import SSGD
from .lars import LARS
from .lamb import LAMB
from .compressed import AdamWMethod, Compressed, LAMBMethod, LARSMethod
from .sam import SAM
from .core.schedule import LinearScalingWarmup, Schedule, lr_at, parse_schedule, scaled_lr, schedule_factor

#: CLI name -> method class (``gradzip train --algo NAME``).
METHODS = {"ssgd": SSGD, "efsgd": EFSGD, "bitsgd": BitSGD,
           "localsgd": LocalSGD, "qsparse": QSparseLocalSGD, "csea": CSEA, "cser": CSER, "cserpl": CSERPL,
           "dgc": DGC, "powersgd": PowerSGD,
           "odsgd": ODSGD, "cdsgd": CDSGD, "cpsgd": CPSGD, "asgd": ASGD,
           "onebitadam": OneBitAdam, "zerooneadam": ZeroOneAdam, "onebitlamb": OneBitLAMB,
           "diloco": DiLoCoMethod, "sparseloco": SparseLoCoMethod, "demo": DeMo,
           "lars": LARSMethod, "lamb": LAMBMethod, "adamw": AdamWMethod}

__all__ = ["DistributedOptimizer", "method_options", "COMMON_OPTIONS", "SSGD", "EFSGD", "BitSGD",
           "LocalSGD", "QSparseLocalSGD", "CSEA", "CSER", "CSERPL", "DGC", "PowerSGD",
           "ODSGD", "CDSGD", "CPSGD", "METHODS",
           "Compressed", "LARS", "LAMB", "SAM", "LARSMethod", "LAMBMethod", "AdamWMethod",
           "LinearScalingWarmup", "lr_at", "scaled_lr", "Schedule", "parse_schedule", "schedule_factor", "DiLoCo", "DiLoCoMethod", "SparseLoCo", "SparseLoCoMethod", "DeMo", "ASGD",
           "OneBitAdam", "ZeroOneAdam", "OneBitLAMB"]
