"""gradzip inside PyTorch Lightning (optional: ``pip install 'gradzip[lightning]'``;
docs/integrations.md). Two strategies, both DDP's process setup, sampler and launch:

* :class:`DDPHookStrategy`: DDP with a gradzip communication hook (:mod:`gradzip.integrations.ddp`)
  registered on every device. Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers
  hooks only for CUDA devices, so on CPU it silently trains uncompressed.
* :class:`GradzipStrategy`: for a gradzip optimizer returned by ``configure_optimizers``: no
  DDP wrapper (the optimizer communicates; under DDP every gradient would be sent twice),
  rank 0's parameters broadcast at the start, gradient accumulation through the
  optimizer's ``accumulate()``.

Checkpoints: Lightning writes rank 0's optimizer state only, but error-feedback residuals,
hook residuals and (local SGD, CSER, ...) model replicas differ per rank, and a resume from
rank 0's alone drifts. Both strategies gather every rank's state into the checkpoint
(``checkpoint["gradzip"]["ranks"][r]``: the hook state, every optimizer's state, and the
module's weights where an optimizer's replicas differ) and each rank restores its own, so
``trainer.fit(model, ckpt_path=...)`` continues bit for bit from a checkpoint taken at an
epoch's end; from one taken mid-epoch it does not (Lightning restarts a plain data loader
from the epoch's start, with plain DDP too). Resume with the world size that saved it.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .ddp import CodecState, PowerSGDState
from ..errors import GradzipError
from ..optim import DistributedOptimizer
from ..guards.replicas import broadcast_parameters
from ..validation import constructor_options, refuse_unknown_options

try:
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as error:  # pragma: no cover - the optional dependency
    raise GradzipError(f"gradzip.integrations.lightning needs PyTorch Lightning ({error}); install it: "
                       "pip install 'gradzip[lightning]' (or pip install lightning)") from None

__all__ = ["DDPHookStrategy", "GradzipStrategy"]


def _gather(obj: Any) -> list:
    """Every rank's ``obj`` in rank order (one all_gather_object; collective)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _check_options(cls: type, kwargs: dict) -> None:
    """Refuse a keyword that neither the strategy (``DDPStrategy``'s included) nor
    ``DistributedDataParallel`` takes: ``DDPStrategy`` passes the rest on to DDP unchecked,
    and under :class:`GradzipStrategy`, which builds no DDP, nothing would read it."""
    ddp = [n for n in inspect.signature(DistributedDataParallel.__init__).parameters if n not in ("self", "module")]
    valid = constructor_options(cls) + ddp
    refuse_unknown_options(cls.__name__, [k for k in kwargs if k not in valid], valid)


def _mine(checkpoint: dict) -> dict | None:
    """This rank's entry of ``checkpoint["gradzip"]`` (None: not a gradzip checkpoint)."""
    saved = checkpoint.get("gradzip")
    if saved is None:
        return None
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    ranks = saved["ranks"]
    if len(ranks) != world:
        raise GradzipError(f"this checkpoint holds the gradzip state of {len(ranks)} ranks and the run has {world}: "
                           "residuals and replicas are per rank; resume with as many processes as saved it")
    return ranks[dist.get_rank() if world > 1 else 0]


class _PerRank:
    """Gathers each rank's state into the checkpoint and restores this rank's (mixed into a
    ``DDPStrategy``)."""

    def _rank_state(self) -> dict:
        raise NotImplementedError

    def _load_rank_state(self, state: dict) -> None:
        raise NotImplementedError

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any = None) -> None:
        # every rank comes here (Lightning writes on rank 0 only): gather first
        checkpoint["gradzip"] = {"ranks": _gather(self._rank_state())}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        mine = _mine(checkpoint)
        if mine is not None:
            self._load_rank_state(mine)
        return checkpoint


