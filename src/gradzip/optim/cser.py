"""CSER and CSER-PL: error reset with partial synchronisation (Xie et al., NeurIPS 2020).

The codecs and period derived from a target ratio ``rc`` come from :mod:`.ratios`.
"""
from __future__ import annotations

import torch

from ..compressors import Compressor
from ..guards.nonfinite import NonFiniteAggregate
from ..validation import require
from .core.overlap import GradientExchange
from .core.ratios import DEFAULT_RC, check_period, check_rc, derive_cser, derive_periodic, is_auto


def _is_zero(value) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in ("zero", "0"))


class CSER(GradientExchange):
    """CSER (CSER slides Alg. 6; docs/algorithms.md §CSER): error reset plus gradient partial
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
    (and H, unless given) are derived (:mod:`.ratios`); it cannot be combined with
    explicit ``c1``/``c2`` codecs, except ``c2=None``. Options left at ``"auto"`` without
    ``rc`` take the rc = 16 setting (C2 = ``randblock:in=32``, C1 = ``randblock:in=4``,
    H = 8).

    The gradient exchange (C2) starts during backward (``overlap_backward``,
    :mod:`gradzip.optim.core.overlap`); the error reset runs in ``step()`` after it. Without a
    gradient exchange (``c2=None``, CSER-PL) ``step()`` does everything.
    """

    replicas_differ = True

    def __init__(self, params, lr, *, c1: str | Compressor = "auto", c2: str | Compressor | None = "auto",
                 H: int | None = None, rc: float | None = None, **kwargs):
        name = type(self).__name__
        rc = check_rc(name, rc)
        if H is not None:
            check_period(name, H)
        zero = _is_zero(c2)
        explicit = [k for k, v in (("c1", c1), ("c2", c2)) if not is_auto(v) and not (k == "c2" and zero)]
        if rc is not None and explicit:
            require(False, name, f"give either rc (codecs derived from it) or explicit codecs, not both; "
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
        self.psync1 = self.make_psync(d1 if is_auto(c1) else c1, salt=0)
        self.psync2 = None if zero else self.make_psync(d2 if is_auto(c2) else c2, salt=1)
        if zero:   # nothing to exchange before the error reset
            self.disable_overlap()

    def _error(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "error" not in state:
            self.replaced(state, "error")
            state["error"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["error"]

    # -- the gradient exchange per tensor, for overlap_backward (same operations as step()) --
    @property
    def psync(self):
        return self.psync2

    def exchange_input(self, group, p):
        return self.local_direction(p, group)

    def apply_exchange(self, pairs, aggregates, residuals):
        self.irreversible()                                          # model and error change before C1
        for (group, p), agg, r in zip(pairs, aggregates, residuals):
            p.sub_(agg.add(r), alpha=group["lr"])                   # x ← x − η g'
            self._error(p).sub_(r, alpha=group["lr"])               # e ← e − η r

    def finish_exchange(self, pairs):
        if self.steps % self.H == 0:                                 # error reset
            self._reset_errors([p for _, p in pairs])

    def _reset_errors(self, params) -> None:
        errors = [self._error(p) for p in params]
        res = self.psync1(errors, self.steps, keys=self.keys(params))
        for p, e, agg, r in zip(params, errors, res.aggregate, res.residual):
            p.sub_(e).add_(agg).add_(r)                              # x ← x − e + e'
            e.copy_(r)                                               # e ← e_new

    def exchanges_at(self, step: int) -> bool:
        """Every step with a gradient codec; without one (CSER-PL) every H steps."""
        return self.psync2 is not None or step % self.H == 0

    @torch.no_grad()
    def step(self, closure=None):
        if self.overlap_backward:   # GradientExchange's: the gradient exchange started in backward
            return super().step(closure)
        loss, pairs, params, skipped = self.begin_step(closure)
        if skipped:
            return loss
        try:
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
                self._reset_errors(params)
        except NonFiniteAggregate as overflow:  # a codec overflowed: undo + skip, or raise
            return self.codec_overflow(overflow, loss)
        return loss

    def metrics(self) -> dict[str, float]:
        return {"H": self.H}


class CSERPL(CSER):
    """CSER-PL, partial local SGD (CSER slides; docs/algorithms.md §CSER-PL)::

        x_i ← x_i − η d_i;   e_i ← e_i − η d_i
        if t mod H == 0:  (e', e_new) = PSync(e_i; C1);  x_i ← x_i − e_i + e';  e_i ← e_new

    Exactly ``CSER(c2=None)``. ``rc`` derives C1 and H with ``R_C = H·R_C1`` (see
    :mod:`gradzip.optim.core.ratios`); without it, ``"auto"`` options take the rc = 16 setting
    (H = 4, C1 = ``randblock:in=4``). With H = 1 it is CSEA.
    """

    overlaps_backward = False   # no gradient exchange: nothing to start in backward

    def __init__(self, params, lr, *, c1: str | Compressor = "auto", H: int | None = None,
                 rc: float | None = None, **kwargs):
        super().__init__(params, lr, c1=c1, c2=None, H=H, rc=rc, **kwargs)
