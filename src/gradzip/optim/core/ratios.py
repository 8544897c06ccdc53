"""Compression ratios of the CSER family: from a target overall ratio ``rc`` to codecs and
a period (CSER, CSER-PL, CSEA, EF-SGD and QSparse-local-SGD use it); and the check of a
synchronisation period H (:func:`check_period`: local SGD, QSparse, CSER).

The rule follows the paper's grids (docs/algorithms.md §rc: codecs and H from a target ratio).

**Codec for a per-codec ratio R** (:func:`codec_for_ratio`): ``"none"`` at R = 1, else
``randblock:in=R`` (R rounded to an integer): the random-block sparsifier of the
reference code, the same block on every worker (so every exchange is an allreduce of a
dense sub-block). **[choice]** Why ``in=R`` (every tensor sends ``1/R`` of itself in
expectation) and not ``ratio=`` or ``in=a,out=b``: docs/algorithms.md §rc: codecs and H
from a target ratio.

**Ratios and period from rc** (``rc`` = target R_C, H optional):

* CSER: ``R_C2 = 2·rc`` (gradient codec, every step) and ``R_C1 = R_C2 / H`` (error
  codec, every H steps), so ``1/R_C = 1/R_C2 + 1/(H·R_C1) = 1/rc``. H: the paper's
  ImageNet grid where it has the value (rc = 32: H = 16; rc = 256: H = 32; rc = 1024:
  H = 256), else ``2**ceil(log2(sqrt(R_C2)))`` (which gives the grid's 32 at rc = 256).
* CSER-PL (CSER with ``c2=None``) and QSparse-local-SGD: ``R_C = H·R_C1``; H:
  ``2**round(log2(sqrt(rc)))`` (rc = 16: 4, 256: 16, 1024: 32), ``R_C1 = rc / H``.
* CSEA (and EF-SGD): ``R_C1 = rc``.

Without ``rc``, every option left at ``"auto"`` / ``None`` takes the rc = 16 setting.
"""
from __future__ import annotations

import math

from ...validation import is_int, is_real, require

#: The rc used for options left at "auto" when no rc is given.
DEFAULT_RC = 16.0

#: Largest rc: the codecs derived from it (``randblock:in=round(2·rc)`` at most) stay within
#: randblock's limit of 2**31 blocks.
MAX_RC = 2**30

#: The paper's ImageNet grid, in docs/algorithms.md's naming (C2 = gradient codec): R_C -> (R_C2, R_C1, H).
CSER_GRID = {32: (64, 4, 16), 256: (512, 16, 32), 1024: (2048, 8, 256)}


def check_period(method: str, H) -> int:
    """``H`` must be an integer >= 1 (steps H, 2H, ... synchronise)."""
    require(is_int(H) and H >= 1, method,
            f"H (the synchronisation period, in steps) must be an integer >= 1, got {H!r}")
    return H


def check_rc(method: str, rc) -> float | None:
    """``rc`` as a float (``None`` stays ``None``), or :class:`GradzipError` naming ``method``
    unless it is a number in ``[1, 2**30]``."""
    if rc is None:
        return None
    ok = is_real(rc) and 1 <= rc <= MAX_RC  # NaN fails
    require(ok, method, f"rc (target overall compression ratio, dense bytes / sent bytes) must be a "
                        f"number >= 1 and <= 2**30, got {rc!r}")
    return float(rc)


def codec_for_ratio(R: float) -> str:
    """The codec sending ``1/R`` of every tensor in expectation (see the module docstring)."""
    blocks = max(1, round(R))
    return "none" if blocks == 1 else f"randblock:in={blocks}"


def single_codec(method: str, compressor, rc, default: str) -> tuple[object, float | None]:
    """The codec of a one-codec method and its validated ``rc``: ``compressor`` as given,
    or, left at ``"auto"``, the codec sending 1/rc of every tensor (``default`` without rc).
    Giving both an explicit codec and rc is an error."""
    rc = check_rc(method, rc)
    if not is_auto(compressor):
        require(rc is None, method, f"give either rc (codec derived from it) or compressor, not both; "
                                    f"got rc={rc} and compressor={compressor!r}")
        return compressor, rc
    return (default if rc is None else codec_for_ratio(rc)), rc


def _pow2(x: float, rounding) -> int:
    return 2 ** int(rounding(math.log2(x))) if x > 1 else 1


def derive_periodic(method: str, rc: float, H: int | None) -> tuple[str, int]:
    """(C1 codec, H) with ``H·R_C1 = rc``: CSER-PL and QSparse-local-SGD."""
    if H is None:
        H = min(_pow2(math.sqrt(rc), round), max(1, int(rc)))
    require(H <= rc, method, f"with rc={rc:g}, H must be <= rc (R_C = H·R_C1 and R_C1 >= 1), got H={H}")
    return codec_for_ratio(rc / H), H


def derive_cser(method: str, rc: float, H: int | None) -> tuple[str, str, int]:
    """(C1 codec, C2 codec, H) with ``R_C2 = 2·rc``, ``H·R_C1 = R_C2``: CSER."""
    rc2 = 2.0 * rc
    if H is None:
        grid = CSER_GRID.get(rc) if float(rc).is_integer() else None
        H = grid[2] if grid else _pow2(math.sqrt(rc2), math.ceil)
    require(H <= rc2, method, f"with rc={rc:g}, H must be <= 2·rc (R_C2 = 2·rc = H·R_C1, R_C1 >= 1), got H={H}")
    return codec_for_ratio(rc2 / H), codec_for_ratio(rc2), H


def is_auto(value) -> bool:
    """Whether an option was left at ``"auto"`` (to be derived from rc)."""
    return isinstance(value, str) and value.strip().lower() == "auto"
