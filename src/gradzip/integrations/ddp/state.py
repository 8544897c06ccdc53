"""What both DDP hook states share (docs/ddp.md, "Stable state" and "Non-finite gradients"):
parameter keys that survive bucket rebuilds, the group, pickling, and the step's
non-finite policy."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ...comm import TorchGroup
from ...errors import GradzipError
from ...guards.nonfinite import NONFINITE_POLICIES, NonFiniteGradient


class HookState:
    """Stable keys (a parameter's position in ``model.parameters()``, or first-seen order
    without ``model``), the process group (re-created on first use after unpickling),
    ``iter`` (synchronised steps completed) and ``nonfinite`` (``"raise"``, ``"skip"`` or
    ``"off"``, as the optimizers' option; see :meth:`settle`).

    The counters a run reports, ``iter``, ``skipped_steps`` and ``bytes_sent``, are in every
    state (:meth:`counters`, :meth:`load_counters`) and survive pickling, so a resumed run
    counts on from the saved ones (``bytes_sent`` of a run resumed from a checkpoint is the
    whole run's, not the part after the resume)."""

    _transient = ("process_group", "_comm", "_ids", "_pending")

    def __init__(self, model: torch.nn.Module | None, process_group: Any, nonfinite: str = "raise"):
        if nonfinite not in NONFINITE_POLICIES:
            raise GradzipError(f"{type(self).__name__}: nonfinite must be one of "
                               f"{', '.join(NONFINITE_POLICIES)}, got {nonfinite!r}")
        self.process_group = process_group
        self.nonfinite = nonfinite
        self.iter = 0                    # synchronised steps completed (hook rounds)
        self.skipped_steps = 0           # steps whose gradients were zeroed (nonfinite="skip")
        self._bytes_before = 0           # bytes sent through an earlier group (saved, or before pickling)
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
    def comm_hook(self) -> Callable:
        """The hook function this state is for: ``ddp.register_comm_hook(state, state.comm_hook)``."""
        raise NotImplementedError

    @property
    def comm(self) -> TorchGroup:
        if self._comm is None:
            self._comm = TorchGroup(self.process_group)
        return self._comm

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent through the hook, a resumed run's included."""
        return self._bytes_before + (self._comm.bytes_sent if self._comm is not None else 0)

    def counters(self) -> dict:
        """The counters a run reports, for ``state_dict()``: :meth:`load_counters` restores them."""
        return {"iter": self.iter, "skipped_steps": self.skipped_steps, "bytes_sent": self.bytes_sent}

    def load_counters(self, state: dict) -> None:
        """:meth:`counters` back from a saved state (a state without ``bytes_sent``, saved
        before it was kept, counts from 0)."""
        self.iter = int(state["iter"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._bytes_before = int(state.get("bytes_sent", 0)) - (self._comm.bytes_sent if self._comm is not None else 0)

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if k not in self._transient}
        state["_bytes_before"] = self.bytes_sent   # the group is not pickled: its count is
        return state

    def __setstate__(self, state: dict) -> None:
        state.setdefault("nonfinite", "raise")
        state.setdefault("skipped_steps", 0)
        state.setdefault("_bytes_before", 0)
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
