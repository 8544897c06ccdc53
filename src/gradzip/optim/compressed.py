"""Any torch optimizer with any codec (docs/algorithms.md §Large-batch training,
"Compressed(inner)").

:class:`Compressed` wraps a ``torch.optim.Optimizer`` built on the parameters (AdamW,
:class:`~gradzip.optim.LARS`, :class:`~gradzip.optim.LAMB`, ...)::

    (a, r_i) = PSync(e_i + g_i; C)       # error feedback on the gradient when C is biased
    e_i ← r_i                            # (no e_i for unbiased codecs or error_feedback=False)
    g ← a  (written into .grad);  inner.step()

With ``compressor="none"`` it is DDP + the inner optimizer on the mean gradient. The
exchange starts during backward (``overlap_backward``, :mod:`gradzip.optim.core.overlap`), the
residuals are ``state[p]["error"]`` of the wrapper, and the wrapper shares the inner
optimizer's ``param_groups`` (the same list): an LR scheduler built on either acts on the
inner optimizer's groups.

The ``--algo`` methods ``lars``, ``lamb`` and ``adamw`` (:class:`LARSMethod`,
:class:`LAMBMethod`, :class:`AdamWMethod`) are ``Compressed`` around the inner optimizer
built from the common options, so the CLI needs no per-method code.
"""
from __future__ import annotations

import torch

from ..compressors import Compressor, build
from ..errors import GradzipError
from ..exchange import DEFAULT_BUCKET_BYTES
from ..validation import is_real, refuses_unknown_options, require
from .core.base import DistributedOptimizer
from .lamb import LAMB
from .lars import LARS
from .core.options import no_momentum, parse_betas
from .core.overlap import GradientExchange
from .core.participation import hold_once


class Compressed(GradientExchange):
    """``inner.step()`` on the gradient exchanged through PSync (module docstring).

    ``error_feedback=None``: on for biased codecs, off for unbiased ones
    (:attr:`Compressor.unbiased`) and for ``"none"`` (its residual is zero), as the DDP
    hook (:class:`gradzip.integrations.ddp.CodecState`); ``True`` with an unbiased codec is refused.
    ``state_dict()`` holds the residuals, the counters and ``"inner"``: the inner
    optimizer's state dict. The common options: ``comm``, ``seed``, ``bucket_bytes``,
    ``nonfinite``, ``overlap_backward``, ``transport``, ``hierarchy``, ``round_bytes``, ``link``,
    ``recalibrate_every``; learning rate, momentum and weight decay are the
    inner optimizer's."""

    @refuses_unknown_options
    def __init__(self, inner: torch.optim.Optimizer, *, compressor: "str | Compressor" = "none",
                 error_feedback: bool | None = None, comm=None, seed: int = 0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, nonfinite: str = "raise", overlap_backward: bool = True,
                 transport: str = "auto", hierarchy: "int | str | None" = None, round_bytes: int | None = None,
                 link=None, recalibrate_every: int | None = None):
        name = type(self).__name__
        if not isinstance(inner, torch.optim.Optimizer) or isinstance(inner, DistributedOptimizer):
            raise GradzipError(
                f"{name}: inner must be a torch.optim.Optimizer that does not communicate (e.g. "
                f"torch.optim.AdamW(model.parameters())), got {type(inner).__name__}; a gradzip method "
                "already exchanges its gradients: use it alone")
        codec = build(compressor)
        if error_feedback is None:
            error_feedback = codec.error_feedback_by_default
        require(isinstance(error_feedback, bool), name,
                f"error_feedback must be True, False or None (by the codec), got {error_feedback!r}")
        codec.refuse_error_feedback(error_feedback, name)
        hold_once(inner, name)   # the groups are shared (below): each parameter once
        params = [p for g in inner.param_groups for p in g["params"]]
        require(len(params) > 0, name, "the inner optimizer has no parameters")
        super().__init__(params, 0.0, comm=comm, seed=seed, bucket_bytes=bucket_bytes, nonfinite=nonfinite,
                         overlap_backward=overlap_backward, transport=transport, hierarchy=hierarchy,
                         round_bytes=round_bytes, link=link,
                         recalibrate_every=recalibrate_every)
        self.param_groups = inner.param_groups   # one list: schedulers act on the inner's groups
        self.defaults = inner.defaults
        self.inner = inner
        self.inner_optimizer = type(inner).__name__   # compared across workers (describe)
        self.error_feedback = error_feedback
        self.exchange_residual = error_feedback
        self.psync = self.make_psync(codec)

    def add_param_group(self, param_group: dict) -> None:
        """The inner optimizer's ``add_param_group`` (its checks and defaults); the group
        joins the exchange from the next step (compared across workers again)."""
        if not hasattr(self, "inner"):   # the base constructor's own groups
            return super().add_param_group(param_group)
        self.inner.add_param_group(param_group)
        hold_once(self.inner, type(self).__name__)
        if self.param_groups is not self.inner.param_groups:
            self.param_groups = self.inner.param_groups
        self.joined(self.param_groups[-1]["params"])
        if self.overlap_backward:
            self._register_hooks(self.param_groups[-1]["params"])

    def exchange_input(self, group, p):
        error = self.state[p].get("error") if self.error_feedback else None
        return p.grad if error is None else error.add(p.grad)       # e_i + g_i

    def apply_exchange(self, pairs, aggregates, residuals):
        for i, ((_, p), agg) in enumerate(zip(pairs, aggregates)):
            if self.error_feedback:
                self.state[p]["error"] = residuals[i]
            p.grad.copy_(agg)

    def after_exchange(self) -> None:
        """``inner.step()`` on the aggregate in ``.grad`` (never on a skipped step)."""
        self.inner.step()

    def check_saved_group(self, group: dict, where: str) -> None:
        """The inner optimizer checks its own groups (``load_state_dict``)."""

    def state_dict(self) -> dict:
        out = super().state_dict()
        out["inner"] = self.inner.state_dict()
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """The residuals and counters, and the inner optimizer's state (``"inner"``)."""
        inner = state_dict.get("inner") if isinstance(state_dict, dict) else None
        if not isinstance(inner, dict):
            raise GradzipError(f"{type(self).__name__}.load_state_dict: this state has no 'inner' entry (the inner "
                               "optimizer's state); load a state saved by Compressed.state_dict()")
        own = {k: v for k, v in state_dict.items() if k != "inner"}
        super().load_state_dict(own)       # the gradzip checks; torch's load gives new group dicts
        self.inner.load_state_dict(inner)
        self.param_groups = self.inner.param_groups


