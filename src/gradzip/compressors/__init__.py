"""Gradient codecs (docs/algorithms.md, "Codecs"). ``build("topk:ratio=0.01")``, ``names()``.

Adding a codec: one module with a ``@register``-ed :class:`Compressor` subclass, and one
import line below.
"""
from .base import Compressor, Packet, Slices, keep_count
from .registry import build, names, register

from . import identity, threshold2bit, onebit, sign, scaled_sign, qsgd, terngrad, int8, sparsify, randomk, dgc, powersgd, topk2bit, dct  # noqa: E402,F401,E501  (registration)
from .policy import Auto, PerTensor  # noqa: E402  (policies: gradzip.PerTensor, auto:<codec>)

__all__ = ["Auto", "Compressor", "Packet", "Slices", "build", "names", "register", "keep_count", "PerTensor"]
