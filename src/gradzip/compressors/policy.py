"""A codec per tensor: :class:`PerTensor` (as hivemind's size- and role-adaptive compression).

Small tensors (biases, norms) cost a collective's latency, not its bandwidth, and a sparse or
quantised bias hurts accuracy for nothing saved; embeddings may want another codec than
convolutions. A ``PerTensor`` policy goes wherever a codec goes (``compressor=`` of every
method that takes one, ``c1`` / ``c2`` of CSER, the DDP hook's codec): PSync, which
compresses per tensor already, asks it for each tensor's codec by the tensor's parameter
name and shape, once per tensor (docs/algorithms.md §PSync: compression per tensor).

The choice for a tensor ``(name, t)``, first that applies:

1. ``rules``: the codec of the first ``(pattern, codec)`` whose shell-style pattern
   (:mod:`fnmatch`, e.g. ``"*.bias"``, ``"embed.*"``) matches the parameter's name;
2. ``skip_1d`` and ``t.dim() <= 1``, or ``t.numel() < min_numel``: ``"none"`` (sent as it is);
3. ``default``.

Names come from the optimizer's parameter names (``Method(model.named_parameters(), ...)``,
torch's named param groups) or from the DDP hook state's model (``model=``). A policy with
name rules refuses tensors whose name it was not given.
"""
from __future__ import annotations

import fnmatch
from typing import Iterable, Mapping, Sequence

import torch

from ..errors import GradzipError
from .base import Compressor, Packet
from .registry import build


class PerTensor(Compressor):
    """``PerTensor(default, rules=(), *, min_numel=0, skip_1d=False)``: a codec per tensor
    (module docstring). ``default`` and the rules' codecs are spec strings or codecs;
    ``rules``: a mapping or a sequence of ``(pattern, codec)``, tried in order.

    It is not a codec itself: :meth:`resolve` gives the codec of a tensor, and its codec
    methods (``compress``, ...) refuse to run. ``unbiased``: every codec it can pick is
    (the DDP hook then leaves error feedback off by default)."""

    name = "per_tensor"

    def __init__(self, default: "str | Compressor" = "none",
                 rules: "Mapping[str, str | Compressor] | Sequence[tuple[str, str | Compressor]]" = (),
                 *, min_numel: int = 0, skip_1d: bool = False):
        pairs = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
                raise GradzipError(f"PerTensor: rule #{i} is {pair!r}, not a (name pattern, codec) pair; "
                                   "write rules={'*.bias': 'none', 'embed.*': 'qsgd'}")
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise GradzipError(f"PerTensor: min_numel must be an integer >= 0, got {min_numel!r}")
        if not isinstance(skip_1d, bool):
            raise GradzipError(f"PerTensor: skip_1d must be True or False, got {skip_1d!r}")
        self.default = _codec(default, "default")
        if isinstance(self.default, PerTensor):
            raise GradzipError("PerTensor: default must be a codec, not another PerTensor policy")
        self.rules = [(pattern, _codec(codec, f"rule {pattern!r}")) for pattern, codec in pairs]
        self.min_numel = min_numel
        self.skip_1d = skip_1d
        self.dense = build("none")
        small = [self.dense] if min_numel or skip_1d else []
        self.unbiased = all(c.unbiased or c.name == "none" for c in [self.default, *small]
                            + [c for _, c in self.rules])

    def resolve(self, name: str | None, tensor: torch.Tensor) -> Compressor:
        """The codec of the tensor of parameter ``name`` (None: not known)."""
        if self.rules:
            if name is None:
                raise GradzipError(
                    "PerTensor: its rules match parameter names, but this tensor has none: pass "
                    "model.named_parameters() to the optimizer (or model= to the DDP hook state)")
            for pattern, codec in self.rules:
                if fnmatch.fnmatchcase(name, pattern):
                    return codec
        if (self.skip_1d and tensor.dim() <= 1) or tensor.numel() < self.min_numel:
            return self.dense
        return self.default

    def plan(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
        """``{name: codec spec}`` for named tensors: what the policy will do (to print)."""
        return {n: self.resolve(n, t).spec for n, t in named}

    @property
    def spec(self) -> str:
        """A description of the policy (every worker must hold the same one)."""
        parts = [f"default={self.default.spec}"]
        parts += [f"{pattern}->{codec.spec}" for pattern, codec in self.rules]
        if self.min_numel:
            parts.append(f"min_numel={self.min_numel}")
        if self.skip_1d:
            parts.append("skip_1d")
        return f"per_tensor({'; '.join(parts)})"

    def __repr__(self) -> str:
        return self.spec

    def _refuse(self, *args, **kwargs) -> Packet:
        raise GradzipError(f"{self.spec} picks a codec per tensor and is not one itself: use it as a method's "
                           "compressor or the DDP hook's codec, or call .resolve(name, tensor).compress(...)")

    compress = decompress = compress_residual = aggregate = summand = from_sum = _refuse


def _codec(codec: "str | Compressor", what: str) -> Compressor:
    try:
        return build(codec)
    except GradzipError as error:
        raise GradzipError(f"PerTensor {what}: {error}") from None
