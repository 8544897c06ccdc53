"""PowerSGD as a DDP hook: PyTorch's ``powerSGD_hook`` algorithm, options and random ``Q``
draws (its results agree to float rounding; tests/test_ddp.py checks it), with state keyed
by parameter, collectives issued in bucket order from the hook's thread and two rounds per
bucket instead of three (docs/ddp.md, "PowerSGDState + powersgd_hook"; docs/algorithms.md
§PowerSGD)."""

from collections import defaultdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ...compressors.powersgd import matrix_shape, orthogonalize, should_compress
from ...errors import GradzipError
from ...validation import is_int, refuses_unknown_options
from ...guards.nonfinite import all_finite
from .state import HookState, views


def rng_state(rng: np.random.RandomState) -> dict:
    """``rng``'s state as a tensor and plain values (loads with ``torch.load``'s defaults)."""
    kind, key, pos, has_gauss, gauss = rng.get_state()
    return {"kind": str(kind), "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}


def set_rng_state(rng: np.random.RandomState, state: "dict | tuple") -> None:
    """Inverse of :func:`rng_state` (also takes numpy's own tuple, as older checkpoints hold)."""
    if isinstance(state, dict):
        state = (state["kind"], state["key"].numpy().astype(np.uint32), state["pos"],
                 state["has_gauss"], state["cached_gaussian"])
    rng.set_state(state)


class PowerSGDState(HookState):
    """State of :func:`powersgd_hook`; options named and defaulted as PyTorch's
    ``PowerSGDState`` (``start_iter`` = its ``start_powerSGD_iter``, ``rank`` = its
    ``matrix_approximation_rank``, ``random_seed``, ``batch_tensors_with_same_shape``),
    plus ``model`` (stable keys), ``overlap`` (``False``: each bucket finishes inside its own
    hook call, for measurements) and ``nonfinite`` (see :meth:`HookState.settle`; PowerSGD
    needs no extra collective for it: a NaN or Inf anywhere reaches every rank's sums).

    ``Q`` is drawn as PyTorch draws it: per bucket, when a tensor of the bucket needs a
    fresh ``Q``, one seed from ``numpy.random.RandomState(random_seed)``, then standard
    normal draws for the bucket's compressed tensors grouped by shape, orthogonalised. The
    first ``start_iter`` synchronised steps are a plain allreduce-mean."""

    @refuses_unknown_options
    def __init__(self, rank: int = 1, start_iter: int = 1000, min_compression_rate: float = 2,
                 use_error_feedback: bool = True, warm_start: bool = True, orthogonalization_epsilon: float = 0.0,
                 random_seed: int = 0, batch_tensors_with_same_shape: bool = False, *,
                 model: torch.nn.Module | None = None, process_group: Any = None, overlap: bool = True,
                 nonfinite: str = "raise"):
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
        self._step: list = []        # this step's buckets, committed at its last bucket
        super().__init__(model, process_group, nonfinite)

    _transient = HookState._transient + ("_step",)

    @property
    def comm_hook(self):
        return powersgd_hook

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._step = []

    def _check_fresh(self) -> None:
        if self._step:
            raise GradzipError("a DDP hook state was checkpointed in the middle of a backward pass")
        super()._check_fresh()

    def state_dict(self) -> dict:
        """Tensors and plain values only: loads with ``torch.load``'s defaults."""
        self._check_fresh()
        return {**self.counters(), "rng": rng_state(self.rng),
                "errors": {k: v.clone() for k, v in self.errors.items()},
                "qs": {k: v.clone() for k, v in self.qs.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.load_counters(state)
        set_rng_state(self.rng, state["rng"])
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
        bucket_views, keys = views(bucket), [state._key(p) for p in bucket.parameters()]
        acc = torch.promote_types(self.buffer.dtype, torch.float32)
        self.dense, groups = [], defaultdict(list)   # groups: shape -> [(key, view, M)]
        for view, key in zip(bucket_views, keys):
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
        flat = dense_flat + [p.reshape(-1) for p in self.ps]
        acc_buf = torch.cat(flat) if flat else torch.zeros(0, dtype=acc)
        self.work = state.comm.allreduce(acc_buf, async_op=True)   # round 1: dense + P, fused
        self.stage, self.bad, self.updates = 1, False, []

    def q_round(self) -> None:
        n = self.state.comm.world_size
        total = self.work.wait()
        self.bad = not all_finite([total])
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
        """Round 2's result into the bucket; the new errors and ``Q`` are kept in
        ``updates`` until the step is known to be finite (:meth:`commit`)."""
        state, n = self.state, self.state.comm.world_size
        total = self.work.wait()
        self.bad = self.bad or not all_finite([total])
        offset = 0
        for batch, m, p, q, aliased in zip(self.batches, self.ms, self.ps, self.qs, self.aliased):
            q.copy_(total[offset:offset + q.numel()].view(q.shape) / n)
            offset += q.numel()
            if not aliased and len(batch) == 1 and batch[0][1].dtype == p.dtype:
                # M is our own tensor: write M̂ straight into the bucket, then e = M − M̂ in place
                key, view, _ = batch[0]
                out = view.view(1, *m.shape[1:])
                torch.bmm(p, q.transpose(1, 2), out=out)
                if state.use_error_feedback:
                    self.updates.append((state.errors, key, m[0].sub_(out[0]).view(view.shape)))
                if state.warm_start:
                    self.updates.append((state.qs, key, q[0].clone()))
                continue
            approx = torch.bmm(p, q.transpose(1, 2))
            for i, (key, view, _) in enumerate(batch):
                if state.use_error_feedback:   # e = M − M̂, before M̂ overwrites an aliased M
                    error = m[i] - approx[i] if aliased else m[i].sub_(approx[i])
                    self.updates.append((state.errors, key, error.view(view.shape)))
                view.copy_(approx[i].view(view.shape))
                if state.warm_start:
                    self.updates.append((state.qs, key, q[i].clone()))
        self.fut.set_result(self.buffer)

    def commit(self) -> None:
        """Keep this bucket's new errors and ``Q`` (a bucket whose sums were not finite, as
        after a GradScaler overflow, keeps the old ones)."""
        if not self.bad:
            for store, key, value in self.updates:
                store[key] = value


#: Where PowerSGD sees a NaN or Inf: in its sums, which every rank shares (no extra collective).
_AGGREGATE = "in the allreduced sums (a rank's gradient, or its low-rank factors)"


def _dense_allreduce(state: PowerSGDState, bucket: "dist.GradBucket") -> torch.futures.Future:
    buffer = bucket.buffer()
    buffer.div_(state.comm.world_size)
    work = state.comm.allreduce(buffer, async_op=True)
    fut = torch.futures.Future()
    state._pending.append((fut, work, buffer))
    return fut


def _finish_dense(state: PowerSGDState) -> bool:
    """The plain allreduce steps (before ``start_iter``); whether the step counts."""
    pending, state._pending = state._pending, []
    for _, work, _ in pending:
        work.wait()
    buffers = [buffer for _, _, buffer in pending]
    try:
        skipped = state.settle(None if all_finite(buffers) else _AGGREGATE, buffers, "powersgd_hook")
    except GradzipError as error:
        for fut, _, _ in pending:
            fut.set_exception(error)
        raise
    for fut, _, buffer in pending:
        fut.set_result(buffer)
    return not skipped


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: PowerSGD (see :class:`PowerSGDState`). Bucket ``b``'s call
    moves bucket ``b − 1`` to its ``Q`` round, then launches its own ``P`` round (every
    collective from the hook's thread, in bucket order); the last bucket finishes all."""
    if state.iter < state.start_iter:
        for p in bucket.parameters():   # fix first-seen keys on DDP's initial buckets
            state._key(p)
        fut = _dense_allreduce(state, bucket)
        if bucket.is_last() and _finish_dense(state):
            state.iter += 1
        return fut
    for previous in state._pending:   # move the previous bucket to its Q round (same order on every rank)
        if previous.stage == 1:
            previous.q_round()
    current = _PowerSGDBucket(state, bucket)
    state._pending.append(current)
    state._step.append(current)
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
        step, state._step = state._step, []
        where = _AGGREGATE if any(b.bad for b in step) else None
        if not state.settle(where, [b.buffer for b in step], "powersgd_hook"):
            for b in step:
                b.commit()
            if not state.warm_start:
                state.qs.clear()
            state.iter += 1
    return current.fut
