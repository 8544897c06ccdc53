"""What a method does per step, measured by running it: :func:`profile_method` runs the
method's own ``step()`` (any class in ``gradzip.optim.METHODS``) on a
:class:`RecordingGroup`, a world of ``n`` that records every collective instead of sending
it, and times its codec work (``optimizer.timings.compress_s``) and the rest of the step
on this machine. So a method added later is modelled without changes to the benchmarks.

What the profile reads from the method is its public contract: ``step()``, ``timings``,
``tracer``, the step counter ``steps``, the class attribute ``overlaps_exchange`` (the
exchange of step t runs while step t+1 computes) with ``synchronize()`` (wait for it),
and ``close()`` where a method has a background thread to stop. A method whose class says
``collective_exchanges = False`` (A-SGD: point to point to a parameter server) cannot run
on a recording group: :func:`profile_method` raises :class:`Unprofilable` for it.

It also notes every PSync exchange a step starts (:class:`Exchange`: codec, tensor
shapes, and which of the recorded collectives were its own), so the model can price the
exchange for a transport the recording never saw (two-phase, hierarchical:
:meth:`MethodProfile.comm_cost`).
"""
from __future__ import annotations

import math
import statistics
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from ..comm.base import Group, Work
from ..compressors import build
from ..errors import GradzipError
from ..exchange import DEFAULT_BUCKET_BYTES, PSync
from ..trace import Tracer
from ..train.config import method_class
from .costs import ExchangeCost, collective_time, hierarchical_cost


class Unprofilable(GradzipError):
    """The method's exchanges are not collectives on its group, so it cannot be profiled."""


class _DryRun(Exception):
    """Raised by a dry :class:`RecordingGroup` when a step waits for a collective."""


class RecordingGroup(Group):
    """A world of ``world_size`` seen from rank 0 that sends nothing: every collective is
    recorded as ``(kind, payload bytes)`` and completes at once as if every worker had
    contributed this worker's tensor (allreduce: the tensor itself; allgather: ``n``
    copies). Byte counting is the base class's, as for a real group. ``dry=True``: waiting
    on an allgather or broadcast raises :class:`_DryRun` instead (sizes only, no decoding of
    ``n`` packets); an allreduce and an all-to-all complete (one packet's decoding), so the
    collectives a step issues after them (two-phase's second round) are sized too."""

    def __init__(self, world_size: int, rank: int = 0, dry: bool = False):
        super().__init__()
        self.world_size, self.rank, self.dry = int(world_size), int(rank), dry
        self.calls: list[tuple[str, int]] = []
        self._family = [self]

    def new_group(self) -> "RecordingGroup":
        """Another group of the same workers; its collectives go to the same record."""
        child = RecordingGroup(self.world_size, self.rank, self.dry)
        child.calls = self.calls
        child._family = self._family
        self._family.append(child)
        return child

    def total_bytes(self) -> int:
        """Bytes counted by this group and the groups made from it."""
        return sum(g.bytes_sent for g in self._family)

    def _done(self, result, nbytes):
        if self.dry:
            def fail():
                raise _DryRun()
            return Work(fail, nbytes)
        return Work.completed(result, nbytes)

    def _allreduce(self, tensor, nbytes):
        self.calls.append(("allreduce", tensor.numel() * tensor.element_size()))
        return Work.completed(tensor, nbytes)

    def _allgather(self, tensor, nbytes):
        self.calls.append(("allgather", tensor.numel() * tensor.element_size()))
        return self._done(tensor.unsqueeze(0).expand(self.world_size, *tensor.shape), nbytes)

    def _broadcast(self, tensor, src, nbytes):
        self.calls.append(("broadcast", tensor.numel() * tensor.element_size()))
        return self._done(tensor, nbytes)

    def _all_to_all(self, tensors, recv_sizes, nbytes):
        """Recorded with the bytes it sends; completes even when dry, as if every worker sent
        this worker's message for ``rank`` (zeros where a peer's size differs; the two-phase
        transport issues its second round after decoding the first: a dry run sizes both)."""
        self.calls.append(("all_to_all", nbytes))
        own = tensors[self.rank]
        return Work.completed([own.clone() if own.numel() == size else own.new_zeros(size)
                               for size in recv_sizes], nbytes)

    def allgather_control(self, tensor):
        """Answered locally, unrecorded: the model leaves out the few bytes and the latency
        of a method's coordination (settings digest, non-finite agreement)."""
        return tensor.unsqueeze(0).expand(self.world_size, *tensor.shape).clone()