def _inner_options(name: str, momentum, nesterov) -> None:
    require(not nesterov, name, "nesterov=True is not part of this optimizer; leave --nesterov out")


class LARSMethod(Compressed):
    """``--algo lars``: :class:`~gradzip.optim.LARS` (momentum, weight decay and the
    learning rate from the common options) in :class:`Compressed` (S-SGD exchange by
    default; any codec with ``compressor``)."""

    @classmethod
    def default_lr(cls, options: dict) -> float:
        return 3.0   # the step is lr·τ·‖w‖ (τ = 0.001); digits, 3 epochs: 0.22 at lr 0.1, 0.58 at 0.3, 0.73 at 1, 0.88 at 3

    def __init__(self, params, lr: float, *, momentum: float = 0.9, nesterov: bool = False,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001, eps: float = 1e-8,
                 exclude_1d: bool = True, compressor: str = "none", error_feedback: bool | None = None, **common):
        _inner_options(type(self).__name__, momentum, nesterov)
        inner = LARS(params, lr, momentum=momentum, weight_decay=weight_decay,
                     trust_coefficient=trust_coefficient, eps=eps, exclude_1d=exclude_1d)
        super().__init__(inner, compressor=compressor, error_feedback=error_feedback, **common)


class LAMBMethod(Compressed):
    """``--algo lamb``: :class:`~gradzip.optim.LAMB` in :class:`Compressed` (``momentum``
    of the common options must stay 0: LAMB's are ``betas``, ``--betas 0.9,0.999`` or
    ``--beta1 --beta2``)."""

    @classmethod
    def default_lr(cls, options: dict) -> float:
        return 0.01   # the step is lr·‖w‖ per tensor (trust ratio); digits, 3 epochs: 0.82 at 1e-3, 0.91 at 3e-3, 0.95 at 0.01

    def __init__(self, params, lr: float, *, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, betas: "tuple[float, float] | str | None" = None,
                 beta1: float | None = None, beta2: float | None = None, eps: float = 1e-6,
                 exclude_1d: bool = True, compressor: str = "none", error_feedback: bool | None = None, **common):
        name = type(self).__name__
        no_momentum(name, momentum, nesterov)
        inner = LAMB(params, lr, betas=parse_betas(name, betas, beta1=beta1, beta2=beta2), eps=eps,
                     weight_decay=weight_decay, exclude_1d=exclude_1d)
        super().__init__(inner, compressor=compressor, error_feedback=error_feedback, **common)


class AdamWMethod(Compressed):
    """``--algo adamw``: ``torch.optim.AdamW`` in :class:`Compressed` (decoupled weight
    decay from the common options; ``momentum`` must stay 0: AdamW's are ``betas``, ``--betas
    0.9,0.999`` or ``--beta1 --beta2``)."""

    @classmethod
    def default_lr(cls, options: dict) -> float:
        return 1e-3   # AdamW's own default

    def __init__(self, params, lr: float, *, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, betas: "tuple[float, float] | str | None" = None,
                 beta1: float | None = None, beta2: float | None = None, eps: float = 1e-8,
                 compressor: str = "none", error_feedback: bool | None = None, **common):
        name = type(self).__name__
        no_momentum(name, momentum, nesterov)
        betas = parse_betas(name, betas, beta1=beta1, beta2=beta2)
        require(is_real(lr) and 0 <= lr <= 3.4e38, name, f"lr must be a finite number >= 0, got {lr!r}")
        require(is_real(eps) and 0 <= eps <= 1.0, name, f"eps must be a number in [0, 1], got {eps!r}")
        require(is_real(weight_decay) and 0 <= weight_decay <= 3.4e38, name,
                f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
        inner = torch.optim.AdamW(params, lr=float(lr), betas=betas, eps=float(eps), weight_decay=float(weight_decay))
        super().__init__(inner, compressor=compressor, error_feedback=error_feedback, **common)
