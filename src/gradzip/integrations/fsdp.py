"""gradzip inside PyTorch's FSDP2 and HSDP: :func:`compress` (public as ``gradzip.integrations.fsdp.compress``;
docs/algorithms.md §Sharded exchange is the spec, docs/integrations.md the guide).

``handle = gradzip.integrations.fsdp.compress(model, compressor="1bit")`` after ``fully_shard`` installs,
through FSDP2's own hooks, on every FSDP module of ``model``:

* the gradient reduce-scatter as the first half of gradzip's two-phase exchange (every
  worker compresses, per parameter, the chunk of each shard owner in its shape, one
  all-to-all, the owner sums in float32), with error feedback ("full": the residual, the
  unsharded gradient's size; "shard": its top-k, a shard's size);
* with ``replicas`` (HSDP: FSDP sharding on each node's workers), FSDP's exact reduce-scatter
  inside the node and the replica all-reduce across nodes as a PSync (any codec, transport,
  error feedback, shard-sized residuals);
* with ``weights`` (``"int8"`` or another dense codec), the parameters' all-gather as codes
  and scales (ZeRO++'s qwZ); the optimizer's sharded float32 parameters stay exact.

Every collective gradzip installs counts its bytes (``handle.bytes_sent``). The handle is a
DCP ``Stateful``: ``dcp.save({"model": ..., "optim": ..., "gradzip": handle}, ...)`` and
``dcp.load`` resume its error memory, server errors and counters bit for bit.

FSDP2 itself is imported only when a model is compressed (``import gradzip`` stays light).
Relies on FSDP2 as of torch 2.13: ``set_custom_reduce_scatter``, ``set_custom_all_gather``,
``set_all_reduce_hook``, and a module's parameter group (``_get_fsdp_state()``) for its count
and its ``gradient_divide_factor``.
"""
from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist

from ..comm import TorchGroup
from ..compressors import Auto, Compressor, Packet, PerTensor, build
from ..errors import GradzipError
from ..exchange import PSync, Timings
from ..exchange.planner import check_transport
from ..validation import is_int
from .fsdp_collectives import CodecAllGather, CompressedReduceScatter, ExactAllGather, ExactReduceScatter, Exchange, ModuleState, ReplicaExchange

__all__ = ["compress", "FSDPCompression", "ERROR_FEEDBACK", "DROPPING_CODECS"]

#: ``error_feedback``'s modes (True is "full", False "off", None: "full" for biased codecs).
ERROR_FEEDBACK = ("full", "shard", "off")
#: Codecs that drop entries (sparse, low-rank): refused for ``weights`` (they drop parameters).
DROPPING_CODECS = ("topk", "randomk", "randblock", "dgc", "powersgd")


def compress(model: torch.nn.Module, *, compressor: "str | Compressor | None" = "none", error_feedback=None,
             weights: "str | Compressor | None" = None, replicas=None, seed: int = 0, transport: str = "auto",
             link=None, round_bytes: int | None = None, recalibrate_every: int | None = None) -> "FSDPCompression":
    """Install gradzip on every FSDP2 module of ``model`` (module docstring); returns the
    :class:`FSDPCompression` handle. Collective: every worker calls it, after ``fully_shard``
    and before the first forward.

    ``compressor``: the gradients' codec (a spec or codec); None leaves FSDP2's exact
    reduce-scatter (counted). ``error_feedback``: None (on for biased codecs but ``none``), True / "full",
    "shard" (a shard's memory; not with ``replicas``), False / "off". ``weights``: the
    parameters' all-gather codec, None for FSDP2's own. ``replicas``: None (plain FSDP2),
    R (the FSDP modules shard over nodes of n/R workers, ranks node-major), or the 2-D
    ``DeviceMesh`` (replicate, shard) whose shard dimension the modules use, or its 1-D
    replicate dimension. ``seed``, and for the replica PSync ``transport``, ``link``,
    ``round_bytes`` and ``recalibrate_every`` (as every method's). ``compressor="auto:<codec>"``
    (docs/algorithms.md §Auto codec choice) applies to HSDP's exchange across nodes only."""
    return FSDPCompression(model, compressor=compressor, error_feedback=error_feedback, weights=weights,
                           replicas=replicas, seed=seed, transport=transport, link=link, round_bytes=round_bytes,
                           recalibrate_every=recalibrate_every)


