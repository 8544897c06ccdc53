"""DGC: Deep Gradient Compression (Lin et al., ICLR 2018)."""
from __future__ import annotations

import torch

from ..compressors.dgc import DGCCompressor, selected_indices
from ..guards.nonfinite import NonFiniteAggregate
from ..validation import is_int, is_real, require
from .core.overlap import GradientExchange

#: The paper's warm-up: sparsity 75%, 93.75%, 98.4375%, 99.6%, then the target (99.9%),
#: i.e. density 0.25**s in stage s = 1, 2, 3, 4 of the warm-up.
WARMUP_STAGES = 4


class DGC(GradientExchange):
    """DGC (docs/algorithms.md §DGC; reference code synxlin/deep-gradient-compression).

    For each tensor with more than one dimension::

        [g_i ← clip(g_i, clip_norm · n^-1/2)]          # local gradient clipping (option)
        u_i ← m·u_i + g_i;   v_i ← v_i + u_i           # momentum correction
        select = dgc_topk(v_i, density ρ_t)           # sampled threshold, [0.8k, k] entries
        send (values, indices) of v_i at select       # allgather
        u_i[select] = 0;  v_i[select] = 0             # momentum factor masking
        G = (Σ_j scatter(values_j, indices_j)) / n
        x ← x − η_t (G + wd·x)

    Tensors with one dimension (biases, norms) go dense through S-SGD with momentum and
    weight decay after the reduction (``global_update``), as do *all* tensors while the
    density is 1 (the reference code's dense path: there momentum acts after the reduction,
    so DGC at density 1 equals momentum S-SGD; the box above at density 1 would reset
    ``u`` every step and lose the momentum).

    Options:

    * ``ratio``: target density ρ (default 0.001, i.e. 99.9% sparsity); ``sample_ratio``:
      the fraction of entries sampled to estimate the threshold (default 0.01).
    * ``warmup_steps``: sparsity warm-up length in steps (the optimizer does not know
      epochs: pass ``steps_per_epoch × warmup_epochs``; the paper uses 4 epochs). It is cut
      into 4 equal stages with densities 0.25, 0.0625, 0.015625, 0.0039 (the paper's 75% →
      99.6% sparsity; never below ``ratio``), then ``ratio``. 0 (default): no warm-up.
    * ``lr_warmup_steps``: linear learning-rate warm-up, ``η_t = η · min(1, t / W)``
      (applied on top of the param group's ``lr``, so LR schedulers still work). 0: none.
    * ``clip_norm``: local gradient clipping by the total norm of this worker's gradients,
      with the threshold scaled by ``n^-1/2`` (the paper's rule, so the sum over workers
      keeps the scale of a clipped global gradient). 0 (default): no clipping.
    * ``nesterov`` is not supported (the box has no Nesterov form).

    Weight decay is applied after the reduction (``x ← x − η(G + wd·x)``), identically on
    every worker, so the models stay identical. ``metrics()`` reports the target density
    and the density achieved (selected / entries over the sparsified tensors) in the last
    step and on average; the state (``u``, ``v``, ``momentum_buffer`` for dense tensors)
    checkpoints through ``state_dict()``.

    Without clipping the exchange starts during backward (``overlap_backward``,
    :mod:`gradzip.optim.core.overlap`): a tensor's ``v`` (or dense gradient) is known once its
    gradient is. ``clip_norm > 0`` needs every gradient's norm first: ``step()`` does all.
    """

    complex_parameters = False   # its box reads real entries (optim.participation)

    reads_packets = True  # _mask_and_apply reads each tensor's selected indices from its packet

    def __init__(self, params, lr, *, ratio: float = 0.001, sample_ratio: float = 0.01,
                 warmup_steps: int = 0, lr_warmup_steps: int = 0, clip_norm: float = 0.0, **kwargs):
        name = "DGC"
        for key, value in (("ratio", ratio), ("sample_ratio", sample_ratio)):
            require(is_real(value) and 0 < value <= 1, name,
                    f"{key} must be in (0, 1], got {value!r}")
        for key, value in (("warmup_steps", warmup_steps), ("lr_warmup_steps", lr_warmup_steps)):
            require(is_int(value) and value >= 0, name,
                    f"{key} must be an integer >= 0, got {value!r}")
        require(is_real(clip_norm) and clip_norm >= 0, name,
                f"clip_norm must be >= 0 (0 = no clipping), got {clip_norm!r}")
        require(not kwargs.get("nesterov", False), name, "nesterov=True is not supported (use nesterov=False)")
        super().__init__(params, lr, **kwargs)
        self.ratio, self.sample_ratio = float(ratio), float(sample_ratio)
        self.warmup_steps, self.lr_warmup_steps, self.clip_norm = warmup_steps, lr_warmup_steps, float(clip_norm)
        self.dense = self.make_psync("none", salt=0)
        self._sparse: dict[float, object] = {}   # density -> PSync with a dgc codec
        self._selected = self._entries = 0           # last step
        self._selected_total = self._entries_total = 0
        self._target_sum = 0.0
        self._target_steps = 0
        if self.clip_norm > 0:   # the clipping factor needs every gradient: no overlap
            self.disable_overlap()
        self._step_selected = 0  # entries selected in the buckets applied so far this step
        self._corrected: dict = {}  # param -> (u, v) after the momentum correction, until applied

    # -- schedules ----------------------------------------------------------------------
    def density(self, step: int) -> float:
        """Target density at ``step`` (steps count from 1), with the sparsity warm-up."""
        if step <= self.warmup_steps:
            stage = min(WARMUP_STAGES - 1, (step - 1) * WARMUP_STAGES // self.warmup_steps)
            return max(self.ratio, 0.25 ** (stage + 1))
        return self.ratio

    def lr_scale(self, step: int) -> float:
        return min(1.0, step / self.lr_warmup_steps) if self.lr_warmup_steps else 1.0

    def _psync_for(self, density: float):
        if density not in self._sparse:
            codec = DGCCompressor(ratio=density, sample_ratio=self.sample_ratio)
            self._sparse[density] = self.make_psync(codec, salt=1 + len(self._sparse))
        return self._sparse[density]

    # -- the box --------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        if self.overlap_backward:   # GradientExchange's: the exchange started in backward
            return super().step(closure)
        loss, pairs, params, skipped = self.begin_step(closure)
        if skipped:
            return loss
        try:
            t = self.steps
            rho, scale = self.density(t), self.lr_scale(t)
            grads = self._clipped({p: p.grad for _, p in pairs})   # [g_i ← clip(g_i, clip_norm·n^-1/2)]
            sparse, dense = self._partition(pairs, rho)
            sparse_round = self._send_top_k(sparse, grads, rho, t) if sparse else None
            dense_round = self.dense.start([grads[p] for _, p in dense], t, keys=self.keys([p for _, p in dense]),
                                           residual=False) if dense else None
            # both exchanges decoded before anything is applied (an overflow leaves the step undone)
            sparse_result, dense_result = _wait_both(sparse_round, dense_round)
            if sparse_round is not None:
                selected = self._mask_and_apply(sparse, sparse_round.packets, sparse_result, scale)
                self._record_density(selected, sum(p.numel() for _, p in sparse), rho)
            if dense_result is not None:                           # S-SGD, momentum after the reduction
                for (group, p), agg in zip(dense, dense_result.aggregate):
                    direction = self._momentum(self.state[p], "global_momentum_buffer", agg, p, group)
                    p.add_(direction, alpha=-group["lr"] * scale)
        except NonFiniteAggregate as overflow:  # a codec overflowed: undo + skip, or raise
            return self.codec_overflow(overflow, loss)
        return loss

    # -- the box per tensor, for overlap_backward (same operations as step()) ---------------
    def exchange_input(self, group, p):
        """``v`` after the momentum correction (sparse tensors), else the gradient. The new
        ``u``, ``v`` enter the state when the step applies (it reads as before until then)."""
        rho = self.density(self.steps + 1)
        if not (p.dim() > 1 and rho < 1):
            return p.grad
        st = self.state[p]
        u = st["u"] if "u" in st else torch.zeros_like(p)
        v = st["v"] if "v" in st else torch.zeros_like(p)
        u = u.mul(group["momentum"]).add_(p.grad)            # momentum correction
        self._corrected[p] = (u, v.add(u))
        return self._corrected[p][1]

    def launch_psync(self):
        return self.dense   # the step's buckets: the parameters' own bytes (codec none)

    def start_bucket(self, members, inputs, step, plan):
        """The bucket's sparse tensors through the step's dgc exchange, then its dense ones
        (each planned by its own PSync: exact transports)."""
        rho = self.density(step)
        goes_sparse = [p.dim() > 1 and rho < 1 for p in members]
        out = []
        for sparse in (True, False):
            chosen = [(p, x) for p, x, s in zip(members, inputs, goes_sparse) if s == sparse]
            if chosen:
                psync = self._psync_for(rho) if sparse else self.dense
                ps = [p for p, _ in chosen]
                out.append((ps, psync.start([x for _, x in chosen], step, keys=self.keys(ps), residual=sparse)))
        return out

    def apply_bucket(self, pairs, pending, result):
        scale = self.lr_scale(self.steps)
        if pending.psync is self.dense:                      # S-SGD, momentum after the reduction
            for (group, p), agg in zip(pairs, result.aggregate):
                direction = self._momentum(self.state[p], "global_momentum_buffer", agg, p, group)
                p.add_(direction, alpha=-group["lr"] * scale)
        else:
            for _, p in pairs:
                self.state[p]["u"], self.state[p]["v"] = self._corrected.pop(p)
            self._step_selected += self._mask_and_apply(pairs, pending.packets, result, scale)

    def finish_exchange(self, pairs):
        rho = self.density(self.steps)
        sparse, _ = self._partition(pairs, rho)
        if sparse:
            self._record_density(self._step_selected, sum(p.numel() for _, p in sparse), rho)
        self._step_selected = 0
        self._corrected.clear()

    def forget_exchanges(self, count):
        super().forget_exchanges(count)
        self._sparse = {d: x for d, x in self._sparse.items() if any(x is y for y in self._exchanges)}

    # -- the box's named steps ------------------------------------------------------------
    def _clipped(self, grads: dict) -> dict:
        """Local gradient clipping (``clip_norm > 0``): every gradient scaled by
        ``clip_norm · n^-1/2 / ‖g‖`` when this worker's total norm exceeds it; else as given."""
        if self.clip_norm <= 0 or not grads:
            return grads
        limit = self.clip_norm * self.comm.world_size ** -0.5
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        factor = limit / (float(total) + 1e-6)
        return {p: g * factor for p, g in grads.items()} if factor < 1 else grads

    @staticmethod
    def _partition(pairs: list, rho: float) -> tuple[list, list]:
        """``(sparse, dense)``: tensors with more than one dimension follow the box while the
        density is below 1; the rest (biases, norms; everything at density 1) go dense."""
        goes_sparse = [p.dim() > 1 and rho < 1 for _, p in pairs]
        return ([gp for gp, s in zip(pairs, goes_sparse) if s], [gp for gp, s in zip(pairs, goes_sparse) if not s])

    def _send_top_k(self, sparse: list, grads: dict, rho: float, t: int):
        """``u ← m·u + g;  v ← v + u`` (momentum correction, new tensors logged for a skipped
        step), then start the exchange of ``v``'s sampled top-k at density ``rho``."""
        carried = []
        for group, p in sparse:
            st = self.state[p]
            self.replaced(st, "u")                           # new tensors: a skipped step
            self.replaced(st, "v")                           # puts the old ones back
            u = st["u"] if "u" in st else torch.zeros_like(p)
            v = st["v"] if "v" in st else torch.zeros_like(p)
            st["u"] = u.mul(group["momentum"]).add_(grads[p])   # momentum correction
            st["v"] = v.add(st["u"])
            carried.append(st["v"])
        return self._psync_for(rho).start(carried, t, keys=self.keys([p for _, p in sparse]))

    def _mask_and_apply(self, sparse: list, packets, result, scale: float) -> int:
        """``u[select] = 0; v[select] = 0`` (momentum factor masking) and ``x ← x − η_t (G +
        wd·x)``; returns how many entries were selected."""
        selected = 0
        for (group, p), packet, agg, res in zip(sparse, packets, result.aggregate, result.residual):
            st = self.state[p]
            idx = selected_indices(packet)
            st["u"].view(-1).index_fill_(0, idx, 0.0)      # momentum factor masking
            st["v"].copy_(res)                              # v − C(v): zero exactly at select
            selected += idx.numel()
            update = agg.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else agg
            p.add_(update, alpha=-group["lr"] * scale)
        return selected

    def _record_density(self, selected: int, entries: int, rho: float) -> None:
        """The achieved and target densities of this step, for :meth:`metrics`."""
        self._selected, self._entries = selected, entries
        self._selected_total += selected
        self._entries_total += entries
        self._target_sum += rho
        self._target_steps += 1

    # -- reporting / state ------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        out = {"dgc_target_density": self.density(max(self.steps, 1))}
        if self._entries:
            out["dgc_density"] = self._selected / self._entries
            out["dgc_density_mean"] = self._selected_total / self._entries_total
            out["dgc_target_density_mean"] = self._target_sum / self._target_steps
        return out

    def state_dict(self) -> dict:
        out = super().state_dict()
        out["gradzip"]["dgc"] = {"selected": self._selected, "entries": self._entries,
                                 "selected_total": self._selected_total, "entries_total": self._entries_total,
                                 "target_sum": self._target_sum, "target_steps": self._target_steps,
                                 "densities": list(self._sparse)}
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        extra = state_dict.get("gradzip", {}).get("dgc")
        for density in (extra or {}).get("densities", []):  # the same exchanges, seeds and counters
            self._psync_for(density)
        super().load_state_dict(state_dict)
        if extra is not None:
            self._selected, self._entries = extra["selected"], extra["entries"]
            self._selected_total, self._entries_total = extra["selected_total"], extra["entries_total"]
            self._target_sum, self._target_steps = extra["target_sum"], extra["target_steps"]


def _wait_both(first, second) -> tuple:
    """The results of two pending exchanges (None: not started). Both are waited for even
    when the first decodes a non-finite aggregate, whose error is raised after: a worker must
    not leave while a peer may still be starting the second collective (the peer would see
    it gone instead of the overflow that every worker raises)."""
    try:
        first_result = first.wait() if first is not None else None
    except NonFiniteAggregate:
        if second is not None:
            try:
                second.wait()
            except NonFiniteAggregate:
                pass  # the first exchange's overflow is the one named
        raise
    return first_result, second.wait() if second is not None else None

