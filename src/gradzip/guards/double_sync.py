"""A gradzip optimizer over parameters that DDP also synchronises: refused at the first step;
one whose DDP communicates nothing (no-op hook) takes DDP's ``no_sync()`` as accumulation.

``DistributedDataParallel`` allreduces the gradients in backward; a gradzip method would
then compress the already averaged gradient and send it again, and ``bytes_sent`` would
count only the second exchange (docs/ddp.md). :func:`refuse_ddp_double_sync` finds the
live DDP modules (a garbage-collector scan, only when a process group exists) and raises
:class:`DoubleCommunication` with the fix; it returns the wrappers it accepts (DDP's no-op
hook), whose ``no_sync()`` marks backward passes that only accumulate
(:func:`accumulating`: Accelerate's ``accumulate()`` enters it on all but the last
micro-batch). It sits below :mod:`gradzip.optim`, which calls it, and apart from
:mod:`gradzip.integrations.ddp`, which sits above.
"""
from __future__ import annotations

import gc
import weakref
from typing import Iterable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..errors import GradzipError


class DoubleCommunication(GradzipError):
    """A gradzip optimizer's parameters are also synchronised by DDP."""


def refuse_ddp_double_sync(params: Iterable[torch.Tensor], method: str) -> list[weakref.ref]:
    """Raise :class:`DoubleCommunication` if a live ``DistributedDataParallel`` module owns
    one of ``params`` and has no no-op communication hook: DDP would allreduce the
    gradients in backward, and the method would compress the already averaged gradient and
    send it again (``bytes_sent`` counting only the second exchange).

    Detection (once, at the first step): DDP leaves no mark on a parameter that Python can
    see (its reducer hooks the C++ gradient accumulators), so the live DDP instances are
    found by one pass over the garbage collector's objects (about 0.1 s for 170,000
    objects), only when a process group is initialised (DDP cannot exist without one), and
    their ``_module_parameters`` (what the reducer synchronises) are compared by identity; a
    module whose registered hooks (``_comm_hooks``) are all torch's ``noop_hook``
    communicates nothing and is accepted. A torch without these attributes (older than
    2.1) cannot be checked: nothing is refused there.

    Returns weak references to the DDP modules over ``params`` that communicate nothing (no-op
    hook): for :func:`accumulating`."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    # lazy: torch.distributed.algorithms is only needed once a process group exists
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

    ours = {id(p) for p in params}
    accepted = []
    for module in gc.get_objects():
        # type(), not isinstance(): DDP is an ABC, whose isinstance reads every object's
        # __class__, and some module proxies warn when touched (torch.distributed.reduce_op)
        if not issubclass(type(module), DistributedDataParallel):
            continue
        registered = getattr(module, "_comm_hooks", None)
        if registered is None:
            continue
        hooks = [h for h, _ in registered]
        shared = [i for i, p in enumerate(getattr(module, "_module_parameters", [])) if id(p) in ours]
        if shared and hooks and all(h is noop_hook for h in hooks):
            accepted.append(weakref.ref(module))
        elif shared:
            how = f"with the hook {hooks[-1].__qualname__}" if hooks else "with its default allreduce"
            raise DoubleCommunication(
                f"{method}: {len(shared)} of its parameters belong to a DistributedDataParallel module "
                f"that synchronises them {how}: every gradient would be sent twice and compressed after "
                f"DDP averaged it. {_fix(module)}")
    return accepted


def accumulating(wrappers: list[weakref.ref]) -> bool:
    """Whether one of ``wrappers`` (:func:`refuse_ddp_double_sync`'s) is inside ``no_sync()``
    now (its ``require_backward_grad_sync`` off): a backward pass there only accumulates."""
    return any(m is not None and not m.require_backward_grad_sync for m in (w() for w in wrappers))


def _fix(ddp: DistributedDataParallel) -> str:
    """The way out for ``ddp``: under PyTorch Lightning (DDP around a ``LightningModule``; found
    by class name, nothing here imports Lightning), the strategy for gradzip optimizers;
    elsewhere DDP's no-op hook or no DDP."""
    if any(c.__name__ == "LightningModule" for c in type(getattr(ddp, "module", None)).__mro__):
        return ("Under PyTorch Lightning, train a gradzip optimizer with strategy=gradzip.integrations.lightning.GradzipStrategy() "
                "(no DDP wrapper: the optimizer communicates); DDPHookStrategy and DDPStrategy are for torch "
                "optimizers.")
    return ("Register DDP's no-op hook, ddp.register_comm_hook(None, torch.distributed.algorithms.ddp_comm_hooks."
            "debugging_hooks.noop_hook), or pass the unwrapped module's parameters without DDP.")
