"""What every gradzip method shares: a ``torch.optim.Optimizer`` over a communication group.

A method subclasses :class:`DistributedOptimizer` and writes ``step()`` as its algorithm
box, around one or two :class:`~gradzip.exchange.PSync` calls. This base class holds the
hyper-parameters (param groups, so LR schedulers work), the step counter (steps count
from 1), the validation of options, the two SGD rules the spec uses —
:meth:`local_direction` (weight decay + momentum kept on this worker, spec "Notation") and
:meth:`global_update` (momentum SGD applied after the reduction, identical on every
worker) — and a ``state_dict()`` that carries every residual, buffer and counter.

Two guards run in every ``step()`` before anything is compressed or sent
(:meth:`DistributedOptimizer.begin_step`): on the first step, the workers compare a digest
of their settings (:mod:`gradzip.consistency`, one small control allgather); on every
step, each worker checks its gradients for NaN or Inf (``nonfinite``: ``"raise"`` here,
``"skip"`` the step on every worker after agreeing with one small control allgather, or
``"off"``). Neither touches residuals, momentum or the step counter when it stops a step.
"""
from __future__ import annotations

import functools
import inspect
import typing
from typing import Any, Callable, Iterable, Sequence

import torch

from .. import comm as comm_lib
from .. import consistency, seeds
from ..errors import GradzipError
from ..exchange import DEFAULT_BUCKET_BYTES, PSync, Timings
from ..compressors import Compressor
from ..validation import is_int, is_real, require
from ..version import __version__


#: Options every method takes; the rest of a method's keyword-only options are its own.
COMMON_OPTIONS = ("lr", "comm", "momentum", "nesterov", "weight_decay", "seed", "bucket_bytes", "nonfinite")

#: What a step does when some worker's gradient holds a NaN or Inf (see ``begin_step``).
NONFINITE_POLICIES = ("raise", "skip", "off")


#: The largest finite float32: a learning rate or decay above it overflows the update.
FLOAT32_MAX = 3.4028234663852886e38


class NonFiniteGradient(GradzipError):
    """A worker's gradient held a NaN or Inf (``nonfinite="raise"``): raised on that worker
    before anything was compressed, sent or updated (its peers then stop with a
    ``PeerFailure`` naming it)."""


class _SkipStep(Exception):
    """Internal: ``begin_step`` decided (on every worker) to skip this step."""

    def __init__(self, loss):
        super().__init__()
        self.loss = loss


def _skippable(step):
    """Wrap a method's ``step()`` so a step that :meth:`begin_step` skips returns its loss."""
    @functools.wraps(step)
    def guarded(self, closure=None):
        try:
            return step(self, closure)
        except _SkipStep as skip:
            return skip.loss
    guarded.gradzip_skippable = True
    return guarded


