"""Policies that pick a codec where a codec goes: :class:`PerTensor`, a codec per tensor
by name and size (as hivemind's size- and role-adaptive compression), and :class:`Auto`,
``auto:<codec>``, the codec or uncompressed per unit of the exchange's plan by measured cost
(docs/algorithms.md §Auto codec choice). Neither is a codec itself.

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
from .registry import build, register_wrapper


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
        self.default = _codec(default, "PerTensor default")
        self.rules = [(pattern, _codec(codec, f"PerTensor rule {pattern!r}")) for pattern, codec in pairs]
        for codec in [self.default, *(c for _, c in self.rules)]:
            if isinstance(codec, (PerTensor, Auto)):
                raise GradzipError(f"PerTensor: {codec.spec} is a policy, not a codec; give codecs to a PerTensor "
                                   "policy (auto:<codec> decides per bucket of a whole exchange: use it alone)")
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


def _codec(codec: "str | Compressor", where: str) -> Compressor:
    """``build(codec)``, its error prefixed with ``where``."""
    try:
        return build(codec)
    except GradzipError as error:
        raise GradzipError(f"{where}: {error}") from None


@register_wrapper("auto")
class Auto(Compressor):
    """``auto:<codec>`` (``Auto("topk:ratio=0.01")``): per unit of an exchange's plan, ``codec``
    or uncompressed (``none``), whichever takes less time by the measured (or declared) costs
    (docs/algorithms.md §Auto codec choice; the rule is :func:`gradzip.exchange.planner.plan`'s, the
    measurement :mod:`gradzip.exchange.calibration`'s). It goes where a codec goes in a method that
    exchanges through PSync and in the DDP hook; the plan resolves it to ``codec`` or
    ``none`` per tensor (``Plan.codecs``), and its own codec methods refuse to run.

    The properties a method reads of its codec are ``codec``'s (``unbiased``, so error
    feedback is on for a biased codec; ``shared_randomness``; ``sum_dtype`` for the
    transports it allows), which stay right for the units sent uncompressed: ``none``'s
    residual is zero and its allreduce needs nothing the codec's does not."""

    name = "auto"

    def __init__(self, codec: "str | Compressor"):
        self.codec = _codec(codec, f"auto:{codec}")
        if isinstance(self.codec, (PerTensor, Auto)):
            raise GradzipError(f"auto:{self.codec.spec}: auto chooses between one codec and none per bucket; give it "
                               "a codec, e.g. auto:topk:ratio=0.01")
        if self.codec.name == "none":
            raise GradzipError("auto:none chooses between none and none; use compressor='none'")
        self.dense = build("none")
        self.unbiased = self.codec.unbiased
        self.shared_randomness = self.codec.shared_randomness
        self.propagates_nonfinite = self.codec.propagates_nonfinite and self.dense.propagates_nonfinite

    def sum_dtype(self, world_size: int, dtype: torch.dtype = torch.float32) -> torch.dtype | None:
        return self.codec.sum_dtype(world_size, dtype)

    @property
    def spec(self) -> str:
        return f"auto:{self.codec.spec}"

    def __repr__(self) -> str:
        return self.spec

    def __eq__(self, other) -> bool:
        return isinstance(other, Auto) and other.codec == self.codec

    def __hash__(self) -> int:
        return hash(self.spec)

    def _refuse(self, *args, **kwargs) -> Packet:
        raise GradzipError(f"{self.spec} picks {self.codec.spec} or none per bucket of an exchange and is not a codec "
                           "itself: use it as a method's compressor or the DDP hook's codec")

    compress = decompress = compress_residual = aggregate = summand = from_sum = wire_nbytes = _refuse
