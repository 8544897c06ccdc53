"""The collectives of gradzip's sharded exchange, as FSDP2 calls them (docs/algorithms.md
§Sharded exchange; the public entry point is :func:`gradzip.integrations.fsdp.compress`).

FSDP2 takes a custom reduce-scatter and all-gather as objects with ``allocate(size, *,
dtype, device)`` and ``__call__`` (its ``ReduceScatter`` / ``AllGather`` interfaces, met here
by duck typing, so that importing gradzip does not import FSDP2), and a replica all-reduce
hook ``hook(reduce_output)`` that it calls right after a 1-D mesh's reduce-scatter. One
object per FSDP module (its :class:`ModuleState`), all sharing one :class:`Exchange`:

* :class:`CompressedReduceScatter`: the box's compressed reduce-scatter, two-phase's phase 1
  per parameter (FSDP's dim-0 chunks are its slices, each compressed in its own shape, as
  every gradzip exchange compresses layer-wise), with the error memory ``ê_i`` ("full": the
  residual; "shard": its top-k packet);
* :class:`ExactReduceScatter` / :class:`ExactAllGather`: FSDP2's own collectives, called as
  FSDP2 calls them (same bits), their ring bytes counted;
* :class:`ReplicaExchange`: HSDP's replica all-reduce as a :class:`~gradzip.exchange.PSync`
  of the parameters' shards among the workers of equal local rank (any codec, transport,
  error feedback);
* :class:`CodecAllGather`: the parameters' all-gather as every worker's codec packet.

Every call runs to completion before it returns (FSDP2 passes ``async_op=False``; its
default streams on the CPU), so FSDP2's order of collectives is gradzip's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import seeds
from ..comm import TorchGroup
from ..compressors import Compressor, Packet
from ..compressors.sparsify import TopK
from ..errors import GradzipError
from ..exchange import PSync, Timings

__all__ = ["ModuleState", "Exchange", "CompressedReduceScatter", "ExactReduceScatter", "ExactAllGather",
           "CodecAllGather", "ReplicaExchange", "reduce_scale", "shard_error_codec", "pieces"]


@dataclass
class ModuleState:
    """One FSDP module's part of the exchange: its key g (position among the model's FSDP
    modules), its name, FSDP2's parameter group (its divide factor is read at every call),
    its parameters' keys (positions among every FSDP module's parameters) and the shape of
    each one's piece of a reduce-scatter row (FSDP's padded shard), t (reduce-scatters so far)
    and its error memory: a tensor ("full", HSDP's ``e``), the top-k packet of the residual
    ("shard"), or None."""

    key: int
    name: str
    param_group: Any
    param_keys: list[int]
    shapes: list[torch.Size]
    steps: int = 0
    error: torch.Tensor | Packet | None = None

    @property
    def row_numel(self) -> int:
        """Entries of one reduce-scatter row (D/s): every parameter's piece."""
        return sum(shape.numel() for shape in self.shapes)

    def check(self, numel: int, rows: int) -> None:
        """Refuse a reduce-scatter that is not ``rows`` rows of every parameter's piece: a
        parameter without a gradient in this step (FSDP2 then leaves it out)."""
        if numel != rows * self.row_numel:
            raise GradzipError(f"gradzip.integrations.fsdp: module {self.name!r} reduce-scattered {numel} gradient entries, not "
                               f"the {rows * self.row_numel} of all its parameters: a parameter had no gradient in "
                               "this step; call set_reduce_scatter_unused_params(True) on the module")


def pieces(row: torch.Tensor, shapes) -> list[torch.Tensor]:
    """The parameters' pieces of one flat reduce-scatter row, each viewed in its shape."""
    out, at = [], 0
    for shape in shapes:
        out.append(row[at:at + shape.numel()].view(shape))
        at += shape.numel()
    return out


def shard_error_codec(s: int) -> TopK:
    """``T`` of the box's "shard" error feedback for a shard group of ``s``: top-k with
    ``k = ⌈D/(2s)⌉``, a packet of at most a shard's float32 bytes plus 8."""
    return TopK(ratio=1 / (2 * s))


def reduce_scale(op, s: int, factor: float | None) -> float:
    """ω of the box: what FSDP2's reduce op makes of the mean over the ``s`` workers (``AVG``:
    1, ``SUM``: s, ``PREMUL_SUM`` by ``1/factor``: s/factor)."""
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.AVG:
        return 1.0
    if kind == dist.ReduceOp.SUM:
        return float(s)
    if kind == dist.ReduceOp.PREMUL_SUM and factor:
        return s / float(factor)
    raise GradzipError(f"gradzip.integrations.fsdp: FSDP2 asked for a reduce-scatter with op {kind}, which the sharded exchange "
                       "does not implement (mean, sum, or a sum divided by set_gradient_divide_factor)")


class Exchange:
    """What the collectives of one :func:`gradzip.integrations.fsdp.compress` share: the codecs, the error
    feedback mode, the seed, the :class:`~gradzip.comm.TorchGroup` of each process group FSDP2
    passes (bytes counted there), the bytes of FSDP2's own collectives (counted by the ring
    model, :attr:`exact_bytes`) and the seconds of codec work and of waiting."""

    def __init__(self, codec: Compressor | None, error_feedback: str, weights: Compressor | None, seed: int):
        self.codec, self.error_feedback, self.weights, self.seed = codec, error_feedback, weights, int(seed)
        self.timings = Timings()
        self.exact_bytes = 0
        self.dense_bytes = 0      # the gradients' reduce-scatter (HSDP: replica) inputs, uncompressed
        self.payload_bytes = 0    # what their packets carried (the exact collectives: the same)
        self.groups: dict[Any, TorchGroup] = {}
        self.psync: PSync | None = None       # HSDP's replica exchange (set by the handle)

    def group(self, pg) -> TorchGroup:
        comm = self.groups.get(pg)
        if comm is None:
            comm = self.groups[pg] = TorchGroup(pg)
        return comm

    @property
    def bytes_sent(self) -> int:
        cross = self.psync.comm.bytes_sent if self.psync is not None else 0
        return sum(g.bytes_sent for g in self.groups.values()) + cross + self.exact_bytes

    @property
    def compression_ratio(self) -> float:
        """R_C of the gradients' exchange (docs/algorithms.md §Bytes and R_C); inf before any."""
        return self.dense_bytes / self.payload_bytes if self.payload_bytes else float("inf")

    def count_payload(self, dense: torch.Tensor, payload_bytes: int) -> None:
        self.dense_bytes += dense.numel() * dense.element_size()
        self.payload_bytes += payload_bytes

    def all_timings(self) -> Timings:
        return self.timings + self.psync.timings if self.psync is not None else self.timings

    def waited(self, began: float, ended: float) -> None:
        self.timings.communicate_s += ended - began
        self.timings.wait_s += ended - began

    def coded(self, seconds: float) -> None:
        self.timings.compress_s += seconds
        self.timings.inline_compress_s += seconds

    def seed_of(self, codec: Compressor, step: int, key: int, rank: int) -> int:
        """σ of the box: PSync's seed of (step, key) (docs/algorithms.md §Randomness and seeds)."""
        return seeds.mix(self.seed, step, key) if codec.shared_randomness else seeds.mix(self.seed, step, key, rank + 1)


class _Collective:
    """One module's collective: its :class:`Exchange` and :class:`ModuleState`."""

    def __init__(self, exchange: Exchange, module: ModuleState):
        self.exchange, self.module = exchange, module

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CompressedReduceScatter(_Collective):
    """The box's compressed reduce-scatter (``replicas`` None): per owner j and parameter p,
    ``c_ijp = C(v[j, p])``, the piece in its shape; one all-to-all of every owner's pieces;
    the owner's aggregate per piece."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False) -> None:
        ex, m = self.exchange, self.module
        comm = ex.group(group)
        s, rank, codec = comm.world_size, comm.rank, ex.codec
        m.check(input_tensor.numel(), s)
        m.steps += 1
        began = time.perf_counter()
        v = input_tensor.reshape(s, -1).to(torch.float32, copy=True)
        error = self._error(s)
        if error is not None:
            v.view(-1).add_(error)
        r = torch.empty_like(v) if ex.error_feedback != "off" else None
        sent = []   # sent[j][p]: the packet of parameter p for owner j
        for j in range(s):
            residuals = pieces(r[j], m.shapes) if r is not None else [None] * len(m.shapes)
            sent.append([self._compress(x, ex.seed_of(codec, m.steps, key, rank), j, out)
                         for x, key, out in zip(pieces(v[j], m.shapes), m.param_keys, residuals)])
        wires = [torch.cat([w for packet in row for w in packet.raw()]) for row in sent]
        work = comm.all_to_all(wires, [wires[rank].numel()] * s, async_op=True)
        waiting = time.perf_counter()
        ex.coded(waiting - began)
        ex.count_payload(input_tensor, sum(w.numel() for w in wires))
        received = work.wait()
        decoding = time.perf_counter()
        ex.waited(waiting, decoding)
        mine, at, shard = sent[rank], 0, []
        for template in mine:
            size = template.nbytes
            shard.append(codec.aggregate([template.from_raw(w[at:at + size]) for w in received]).reshape(-1))
            at += size
        shard = torch.cat(shard)
        omega = reduce_scale(op, s, m.param_group.gradient_divide_factor)
        output_tensor.view(-1).copy_(shard if omega == 1 else shard.mul_(omega))
        if r is not None:
            m.error = r.view(-1) if ex.error_feedback == "full" else shard_error_codec(s).compress(r.view(-1))
        ex.coded(time.perf_counter() - decoding)
        return None

    def _compress(self, x: torch.Tensor, sigma: int, j: int, residual: torch.Tensor | None) -> Packet:
        """``c_ij`` of one piece (seed ``mix(σ, j)``, two-phase's phase-1 seed); its residual
        into ``residual`` when given."""
        codec, seed = self.exchange.codec, seeds.mix(sigma, j)
        return codec.compress(x, seed) if residual is None else codec.compress_residual(x, seed, residual)

    def _error(self, s: int) -> torch.Tensor | None:
        """``ê_i`` as a dense float32 tensor (None: none yet, or off)."""
        error = self.module.error
        if error is None or self.exchange.error_feedback == "off":
            return None
        return shard_error_codec(s).decompress(error) if isinstance(error, Packet) else error


class ExactReduceScatter(_Collective):
    """FSDP2's reduce-scatter as its default issues it (the same bits), its ring bytes
    ``⌊(s−1)·B/s⌋`` counted. ``counts_steps``: it counts the module's t (False under HSDP,
    where it is the exact reduce-scatter inside the node and the replica hook counts)."""

    def __init__(self, exchange: Exchange, module: ModuleState, counts_steps: bool = True):
        super().__init__(exchange, module)
        self.counts_steps = counts_steps

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        ex = self.exchange
        s = dist.get_world_size(group)
        if self.counts_steps:
            self.module.steps += 1
        ex.exact_bytes += (s - 1) * input_tensor.numel() * input_tensor.element_size() // s
        if self.counts_steps:   # the gradients' exchange (under HSDP the replica hook's)
            ex.count_payload(input_tensor, input_tensor.numel() * input_tensor.element_size())
        began = time.perf_counter()
        work = dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op,
                                          async_op=async_op)
        ex.waited(began, time.perf_counter())
        return work


class ExactAllGather(_Collective):
    """FSDP2's all-gather as its default issues it, its ring bytes ``(s−1)·B`` counted."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        ex = self.exchange
        ex.exact_bytes += (dist.get_world_size(group) - 1) * input_tensor.numel() * input_tensor.element_size()
        began = time.perf_counter()
        work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        ex.waited(began, time.perf_counter())
        return work


class CodecAllGather(_Collective):
    """The box's weight all-gather: every worker's packet of its shard, each decoded into its
    row of the unsharded parameters (this worker's too, from the same bytes)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 async_op: bool = False) -> None:
        ex, m = self.exchange, self.module
        if not input_tensor.is_floating_point():
            raise GradzipError(f"gradzip.integrations.fsdp: module {m.name!r} gathers parameters of several dtypes in one buffer "
                               f"({input_tensor.dtype}); weights={ex.weights.spec!r} quantizes floating-point "
                               "parameters: give the module's parameters one dtype, or leave weights=None")
        comm = ex.group(group)
        began = time.perf_counter()
        packet = ex.weights.compress(input_tensor.reshape(-1).to(torch.float32),
                                     seeds.mix(ex.seed, m.steps, m.key, comm.rank + 1))
        raw = packet.raw()
        flat = torch.cat(raw) if len(raw) > 1 else raw[0]
        gathering = time.perf_counter()
        ex.coded(gathering - began)
        gathered = comm.allgather(flat)
        decoding = time.perf_counter()
        ex.waited(gathering, decoding)
        rows = output_tensor.view(comm.world_size, -1)
        for j in range(comm.world_size):
            rows[j].copy_(ex.weights.decompress(packet.from_raw(gathered[j])).view(-1))
        ex.coded(time.perf_counter() - decoding)
        return None


class ReplicaExchange(_Collective):
    """HSDP's replica all-reduce of one module's shard (FSDP2's all-reduce hook): PSync of its
    parameters' pieces, each in its shape, among the ``replicas`` workers of equal local rank,
    the residual kept as ``e``."""

    def __init__(self, exchange: Exchange, module: ModuleState, replicas: int):
        super().__init__(exchange, module)
        self.replicas = replicas

    def __call__(self, reduce_output: torch.Tensor) -> None:
        ex, m = self.exchange, self.module
        m.check(reduce_output.numel(), 1)
        m.steps += 1
        x = reduce_output.reshape(-1).to(torch.float32, copy=True)
        feedback = ex.error_feedback != "off"
        if feedback and m.error is not None:
            x.add_(m.error)
        result = ex.psync(pieces(x, m.shapes), m.steps, keys=m.param_keys, residual=feedback)
        ex.count_payload(reduce_output, result.packet_bytes)
        a = torch.cat([t.reshape(-1) for t in result.aggregate])
        if m.param_group.gradient_divide_factor is not None:   # FSDP2 divides by its factor alone: the sum
            a = a.mul_(self.replicas)
        reduce_output.view(-1).copy_(a)
        if feedback:
            m.error = torch.cat([t.reshape(-1) for t in result.residual])
