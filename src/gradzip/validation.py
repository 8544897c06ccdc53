"""Checks of user-given values, shared by every layer: one definition of "an integer",
"a real number" and of the error a failed check raises.

A bool is never a number here (``True`` is not a worker count or a learning rate), and
NaN is not a real number (it passes no range check a user means).

A keyword argument a constructor does not take is refused the same way everywhere, naming
it and the closest valid name (:func:`refuse_unknown_options`); :func:`refuses_unknown_options`
does it for a constructor whose options are all in its signature, in place of Python's
``TypeError``.
"""
from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable, Iterable

from .errors import GradzipError


def is_int(value: Any, kinds: Any = int) -> bool:
    """``value`` is an integer (an instance of ``kinds``, by default Python ``int``) and
    not a bool."""
    return isinstance(value, kinds) and not isinstance(value, bool)


def is_real(value: Any, kinds: Any = (int, float)) -> bool:
    """``value`` is a real number (an instance of ``kinds``), not a bool and not NaN."""
    return isinstance(value, kinds) and not isinstance(value, bool) and value == value


def require(ok: bool, where: str | None, message: str) -> None:
    """Raise :class:`GradzipError` ``"<where>: <message>"`` (just ``message`` when ``where``
    is empty) unless ``ok``. ``where`` names what was being configured (a method, a codec)."""
    if not ok:
        raise GradzipError(f"{where}: {message}" if where else message)


def refuse_unknown_options(where: str, unknown: Iterable[str], valid: Iterable[str]) -> None:
    """Raise :class:`GradzipError` naming every name of ``unknown`` (nothing when it is
    empty) and, where one of ``valid`` is close, that one:
    ``"EFSGD: unknown option 'compresor' (did you mean 'compressor'?)"``; the valid names
    follow when some unknown name has no close match."""
    unknown, valid = list(unknown), list(dict.fromkeys(valid))
    if not unknown:
        return
    named, unmatched = [], False
    for name in unknown:
        close = _closest(name, valid)
        named.append(f"{name!r} (did you mean {close!r}?)" if close else repr(name))
        unmatched = unmatched or not close
    known = f"; valid options: {', '.join(valid)}" if unmatched else ""
    raise GradzipError(f"{where}: unknown option{'s' * (len(unknown) > 1)} {', '.join(named)}{known}")


def _closest(name: str, valid: list[str]) -> str | None:
    """The valid name most like ``name`` (``difflib``'s ratio, ignoring case: ``h`` means
    ``H``; the first in ``valid`` among equals), or None when none is half alike."""
    scores = [(difflib.SequenceMatcher(None, name.lower(), v.lower()).ratio(), -i, v) for i, v in enumerate(valid)]
    score, _, best = max(scores, default=(0.0, 0, None))
    return best if score >= 0.5 else None


def constructor_options(cls: type, stop: type | None = None) -> list[str]:
    """The keyword arguments ``cls(...)`` takes, in signature order: those its ``__init__``
    names and, while an ``__init__`` passes ``**kwargs`` on, those of the next ``__init__``
    in the MRO, up to ``stop``'s (whose ``**kwargs`` ends the chain)."""
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters.values()
        names += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                  and p.name != "self" and p.name not in names]
        if klass is stop or not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names


def refuses_unknown_options(init: Callable) -> Callable:
    """Decorates a constructor whose options are all in its signature: a keyword argument it
    does not name is refused by :func:`refuse_unknown_options` (the closest of
    :func:`constructor_options` of the class being built), not by Python's ``TypeError``."""
    own = {p.name for p in inspect.signature(init).parameters.values()
           if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        unknown = [k for k in kwargs if k not in own]
        if unknown:
            refuse_unknown_options(type(self).__name__, unknown, constructor_options(type(self)))
        return init(self, *args, **kwargs)
    return checked
