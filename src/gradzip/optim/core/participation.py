"""Which parameters a method holds, and which take part in a step: a mixin of
:class:`~gradzip.optim.core.base.DistributedOptimizer`, apart from it because it is one concept
(the parameter set: held once, dense gradients, the same on every worker) that no box reads.

**Held once**: a parameter listed twice (``EFSGD([a, a])``, tied weights in a hand-built
list) is held once, where it is first listed, with one warning (torch warns too, and its
optimizers update such a parameter twice): every method updates it once per step, with
``overlap_backward`` on or off alike. A method that wraps a torch optimizer (``Compressed``,
``DiLoCo``) holds the inner optimizer's groups once too (:func:`hold_once`).

**Complex parameters** are taken as torch's optimizers take them, as their real views: the
exchange (:mod:`gradzip.exchange`) sends ``torch.view_as_real`` of every complex tensor, and
a method whose box is real-linear in its inputs (momentum, weight decay, error feedback,
model averaging, a torch optimizer inside) gives the numbers of the same model with a real
parameter of shape ``(..., 2)`` used through ``torch.view_as_complex`` (to float rounding:
a complex ``add_(x, alpha=a)`` rounds its product differently from the real one). A method whose box
reads the entries otherwise (DGC's selection, PowerSGD's matrices, A-SGD's server, the
1-bit Adam / LAMB moments) refuses complex parameters at construction, in one line
(``complex_parameters = False``).

**Dense gradients**: a sparse gradient (``nn.Embedding(sparse=True)``) is refused in one
line where it is first read (``params_with_grad``, or the gradient hook of the backward
overlap): every exchange, codec and box here works on dense tensors.

**Missing gradients** (``params_with_grad``): every parameter of the optimizer that
requires a gradient takes part in every step; one whose ``.grad`` is None on a worker
counts as a zero gradient there (its ``.grad`` is set to zeros), as under
``DistributedDataParallel(find_unused_parameters=True)``. Every worker thus exchanges the
same tensors in the same order whatever its backward touched. A parameter no worker
touched still gets weight decay, momentum and any residual carried over (like DDP +
``torch.optim.SGD``, unlike ``torch.optim.SGD`` alone, which skips it): it stays unchanged
only with ``weight_decay=0`` and no momentum / residual left. Parameters with
``requires_grad=False`` (frozen) never take part.

**The same set on every worker**: which parameters take part can change mid-run
(``requires_grad_(False)`` to freeze a layer, ``True`` to unfreeze it), and every worker
must change it alike, at the same step, or their exchanges would average different tensors
together (same shapes) or fail inside the collective (different ones). So the workers
agree on it (:meth:`~Participation.agree`) before any step's exchange of these tensors
starts: a digest of the set (recomputed only when the set changes) rides in the step's
control allgather, 8 bytes per worker: the one the step makes anyway (the backward
overlap's, ``nonfinite="skip"``'s), else one of its own on every step that exchanges
(:meth:`~Participation.exchanges_at`; a method with periods only on those steps). If the
digests differ, every worker raises :class:`gradzip.guards.consistency.InconsistentWorkers` naming
each rank's frozen parameters, nothing updated. (A-SGD pushes to a server that holds the
parameter list it was built with: it checks its own set against that, no collective.)

The host class provides ``comm``, ``param_groups`` (torch's), ``_keys`` (parameter -> its
position) and ``_exchanges`` (its PSyncs).
"""
from __future__ import annotations

import hashlib
import os
import sys
import warnings
from typing import Callable

import torch

from ...guards import consistency
from ...errors import GradzipError


def held_once(params: list, who: str, where: str) -> list:
    """``params`` (tensors, or torch's ``(name, tensor)`` pairs) with every tensor after its
    first listing left out, warning once per list that had any (module docstring)."""
    seen: set[int] = set()
    out, repeated = [], []
    for item in params:
        tensor = item[1] if isinstance(item, tuple) and len(item) == 2 else item
        if id(tensor) in seen:
            repeated.append(tensor)
            continue
        seen.add(id(tensor))
        out.append(item)
    if repeated:
        shapes = ", ".join(str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
                           for t in repeated[:3])
        warnings.warn(f"{who}: {where}params lists {len(repeated)} parameter(s) more than once (shape "
                      f"{shapes}{', ...' if len(repeated) > 3 else ''}); each is held once and updated once "
                      "per step (tied weights are one parameter)", UserWarning, stacklevel=_callers_level())
    return out


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside gradzip and torch: the line of the
    caller's script that built the optimizer."""
    inside = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(torch.__file__))
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def require_dense(p: torch.Tensor, who: str, index: int) -> None:
    """Refuse, in one line naming ``who`` and the parameter (its position ``index``), a
    sparse ``p.grad`` (module docstring)."""
    if p.grad is not None and p.grad.layout != torch.strided:
        raise GradzipError(
            f"{who}: parameter #{index} (shape {tuple(p.shape)}) has a sparse gradient ({p.grad.layout}, e.g. from "
            "nn.Embedding(sparse=True)); gradzip's exchanges, codecs and methods work on dense gradients: build "
            "the layer with sparse=False")


def hold_once(optimizer: torch.optim.Optimizer, who: str) -> None:
    """In place: every param group of ``optimizer`` (the inner optimizer a method wraps)
    holding each parameter once (:func:`held_once`), its ``param_names`` kept in step."""
    for i, group in enumerate(optimizer.param_groups):
        names = group.get("param_names")
        items = list(zip(names, group["params"])) if names else list(group["params"])
        kept = held_once(items, who, f"inner param_groups[{i}].")
        if len(kept) < len(items):
            group["params"] = [t for _, t in kept] if names else kept
            if names:
                group["param_names"] = [n for n, _ in kept]


