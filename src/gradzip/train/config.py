"""How a run names its method: the ``--algos`` list, the ``algo@codec`` label, the one
"unknown method" check. Used by the CLI, the training loop and the benchmarks, so a
method list means the same everywhere. (:class:`gradzip.train.loop.RunConfig`, the
rest of a run's configuration, still lives beside the loop.)
"""
from __future__ import annotations

import re

from .. import optim
from ..errors import GradzipError

#: A comma starts a new method only when a bare word (a method name) follows it, so codec
#: specs may hold commas: ``efsgd@topk:ratio=0.01,unbiased=true,bitsgd``.
_METHOD_BOUNDARY = re.compile(r",(?=\s*[A-Za-z_]\w*\s*(?:@|,|$))")


def method_class(algo: str, where: str = "") -> type:
    """The class registered as ``algo`` in :data:`gradzip.optim.METHODS`; a
    :class:`GradzipError` listing the valid names otherwise (``where``: e.g. ``" in --algos"``)."""
    if algo not in optim.METHODS:
        raise GradzipError(f"unknown method {algo!r}{where}; valid methods: {', '.join(optim.METHODS)}")
    return optim.METHODS[algo]


def method_label(algo: str, codec: str | None = None) -> str:
    """The name a run is reported under: ``algo``, or ``algo@codec`` when a codec is given."""
    return f"{algo}@{codec}" if codec else algo


def parse_algos(text: str) -> list[tuple[str, str | None]]:
    """``"ssgd,efsgd@topk:ratio=0.01,unbiased=true,bitsgd"`` → [(algo, codec or None), ...];
    every method must be registered."""
    if not isinstance(text, str) or not text.strip():
        raise GradzipError("--algos is empty; give e.g. ssgd,efsgd@topk:ratio=0.01")
    out = []
    for item in (s.strip() for s in _METHOD_BOUNDARY.split(text)):
        if not item:
            continue
        algo, _, codec = item.partition("@")
        algo = algo.strip().lower()
        if not re.fullmatch(r"[a-z_]\w*", algo):  # '', 'ssgd,,' (stray commas), '@@', ...
            raise GradzipError(f"bad entry {item!r} in --algos: expected METHOD or METHOD@CODEC, comma-separated "
                               f"(e.g. ssgd,efsgd@topk:ratio=0.01); valid methods: {', '.join(optim.METHODS)}")
        method_class(algo, " in --algos")
        out.append((algo, codec.strip() or None))
    return out
