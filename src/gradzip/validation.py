"""Checks of user-given values, shared by every layer: one definition of "an integer",
"a real number" and of the error a failed check raises.

A bool is never a number here (``True`` is not a worker count or a learning rate), and
NaN is not a real number (it passes no range check a user means).
"""
from __future__ import annotations

from typing import Any

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
