"""The generic DDP hook: any gradzip codec, with error feedback (docs/ddp.md, "The generic
hook"). Per parameter tensor ``i`` of each bucket::

    v_i = g_i + e_i;   g_i ← aggregate_j C(v_j);   e_i ← v_i − C(v_i)

PSync (docs/algorithms.md §PSync) with the residual kept as error memory: EF-SGD on
the raw gradient; the optimizer after DDP applies learning rate, momentum and weight decay.
"""

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ...compressors import Auto, Compressor, PerTensor, build
from ...errors import GradzipError
from ...exchange import DEFAULT_BUCKET_BYTES, PSync, calibration
from ...exchange.calibration import check_recalibrate_every
from ...exchange.planner import Link, as_link
from ...guards.nonfinite import all_finite
from ...kernels.sums import mean_in_place
from ...validation import refuses_unknown_options
from .state import HookState, views

class _Bucket(NamedTuple):
    """One bucket in flight: its future, exchange, gradient views, keys, buffer, and
    whether its gradient held a NaN or Inf on this rank. ``native``: sent as DDP sends it
    (the allreduce of the bucket's own buffer, :meth:`CodecState.sends_uncompressed`)."""
    fut: torch.futures.Future
    work: Any
    views: list
    keys: list
    buffer: torch.Tensor
    bad: bool
    native: bool = False


