"""The hierarchical exchange: PSync across nodes, uncompressed inside them (spec
"Transports of PSync", box "Hierarchical exchange").

Workers are grouped by node, ``k`` per node (``workers_per_node``; ``"auto"``: torchrun's
``LOCAL_WORLD_SIZE``), ranks node-major as torchrun numbers them: node ``m = rank // k``,
local rank ``ℓ = rank % k``. Shard ℓ of a tensor of ``d`` elements (flattened) is
``tensor_split(arange(d), k)[ℓ]``. One exchange of tensors ``v_i``, bucket by bucket of the
plan (:func:`gradzip.exchange.planner.plan` with ``hierarchy=k``)::

    inside node m:   u = reduce_scatter_mean over local ranks of v_i     # fp32 (or fp16); worker ℓ gets shard ℓ
    across nodes:    (a, ρ) = PSync(u; C) among the n/k workers with local rank ℓ
    inside node m:   aggregate = allgather over local ranks of a
    residual r_i:    k·ρ on worker i's shard, 0 elsewhere

With that residual a method's error rule is unchanged: the mean over a node's workers of
``e_i`` is the node's error (sharded over its workers). ``k = 1`` is PSync itself (same
seeds, same bits); with one node (``k = n``) nothing is compressed: the aggregate is the
exact mean and the residual 0. The tensors of a bucket travel in one reduce-scatter and one
allgather inside the node (row ℓ holds shard ℓ of every tensor, padded to the longest
row); the PSync across nodes follows the bucket's inner plan (its shards, any transport).

:class:`HierarchicalPSync` is a :class:`~gradzip.exchange.PSync` (the same ``start`` /
``wait`` / ``__call__``, counters, tracer), so a method takes it where it takes a PSync.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..comm import Group
from ..errors import GradzipError
from ..trace import forwarding_tracer
from .complexes import real_views, with_complex
from .psync import DEFAULT_BUCKET_BYTES, Pending, PSync, Result, Timings
from .planner import INTRA_DTYPES, Plan, plan, shard_bounds
from ..validation import is_int

__all__ = ["HierarchicalPSync", "INTRA_DTYPES", "check_workers_per_node", "shard_bounds"]


def check_workers_per_node(value, world_size: int) -> int:
    """``value`` (an int k, ``"auto"`` = ``LOCAL_WORLD_SIZE``, or None = 1) checked against
    ``world_size``: k >= 1 dividing it."""
    if value is None:
        return 1
    if value == "auto":
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None or not env.isdigit():
            raise GradzipError("hierarchy='auto' reads LOCAL_WORLD_SIZE (set by torchrun), which is not set; "
                               "give the workers per node as an integer")
        value = int(env)
    if not is_int(value) or value < 1 or world_size % value:
        raise GradzipError(f"workers per node must be an integer >= 1 dividing the {world_size} workers, "
                           f"got {value!r}; e.g. --workers-per-node 8 for 8 GPUs per node")
    return int(value)


@dataclass
class _HierBucket:
    """One hierarchical bucket in flight: its members, their node-mean shards ``u`` and the
    cross-node exchange (None with one node)."""

    members: list[int]
    shards: list[torch.Tensor]
    inner: Pending | None
    intra_bytes: int


@dataclass
class _HierPending:
    """A hierarchical exchange in flight."""

    psync: "HierarchicalPSync"
    tensors: list[torch.Tensor]           # this worker's inputs (shapes, dtypes)
    buckets: list[_HierBucket]
    residual: bool
    #: none: its copies into the node's reduce-scatter make no digests (``PSync.start(digest_inputs=)``)
    digests: tuple = ()

    @property
    def packets(self):
        """The cross-node packets of this worker's shards, by tensor position."""
        out = [None] * len(self.tensors)
        for b in self.buckets:
            for i, packet in zip(b.members, b.inner.packets if b.inner is not None else ()):
                out[i] = packet
        return out

    def wait(self) -> Result:
        return self.psync._finish_hier(self)


