"""The exchange starts during backward (docs/algorithms.md §PSync, "Overlap with backward").

For a method whose exchange input for a parameter is known as soon as that parameter's
gradient is (S-SGD with any codec, EF-SGD, BIT-SGD, CSEA, DGC without clipping, CSER's
gradient exchange), :class:`GradientExchange` splits ``step()`` into :meth:`~GradientExchange.exchange_input` (what goes into PSync for
one parameter, with its state changes, e.g. EF-SGD's ``p = e + η d``) and
:meth:`~GradientExchange.apply_exchange`, and launches the exchange from gradient hooks
(``register_post_accumulate_grad_hook``) as DDP does, so compression and communication of
the last layers run while the first layers' backward still computes; ``step()`` waits
and applies.

**Buckets** (transport only): the parameters that take part (``params_with_grad``'s set and
order) are cut, in *reverse* order (≈ the order backward delivers gradients), into buckets
of up to ``bucket_bytes`` of parameter bytes; the cut is fixed and the same on every worker.
A bucket launches (one ``PSync.start`` over its members, with their keys and the step's
seeds) once all its members' gradients are ready and every earlier bucket has launched, so
every worker issues the same collectives in the same order. ``step()`` feeds what no hook
did (a missing ``.grad`` is a zero gradient; a gradient set by hand), launches the rest in
order, runs one control allgather (16 bytes: the first non-finite gradient, "a gradient
changed after its hook"), waits for all, and only then applies (a codec overflow leaves the
step undoable).
Every path with ``overlap_backward=True`` (hooks or not) uses these buckets, so they give
the same bits; with ``overlap_backward=False`` ``step()`` exchanges every tensor in one
``PSync`` call, as before this module. The two agree bit for bit on the in-process group and
on 2 gloo workers; with 3 or more, a float allreduce may associate differently per bucket
composition (≈ 1 ulp, as any change of ``bucket_bytes``).

**Contract with the training loop**:

* one backward per step: a gradient that accumulates again before ``step()`` raises
  :class:`GradzipError`; accumulate over micro-batches inside ``with opt.accumulate():``
  (hooks idle, like DDP's ``no_sync``), the last backward outside it; inside ``no_sync()`` of
  a DDP wrapper with DDP's no-op hook (Accelerate's ``accumulate()``) the hooks idle too;
* a gradient changed between backward and ``step()`` (clipping, editing by hand, also through
  ``p.grad.data`` or outside torch; seen by its tensor, its version counter or a snapshot
  of its values, :mod:`gradzip.optim.core.fingerprint`): the exchange already started from the old one.
  The control allgather tells every worker; all discard it and exchange again from the
  current gradients (exact; twice the traffic, counted: ``overlap_backward=False`` if you
  clip every step). The snapshot of a gradient of up to 4096 entries is a copy of it,
  compared at ``step()`` with all others in one ``torch.equal``; a larger one's is a digest
  (one pass; :mod:`gradzip.kernels.digest`), taken when the exchange reads the gradient: in
  the hook where the input is a copy (EF-SGD's ``p = e + η d``), in the bucket's copy where
  the input is the gradient itself (S-SGD: no second read in backward), or at the end of
  backward where that bucket waits for ``step()``; one more pass at ``step()``;
* hyper-parameters (lr, momentum, weight decay) are read when the gradient is ready: an LR
  scheduler stepped after ``step()`` (the usual place) acts on the next step, as without hooks.

**Guards**: the settings check and the DDP double-sync refusal run at the first hook of the
first step, before any hook-launched collective. A non-finite gradient seen by a hook sends
zeros in its place (never applied): under ``"raise"`` nothing further launches and
``step()`` raises (the state the hooks changed put back; the peers fail at their next
collective, as before); under ``"skip"`` ``step()`` launches the rest, the workers agree (the
control allgather), and a skipped step waits for and discards its exchanges and puts back
what the hooks changed (undo log, byte counters): as if the step never happened. Between
backward and ``step()``, ``opt.state`` already holds the step's momentum buffers (DGC's
``u``, ``v`` excepted: they enter when applied).
"""
from __future__ import annotations

import contextlib
import time
import weakref
from typing import Iterator

import torch