@dataclass
class Exchange:
    """One PSync exchange a step started: its codec (spec), the shapes of its tensors and
    the positions ``[first, end)`` of its own collectives in the step's recorded calls;
    ``bucket``: launched as a bucket of an exchange that starts during backward
    (``overlap_backward``: ``GradientExchange.start_bucket``)."""

    codec: str
    shapes: list[tuple[int, ...]]     # in the plan's launch order
    first: int
    end: int
    bucket: bool = False
    bucket_bytes: int = DEFAULT_BUCKET_BYTES   # its PSync's: the plan it is priced by
    later: list[int] = field(default_factory=list)   # calls it issued while finishing (two-phase's second round)

    def own(self) -> set[int]:
        """Positions of its collectives in the step's recorded calls."""
        return set(range(self.first, self.end)) | set(self.later)


_RECORDING = threading.local()   # .bucket: inside a start_bucket (this thread)


def _marking_buckets(opt) -> None:
    """``opt.start_bucket`` (an instance attribute over the class's) notes, while it runs,
    that the exchanges it starts are buckets."""
    method = opt.start_bucket

    def start_bucket(*args, **kwargs):
        _RECORDING.bucket = True
        try:
            return method(*args, **kwargs)
        finally:
            _RECORDING.bucket = False

    opt.start_bucket = start_bucket


@contextmanager
def _noting_exchanges(group: "RecordingGroup", into: list) -> Iterator[None]:
    """While inside: every ``PSync.start`` on ``group`` (any thread) is noted in ``into``,
    with the collectives its ``_finish`` issues (two-phase's second round)."""
    original, original_finish = PSync.start, PSync._finish
    noted: dict[int, Exchange] = {}

    def start(self, tensors, step, **kwargs):
        first = len(group.calls)
        pending = original(self, tensors, step, **kwargs)
        if self.comm is group or getattr(self.comm, "calls", None) is group.calls:
            order = (range(len(tensors)) if kwargs.get("plan") is not None
                     else self.exchange_plan(tensors, kwargs.get("keys"))[0])   # the plan's launch order
            into.append(Exchange(self.compressor.spec, [tuple(tensors[i].shape) for i in order], first,
                                 len(group.calls), getattr(_RECORDING, "bucket", False), self.bucket_bytes))
            noted[id(pending)] = into[-1]
        return pending

    def finish(self, pending):
        first = len(group.calls)
        result = original_finish(self, pending)
        if id(pending) in noted:
            noted.pop(id(pending)).later.extend(range(first, len(group.calls)))
        return result

    PSync.start, PSync._finish = start, finish
    try:
        yield
    finally:
        PSync.start, PSync._finish = original, original_finish