class FSDPCompression:
    """The handle of one :func:`compress`: ``bytes_sent`` (this worker's, every installed
    collective), ``timings`` (codec and waiting seconds, as a PSync's), ``compression_ratio``
    (the gradients'), ``steps`` (gradient reduce-scatters of the busiest module),
    ``error_memory_bytes``, ``state_dict()`` / ``load_state_dict()`` (also through DCP),
    ``describe()``."""

    def __init__(self, model, *, compressor, error_feedback, weights, replicas, seed, transport, link, round_bytes,
                 recalibrate_every=None):
        if not dist.is_available() or not dist.is_initialized():
            raise GradzipError("gradzip.integrations.fsdp.compress: torch.distributed is not initialised; FSDP2 runs in a process "
                               "group (torchrun, or gradzip train --fsdp)")
        if not is_int(seed):
            raise GradzipError(f"gradzip.integrations.fsdp.compress: seed must be an integer, got {seed!r}")
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        modules = _fsdp_modules(model)
        self.codec = _codec(compressor, "compressor")
        self.weights = _codec(weights, "weights")
        if self.weights is not None and self.weights.name in DROPPING_CODECS:
            raise GradzipError(f"gradzip.integrations.fsdp.compress: weights={self.weights.spec!r} drops entries, i.e. parameters, "
                               "from what forward computes with; use a dense codec such as 'int8', 'fp16' or 'bf16'")
        shard_ranks = _shard_ranks(modules)
        self.replicas, cross = _replica_group(replicas, self.world_size, shard_ranks)
        if isinstance(self.weights, Auto) or (isinstance(self.codec, Auto) and cross is None):
            raise GradzipError("gradzip.integrations.fsdp.compress: auto:<codec> chooses per bucket of a PSync exchange, which "
                               "here is HSDP's exchange across nodes: give replicas= for compressor='auto:...', and a "
                               "codec for FSDP's reduce-scatter and for weights")
        self.error_feedback = _error_feedback(error_feedback, self.codec, cross is not None)
        self.seed, self.transport = int(seed), check_transport(transport, "gradzip.integrations.fsdp.compress")
        if cross is None and (transport != "auto" or link is not None or round_bytes is not None
                              or recalibrate_every is not None):
            raise GradzipError("gradzip.integrations.fsdp.compress: transport, link, round_bytes and recalibrate_every set the "
                               "exchange across nodes; give replicas= (HSDP), or leave them out")
        self._exchange = Exchange(self.codec, self.error_feedback, self.weights, self.seed)
        if cross is not None:
            self._exchange.psync = PSync(cross, self.codec or "none", seed=self.seed, transport=transport, link=link,
                                         round_bytes=round_bytes, recalibrate_every=recalibrate_every)
        self.modules, first = [], 0
        for key, (name, _, group) in enumerate(modules):
            shapes = [fp.padded_sharded_param_size for fp in group.fsdp_params]
            self.modules.append(ModuleState(key, name, group, list(range(first, first + len(shapes))), shapes))
            first += len(shapes)
        self._bytes_offset = 0
        for (name, module, _), state in zip(modules, self.modules):
            self._install(module, state, cross is not None)
            module._gradzip_fsdp = self

    def _install(self, module, state: ModuleState, hsdp: bool) -> None:
        ex = self._exchange
        if hsdp:
            module.set_custom_reduce_scatter(ExactReduceScatter(ex, state, counts_steps=False))
            module.set_all_reduce_hook(ReplicaExchange(ex, state, self.replicas))
        elif self.codec is None:
            module.set_custom_reduce_scatter(ExactReduceScatter(ex, state))
        else:
            module.set_custom_reduce_scatter(CompressedReduceScatter(ex, state))
        module.set_custom_all_gather(CodecAllGather(ex, state) if self.weights is not None else ExactAllGather(ex, state))

    # -- what a run reports ----------------------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        return self._exchange.bytes_sent + self._bytes_offset

    @property
    def timings(self) -> Timings:
        return self._exchange.all_timings()

    @property
    def compression_ratio(self) -> float:
        """R_C of the gradients' exchange: their dense bytes over the packets' bytes."""
        return self._exchange.compression_ratio

    @property
    def steps(self) -> int:
        return max((m.steps for m in self.modules), default=0)

    @property
    def error_memory_bytes(self) -> int:
        """Bytes this worker keeps as error memory across steps (the box's ``ê_i`` / ``e``)."""
        total = 0
        for m in self.modules:
            tensors = m.error.wire.values() if isinstance(m.error, Packet) else [m.error] if m.error is not None else []
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total

    def settings(self) -> dict[str, Any]:
        """What the numbers depend on (saved with the state, compared when it is loaded)."""
        return {"world_size": self.world_size, "codec": _spec(self.codec), "error_feedback": self.error_feedback,
                "weights": _spec(self.weights), "replicas": self.replicas, "seed": self.seed,
                "transport": self.transport, "modules": ",".join(m.name or "<root>" for m in self.modules)}

    def describe(self) -> dict[str, Any]:
        return {**self.settings(), "error_memory_bytes": self.error_memory_bytes}

    # -- state (DCP Stateful) ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"settings": ..., "rank<r>": bytes}``: this worker's error memory, server errors,
        step counters and bytes, serialised under its own key (DCP writes every worker's;
        a tensor under one key would be kept from one worker only)."""
        payload = {"steps": {m.name: m.steps for m in self.modules},
                   "errors": {m.name: _error_state(m.error) for m in self.modules},
                   "server_errors": self._exchange.psync.state_dict() if self._exchange.psync is not None else {},
                   "bytes_sent": self.bytes_sent}
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        return {"settings": self.settings(), f"rank{self.rank}": buffer.getvalue()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; refuses one saved with other settings, naming the first."""
        saved, now = state.get("settings", {}), self.settings()
        for name, value in now.items():
            if saved.get(name) != value:
                raise GradzipError(f"gradzip.integrations.fsdp: this state was saved with {name}={saved.get(name)!r}, this handle "
                                   f"has {name}={value!r}; load it into gradzip.integrations.fsdp.compress(...) with the same "
                                   "settings on as many workers, or start without it")
        mine = state.get(f"rank{self.rank}")
        if not isinstance(mine, (bytes, bytearray)):
            raise GradzipError(f"gradzip.integrations.fsdp: the state holds no entry rank{self.rank} for this worker; load the "
                               "state every worker saved, on as many workers")
        payload = torch.load(io.BytesIO(mine), weights_only=True)
        for m in self.modules:
            m.steps = int(payload["steps"][m.name])
            m.error = _error_from(payload["errors"][m.name])
        if self._exchange.psync is not None:
            self._exchange.psync.load_state_dict(payload["server_errors"])
        self._bytes_offset = int(payload["bytes_sent"]) - self._exchange.bytes_sent