from ...errors import GradzipError
from ...exchange import Pending
from .fingerprint import SMALL, changed, snapshot
from ...guards.nonfinite import NonFiniteAggregate, first_nonfinite
from ...validation import require
from .base import DistributedOptimizer


class _Plan:
    """The step's buckets over ``pairs`` (``(group, param)``, ``params_with_grad``'s order):
    the exchange plan of the method's launching PSync (:meth:`GradientExchange.launch_psync`,
    :func:`gradzip.exchange.plan`), its buckets as parameter lists in launch order (descending
    key: reverse parameter order)."""

    def __init__(self, pairs: list[tuple[dict, torch.Tensor]], psync, keys: list[int]):
        self.key = _plan_key(pairs, psync)   # auto:<codec>: and its decision (PSync.plan_version)
        self.pairs = pairs
        self.group = {p: g for g, p in pairs}
        params = [p for _, p in pairs]
        order, self.exchange = psync.exchange_plan(params, keys)
        self.buckets: list[list[torch.Tensor]] = [[params[order[i]] for i in b.tensors]
                                                  for b in self.exchange.buckets]
        self.where = {p: b for b, members in enumerate(self.buckets) for p in members}
        #: the parameters this plan sends with a lossless codec (``none``; auto:<codec>'s
        #: uncompressed units): their aggregate is the exact mean of the inputs
        self.lossless = {id(params[order[i]]) for i, exact in enumerate(self.exchange.lossless()) if exact}


def _plan_key(pairs, psync) -> tuple:
    return (id(psync), psync.plan_version, *((id(g), id(p)) for g, p in pairs))


class _Run:
    """One step's exchange as the hooks and ``step()`` build it."""

    def __init__(self, plan: _Plan, step: int, counters: list[tuple[int, int]]):
        self.plan = plan
        self.step = step                                   # the step number of its seeds
        self.counters = counters                           # every exchange's byte counters before it
        self.pairs: list[tuple[dict, torch.Tensor]] = []   # the step's (group, param), set by step()
        self.inputs: dict[torch.Tensor, torch.Tensor] = {}
        self.seen: dict[torch.Tensor, tuple] = {}  # hooked: (grad, its version)
        self.snapshots: list[tuple] = []                   # (gradient or list of small ones, snapshot)
        self.deferred: dict[torch.Tensor, torch.Tensor] = {}   # param -> gradient, its snapshot not taken yet
        self.missing = [len(b) for b in plan.buckets]      # members not fed yet, per bucket
        self.launched: list[list[tuple[list, Pending]]] = []   # per bucket: (members, pending) per exchange
        self.poisoned = False                              # "raise": a non-finite gradient; launch no more
        self.rest_queued = False                           # _snapshot_rest runs at the end of backward
        self.bad: set[int] = set()                         # keys of parameters fed a non-finite gradient


