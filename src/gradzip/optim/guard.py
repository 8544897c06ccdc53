"""The non-finite guard of a step and its undo log (docs/algorithms.md §Non-finite
gradients and the settings check): a mixin of
:class:`~gradzip.optim.base.DistributedOptimizer`, apart from it because it is one concept
with its own state (the policy, the log of what the step replaced, the skip counter) that
no box reads.

Two checks, one policy (``nonfinite``, :data:`gradzip.nonfinite.NONFINITE_POLICIES`):

- **the gradients**, before anything is compressed or sent (:meth:`gradients_finite`,
  called by ``begin_step``); ``"skip"`` agrees across workers first;
- **what the codec produced**: every exchange checks its decoded aggregate (the same on
  every worker, so no collective) and raises
  :class:`~gradzip.nonfinite.NonFiniteAggregate`; a ``step()`` catches it and returns
  :meth:`codec_overflow`, which puts back what the step replaced (:meth:`replaced`) and
  skips the step, or raises :class:`~gradzip.nonfinite.NonFiniteGradient` once the step
  changed the model (:meth:`irreversible`) or under ``"raise"``.

The host class provides ``comm``, ``nonfinite``, ``steps`` and ``skipped_steps``.
"""
from __future__ import annotations

from typing import Any

import torch

from ..nonfinite import NonFiniteAggregate, NonFiniteGradient, first_nonfinite


class NonFiniteGuard:
    """Mixin: the step's non-finite checks, the undo log and the codec-overflow outcome."""

    _undo: "list[tuple[dict, str, Any]] | None" = None

    def start_undo_log(self) -> None:
        """A step began: nothing replaced yet, everything undoable (``begin_step``)."""
        self._undo = []

    def irreversible(self) -> None:
        """Called by a ``step()`` before it changes the model or a residual ahead of an
        exchange (local SGD's local step, CSER's error reset, CD-SGD's local update). Until
        then a codec overflow (a non-finite decoded aggregate, the same on every worker)
        under ``nonfinite="skip"`` skips the step exactly: the momentum buffers that
        ``local_direction`` replaced are put back (methods keep every other change until
        after their exchanges, or log it with :meth:`replaced`). After it, a codec overflow
        raises under either policy."""
        self._undo = None

    def replaced(self, state: dict, key: str) -> None:
        """Log ``state[key]`` before a step replaces it (with a new tensor, never in place),
        so that a skipped step can put it back."""
        if self._undo is not None:
            self._undo.append((state, key, state.get(key)))

    def restore_replaced(self) -> None:
        """Put back everything :meth:`replaced` logged since the step began (newest first)
        and empty the log; nothing if the step became :meth:`irreversible`."""
        for state, key, old in reversed(self._undo or []):
            if old is None:
                state.pop(key, None)
            else:
                state[key] = old
        if self._undo is not None:
            self._undo = []

    def codec_overflow(self, overflow: NonFiniteAggregate, loss: Any) -> Any:
        """What ``step()`` returns when its exchange decoded a non-finite aggregate although
        every gradient was finite: ``loss``, the step undone and skipped on every worker
        (``"skip"``, while it can be undone); else :class:`NonFiniteGradient` is raised (the
        step undone first where it can be)."""
        name = type(self).__name__
        undone = self._undo is not None
        if undone:  # the step as if it never began (both policies)
            self.restore_replaced()
            self.steps -= 1
        if self.nonfinite == "skip" and undone:
            self.skipped_steps += 1
            return loss
        after = "" if self.nonfinite == "raise" else (
            " (nonfinite='skip' cannot undo this method's step once it changed the model: raised instead)")
        raise NonFiniteGradient(
            f"{name} step {self.steps + undone}: {overflow}{after}. Lower the learning rate, clip "
            "gradients or pick a codec with a wider range; or skip such steps on every worker with "
            "nonfinite='skip' (CLI: --nonfinite skip)."
        ) from overflow

    def gradients_finite(self, params: list[torch.Tensor]) -> bool:
        """Whether this step may go on. ``"raise"``: this worker's gradients are checked
        locally (no collective) and a NaN/Inf raises :class:`NonFiniteGradient` here, before
        anything is sent; the peers then stop at their next collective with a
        ``PeerFailure`` naming this rank. ``"skip"``: every worker must skip the same steps,
        so the workers agree first (one control allgather of 8 bytes per worker per step)
        and all skip if any worker's gradient is not finite."""
        first_bad = first_nonfinite([p.grad for p in params])
        if self.nonfinite == "raise":
            if first_bad >= 0:
                p = params[first_bad]
                raise NonFiniteGradient(
                    f"{type(self).__name__} step {self.steps + 1}: non-finite gradient (NaN or Inf) "
                    f"on rank {self.comm.rank}, parameter #{first_bad} (shape {tuple(p.shape)}); "
                    "stopped before anything was compressed, sent or updated. Lower the learning "
                    "rate or clip gradients, or skip such steps on every worker with "
                    "nonfinite='skip' (CLI: --nonfinite skip)."
                )
            return True
        if self.comm.world_size > 1:
            first_bad = max(self.comm.allgather_control(torch.tensor([first_bad])).reshape(-1).tolist())
        return first_bad < 0
