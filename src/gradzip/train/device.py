"""Where a worker trains and in which precision: ``--device cpu|cuda|auto`` and
``--amp none|bf16|fp16`` of ``gradzip train`` / ``compare``.

- :func:`resolve_device`: ``cpu``; ``cuda`` (rank r on ``cuda:LOCAL_RANK % device_count``;
  a one-line error where CUDA is missing); ``auto``: CUDA where available, else the CPU.
- :class:`Precision`: the forward pass under ``torch.autocast`` (bf16 or fp16) and, for
  fp16, ``torch.amp.GradScaler`` around a gradzip optimizer: the loss is scaled for
  backward, the gradients are unscaled *before* the optimizer compresses them, and the
  workers agree on whether any of them found an inf/NaN (one control allgather of one
  flag): if one did, every worker skips the step (the optimizer's ``step()`` is not called:
  residuals, momentum and the step counter untouched; ``skipped_steps`` counts it) and
  every worker's scaler backs off alike, so the scales stay equal on every worker.

fp16 needs the exchange to start in ``step()``, after unscaling: :func:`method_options`
turns the exchange during backward (``overlap_backward``) off, and refuses it when asked for.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from ..comm import Group
from ..errors import GradzipError

DEVICES = ("cpu", "cuda", "auto")
AMP = ("none", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(device: str, rank: int = 0) -> torch.device:
    """The torch device of the worker of ``rank`` (on CUDA: ``LOCAL_RANK``, where set,
    else ``rank``, modulo the devices this process sees)."""
    if device not in DEVICES:
        raise GradzipError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise GradzipError("--device cuda, but this torch sees no CUDA device (a CPU build, or no GPU); "
                           "use --device cpu, or auto to take a GPU where there is one")
    local = int(os.environ.get("LOCAL_RANK", rank))
    return torch.device("cuda", local % torch.cuda.device_count())


def method_options(amp: str, options: dict[str, Any], cls: type) -> dict[str, Any]:
    """The keyword arguments of method ``cls`` for ``amp``: under fp16,
    ``overlap_backward=False`` where the method can exchange during backward
    (``overlaps_backward``: the gradients are unscaled after backward, before compression);
    an explicit ``overlap_backward=True`` is an error naming the fix."""
    if amp != "fp16" or not getattr(cls, "overlaps_backward", False):
        return options
    if options.get("overlap_backward") is True:
        raise GradzipError("--amp fp16 unscales the gradients after backward, before they are compressed, "
                           "so the exchange cannot start during backward: drop --overlap-backward true "
                           "(or use --amp bf16, which needs no scaling)")
    return {**options, "overlap_backward": False}


class Precision:
    """Autocast for the forward pass and, for fp16, the agreed GradScaler step."""

    def __init__(self, amp: str, device: torch.device, comm: Group):
        if amp not in AMP:
            raise GradzipError(f"unknown --amp {amp!r}; choose one of {', '.join(AMP)}")
        self.amp, self.device, self.comm = amp, device, comm
        self.scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None

    def autocast(self):
        """The context of the forward pass and the loss."""
        if self.amp == "none":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=_DTYPES[self.amp])

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, opt) -> bool:
        """``opt.step()``, for fp16 through the scaler with the workers' agreement; whether
        the optimizer stepped. Collective under fp16 (one control allgather)."""
        if self.scaler is None:
            opt.step()
            return True
        self.scaler.unscale_(opt)
        found = self._found_inf(opt)
        local = any(bool(f.item()) for f in found.values())
        agreed = bool(self.comm.allgather_control(torch.tensor([float(local)])).sum().item())
        for f in found.values():  # every worker's scaler sees the agreed verdict
            f.fill_(float(agreed))
        self.scaler.step(opt)     # calls opt.step() only where nothing was found: on every worker alike
        self.scaler.update()
        if agreed:
            opt.skipped_steps += 1
        return not agreed

    def _found_inf(self, opt) -> dict:
        states = getattr(self.scaler, "_per_optimizer_states", None)
        try:
            return states[id(opt)]["found_inf_per_device"]
        except (TypeError, KeyError):
            raise GradzipError(f"this torch ({torch.__version__}) keeps GradScaler's inf checks elsewhere: "
                               "--amp fp16 cannot make the workers agree on a skipped step; use --amp bf16 "
                               "or torch>=2.3") from None

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