def method_options(cls: type) -> dict[str, type]:
    """A method's own keyword-only options and their types (int, float, bool or str), read
    from its signature, so front ends (the CLI) need no per-method code."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # an annotation that does not evaluate: fall back to the default's type
        hints = {}
    out = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if param.kind != param.KEYWORD_ONLY or name in COMMON_OPTIONS:
            continue
        kinds = typing.get_args(hints.get(name)) or (hints.get(name),)
        simple = [k for k in (bool, int, float, str) if k in kinds]
        if not simple and param.default is not None and param.default is not inspect.Parameter.empty:
            simple = [type(param.default)]
        out[name] = simple[0] if simple else str
    return out


class DistributedOptimizer(torch.optim.Optimizer):
    """Base of every method. ``comm=None``: the default torch.distributed group when one is
    initialised, else a world of one."""

    #: The workers' models differ between synchronisations (local SGD, CSER, ...): the
    #: harness then evaluates on their average (``--eval-on auto``).
    replicas_differ: bool = False
    #: ``step()`` returns before its exchange finishes: compression and communication of
    #: step t run while step t+1 computes (OD-SGD, CD-SGD), so step t's update lands a step
    #: late and ``synchronize()`` waits for it. Part of the method's contract.
    overlaps_exchange: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        step = cls.__dict__.get("step")
        if step is not None and not getattr(step, "gradzip_skippable", False):
            cls.step = _skippable(step)

    def __init__(self, params: Iterable, lr: float, *, comm: "comm_lib.Group | None" = None,
                 momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
                 seed: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, nonfinite: str = "raise",
                 **options: Any):
        name = type(self).__name__
        require(nonfinite in NONFINITE_POLICIES, name,
                f"nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {nonfinite!r}")
        require(is_real(lr) and 0 <= lr <= FLOAT32_MAX, name, f"lr must be a finite number >= 0, got {lr!r}")
        require(is_real(momentum) and 0.0 <= momentum < 1.0, name, f"momentum must be in [0, 1), got {momentum!r}")
        require(is_real(weight_decay) and 0.0 <= weight_decay <= FLOAT32_MAX, name,
                f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
        require(isinstance(nesterov, bool), name, f"nesterov must be True or False, got {nesterov!r}")
        require(not nesterov or momentum > 0, name, "nesterov=True needs momentum > 0")
        require(is_int(bucket_bytes) and bucket_bytes >= 1, name,
                f"bucket_bytes must be an integer >= 1, got {bucket_bytes!r}")
        require(is_int(seed), name, f"seed must be an integer, got {seed!r}")
        defaults = dict(lr=float(lr), momentum=float(momentum), nesterov=bool(nesterov),
                        weight_decay=float(weight_decay), **options)
        super().__init__(params, defaults)
        self.comm = comm if comm is not None else comm_lib.default()
        self.seed = int(seed)
        self.bucket_bytes = int(bucket_bytes)
        self.nonfinite = nonfinite
        self.steps = 0
        self.skipped_steps = 0   # steps skipped for a non-finite gradient (nonfinite="skip")
        self._verified = False   # settings compared across workers (first step)
        self._tracer = None
        self._exchanges: list[PSync] = []
        self._keys = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    # -- building blocks for step() -----------------------------------------------------
    def make_psync(self, compressor: "str | Compressor | None", salt: int = 0,
                   comm: "comm_lib.Group | None" = None) -> PSync:
        """A PSync on this optimizer's group (or ``comm``); ``salt`` separates the seeds of
        two exchanges."""
        psync = PSync(comm or self.comm, compressor, seed=seeds.exchange_seed(self.seed, salt),
                      bucket_bytes=self.bucket_bytes)
        psync.tracer = self._tracer
        self._exchanges.append(psync)
        return psync

    @property
    def tracer(self):
        """A :class:`gradzip.trace.Tracer` that this method's exchanges record spans into."""
        return self._tracer

    @tracer.setter
    def tracer(self, tracer) -> None:
        self._tracer = tracer
        for psync in self._exchanges:
            psync.tracer = tracer

    def begin_step(self, closure: Callable[[], Any] | None):
        """What every ``step()`` starts with: evaluate the closure; on the first step,
        compare settings across workers (:meth:`verify_consistent`); check every worker's
        gradients for NaN/Inf (``nonfinite``); count the step (from 1); list the
        parameters that have gradients. Returns ``(loss, pairs, params)`` with ``pairs`` the
        ``(group, param)`` of :meth:`params_with_grad`. A skipped step leaves ``step()``
        here (it returns the loss) with nothing changed but ``skipped_steps``."""
        loss = self._evaluate(closure)
        if not self._verified:
            consistency.refuse_ddp_double_sync([p for g in self.param_groups for p in g["params"]], type(self).__name__)
            self.verify_consistent()
        pairs = self.params_with_grad()
        if self.nonfinite != "off" and not self._gradients_finite([p for _, p in pairs]):
            self.skipped_steps += 1
            raise _SkipStep(loss)
        self.steps += 1
        return loss, pairs, [p for _, p in pairs]

    def _gradients_finite(self, params: list[torch.Tensor]) -> bool:
        """Whether this step may go on. ``"raise"``: this worker's gradients are checked
        locally (no collective) and a NaN/Inf raises :class:`NonFiniteGradient` here, before
        anything is sent; the peers then stop at their next collective with a
        ``PeerFailure`` naming this rank. ``"skip"``: every worker must skip the same steps,
        so the workers agree first (one control allgather of 8 bytes per worker per step)
        and all skip if any worker's gradient is not finite."""
        first_bad = -1
        if params:
            # a sum is finite iff every element is, unless it overflows: one fast pass, and an
            # exact look only at tensors whose sum is not finite
            sums = torch.stack([p.grad.detach().sum().float() for p in params])
            if not bool(torch.isfinite(sums).all()):
                first_bad = next((i for i, p in enumerate(params)
                                  if not bool(torch.isfinite(p.grad).all())), -1)
        if self.nonfinite == "raise":
            if first_bad >= 0:
                p = params[first_bad]
                raise NonFiniteGradient(
                    f"{type(self).__name__} step {self.steps + 1}: non-finite gradient (NaN or Inf) "
                    f"on rank {self.comm.rank}, parameter #{first_bad} (shape {tuple(p.shape)}); "
                    "stopped before anything was compressed, sent or updated. Lower the learning "
                    "rate or clip gradients, or skip such steps on every worker with "
                    "nonfinite='skip' (CLI: --nonfinite skip)."
                )
            return True
        if self.comm.world_size > 1:
            first_bad = max(self.comm.allgather_control(torch.tensor([first_bad])).reshape(-1).tolist())
        return first_bad < 0

    def describe(self) -> dict[str, Any]:
        """The settings every worker of a group must share: method, version, world size,
        parameter shapes, hyper-parameters per param group, options kept as attributes
        (periods, ratios, ...) and the codec spec of every exchange."""
        fields: dict[str, Any] = {
            "gradzip version": __version__, "method": type(self).__name__,
            "world size": self.comm.world_size,
            "parameter shapes": [tuple(p.shape) for g in self.param_groups for p in g["params"]],
        }
        for i, group in enumerate(self.param_groups):
            fields.update({f"param_groups[{i}].{k}": v for k, v in group.items() if k != "params"})
        fields.update({k: v for k, v in vars(self).items()
                       if not k.startswith("_") and k not in ("steps", "skipped_steps")
                       and isinstance(v, (bool, int, float, str))})
        for i, psync in enumerate(self._exchanges):
            fields[f"exchange {i} codec"] = psync.compressor.spec
        return fields

    def verify_consistent(self) -> None:
        """Compare :meth:`describe` across the group (once; collective): raises
        :class:`gradzip.consistency.InconsistentWorkers` on every worker, naming the first
        setting that differs, if any does. ``step()`` calls it on the first step."""
        consistency.verify(self.comm, self.describe(), what=f"{type(self).__name__} settings")
        self._verified = True

    def params_with_grad(self) -> list[tuple[dict, torch.Tensor]]:
        """``(group, param)`` for every parameter with a gradient, in a fixed order."""
        return [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]

    def keys(self, params: Sequence[torch.Tensor]) -> list[int]:
        """Stable per-parameter keys (its position in the optimizer) for shared seeds."""
        return [self._keys[p] for p in params]

    def local_direction(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """``d_i``: the gradient with weight decay and local (never synchronised) momentum."""
        return self._momentum(self.state[p], "momentum_buffer", p.grad, p, group)

    def global_update(self, p: torch.Tensor, aggregate: torch.Tensor, group: dict,
                      target: torch.Tensor | None = None) -> None:
        """``x ← GlobalOpt(x, aggregate)``: momentum SGD with weight decay on the reduced
        gradient; the same operations on the same values on every worker. ``x`` is ``p``,
        or ``target`` (e.g. a global model kept beside ``p``); the buffer lives in
        ``self.state[p]``."""
        x = p if target is None else target
        direction = self._momentum(self.state[p], "global_momentum_buffer", aggregate, x, group)
        x.add_(direction, alpha=-group["lr"])

    @staticmethod
    def _momentum(state: dict, key: str, grad: torch.Tensor, p: torch.Tensor, group: dict) -> torch.Tensor:
        """``torch.optim.SGD``'s rule (dampening 0): ``d = g + wd·x; b = m·b + d;
        d = d + m·b`` (Nesterov) or ``b``."""
        d = grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else grad.clone()
        m = group["momentum"]
        if m == 0:
            return d
        if key not in state:
            state[key] = d.clone()
        else:
            state[key].mul_(m).add_(d)
        return d.add(state[key], alpha=m) if group["nesterov"] else state[key].clone()

    def _evaluate(self, closure: Callable[[], Any] | None) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def evaluation_parameters(self) -> list[torch.Tensor] | None:
        """Tensors to evaluate instead of the ones the model holds (in the optimizer's
        parameter order), e.g. a global model kept beside a local one; None: the model's."""
        return None

    def metrics(self) -> dict[str, float]:
        """Method-specific numbers for the run's records (e.g. achieved density)."""
        return {}

    # -- accounting --------------------------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        """Bytes this worker put on the wire in this optimizer's exchanges."""
        return sum(x.bytes_sent for x in self._exchanges)

    @property
    def compression_ratio(self) -> float:
        """R_C: payload bytes S-SGD would have sent in as many steps (every gradient, dense)
        / payload bytes this worker's packets carried (1 for S-SGD; inf if none sent)."""
        payload = sum(x.payload_bytes for x in self._exchanges)
        dense = self.steps * sum(p.numel() * p.element_size() for g in self.param_groups for p in g["params"])
        return dense / payload if payload else float("inf")

    @property
    def timings(self) -> Timings:
        """Codec and communication time of this method's exchanges (see
        :class:`~gradzip.exchange.Timings`); a method that waits for a background exchange
        outside PSync adds that wait to ``wait_s`` by overriding this."""
        return sum((x.timings for x in self._exchanges), Timings())

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        out = super().state_dict()
        out["gradzip"] = {"steps": self.steps, "skipped_steps": self.skipped_steps, "seed": self.seed,
                          "method": type(self).__name__, "world_size": self.comm.world_size,
                          "exchanges": [x.counters() for x in self._exchanges]}
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("gradzip", None)
        if extra is not None:
            if extra["method"] != type(self).__name__:
                raise GradzipError(
                    f"this state_dict was saved by {extra['method']}, not {type(self).__name__}; "
                    "load it into the method that saved it"
                )
            self.steps = int(extra["steps"])
            self.skipped_steps = int(extra.get("skipped_steps", 0))
            self.seed = int(extra["seed"])
            for psync, counters in zip(self._exchanges, extra.get("exchanges", [])):
                psync.load_counters(counters)
        super().load_state_dict(state_dict)
