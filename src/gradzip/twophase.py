"""The two-phase compressed allreduce, PSync's transport whose bytes stay flat in n
(docs/algorithms.md §Transports of PSync, "Two-phase compressed allreduce").

Per tensor ``v`` of ``d`` elements (flattened), slices ``S_0 … S_{n−1}`` of
``torch.tensor_split(arange(d), n)`` (the first ``d mod n`` one element longer; empty
when ``d < n``, and an empty slice is neither compressed nor sent)::

    worker i, phase 1:  c_ij = C(v_i[S_j]) for every j;   r_i = v_i − concat_j dec(c_ij)
                        send c_ij to worker j                                 # all-to-all
    worker j, phase 2:  s_j = aggregate_i dec(c_ij) + E_j    # the codec's aggregate (mean, majority vote)
                        ĉ_j = C(s_j);  E_j ← s_j − dec(ĉ_j)   # server error, starts at 0
                        send ĉ_j to every worker                              # "allgather"
    every worker:       aggregate = concat_j dec(ĉ_j);  residual r_i

Both rounds are :meth:`Group.all_to_all` calls: one message per peer holding that peer's
slices of every tensor of the bucket (phase 2 sends the same message to every peer, what
an allgather of unequal sizes sends). A receiver sizes what it gets from its own packet of
the same slice (same shape, same codec: the layout PSync's allgather relies on too), so
no sizes travel. Local work: each stage (compress, aggregate + recompress, decode) is one
codec call per bucket over all its slices (:class:`Layout`,
:meth:`~gradzip.compressors.Compressor.compress_slices`), the same bits as a call per slice.
Bytes per worker: ``Σ_{j≠i} |c_ij| + (n−1)·|ĉ_i|`` ≈ 2(n−1)/n × packet
(:func:`wire_bytes`). With PSync's ``round_bytes`` each of the two all-to-alls is sent in
rounds of at most that many bytes per message (:func:`rounds`): the same bytes and numbers,
more calls; on links that several exchanges share (the exchanges of a node's workers
behind its uplink) whole messages left the link idle a third of the time
(docs/benchmarks/transports-and-nodes.md, "Two-phase across nodes: what the uplink runs
say").

Seeds: phase 1 slice ``j`` uses ``mix(seed of (step, key) as for the exact transports, j)``
(so shared randomness stays shared per slice), the second compression of slice ``j`` (done
by worker ``j`` alone) ``mix(seed, step, key, j)``. Sign's majority vote is a ±1/0 vector
that ``sign`` compresses to itself except at ties (0 → +1, kept in ``E_j``): the rule is
applied as written, for every codec.

The server error ``E_j`` is exchange state, keyed ``(tensor key, slice j)``: stable across
bucket rebuilds and resume (:meth:`ServerErrors.state_dict`). An exchange updates it only
once its aggregate passed the overflow check, so a skipped step leaves it as it was.

**auto** (:func:`choose`): per bucket (the tensors of one exchange in order, up to
``bucket_bytes`` of packets), deterministically from (codec, shapes, dtypes, n, bucket
size), the modelled cost of each transport: wire bytes over :data:`LINK_BYTES_PER_S` plus
:data:`MESSAGE_LATENCY_S` per message (ring allreduce and two-phase ``2(n−1)`` messages,
allgather ``n−1``, once per bucket). The whole bucket goes two-phase only when that costs at
most half of its exact collectives (each tensor's: PSync's byte rule), so small jobs keep
the exact numbers; the choice depends on the bucket, never on the rank, and never for codecs whose packets are their summands
(``none``, ``fp16``, ``randomk``, ``randblock``, ``powersgd``: their allreduce is already flat).
"""
from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch

from . import seeds
from .comm import allgather_wire_bytes, allreduce_wire_bytes
from .compressors import Compressor, Packet
from .errors import GradzipError
from .validation import is_int

TRANSPORTS = ("auto", "allreduce", "allgather", "twophase")

#: The auto rule's link (10 Gbit/s) and per-message latency (20 µs): a model, not a measurement.
LINK_BYTES_PER_S = 1.25e9
MESSAGE_LATENCY_S = 20e-6


