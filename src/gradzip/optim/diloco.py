"""DiLoCo and streaming DiLoCo: an inner optimizer for H local steps, then an outer
optimizer on the synchronised model, fed the mean pseudo-gradient.

docs/diloco.md; spec §DiLoCo and §Streaming DiLoCo (Douillard et al. 2023, 2025; torchft
``DiLoCo``). Every worker keeps the global model ``θ̂`` (``state[p]["global"]``, the same
on every worker: each applies the same outer step to the same aggregate) beside its local
model ``x_i`` (the user's module). The parameters are split into P fragments; fragment p
has its own outer optimizer (per-parameter state, so P of them are one) and, with
``h = H / P``, this box (steps count from 1)::

    every step:              x_i ← InnerOpt(x_i, g_i)                   # all fragments
    at t = kH + (p+1)h − τ:  Δ_i,p = θ̂_p − x_i,p                        # pseudo-gradient
                             start (Δ̄_p, r_i) = PSync(Δ_i,p + e_i; C);  e_i ← r_i   # in flight
    at t = kH + (p+1)h:      wait;  L = x_i,p                           # after τ more inner steps
                             θ̂_p ← OuterOpt_p(θ̂_p, Δ̄_p)               # torch.optim.SGD semantics
                             x_i,p ← (1−α)·θ̂_p + α·L

P = 1, τ = 0, α = 0 is DiLoCo (Δ = θ − θ_i; θ ← OuterOpt(θ, Δ); θ_i ← θ). The error
memory ``e_i`` is kept only for a biased codec (``Compressor.unbiased`` False, not
``none``); the spec's streaming box writes none, and with ``none`` both agree. At most one
fragment is in flight: its start comes after the previous fragment's sync (τ < h).

The exchange in flight is a :class:`gradzip.exchange.Pending` started on the training
thread (``PSync.start``): the collectives run while the next τ inner steps compute, and
``wait`` decodes at the sync step. Waiting earlier changes no number (the aggregate was
fixed when it started), so :meth:`synchronize`, ``state_dict`` and ``load_state_dict``
wait and keep the decoded aggregate for the sync step: a checkpoint taken mid-flight
resumes bit for bit.

:class:`DiLoCo` wraps any ``torch.optim.Optimizer`` (its state stays local, never reset).
:class:`DiLoCoMethod` is the same method built from parameters, as the registry, the CLI
(``gradzip train --algo diloco --inner adamw --inner-lr 1e-3 --H 8``) and
:func:`gradzip.train.config.make_optimizer` build every method: ``inner="adamw"``
(default) or ``"sgd"`` with the common ``lr`` / ``momentum`` / ``nesterov`` /
``weight_decay``.

**[choice]** the outer hyper-parameters are this optimizer's param group (``lr`` =
outer_lr, ``momentum`` = outer_momentum, ``nesterov`` = outer_nesterov, no weight decay):
an LR scheduler on the DiLoCo object schedules the outer step, one on ``inner`` the inner
one. The workers' local models differ between syncs (``replicas_differ``): the harness
evaluates their average, as for local SGD.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..compressors import build
from ..errors import GradzipError
from ..exchange import DEFAULT_BUCKET_BYTES, Pending
from ..guards.nonfinite import NonFiniteAggregate
from ..trace import maybe_span
from ..validation import is_int, is_real, refuses_unknown_options, require
from .core.base import DistributedOptimizer
from .core.options import FLOAT32_MAX, check_hyperparameters, no_momentum
from .core.participation import hold_once
from .core.ratios import check_period


class DiLoCo(DistributedOptimizer):
    """DiLoCo (``fragments=1, delay=0``) and streaming DiLoCo (module docstring)::

        DiLoCo(inner, *, H, outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True,
               compressor="none", fragments=1, delay=0, alpha=0.0, comm=None)

    ``inner``: a ``torch.optim.Optimizer`` over the model's parameters (not a gradzip
    method: that one would communicate too). ``fragments``: P, tensor k of the inner
    optimizer (in order) in fragment k mod P; or an explicit list of parameter lists that
    partitions them. ``H`` a multiple of P; ``delay`` τ in [0, H/P); ``alpha`` α in [0, 1]."""

    replicas_differ = True

    @refuses_unknown_options
    def __init__(self, inner: torch.optim.Optimizer, *, H: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, outer_nesterov: bool = True, compressor: str = "none",
                 fragments: "int | Sequence[Sequence[torch.Tensor]]" = 1, delay: int = 0, alpha: float = 0.0,
                 comm=None, seed: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, nonfinite: str = "raise",
                 transport: str = "auto", hierarchy: "int | str | None" = None, round_bytes: int | None = None,
                 link=None, recalibrate_every: int | None = None):
        name = type(self).__name__
        require(isinstance(inner, torch.optim.Optimizer) and not isinstance(inner, DistributedOptimizer), name,
                f"inner must be a torch.optim.Optimizer over the model's parameters (e.g. torch.optim.AdamW"
                f"(model.parameters(), lr=1e-3)), not a gradzip method, got {type(inner).__name__}")
        check_period(name, H)
        require(is_real(outer_lr) and 0 <= outer_lr <= FLOAT32_MAX, name,
                f"outer_lr must be a finite number >= 0, got {outer_lr!r}")
        require(is_real(outer_momentum) and 0 <= outer_momentum < 1, name,
                f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        require(isinstance(outer_nesterov, bool), name, f"outer_nesterov must be True or False, got {outer_nesterov!r}")
        require(not outer_nesterov or outer_momentum > 0, name,
                "outer_nesterov=True needs outer_momentum > 0 (for plain outer SGD pass outer_nesterov=False)")
        require(is_int(delay) and delay >= 0, name, f"delay (τ, in steps) must be an integer >= 0, got {delay!r}")
        require(is_real(alpha) and 0 <= alpha <= 1, name, f"alpha must be a number in [0, 1], got {alpha!r}")
        hold_once(inner, name)
        params = [p for g in inner.param_groups for p in g["params"]]
        parts = _fragments(name, fragments, params)
        P = len(parts)
        require(H % P == 0, name, f"H ({H}) must be a multiple of fragments ({P}): each fragment syncs every H steps, "
                                  f"h = H / fragments apart")
        require(delay < H // P, name, f"delay ({delay}) must be below H / fragments = {H // P}: a fragment's exchange "
                                      "must finish before the next fragment's starts")
        super().__init__(params, float(outer_lr), comm=comm, momentum=float(outer_momentum),
                         nesterov=outer_nesterov, weight_decay=0.0, seed=seed, bucket_bytes=bucket_bytes, nonfinite=nonfinite,
                         transport=transport, hierarchy=hierarchy, round_bytes=round_bytes, link=link,
                         recalibrate_every=recalibrate_every)
        self.inner = inner
        self.H = H
        self.fragment_count = P
        self.delay = delay
        self.alpha = float(alpha)
        self.codec = build(compressor)
        self.error_feedback = self.codec.error_feedback_by_default
        self._error_decay = 1.0          # e_i enters as β·e_i (SparseLoCo's β; DiLoCo's is 1)
        self.psync = self.make_psync(self.codec)
        self._fragments = parts
        # (fragment, its participating parameters, Pending or the decoded aggregates) or None
        self._inflight: "tuple[int, list[torch.Tensor], Pending | list[torch.Tensor]] | None" = None

    # -- the algorithm box ---------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss, pairs, params, skipped = self.begin_step(closure)
        if skipped:
            return loss
        try:
            for p in params:             # θ̂ = the (identical) initial model, before any inner step
                if "global" not in self.state[p]:
                    self.state[p]["global"] = p.detach().clone()
            self.irreversible()          # the inner step changes the model ahead of the exchange
            self.inner.step()
            r, h = self.steps % self.H, self.H // self.fragment_count
            for f in range(self.fragment_count):
                if r == ((f + 1) * h - self.delay) % self.H:
                    self._start(f)
                if r == ((f + 1) * h) % self.H:
                    self._sync(f)
        except NonFiniteAggregate as overflow:  # a codec overflowed: undo + skip, or raise
            return self.codec_overflow(overflow, loss)
        return loss

    def exchanges_at(self, step: int) -> bool:
        """The steps a fragment's exchange starts (the set's agreement:
        :mod:`gradzip.optim.core.participation`)."""
        r, h = step % self.H, self.H // self.fragment_count
        return any(r == ((f + 1) * h - self.delay) % self.H for f in range(self.fragment_count))

    def _start(self, f: int) -> None:
        """``Δ_i,p = θ̂_p − x_i,p`` (+ ``e_i``) into PSync, left in flight."""
        params = [p for p in self._fragments[f] if p.requires_grad]
        deltas = []
        for p in params:
            state = self.state[p]
            delta = state["global"] - p
            if "residual" in state:
                residual = state["residual"]
                delta.add_(residual if self._error_decay == 1.0 else residual * self._error_decay)
            deltas.append(delta)
        pending = self.psync.start(deltas, self.steps, keys=self.keys(params), residual=self.error_feedback)
        if self.error_feedback:
            for p, r in zip(params, pending.residual):
                self.state[p]["residual"] = r
        self._inflight = (f, params, pending)

    def _sync(self, f: int) -> None:
        """Wait; ``θ̂_p ← OuterOpt_p(θ̂_p, Δ̄_p)``; ``x_i,p ← (1−α)·θ̂_p + α·L``."""
        aggregate = self._received()
        fragment, params, _ = self._inflight
        assert fragment == f, f"fragment {fragment} in flight at fragment {f}'s sync"
        self._inflight = None
        groups = {p: g for g in self.param_groups for p in g["params"]}
        with maybe_span(self.tracer, "outer_update"):
            for p, delta in zip(params, aggregate):
                theta = self.state[p]["global"]
                self.global_update(p, delta, groups[p], target=theta)
                if self.alpha == 0.0:
                    p.copy_(theta)
                else:
                    p.copy_(torch.lerp(theta, p, self.alpha))

    def _received(self) -> list[torch.Tensor]:
        """The in-flight exchange's aggregates (waiting for them the first time)."""
        fragment, params, pending = self._inflight
        if not isinstance(pending, list):   # in flight (PSync counts the wait: Timings.wait_s)
            pending = pending.wait().aggregate
            self._inflight = (fragment, params, pending)
        return pending

    def synchronize(self) -> None:
        """Wait for the exchange in flight, if any, and keep its aggregate for its sync
        step (no number changes)."""
        if self._inflight is not None:
            self._received()

    def lr_groups(self) -> list[dict]:
        """The inner optimizer's groups: a schedule scales the inner rate, the outer one stays."""
        return self.inner.param_groups

    # -- description, records, state -------------------------------------------------------
    def describe(self) -> dict:
        fields = super().describe()
        fields["inner optimizer"] = type(self.inner).__name__
        for i, group in enumerate(self.inner.param_groups):
            fields.update({f"inner.param_groups[{i}].{k}": v for k, v in group.items() if k != "params"})
        keys = {p: i for i, p in enumerate(self._all_params())}
        fields["fragments"] = [[keys[p] for p in part] for part in self._fragments]
        return fields

    def metrics(self) -> dict[str, float]:
        return {"H": self.H, "fragments": self.fragment_count}

    def state_dict(self) -> dict:
        """torch's state (θ̂, outer momentum, error memory per parameter) plus the inner
        optimizer's state and the exchange in flight (its decoded aggregate)."""
        self.synchronize()
        out = super().state_dict()
        out["gradzip"]["inner"] = self.inner.state_dict()
        if self._inflight is not None:
            fragment, params, aggregate = self._inflight
            out["gradzip"]["inflight"] = {"fragment": fragment, "keys": self.keys(params),
                                          "aggregate": [a.clone() for a in aggregate]}
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        name = type(self).__name__
        self.synchronize()
        extra = state_dict.get("gradzip") if isinstance(state_dict, dict) else None
        inner = extra.get("inner") if isinstance(extra, dict) else None
        if isinstance(extra, dict) and extra.get("method") == name and inner is None:
            raise GradzipError(f"{name}.load_state_dict: this state has no inner optimizer state; "
                               f"load a state saved by {name}.state_dict()")
        super().load_state_dict(state_dict)
        self.inner.load_state_dict(inner)
        inflight = extra.get("inflight")
        self._inflight = None
        if inflight is not None:
            by_key = dict(enumerate(self._all_params()))
            params = [by_key[k] for k in inflight["keys"]]
            self._inflight = (int(inflight["fragment"]), params,
                              [a.to(p.device, p.dtype) for a, p in zip(inflight["aggregate"], params)])