class CodecState(HookState):
    """State of :func:`codec_hook`: the codec, error feedback, residuals by parameter key.

    ``error_feedback=None`` (default): on for biased codecs, off for unbiased ones
    (:attr:`Compressor.unbiased`: error feedback only adds their variance to the next step;
    ``qsgd`` with it reaches NaN within 20 steps in tests/test_ddp.py) and for ``"none"``
    (its residual is zero: the same numbers without a residual's pass and memory);
    ``True`` with an unbiased codec is refused, as is the single-round ``powersgd`` codec
    unless ``single_round_powersgd=True`` (the two-round PowerSGD is :func:`powersgd_hook`).
    ``codec`` may be a :class:`gradzip.PerTensor` policy (a codec per parameter; its name
    rules need ``model=``), or ``"auto:<codec>"`` (docs/algorithms.md §Auto codec choice:
    per unit of each DDP bucket's plan, the codec or uncompressed, decided at the first step
    (for DDP's initial buckets; the buckets it rebuilds after that step, and a resumed run,
    execute those decisions per parameter: :meth:`PSync._sources`) from measured costs, or
    the declared ``link``; again every
    ``recalibrate_every`` steps; the decisions are in :attr:`decisions` and the
    ``state_dict()``). ``start_iter``: the first ``start_iter`` steps allreduce the
    gradients uncompressed, without error feedback (a dense warm-up, as PowerSGD's
    ``start_iter``); compression starts at step ``start_iter + 1``.
    ``nonfinite``: see :meth:`HookState.settle`."""

    @refuses_unknown_options
    def __init__(self, codec: "str | Compressor" = "none", *, error_feedback: bool | None = None,
                 model: torch.nn.Module | None = None, process_group: Any = None, seed: int = 0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, nonfinite: str = "raise",
                 single_round_powersgd: bool = False, start_iter: int = 0, link: "str | Link | None" = None,
                 recalibrate_every: int | None = None):
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise GradzipError(f"DDP hook: start_iter must be an integer >= 0 (dense steps before "
                               f"compression starts), got {start_iter!r}")
        self.start_iter = start_iter
        self.codec = build(codec)
        try:
            self.link = None if link is None else as_link(link)
        except GradzipError as exc:
            raise GradzipError(f"DDP hook: {exc}") from None
        self.recalibrate_every = check_recalibrate_every(recalibrate_every, "DDP hook")
        #: auto:<codec>: the decisions per set of tensors (PSync.decisions), kept here so that
        #: they survive pickling and the state_dict
        self.decisions: dict = {}
        if getattr(self.codec, "codec", self.codec).name == "powersgd" and single_round_powersgd is not True:
            raise GradzipError(
                f"DDP hook: {self.codec.spec!r} is the single-round PowerSGD codec, which diverges where "
                "PowerSGD is expected; use PowerSGD's hook: model.register_comm_hook("
                "gradzip.integrations.ddp.PowerSGDState(rank=..., model=model), gradzip.integrations.ddp.powersgd_hook) "
                "(or pass single_round_powersgd=True to mean the codec)")
        if error_feedback is None:
            error_feedback = self.codec.error_feedback_by_default
        if not isinstance(error_feedback, bool):
            raise GradzipError(f"DDP hook: error_feedback must be True, False or None, got {error_feedback!r}")
        self.codec.refuse_error_feedback(error_feedback, "DDP hook")
        self.error_feedback = error_feedback
        self.seed = int(seed)
        self.bucket_bytes = int(bucket_bytes)
        self.residuals: dict[int, torch.Tensor] = {}
        self._psync = self._dense = None
        super().__init__(model, process_group, nonfinite)

    _transient = HookState._transient + ("_psync", "_dense")

    @property
    def comm_hook(self):
        return codec_hook

    @property
    def psync(self) -> PSync:
        if self._psync is None:
            # exact transports only: the hook's state has no place for two-phase server errors
            self._psync = PSync(self.comm, self.codec, seed=self.seed, bucket_bytes=self.bucket_bytes,
                                allow_twophase=False, link=self.link, recalibrate_every=self.recalibrate_every)
            self._psync.names = self.names
            self._psync.decisions = self.decisions   # shared: made there, kept here
        return self._psync

    @property
    def dense(self) -> PSync:
        """The uncompressed exchange of the warm-up steps (``start_iter``)."""
        if self._dense is None:
            self._dense = PSync(self.comm, "none", seed=self.seed, bucket_bytes=self.bucket_bytes)
        return self._dense

    def __setstate__(self, state: dict) -> None:
        state.setdefault("start_iter", 0)
        state.setdefault("link", None)
        state.setdefault("recalibrate_every", None)
        state.setdefault("decisions", {})
        super().__setstate__(state)
        self._psync = self._dense = None

    def rescale(self, factor: float) -> None:
        """Multiply every residual by ``factor`` (e.g. after a GradScaler scale change)."""
        for r in self.residuals.values():
            r.mul_(factor)

    def state_dict(self) -> dict:
        """Tensors and plain values only: loads with ``torch.load``'s defaults."""
        self._check_fresh()
        return {"codec": self.codec.spec, "error_feedback": self.error_feedback, "seed": self.seed,
                **self.counters(), "start_iter": self.start_iter,
                "residuals": {k: v.clone() for k, v in self.residuals.items()},
                **({"auto": calibration.save(self.decisions)} if self.decisions else {})}

    def load_state_dict(self, state: dict) -> None:
        if state["codec"] != self.codec.spec:
            if state["codec"].startswith(PerTensor.name):
                raise GradzipError(f"DDP hook: this state was saved with the policy {state['codec']}; "
                                   "construct the hook state with that PerTensor policy, then load it")
            self.codec = build(state["codec"])
        self._psync = self._dense = None
        self.start_iter = int(state.get("start_iter", 0))
        self.error_feedback, self.seed = bool(state["error_feedback"]), int(state["seed"])
        self.load_counters(state)
        self.residuals = {int(k): v.clone() for k, v in state["residuals"].items()}
        self.decisions = calibration.load(state.get("auto", []))   # auto:<codec>: executed as saved

    def sends_uncompressed(self, bucket: dist.GradBucket, params: list, keys: list, step: int,
                           compressing: bool) -> bool:
        """Whether this bucket goes as DDP sends it: the allreduce of its own buffer, then
        the mean in place (no copy, no codec; the numbers of the ``none`` exchange bit for
        bit). So it goes where every tensor of it is sent uncompressed (a dense warm-up
        step, ``"none"``, or every unit of auto's decision ``none``: deciding it is
        collective) in a dtype the exchange sums in as it is (float32, float64). ``params``:
        the bucket's parameters (their shapes and dtypes are the gradients')."""
        if bucket.buffer().dtype not in (torch.float32, torch.float64):
            return False
        if not compressing:
            return True
        if not isinstance(self.codec, (Auto, PerTensor)):
            return self.codec.name == "none"
        _, plan = self.psync.exchange_plan(params, keys, step)
        return all(codec.name == "none" for codec in plan.codecs)

    def _start_native(self, bucket: dist.GradBucket, keys: list, feedback: bool) -> torch.futures.Future:
        """Launch the allreduce of the bucket's buffer (:meth:`sends_uncompressed`); a
        residual kept for its tensors (a unit auto switched to ``none``) is added in and so
        sent whole, and dropped once the step counts (docs/algorithms.md §Auto codec
        choice, "Residual folding")."""
        folded = [key for key in keys if feedback and key in self.residuals]
        if folded:
            for view, key in zip(views(bucket), keys):
                if key in self.residuals:   # feedback is on: each is one of folded
                    view.add_(self.residuals[key])
        buffer, n, check = bucket.buffer(), self.comm.world_size, self.nonfinite != "off"
        work = self.comm.allreduce(buffer, async_op=True).then(lambda total: _mean_is_finite(total, n, check))
        fut = torch.futures.Future()
        self._pending.append(_Bucket(fut, work, None, folded, buffer, False, native=True))
        return fut

    def _start_coded(self, bucket: dist.GradBucket, views: list, keys: list, step: int, compressing: bool,
                     feedback: bool) -> torch.futures.Future:
        """Compress the bucket's gradients (``v = g + e`` with error feedback) and launch
        their exchange through the hook's PSync (the dense one on a warm-up step)."""
        carried = []
        for view, key in zip(views, keys):
            v = view.to(torch.promote_types(view.dtype, torch.float32))
            if feedback and key in self.residuals:
                v = v + self.residuals[key]
            carried.append(v)
        bad = self.nonfinite != "off" and not all_finite(views)
        psync = self.psync if compressing else self.dense
        work = psync.start(carried, step, keys=keys, residual=feedback)
        fut = torch.futures.Future()
        self._pending.append(_Bucket(fut, work, views, keys, bucket.buffer(), bad))
        return fut

    def _finish_all(self) -> bool:
        """Wait for every bucket of the step, apply ``nonfinite``, write the buckets and the
        residuals; whether the step counts (not skipped). A native bucket's mean is checked
        on the sum itself, the same on every rank (a NaN or Inf in any rank's gradient makes
        it non-finite), so it needs no agreement; the other buckets' checks are agreed."""
        pending, self._pending = self._pending, []
        results = [b.work.wait() for b in pending]
        sums_bad = not all(finite for b, finite in zip(pending, results) if b.native)   # _mean_is_finite's
        coded = [(b, r) for b, r in zip(pending, results) if not b.native]
        output_bad = self.nonfinite != "off" and not all(   # the codec overflowed (qsgd's norm, a residual)
            all_finite(list(r.aggregate)) and (r.residual is None or all_finite(list(r.residual)))
            for _, r in coded)
        try:
            where = self.agree(any(b.bad for b, _ in coded), output_bad) if coded else None
            if where is None and sums_bad:
                where = "in the allreduced sums of the uncompressed buckets (every rank's)"
            skipped = self.settle(where, [b.buffer for b in pending], "codec_hook")
        except GradzipError as error:
            for b in pending:
                b.fut.set_exception(error)
            raise
        for b, result in zip(pending, results):
            if b.native:
                if not skipped:
                    for key in b.keys:   # the folded residuals: sent
                        del self.residuals[key]
            elif not skipped:
                for i, (view, agg, key) in enumerate(zip(b.views, result.aggregate, b.keys)):
                    if self.error_feedback and result.residual is not None:   # None: a dense warm-up step
                        residual = result.residual[i]
                        if all_finite([residual]):   # nonfinite="off": keep the old one
                            self.residuals[key] = residual
                    view.copy_(agg.reshape(view.shape))
            b.fut.set_result(b.buffer)
        return not skipped


