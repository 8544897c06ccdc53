"""Spec strings, ``name[:key=value[,key=value...]]``: the one parser behind codecs
(``"topk:ratio=0.01"``), datasets (``"synthetic:n=4096"``) and models (``"mlp:hidden=512"``),
and the one table of the words that spell a bool.

The parser only splits; each registry checks the name and the keys against what it knows
and words its own errors (it knows what is valid).
"""
from __future__ import annotations

from dataclasses import dataclass

#: Words accepted for a bool (case-insensitive) in spec strings and on the command line.
BOOLS = {"1": True, "true": True, "yes": True, "on": True,
         "0": False, "false": False, "no": False, "off": False}


def parse_bool(raw: str) -> bool:
    """``raw`` as a bool by :data:`BOOLS`; ``ValueError`` for any other word."""
    try:
        return BOOLS[raw.strip().lower()]
    except KeyError:
        raise ValueError(raw) from None


@dataclass(frozen=True)
class Option:
    """One ``key=value`` item of a spec, each part stripped; ``has_value`` is false when the
    item has no ``=`` (an error for every registry, worded by it)."""

    item: str
    key: str
    value: str
    has_value: bool


def is_name(name: object) -> bool:
    """Whether ``name`` can be registered: a non-empty lower-case string, stripped, without
    ``:`` or ``,`` (what :func:`split` gives back for it)."""
    return (isinstance(name, str) and bool(name) and name == name.strip().lower()
            and ":" not in name and "," not in name)


def split(spec: str) -> tuple[str, str, list[Option]]:
    """``(name, options_text, options)`` of a spec string: ``name`` stripped and
    lower-cased, the text after the first ``:`` as given, and its non-empty
    comma-separated items in order."""
    name, _, rest = spec.strip().partition(":")
    options = []
    for item in (p.strip() for p in rest.split(",")):
        if item:
            key, eq, value = item.partition("=")
            options.append(Option(item, key.strip(), value.strip(), bool(eq)))
    return name.strip().lower(), rest, options
