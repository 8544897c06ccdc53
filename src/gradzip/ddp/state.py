"""What both DDP hook states share (docs/ddp.md, "Stable state" and "Non-finite gradients"):
parameter keys that survive bucket rebuilds, the group, pickling, and the step's
non-finite policy."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..comm import TorchGroup
from ..errors import GradzipError
from ..nonfinite import NONFINITE_POLICIES, NonFiniteGradient


class HookState:
    """Stable keys (a parameter's position in ``model.parameters()``, or first-seen order
    without ``model``), the process group (re-created on first use after unpickling),
    ``iter`` (synchronised steps completed) and ``nonfinite`` (``"raise"``, ``"skip"`` or
    ``"off"``, as the optimizers' option; see :meth:`settle`)."""

    _transient = ("process_group", "_comm", "_ids", "_pending")

    def __init__(self, model: torch.nn.Module | None, process_group: Any, nonfinite: str = "raise"):
        if nonfinite not in NONFINITE_POLICIES:
            raise GradzipError(f"{type(self).__name__}: nonfinite must be one of "
                               f"{', '.join(NONFINITE_POLICIES)}, got {nonfinite!r}")
        self.process_group = process_group
        self.nonfinite = nonfinite
        self.iter = 0                    # synchronised steps completed (hook rounds)
        self.skipped_steps = 0           # steps whose gradients were zeroed (nonfinite="skip")
        self._comm = None
        self._pending: list = []
        self._ids: dict[int, int] = {}   # id(param) -> key
        self._next_key = 0
        self.keys_from: str | None = None   # "model" (bind) or "first_seen"
        self.names: dict[int, str] = {}
        if model is not None:
            self.bind(model)

    def bind(self, model: torch.nn.Module) -> None:
        """Key every parameter by its position in ``model.parameters()`` (stable)."""
        module = getattr(model, "module", model)
        named = list(module.named_parameters())
        self._ids = {id(p): i for i, (_, p) in enumerate(named)}
        self.names = {i: n for i, (n, _) in enumerate(named)}   # key -> name (PerTensor rules)
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
    def comm(self) -> TorchGroup:
        if self._comm is None:
            self._comm = TorchGroup(self.process_group)
        return self._comm

    @property
    def bytes_sent(self) -> int:
        return self._comm.bytes_sent if self._comm is not None else 0

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in self._transient}

    def __setstate__(self, state: dict) -> None:
        state.setdefault("nonfinite", "raise")
        state.setdefault("skipped_steps", 0)
        state.setdefault("names", {})
        self.__dict__.update(state)
        self.process_group, self._comm, self._pending, self._ids = None, None, [], {}
        self._next_key = 0   # first-seen keys are re-derived on first use; model keys need bind()

    def _check_fresh(self) -> None:
        if self._pending:
            raise GradzipError("a DDP hook state was checkpointed in the middle of a backward pass")

    def settle(self, where: str | None, buffers: list[torch.Tensor], hook: str) -> bool:
        """Apply ``nonfinite`` to a step whose gradients (or what the codec made of them)
        were not finite ``where`` (the same on every rank; None: the step is fine).
        Returns whether the step is skipped. ``"raise"``:
        :class:`NonFiniteGradient` on every rank; ``"skip"``: every bucket of the step is
        zeroed on every rank (the optimizer then steps with a zero gradient; momentum and
        weight decay still act), residuals, errors, ``Q`` and ``iter`` untouched,
        ``skipped_steps`` counted; ``"off"``: the values pass through (the AMP
        ``GradScaler`` mode: the scaler sees the Inf and skips the step)."""
        if where is None or self.nonfinite == "off":
            return False
        if self.nonfinite == "raise":
            raise NonFiniteGradient(
                f"{hook} step {self.iter + 1}: non-finite values (NaN or Inf) {where}; raised on every "
                "rank before the bucket was written. Lower the learning rate or clip gradients, zero such "
                "steps on every rank with nonfinite='skip', or let a GradScaler handle them with "
                "nonfinite='off'.")
        for buffer in buffers:
            buffer.zero_()
        self.skipped_steps += 1
        return True

    def agree(self, gradient_bad: bool, output_bad: bool) -> str | None:
        """Where the step is not finite, the same on every rank (None: nowhere): one 8-byte
        control allgather per rank and step (none with ``nonfinite="off"``, which needs no
        agreement). A rank's own gradient is named before what the codec made of it."""
        if self.nonfinite == "off":
            return None
        flag = 2 if gradient_bad else int(output_bad)
        flags = self.comm.allgather_control(torch.tensor([flag])).reshape(-1).tolist()
        for level, what in ((2, "in the gradient"), (1, "in what the codec made of the gradient")):
            ranks = [r for r, f in enumerate(flags) if f == level]
            if ranks:
                return f"{what} on rank{'s' * (len(ranks) > 1)} {','.join(map(str, ranks))}"
        return None


def views(bucket: "dist.GradBucket") -> list[torch.Tensor]:
    """Each parameter's gradient as a view of the bucket's flat buffer, in bucket order."""
    buffer = bucket.buffer()
    out, offset = [], 0
    for g in bucket.gradients():
        out.append(buffer[offset:offset + g.numel()].view(g.shape))
        offset += g.numel()
    return out
