"""Spec strings -> codecs: ``build("topk:ratio=0.01")``. A registry, no if/elif chain.

Grammar: ``name[:param=value[,param=value...]]``. Parameters are the codec dataclass's
fields; values are converted to the field's type (``int``, ``float``, ``bool``) and then
validated by the codec. A key that is a Python keyword names the field with a trailing
underscore (``randblock:in=4`` sets ``in_``), and :attr:`Compressor.spec` prints it back
as ``in``. Every failure raises :class:`GradzipError` listing what is valid.
"""
from __future__ import annotations

import dataclasses
import keyword
import typing
from typing import Callable, TypeVar

from .. import specs
from ..errors import GradzipError
from .base import Compressor, spec_key

_REGISTRY: dict[str, type[Compressor]] = {}
C = TypeVar("C", bound=type[Compressor])


def register(cls: C) -> C:
    """Class decorator: make ``cls`` buildable by its ``name``."""
    if cls.name in _REGISTRY:
        raise RuntimeError(f"compressor name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    """Registered codec names, in registration order."""
    return list(_REGISTRY)


def _convert(kind: type, raw: str, where: str):
    converters: dict[type, Callable[[str], object]] = {
        int: int,
        float: float,
        str: str,
        bool: specs.parse_bool,
    }
    try:
        return converters[kind](raw)
    except (ValueError, KeyError):
        raise GradzipError(f"{where}: {raw!r} is not a valid {kind.__name__}") from None


def _field_types(cls: type[Compressor]) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        out[f.name] = args[0] if args else kind  # Optional[int] -> int
    return out


#: ``prefix`` -> a class built from the rest of the spec (``auto:topk:ratio=0.01``): a policy
#: over a whole codec spec, whose own ``:`` and ``,`` belong to the codec (:func:`register_wrapper`).
_WRAPPERS: dict[str, Callable[[str], Compressor]] = {}


def register_wrapper(prefix: str) -> Callable[[C], C]:
    """Class decorator: ``build(f"{prefix}:<codec spec>")`` is ``cls(<codec spec>)``."""
    def add(cls: C) -> C:
        _WRAPPERS[prefix] = cls
        return cls
    return add


def build(spec: "str | Compressor | None") -> Compressor:
    """Build a codec from a spec string (``"2bit:threshold=0.05"``); a codec passes through;
    ``None`` means ``"none"`` (no compression); ``"auto:<codec spec>"`` is a wrapper's
    (:func:`register_wrapper`)."""
    if isinstance(spec, Compressor):
        return spec
    if spec is None:
        spec = "none"
    if not isinstance(spec, str):
        raise GradzipError(f"a compressor is a spec string or a Compressor, not {type(spec).__name__}")
    prefix, colon, rest = spec.strip().partition(":")
    if colon and prefix.strip().lower() in _WRAPPERS:
        return _WRAPPERS[prefix.strip().lower()](rest)
    name, _, options = specs.split(spec)
    if name not in _REGISTRY:
        raise GradzipError(
            f"unknown compressor {name!r} in {spec!r}; valid names: {', '.join(names())}"
            + "".join(f", or {prefix}:<codec spec>" for prefix in _WRAPPERS)
        )
    cls = _REGISTRY[name]
    types = _field_types(cls)
    kwargs = {}
    for opt in options:
        key = opt.key
        if keyword.iskeyword(key) and key + "_" in types:
            key += "_"
        valid = ", ".join(f"{spec_key(k)} ({t.__name__})" for k, t in types.items()) or "none"
        if not opt.has_value or not opt.value:
            raise GradzipError(f"compressor {name!r}: expected param=value, got {opt.item!r}; parameters: {valid}")
        if key not in types:
            raise GradzipError(f"compressor {name!r} has no parameter {key!r}; parameters: {valid}")
        if key in kwargs:
            raise GradzipError(f"compressor {name!r}: parameter {spec_key(key)!r} given twice in {spec!r}")
        kwargs[key] = _convert(types[key], opt.value, f"compressor {name!r} parameter {spec_key(key)!r}")
    try:
        return cls(**kwargs)
    except TypeError as exc:  # e.g. a required parameter is missing
        raise GradzipError(f"compressor {name!r}: {exc}") from None
