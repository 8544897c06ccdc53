"""What every gradzip method shares: a ``torch.optim.Optimizer`` over a communication group.

A method subclasses :class:`DistributedOptimizer` and writes ``step()`` as its algorithm
box, around one or two :class:`~gradzip.exchange.PSync` calls. This base class holds the
hyper-parameters (param groups, so LR schedulers work), the step counter (steps count
from 1, docs/algorithms.md §Steps and periods), the validation of options, the two SGD
rules of §Momentum and weight decay — :meth:`local_direction` (weight decay + momentum kept
on this worker) and :meth:`global_update` (momentum SGD applied after the reduction,
identical on every worker) — and a ``state_dict()`` that carries every residual, buffer
and counter.

Every ``step()`` reads the same way (the skipped step and the codec overflow are explicit
control flow, no wrapper)::

    loss, pairs, params, skipped = self.begin_step(closure)
    if skipped:                                  # every worker agreed to skip (nonfinite="skip")
        return loss
    try:
        ...                                      # the box
    except NonFiniteAggregate as overflow:       # a codec overflowed: undo + skip, or raise
        return self.codec_overflow(overflow, loss)
    return loss

:meth:`DistributedOptimizer.begin_step` runs the guards before anything is compressed or
sent: on the first step, the workers compare a digest of their settings and of the
parameters' values (:mod:`gradzip.optim.core.agreement`, over :mod:`gradzip.guards.consistency`;
replicas must start equal: :func:`gradzip.broadcast_parameters`); on every step, the gradients' non-finite check
(:mod:`gradzip.optim.core.guard`, which also holds the undo log behind
:meth:`~gradzip.optim.core.guard.NonFiniteGuard.codec_overflow`). Neither touches residuals,
momentum or the step counter when it stops a step.

Which parameters take part in a step (held once, dense gradients, missing ones as zeros,
frozen ones never, the same on every worker) is :mod:`gradzip.optim.core.participation`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from ... import comm as comm_lib
from ...errors import GradzipError
from ...exchange import DEFAULT_BUCKET_BYTES, PSync
from ...exchange.calibration import check_recalibrate_every
from ...exchange.planner import Link, as_link, check_transport
from ...exchange.twophase import check_round_bytes
from ...exchange.hierarchy import check_workers_per_node
from ...guards.nonfinite import NONFINITE_POLICIES
from ...validation import constructor_options, is_int, refuse_unknown_options, require
from .eager import EagerOptimizer
from .agreement import Agreement
from .exchanges import ExchangeOwner
from .guard import NonFiniteGuard
from .options import check_group, check_hyperparameters
from .participation import Participation


class DistributedOptimizer(Agreement, ExchangeOwner, NonFiniteGuard, Participation, EagerOptimizer):
    """Base of every method. ``comm=None``: the default torch.distributed group when one is
    initialised, else a world of one."""

    #: The workers' models differ between synchronisations (local SGD, CSER, ...): the
    #: harness then evaluates on their average (``--eval-on auto``).
    replicas_differ: bool = False
    #: ``step()`` returns before its exchange finishes: compression and communication of
    #: step t run while step t+1 computes (OD-SGD, CD-SGD), so step t's update lands a step
    #: late and ``synchronize()`` waits for it. Part of the method's contract.
    overlaps_exchange: bool = False
    #: The exchange starts from gradient hooks during backward (``overlap_backward``; the
    #: methods of :class:`gradzip.optim.core.overlap.GradientExchange`): the input for a tensor is
    #: known once its gradient is. False for methods whose input needs the whole step.
    overlaps_backward: bool = False
    #: The method reads the whole-tensor packets of an exchange (DGC's selected indices), so
    #: its exchanges keep to the exact transports (``transport="twophase"`` is refused).
    reads_packets: bool = False
    #: The method's own options kept per param group (in ``defaults``, so a param group may
    #: set them too): CD-SGD's ``local_lr``, the Adam methods' ``betas`` and ``eps``. Any other
    #: keyword that reaches this constructor is refused, naming the closest valid option.
    group_options: tuple[str, ...] = ()
    #: Every exchange is a collective on the method's group, so a step can run on a group that
    #: records its collectives (:mod:`gradzip.bench.profiling`: ``gradzip bench model`` and the
    #: projection of a run). False for a method that talks point to point (A-SGD's server).
    collective_exchanges: bool = True

    @classmethod
    def default_lr(cls, options: dict) -> float:
        """The learning rate the CLI uses where ``--lr`` is not given, for this method with
        ``options``: 0.1 (momentum SGD); LARS, LAMB and the Adam methods say their own."""
        return 0.1

    def __init__(self, params: Iterable, lr: float, *, comm: "comm_lib.Group | None" = None,
                 momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
                 seed: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, nonfinite: str = "raise",
                 transport: str = "auto", hierarchy: "int | str | None" = None, round_bytes: int | None = None,
                 link: "str | Link | None" = None, recalibrate_every: int | None = None, **options: Any):
        name = type(self).__name__
        refuse_unknown_options(name, [k for k in options if k not in self.group_options],
                               constructor_options(type(self), stop=DistributedOptimizer))
        require(nonfinite in NONFINITE_POLICIES, name,
                f"nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {nonfinite!r}")
        check_hyperparameters(name, lr, momentum, weight_decay, nesterov)
        require(is_int(bucket_bytes) and bucket_bytes >= 1, name,
                f"bucket_bytes must be an integer >= 1, got {bucket_bytes!r}")
        require(is_int(seed), name, f"seed must be an integer, got {seed!r}")
        check_transport(transport, name)
        check_round_bytes(round_bytes, name)
        try:
            declared = None if link is None else as_link(link)
        except GradzipError as exc:
            raise GradzipError(f"{name}: {exc}") from None
        check_recalibrate_every(recalibrate_every, name)
        require(transport != "twophase" or not self.reads_packets, name,
                "transport='twophase' is not available: this method reads the whole-tensor packets of its "
                "exchange; use transport='auto', 'allreduce' or 'allgather'")
        defaults = dict(lr=float(lr), momentum=float(momentum), nesterov=bool(nesterov),
                        weight_decay=float(weight_decay), **options)
        super().__init__(params, defaults)
        self.comm = comm_lib.resolve(comm, name)
        self.comm.claim(self._all_params(), name)   # in-process workers: no parameter shared by two
        self.seed = int(seed)
        self.bucket_bytes = int(bucket_bytes)
        self.nonfinite = nonfinite
        self.transport = transport
        #: two-phase: each all-to-all in rounds of at most this many bytes per message (None:
        #: whole messages; PSync's round_bytes); an int joins the settings compared across workers
        self.round_bytes = round_bytes
        #: the link every exchange's plan is priced on (auto's choices, two-phase): declared, or
        #: None (auto:<codec> measures it; the others take the default, 10 Gbit/s)
        self._declared_link = declared
        #: auto:<codec>: steps between decisions (None: decided once)
        self.recalibrate_every = recalibrate_every
        try:   # k workers per node: every exchange hierarchical (gradzip.exchange.hierarchy); 1 = flat PSync
            self._hierarchy = check_workers_per_node(hierarchy, self.comm.world_size)
        except GradzipError as exc:
            raise GradzipError(f"{name}: hierarchy: {exc}") from None
        self.steps = 0
        self.skipped_steps = 0   # steps skipped for a non-finite gradient (nonfinite="skip")
        self._verified = False   # settings compared across workers (first step)
        self._ddp: list | None = None   # DDP wrappers (no-op hook) over the parameters, found once
        self._tracer = None
        self._exchanges: list[PSync] = []
        self._keys = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        self._names: dict[int, str] = {}   # key -> parameter name (named params), every PSync's .names
        self._learn_names()
        self.start_undo_log()  # see NonFiniteGuard.irreversible()

    def add_param_group(self, param_group: dict) -> None:
        """As ``torch.optim.Optimizer.add_param_group`` (defaults filled in), with the
        constructor's checks on the group's hyper-parameters. Added after the first step,
        the settings (shapes, values) are compared across the workers again at the next
        step: every worker must add the same group."""
        super().add_param_group(param_group)
        where = f"param_groups[{len(self.param_groups) - 1}]."
        try:
            check_group(type(self).__name__, self.param_groups[-1], where)
        except GradzipError:
            self.param_groups.pop()
            raise
        if hasattr(self, "_keys"):  # not while the constructor adds the first groups
            self.joined(self.param_groups[-1]["params"])
            self._learn_names()

    def joined(self, params: list[torch.Tensor]) -> None:
        """Parameters of a group added after construction: claimed on the group
        (``comm.claim``: not another in-process worker's), keyed after the others, and the
        settings compared across workers again at the next step (:meth:`reverify`)."""
        self.comm.claim(params, type(self).__name__)
        for p in params:
            self._keys.setdefault(p, len(self._keys))
        self.reverify()

    # -- building blocks for step() -----------------------------------------------------
    def begin_step(self, closure: Callable[[], Any] | None):
        """What every ``step()`` starts with: evaluate the closure; refuse a step inside a
        DDP wrapper's ``no_sync()`` (:meth:`refuse_step_while_accumulating`); on the first step,
        refuse DDP double communication and compare settings across workers
        (:meth:`verify_consistent`); list the parameters that take part
        (:meth:`params_with_grad`: missing gradients become zeros); check every worker's
        gradients for NaN/Inf (``nonfinite``); agree on the set across workers where this
        step exchanges it (:meth:`agree`); count the step (from 1).

        Returns ``(loss, pairs, params, skipped)``: ``pairs`` the ``(group, param)`` of
        :meth:`params_with_grad`, ``params`` their parameters. ``skipped``: the workers
        agreed to skip this step (``nonfinite="skip"``), with nothing changed but
        ``skipped_steps``; ``step()`` then returns ``loss`` at once::

            loss, pairs, params, skipped = self.begin_step(closure)
            if skipped:
                return loss
        """
        loss = self._evaluate(closure)
        self.refuse_step_while_accumulating()
        self.verify_once()
        pairs = self.params_with_grad()
        params = [p for _, p in pairs]
        first_bad = self.first_bad_gradient(params)     # "raise": raised here, before anything is sent
        if self.nonfinite == "skip" or self.exchanges_at(self.steps + 1):   # the same set on every worker
            first_bad = max(row[0] for row in self.agree([first_bad], pairs))
        if first_bad >= 0:                                  # "skip": every worker skips this step
            self.skipped_steps += 1
            return loss, pairs, params, True
        self.steps += 1
        self.start_undo_log()
        return loss, pairs, params, False

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def lr_groups(self) -> list[dict]:
        """The param groups whose ``"lr"`` is the method's learning rate, the one a
        schedule scales (``--lr-schedule``, ``--lr-scaling``): these groups, or a
        wrapper's inner optimizer's (DiLoCo: the inner rate, not the outer one)."""
        return self.param_groups

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

    def _momentum(self, state: dict, key: str, grad: torch.Tensor, p: torch.Tensor, group: dict) -> torch.Tensor:
        """``torch.optim.SGD``'s rule (dampening 0): ``d = g + wd·x; b = m·b + d;
        d = d + m·b`` (Nesterov) or ``b``."""
        d = grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else grad.clone()
        m = group["momentum"]
        if m == 0:
            return d
        self.replaced(state, key)  # a new tensor, so a skipped step can put the old one back
        state[key] = d.clone() if key not in state else state[key].mul(m).add_(d)
        return d.add(state[key], alpha=m) if group["nesterov"] else state[key].clone()

    def _evaluate(self, closure: Callable[[], Any] | None) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients; the last backward of the step
        runs outside, then ``step()``. Nothing to do for a method that exchanges in ``step()``;
        methods that start their exchange in backward (``overlaps_backward``) idle their hooks
        here. Every method has it, so a script's accumulation loop works for any of them. A
        DDP wrapper's ``no_sync()`` over the parameters (no-op hook) counts as this too
        (:meth:`ddp_accumulating`), so Accelerate's ``accumulate()`` needs nothing more."""
        yield

    def evaluation_parameters(self) -> list[torch.Tensor] | None:
        """Tensors to evaluate instead of the ones the model holds (in the optimizer's
        parameter order), e.g. a global model kept beside a local one; None: the model's."""
        return None

    def metrics(self) -> dict[str, float]:
        """Method-specific numbers for the run's records (e.g. achieved density)."""
        return {}

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        out = super().state_dict()
        out["gradzip"] = {"steps": self.steps, "skipped_steps": self.skipped_steps, "seed": self.seed,
                          "method": type(self).__name__, "world_size": self.comm.world_size,
                          "exchanges": [x.counters() for x in self._exchanges],
                          "exchange_states": [x.state_dict() for x in self._exchanges]}
        return out

    def check_saved_group(self, group: dict, where: str) -> None:
        """``load_state_dict``'s check of a saved param group (the constructor's checks);
        a method whose groups hold other hyper-parameters overrides it."""
        check_group(type(self).__name__, group, where)

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim``'s, refusing (naming the field) a state this optimizer cannot
        continue from: not a gradzip state, another method, another world size, param
        groups whose hyper-parameters fail the constructor's checks."""
        name = type(self).__name__
        state_dict = dict(state_dict)
        extra = state_dict.pop("gradzip", None)
        if not isinstance(extra, dict):
            raise GradzipError(
                f"{name}.load_state_dict: this state has no 'gradzip' entry (a torch.optim state, "
                f"e.g. torch.optim.SGD's?), so it holds none of {name}'s residuals, counters and seeds; "
                f"load a state saved by {name}.state_dict()"
            )
        if extra.get("method") != name:
            raise GradzipError(
                f"this state_dict was saved by {extra.get('method')}, not {name}; "
                "load it into the method that saved it"
            )
        if extra.get("world_size") != self.comm.world_size:
            raise GradzipError(
                f"{name}.load_state_dict: 'world_size' is {extra.get('world_size')} in this state, the "
                f"group has {self.comm.world_size} workers; residuals and errors are per worker: "
                "resume with as many workers as saved it"
            )
        for i, group in enumerate(state_dict.get("param_groups", [])):
            self.check_saved_group(group, f"param_groups[{i}].")
        super().load_state_dict(state_dict)   # torch's own checks (group sizes) first
        self.steps = int(extra["steps"])
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        self.seed = int(extra["seed"])
        for psync, counters in zip(self._exchanges, extra.get("exchanges", [])):
            psync.load_counters(counters)
        for psync, state in zip(self._exchanges, extra.get("exchange_states", [])):
            psync.load_state_dict(state)
        self.reverify()  # the loaded values (and settings) are compared at the next step
