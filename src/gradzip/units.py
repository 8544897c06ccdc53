"""Link rates as users write them: ``"100mbit"`` -> bits/s and back. A foundation: the
exchange planner's link model (``link="10gbit"``) and the benchmarks' flags share it."""
from __future__ import annotations

import re

from .errors import GradzipError

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


def format_rate(bps: float | None) -> str:
    """Bits per second as ``"1 Gbit/s"``, ``"100 Mbit/s"``; None as ``"unshaped"``."""
    if bps is None:
        return "unshaped"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"