# ----------------------------------------------------------------------------- checks
def _fsdp_modules(model) -> list[tuple[str, Any, Any]]:
    """(name, FSDP module, its parameter group) of every FSDP2 module of ``model`` with
    parameters, in ``named_modules`` order; refusals name the module."""
    from torch.distributed.fsdp import FSDPModule   # here: FSDP2 costs seconds to import

    if not isinstance(model, torch.nn.Module):
        raise GradzipError(f"gradzip.integrations.fsdp.compress takes the model (a torch.nn.Module), got {type(model).__name__}")
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        if getattr(module, "_gradzip_fsdp", None) is not None:
            raise GradzipError(f"gradzip.integrations.fsdp.compress: module {name or '<root>'!r} already has gradzip installed; "
                               "compress a model once")
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise GradzipError(f"gradzip.integrations.fsdp.compress: module {name or '<root>'!r} holds {len(groups)} parameter "
                               "groups (per-parameter meshes of shard_placement_fn), for which FSDP2 takes no custom "
                               "collectives; shard it on one mesh, or leave gradzip off for it")
        if groups:
            out.append((name, module, groups[0]))
    if not out:
        raise GradzipError(f"gradzip.integrations.fsdp.compress: {type(model).__name__} holds no FSDP2 module with parameters; call "
                           "torch.distributed.fsdp.fully_shard on its layers and on the model first")
    return out


def _shard_ranks(modules) -> list[int]:
    """The global ranks of the one shard group every module uses (1-D meshes only)."""
    found = set()
    for name, _, group in modules:
        info = group.mesh_info
        if getattr(info, "replicate_process_group", None) is not None:
            raise GradzipError(f"gradzip.integrations.fsdp.compress: module {name or '<root>'!r} is sharded on a 2-D mesh, whose "
                               "replica all-reduce FSDP2 runs itself, uncompressed; for HSDP shard with "
                               "fully_shard(..., mesh=mesh['shard']) and pass replicas=mesh")
        found.add(tuple(dist.get_process_group_ranks(info.shard_process_group)))
    if len(found) > 1:
        raise GradzipError(f"gradzip.integrations.fsdp.compress: the FSDP modules shard over different groups {sorted(found)}; "
                           "shard every module on the same mesh")
    return list(found.pop())


