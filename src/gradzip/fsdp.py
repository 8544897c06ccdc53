"""``gradzip.fsdp``: any gradzip codec inside PyTorch's FSDP2 and HSDP (the compressed
reduce-scatter, the compressed replica all-reduce, the quantized weight all-gather):
``handle = gradzip.fsdp.compress(model, compressor="1bit")`` after ``fully_shard``.
Implemented in :mod:`gradzip.integrations.fsdp`; docs/algorithms.md §Sharded exchange."""
from .integrations.fsdp import *  # noqa: F401,F403
from .integrations.fsdp import __all__  # noqa: F401
