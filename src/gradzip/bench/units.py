"""Rates and lists as the benchmarks take and show them: ``"100mbit"`` -> bits/s and
back, comma-separated integers and numbers for the ``gradzip bench`` flags."""
from __future__ import annotations

import re

from ..errors import GradzipError

_RATE = re.compile(r"^\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)(?:bit|b|bps)?(?:/s)?\s*$", re.I)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float | None:
    """``"100mbit"``, ``"1gbit"``, ``"10g"``, ``"2.5e9"`` -> bits per second; ``"unshaped"`` -> None."""
    if text.strip().lower() in ("unshaped", "none", "inf"):
        return None
    m = _RATE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise GradzipError(f"bad bandwidth {text!r}: give a positive rate such as 100mbit, 1gbit, "
                           "10gbit (bits per second), or 'unshaped'")
    return float(m.group(1)) * _SCALE[m.group(2).lower()]


def parse_rates(text: str) -> list[float | None]:
    """A comma-separated list of :func:`parse_rate` rates."""
    return [parse_rate(b) for b in text.split(",") if b.strip()]


def format_rate(bps: float | None) -> str:
    """Bits per second as ``"1 Gbit/s"``, ``"100 Mbit/s"``; None as ``"unshaped"``."""
    if bps is None:
        return "unshaped"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def parse_ints(text: str, what: str, low: int) -> list[int]:
    """``"2,4"`` -> [2, 4]; every value >= ``low``, else an error naming the flag ``what``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < low:
        raise GradzipError(f"{what} must be comma-separated integers >= {low}, got {text!r}")
    return values


def parse_non_negatives(text: str, what: str) -> list[float]:
    """``"0,2.5"`` -> [0.0, 2.5]; every value a number >= 0, else an error naming ``what``."""
    values = []
    for v in text.split(","):
        try:
            value = float(v)
        except ValueError:
            value = -1.0
        if not value >= 0:
            raise GradzipError(f"{what} must be comma-separated numbers >= 0, got {text!r}")
        values.append(value)
    return values