#: The inner optimizers the registry forms build (``inner=``).
INNER = ("adamw", "sgd")


def inner_default_lr(options: dict) -> float:
    """The registry forms' default ``lr``, the inner optimizer's: AdamW's 0.001, or momentum SGD's 0.1."""
    return 0.1 if options.get("inner", "adamw") == "sgd" else 1e-3


def inner_optimizer(name: str, params, lr: float, inner: str, inner_lr: float | None, momentum: float,
                    nesterov: bool, weight_decay: float) -> torch.optim.Optimizer:
    """The registry form's inner optimizer (:class:`DiLoCoMethod`, and SparseLoCo's):
    ``torch.optim.AdamW(params, lr=inner_lr or lr, weight_decay)`` (``inner="adamw"``, momentum
    must be 0) or ``torch.optim.SGD(params, inner_lr or lr, momentum, nesterov, weight_decay)``."""
    check_hyperparameters(name, lr, momentum, weight_decay, nesterov)
    require(inner in INNER, name, f"inner must be one of {', '.join(INNER)}, got {inner!r}")
    require(inner_lr is None or (is_real(inner_lr) and 0 <= inner_lr <= FLOAT32_MAX), name,
            f"inner_lr must be a finite number >= 0 (or None: lr), got {inner_lr!r}")
    if inner == "adamw":
        no_momentum(name, momentum, nesterov, fix="; or pass inner='sgd' (AdamW's moments are its betas)")
    params = list(params)
    step = float(lr if inner_lr is None else inner_lr)
    if inner == "adamw":
        return torch.optim.AdamW(params, lr=step, weight_decay=float(weight_decay))
    return torch.optim.SGD(params, lr=step, momentum=float(momentum), nesterov=bool(nesterov),
                           weight_decay=float(weight_decay))


