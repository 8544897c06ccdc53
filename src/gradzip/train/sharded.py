"""FSDP2 and HSDP runs of the harness (``gradzip train --fsdp [--hsdp R]``, ``compare``'s
``fsdp@CODEC`` / ``hsdp@CODEC``): the model sharded with ``fully_shard``, gradzip installed
with :func:`gradzip.integrations.fsdp.compress` (docs/algorithms.md §Sharded exchange), and momentum SGD
on the sharded parameters, behind the optimizer interface the training loop reads
(:class:`ShardedOptimizer`).

``fsdp`` shards over every worker; ``hsdp`` over nodes of n/R workers (``replicas`` R, ranks
node-major), replicated across them. Without a codec (``fsdp``, ``hsdp``) the run is plain
FSDP2 / HSDP through FSDP2's own collectives (counted); ``fsdp@none`` is gradzip's exchange
with the identity codec. Options (``cfg.options``): :data:`OPTIONS` (``error_memory``
"shard" turns ``error_feedback`` into the shard-sized kind). Settings that need a gradzip method are refused in
:func:`check` (checkpoints: save a sharded model with DCP in a script; ``--amp``: use
FSDP2's ``MixedPrecisionPolicy``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ..guards import consistency
from ..comm import Group, TorchGroup
from ..errors import GradzipError
from ..exchange import Timings
from ..integrations.fsdp import FSDPCompression, compress
from ..validation import is_int
from .evaluation import evaluation_sums

#: The harness's names of the sharded runs (``--algos`` entries beside the methods).
SHARDED = ("fsdp", "hsdp")
#: The options a sharded run takes (``cfg.options``): the method flags ``--compressor`` and
#: ``--error-feedback`` (true / false), and ``--weights``, ``--error-memory``, ``--hsdp``.
METHOD_FLAGS = ("compressor", "error_feedback")
OPTIONS = METHOD_FLAGS + ("weights", "error_memory", "replicas")
#: The learning rate when none is given (momentum SGD, as the SGD methods').
DEFAULT_LR = 0.1


def is_sharded(algo: str) -> bool:
    return algo in SHARDED


def check(cfg, workers: int | None = None, backend: str = "gloo") -> None:
    """Refuse what a sharded run cannot do, in one line each (before any worker starts)."""
    name = cfg.algo
    unknown = sorted(set(cfg.options) - set(OPTIONS))
    if unknown:
        raise GradzipError(f"{name} takes no option {', '.join(unknown)}; its options: {', '.join(OPTIONS)}")
    error_feedback(cfg.options)
    replicas = cfg.options.get("replicas")
    if name == "hsdp" and (not is_int(replicas) or replicas < 1):
        raise GradzipError(f"hsdp needs the number of replicas: --hsdp R (an integer >= 1), got {replicas!r}")
    if name == "fsdp" and replicas is not None:
        raise GradzipError("fsdp shards over every worker; for replicas across nodes use --hsdp R")
    if workers is not None and replicas is not None and workers % replicas:
        raise GradzipError(f"--hsdp {replicas} does not divide the {workers} workers into nodes; give R dividing "
                           "--workers")
    refused = {"checkpoint_dir": "--checkpoint-dir (save a sharded model with torch.distributed.checkpoint and the "
                                 "gradzip.integrations.fsdp handle in a script)",
               "workers_per_node": "--workers-per-node (use --hsdp R)",
               "sam_rho": "--sam-rho", "sharpness_rho": "--sharpness-rho",
               "amp": "--amp (FSDP2 takes a MixedPrecisionPolicy)"}
    for field, flag in refused.items():
        if getattr(cfg, field) not in (None, 0, 0.0, "none"):
            raise GradzipError(f"{name} runs take no {flag}")
    if cfg.nonfinite == "skip":
        raise GradzipError(f"{name} runs cannot skip a non-finite step on every worker (FSDP2 applies what it "
                           "reduced); use --nonfinite raise or off")
    if name == "fsdp" and (cfg.transport != "auto" or cfg.round_bytes is not None or cfg.link is not None
                           or cfg.recalibrate_every is not None):
        raise GradzipError("--transport, --round-bytes, --link and --recalibrate-every apply to hsdp's exchange "
                           "across nodes; fsdp's reduce-scatter is one all-to-all")
    if backend == "threads":
        raise GradzipError(f"{name} runs FSDP2, which needs torch.distributed processes: use --backend gloo")


def error_feedback(options: dict[str, Any]):
    """``compress``'s ``error_feedback`` from the flags: ``--error-feedback`` (None: the codec's
    default) and ``--error-memory shard``."""
    value = options.get("error_feedback")
    if options.get("error_memory") != "shard":
        return value
    if value is False:
        raise GradzipError("--error-memory shard is the memory of error feedback: drop --error-feedback false")
    return "shard"


class ShardedOptimizer:
    """Momentum SGD on FSDP2's sharded parameters, with what the training loop reads of a
    gradzip method: ``steps``, ``timings``, ``bytes_sent``, ``compression_ratio``,
    ``metrics()``, ``describe()``, ``verify_consistent()`` (the replicas are identical:
    ``replicas_differ`` False)."""

    replicas_differ = False
    overlaps_exchange = False

    def __init__(self, model: torch.nn.Module, handle: FSDPCompression, comm: Group, cfg):
        self.model, self.handle, self.comm, self.name = model, handle, comm, cfg.algo
        self.inner = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                                     weight_decay=cfg.weight_decay)
        self.steps = 0
        self.skipped_steps = 0
        self.tracer = None
        self._evaluation_bytes, self._evaluation_timings = 0, Timings()

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def lr_groups(self) -> list[dict]:
        """As :meth:`gradzip.optim.DistributedOptimizer.lr_groups`: the SGD's groups."""
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        loss = self.inner.step(closure)
        self.steps += 1
        return loss

    @property
    def timings(self) -> Timings:
        return _difference(self.handle.timings, self._evaluation_timings)

    @property
    def bytes_sent(self) -> int:
        return self.handle.bytes_sent - self._evaluation_bytes

    @property
    def compression_ratio(self) -> float:
        return self.handle.compression_ratio

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """(accuracy, mean cross-entropy) on the whole test set: every worker runs the same
        forward passes (each gathers parameters: collective); rank 0's numbers (BatchNorm
        statistics are each worker's own) sent to every worker. What the gathers send and
        wait is not training's: left out of ``bytes_sent`` and ``timings``."""
        bytes_before, before = self.handle.bytes_sent, self.handle.timings
        correct, loss = evaluation_sums(self.model, x, y)
        total = torch.tensor([float(correct), loss], dtype=torch.float64)
        self.comm.broadcast(total, src=0)
        self._evaluation_bytes += self.handle.bytes_sent - bytes_before
        self._evaluation_timings = _difference(self.handle.timings, before) + self._evaluation_timings
        return total[0].item() / y.numel(), total[1].item() / y.numel()

    def metrics(self) -> dict[str, Any]:
        return {"error_memory_bytes": self.handle.error_memory_bytes}

    def evaluation_parameters(self):
        return None

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, **self.handle.settings()}

    def verify_consistent(self) -> None:
        consistency.verify(self.comm, self.describe(), what=f"{self.name} settings")