class DDPHookStrategy(_PerRank, DDPStrategy):
    """``DDPStrategy`` with a gradzip hook registered on any device (CPU included):
    ``Trainer(strategy=DDPHookStrategy(gradzip.integrations.ddp.hook("topk:ratio=0.01")))``.

    ``state``: a :class:`gradzip.integrations.ddp.CodecState` (``gradzip.integrations.ddp.hook(...)``) or
    :class:`gradzip.integrations.ddp.PowerSGDState`; ``hook``: default the state's own (``state.comm_hook``:
    :func:`~gradzip.integrations.ddp.codec_hook` or :func:`~gradzip.integrations.ddp.powersgd_hook`). The state is bound to the
    LightningModule (keys and names by ``named_parameters()``) unless it already is, and is
    saved and restored per rank with every checkpoint. ``kwargs``: ``DDPStrategy``'s (an unknown
    one is refused, naming the closest)."""

    def __init__(self, state: "CodecState | PowerSGDState", hook: Callable | None = None, **kwargs: Any):
        if not isinstance(state, (CodecState, PowerSGDState)):
            raise GradzipError(f"DDPHookStrategy: state must be a gradzip.integrations.ddp.CodecState (gradzip.integrations.ddp.hook(...)) or "
                               f"PowerSGDState, got {type(state).__name__}")
        if "ddp_comm_hook" in kwargs or "ddp_comm_state" in kwargs:
            raise GradzipError("DDPHookStrategy: pass the hook state as its first argument (and hook=), "
                               "not ddp_comm_state / ddp_comm_hook")
        _check_options(type(self), kwargs)
        hook = hook or state.comm_hook
        super().__init__(ddp_comm_state=state, ddp_comm_hook=hook, **kwargs)
        self.hook_state = state

    def _register_ddp_hooks(self) -> None:
        """Lightning's registers only on CUDA devices; this on any."""
        if self.hook_state.keys_from is None:
            self.hook_state.bind(self.model)      # DDP(LightningModule): keys of the module
        self.model.register_comm_hook(self.hook_state, self._ddp_comm_hook)

    def _rank_state(self) -> dict:
        return {"hook": self.hook_state.state_dict()}

    def _load_rank_state(self, state: dict) -> None:
        self.hook_state.load_state_dict(state["hook"])


class GradzipStrategy(_PerRank, DDPStrategy):
    """For a gradzip optimizer (``configure_optimizers`` returns e.g.
    ``gradzip.optim.EFSGD(self.parameters(), lr=0.1, compressor="topk:ratio=0.01")``):
    ``Trainer(strategy=GradzipStrategy(), devices=N)``. No DDP wrapper; rank 0's parameters
    and buffers are broadcast when training starts; ``accumulate_grad_batches`` runs the
    accumulating backward passes inside the optimizers' ``accumulate()``; checkpoints hold
    every rank's optimizer state (and module weights where replicas differ), each rank
    restoring its own. Evaluate with :func:`gradzip.evaluation_model` (the workers' average
    for local SGD / CSER, the global model for CD-SGD). ``kwargs``: ``DDPStrategy``'s
    (those about the DDP wrapper have no effect; an unknown one is refused)."""

    def __init__(self, **kwargs: Any):
        _check_options(type(self), kwargs)
        super().__init__(**kwargs)

    def configure_ddp(self) -> None:
        """No DDP wrapper: the optimizer communicates. The replicas start from rank 0's,
        except on a resume whose replicas differ: each rank's own, loaded again after."""
        broadcast_parameters(self.model)
        module = (getattr(self, "_pending_state", None) or {}).get("module")
        if module is not None:
            self.lightning_module.load_state_dict(module)

    def _register_ddp_hooks(self) -> None:
        pass

    def _gradzip_optimizers(self) -> list[DistributedOptimizer]:
        out = []
        for opt in self.optimizers:
            opt = opt._optimizer if isinstance(opt, LightningOptimizer) else opt
            if isinstance(opt, DistributedOptimizer):
                out.append(opt)
        return out

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        self._check_optimizers()

    def _check_optimizers(self) -> None:
        """Refuse an optimizer that is not a gradzip method: without DDP nothing would
        synchronise its parameters."""
        plain = [type(o).__name__ for o in self.optimizers
                 if not isinstance(o._optimizer if isinstance(o, LightningOptimizer) else o, DistributedOptimizer)]
        if plain:
            raise GradzipError(f"GradzipStrategy: configure_optimizers returned {', '.join(plain)}, not a gradzip "
                               "optimizer: nothing would synchronise the workers. Return a gradzip.optim method, "
                               "or use DDPHookStrategy (DDP with a gradzip hook) for a torch optimizer")

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's accumulation: the backward passes before the last one of a step."""
        with contextlib.ExitStack() as stack:
            for opt in self._gradzip_optimizers():
                stack.enter_context(opt.accumulate())
            yield

    def _rank_state(self) -> dict:
        opts = self._gradzip_optimizers()
        state: dict[str, Any] = {"optimizers": [o.state_dict() for o in opts]}
        if any(o.replicas_differ for o in opts):
            state["module"] = {k: v.detach().clone() for k, v in self.lightning_module.state_dict().items()}
        return state

    def _load_rank_state(self, state: dict) -> None:
        self._pending_state = state          # the module's now; the optimizers' once they exist

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        module = (getattr(self, "_pending_state", None) or {}).get("module")
        if module is not None:               # this rank's replica, not rank 0's
            self.lightning_module.load_state_dict(module, strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        mine = getattr(self, "_pending_state", None)
        if mine is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        opts = self._gradzip_optimizers()
        if len(opts) != len(mine["optimizers"]):
            raise GradzipError(f"GradzipStrategy: the checkpoint holds {len(mine['optimizers'])} gradzip optimizer "
                               f"states and configure_optimizers returned {len(opts)}; return the same optimizers")
        for opt, state in zip(opts, mine["optimizers"]):
            opt.load_state_dict(state)
        self._pending_state = None          # applied (configure_ddp ran before: setup, then restore)
