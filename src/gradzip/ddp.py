"""gradzip codecs inside ``torch.nn.parallel.DistributedDataParallel``: communication hooks.

Two hooks, PyTorch style (a state object plus a function, for
``DistributedDataParallel.register_comm_hook(state, hook)``):

* :func:`hook` / :class:`CodecState` + :func:`codec_hook`: **any gradzip codec**, with
  optional error feedback. Per parameter tensor ``i`` of each bucket::

      v_i = g_i + e_i;   g_i ← aggregate_j C(v_j);   e_i ← v_i − C(v_i)

  i.e. PSync (spec, "Notation") with the residual kept as error memory (EF-SGD on the raw
  gradient; the optimizer after DDP applies learning rate, momentum and weight decay).
  ``error_feedback=False`` drops the residual (for unbiased codecs: ``qsgd``,
  ``terngrad``, ``randomk:unbiased=true``). With ``"none"`` it is DDP's default allreduce.
* :class:`PowerSGDState` + :func:`powersgd_hook`: PowerSGD with two allreduce rounds, the
  same algorithm, options and random ``Q`` draws as PyTorch's
  ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` (its results agree to
  float rounding; ``tests/test_ddp.py`` checks it), with three fixes (below).

Usage::

    import gradzip.ddp
    model = DistributedDataParallel(net)
    state = gradzip.ddp.hook("topk:ratio=0.01", error_feedback=True, model=model)
    model.register_comm_hook(state, gradzip.ddp.codec_hook)
    # or: state = gradzip.ddp.PowerSGDState(rank=2, start_iter=100, model=model)
    #     model.register_comm_hook(state, gradzip.ddp.powersgd_hook)
    ...
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "hook": state.state_dict()}, path)          # or pickle the state itself
    state.load_state_dict(checkpoint["hook"])              # into a fresh state and DDP

**State keyed by parameter, not by bucket.** DDP rebuilds its buckets after the first
iteration (and bucket indices then mean other tensors); PyTorch's PowerSGD keys its error
and ``Q`` by bucket index, which is why it needs ``start_powerSGD_iter >= 2`` and why a
checkpoint cannot move to a different bucket layout. Here residuals, errors and ``Q``
are keyed by the parameter's position in ``model.parameters()`` (pass ``model=``: the DDP
module or the wrapped one), so bucket rebuilds, a new DDP instance and another
``bucket_cap_mb`` cannot mix them up, and ``start_iter`` may be 0 or 1. Without
``model=`` the keys are the order in which the hook first sees the parameters, which is
DDP's initial bucket order, deterministic for a given model (so it also survives a
restore into a new DDP instance of the same model), but ``model=`` is the safe choice.

**Checkpointing.** ``state.state_dict()`` / ``load_state_dict()`` carry every residual,
error, ``Q``, the step counter and the random state; states also pickle (``torch.save(state)``):
the process group and the communication handles are dropped and re-created on first use
(the default group, or ``state.process_group`` set after loading). PyTorch issue 75666 is
the pain this avoids.

**Collectives are issued in the same order on every rank.** PyTorch's PowerSGD issues its
second and third allreduce from future callbacks, which run on whichever thread completes
the previous collective, so two buckets' collectives can be issued in different orders on
different ranks; gloo then matches messages of different sizes ("Received data size
doesn't match expected size"). These hooks issue every collective from the thread that
calls the hook, in bucket order: bucket ``b``'s hook first moves bucket ``b − 1`` to its
``Q`` round, then launches bucket ``b``'s ``P`` round; the last bucket's hook finishes all.
That is also the overlap of PyTorch issue 74148: the ``P`` allreduce of one bucket runs
while backward computes the next, and its ``Q`` round overlaps the next bucket's ``P``
round. The uncompressed tensors of a bucket travel in the same allreduce as its ``P``
(PyTorch: a separate allreduce before it): two rounds per bucket instead of three.
``overlap=False`` finishes each bucket inside its own hook call (for measurements).

**Gradient accumulation (``no_sync()``).** Inside ``with model.no_sync():`` DDP does not
call the hook; gradients accumulate locally in ``.grad``. The next synchronised backward
calls the hook once with the accumulated gradient: error feedback then applies once to
the accumulated gradient, the step counter (``state.iter``: shared random seeds,
``start_iter``) counts synchronised steps only, and nothing is lost. (A residual is a
property of what was *sent*, so accumulation before compression is exactly right.)

**AMP.** Under ``torch.autocast`` parameters and gradients stay float32, so nothing
changes. With ``GradScaler``, gradients reach the hook multiplied by the loss scale, so
residuals are in scaled units: when the scaler changes its scale, call
``state.rescale(new_scale / old_scale)`` (or accept a transient mis-scaled residual);
a step whose gradients overflow (inf/NaN, which the scaler then skips) leaves every
residual, error and ``Q`` untouched. With fp16 / bf16 *parameters* (``model.half()``)
the bucket is fp16 / bf16: the codecs and PowerSGD compute in float32, residuals are kept
in float32, and only the result written back into the bucket is cast. (PyTorch's PowerSGD
computes in the bucket's dtype.)
"""
from collections import defaultdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .compressors import Compressor, build
from .compressors.powersgd import matrix_shape, orthogonalize, should_compress
from .errors import GradzipError
from .exchange import DEFAULT_BUCKET_BYTES, PSync
from .validation import is_int

