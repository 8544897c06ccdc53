"""EF-SGD: compression with error feedback."""
from __future__ import annotations

import torch

from .core.overlap import GradientExchange
from .core.ratios import single_codec

DEFAULT_CODEC = "topk:ratio=0.01"


class EFSGD(GradientExchange):
    """EF-SGD (Karimireddy et al. 2019; CSER slides Alg. 2; docs/algorithms.md §EF-SGD)::

        p_i = e_i + η d_i;   p'_i = C(p_i);   e_i = p_i − p'_i;   x ← x − mean_j p'_j

    The error ``e_i`` (``state[p]["error"]``, gradzip's sign convention: what is still owed
    to the model) holds everything compression dropped and is added back next step; a
    tensor sent uncompressed (``none``, or a unit ``auto:<codec>`` sends so) owes nothing and
    keeps none (absent means zero: ``PSync.omit_zero_residuals``). Sent uncompressed again
    with nothing owed, without momentum or weight decay, ``p = η g`` is not formed: the
    gradient itself is sent and ``x ← x − η mean_j g_j`` applied, S-SGD's arithmetic (bit
    for bit; one pass over the gradient less); else ``p = η g`` is one pass into the memory of
    its last input. The model is identical on all workers. With the identity codec it is S-SGD; with one
    worker and a lossy codec it is not SGD (the error delays updates). 1-bit SGD is
    ``EFSGD(compressor="1bit")``, EF-signSGD ``EFSGD(compressor="scaled_sign")``.

    ``compressor="auto"`` is ``topk:ratio=0.01``; or give ``rc``, a target R_C = R_C1, for
    the random-block codec sending 1/rc of every tensor (as CSEA; :mod:`gradzip.optim.core.ratios`),
    so that ``gradzip compare --rc`` treats EF-SGD like the error-reset methods. The
    exchange starts during backward (``overlap_backward``, :mod:`gradzip.optim.core.overlap`).
    """

    inputs_keep_gradient_nonfinite = True   # p = e + η d keeps a NaN/Inf of g (η·Inf is Inf or NaN)

    def __init__(self, params, lr, *, compressor: str = "auto", rc: float | None = None, **kwargs):
        codec, self.rc = single_codec(type(self).__name__, compressor, rc, DEFAULT_CODEC)
        super().__init__(params, lr, **kwargs)
        self.psync = self.make_psync(codec)
        self.psync.omit_zero_residuals = True   # a unit sent uncompressed owes nothing: no error kept
        self.psync.reuse_aggregates = True      # each aggregate is applied at once, never kept (as S-SGD)
        self._inputs: dict = {}   # param -> this step's exchange input (its own temporary)
        self._unscaled: set = set()   # params whose input this step is g itself (η applied after)

    def exchange_input(self, group, p):
        error = self.state[p].get("error")   # absent: zero (the first step, or nothing owed)
        plain = not group["momentum"] and not group["weight_decay"]
        if error is None and plain and self.sent_losslessly(p):   # p = η g, its mean η mean_j g_j:
            self._unscaled.add(p)                                    # g sent, η applied (S-SGD's bits)
            return p.grad
        self._unscaled.discard(p)
        if error is None and plain:
            d = self.psync.memory.residual(self._keys[p], p.grad)   # d = g: p = η g in one pass,
            self._inputs[p] = torch.mul(p.grad, group["lr"], out=d)    # into last step's input if spare
            return self._inputs[p]
        d = self.local_direction(p, group)   # a new tensor: p = e + η d is written into it
        self._inputs[p] = d.mul_(group["lr"]) if error is None else torch.add(error, d, alpha=group["lr"], out=d)
        return self._inputs[p]

    def apply_exchange(self, pairs, aggregates, residuals):
        unscaled, scaled = [], []
        for i, (_, p) in enumerate(pairs):
            (unscaled if p in self._unscaled else scaled).append(i)
        if unscaled:                            # x ← x − η mean_j g_j (sent as g)
            self.descend([pairs[i] for i in unscaled], [aggregates[i] for i in unscaled])
        if scaled:                              # x ← x − mean_j p'_j, one call
            torch._foreach_sub_([pairs[i][1] for i in scaled], [aggregates[i] for i in scaled])
        for (_, p), err in zip(pairs, residuals):
            if err is None:                      # sent uncompressed (PSync.omit_zero_residuals): e = 0
                self.state[p].pop("error", None)
            else:
                self.state[p]["error"] = err
            spent = self._inputs.pop(p, None)   # read by the exchange, kept by no one: next error's memory
            if spent is not None:
                self.psync.residual_spares[self._keys[p]] = spent