class GradientExchange(DistributedOptimizer):
    """Base of the methods whose exchange input for a parameter is known once its gradient
    is ready (module docstring). A subclass sets ``self.psync`` and writes
    :meth:`exchange_input` and :meth:`apply_exchange`; ``step()`` is this class's. A method
    with more than one exchange per step overrides :meth:`start_bucket` and
    :meth:`apply_bucket` (DGC's sparse and dense tensors), or has work after the exchange
    (:meth:`finish_exchange`: CSER's error reset).

    ``overlap_backward=True`` (default): the exchange starts from gradient hooks during
    backward; ``False``: ``step()`` does everything, in one ``PSync`` call."""

    #: This method's exchange can start during backward (``overlap_backward``).
    overlaps_backward: bool = True
    #: PSync returns the local residual (error-feedback methods); False for S-SGD.
    exchange_residual: bool = True
    #: The exchange input keeps every NaN/Inf of the gradient (S-SGD's ``d``, EF-SGD's
    #: ``e + η d``): where ``self.psync``'s aggregate check guards its inputs, the exchange
    #: checks the gradients (:meth:`gradients_checked_by_exchange`).
    inputs_keep_gradient_nonfinite: bool = False

    def __init__(self, params, lr, *, overlap_backward: bool = True, **kwargs):
        require(isinstance(overlap_backward, bool), type(self).__name__,
                f"overlap_backward must be True or False, got {overlap_backward!r}")
        super().__init__(params, lr, **kwargs)
        self.overlap_backward = overlap_backward
        self._accumulating = 0
        self._run: _Run | None = None
        self._plan: _Plan | None = None
        self._guard_plan: _Plan | None = None   # the plan of the hooks' step (gradients_checked_by_exchange)
        self._handles: list = []
        self._hooked: set[int] = set()
        weakref.finalize(self, _remove_hooks, self._handles)
        if overlap_backward:
            self._register_hooks(self._all_params())

    def gradients_checked_by_exchange(self) -> bool:
        """(NonFiniteGuard's contract.) With the backward overlap, decided on the plan of the
        step the hooks run (``PSync.plan_guards_inputs``: auto:<codec>'s units all
        uncompressed guard their inputs as ``none`` does); else on the exchange's codec."""
        if not (self.inputs_keep_gradient_nonfinite and self.nonfinite == "raise"):
            return False
        if self.psync.guards_inputs:
            return True
        plan = self._guard_plan
        return plan is not None and self.launch_psync() is self.psync and self.psync.plan_guards_inputs(plan.exchange)

    def disable_overlap(self) -> None:
        """This instance's exchange cannot start in backward (e.g. DGC with clipping, CSER
        without a gradient exchange): ``step()`` does everything; the hooks are removed."""
        self.overlap_backward = False
        self._guard_plan = None
        _remove_hooks(self._handles)

    # -- the method's two halves --------------------------------------------------------
    def exchange_input(self, group: dict, p: torch.Tensor) -> torch.Tensor:
        """What goes into PSync for ``p`` this step, with its state changes (logged with
        :meth:`replaced` so that a skipped step can put them back)."""
        raise NotImplementedError

    def apply_exchange(self, pairs: list, aggregates: list, residuals: list | None) -> None:
        """Apply the exchange's result to ``pairs`` (``(group, param)``, in the order of
        ``aggregates`` and ``residuals``)."""
        raise NotImplementedError

    def sent_losslessly(self, p: torch.Tensor) -> bool:
        """Whether this step's exchange plan sends ``p`` with a lossless codec (``none``, or a
        unit auto:<codec> sends uncompressed): what :meth:`exchange_input` may ask."""
        return self._plan is not None and id(p) in self._plan.lossless

    @staticmethod
    def descend(pairs: list, aggregates: list) -> None:
        """``x ← x − η · a`` for each ``(group, x)`` of ``pairs`` and its ``a`` of
        ``aggregates``, η its group's lr: one ``_foreach`` call per learning rate."""
        by_lr: dict = {}
        for (group, p), agg in zip(pairs, aggregates):
            params, aggs = by_lr.setdefault(group["lr"], ([], []))
            params.append(p)
            aggs.append(agg)
        for lr, (params, aggs) in by_lr.items():
            torch._foreach_add_(params, aggs, alpha=-lr)

    def launch_psync(self):
        """The PSync whose plan cuts the step into buckets (default: ``self.psync``)."""
        return self.psync

    def start_bucket(self, members: list, inputs: list, step: int, plan) -> list[tuple[list, Pending]]:
        """Launch one bucket (``plan``: its part of the exchange plan): ``(members, pending)``
        per exchange started (default: one ``self.psync.start`` over all members, which
        digests the gradients it copies as they are for the edit guard)."""
        return [(members, self.psync.start(inputs, step, keys=self.keys(members), residual=self.exchange_residual,
                                           plan=plan, digest_inputs=True))]

    def apply_bucket(self, pairs: list, pending: Pending, result) -> None:
        """Apply one exchange of a bucket (``pairs`` its members)."""
        self.apply_exchange(pairs, result.aggregate, result.residual)

    def finish_exchange(self, pairs: list) -> None:
        """After every bucket was applied (``pairs``: the step's, in parameter order)."""

    # -- the public surface -------------------------------------------------------------
    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients (the hooks stay idle, like
        DDP's ``no_sync``); the last backward of the step runs outside, then ``step()``."""
        self._accumulating += 1
        try:
            yield
        finally:
            self._accumulating -= 1

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if getattr(self, "overlap_backward", False):
            self._register_hooks(self.param_groups[-1]["params"])

    @torch.no_grad()
    def step(self, closure=None):
        if self.overlap_backward:   # the exchange started in backward's hooks; the rest here
            loss, run, skipped = self.begin_overlapped_step(closure)
        else:                       # everything here, one PSync call
            (loss, pairs, params, skipped), run = self.begin_step(closure), None
        if skipped:
            return loss
        try:
            if run is None:
                self._replan(pairs, self.steps)   # the plan exchange_input may ask (sent_losslessly)
                inputs = [self.exchange_input(group, p) for group, p in pairs]
                result = self.psync(inputs, self.steps, keys=self.keys(params), residual=self.exchange_residual)
                self.apply_exchange(pairs, result.aggregate, result.residual)
            else:
                for pairs, pending, result in self._wait_buckets(run):   # all decoded before any is applied
                    self.apply_bucket(pairs, pending, result)
                self.finish_exchange(run.pairs)
        except NonFiniteAggregate as overflow:  # a codec overflowed: undo + skip, or raise
            return self.codec_overflow(overflow, loss)
        self.after_exchange()
        return loss

    def after_exchange(self) -> None:
        """Runs once a step's exchange has been applied (not on a skipped step); the
        methods here need nothing more. :class:`~gradzip.optim.Compressed` steps its inner
        optimizer."""

    # -- overlap_backward=True ----------------------------------------------------------------
    def _register_hooks(self, params) -> None:
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            opt = ref()
            if opt is not None:
                opt._gradient_ready(p)

        for p in params:
            if p.requires_grad and p.is_leaf and id(p) not in self._hooked:
                self._handles.append(p.register_post_accumulate_grad_hook(hook))
                self._hooked.add(id(p))

    def _gradient_ready(self, p: torch.Tensor) -> None:
        """The hook: feed ``p``'s exchange input, launch the buckets that became ready (not
        while accumulating: :meth:`accumulate`, or a DDP wrapper's ``no_sync()``)."""
        if self._accumulating or not self.overlap_backward or self.ddp_accumulating():
            return
        if torch.is_grad_enabled():   # backward(create_graph=True); else autograd runs hooks without
            with torch.no_grad():     # grad mode, and the context (microseconds) is skipped, per tensor
                return self._gradient_ready(p)
        run = self._current_run()
        if p not in run.plan.where:
            return
        if p in run.inputs:
            raise GradzipError(
                f"{type(self).__name__}: parameter #{self._keys[p]} (shape {tuple(p.shape)}) got a second "
                "gradient before step(), after its exchange had started; accumulate micro-batches "
                "inside `with opt.accumulate():` (the last backward outside it), or pass "
                "overlap_backward=False")
        if p.grad.layout != torch.strided:   # refused (check_dense), the step as if never begun
            self._run = None
            self._discard(run, uncount=True)
            self.check_dense(p)
        self._feed(run, p)
        # the snapshot of what the exchange reads, when it reads it: an input that is the
        # gradient itself is read when its bucket launches (_launch_ready), a copy now
        run.seen[p] = (p.grad, p.grad._version)
        if run.inputs[p] is not p.grad:
            run.snapshots.append((p.grad, snapshot(p.grad)))
        else:
            run.deferred[p] = p.grad
            if not run.rest_queued:
                run.rest_queued = True
                _at_backward_end(lambda: _snapshot_rest(run))
        self._launch_ready(run)

    def _current_run(self) -> _Run:
        if self._run is None:
            verifying = not self._verified
            self.verify_once()   # before the first collective of this optimizer
            # the set last agreed on, else the participating one (a change: step() exchanges again)
            self._replan(self.participating() if self._plan is None or verifying else self._plan.pairs,
                         self.steps + 1)
            self._run = self._new_run()
        return self._run

    def _replan(self, pairs: list, step: int) -> None:
        """Buckets over ``pairs``, a set the workers agree on (the settings check, or
        :meth:`agree`), for the exchange of ``step``; kept where it is the plan's already.
        auto:<codec>: the launching PSync's decision for that set is made first where it is
        due (collective: every worker calls this at the same point, before the step's first
        bucket)."""
        psync, params = self.launch_psync(), [p for _, p in pairs]
        keys = self.keys(params)
        psync.prepare(params, keys, step)
        if self._plan is None or self._plan.key != _plan_key(pairs, psync):
            self._plan = _Plan(pairs, psync, keys)

    def _new_run(self) -> _Run:
        self.start_undo_log()
        self._guard_plan = self._plan
        return _Run(self._plan, self.steps + 1, [(x.bytes_sent, x.payload_bytes) for x in self._exchanges])

    def _feed(self, run: _Run, p: torch.Tensor) -> None:
        if not p.requires_grad:                  # frozen since the plan: never applied (the step exchanges again)
            run.inputs[p] = torch.zeros_like(p)
        else:                                    # its gradient is checked with its bucket's (_check_bucket)
            run.inputs[p] = self.exchange_input(run.plan.group[p], p)
        run.missing[run.plan.where[p]] -= 1

    def _launch_ready(self, run: _Run) -> None:
        buckets = run.plan.buckets
        while not run.poisoned and len(run.launched) < len(buckets) and run.missing[len(run.launched)] == 0:
            b = len(run.launched)
            members = buckets[b]
            self._check_bucket(run, members)
            if run.poisoned:
                break
            launched = self.start_bucket(members, [run.inputs[p] for p in members], run.step,
                                         run.plan.exchange.select([b]))
            run.launched.append(launched)
            if run.deferred:   # the deferred snapshots: the digests made in the bucket's copy, else now
                made = {id(m): d for ms, pending in launched for m, d in zip(ms, pending.digests) if d is not None}
                _take_snapshots(run, [p for p in members if p in run.deferred], made)

    def _check_bucket(self, run: _Run, members: list) -> None:
        """A bucket's gradients, once all are fed and before it launches, in one batched
        check (:func:`~gradzip.guards.nonfinite.first_nonfinite`; none where the exchange
        checks them itself): each non-finite one sends zeros in place of its input (never
        applied: the step raises or is skipped; what its input changed is put back then)."""
        if self.nonfinite == "off" or self.gradients_checked_by_exchange():
            return
        fed = [p for p in members if p.requires_grad]
        if first_nonfinite([p.grad for p in fed]) < 0:
            return
        for p in fed:
            if first_nonfinite([p.grad]) >= 0:
                run.bad.add(self._keys[p])
                run.inputs[p] = torch.zeros_like(p)
        run.poisoned = self.nonfinite == "raise"

    def _feed_rest(self, run: _Run) -> None:
        for members in run.plan.buckets:
            for p in members:
                if p not in run.inputs:
                    self._feed(run, p)
        self._launch_ready(run)

    def _discard(self, run: _Run, uncount: bool) -> None:
        """Wait for ``run``'s launched exchanges (the peers take part in them), drop their
        results, put back what its inputs changed and (``uncount``: a skipped step, as if it
        never happened) its byte counters."""
        for _, pending in (x for exchanges in run.launched for x in exchanges):
            try:
                pending.wait()
            except NonFiniteAggregate:
                pass
        self.restore_replaced()
        if uncount:
            self.forget_exchanges(len(run.counters))
            for psync, (sent, payload) in zip(self._exchanges, run.counters):
                psync.bytes_sent, psync.payload_bytes = sent, payload

    def forget_exchanges(self, count: int) -> None:
        """A skipped step: drop the exchanges created since the step began (their number was
        ``count``); a method that keeps them elsewhere too (DGC) overrides this."""
        del self._exchanges[count:]

    def begin_overlapped_step(self, closure):
        """``begin_step`` with ``overlap_backward``: evaluate the closure (its backward fires
        the hooks), feed and launch what the hooks did not, run the guards (module docstring)
        and count the step. Returns ``(loss, run, skipped)``."""
        loss = self._evaluate(closure)           # its backward fires the hooks
        self.refuse_step_while_accumulating()
        run = self._current_run()                # verifies first if no hook did
        self._run = None                         # this step consumes it, whatever happens
        pairs = run.pairs = self.params_with_grad()   # a missing gradient becomes zeros
        params = [p for _, p in pairs]
        _snapshot_rest(run)                      # (where no backward's end did: hooks fired by hand)
        stale = _changed_since_hooks(run)
        if stale:                                # a non-finite gradient a hook saw may be replaced since
            run.poisoned = False
        else:                                    # the hooks checked theirs; feeding checks the rest
            self._feed_rest(run)
        if stale or (run.bad and self.nonfinite == "raise"):
            first_bad = first_nonfinite([p.grad for p in params]) if self.nonfinite != "off" else -1
        else:
            first_bad = min((i for i, p in enumerate(params) if self._keys[p] in run.bad), default=-1)
        if self.nonfinite == "raise" and first_bad >= 0:  # what was sent stays counted
            self.restore_replaced()              # (not first_bad_gradient: it reads nothing where the
            self.raise_bad_gradient(params, first_bad,   # exchange checks, and would let this pass)
                                    "stopped before anything was updated (the exchanges begun in backward were sent)")
        self._feed_rest(run)                     # every bucket launched before the agreement
        moved = _plan_key(pairs, self.launch_psync()) != run.plan.key   # the set changed since the plan
        began = time.perf_counter()              # the one control collective of the step (and the set's
        flags = self.agree([first_bad, int(stale or moved)], pairs,   # agreement), behind the buckets:
                           cleanup=lambda: self._discard(run, uncount=True))   # it waits for their traffic
        if self.comm.world_size > 1:
            self._exchanges[0].count_wait(began, time.perf_counter())
        if max(row[0] for row in flags) >= 0:    # "skip": every worker skips this step
            self._discard(run, uncount=True)
            self.skipped_steps += 1
            return loss, run, True
        if max(row[1] for row in flags) > 0:     # a gradient changed after its hook, or the (agreed) set
            self._discard(run, uncount=False)    # since the plan: all exchange again; the traffic stays counted
            self._replan(pairs, self.steps + 1)
            run = self._new_run()
            run.pairs = pairs
            self._feed_rest(run)
        self.steps += 1
        return loss, run, False

    def _wait_buckets(self, run: _Run) -> list:
        """``(pairs, pending, result)`` per exchange of every bucket, once every bucket is decoded; a codec overflow in
        any is raised after all were waited for, naming the first tensor in the step's order."""
        params = [p for members in run.plan.buckets for p in members]
        params.sort(key=lambda p: self._keys[p])
        results, overflows = [], []
        for members, pending in (x for exchanges in run.launched for x in exchanges):
            try:
                results.append(([(run.plan.group[p], p) for p in members], pending, pending.wait()))
            except NonFiniteAggregate as error:
                overflows.append(_renumbered(error, members, params))
        if overflows:
            raise min(overflows, key=lambda e: e.index)
        return results


def _changed_since_hooks(run: _Run) -> bool:
    """Whether a gradient the hooks fed changed since: another tensor, its version counter,
    or its values (:func:`gradzip.optim.core.fingerprint.changed`: edits through ``.data``, or
    outside torch, that no version counter sees); one comparison per device."""
    if any(p.grad is not grad or p.grad._version != version for p, (grad, version) in run.seen.items()):
        return True
    return changed(run.snapshots)


def _take_snapshots(run: _Run, params: list, made: dict | None = None) -> None:
    """The deferred snapshots of ``params``' gradients: the digest made in their bucket's
    copy where ``made`` (by ``id``) has one; the small ones of one dtype and device together
    in one flat copy (one call for a bucket of hundreds of biases); each other large one its
    own."""
    small: dict = {}
    for p in params:
        grad = run.deferred.pop(p)
        if made and id(p) in made:
            run.snapshots.append((grad, made[id(p)]))
        elif grad.numel() > SMALL:
            run.snapshots.append((grad, snapshot(grad)))
        else:
            small.setdefault((grad.dtype, grad.device), []).append(grad)
    run.snapshots.extend((grads, snapshot(grads)) for grads in small.values())


def _snapshot_rest(run: _Run) -> None:
    """The snapshots still deferred (their buckets wait for a gradient that is not ready,
    or fed at ``step()``): taken at the end of backward, before any code can edit them."""
    if run.deferred:
        _take_snapshots(run, list(run.deferred))


def _at_backward_end(callback) -> None:
    """Run ``callback`` when the backward pass running this hook ends (autograd's queued
    callbacks, as DDP's reducer uses); at once where no backward runs."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    except RuntimeError:
        callback()


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def _renumbered(error: NonFiniteAggregate, members: list, params: list) -> NonFiniteAggregate:
    """``error`` of a bucket's exchange, naming the tensor by its position among ``params``
    (the step's order, as one exchange of every tensor names it) instead of in the bucket."""
    index = next(i for i, p in enumerate(params) if p is members[error.index])
    message = str(error).replace(f"tensor #{error.index} ", f"tensor #{index} ", 1)
    renamed = NonFiniteAggregate(message, index)
    renamed.__cause__ = error.__cause__
    return renamed
