"""PowerSGD: rank-r gradient compression by one step of power iteration (Vogels et al., 2019)."""
from __future__ import annotations

from collections import defaultdict

import torch

from ..compressors.powersgd import effective_rank, matrix_shape, orthogonalize, random_q, should_compress
from ..guards.nonfinite import NonFiniteAggregate
from ..seeds import mix as mix_seed
from ..validation import is_int, is_real, require
from .core.base import DistributedOptimizer


class PowerSGD(DistributedOptimizer):
    """PowerSGD (docs/algorithms.md §PowerSGD; PyTorch ``powerSGD_hook``; epfml/powersgd).

    Per matrix-shaped parameter tensor (``rows = shape[0]``, ``cols`` = the rest), rank
    ``r' = min(rank, rows, cols)``, with a ``Q`` shared by all workers::

        M = g + e                                   # error feedback (use_error_feedback)
        P = allreduce_mean(M Q);   P̂ = orthogonalize(P)
        Q = allreduce_mean(Mᵀ P̂)
        M̂ = P̂ Qᵀ;   e = M − M̂
        x ← GlobalOpt(x, M̂)                         # momentum SGD + weight decay, after the reduction

    Tensors with one dimension, and matrices not worth compressing
    (``(rows + cols)·r'·min_compression_rate >= rows·cols``, PyTorch's rule), go dense
    through a plain allreduce-mean; so do all tensors during the first ``start_iter`` steps
    (PyTorch's ``start_powerSGD_iter``: as many plain-allreduce steps as PyTorch runs).
    ``Q`` starts as an orthonormalised standard normal draw seeded by ``(seed, tensor)``,
    the same on every worker; with ``warm_start`` it is reused from the previous step,
    else redrawn every step from ``(seed, step, tensor)``. Tensors of the same shape are
    batched (one ``bmm``). ``e`` and ``Q`` live in ``state[p]["error"]`` / ``state[p]["q"]``,
    so they checkpoint with ``state_dict()``.

    Communication per step: the dense tensors' allreduce is launched first and waited for
    last, so it overlaps the whole P/Q exchange; all ``P`` go in one fused allreduce (of up
    to ``bucket_bytes`` per collective), then all ``Q`` in one. The two rounds are
    inherently sequential (``Q`` needs ``P̂``).

    Differences from PyTorch's ``powerSGD_hook`` (which the DDP hook
    :func:`gradzip.integrations.ddp.powersgd_hook` reproduces exactly):

    * state per parameter tensor, not per DDP bucket; ``Q`` drawn per tensor from gradzip's
      seeds instead of one numpy-seeded draw per bucket;
    * PyTorch re-orthogonalises the warm-started ``Q`` before ``P = M Q``: this changes
      ``P`` by a right factor ``R⁻¹`` (upper triangular, positive diagonal), which Gram-Schmidt
      removes again, so ``P̂`` is the same in exact arithmetic (only rounding differs);
    * PyTorch also keeps an "error" for the dense tensors of a bucket (``M − mean_j M_j``,
      which sums to zero over the workers); here the dense tensors carry no error;
    * momentum and weight decay act on the reduced gradient here (§Momentum and weight decay); with DDP they
      are whatever optimizer runs after the hook.
    """

    complex_parameters = False   # its box reads real entries (optim.participation)

    def __init__(self, params, lr, *, rank: int = 1, start_iter: int = 10, min_compression_rate: float = 2.0,
                 warm_start: bool = True, use_error_feedback: bool = True,
                 orthogonalization_epsilon: float = 0.0, **kwargs):
        name = "PowerSGD"
        require(is_int(rank) and rank >= 1, name,
                f"rank must be an integer >= 1, got {rank!r}")
        require(is_int(start_iter) and start_iter >= 0, name,
                f"start_iter must be an integer >= 0, got {start_iter!r}")
        for key, value in (("min_compression_rate", min_compression_rate),
                           ("orthogonalization_epsilon", orthogonalization_epsilon)):
            require(is_real(value) and value >= 0, name,
                    f"{key} must be a number >= 0, got {value!r}")  # NaN fails too
        for key, value in (("warm_start", warm_start), ("use_error_feedback", use_error_feedback)):
            require(isinstance(value, bool), name, f"{key} must be True or False, got {value!r}")
        super().__init__(params, lr, **kwargs)
        self.rank, self.start_iter = rank, start_iter
        self.min_compression_rate = float(min_compression_rate)
        self.warm_start, self.use_error_feedback = bool(warm_start), bool(use_error_feedback)
        self.epsilon = float(orthogonalization_epsilon)
        self.dense = self.make_psync("none", salt=0)
        self.p_round = self.make_psync("none", salt=1)
        self.q_round = self.make_psync("none", salt=2)

    def load_state_dict(self, state_dict: dict) -> None:
        """Refuses a state whose ``Q`` (``state[i]["q"]``) has another rank or shape than this
        optimizer's (e.g. saved with ``rank=2``, loaded with ``rank=4``), naming the parameter."""
        saved = state_dict.get("state", {})
        for i, p in enumerate(p for g in self.param_groups for p in g["params"]):
            q = saved.get(i, {}).get("q")
            if q is None:
                continue
            _, cols = matrix_shape(p.shape)
            expected = (cols, effective_rank(p.shape, self.rank))
            require(tuple(q.shape) == expected, "PowerSGD",
                    f"load_state_dict: the state's 'q' of parameter #{i} (shape {tuple(p.shape)}) has shape "
                    f"{tuple(q.shape)} (rank {q.shape[-1]}), this optimizer's rank={self.rank} needs {expected}; "
                    f"load it with rank={q.shape[-1]} (the rank is part of the state)")
        super().load_state_dict(state_dict)

    def _initial_q(self, p: torch.Tensor, cols: int, r: int, step: int) -> torch.Tensor:
        key = self.keys([p])[0]
        seed = mix_seed(self.seed, key) if self.warm_start else mix_seed(self.seed, step, key)
        return random_q(cols, r, seed, torch.promote_types(p.dtype, torch.float32), p.device)

    @torch.no_grad()
    def step(self, closure=None):
        loss, pairs, params, skipped = self.begin_step(closure)
        if skipped:
            return loss
        try:
            t = self.steps
            low_rank, dense = self._partition(pairs, t)
            dense_round = self.dense.start([p.grad for _, p in dense], t, residual=False) if dense else None
            if low_rank:
                batches = self._batches(low_rank)                    # one bmm per shape
                ms, qs = self._matrices(batches, t)                  # M = g + e;  Q (warm or fresh)
                ps = [torch.bmm(m, q) for m, q in zip(ms, qs)]       # P = M Q
                p_mean = self.p_round([p.reshape(-1) for p in ps], t, residual=False).aggregate
                ps = [orthogonalize(pm.view_as(p).clone(), self.epsilon) for pm, p in zip(p_mean, ps)]  # P̂
                qs = [torch.bmm(m.transpose(1, 2), p) for m, p in zip(ms, ps)]                 # Q = Mᵀ P̂
                q_mean = self.q_round([q.reshape(-1) for q in qs], t, residual=False).aggregate
            dense_mean = dense_round.wait().aggregate if dense_round is not None else []
            # every exchange decoded before anything is applied (an overflow leaves the step undone)
            if low_rank:
                self._apply_low_rank(batches, ms, ps, [qm.view_as(q) for qm, q in zip(q_mean, qs)])
            for (group, p), agg in zip(dense, dense_mean):
                self.global_update(p, agg, group)
        except NonFiniteAggregate as overflow:  # a codec overflowed: undo + skip, or raise
            return self.codec_overflow(overflow, loss)
        return loss

    # -- the box's named steps ------------------------------------------------------------
    def _partition(self, pairs: list, t: int) -> tuple[list, list]:
        """``(low_rank, dense)``: after ``start_iter`` steps, the tensors worth compressing
        (``should_compress``, PyTorch's rule) go low-rank; the rest go dense."""
        compress = t > self.start_iter
        low_rank = [(g, p) for g, p in pairs
                    if compress and should_compress(p.shape, self.rank, self.min_compression_rate)]
        chosen = {p for _, p in low_rank}
        return low_rank, [(g, p) for g, p in pairs if p not in chosen]

    def _batches(self, low_rank: list) -> dict[tuple, list]:
        """``(rows, cols, r') -> [(group, p), ...]``: tensors of one matrix shape and rank,
        batched so that each product is one ``bmm``."""
        batches: dict[tuple, list] = defaultdict(list)
        for group, p in low_rank:
            batches[(*matrix_shape(p.shape), effective_rank(p.shape, self.rank))].append((group, p))
        return batches

    def _matrices(self, batches: dict[tuple, list], t: int) -> tuple[list, list]:
        """Per batch, ``M = g + e`` stacked as ``(batch, rows, cols)`` and ``Q`` as ``(batch,
        cols, r')``: the previous step's (``warm_start``) or a fresh draw (:meth:`_initial_q`)."""
        ms, qs = [], []
        for (rows, cols, r), members in batches.items():
            mats, qlist = [], []
            for _, p in members:
                st = self.state[p]
                m = p.grad.reshape(rows, cols).to(torch.promote_types(p.dtype, torch.float32))
                if self.use_error_feedback and "error" in st:
                    m = m + st["error"].view(rows, cols)
                mats.append(m)
                q = st.get("q") if self.warm_start else None
                qlist.append(q if q is not None else self._initial_q(p, cols, r, t))
            ms.append(torch.stack(mats))
            qs.append(torch.stack(qlist))
        return ms, qs

    def _apply_low_rank(self, batches: dict[tuple, list], ms: list, p_hats: list, q_news: list) -> None:
        """``M̂ = P̂ Qᵀ;  e = M − M̂;  x ← GlobalOpt(x, M̂)``, keeping ``Q`` for a warm start."""
        for members, m, p_hat, q_new in zip(batches.values(), ms, p_hats, q_news):
            approx = torch.bmm(p_hat, q_new.transpose(1, 2))
            for i, (group, p) in enumerate(members):
                st = self.state[p]
                if self.use_error_feedback:
                    st["error"] = (m[i] - approx[i]).reshape(p.shape)
                if self.warm_start:
                    st["q"] = q_new[i].clone()
                self.global_update(p, approx[i].reshape(p.shape).to(p.dtype), group)