__all__ = ["CodecState", "codec_hook", "hook", "PowerSGDState", "powersgd_hook"]


class _HookState:
    """What both hook states share: stable parameter keys, the group, pickling."""

    _transient = ("process_group", "_comm", "_ids", "_pending")

    def __init__(self, model: torch.nn.Module | None, process_group: Any):
        self.process_group = process_group
        self.iter = 0                    # synchronised steps completed (hook rounds)
        self._comm = None
        self._pending: list = []
        self._ids: dict[int, int] = {}   # id(param) -> key
        self._next_key = 0
        self.keys_from: str | None = None   # "model" (bind) or "first_seen"
        if model is not None:
            self.bind(model)

    def bind(self, model: torch.nn.Module) -> None:
        """Key every parameter by its position in ``model.parameters()`` (stable)."""
        module = getattr(model, "module", model)
        self._ids = {id(p): i for i, p in enumerate(module.parameters())}
        self._next_key = len(self._ids)
        self.keys_from = "model"

    def _key(self, param: torch.Tensor) -> int:
        key = self._ids.get(id(param))
        if key is None:
            if self.keys_from == "model":
                raise GradzipError("DDP hook state: a parameter of the bucket is not in the bound model; "
                                   "after unpickling a state, call state.bind(model)")
            # no model bound: first-seen order (DDP's initial bucket order)
            key = self._ids[id(param)] = self._next_key
            self._next_key += 1
            self.keys_from = "first_seen"
        return key

    @property
    def comm(self):
        if self._comm is None:
            from .comm import TorchGroup
            self._comm = TorchGroup(self.process_group)
        return self._comm

    @property
    def bytes_sent(self) -> int:
        return self._comm.bytes_sent if self._comm is not None else 0

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in self._transient}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.process_group, self._comm, self._pending, self._ids = None, None, [], {}
        self._next_key = 0   # first-seen keys are re-derived on first use; model keys need bind()

    def _check_fresh(self) -> None:
        if self._pending:
            raise GradzipError("a DDP hook state was checkpointed in the middle of a backward pass")