def prepare(cfg, model: torch.nn.Module, comm: Group, device: torch.device) -> tuple[torch.nn.Module, ShardedOptimizer]:
    """Shard ``model`` (every submodule that owns parameters, then the whole), install gradzip
    and build the optimizer. Collective. ``comm`` must be the default process group's."""
    from torch.distributed.device_mesh import init_device_mesh   # FSDP2 costs seconds to import
    from torch.distributed.fsdp import fully_shard

    check(cfg, comm.world_size)
    if not isinstance(comm, TorchGroup) or not dist.is_initialized():
        raise GradzipError(f"{cfg.algo} runs FSDP2, which needs torch.distributed processes: use --backend gloo")
    n = comm.world_size
    replicas = cfg.options.get("replicas")
    if replicas is None:
        mesh = shard_mesh = init_device_mesh(device.type, (n,))
    else:
        mesh = init_device_mesh(device.type, (replicas, n // replicas), mesh_dim_names=("replicate", "shard"))
        shard_mesh = mesh["shard"]
    owners = [m for m in model.modules() if m is not model and next(m.parameters(recurse=False), None) is not None]
    for module in reversed(owners):   # the deepest first
        fully_shard(module, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    handle = compress(model, compressor=cfg.options.get("compressor"), weights=cfg.options.get("weights"),
                      error_feedback=error_feedback(cfg.options), seed=cfg.seed,
                      **({} if replicas is None else {"replicas": mesh, "transport": cfg.transport,
                                                      "round_bytes": cfg.round_bytes, "link": cfg.link,
                                                      "recalibrate_every": cfg.recalibrate_every}))
    return model, ShardedOptimizer(model, handle, comm, cfg)


def _difference(a: Timings, b: Timings) -> Timings:
    return Timings(*(x - y for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b))))
