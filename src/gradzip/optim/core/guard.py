"""The non-finite guard of a step and its undo log (docs/algorithms.md §Non-finite
gradients and the settings check): a mixin of
:class:`~gradzip.optim.core.base.DistributedOptimizer`, apart from it because it is one concept
with its own state (the policy, the log of what the step replaced, the skip counter) that
no box reads.

Two checks, one policy (``nonfinite``, :data:`gradzip.guards.nonfinite.NONFINITE_POLICIES`):

- **the gradients**, before anything is compressed or sent (:meth:`first_bad_gradient`,
  called by ``begin_step``); ``"skip"`` agrees across workers first. Under ``"raise"`` a
  method whose exchange finds a bad gradient by itself (:meth:`gradients_checked_by_exchange`:
  S-SGD with ``none`` / ``fp16`` / ``bf16``) leaves them unread: one pass less per step;
- **what the codec produced**: every exchange checks its decoded aggregate (the same on
  every worker, so no collective) and raises
  :class:`~gradzip.guards.nonfinite.NonFiniteAggregate`; a ``step()`` catches it and returns
  :meth:`codec_overflow`, which puts back what the step replaced (:meth:`replaced`) and
  skips the step, or raises :class:`~gradzip.guards.nonfinite.NonFiniteGradient` once the step
  changed the model (:meth:`irreversible`) or under ``"raise"``. Where the exchange checks
  the gradients, a non-finite aggregate is first told apart from an overflow: an exact look
  at this worker's gradients and one control allgather, on that path only; a bad gradient
  anywhere raises :class:`~gradzip.guards.nonfinite.NonFiniteGradient` on every worker, naming
  the (lowest) rank and its parameter, the step undone.

The host class provides ``comm``, ``nonfinite``, ``steps``, ``skipped_steps`` and
``params_with_grad``.
"""
from __future__ import annotations

from typing import Any

import torch

from ...guards.nonfinite import NonFiniteAggregate, NonFiniteGradient, first_nonfinite


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
        if self.gradients_checked_by_exchange():   # a gradient's NaN/Inf, or an overflow?
            self._raise_on_a_bad_gradient(undone, overflow)
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

    def gradients_checked_by_exchange(self) -> bool:
        """Whether, under ``"raise"``, this step's exchange finds a NaN/Inf in any worker's
        gradient by itself: its input keeps the gradient's non-finite values and its PSync's
        aggregate check catches them (:attr:`gradzip.exchange.PSync.guards_inputs`). Then
        the gradients are not read before the exchange (:meth:`first_bad_gradient`, the
        hooks) and :meth:`codec_overflow` names the gradient. False here; S-SGD's and EF-SGD's
        say (``GradientExchange.inputs_keep_gradient_nonfinite``)."""
        return False

    def _raise_on_a_bad_gradient(self, undone: bool, overflow: NonFiniteAggregate) -> None:
        """After a non-finite aggregate of an exchange that checks the gradients: every
        worker looks at its own (exactly) and they agree (one control allgather; every
        worker is here, the aggregate being the same); a bad gradient on any rank raises
        :class:`NonFiniteGradient` on all, naming the lowest such rank and its parameter."""
        params = [p for _, p in self.params_with_grad()]
        first_bad = [first_nonfinite([p.grad for p in params])]
        if self.comm.world_size > 1:
            first_bad = self.comm.allgather_control(torch.tensor(first_bad)).reshape(-1).tolist()
        rank = next((r for r, bad in enumerate(first_bad) if bad >= 0), None)
        if rank is not None:
            index = first_bad[rank]
            raise NonFiniteGradient(self._bad_gradient_message(
                rank, index, params[index], "found in the aggregate of the exchange; stopped on every worker "
                f"before anything was updated{'' if undone else ' (the step could not be undone)'}")) from overflow

    def _bad_gradient_message(self, rank: int, index: int, p: torch.Tensor, where: str) -> str:
        return (f"{type(self).__name__} step {self.steps + 1}: non-finite gradient (NaN or Inf) on rank {rank}, "
                f"parameter #{index} (shape {tuple(p.shape)}); {where}. Lower the learning rate or clip "
                "gradients, or skip such steps on every worker with nonfinite='skip' (CLI: --nonfinite skip).")

    def first_bad_gradient(self, params: list[torch.Tensor]) -> int:
        """This worker's first parameter (position in ``params``) whose gradient holds a
        NaN/Inf, or -1. ``"raise"``: checked locally (no collective) and a NaN/Inf raises
        :class:`NonFiniteGradient` here, before anything is sent; the peers then stop at
        their next collective with a ``PeerFailure`` naming this rank. ``"skip"``: the
        position, which the workers then agree on (``begin_step``: one control allgather
        per step; every worker skips if any found one). ``"off"``, and ``"raise"`` where
        :meth:`gradients_checked_by_exchange`: nothing read here (-1)."""
        if self.nonfinite == "off" or (self.nonfinite == "raise" and self.gradients_checked_by_exchange()):
            return -1
        first_bad = first_nonfinite([p.grad for p in params])
        if self.nonfinite == "raise" and first_bad >= 0:
            self.raise_bad_gradient(params, first_bad, "stopped before anything was compressed, sent or updated")
        return first_bad

    def raise_bad_gradient(self, params: list[torch.Tensor], index: int, where: str) -> None:
        """Raise :class:`NonFiniteGradient` for this worker's ``params[index]`` (``where``:
        how far the step got); the peers stop at their next collective."""
        raise NonFiniteGradient(self._bad_gradient_message(self.comm.rank, index, params[index], where))