# ---------------------------------------------------------------------------------------
# any codec
# ---------------------------------------------------------------------------------------
class CodecState(_HookState):
    """State of :func:`codec_hook`: the codec, error feedback, residuals by parameter key."""

    def __init__(self, codec: "str | Compressor" = "none", *, error_feedback: bool = True,
                 model: torch.nn.Module | None = None, process_group: Any = None, seed: int = 0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.codec = build(codec)
        self.error_feedback = bool(error_feedback)
        self.seed = int(seed)
        self.bucket_bytes = int(bucket_bytes)
        self.residuals: dict[int, torch.Tensor] = {}
        self._psync = None
        super().__init__(model, process_group)

    _transient = _HookState._transient + ("_psync",)

    @property
    def psync(self) -> PSync:
        if self._psync is None:
            self._psync = PSync(self.comm, self.codec, seed=self.seed, bucket_bytes=self.bucket_bytes)
        return self._psync

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._psync = None

    def rescale(self, factor: float) -> None:
        """Multiply every residual by ``factor`` (e.g. after a GradScaler scale change)."""
        for r in self.residuals.values():
            r.mul_(factor)

    def state_dict(self) -> dict:
        self._check_fresh()
        return {"codec": self.codec.spec, "error_feedback": self.error_feedback, "seed": self.seed,
                "iter": self.iter, "residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.codec, self._psync = build(state["codec"]), None
        self.error_feedback, self.seed, self.iter = bool(state["error_feedback"]), int(state["seed"]), int(state["iter"])
        self.residuals = {int(k): v.clone() for k, v in state["residuals"].items()}

    def _finish_all(self) -> None:
        pending, self._pending = self._pending, []
        for fut, work, views, keys, buffer in pending:
            result = work.wait()
            for i, (view, agg, key) in enumerate(zip(views, result.aggregate, keys)):
                if self.error_feedback:
                    residual = result.residual[i]
                    if bool(torch.isfinite(residual).all()):   # an overflowed AMP step keeps the old one
                        self.residuals[key] = residual
                view.copy_(agg.reshape(view.shape))
            fut.set_result(buffer)


def hook(codec: "str | Compressor" = "none", error_feedback: bool = True, **options: Any) -> CodecState:
    """A :class:`CodecState` for :func:`codec_hook`:
    ``ddp.register_comm_hook(gradzip.ddp.hook("topk:ratio=0.01", model=ddp), gradzip.ddp.codec_hook)``.
    ``options``: ``model``, ``process_group``, ``seed``, ``bucket_bytes``."""
    return CodecState(codec, error_feedback=error_feedback, **options)


def _views(bucket: "dist.GradBucket") -> list[torch.Tensor]:
    """Each parameter's gradient as a view of the bucket's flat buffer, in bucket order."""
    buffer = bucket.buffer()
    out, offset = [], 0
    for g in bucket.gradients():
        out.append(buffer[offset:offset + g.numel()].view(g.shape))
        offset += g.numel()
    return out


def codec_hook(state: CodecState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: compress each gradient of the bucket with ``state.codec``
    (error feedback if enabled) and write the aggregate into the bucket (see the module)."""
    views = _views(bucket)
    keys = [state._key(p) for p in bucket.parameters()]
    step = state.iter + 1
    carried = []
    for view, key in zip(views, keys):
        v = view.to(torch.promote_types(view.dtype, torch.float32))
        if state.error_feedback and key in state.residuals:
            v = v + state.residuals[key]
        carried.append(v)
    work = state.psync.start(carried, step, keys=keys, residual=state.error_feedback)
    fut = torch.futures.Future()
    state._pending.append((fut, work, views, keys, bucket.buffer()))
    if bucket.is_last():
        state._finish_all()
        state.iter += 1
    return fut


# ---------------------------------------------------------------------------------------
# PowerSGD
# ---------------------------------------------------------------------------------------
class PowerSGDState(_HookState):
    """State of :func:`powersgd_hook`; options named and defaulted as PyTorch's
    ``PowerSGDState`` (``start_iter`` = its ``start_powerSGD_iter``, ``rank`` = its
    ``matrix_approximation_rank``, ``random_seed``, ``batch_tensors_with_same_shape``),
    plus ``model`` (stable keys), ``overlap`` (see the module docstring).

    ``Q`` is drawn as PyTorch draws it: per bucket, when a tensor of the bucket needs a
    fresh ``Q``, one seed from ``numpy.random.RandomState(random_seed)``, then standard
    normal draws for the bucket's compressed tensors grouped by shape, orthogonalised. The
    first ``start_iter`` synchronised steps are a plain allreduce-mean."""

    def __init__(self, rank: int = 1, start_iter: int = 1000, min_compression_rate: float = 2,
                 use_error_feedback: bool = True, warm_start: bool = True, orthogonalization_epsilon: float = 0.0,
                 random_seed: int = 0, batch_tensors_with_same_shape: bool = False, *,
                 model: torch.nn.Module | None = None, process_group: Any = None, overlap: bool = True):
        if not (is_int(rank) and rank >= 1):
            raise GradzipError(f"PowerSGDState: rank must be an integer >= 1, got {rank!r}")
        if not (is_int(start_iter) and start_iter >= 0):
            raise GradzipError(f"PowerSGDState: start_iter must be an integer >= 0, got {start_iter!r}")
        if not min_compression_rate >= 0:
            raise GradzipError(f"PowerSGDState: min_compression_rate must be >= 0, got {min_compression_rate!r}")
        self.rank, self.start_iter, self.min_compression_rate = rank, start_iter, min_compression_rate
        self.use_error_feedback, self.warm_start = bool(use_error_feedback), bool(warm_start)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.batch_tensors_with_same_shape = bool(batch_tensors_with_same_shape)
        self.overlap = bool(overlap)
        self.rng = np.random.RandomState(random_seed)
        self.errors: dict[int, torch.Tensor] = {}
        self.qs: dict[int, torch.Tensor] = {}
        super().__init__(model, process_group)

    def state_dict(self) -> dict:
        self._check_fresh()
        return {"iter": self.iter, "rng": self.rng.get_state(),
                "errors": {k: v.clone() for k, v in self.errors.items()},
                "qs": {k: v.clone() for k, v in self.qs.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.iter = int(state["iter"])
        self.rng.set_state(state["rng"])
        self.errors = {int(k): v.clone() for k, v in state["errors"].items()}
        self.qs = {int(k): v.clone() for k, v in state["qs"].items()}

    def rescale(self, factor: float) -> None:
        """Multiply the errors by ``factor`` (after a GradScaler scale change)."""
        for e in self.errors.values():
            e.mul_(factor)


class _PowerSGDBucket:
    """One bucket in flight through the two rounds."""

    def __init__(self, state: PowerSGDState, bucket: "dist.GradBucket"):
        self.state, self.fut = state, torch.futures.Future()
        self.buffer = bucket.buffer()
        views, keys = _views(bucket), [state._key(p) for p in bucket.parameters()]
        acc = torch.promote_types(self.buffer.dtype, torch.float32)
        self.dense, groups = [], defaultdict(list)   # groups: shape -> [(key, view, M)]
        for view, key in zip(views, keys):
            m = view.to(acc)   # no copy for a float32 bucket: M may alias the bucket (see finish)
            if state.use_error_feedback and key in state.errors:
                m = m + state.errors[key]
            if should_compress(view.shape, state.rank, state.min_compression_rate):
                rows, cols = matrix_shape(view.shape)
                groups[(rows, cols)].append((key, view, m.reshape(rows, cols)))
            else:
                self.dense.append((view, m))
        # batches in PyTorch's order (shape groups in first-appearance order)
        self.batches = []
        for (rows, cols), members in groups.items():
            chunks = [members] if state.batch_tensors_with_same_shape else [[x] for x in members]
            self.batches.extend(chunks)
        # one tensor: a view (no copy), as PyTorch; several of one shape: stacked
        self.ms = [b[0][2].unsqueeze(0) if len(b) == 1 else torch.stack([m for _, _, m in b]) for b in self.batches]
        self.aliased = [len(b) == 1 and b[0][2].data_ptr() == b[0][1].data_ptr() for b in self.batches]
        ranks = [min(m.shape[1], m.shape[2], state.rank) for m in self.ms]
        fresh = (not state.warm_start) or any(key not in state.qs for b in self.batches for key, _, _ in b)
        if fresh and self.batches:
            gen = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
            self.qs = [torch.randn(m.shape[0], m.shape[2], r, generator=gen, dtype=self.buffer.dtype).to(acc)
                       for m, r in zip(self.ms, ranks)]
        else:
            self.qs = [torch.stack([state.qs[key] for key, _, _ in b]).to(acc) for b in self.batches]
        for q in self.qs:
            orthogonalize(q, state.orthogonalization_epsilon)
        self.ps = [torch.bmm(m, q) for m, q in zip(self.ms, self.qs)]
        dense_flat = [m.reshape(-1) for _, m in self.dense]
        self.n_dense = sum(x.numel() for x in dense_flat)
        flat = dense_flat + [p.reshape(-1) for p in self.ps]
        acc_buf = torch.cat(flat) if flat else torch.zeros(0, dtype=acc)
        self.work = state.comm.allreduce(acc_buf, async_op=True)   # round 1: dense + P, fused
        self.stage = 1

    def q_round(self) -> None:
        n = self.state.comm.world_size
        total = self.work.wait()
        offset = 0
        for view, m in self.dense:
            view.copy_((total[offset:offset + m.numel()] / n).view(view.shape))
            offset += m.numel()
        for p in self.ps:   # PyTorch keeps the sum: the scale does not survive orthogonalisation
            p.copy_(total[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
            orthogonalize(p, self.state.orthogonalization_epsilon)
        self.qs = [torch.bmm(m.transpose(1, 2), p) for m, p in zip(self.ms, self.ps)]
        flat = [q.reshape(-1) for q in self.qs]
        buf = torch.cat(flat) if flat else torch.zeros(0, dtype=self.buffer.dtype)
        self.work = self.state.comm.allreduce(buf, async_op=True)   # round 2: Q
        self.stage = 2

    def finish(self) -> None:
        state, n = self.state, self.state.comm.world_size
        total = self.work.wait()
        offset, finite = 0, bool(torch.isfinite(total).all())
        for batch, m, p, q, aliased in zip(self.batches, self.ms, self.ps, self.qs, self.aliased):
            q.copy_(total[offset:offset + q.numel()].view(q.shape) / n)
            offset += q.numel()
            if not aliased and len(batch) == 1 and batch[0][1].dtype == p.dtype:
                # M is our own tensor: write M̂ straight into the bucket, then e = M − M̂ in place
                key, view, _ = batch[0]
                out = view.view(1, *m.shape[1:])
                torch.bmm(p, q.transpose(1, 2), out=out)
                if finite and state.use_error_feedback:
                    state.errors[key] = m[0].sub_(out[0]).view(view.shape)
                if finite and state.warm_start:
                    state.qs[key] = q[0].clone()
                continue
            approx = torch.bmm(p, q.transpose(1, 2))
            for i, (key, view, _) in enumerate(batch):
                if finite and state.use_error_feedback:   # e = M − M̂, before M̂ overwrites an aliased M
                    error = m[i] - approx[i] if aliased else m[i].sub_(approx[i])
                    state.errors[key] = error.view(view.shape)
                view.copy_(approx[i].view(view.shape))
                if finite and state.warm_start:
                    state.qs[key] = q[i].clone()
        self.fut.set_result(self.buffer)


def _dense_allreduce(state: _HookState, bucket: "dist.GradBucket") -> torch.futures.Future:
    buffer = bucket.buffer()
    buffer.div_(state.comm.world_size)
    work = state.comm.allreduce(buffer, async_op=True)
    fut = torch.futures.Future()
    state._pending.append((fut, work, buffer))
    return fut


def _finish_dense(pending: list) -> None:
    for fut, work, buffer in pending:
        work.wait()
        fut.set_result(buffer)


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: PowerSGD (see :class:`PowerSGDState` and the module)."""
    if state.iter < state.start_iter:
        for p in bucket.parameters():   # fix first-seen keys on DDP's initial buckets
            state._key(p)
        fut = _dense_allreduce(state, bucket)
        if bucket.is_last():
            pending, state._pending = state._pending, []
            _finish_dense(pending)
            state.iter += 1
        return fut
    for previous in state._pending:   # move the previous bucket to its Q round (same order on every rank)
        if previous.stage == 1:
            previous.q_round()
    current = _PowerSGDBucket(state, bucket)
    state._pending.append(current)
    if not state.overlap or bucket.is_last():
        pending, state._pending = state._pending, []
        for b in pending:
            if b.stage == 1:
                b.q_round()
        for b in pending:
            b.finish()
    if bucket.is_last():
        if state._pending:   # overlap=False leaves nothing pending
            raise GradzipError("internal: PowerSGD buckets left pending")
        if not state.warm_start:
            state.qs.clear()
        state.iter += 1
    return current.fut