def check_transport(transport, where: str = "PSync") -> str:
    if transport not in TRANSPORTS:
        raise GradzipError(f"{where}: transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    return transport


def check_round_bytes(round_bytes, where: str = "PSync") -> int | None:
    """``round_bytes`` checked: None, or an integer >= 1."""
    if round_bytes is not None and (not is_int(round_bytes) or round_bytes < 1):
        raise GradzipError(f"{where}: round_bytes must be None (whole messages) or an integer >= 1, "
                           f"got {round_bytes!r}; e.g. 131072 for rounds of 128 KiB")
    return None if round_bytes is None else int(round_bytes)


def rounds(sizes: Sequence[int], wire: torch.Tensor, round_bytes: int | None) -> int:
    """How many rounds a phase's all-to-all takes (:meth:`gradzip.comm.Group.all_to_all`):
    enough that no message exceeds ``round_bytes`` (``sizes``: the entries of ``wire``'s
    dtype each slice's packets take; the same on every worker, so every worker takes the same
    number); 1 for ``round_bytes`` None."""
    if round_bytes is None or not sizes:
        return 1
    return max(1, -(-max(sizes) * wire.element_size() // round_bytes))


def slice_bounds(d: int, n: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of ``torch.tensor_split(arange(d), n)``'s slices."""
    q, extra = divmod(d, n)
    bounds, start = [], 0
    for j in range(n):
        stop = start + q + (j < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


class Layout:
    """Where the slices of a bucket's tensors (``numels``, back to back in one flat buffer)
    lie, for ``n`` workers: the exchange's codec calls take them all at once
    (:meth:`gradzip.compressors.Compressor.compress_slices`), so its local work grows with the
    bytes, not with tensors × slices.

    ``offsets[k]``: tensor k's first entry in the buffer. Per destination ``j``: ``members[j]``
    (the tensors whose slice j is not empty, in order), ``blocks[j]`` (those slices' bounds
    in the buffer) and ``packed[j]`` (the same slices back to back from 0: phase 2's buffer
    on worker j). ``bounds``: every block, destination by destination (phase 1's order, so
    each peer's message is one contiguous run), ``first[j]``: block j's first index there."""

    def __init__(self, numels: Sequence[int], n: int):
        self.offsets = [0]
        for d in numels:
            self.offsets.append(self.offsets[-1] + d)
        self.total = self.offsets.pop()
        cut = [slice_bounds(d, n) for d in numels]
        self.members = [[k for k, c in enumerate(cut) if c[j][1] > c[j][0]] for j in range(n)]
        self.blocks = [[(self.offsets[k] + cut[k][j][0], self.offsets[k] + cut[k][j][1]) for k in self.members[j]]
                       for j in range(n)]
        self.packed = []
        for block in self.blocks:
            ends = itertools.accumulate(b - a for a, b in block)
            self.packed.append([(end - (b - a), end) for (a, b), end in zip(block, ends)])
        self.bounds = [ab for block in self.blocks for ab in block]
        self.first = [0, *itertools.accumulate(len(block) for block in self.blocks)]


def phase1_seed(base: int, j: int) -> int:
    return seeds.mix(base, j)


def phase2_seed(seed: int, step: int, key: int, j: int) -> int:
    return seeds.mix(seed, step, key, j)


class Sizer:
    """Wire bytes of a codec's packets by (numel, dtype), cached: the codec's own
    ``wire_nbytes`` for float32, a compressed zero tensor of that dtype otherwise (``none``
    sends bfloat16 gradients in 2 bytes an element, not 4)."""

    def __init__(self, codec: Compressor):
        self.codec = codec
        self._cache: dict[tuple[int, torch.dtype], int] = {}
        self._slices: dict[tuple[int, int, torch.dtype], int] = {}

    def __call__(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        key = (numel, dtype)
        if key not in self._cache:
            if numel == 0:
                self._cache[key] = 0
            elif dtype == torch.float32:
                self._cache[key] = int(self.codec.wire_nbytes((numel,)))
            else:
                self._cache[key] = int(self.codec.compress(torch.zeros(numel, dtype=dtype)).nbytes)
        return self._cache[key]

    def slices(self, d: int, n: int, dtype: torch.dtype = torch.float32) -> int:
        """The bytes of the packets of one tensor's ``n`` slices (:func:`slice_bounds`), cached:
        what PSync buckets two-phase tensors by, and what the auto rule prices."""
        key = (d, n, dtype)
        if key not in self._slices:
            self._slices[key] = sum(self(b - a, dtype) for a, b in slice_bounds(d, n))
        return self._slices[key]


def wire_bytes(sizer: Sizer, d: int, n: int, rank: int, dtype: torch.dtype = torch.float32) -> int:
    """What worker ``rank`` sends for one tensor of ``d`` elements: its slices for the other
    workers, then its compressed slice to each of them."""
    if n == 1:
        return 0
    sizes = [sizer(b - a, dtype) for a, b in slice_bounds(d, n)]
    return sum(s for j, s in enumerate(sizes) if j != rank) + (n - 1) * sizes[rank]


def sums_as_packet(codec: Compressor, n: int, dtype: torch.dtype) -> bool:
    """The codec's packets sum in compressed form as they are (its summand is its packet:
    ``none``, ``fp16``, ``randomk``, ...): two-phase gains nothing there."""
    return codec.sum_dtype(n, dtype) is not None and not _packs_summand(codec)


def _packs_summand(codec: Compressor) -> bool:
    # a codec that sizes its summand without building it widens packed codes (2bit, sign)
    probe = Packet({}, torch.Size([1]), torch.float32)
    try:
        return codec.summand_numel(probe, 2) is not None
    except Exception:  # noqa: BLE001 - a codec whose summand_numel reads its wire
        return False


def _costs(codec: Compressor, sizer: Sizer, d: int, dtype: torch.dtype, n: int) -> tuple[str, dict, float]:
    """For one tensor of ``d`` elements: PSync's exact collective (fewer wire bytes, ties to
    allreduce), the wire bytes of each exact collective, and two-phase's mean wire bytes."""
    packet = sizer(d, dtype)
    sum_dtype = codec.sum_dtype(n, dtype)
    by_bytes = {"allgather": allgather_wire_bytes(packet, n)}
    if sum_dtype is not None:
        width = torch.empty((), dtype=sum_dtype).element_size()
        numel = d if _packs_summand(codec) else packet // width
        by_bytes["allreduce"] = allreduce_wire_bytes(numel * width, n)
    best = min(by_bytes, key=lambda k: (by_bytes[k], k != "allreduce"))
    two = 2 * (n - 1) * sizer.slices(d, n, dtype) / n
    return best, by_bytes, two


def choose(codec: Compressor, sizer: Sizer, specs: Sequence[tuple[Sequence[int], torch.dtype]], n: int,
           bucket_bytes: int, twophase: bool = True) -> list[str]:
    """The ``auto`` transport of each tensor (``(shape, dtype)``, in exchange order), per
    bucket (module docstring); ``twophase=False``: each tensor's exact collective."""
    if n == 1:
        return ["allreduce" if codec.sum_dtype(n, dt) is not None else "allgather" for _, dt in specs]
    costs = [_costs(codec, sizer, math.prod(shape), dtype, n) for shape, dtype in specs]
    plan = [best for best, _, _ in costs]
    if not twophase or any(sums_as_packet(codec, n, dtype) for _, dtype in specs):
        return plan
    messages = {"allreduce": 2 * (n - 1), "allgather": n - 1}
    buckets, current, filled = [], [], 0
    for i, (shape, dtype) in enumerate(specs):
        packet = sizer(math.prod(shape), dtype)
        if current and filled + packet > bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += packet
    if current:
        buckets.append(current)
    for members in buckets:
        kinds = {plan[i] for i in members}
        exact = (sum(costs[i][1][plan[i]] for i in members) / LINK_BYTES_PER_S
                 + sum(messages[k] for k in kinds) * MESSAGE_LATENCY_S)
        two = sum(costs[i][2] for i in members) / LINK_BYTES_PER_S + 2 * (n - 1) * MESSAGE_LATENCY_S
        if two <= exact / 2:
            for i in members:
                plan[i] = "twophase"
    return plan


class ServerErrors:
    """``E_j`` per ``(tensor key, slice j)`` held by this worker (module docstring)."""

    def __init__(self):
        self.errors: dict[tuple[int, int], torch.Tensor] = {}

    def state_dict(self) -> dict:
        return {f"{key}:{j}": e.clone() for (key, j), e in sorted(self.errors.items())}

    def load_state_dict(self, state: dict) -> None:
        errors = {}
        for name, e in state.items():
            key, _, j = str(name).partition(":")
            errors[(int(key), int(j))] = e.clone()
        self.errors = errors

    def reset(self) -> None:
        self.errors = {}
