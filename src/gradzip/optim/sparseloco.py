"""SparseLoCo: DiLoCo whose pseudo-gradient travels as top-k with 2-bit values, with error
feedback in place of the outer momentum.

docs/algorithms.md §SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient
LLM Pre-training with SparseLoCo", 2025). Every worker keeps the global model ``θ̂``
(``state[p]["global"]``, identical everywhere) and its error memory ``e_i``
(``state[p]["residual"]``); steps count from 1::

    every step:       x_i ← InnerOpt(x_i, g_i)
    at t = kH:        Δ_i = θ̂ − x_i                                   # pseudo-gradient
                      v_i = β·e_i + Δ_i                               # decayed error feedback
                      (Δ̄, r_i) = PSync(v_i; C);  e_i ← r_i            # C = Q ∘ TopK: v_i − C(v_i) stays
                      θ̂ ← θ̂ − α·Δ̄                                    # outer SGD, no momentum
                      x_i ← θ̂

``C`` is the ``topk2bit`` codec (``compressor="topk:ratio=ρ"``, ``quantizer="2bit"``) or the
compressor alone (``quantizer="none"``). It is :class:`gradzip.optim.DiLoCo` with one
fragment, no delay, outer SGD(α, momentum 0) and the error memory always kept and decayed
by β before the pseudo-gradient is added (DiLoCo's is undecayed, β = 1, and kept only for
biased codecs). With ``ratio=1`` and ``quantizer="none"`` nothing is left behind
(``e_i = 0``) and, with α = 1, it is local SGD: the workers' models averaged every H steps.

:class:`SparseLoCoMethod` is the registry's and the CLI's form (``gradzip train --algo
sparseloco --inner adamw --H 8 --compressor topk:ratio=0.02``), building the inner optimizer
as :class:`gradzip.optim.DiLoCoMethod` does.
"""
from __future__ import annotations

import torch

from ..compressors import Compressor, build
from ..exchange import DEFAULT_BUCKET_BYTES
from ..validation import is_real, refuses_unknown_options, require
from .diloco import DiLoCo, inner_default_lr, inner_optimizer

#: How the k selected values travel (``quantizer=``).
QUANTIZERS = ("2bit", "none")


def sparse_codec(name: str, compressor: "str | Compressor", quantizer: str) -> Compressor:
    """SparseLoCo's codec: ``topk2bit`` at the ratio of the ``topk`` spec ``compressor``
    (``quantizer="2bit"``), or ``compressor`` itself (``quantizer="none"``)."""
    require(quantizer in QUANTIZERS, name, f"quantizer must be one of {', '.join(QUANTIZERS)}, got {quantizer!r}")
    codec = build(compressor)
    if quantizer == "none":
        return codec
    require(codec.name == "topk", name,
            f"quantizer='2bit' quantizes the values top-k selects: compressor must be a topk spec (e.g. "
            f"topk:ratio=0.02), got {codec.spec!r}; or pass quantizer='none' to send {codec.spec!r} as it is")
    return build(f"topk2bit:ratio={codec.ratio}")


class SparseLoCo(DiLoCo):
    """SparseLoCo (module docstring)::

        SparseLoCo(inner, *, H, compressor="topk:ratio=0.02", quantizer="2bit", outer_lr=1.0,
                   error_decay=0.95, comm=None)

    ``inner``: a ``torch.optim.Optimizer`` over the model's parameters; ``H`` the inner steps
    between synchronisations; ``outer_lr`` α; ``error_decay`` β in [0, 1]. **[choice]** the
    defaults α = 1 and β = 0.95 (docs/algorithms.md §SparseLoCo)."""

    @refuses_unknown_options
    def __init__(self, inner: torch.optim.Optimizer, *, H: int, compressor: "str | Compressor" = "topk:ratio=0.02",
                 quantizer: str = "2bit", outer_lr: float = 1.0, error_decay: float = 0.95, comm=None, seed: int = 0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, nonfinite: str = "raise", transport: str = "auto",
                 hierarchy: "int | str | None" = None, round_bytes: int | None = None, link=None,
                 recalibrate_every: int | None = None):
        name = type(self).__name__
        require(is_real(error_decay) and 0 <= error_decay <= 1, name,
                f"error_decay (β) must be a number in [0, 1], got {error_decay!r}")
        codec = sparse_codec(name, compressor, quantizer)
        super().__init__(inner, H=H, outer_lr=outer_lr, outer_momentum=0.0, outer_nesterov=False, compressor=codec,
                         comm=comm, seed=seed, bucket_bytes=bucket_bytes, nonfinite=nonfinite, transport=transport,
                         hierarchy=hierarchy, round_bytes=round_bytes, link=link,
                         recalibrate_every=recalibrate_every)
        self.quantizer = quantizer
        self.error_decay = float(error_decay)
        self._error_decay = self.error_decay
        self.error_feedback = True


class SparseLoCoMethod(SparseLoCo):
    """SparseLoCo built from parameters (``--algo sparseloco``): the inner optimizer as
    :class:`gradzip.optim.DiLoCoMethod` builds it (``inner="adamw"`` by default, or
    ``"sgd"``; ``inner_lr`` defaults to ``lr``); ``H`` defaults to 8 here, the other options
    are :class:`SparseLoCo`'s."""

    @classmethod
    def default_lr(cls, options: dict) -> float:
        return inner_default_lr(options)

    @refuses_unknown_options
    def __init__(self, params, lr, *, inner: str = "adamw", inner_lr: float | None = None, H: int = 8,
                 compressor: str = "topk:ratio=0.02", quantizer: str = "2bit", outer_lr: float = 1.0,
                 error_decay: float = 0.95, comm=None, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, seed: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 nonfinite: str = "raise", transport: str = "auto", hierarchy: "int | str | None" = None,
                 round_bytes: int | None = None, link=None, recalibrate_every: int | None = None):
        opt = inner_optimizer(type(self).__name__, params, lr, inner, inner_lr, momentum, nesterov, weight_decay)
        self.inner_kind = inner
        super().__init__(opt, H=H, compressor=compressor, quantizer=quantizer, outer_lr=outer_lr,
                         error_decay=error_decay, comm=comm, seed=seed, bucket_bytes=bucket_bytes, nonfinite=nonfinite,
                         transport=transport, hierarchy=hierarchy, round_bytes=round_bytes, link=link,
                         recalibrate_every=recalibrate_every)