class DiLoCoMethod(DiLoCo):
    """DiLoCo built from parameters (the registry's and the CLI's form, ``--algo diloco``):
    the inner optimizer is ``torch.optim.AdamW(params, lr=inner_lr or lr,
    weight_decay=weight_decay)`` (``inner="adamw"``, momentum must be 0: AdamW's moments
    are its betas) or ``torch.optim.SGD(params, lr, momentum, nesterov, weight_decay)``
    (``inner="sgd"``). ``H`` defaults to 8 here (as local SGD's); the other options are
    :class:`DiLoCo`'s."""

    @classmethod
    def default_lr(cls, options: dict) -> float:
        return inner_default_lr(options)

    @refuses_unknown_options
    def __init__(self, params, lr, *, inner: str = "adamw", inner_lr: float | None = None, H: int = 8,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, outer_nesterov: bool = True,
                 compressor: str = "none", fragments: int = 1, delay: int = 0, alpha: float = 0.0,
                 comm=None, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
                 seed: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, nonfinite: str = "raise",
                 transport: str = "auto", hierarchy: "int | str | None" = None, round_bytes: int | None = None,
                 link=None, recalibrate_every: int | None = None):
        opt = inner_optimizer(type(self).__name__, params, lr, inner, inner_lr, momentum, nesterov, weight_decay)
        self.inner_kind = inner
        super().__init__(opt, H=H, outer_lr=outer_lr, outer_momentum=outer_momentum,
                         outer_nesterov=outer_nesterov, compressor=compressor, fragments=fragments,
                         delay=delay, alpha=alpha, comm=comm, seed=seed, bucket_bytes=bucket_bytes,
                         nonfinite=nonfinite, transport=transport, hierarchy=hierarchy, round_bytes=round_bytes,
                         link=link, recalibrate_every=recalibrate_every)


def _fragments(name: str, fragments, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The fragments as lists of parameters: ``P`` strided (tensor k in fragment k mod P),
    or the given lists, which must partition ``params``."""
    if is_int(fragments):
        require(1 <= fragments <= max(1, len(params)), name,
                f"fragments must be an integer in [1, {max(1, len(params))}] (one per parameter tensor at most), "
                f"got {fragments!r}")
        return [params[k::fragments] for k in range(fragments)]
    ok = isinstance(fragments, (list, tuple)) and len(fragments) >= 1 and all(
        isinstance(part, (list, tuple)) and part and all(isinstance(p, torch.Tensor) for p in part)
        for part in fragments)
    require(ok, name, "fragments must be an integer P or a non-empty list of non-empty lists of parameters, "
                      f"got {type(fragments).__name__}")
    given = [p for part in fragments for p in part]
    ids = [id(p) for p in given]
    require(len(set(ids)) == len(ids) and set(ids) == {id(p) for p in params}, name,
            "fragments must hold every parameter of the inner optimizer exactly once")
    order = {id(p): i for i, p in enumerate(params)}
    return [sorted(part, key=lambda p: order[id(p)]) for part in fragments]
