"""The exchange plan (docs/algorithms.md §Transports): which tensors travel together, on
which route, and what that costs on a modelled link. A pure function of (tensor shapes and
dtypes, the codec's wire sizes, n, bucket size, transport, hierarchy, link): no tensors of
the caller, no communication. :class:`~gradzip.exchange.PSync` executes exactly this plan,
the backward hooks (:mod:`gradzip.optim.core.overlap`) launch its buckets, ``bench.costs`` prices
it and ``describe()`` prints it, so the model and the run cannot drift apart.

**Buckets.** The tensors, in the order given (launch order: PSync passes them in descending
key order, ≈ the order backward delivers gradients, as DDP), are cut greedily into *units*
of up to ``bucket_bytes`` of the tensors' own bytes (a tensor larger than that is a unit of
its own; a change of dtype starts a new unit), as DDP's ``bucket_cap_mb``. A unit is sent
either

* on the exact transports: each tensor on its route (:func:`exact_route`: the allreduce of
  the codec's summand where packets sum and that puts no more ring bytes on the wire, else
  the allgather of its packet), one bucket per (route, carried dtype) in the unit; or
* two-phase (docs/algorithms.md §Two-phase compressed allreduce): the unit is one bucket
  whose concatenated elements are cut into ``n`` slices; or
* hierarchical (``hierarchy=k``): one bucket, reduce-scattered inside the node, its shards
  planned again (``inner``) among the ``n/k`` workers of each local rank.

Buckets are listed in launch order (by their first tensor).

**auto** (one rule, one link model): a unit goes two-phase when its modelled time is at
most :data:`TWOPHASE_FACTOR` of its exact buckets' time on ``link``, never for codecs whose
packets are their summands (their allreduce is already flat in n), a ``PerTensor`` policy,
one worker, or ``twophase=False`` (a method that reads whole-tensor packets). The model is
the alpha-beta one of ring collectives (:func:`collective_time`) on a :class:`Link`:
``link=None`` is :data:`DEFAULT_LINK` (10 Gbit/s, 20 µs a message), a rate string such as
``"100mbit"`` that bandwidth with the default latency.

**auto:<codec>** (docs/algorithms.md §Auto codec choice; :class:`~gradzip.compressors.Auto`):
per unit (cut at ``min(bucket_bytes, AUTO_UNIT_BYTES)``: small enough that large and small
layers fall apart), the codec's buckets or the unit uncompressed (``none``), whichever has the smaller
modelled time: each tensor's coding (:class:`CodecCost` of its codec in ``codec_costs``, by
spec; free where none is given) plus the buckets' seconds on ``link``; ties go to
uncompressed. Or, given ``choices`` (one codec spec per unit, in the plan's order: a decision
made before, e.g. rank 0's, or a checkpoint's), exactly those. Consecutive units that took
the same codec then travel as one unit while their bytes fit ``bucket_bytes``. ``Plan.choices``
records what each unit took and ``Plan.codecs`` each tensor's codec, which PSync executes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import torch

from ..comm.base import all_to_all_wire_bytes, allgather_wire_bytes, allreduce_wire_bytes
from ..compressors import Auto, Compressor, PerTensor, build
from ..errors import GradzipError
from ..units import format_rate, parse_rate
from ..validation import is_int, is_real

TRANSPORTS = ("auto", "allreduce", "allgather", "twophase")
ROUTES = ("allreduce", "allgather", "twophase", "hierarchical")
#: DDP's ``bucket_cap_mb`` (docs/algorithms.md §Transports, "[choice] bucket_bytes defaults to 25 MiB").
DEFAULT_BUCKET_BYTES = 25 << 20
#: auto:<codec> decides per unit of at most this many bytes (``bucket_bytes`` where smaller),
#: then sends consecutive units that took the same codec together, up to ``bucket_bytes``
#: (docs/algorithms.md §Auto codec choice, "[choice] Decide per 4 MiB, send per bucket").
AUTO_UNIT_BYTES = 4 << 20
#: ``auto`` takes two-phase only where it costs at most this fraction of the exact transports.
TWOPHASE_FACTOR = 0.5
#: Fp32 or fp16 inside a node (hierarchical exchange).
INTRA_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


# ----------------------------------------------------------------------------- the link model
@dataclass(frozen=True)
class Link:
    """One worker's full-duplex link in the alpha-beta model: ``bytes_per_s`` and
    ``latency_s`` seconds per message step."""

    bytes_per_s: float
    latency_s: float = 20e-6

    def __post_init__(self) -> None:
        rate, latency = self.bytes_per_s, self.latency_s
        if not (is_real(rate) and rate > 0) or not (is_real(latency) and 0 <= latency < math.inf):
            raise GradzipError(f"Link({rate!r}, {latency!r}): a link needs bytes_per_s > 0 (inf: infinitely fast) "
                               "and a finite latency_s >= 0, e.g. Link(1.25e8, 50e-6) or link='1gbit'")

    def __str__(self) -> str:
        return f"{format_rate(self.bytes_per_s * 8)}, {self.latency_s * 1e6:g} us"

    def shared(self, ways: int) -> "Link":
        """This link shared by ``ways`` exchanges at once (a node's uplink)."""
        return replace(self, bytes_per_s=self.bytes_per_s / ways)


#: The link ``auto`` assumes when none is declared: 10 Gbit/s, 20 µs per message (a model).
DEFAULT_LINK = Link(1.25e9, 20e-6)
#: Inside a node (hierarchical exchange), when none is declared: 100 Gbit/s, 5 µs.
DEFAULT_INTRA_LINK = Link(12.5e9, 5e-6)


def as_link(value, default: Link = DEFAULT_LINK) -> Link:
    """``None`` -> ``default``; a :class:`Link`; a rate string (``"10gbit"``) -> that
    bandwidth with the default's latency."""
    if value is None:
        return default
    if isinstance(value, Link):
        return value
    if isinstance(value, str):
        try:
            bps = parse_rate(value)
        except GradzipError as error:
            raise GradzipError(f"link={value!r}: {error}") from None
        if bps is None:
            raise GradzipError(f"link={value!r}: the model needs a finite rate such as '10gbit' or '100mbit'")
        return replace(default, bytes_per_s=bps / 8)
    raise GradzipError(f"link must be None, a rate such as '10gbit' or '100mbit', or a gradzip.exchange.Link, "
                       f"got {value!r}")


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds for one ring collective among ``n`` workers on ``link``: ``allreduce`` of
    ``nbytes`` (``2(n−1)`` steps of ``nbytes/n``), ``allgather`` of ``nbytes`` from each
    (``n−1`` steps of ``nbytes``), ``all_to_all`` / ``broadcast`` in which a worker sends
    ``nbytes`` in all (``n−1`` messages)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind == "allreduce":
        return 2 * (n - 1) * link.latency_s + allreduce_wire_bytes(nbytes, n) / link.bytes_per_s
    if kind == "allgather":
        return (n - 1) * link.latency_s + allgather_wire_bytes(nbytes, n) / link.bytes_per_s
    if kind in ("all_to_all", "broadcast"):
        return (n - 1) * link.latency_s + nbytes / link.bytes_per_s
    raise GradzipError(f"unknown collective {kind!r}")


@dataclass(frozen=True)
class CodecCost:
    """A codec's coding seconds for one tensor on one worker of ``n`` (docs/algorithms.md
    §Auto codec choice): ``fixed_s + per_element_s · numel`` for compressing it with its
    residual and decoding its aggregate (the route's ``from_sum``, or ``n`` packets)."""

    fixed_s: float = 0.0
    per_element_s: float = 0.0

    def seconds(self, numel: int) -> float:
        return self.fixed_s + self.per_element_s * numel


# ----------------------------------------------------------------------------- wire sizes
def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def slice_bounds(d: int, n: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of ``torch.tensor_split(arange(d), n)``'s slices (the first
    ``d mod n`` one element longer; empty ones when ``d < n``)."""
    q, extra = divmod(d, n)
    bounds, start = [], 0
    for j in range(n):
        stop = start + q + (j < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


class Sizer:
    """A codec's wire sizes by (shape, dtype), cached: its packet's bytes (the codec's own
    ``wire_nbytes`` for float32, a compressed zero tensor of that dtype otherwise) and its
    summand's bytes for ``n`` workers (None where packets do not sum)."""

    def __init__(self, codec: Compressor):
        self.codec = codec
        self._packets: dict = {}
        self._summands: dict = {}

    def packet(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
        key = (tuple(shape), dtype)
        if key not in self._packets:
            if math.prod(key[0]) == 0:
                self._packets[key] = 0
            elif dtype == torch.float32:
                self._packets[key] = int(self.codec.wire_nbytes(key[0]))
            else:
                self._packets[key] = int(self.codec.compress(torch.zeros(key[0], dtype=dtype)).nbytes)
        return self._packets[key]

    def summand(self, shape: Sequence[int], n: int, dtype: torch.dtype = torch.float32) -> int | None:
        sum_dtype = self.codec.sum_dtype(n, dtype)
        if sum_dtype is None:
            return None
        key = (tuple(shape), n, dtype)
        if key not in self._summands:
            packet = self.codec.compress(torch.zeros(key[0], dtype=dtype))
            numel = self.codec.summand_numel(packet, n)
            if numel is None:
                numel = self.codec.summand(packet, n).numel()
            self._summands[key] = numel * itemsize(sum_dtype)
        return self._summands[key]

    def slices(self, d: int, n: int, dtype: torch.dtype = torch.float32) -> list[int]:
        """The packet bytes of each of the ``n`` slices of ``d`` elements (:func:`slice_bounds`)."""
        return [self.packet((b - a,), dtype) for a, b in slice_bounds(d, n)]


_SIZERS: dict = {}


def sizer(codec: Compressor) -> Sizer:
    """The shared :class:`Sizer` of a codec (codecs are immutable: one per spec)."""
    key = (type(codec), codec.spec)
    if key not in _SIZERS:
        _SIZERS[key] = Sizer(codec)
    return _SIZERS[key]


_SUMS_AS_PACKET: dict = {}


def sums_as_packet(codec: Compressor, n: int, dtype: torch.dtype = torch.float32) -> bool:
    """The codec's packets sum in compressed form as they are (its summand is its packet:
    ``none``, ``fp16``, ``randomk``, ``powersgd``, ...): its allreduce is already flat in n,
    so two-phase gains nothing. (Codecs whose summand widens packed codes, ``2bit`` and
    ``sign``, size it without building it: ``summand_numel``.)"""
    key = (type(codec), codec.spec, n, dtype)
    if key not in _SUMS_AS_PACKET:
        sums = codec.sum_dtype(n, dtype) is not None
        _SUMS_AS_PACKET[key] = sums and codec.summand_numel(codec.compress(torch.zeros(64, dtype=dtype)), n) is None
    return _SUMS_AS_PACKET[key]


def exact_route(codec: Compressor, shape, n: int, dtype: torch.dtype = torch.float32,
                pinned: str = "auto") -> tuple[str, torch.dtype, int]:
    """PSync's exact route for one tensor: ``("allreduce", summand dtype, summand bytes)``
    where the codec's packets sum and that puts no more ring bytes on the wire than the
    allgather (ties: allreduce), else ``("allgather", uint8, packet bytes)``; ``pinned``
    ``"allreduce"`` / ``"allgather"`` (``transport=``) forces it where the codec allows."""
    sizes = sizer(codec)
    packet = sizes.packet(shape, dtype)
    sum_dtype = codec.sum_dtype(n, dtype)
    if sum_dtype is not None and pinned != "allgather":
        summand = sizes.summand(shape, n, dtype)
        if pinned == "allreduce" or allreduce_wire_bytes(summand, n) <= allgather_wire_bytes(packet, n):
            return "allreduce", sum_dtype, summand
    return "allgather", torch.uint8, packet


# ----------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Bucket:
    """One collective unit of a plan. ``tensors``: positions in the plan's shapes, in order;
    ``route``; ``dtype``: what the collective carries (the summand's dtype for an allreduce,
    uint8 for an allgather, the tensors' dtype for two-phase and hierarchical); ``nbytes``:
    what one worker contributes (summands, its packets, its packets of all slices, its
    tensors); ``seconds``: modelled on the plan's link. Two-phase: ``slices`` are the packet
    bytes of each of the n slices of the bucket's concatenated elements; hierarchical:
    ``inner`` holds, per local rank, the plan of its shards across nodes."""

    tensors: tuple[int, ...]
    route: str
    dtype: torch.dtype
    nbytes: int
    seconds: float
    world_size: int
    slices: tuple[int, ...] = ()
    inner: tuple["Plan", ...] = ()
    intra_bytes: int = 0          # hierarchical: what one worker sends inside its node

    @property
    def mean_bytes(self) -> float:
        """:meth:`bytes_for` averaged over the ranks (two-phase: ``2(n−1)/n`` of its packets)."""
        n = self.world_size
        if self.route == "twophase":
            return 2 * (n - 1) * sum(self.slices) / n
        if self.route == "hierarchical":
            return self.intra_bytes + sum(p.bytes_per_worker for p in self.inner) / len(self.inner)
        return self.bytes_for(0)

    def bytes_for(self, rank: int) -> int:
        """Bytes worker ``rank`` puts on the wire for this bucket (what its group counts)."""
        n = self.world_size
        if self.route == "allreduce":
            return allreduce_wire_bytes(self.nbytes, n)
        if self.route == "allgather":
            return allgather_wire_bytes(self.nbytes, n)
        if self.route == "twophase":
            if n == 1:
                return 0
            return all_to_all_wire_bytes(self.slices, rank) + (n - 1) * self.slices[rank]
        k = len(self.inner)
        return self.intra_bytes + self.inner[rank % k].bytes_for(rank // k)


@dataclass(frozen=True)
class Plan:
    """The plan of one exchange (module docstring): ``buckets`` in launch order, and the
    settings it was made with."""

    buckets: tuple[Bucket, ...]
    world_size: int
    transport: str
    bucket_bytes: int
    link: Link
    shapes: tuple[tuple[int, ...], ...] = field(repr=False, default=())
    #: the codec of each tensor (in the order of ``shapes``): what PSync compresses it with
    codecs: tuple[Compressor, ...] = field(repr=False, default=())
    #: auto:<codec>: the codec spec each unit took, in unit order (hierarchical: every local
    #: rank's inner plan in turn, per unit); empty for any other codec
    choices: tuple[str, ...] = ()

    def bytes_for(self, rank: int) -> int:
        """Bytes worker ``rank`` puts on the wire in one exchange of this plan."""
        return sum(b.bytes_for(rank) for b in self.buckets)

    @property
    def bytes_per_worker(self) -> float:
        """Bytes a worker sends per exchange, the mean over ranks (equal on every rank but for
        two-phase, whose longest slices are the first ones)."""
        return sum(b.mean_bytes for b in self.buckets)

    @property
    def seconds(self) -> float:
        """Modelled network seconds of one exchange, the buckets one after the other."""
        return sum(b.seconds for b in self.buckets)

    def routes(self) -> list[str]:
        """The route of each tensor, in the order of the plan's shapes."""
        out = [""] * len(self.shapes)
        for b in self.buckets:
            for i in b.tensors:
                out[i] = b.route
        return out

    def select(self, indices: Sequence[int]) -> "Plan":
        """The plan of these buckets alone, their tensors renumbered ``0 ..`` in bucket
        order: what PSync executes for a bucket launched on its own (the backward hooks)."""
        chosen = [self.buckets[i] for i in indices]
        order = [t for b in chosen for t in b.tensors]
        where = {t: i for i, t in enumerate(order)}
        buckets = tuple(replace(b, tensors=tuple(where[t] for t in b.tensors)) for b in chosen)
        return replace(self, buckets=buckets, shapes=tuple(self.shapes[t] for t in order),
                       codecs=tuple(self.codecs[t] for t in order) if self.codecs else ())

    def lossless(self) -> list[bool]:
        """Per tensor (in the order of ``shapes``): whether the codec it travels with is
        lossless (``none``), so that its aggregate is the exact mean of the inputs
        (hierarchical: the codec of every inner plan, on every local rank)."""
        out = [False] * len(self.shapes)
        for b in self.buckets:
            if b.route == "hierarchical":   # one answer for the bucket: its inner plans'
                inner = all(q.codecs and all(c.lossless for c in q.codecs) for q in b.inner)
            for t in b.tensors:
                out[t] = inner if b.route == "hierarchical" else bool(self.codecs) and self.codecs[t].lossless
        return out

    def layout(self) -> str:
        """Every bucket's route and tensors, compactly (``"twophase[3,2] allreduce[1,0]"``):
        part of the settings every worker must agree on (two-phase numbers depend on it)."""
        return " ".join(f"{b.route}[{','.join(map(str, b.tensors))}]" for b in self.buckets)

    def codec_of(self, bucket: Bucket) -> str:
        """The spec of the codec a bucket's tensors travel with (``"mixed"``: a PerTensor
        policy's bucket of several; hierarchical: the choices of its inner plans)."""
        if bucket.route == "hierarchical":
            return ",".join(dict.fromkeys(c for q in bucket.inner for c in q.choices)) or "?"
        specs = {self.codecs[t].spec for t in bucket.tensors} if self.codecs else set()
        return specs.pop() if len(specs) == 1 else "mixed"

    def describe(self) -> list[str]:
        """One line per bucket, then the totals: what ``opt.describe_plan()`` prints."""
        lines = []
        for i, b in enumerate(self.buckets):
            numel = sum(math.prod(self.shapes[t]) for t in b.tensors)
            codec = f"{self.codec_of(b):<16} " if self.choices else ""
            lines.append(f"bucket {i}: {codec}{b.route:<12} {len(b.tensors):>4} tensors {numel:>12,} elements "
                         f"{b.nbytes:>12,} B/worker in  {b.bytes_for(0):>12,} B on the wire  "
                         f"{b.seconds * 1e3:8.3f} ms")
        lines.append(f"{len(self.buckets)} buckets, {self.bytes_per_worker:,.0f} B per worker, "
                     f"{self.seconds * 1e3:.3f} ms on {self.link} ({self.world_size} workers, transport={self.transport})")
        return lines


def check_transport(transport, where: str = "PSync") -> str:
    if transport not in TRANSPORTS:
        raise GradzipError(f"{where}: transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    return transport


def plan(shapes: Sequence, compressor, world_size: int, *, transport: str = "auto",
         bucket_bytes: int = DEFAULT_BUCKET_BYTES, hierarchy: int | None = None, link=None,
         dtypes: Sequence[torch.dtype] | None = None, twophase: bool = True, intra: str = "fp32",
         intra_link=None, codec_costs: Mapping[str, CodecCost] | None = None,
         choices: "Sequence[str] | None" = None) -> Plan:
    """The plan of one exchange of tensors of ``shapes`` (``torch.Size`` or tuples, in launch
    order; ``dtypes``: theirs, float32 when None) with ``compressor`` (a spec string, a
    :class:`~gradzip.compressors.Compressor`, or one codec per tensor) among ``world_size``
    workers (module docstring). ``hierarchy``: k workers per node, every bucket hierarchical
    (k = 1 gives the flat plan's bits through one-worker nodes); None: flat;
    ``link``: the link ``auto`` and the modelled seconds use (flat: a worker's link;
    hierarchical: the node's uplink, which the node's k exchanges share); ``intra_link``: the
    links inside a node; ``twophase=False``: ``auto`` keeps to the exact transports.
    ``compressor="auto:<codec>"``: ``codec_costs`` (by codec spec) price each unit's coding
    for the rule, or ``choices`` (one codec spec per unit, as ``Plan.choices`` lists them)
    give the decision (module docstring)."""
    shapes = tuple(tuple(int(s) for s in shape) for shape in shapes)
    dtypes = tuple(dtypes) if dtypes is not None else (torch.float32,) * len(shapes)
    if len(dtypes) != len(shapes):
        raise GradzipError(f"plan: {len(dtypes)} dtypes for {len(shapes)} shapes; give one dtype per shape")
    if not is_int(world_size) or world_size < 1:
        raise GradzipError(f"plan: world_size must be an integer >= 1, got {world_size!r}")
    if not is_int(bucket_bytes) or bucket_bytes < 1:
        raise GradzipError(f"plan: bucket_bytes must be an integer >= 1, got {bucket_bytes!r}")
    check_transport(transport, "plan")
    codecs, single = _codecs(compressor, shapes)
    twophase = twophase and single
    link = as_link(link)
    k = 1 if hierarchy is None else hierarchy
    if not is_int(k) or k < 1 or world_size % k:
        raise GradzipError(f"plan: hierarchy must be an integer >= 1 dividing the {world_size} workers, got {hierarchy!r}")
    auto = codecs[0] if single and codecs and isinstance(codecs[0], Auto) else None
    chooser = choices if isinstance(choices, _Chooser) else _Chooser(auto, choices)
    first = len(chooser.made)
    flat_auto = auto is not None and hierarchy is None   # decides per smaller units, then joins them
    units = _units(shapes, dtypes, min(bucket_bytes, AUTO_UNIT_BYTES) if flat_auto else bucket_bytes)
    resolved = list(codecs)
    if hierarchy is not None:
        buckets = [_hierarchical(u, shapes, dtypes, codecs, world_size, k, transport, bucket_bytes, link,
                                 twophase, intra, as_link(intra_link, DEFAULT_INTRA_LINK), codec_costs, chooser)
                   for u in units]
    elif flat_auto:
        decided = [(u, _auto(u, shapes, dtypes, auto, resolved, world_size, transport, link, twophase,
                             codec_costs, chooser))
                   for u in units]
        buckets = [b for group, codec in _together(decided, shapes, dtypes, bucket_bytes)
                   for b in _auto_buckets(group, shapes, dtypes, auto, codec, world_size, transport, link, twophase)]
    else:
        buckets = [b for u in units for b in _flat(u, shapes, dtypes, codecs, world_size, transport, link, twophase)]
    buckets.sort(key=lambda b: b.tensors[0] if b.tensors else -1)
    if chooser is not choices:   # the outermost plan: a given decision must cover it exactly
        chooser.check_used()
    return Plan(tuple(buckets), world_size, transport, int(bucket_bytes), link, shapes, tuple(resolved),
                tuple(chooser.made[first:]))


class _Chooser:
    """auto's choice of each unit, in the plan's order: the given ones (a decision made
    before), else the rule's (``decide``); it records them (``made``)."""

    def __init__(self, auto: "Auto | None", given: Sequence[str] | None):
        if given is not None and (isinstance(given, str) or not all(isinstance(c, str) for c in given)):
            raise GradzipError(f"plan: choices must be a sequence of codec specs, one per unit, got {given!r}")
        if given and auto is None:
            raise GradzipError("plan: choices decide the units of an auto:<codec> exchange; this one has one codec "
                               "(or a PerTensor policy) for every tensor")
        if given is not None and auto is not None:
            bad = sorted(set(given) - {auto.codec.spec, "none"})
            if bad:
                raise GradzipError(f"plan: the decision names {', '.join(bad)}, but {auto.spec} chooses between "
                                   f"{auto.codec.spec} and none; give the decision of this codec")
        self.given = None if given is None else list(given)
        self.made: list[str] = []

    def next(self, decide) -> str:
        if self.given is None:
            choice = decide()
        elif len(self.made) < len(self.given):
            choice = self.given[len(self.made)]
        else:
            raise GradzipError(f"plan: the decision has {len(self.given)} choices, fewer than this exchange's units; "
                               "it was made for other tensors or another bucket_bytes")
        self.made.append(choice)
        return choice

    def check_used(self) -> None:
        if self.given is not None and len(self.given) != len(self.made):
            raise GradzipError(f"plan: the decision has {len(self.given)} choices for {len(self.made)} units; it was "
                               "made for other tensors or another bucket_bytes")


def _unit_seconds(unit, shapes, buckets: list[Bucket], codec: Compressor, costs) -> float:
    """``T_x(U)``: the unit's coding with ``codec`` (:class:`CodecCost`, free where none is
    known) and its buckets' modelled seconds."""
    cost = (costs or {}).get(codec.spec, CodecCost())
    return sum(cost.seconds(math.prod(shapes[i])) for i in unit) + sum(b.seconds for b in buckets)


def _auto_buckets(unit, shapes, dtypes, auto: "Auto", codec: Compressor, n: int, transport: str, link: Link,
                  twophase: bool) -> list[Bucket]:
    """auto's buckets of ``unit`` sent with ``codec``: uncompressed on the exact allreduce,
    whatever transport the codec's takes; the codec on its transport."""
    if codec is auto.dense:
        return _flat(unit, shapes, dtypes, [codec] * len(shapes), n, "auto", link, False)
    return _flat(unit, shapes, dtypes, [codec] * len(shapes), n, transport, link, twophase)


def _auto(unit, shapes, dtypes, auto: "Auto", resolved: list, n: int, transport: str, link: Link,
          twophase: bool, costs, chooser: _Chooser) -> Compressor:
    """auto's choice for one unit (docs/algorithms.md §Auto codec choice): the codec or
    uncompressed, by the rule or the given choice; sets ``resolved`` for its tensors."""
    def seconds(codec: Compressor) -> float:
        return _unit_seconds(unit, shapes, _auto_buckets(unit, shapes, dtypes, auto, codec, n, transport, link,
                                                         twophase), codec, costs)

    def decide() -> str:
        return auto.codec.spec if seconds(auto.codec) < seconds(auto.dense) else "none"

    codec = auto.codec if chooser.next(decide) == auto.codec.spec else auto.dense
    for i in unit:
        resolved[i] = codec
    return codec


def _together(decided, shapes, dtypes, bucket_bytes: int) -> list[tuple[list[int], Compressor]]:
    """auto's decided units (``(unit, codec)`` in order) joined where consecutive ones took
    the same codec and dtype, while their bytes fit ``bucket_bytes``: what travels together."""
    groups = _greedy([_unit_bytes(unit, shapes, dtypes) for unit, _ in decided],
                     [(id(codec), dtypes[unit[0]]) for unit, codec in decided], bucket_bytes)
    return [([i for j in group for i in decided[j][0]], decided[group[0]][1]) for group in groups]


def _codecs(compressor, shapes) -> tuple[list[Compressor], bool]:
    """One codec per tensor, and whether they are one codec (two-phase needs one)."""
    if isinstance(compressor, (list, tuple)):
        if len(compressor) != len(shapes):
            raise GradzipError(f"plan: {len(compressor)} codecs for {len(shapes)} tensors; give one per tensor")
        codecs = [build(c) for c in compressor]
        return codecs, all(c is codecs[0] for c in codecs)
    codec = build(compressor)
    if isinstance(codec, PerTensor):
        return [codec.resolve(None, torch.empty(shape, device="meta")) for shape in shapes], False
    return [codec] * len(shapes), True


def _unit_bytes(unit, shapes, dtypes) -> int:
    """The tensors' own bytes of ``unit`` (what ``bucket_bytes`` counts)."""
    return sum(math.prod(shapes[i]) * itemsize(dtypes[i]) for i in unit)


def _units(shapes, dtypes, bucket_bytes: int) -> list[list[int]]:
    """The greedy cut by the tensors' own bytes (module docstring)."""
    return _greedy([_unit_bytes([i], shapes, dtypes) for i in range(len(shapes))], dtypes, bucket_bytes)


def _greedy(nbytes: Sequence[int], keys: Sequence, limit: int) -> list[list[int]]:
    """Positions ``0 … n−1`` cut in order: each joins the group before it while it has the key
    of that group's first and the group's bytes stay within ``limit`` (an item larger than
    ``limit`` is a group of its own)."""
    groups: list[list[int]] = []
    filled = 0
    for i, (size, key) in enumerate(zip(nbytes, keys)):
        if not groups or filled + size > limit or keys[groups[-1][0]] != key:
            groups.append([])
            filled = 0
        groups[-1].append(i)
        filled += size
    return groups


def _exact(unit, shapes, dtypes, codecs, n: int, pinned: str, link: Link) -> list[Bucket]:
    """The unit's exact buckets: one per (route, carried dtype), in order of first tensor."""
    open_: dict = {}
    for i in unit:
        route, dtype, nbytes = exact_route(codecs[i], shapes[i], n, dtypes[i], pinned)
        members, total = open_.get((route, dtype), ((), 0))
        open_[(route, dtype)] = (members + (i,), total + nbytes)
    return [Bucket(members, route, dtype, total, collective_time(route, total, n, link), n)
            for (route, dtype), (members, total) in open_.items()]


def _twophase(unit, shapes, dtypes, codec: Compressor, n: int, link: Link) -> Bucket:
    """The unit as one two-phase bucket: its ``d`` concatenated elements in ``n`` slices."""
    d = sum(math.prod(shapes[i]) for i in unit)
    slices = tuple(sizer(codec).slices(d, n, dtypes[unit[0]]))
    busiest = max(range(n), key=lambda j: slices[j])
    p1 = all_to_all_wire_bytes(slices, busiest)
    p2 = (n - 1) * slices[busiest]
    seconds = collective_time("all_to_all", p1, n, link) + collective_time("all_to_all", p2, n, link) if n > 1 else 0.0
    return Bucket(tuple(unit), "twophase", dtypes[unit[0]], sum(slices), seconds, n, slices)


def _flat(unit, shapes, dtypes, codecs, n: int, transport: str, link: Link, twophase: bool) -> list[Bucket]:
    codec = codecs[unit[0]]
    if transport == "twophase":
        return [_twophase(unit, shapes, dtypes, codec, n, link)]
    exact = _exact(unit, shapes, dtypes, codecs, n, transport, link)
    if transport != "auto" or not twophase or n == 1 or sums_as_packet(codec, n, dtypes[unit[0]]):
        return exact
    two = _twophase(unit, shapes, dtypes, codec, n, link)
    return [two] if two.seconds <= TWOPHASE_FACTOR * sum(b.seconds for b in exact) else exact


def shard_bounds(d: int, k: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of the ``k`` shards ``tensor_split(arange(d), k)`` (the
    hierarchical exchange's shards)."""
    return slice_bounds(d, k)


def _hierarchical(unit, shapes, dtypes, codecs, n: int, k: int, transport: str, bucket_bytes: int, link: Link,
                  twophase: bool, intra: str, intra_link: Link, costs=None, chooser: "_Chooser | None" = None) -> Bucket:
    """The unit as one hierarchical bucket: a reduce-scatter inside the node (rows padded to
    the longest), per local rank the plan of its shards across the ``n/k`` nodes on its
    share of the uplink, an allgather of the fp32 aggregate shards inside the node."""
    rows = [0] * k
    for i in unit:
        for j, (a, b) in enumerate(shard_bounds(math.prod(shapes[i]), k)):
            rows[j] += b - a
    width = max(rows)
    inner = tuple(
        plan([(b - a,) for i in unit for a, b in [shard_bounds(math.prod(shapes[i]), k)[j]]],
             [codecs[i] for i in unit], n // k, transport=transport, bucket_bytes=bucket_bytes,
             link=link.shared(k), dtypes=[dtypes[i] for i in unit], twophase=twophase, codec_costs=costs,
             choices=chooser)
        for j in range(k))
    scatter = (k - 1) * (k * width * itemsize(INTRA_DTYPES[intra])) // k
    gather = allgather_wire_bytes(width * 4, k)
    seconds = (collective_time("all_to_all", scatter, k, intra_link) + collective_time("allgather", width * 4, k, intra_link)
               + max(p.seconds for p in inner))
    nbytes = _unit_bytes(unit, shapes, dtypes)
    return Bucket(tuple(unit), "hierarchical", dtypes[unit[0]], nbytes, seconds, n, (), inner, scatter + gather)
