"""gradzip inside Hugging Face Accelerate (docs/integrations.md, "Accelerate"): the recipe
needs a few lines and two helpers, :func:`register_hook` and :class:`PerRank`.

After ``accelerator.prepare``, ``register_hook(model, state)`` registers gradzip's DDP hook
on the DDP model (a torch optimizer: the hook compresses), and ``register_hook(model)`` DDP's
no-op hook (a gradzip optimizer communicates itself). A model that ``prepare`` did not wrap
in DDP is refused with the reason (one process: ``accelerate launch --cpu --num_processes 2``
starts one; on CPU, ``--multi_gpu --num_processes 2`` starts two) instead of an
``AttributeError``.

Accelerate's ``save_state`` writes the main process's objects only, but error-feedback
residuals (a gradzip optimizer's, a DDP hook state's) differ per rank, and a resume from
rank 0's alone drifts. ``accelerator.register_for_checkpointing(gradzip.integrations.accelerate.PerRank(x))``
saves every rank's ``x.state_dict()`` (gathered into the one file) and restores each rank's
own at ``load_state``. Nothing here imports Accelerate: it works with any saver that calls
``state_dict()`` on every rank and ``load_state_dict()`` on every rank.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel

from .ddp import HookState
from ..errors import GradzipError
from ..validation import refuses_unknown_options

__all__ = ["PerRank", "register_hook"]

#: The command that starts 2 processes, on CPU too (``--cpu --num_processes 2`` starts one).
LAUNCH = "accelerate launch --multi_gpu --num_processes 2 script.py"


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def register_hook(model: torch.nn.Module, state: HookState | None = None, hook: Callable | None = None) -> None:
    """Register on ``model``, the DDP module ``accelerator.prepare`` returned, gradzip's hook
    for ``state`` (``gradzip.integrations.ddp.hook(...)`` or a ``PowerSGDState``; ``hook``: the state's own
    unless given), or with ``state=None`` DDP's no-op hook, for a gradzip optimizer that
    communicates itself. Refuses a model that is not DDP, naming why (one process)."""
    if not isinstance(model, DistributedDataParallel):
        rank, world = _world()
        why = (f"this run has {world} process{'es' * (world > 1)}: start 2 with `{LAUNCH}` (on CPU too; "
               "`--cpu --num_processes 2` starts one) or `torchrun --nproc-per-node 2 script.py`") if world == 1 else \
            "pass it through accelerator.prepare(...) first, then register the hook"
        raise GradzipError(f"register_hook: the model is a {type(model).__name__}, not DistributedDataParallel: "
                           f"accelerator.prepare wraps it in DDP only when several processes run, and {why}")
    if state is not None and not isinstance(state, HookState):
        raise GradzipError(f"register_hook: state must be a gradzip.integrations.ddp hook state (gradzip.integrations.ddp.hook(...) or "
                           f"PowerSGDState), or None for a gradzip optimizer, got {type(state).__name__}")
    if state is None:
        model.register_comm_hook(None, noop_hook)
    else:
        model.register_comm_hook(state, hook or state.comm_hook)


class PerRank:
    """Every rank's ``obj.state_dict()`` in one state (``{"ranks": [rank 0's, rank 1's, ...]}``),
    each rank loading its own. ``obj``: anything with ``state_dict()`` / ``load_state_dict()``
    (a gradzip optimizer, ``gradzip.integrations.ddp.CodecState``, ...). ``state_dict()`` is collective
    (one ``all_gather_object`` on the default group): every rank must call it, as
    ``accelerator.save_state`` does."""

    @refuses_unknown_options
    def __init__(self, obj: Any):
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise GradzipError(f"PerRank: a {type(obj).__name__} has no state_dict()/load_state_dict(); wrap the "
                               "gradzip optimizer or the DDP hook state itself")
        self.obj = obj

    def state_dict(self) -> dict:
        mine = self.obj.state_dict()
        rank, world = _world()
        if world == 1:
            return {"ranks": [mine]}
        out: list = [None] * world
        dist.all_gather_object(out, mine)
        return {"ranks": out}

    def load_state_dict(self, state: dict) -> None:
        rank, world = _world()
        ranks = state.get("ranks") if isinstance(state, dict) else None
        if not isinstance(ranks, list):
            raise GradzipError("PerRank.load_state_dict: this is not a PerRank state (no 'ranks' list); load a "
                               "state saved through gradzip.integrations.accelerate.PerRank")
        if len(ranks) != world:
            raise GradzipError(f"PerRank: the state holds {len(ranks)} ranks' states and the run has {world} "
                               "processes: residuals are per rank; resume with as many processes as saved it")
        self.obj.load_state_dict(ranks[rank])