def _mean_is_finite(total: torch.Tensor, n: int, check: bool) -> bool:
    """A native bucket's allreduced sum made the mean in place (the ``none`` codec's
    ``from_sum``), and whether it is finite (True when unchecked), in the division's own pass
    (:func:`gradzip.kernels.sums.mean_in_place`). Chained to the allreduce (``Work.then``):
    on gloo/NCCL it runs on the backend's thread as the sum arrives, while backward goes on,
    as the division of PyTorch's ``allreduce_hook``."""
    if not check:   # nonfinite="off": the division alone (no sum, no device sync)
        total.div_(n)
        return True
    return mean_in_place(total, n)


def hook(codec: "str | Compressor" = "none", error_feedback: bool | None = None, **options: Any) -> CodecState:
    """A :class:`CodecState` for :func:`codec_hook`:
    ``ddp.register_comm_hook(gradzip.integrations.ddp.hook("topk:ratio=0.01", model=ddp), gradzip.integrations.ddp.codec_hook)``.
    ``options``: ``model``, ``process_group``, ``seed``, ``bucket_bytes``, ``nonfinite``,
    ``single_round_powersgd``, ``start_iter``, ``link``, ``recalibrate_every``. ``codec``: a spec, a codec or a
    :class:`gradzip.PerTensor` policy."""
    return CodecState(codec, error_feedback=error_feedback, **options)


def codec_hook(state: CodecState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: compress each gradient of the bucket with ``state.codec``
    (error feedback if enabled) and write the aggregate into the bucket; the last bucket
    of a step finishes them all (see :class:`CodecState`)."""
    params = bucket.parameters()
    keys = [state._key(p) for p in params]
    step = state.iter + 1
    compressing = step > state.start_iter          # else a dense warm-up step: no error feedback
    feedback = state.error_feedback and compressing
    fut = (state._start_native(bucket, keys, feedback)
           if state.sends_uncompressed(bucket, params, keys, step, compressing)
           else state._start_coded(bucket, views(bucket), keys, step, compressing, feedback))
    if bucket.is_last() and state._finish_all():
        state.iter += 1
    return fut