class HierarchicalPSync(PSync):
    """PSync with ``workers_per_node`` = k workers per node (module docstring). Creating it
    is collective on ``comm`` (it splits the group into nodes and into equal local ranks).
    ``link``: the node's uplink (the node's k cross-node exchanges share it)."""

    guards_inputs = False   # each shard's check runs on one worker only: the inputs are checked first

    def plan_guards_inputs(self, plan: Plan) -> bool:
        return False

    def __init__(self, comm: Group, compressor="none", *, workers_per_node, seed: int = 0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, check_finite: bool = False, intra: str = "fp32",
                 transport: str = "auto", allow_twophase: bool = True, round_bytes: int | None = None,
                 link=None, recalibrate_every: int | None = None):
        super().__init__(comm, compressor, seed=seed, bucket_bytes=bucket_bytes, check_finite=check_finite,
                         transport=transport, allow_twophase=allow_twophase, round_bytes=round_bytes, link=link,
                         recalibrate_every=recalibrate_every)
        n = comm.world_size
        k = check_workers_per_node(workers_per_node, n)
        if intra not in INTRA_DTYPES:
            raise GradzipError(f"intra={intra!r}: the exchange inside a node is fp32 or fp16")
        self.workers_per_node, self.intra = k, intra
        self.node, self.local_rank = divmod(comm.rank, k)
        nodes = n // k
        self.node_comm = comm.split([[m * k + j for j in range(k)] for m in range(nodes)])
        self.cross_comm = comm.split([[m * k + j for m in range(nodes)] for j in range(k)])
        # the exchange across nodes: any transport (its two-phase server errors are this one's state)
        self.inner = PSync(self.cross_comm, self.compressor, seed=seed, bucket_bytes=bucket_bytes,
                           check_finite=check_finite, transport=transport, allow_twophase=allow_twophase,
                           round_bytes=round_bytes, link=self.link.shared(k))
        self.server_errors = self.inner.server_errors

    def _plan(self, specs, codecs, link=None, costs=None, choices=None) -> Plan:
        return plan([s for s, _ in specs], codecs, self.comm.world_size, transport=self.transport,
                    bucket_bytes=self.bucket_bytes, hierarchy=self.workers_per_node, link=link or self.link,
                    dtypes=[d for _, d in specs], twophase=self.allow_twophase, intra=self.intra,
                    codec_costs=costs, choices=choices)

    def _probe(self):
        """auto decides per level: the units across nodes, on the uplink the node's k groups
        across nodes share (probed by all k at once)."""
        return self.cross_comm, self.workers_per_node

    def routes(self, tensors: Sequence, keys: Sequence[int] | None = None) -> list[str]:
        """The route of each tensor's exchange across nodes (its shard on this worker)."""
        order, p = self.exchange_plan(tensors, keys)
        out = [""] * len(order)
        for b in p.buckets:
            inner = b.inner[self.local_rank]
            for t, route in zip(b.tensors, inner.routes()):
                out[order[t]] = route
        return out

    tracer = forwarding_tracer(lambda self: [self.inner] if getattr(self, "inner", None) is not None else [])

    def _take_inner_timings(self) -> None:
        self.timings = self.timings + self.inner.timings
        self.inner.timings = Timings()

    def _intra_wait(self, work, began_kind: str):
        began = time.perf_counter()
        out = work.wait()
        self.count_wait_intra(began, time.perf_counter(), began_kind, work.nbytes)
        return out

    def count_wait_intra(self, began: float, ended: float, kind: str, nbytes: int = 0) -> None:
        self.timings.communicate_s += ended - began
        if self._owner == threading.get_ident():
            self.timings.wait_s += ended - began
        if self.tracer is not None:   # scope "node": bytes on the links inside the node (bench net splits them)
            self.tracer.add("communicate", began, ended, kind=kind, bytes=nbytes, scope="node")

    def start(self, tensors: Sequence[torch.Tensor], step: int, *, keys: Sequence[int] | None = None,
              residual: bool = True, plan: Plan | None = None, digest_inputs: bool = False) -> _HierPending:
        """Per bucket of the plan: reduce-scatter inside the node (waited for), then start the
        PSync across nodes. ``digest_inputs`` is accepted and makes none
        (:attr:`_HierPending.digests`)."""
        tensors, complex_at = real_views(tensors)
        keys = list(range(len(tensors)) if keys is None else keys)
        if plan is None:
            order, plan = self.exchange_plan(tensors, keys, step)
        else:
            order = list(range(len(tensors)))
        buckets = [self._start_bucket(b.inner[self.local_rank], [order[i] for i in b.tensors], tensors, keys,
                                      step, residual) for b in plan.buckets]
        return with_complex(_HierPending(self, list(tensors), buckets, residual), complex_at)

    def _start_bucket(self, inner_plan: Plan, members: list[int], tensors, keys, step: int,
                      residual: bool) -> _HierBucket:
        k, node = self.workers_per_node, self.node_comm
        dtype = INTRA_DTYPES[self.intra]
        flats = [tensors[i].detach().reshape(-1) for i in members]
        bounds = [shard_bounds(f.numel(), k) for f in flats]
        width = max((sum(b[j][1] - b[j][0] for b in bounds) for j in range(k)), default=0)
        stacked = torch.zeros(k, width, dtype=dtype)
        for j in range(k):
            at = 0
            for f, b in zip(flats, bounds):
                lo, hi = b[j]
                if k > 1 and dtype != f.dtype:   # divide in fp32 first: k terms of x/k cannot overflow
                    stacked[j, at:at + hi - lo] = (f[lo:hi].float() / k).to(dtype)
                else:
                    stacked[j, at:at + hi - lo] = f[lo:hi]
                at += hi - lo
        before = node.bytes_sent
        if k > 1 and dtype != torch.float32:
            mine = self._intra_wait(node.reduce_scatter(stacked, async_op=True), "reduce_scatter").float()
        else:
            mine = self._intra_wait(node.reduce_scatter(stacked, mean=True, async_op=True), "reduce_scatter")
        shards, at = [], 0
        for i, b in zip(members, bounds):
            lo, hi = b[self.local_rank]
            shards.append(mine[at:at + hi - lo].to(tensors[i].dtype))
            at += hi - lo
        inner = None
        if self.cross_comm.world_size > 1:
            inner = self.inner.start(shards, step, keys=[keys[i] for i in members], residual=residual,
                                     plan=inner_plan)
            self._take_inner_timings()
        return _HierBucket(members, shards, inner, node.bytes_sent - before)

    def _finish_hier(self, pending: _HierPending) -> Result:
        out = [None] * len(pending.tensors)
        residuals = [None] * len(pending.tensors) if pending.residual else None
        sent = payload = 0
        for bucket in pending.buckets:
            nbytes, packets = self._finish_bucket(bucket, pending.tensors, out, residuals)
            sent, payload = sent + nbytes, payload + packets
        self.bytes_sent += sent
        self.payload_bytes += payload
        return Result(out, residuals, sent, payload)

    def _finish_bucket(self, bucket: _HierBucket, tensors, out: list, residuals: list | None) -> tuple[int, int]:
        k, node = self.workers_per_node, self.node_comm
        if bucket.inner is not None:
            result = bucket.inner.wait()
            self._take_inner_timings()
            agg, rho = result.aggregate, result.residual
            cross_bytes, payload = result.bytes_sent, result.packet_bytes
        else:   # one node: exact
            agg = [u.clone() for u in bucket.shards]
            rho = [torch.zeros_like(u) for u in bucket.shards] if residuals is not None else None
            cross_bytes = payload = 0
        members = [tensors[i] for i in bucket.members]
        bounds = [shard_bounds(t.numel(), k) for t in members]
        width = max((sum(b[j][1] - b[j][0] for b in bounds) for j in range(k)), default=0)
        row = torch.zeros(width, dtype=torch.float32)
        at = 0
        for a in agg:
            row[at:at + a.numel()] = a.reshape(-1)
            at += a.numel()
        before = node.bytes_sent
        gathered = self._intra_wait(node.allgather(row, async_op=True), "allgather")
        intra = bucket.intra_bytes + node.bytes_sent - before
        ats = [0] * k
        for i, t, b in zip(bucket.members, members, bounds):
            full = torch.empty(t.numel(), dtype=t.dtype)
            for j in range(k):
                lo, hi = b[j]
                full[lo:hi] = gathered[j, ats[j]:ats[j] + hi - lo]
                ats[j] += hi - lo
            out[i] = full.view(t.shape)
        if residuals is not None:
            for i, t, b, r in zip(bucket.members, members, bounds, rho):
                full = torch.zeros(t.numel(), dtype=t.dtype)
                lo, hi = b[self.local_rank]
                full[lo:hi] = r.reshape(-1) * k
                residuals[i] = full.view(t.shape)
        return intra + cross_bytes, payload
