"""The two-phase compressed allreduce, PSync's transport whose bytes stay flat in n
(docs/algorithms.md §Transports of PSync, "Two-phase compressed allreduce").

Per bucket of the plan (:mod:`gradzip.exchange.planner`), its tensors flattened and concatenated in
the plan's order into ``v`` of ``d`` elements, slices ``S_0 … S_{n−1}`` of
``torch.tensor_split(arange(d), n)`` (the first ``d mod n`` one element longer; empty
when ``d < n``, and an empty slice is neither compressed nor sent)::

    worker i, phase 1:  c_ij = C(v_i[S_j]) for every j;   r_i = v_i − concat_j dec(c_ij)
                        send c_ij to worker j                                 # all-to-all
    worker j, phase 2:  s_j = aggregate_i dec(c_ij) + E_j    # the codec's aggregate (mean, majority vote)
                        ĉ_j = C(s_j);  E_j ← s_j − dec(ĉ_j)   # server error, starts at 0
                        send ĉ_j to every worker                              # "allgather"
    every worker:       aggregate = concat_j dec(ĉ_j);  residual r_i

So a bucket sends ``n`` slices however many tensors it holds (as DeepSpeed's
``compressed_allreduce`` slices its flat buffer): a ``1bit`` scale or a ``topk`` count is
per slice of a bucket, and the bucket's composition (the plan's, agreed by every worker)
is part of the numbers. Both rounds are :meth:`Group.all_to_all` calls (phase 2 sends the
same message to every peer, what an allgather of unequal sizes sends); a receiver sizes
what it gets from its own packet of the same slice (same length, same codec), so no sizes
travel. Each stage is one codec call over the bucket's slices
(:meth:`~gradzip.compressors.Compressor.compress_slices`). Bytes per worker:
``Σ_{j≠i} |c_ij| + (n−1)·|ĉ_i|`` ≈ 2(n−1)/n × packet (:meth:`gradzip.exchange.planner.Bucket.bytes_for`).
With ``round_bytes`` each all-to-all is sent in rounds of at most that many bytes per
message (:func:`rounds`): the same bytes and numbers, more calls; on links that several
exchanges share (the exchanges of a node's workers behind its uplink) whole messages left
the link idle a third of the time (docs/benchmarks/transports-and-nodes.md, "Two-phase
across nodes: what the uplink runs say").

Seeds (the bucket's key: its first tensor's key): phase 1 slice ``j`` uses
``mix(seed of (step, key) as for the exact transports, j)``, the second compression of
slice ``j`` (done by worker ``j`` alone) ``mix(seed, step, key, j)``. A one-tensor bucket is
therefore exactly the per-tensor rule of earlier versions.

The server error ``E_j`` is exchange state, keyed ``(bucket key, slice j)``: stable across
resume (:meth:`ServerErrors.state_dict`) since the plan is. An exchange updates it only
once its aggregate passed the overflow check, so a skipped step leaves it as it was. When
the parameters taking part change (a layer frozen or unfrozen, :mod:`gradzip.optim.core.participation`),
the buckets and their slices change with them: every ``E_j`` starts from zero again (one
that does not fit its slice is never added).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .. import seeds
from ..comm import Group, Work
from ..compressors import Compressor, Slices
from ..errors import GradzipError
from .planner import slice_bounds
from ..validation import is_int


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


def phase1_seed(base: int, j: int) -> int:
    return seeds.mix(base, j)


def phase2_seed(seed: int, step: int, key: int, j: int) -> int:
    return seeds.mix(seed, step, key, j)


class ServerErrors:
    """``E_j`` per ``(bucket key, slice j)`` held by this worker (module docstring)."""

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


@dataclass
class TwoPhase:
    """One two-phase bucket in flight (module docstring): phase 1 launched by :meth:`start`,
    phase 2 and the decode by :meth:`finish`."""

    codec: Compressor
    comm: Group
    key: int                       # the bucket's key (its first tensor's)
    step: int
    bounds: list[tuple[int, int]]  # the n slices of the bucket's elements
    dtype: torch.dtype
    device: torch.device
    round_bytes: int | None
    sent: Slices                   # phase 1's packets, the non-empty slices in order
    sizes: list[int]               # bytes of phase 1's message to each peer (0: empty slice)
    work: Work

    @classmethod
    def start(cls, codec: Compressor, comm: Group, x: torch.Tensor, key: int, step: int, base_seed: int,
              residual: torch.Tensor | None, round_bytes: int | None) -> "TwoPhase":
        """Phase 1 on the flat bucket ``x``: compress every slice (its residual into
        ``residual``, when given) and launch the all-to-all."""
        n = comm.world_size
        bounds = slice_bounds(x.numel(), n)
        full = [j for j, (a, b) in enumerate(bounds) if b > a]
        sent = codec.compress_slices(x, [bounds[j] for j in full], [phase1_seed(base_seed, j) for j in full], residual)
        sizes = [0] * n
        for j, nbytes in zip(full, sent.nbytes):
            sizes[j] = nbytes
        work = comm.all_to_all(list(torch.split(sent.wire, sizes)), [sizes[comm.rank]] * n, async_op=True,
                               rounds=rounds(sizes, sent.wire, round_bytes))
        return cls(codec, comm, key, step, bounds, x.dtype, x.device, round_bytes, sent, sizes, work)

    def _template(self, j: int):
        """This worker's own packet of slice ``j`` (the layout of every worker's packet of
        it), None from a fused codec."""
        if self.sent.packets is None:
            return None
        return [self.sent.packets[sum(1 for a, b in self.bounds[:j] if b > a)]]

    def finish(self, server_error: torch.Tensor | None, seed: int, waited: Callable[[float, float], None],
               coded: Callable[[float], None]) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Phase 2: aggregate this worker's slice, add ``server_error``, compress again
        (``seed``), send it to every peer; then decode every slice. Returns the flat
        aggregate, the new server error of this worker's slice (None when it is empty) and
        the bytes both rounds sent. ``waited(began, ended)`` / ``coded(seconds)`` count time."""
        codec, comm = self.codec, self.comm
        n, rank = comm.world_size, comm.rank
        began = time.perf_counter()
        received = self.work.wait()
        decoding = time.perf_counter()
        waited(began, decoding)
        a, b = self.bounds[rank]
        s = torch.empty(b - a, dtype=self.dtype, device=self.device)
        error = None
        if b > a:
            codec.aggregate_slices(received, [(0, b - a)], s, self._template(rank))
            if server_error is not None and server_error.numel() == b - a:   # else another bucket's since
                s.add_(server_error)
            error = torch.empty_like(s)
            back = codec.compress_slices(s, [(0, b - a)], [seed], error)
        else:
            back = Slices(torch.empty(0, dtype=torch.uint8, device=self.device), [])
        compressed = time.perf_counter()
        coded(compressed - decoding)
        work = comm.all_to_all([back.wire] * n, self.sizes, async_op=True,
                               rounds=rounds(self.sizes, back.wire, self.round_bytes))
        gathered = work.wait()
        decoding = time.perf_counter()
        waited(compressed, decoding)
        flat = torch.empty(self.bounds[-1][1], dtype=self.dtype, device=self.device)
        for j, (a, b) in enumerate(self.bounds):
            if b > a:
                codec.decode_slices(gathered[j], [(a, b)], flat, self._template(j))
        coded(time.perf_counter() - decoding)
        return flat, error, self.work.nbytes + work.nbytes