@dataclass
class MethodProfile:
    """What one method does per step, for ``n`` workers (means over the profiled steps)."""

    label: str
    workers: int
    overlaps: bool
    calls: list[list[tuple[str, int]]]   # per profiled step: (kind, payload bytes) per collective
    wire_bytes_per_step: float           # what the group counted (ring bytes), mean per step
    compress_s: float                    # codec work per step (compress + decode), measured here
    update_s: float                      # the rest of step(), measured here
    decode_s: float = 0.0                # the decoding part of compress_s
    timed_at: int = 0                    # worker count the times were measured at
    exchanges: list[list[Exchange]] = field(default_factory=list)   # per profiled step
    decode_one_s: float = 0.0            # decoding one packet of every tensor (an allreduce's from_sum)
    overlaps_backward: bool = False      # its exchange starts during backward (the instance's overlap_backward)

    def codec_time(self, transports: Sequence[str] = (), hierarchy: int = 1) -> float:
        """Codec seconds per step on this machine for the transports the exchanges took
        (``"recorded"``: as profiled). Encoding as profiled; decoding one packet's worth
        per tensor for an allreduce (``from_sum``), ``n`` for an allgather; two-phase
        compresses every slice (the packet's work) plus its own slice again (1/n of it)
        and decodes one packet's worth twice (the n slices it receives, the n
        recompressed ones), whatever n. Where a step mixes transports, the costliest
        rule of those used. With ``hierarchy`` k a worker codes its shard (1/k) only,
        among ``n/k`` workers."""
        if not transports or "recorded" in transports:
            return self.compress_s / hierarchy
        encode, n = self.compress_s - self.decode_s, self.workers // hierarchy
        options = [encode + self.decode_one_s]
        if "allgather" in transports:
            options.append(encode + n * self.decode_one_s)
        if "twophase" in transports:
            options.append(encode * (1 + 1 / n) + 2 * self.decode_one_s)
        return max(options) / hierarchy

    def comm_times(self, bandwidth_Bps: float, alpha_s: float) -> list[float]:
        """Network seconds of each profiled step, of the collectives as recorded."""
        return [sum(collective_time(k, b, self.workers, bandwidth_Bps, alpha_s) for k, b in step)
                for step in self.calls]

    def comm_time(self, bandwidth_Bps: float, alpha_s: float) -> float:
        """Mean network seconds per step, of the collectives as recorded."""
        return statistics.fmean(self.comm_times(bandwidth_Bps, alpha_s))

    def bucket_costs(self, bandwidth_Bps: float, alpha_s: float, transport: str | None = None, hierarchy: int = 1,
                     intra_Bps: float | None = None, intra_alpha_s: float = 0.0) -> list[dict[str, Any]]:
        """Per profiled step, for the timeline of an exchange that starts during backward:
        ``buckets``, ``(elements, network seconds)`` of each bucket exchange in launch order,
        and the step's other exchanges and collectives (``other_s`` seconds, ``other_elements``
        elements coded). ``transport`` None: the collectives as recorded; else every exchange
        priced for that transport, as :meth:`comm_cost`."""
        out = []
        for step, exchanges in zip(self.calls, self.exchanges or [[] for _ in self.calls]):
            own, buckets, other_s, other_elements = set(), [], 0.0, 0
            for ex in exchanges:
                own.update(ex.own())
                if transport is None:   # its own calls, two-phase's second round included
                    s = sum(collective_time(*step[j], self.workers, bandwidth_Bps, alpha_s) for j in sorted(ex.own()))
                elif ex.end == ex.first:
                    s = 0.0
                else:
                    s = hierarchical_cost(transport, build(ex.codec), ex.shapes, self.workers, hierarchy, bandwidth_Bps,
                                          alpha_s, intra_Bps or bandwidth_Bps, intra_alpha_s,
                                          bucket_bytes=ex.bucket_bytes).seconds
                elements = sum(math.prod(shape) for shape in ex.shapes)
                if ex.bucket:
                    buckets.append((elements, s))
                else:
                    other_s, other_elements = other_s + s, other_elements + elements
            other_s += sum(collective_time(k, b, self.workers, bandwidth_Bps, alpha_s)
                           for j, (k, b) in enumerate(step) if j not in own)
            out.append({"buckets": buckets, "other_s": other_s, "other_elements": other_elements})
        return out

    def comm_cost(self, bandwidth_Bps: float, alpha_s: float, transport: str = "auto", hierarchy: int = 1,
                  intra_Bps: float | None = None, intra_alpha_s: float = 0.0) -> dict[str, Any]:
        """Mean network seconds and wire bytes per step with every PSync exchange priced for
        ``transport`` (:func:`~gradzip.bench.costs.exchange_cost`; ``hierarchy`` = k workers
        per node: :func:`~gradzip.bench.costs.hierarchical_cost`, inside a node links of
        ``intra_Bps``); the method's other collectives as recorded. Also the transports the
        exchanges took (``"transports"``, in order of first use) and the seconds of each step
        (``"per_step"``)."""
        seconds, wire, intra, used = [], [], [], []
        for step, exchanges in zip(self.calls, self.exchanges or [[] for _ in self.calls]):
            own = set()
            s = w = i = 0.0
            for ex in exchanges:
                own.update(ex.own())
                if ex.end == ex.first:   # nothing on the wire (one worker)
                    continue
                cost: ExchangeCost = hierarchical_cost(transport, build(ex.codec), ex.shapes, self.workers, hierarchy,
                                                       bandwidth_Bps, alpha_s, intra_Bps or bandwidth_Bps,
                                                       intra_alpha_s, bucket_bytes=ex.bucket_bytes)
                s, w, i = s + cost.seconds, w + cost.wire_bytes, i + cost.intra_bytes
                used.extend(cost.transport.split("+"))
            for j, (kind, nbytes) in enumerate(step):
                if j not in own:
                    s += collective_time(kind, nbytes, self.workers, bandwidth_Bps, alpha_s)
                    w += _ring_bytes(kind, nbytes, self.workers)
            seconds.append(s)
            wire.append(w)
            intra.append(i)
        return {"seconds": statistics.fmean(seconds), "per_step": seconds, "wire_bytes": statistics.fmean(wire),
                "intra_bytes": statistics.fmean(intra), "transports": list(dict.fromkeys(used)) or ["-"]}


def _ring_bytes(kind: str, nbytes: int, n: int) -> int:
    if n <= 1:
        return 0
    if kind == "allreduce":
        return 2 * (n - 1) * nbytes // n
    if kind == "allgather":
        return (n - 1) * nbytes
    return nbytes


def _parameters(shapes: Sequence[tuple[int, ...]], seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.05)
        p.grad = torch.randn(shape, generator=g) * 0.01
        params.append(p)
    return params