class Participation:
    """Mixin: the held parameters (once each), the ones that take part in a step, their
    gradients (dense; zeros where missing), and the workers' agreement on that set."""

    #: This method's box takes a complex parameter as its real view (module docstring);
    #: False: refused at construction.
    complex_parameters: bool = True
    _set_digest: tuple = ((), 0)   # (keys of the set, its digest): recomputed when the keys change
    _agreed_keys: tuple | None = None   # the set last agreed on

    def add_param_group(self, param_group: dict) -> None:
        """torch's, with the group's parameters held once (:func:`held_once`), complex ones
        refused where this method does not take them (:attr:`complex_parameters`)."""
        if isinstance(param_group, dict) and not isinstance(param_group.get("params"), (torch.Tensor, set)):
            param_group = {**param_group, "params": held_once(list(param_group["params"]), type(self).__name__,
                                                              f"param_groups[{len(self.param_groups)}].")}
        super().add_param_group(param_group)
        if not self.complex_parameters:
            self._refuse_complex(self.param_groups[-1]["params"])

    def _refuse_complex(self, params: list) -> None:
        held = sum(len(g["params"]) for g in self.param_groups) - len(params)
        for i, p in enumerate(params):
            if p.is_complex():
                self.param_groups.pop()
                name = type(self).__name__
                raise GradzipError(
                    f"{name}: parameter #{held + i} (shape {tuple(p.shape)}) is {p.dtype}, and {name}'s box reads "
                    "real entries; train its real view instead (a real parameter of shape (..., 2) used through "
                    "torch.view_as_complex), or use a method that takes complex parameters (S-SGD, EF-SGD, ...)")

    def participating(self) -> list[tuple[dict, torch.Tensor]]:
        """``(group, param)`` for every parameter that requires a gradient, in a fixed order,
        the same on every worker."""
        return [(g, p) for g in self.param_groups for p in g["params"] if p.requires_grad]

    def params_with_grad(self) -> list[tuple[dict, torch.Tensor]]:
        """:meth:`participating`, with a missing ``.grad`` set to zeros first (module
        docstring: DDP's ``find_unused_parameters`` semantics) and a sparse one refused."""
        pairs = self.participating()
        for _, p in pairs:
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
            else:
                self.check_dense(p)
        return pairs

    def check_dense(self, p: torch.Tensor) -> None:
        """Refuse, in one line, a sparse gradient of ``p`` (module docstring)."""
        require_dense(p, type(self).__name__, self._keys[p])

    # -- the same set on every worker ---------------------------------------------------------
    def exchanges_at(self, step: int) -> bool:
        """Whether step ``step`` (from 1) exchanges the parameters that take part, so the
        workers agree on them first (module docstring): every step here; a method that
        exchanges on some steps only says which."""
        return True

    def set_digest(self, pairs: list) -> int:
        """A 63-bit digest of which held parameters take part (``pairs``, ``(group, param)``),
        recomputed only when that set changes."""
        keys = tuple(self._keys[p] for _, p in pairs)
        if keys != self._set_digest[0]:
            blob = repr((len(self._keys), keys)).encode()
            self._set_digest = (keys, int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1)
        return self._set_digest[1]

    def agree(self, flags: list[int], pairs: list, cleanup: Callable[[], None] | None = None) -> list[list[int]]:
        """Every worker's ``flags`` (one row per rank), gathered with the digest of the set
        of ``pairs`` in one control allgather (world of one: this worker's, no collective).
        Digests that differ: ``cleanup()`` first (e.g. wait for exchanges already launched),
        then :class:`gradzip.guards.consistency.InconsistentWorkers` on every worker, naming each
        rank's frozen parameters. A set that differs from the one last agreed on (a change
        every worker made) starts the exchanges' two-phase server errors from zero.
        Collective: every worker calls it at the same point."""
        digest = self.set_digest(pairs)
        rows = [[*flags, digest]]
        if self.comm.world_size > 1:
            rows = self.comm.allgather_control(torch.tensor(rows[0], dtype=torch.int64))
            rows = rows.reshape(self.comm.world_size, -1).tolist()
        if len({row[-1] for row in rows}) > 1:
            if cleanup is not None:
                cleanup()
            self._name_the_difference()
        keys = self._set_digest[0]
        if self._agreed_keys is not None and keys != self._agreed_keys:   # a change every worker made
            for psync in self._exchanges:   # the two-phase buckets' slices change with the set
                psync.server_errors.reset()
        self._agreed_keys = keys
        return [row[:-1] for row in rows]

    def _name_the_difference(self) -> None:
        name, held = type(self).__name__, [p for g in self.param_groups for p in g["params"]]
        step = getattr(self, "steps", 0) + 1
        fields = {"frozen parameters": [i for i, p in enumerate(held) if not p.requires_grad],
                  "parameters held": len(held)}
        fix = ("Freeze or unfreeze parameters (requires_grad) alike on every worker, before the same step; "
               "nothing was updated.")
        consistency.verify(self.comm, fields, what=f"{name} parameters taking part in step {step}",
                           fixes={"": fix})
        raise consistency.InconsistentWorkers(
            f"workers run with different {name} parameters taking part in step {step} (their digests differ). {fix}")
