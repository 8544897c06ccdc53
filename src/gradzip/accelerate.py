"""gradzip inside Hugging Face Accelerate (docs/integrations.md, "Accelerate"): the recipe
needs a few lines and one helper, :class:`PerRank`.

Accelerate's ``save_state`` writes the main process's objects only, but error-feedback
residuals (a gradzip optimizer's, a DDP hook state's) differ per rank, and a resume from
rank 0's alone drifts. ``accelerator.register_for_checkpointing(gradzip.accelerate.PerRank(x))``
saves every rank's ``x.state_dict()`` (gathered into the one file) and restores each rank's
own at ``load_state``. Nothing here imports Accelerate: it works with any saver that calls
``state_dict()`` on every rank and ``load_state_dict()`` on every rank.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .errors import GradzipError
from .validation import refuses_unknown_options

__all__ = ["PerRank"]


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class PerRank:
    """Every rank's ``obj.state_dict()`` in one state (``{"ranks": [rank 0's, rank 1's, ...]}``),
    each rank loading its own. ``obj``: anything with ``state_dict()`` / ``load_state_dict()``
    (a gradzip optimizer, ``gradzip.ddp.CodecState``, ...). ``state_dict()`` is collective
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
                               "state saved through gradzip.accelerate.PerRank")
        if len(ranks) != world:
            raise GradzipError(f"PerRank: the state holds {len(ranks)} ranks' states and the run has {world} "
                               "processes: residuals are per rank; resume with as many processes as saved it")
        self.obj.load_state_dict(ranks[rank])