def _steps(algo, options, shapes, workers, steps, warmup, dry=False):
    """Run a method's ``step()`` on a recording group: per measured step its collectives,
    wire bytes, codec seconds (compress + decode, wherever they ran), decode seconds and
    the rest of the time ``step()`` held the training thread. A method that exchanges in
    the background is waited for (its ``synchronize()``) after each step, outside the
    timing. Dry: every step on a fresh optimizer whose step counter is set to ``t - 1``
    (so periodic steps come out right), its collectives sized but never decoded."""
    cls = method_class(algo)
    if not getattr(cls, "collective_exchanges", True):
        raise Unprofilable(f"{cls.__name__} exchanges point to point, not through collectives, so it cannot be "
                           "profiled on a recording group and the timeline model has no price for its exchanges")
    params = _parameters(shapes)
    grads = [p.grad.clone() for p in params]

    def make():
        group = RecordingGroup(workers, dry=dry)
        opt = cls(params, lr=0.01, comm=group, **options)
        opt.tracer = Tracer()
        if getattr(opt, "overlap_backward", False):
            _marking_buckets(opt)
        return group, opt

    group, opt = make()
    calls, compress, decode, update, sent, exchanges = [], [], [], [], [], []
    for i in range(warmup + steps):
        if dry:
            group, opt = make()
            opt.steps = i
        for p, g in zip(params, grads):
            p.grad = g.clone()
        group.calls.clear()
        opt.tracer.events = []
        before, b0 = opt.timings, group.total_bytes()
        noted: list[Exchange] = []
        with _noting_exchanges(group, noted):
            t0 = time.perf_counter()
            try:
                opt.step()
            except _DryRun:
                pass
            elapsed = time.perf_counter() - t0
            try:
                getattr(opt, "synchronize", lambda: None)()  # overlapping methods: finish step t
            except _DryRun:
                pass
        after = opt.timings
        if i >= warmup:
            calls.append(list(group.calls))
            exchanges.append(noted)
            compress.append(after.compress_s - before.compress_s)
            decode.append(sum(e["dur"] for e in opt.tracer.events if e["name"] == "decode") / 1e6)
            update.append(max(0.0, elapsed - (after.inline_compress_s - before.inline_compress_s)
                              - (after.wait_s - before.wait_s)))
            sent.append(group.total_bytes() - b0)
        if dry:
            # a method with a background thread stops it in close() (or when collected);
            # its pending dry exchange raises again there
            try:
                getattr(opt, "close", lambda: None)()
            except _DryRun:
                pass
    return cls, calls, statistics.fmean(sent), statistics.median(compress), statistics.median(decode), \
        statistics.median(update), exchanges, bool(getattr(opt, "overlap_backward", False))


_TIMED: dict = {}  # timing runs by (method, options, shapes, workers, steps, warmup), reused above the cap


def profile_method(algo: str, options: dict[str, Any], shapes: Sequence[tuple[int, ...]], workers: int, *,
                   steps: int = 2, warmup: int = 1, label: str | None = None,
                   time_at_most: int | None = None) -> MethodProfile:
    """Run ``steps`` (after ``warmup``) of method ``algo``'s own ``step()`` on parameters of
    ``shapes`` with random gradients, on a :class:`RecordingGroup` of ``workers``.

    ``time_at_most``: above this worker count, times are measured at that count and the
    collectives sized by a dry run at ``workers`` (no decoding; only the collectives a step
    issues before it first waits for an allgather); decoding time is scaled by the number of packets decoded
    (``n`` for an allgather, 1 for an allreduce)."""
    n_t = workers if time_at_most is None else max(1, min(workers, time_at_most))
    key = (algo, tuple(sorted((k, str(v)) for k, v in options.items())), tuple(map(tuple, shapes)), n_t, steps, warmup)
    if key not in _TIMED:
        _TIMED[key] = _steps(algo, options, shapes, n_t, steps, warmup)
    cls, calls, sent, compress, decode, update, exchanges, backward = _TIMED[key]
    gathers_t = any(k == "allgather" for step in calls for k, _ in step)
    decode_one = decode / (n_t if gathers_t else 1)   # decoding one packet's worth of every tensor
    if n_t != workers:
        _, calls, sent, _, _, _, exchanges, _ = _steps(algo, options, shapes, workers, steps, 0, dry=True)
        gathers = any(k == "allgather" for step in calls for k, _ in step)
        scaled = decode * (workers if gathers else 1) / (n_t if gathers_t else 1)
        compress, decode = compress - decode + scaled, scaled
    return MethodProfile(label or algo, workers, bool(getattr(cls, "overlaps_exchange", False)), calls,
                         sent, compress, update, decode, n_t, exchanges, decode_one, backward)
