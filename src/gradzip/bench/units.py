"""Rates and lists as the benchmarks take and show them: ``"100mbit"`` -> bits/s and
back, comma-separated integers and numbers for the ``gradzip bench`` flags."""
from __future__ import annotations

from ..errors import GradzipError
from ..units import format_rate, parse_rate

__all__ = ["format_rate", "parse_ints", "parse_non_negatives", "parse_rate", "parse_rates"]


def parse_rates(text: str) -> list[float | None]:
    """A comma-separated list of :func:`parse_rate` rates."""
    return [parse_rate(b) for b in text.split(",") if b.strip()]


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
