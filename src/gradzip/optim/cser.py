"""CSER and CSER-PL: error reset with partial synchronisation (Xie et al., NeurIPS 2020).

Also the rule that turns a target overall compression ratio ``rc`` into codecs and a
period for the CSER family (used by CSER, CSER-PL, CSEA and QSparse-local-SGD), following
the paper's grids restated in the spec ("Methods: CSER").

**Codec for a per-codec ratio R** (:func:`codec_for_ratio`): ``"none"`` at R = 1, else
``randblock:in=R`` (R rounded to an integer): the random-block sparsifier of the
reference code, the same block on every worker (so every exchange is an allreduce of a
dense sub-block). **[choice]** With only ``in=R``, dim 0 is cut into R aligned blocks of
``ceil(d0/R)`` rows and one of them is sent, so *every* tensor sends exactly ``1/R`` of
itself in expectation, whatever its size: a bias of 6 entries at R = 1024 sends one
entry with probability 6/1024. The ``ratio=`` form cannot do that (``k = max(1,
ceil(d/R))`` sends at least one entry of every tensor every time, which on a LeNet at
R = 2048 sends ~1.4x too much); and ``in=a,out=b`` would send ``1/a`` of a 1-d tensor, not
``1/(a·b)``. The price is randomness in the bytes: the measured R_C matches the target
in expectation, over many exchanges.

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

import torch

from ..compressors import Compressor
from .base import DistributedOptimizer, check
from .localsgd import check_period

#: The rc used for options left at "auto" when no rc is given.
DEFAULT_RC = 16.0

#: Largest rc: the codecs derived from it (``randblock:in=round(2·rc)`` at most) stay within
#: randblock's limit of 2**31 blocks.
MAX_RC = 2**30

#: The paper's ImageNet grid, spec naming: R_C -> (R_C2, R_C1, H).
CSER_GRID = {32: (64, 4, 16), 256: (512, 16, 32), 1024: (2048, 8, 256)}


def check_rc(method: str, rc) -> float | None:
    if rc is None:
        return None
    ok = isinstance(rc, (int, float)) and not isinstance(rc, bool) and 1 <= rc <= MAX_RC  # NaN fails
    check(ok, method, f"rc (target overall compression ratio, dense bytes / sent bytes) must be a "
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
    if not _is_auto(compressor):
        check(rc is None, method, f"give either rc (codec derived from it) or compressor, not both; "
                                  f"got rc={rc} and compressor={compressor!r}")
        return compressor, rc
    return (default if rc is None else codec_for_ratio(rc)), rc


def _pow2(x: float, rounding) -> int:
    return 2 ** int(rounding(math.log2(x))) if x > 1 else 1


def derive_periodic(method: str, rc: float, H: int | None) -> tuple[str, int]:
    """(C1 codec, H) with ``H·R_C1 = rc``: CSER-PL and QSparse-local-SGD."""
    if H is None:
        H = min(_pow2(math.sqrt(rc), round), max(1, int(rc)))
    check(H <= rc, method, f"with rc={rc:g}, H must be <= rc (R_C = H·R_C1 and R_C1 >= 1), got H={H}")
    return codec_for_ratio(rc / H), H


def derive_cser(method: str, rc: float, H: int | None) -> tuple[str, str, int]:
    """(C1 codec, C2 codec, H) with ``R_C2 = 2·rc``, ``H·R_C1 = R_C2``: CSER."""
    rc2 = 2.0 * rc
    if H is None:
        grid = CSER_GRID.get(rc) if float(rc).is_integer() else None
        H = grid[2] if grid else _pow2(math.sqrt(rc2), math.ceil)
    check(H <= rc2, method, f"with rc={rc:g}, H must be <= 2·rc (R_C2 = 2·rc = H·R_C1, R_C1 >= 1), got H={H}")
    return codec_for_ratio(rc2 / H), codec_for_ratio(rc2), H


def _is_auto(value) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _is_zero(value) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in ("zero", "0"))


class CSER(DistributedOptimizer):
    """CSER (CSER slides Alg. 6; spec "Methods: CSER"): error reset plus gradient partial
    synchronisation. ``c2`` is the gradient codec (every step), ``c1`` the error codec
    (every ``H`` steps)::

        (g'_i, r_i) = PSync(d_i; C2)            # g'_i = mean_j C2(d_j) + r_i
        x_i ← x_i − η g'_i;   e_i ← e_i − η r_i
        if t mod H == 0:                        # error reset: model partial sync
            (e', e_new) = PSync(e_i; C1)        # e' = mean_j C1(e_j) + e_new
            x_i ← x_i − e_i + e';   e_i ← e_new

    ``d_i`` carries weight decay and local momentum (plain or Nesterov), never
    synchronised. ``x_i − e_i`` is the same on every worker; the models themselves differ
    (``replicas_differ``), so the harness evaluates their average. ``state[p]["error"]``
    holds ``e_i`` (zero at the start).

    ``c2=None`` (or the string ``"zero"``, for the command line) means C2 ≡ 0, no gradient
    exchange: ``g' = d``, ``r = d``, which is CSER-PL (:class:`CSERPL`); with ``H = 1`` as
    well it is CSEA. It does not mean "uncompressed" (that is ``c2="none"``).

    ``rc``: a target overall ratio ``1/R_C = 1/R_C2 + 1/(H·R_C1)`` from which the codecs
    (and H, unless given) are derived (module docstring); it cannot be combined with
    explicit ``c1``/``c2`` codecs, except ``c2=None``. Options left at ``"auto"`` without
    ``rc`` take the rc = 16 setting (C2 = ``randblock:in=32``, C1 = ``randblock:in=4``,
    H = 8).
    """

    replicas_differ = True

    def __init__(self, params, lr, *, c1: str | Compressor = "auto", c2: str | Compressor | None = "auto",
                 H: int | None = None, rc: float | None = None, **kwargs):
        name = type(self).__name__
        rc = check_rc(name, rc)
        if H is not None:
            check_period(name, H)
        zero = _is_zero(c2)
        explicit = [k for k, v in (("c1", c1), ("c2", c2)) if not _is_auto(v) and not (k == "c2" and zero)]
        if rc is not None and explicit:
            check(False, name, f"give either rc (codecs derived from it) or explicit codecs, not both; "
                               f"got rc={rc:g} and {', '.join(explicit)}")
        target = DEFAULT_RC if rc is None else rc
        if zero:
            d1, H_auto = derive_periodic(name, target, H)
            d2 = None
        else:
            d1, d2, H_auto = derive_cser(name, target, H)
        super().__init__(params, lr, **kwargs)
        self.H = H if H is not None else H_auto
        self.rc = rc
        # salt 0 for C1, so that CSER(c2=None, H=1) draws the same random blocks as CSEA
        self.psync1 = self.make_psync(d1 if _is_auto(c1) else c1, salt=0)
        self.psync2 = None if zero else self.make_psync(d2 if _is_auto(c2) else c2, salt=1)

    def _error(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "error" not in state:
            self.replaced(state, "error")
            state["error"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["error"]

    @torch.no_grad()
    def step(self, closure=None):
        loss, pairs, params = self.begin_step(closure)
        keys = self.keys(params)
        directions = [self.local_direction(p, group) for group, p in pairs]
        errors = [self._error(p) for p in params]
        if self.psync2 is None:                                  # C2 ≡ 0: g' = d, r = d
            self.irreversible()
            for (group, p), d, e in zip(pairs, directions, errors):
                p.sub_(d, alpha=group["lr"])
                e.sub_(d, alpha=group["lr"])
        else:                                                    # gradient partial sync
            res = self.psync2(directions, self.steps, keys=keys)
            self.irreversible()                                  # model and error change before C1
            for (group, p), agg, r, e in zip(pairs, res.aggregate, res.residual, errors):
                p.sub_(agg.add(r), alpha=group["lr"])           # x ← x − η g'
                e.sub_(r, alpha=group["lr"])                    # e ← e − η r
        if self.steps % self.H == 0:                             # error reset
            res = self.psync1(errors, self.steps, keys=keys)
            for p, e, agg, r in zip(params, errors, res.aggregate, res.residual):
                p.sub_(e).add_(agg).add_(r)                      # x ← x − e + e'
                e.copy_(r)                                       # e ← e_new
        return loss

    def metrics(self) -> dict[str, float]:
        return {"H": self.H}


class CSERPL(CSER):
    """CSER-PL, partial local SGD (CSER slides; spec "Methods: CSER", C2 = 0)::

        x_i ← x_i − η d_i;   e_i ← e_i − η d_i
        if t mod H == 0:  (e', e_new) = PSync(e_i; C1);  x_i ← x_i − e_i + e';  e_i ← e_new

    Exactly ``CSER(c2=None)``. ``rc`` derives C1 and H with ``R_C = H·R_C1`` (see
    :mod:`gradzip.optim.cser`); without it, ``"auto"`` options take the rc = 16 setting
    (H = 4, C1 = ``randblock:in=4``). With H = 1 it is CSEA.
    """

    def __init__(self, params, lr, *, c1: str | Compressor = "auto", H: int | None = None,
                 rc: float | None = None, **kwargs):
        super().__init__(params, lr, c1=c1, c2=None, H=H, rc=rc, **kwargs)