def _replica_group(replicas, n: int, shard_ranks: list[int]) -> tuple[int, TorchGroup | None]:
    """(R, the group of this worker's replicas, or None without HSDP), checked against the
    shard group: R·s = n, the shard groups the nodes ``[m·s, (m+1)·s)``."""
    s = len(shard_ranks)
    if replicas is None:
        if s != n:
            raise GradzipError(f"gradzip.integrations.fsdp.compress: the FSDP modules shard over {s} of the {n} workers; pass "
                               f"replicas={n // s if n % s == 0 else 'R'} for HSDP (replicas across nodes), or shard "
                               "over every worker")
        return 1, None
    if is_int(replicas):
        if replicas < 1 or n % replicas or n // replicas != s:
            raise GradzipError(f"gradzip.integrations.fsdp.compress: replicas={replicas!r} does not divide the {n} workers into "
                               f"nodes of the {s} workers each FSDP module shards over; give R with R·{s} = {n}")
        node = dist.get_rank() // s
        if shard_ranks != list(range(node * s, (node + 1) * s)):
            raise GradzipError(f"gradzip.integrations.fsdp.compress: this worker's FSDP shard group is ranks {shard_ranks}, not its "
                               f"node's {node * s}..{(node + 1) * s - 1}; number ranks node-major (as torchrun) or pass "
                               "the DeviceMesh as replicas")
        cross = TorchGroup().split([[j + m * s for m in range(replicas)] for j in range(s)])
        return int(replicas), cross
    mesh = replicas
    if not hasattr(mesh, "get_group") or getattr(mesh, "ndim", 0) not in (1, 2):
        raise GradzipError(f"gradzip.integrations.fsdp.compress: replicas must be None, an integer R or a DeviceMesh (2-D "
                           f"(replicate, shard), or its replicate dimension), got {type(replicas).__name__}")
    if mesh.ndim == 2 and dist.get_process_group_ranks(mesh.get_group(1)) != shard_ranks:
        raise GradzipError(f"gradzip.integrations.fsdp.compress: the FSDP modules shard over ranks {shard_ranks}, not over the "
                           "mesh's second (shard) dimension; shard with fully_shard(..., mesh=mesh['shard'])")
    pg = mesh.get_group(0)
    if dist.get_world_size(pg) * s != n:
        raise GradzipError(f"gradzip.integrations.fsdp.compress: the replicate dimension has {dist.get_world_size(pg)} workers and "
                           f"the shard groups {s}, which does not make the {n} workers")
    return dist.get_world_size(pg), TorchGroup(pg)


def _codec(spec, what: str) -> Compressor | None:
    if spec is None:
        return None
    codec = build(spec)
    if isinstance(codec, PerTensor):
        raise GradzipError(f"gradzip.integrations.fsdp.compress: {what}={codec.spec!r} is a per-tensor policy; FSDP2 reduces and "
                           "gathers one flat buffer per module: give one codec")
    return codec


def _error_feedback(value, codec: Compressor | None, hsdp: bool) -> str:
    """The error feedback mode (:data:`ERROR_FEEDBACK`) of ``value`` for ``codec``."""
    if codec is None:
        if value not in (None, False, "off"):
            raise GradzipError("gradzip.integrations.fsdp.compress: error feedback needs a codec; give compressor=...")
        return "off"
    if value is None:
        mode = "full" if codec.error_feedback_by_default else "off"
    else:
        mode = "full" if value is True else "off" if value is False else value
    if mode not in ERROR_FEEDBACK:
        raise GradzipError(f"gradzip.integrations.fsdp.compress: error_feedback must be None, True, False or one of "
                           f"{', '.join(ERROR_FEEDBACK)}, got {value!r}")
    codec.refuse_error_feedback(mode != "off", "gradzip.integrations.fsdp.compress")
    if mode == "shard" and hsdp:
        raise GradzipError("gradzip.integrations.fsdp.compress: with replicas the residual is the shard's already; use "
                           "error_feedback=True (or None)")
    return mode


def _spec(codec: Compressor | None) -> str:
    return "exact" if codec is None else codec.spec


def _error_state(error):
    """A module's error memory as plain tensors (a packet: its wire and length)."""
    if isinstance(error, Packet):
        return {"wire": dict(error.wire), "numel": error.numel}
    return error


def _error_from(saved):
    if isinstance(saved, dict):
        return Packet(dict(saved["wire"]), torch.Size([int(saved["numel"])]), torch.float32)
    return saved
