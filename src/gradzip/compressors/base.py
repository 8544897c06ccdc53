"""The codec protocol: ``compress(tensor) -> Packet``, ``decompress(packet) -> tensor``.

A codec is stateless (docs/algorithms.md, "Codecs"): error memory belongs to the methods, so the
same codec object can serve every tensor, worker and step. Randomness comes from an
explicit ``seed`` argument, never from global RNG state, so runs are reproducible and
resumable. Codecs whose random choices must agree on every worker (random-k, random
block) set ``shared_randomness = True``; :mod:`gradzip.exchange` then passes the same seed
on every worker for the same step and tensor, and a rank-specific seed otherwise.

A :class:`Packet` holds the real wire representation (``wire``: the tensors that would
cross the network, e.g. bit-packed ``uint8`` codes, sparse indices) and ``meta``: what every
receiver knows or re-derives without it being sent (shape, dtype, shared indices).
``packet.nbytes`` counts only ``wire``.

Two ways to aggregate packets from ``n`` workers (chosen by :mod:`gradzip.exchange` from
the wire sizes):

* allgather: every worker gets every packet, then ``aggregate(packets)`` (default: the
  mean of the decoded tensors; ``sign`` overrides it with a majority vote);
* allreduce: where packets sum in compressed form, ``summand(packet, n)`` is a flat tensor
  of dtype ``sum_dtype(n)``; after the collective sum, ``from_sum(total, packet, n)``
  returns the same aggregate.

Many slices at once (the two-phase transport, :mod:`gradzip.twophase`): :meth:`Compressor.compress_slices`
compresses many slices ``x[a:b]`` of one flat tensor, each with its own seed, into one
:class:`Slices` (every packet's raw wire bytes back to back), :meth:`Compressor.aggregate_slices`
and :meth:`Compressor.decode_slices` read such buffers back. Each slice is still its own
packet (its own scale, its own seed): the bytes and values are those of one call per slice,
which is what the defaults do; ``sign``, ``scaled_sign`` and ``2bit`` override them with
kernels that do all slices in one call (float32 on the CPU).

Memory rules every codec keeps: ``compress`` never modifies its input, and its wire
tensors do not share memory with it, except for ``none``, whose wire is the input itself
(no copy): do not modify a tensor in place while its ``none`` packet is still needed.
``summand`` always returns a new tensor, so a collective may sum into it in place.
``decompress`` may return a view of the packet's wire (``none`` returns the input, the
casts return the wire when the dtype is unchanged): treat it as read-only. Spec parameters named after a Python keyword (``randblock:in=4``) are
dataclass fields with a trailing underscore (``in_``).
"""
from __future__ import annotations

import dataclasses
import keyword
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch



@dataclass
class Packet:
    """One compressed tensor: ``wire`` is what crosses the network, ``meta`` is not sent."""

    wire: dict[str, torch.Tensor]
    shape: torch.Size
    dtype: torch.dtype
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes that would cross the wire for this packet (wire tensors only)."""
        return sum(t.numel() * t.element_size() for t in self.wire.values())

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def like(self, wire: dict[str, torch.Tensor]) -> "Packet":
        """A packet with another worker's wire tensors and this packet's (shared) metadata."""
        return Packet(wire=wire, shape=self.shape, dtype=self.dtype, meta=self.meta)

    def raw(self) -> list[torch.Tensor]:
        """The wire tensors as flat uint8 views (a copy only where one is not contiguous), in
        ``wire`` order: what an exchange sends, back to back."""
        return [w.contiguous().reshape(-1).view(torch.uint8) for w in self.wire.values()]

    def from_raw(self, raw: torch.Tensor) -> "Packet":
        """Another worker's packet from its raw bytes (:meth:`raw`, concatenated), laid out
        like this one: its wire tensors are views of ``raw`` (read-only for the codec), a copy
        only where the offset is not a multiple of the dtype's size (a dtype view needs that
        alignment); this packet's metadata."""
        wire, offset = {}, 0
        for name, t in self.wire.items():
            nbytes = t.numel() * t.element_size()
            piece = raw[offset:offset + nbytes]
            if piece.storage_offset() % t.element_size():
                piece = piece.clone()
            wire[name] = piece.view(t.dtype).view(t.shape)
            offset += nbytes
        return self.like(wire)


@dataclass
class Slices:
    """The packets of many slices (:meth:`Compressor.compress_slices`): ``wire`` holds each
    packet's raw wire bytes (:meth:`Packet.raw`) back to back, ``nbytes`` their sizes;
    ``packets``: the per-slice packets where the codec made them one by one (the default),
    None where a fused override wrote ``wire`` directly. A receiver passes ``packets`` back
    as the ``templates`` of :meth:`Compressor.aggregate_slices` / :meth:`Compressor.decode_slices`
    (the layout of other workers' packets of the same slices)."""

    wire: torch.Tensor
    nbytes: list[int]
    packets: list[Packet] | None = None


def deliver(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``decompress``'s ending: ``result`` itself, or copied into the caller's ``out``."""
    if out is None:
        return result
    if out.shape != result.shape or out.dtype != result.dtype:
        raise ValueError(f"decompress(out=...) needs a {result.dtype} tensor of shape "
                         f"{tuple(result.shape)}, got {out.dtype} {tuple(out.shape)}")
    return out.copy_(result)


def keep_count(ratio: float, numel: int) -> int:
    """``k = max(1, ceil(ratio * d))`` in float64 (float32 rounds differently; docs/algorithms.md
    §Layer-wise compression and k)."""
    return max(1, math.ceil(float(ratio) * numel))


def index_dtype(numel: int) -> torch.dtype:
    """The wire dtype of indices into a flat tensor of ``numel`` entries: the narrowest that
    holds ``numel − 1``: ``uint8`` up to 256 entries, ``uint16`` up to 65536, ``int32`` above
    (the sparse codecs' wire, docs/algorithms.md §codec: topk). Decided by the shape alone,
    so a receiver lays out another worker's packet from its own."""
    return torch.uint8 if numel <= 1 << 8 else torch.uint16 if numel <= 1 << 16 else torch.int32


def wire_indices(packet: "Packet") -> torch.Tensor:
    """A sparse packet's ``indices`` as int32 (what index ops and the kernels take): the wire
    tensor itself where it is int32, a widened copy of a narrow one."""
    return packet.wire["indices"].to(torch.int32)


@dataclass(frozen=True)
class Compressor:
    """Base class of every codec. Subclasses are frozen dataclasses: their fields are the
    spec-string parameters (``topk:ratio=0.01``), validated in ``__post_init__``."""

    name: ClassVar[str] = ""
    #: Random choices must be identical on every worker (same step, same tensor).
    shared_randomness: ClassVar[bool] = False
    #: ``E[C(v)] = v``: error feedback would only add the codec's variance to the next step,
    #: so the DDP hook leaves it off by default and refuses it. ``randomk`` makes it a field.
    unbiased: ClassVar[bool] = False
    #: A NaN/Inf anywhere in any worker's tensor makes the aggregate non-finite (``none``,
    #: ``fp16``, ``bf16``): PSync's aggregate check then also guards the inputs.
    propagates_nonfinite: ClassVar[bool] = False

    # -- the codec -------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        """``C(tensor)`` as a :class:`Packet`. ``reuse``: a packet this codec made earlier from
        a tensor of the same shape and dtype, whose wire tensors the caller no longer needs;
        a codec may write the new wire into its buffers (the returned packet then holds
        them) instead of allocating. Codecs without a fused path ignore it."""
        raise NotImplementedError

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        """The decoded tensor (shape and dtype of the compressed one). With ``out`` (a
        tensor of that shape and dtype, not sharing memory with the packet), the result is
        written into ``out`` and ``out`` is returned: a caller decoding every step into the
        same buffer pays no allocation (a fresh 64 MB tensor costs page faults worth a
        tenth of a copy)."""
        raise NotImplementedError

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        """``C(tensor)``, and ``tensor − decompress(C(tensor))`` written into ``out`` (the
        error-feedback residual; ``out`` has ``tensor``'s shape and dtype and does not
        overlap it). The same packet and the same residual bits as the two calls; fused
        codecs do it in one pass over memory. ``reuse``: as for :meth:`compress`."""
        packet = self.compress(tensor, seed, reuse)
        torch.sub(tensor, self.decompress(packet), out=out)
        return packet

    # -- many slices (the two-phase transport) ------------------------------------------
    def compress_slices(self, x: torch.Tensor, bounds: Sequence[tuple[int, int]], seeds: Sequence[int],
                        residual: torch.Tensor | None = None) -> Slices:
        """``compress(x[a:b], seed)`` for every ``(a, b)`` of ``bounds`` (non-empty slices of the
        flat tensor ``x``, any order) with its seed, as one :class:`Slices`; with ``residual``
        (``x``'s shape and dtype, not overlapping it), ``x[a:b] − dec`` into ``residual[a:b]``
        (:meth:`compress_residual`). The same bytes and residual bits as one call per slice,
        which is what this default does."""
        packets = [self.compress(x[a:b], seed) if residual is None
                   else self.compress_residual(x[a:b], seed, residual[a:b])
                   for (a, b), seed in zip(bounds, seeds)]
        raw = [w for p in packets for w in p.raw()]
        wire = torch.cat(raw) if raw else torch.empty(0, dtype=torch.uint8, device=x.device)
        return Slices(wire, [p.nbytes for p in packets], packets)

    def aggregate_slices(self, wires: Sequence[torch.Tensor], bounds: Sequence[tuple[int, int]],
                         out: torch.Tensor, templates: Sequence[Packet] | None) -> None:
        """For each slice m: :meth:`aggregate` of the workers' packets of it (``wires[i]``:
        worker i's :class:`Slices` wire of these slices, in rank order) into
        ``out[a_m:b_m]``. ``templates``: this worker's ``Slices.packets`` of the same slices
        (None from a fused override, which knows its layout from the lengths)."""
        offset = 0
        for (a, b), template in zip(bounds, self._templates(templates, bounds, out)):
            size = template.nbytes
            out[a:b].copy_(self.aggregate([template.from_raw(w[offset:offset + size]) for w in wires]).reshape(-1))
            offset += size

    def decode_slices(self, wire: torch.Tensor, bounds: Sequence[tuple[int, int]], out: torch.Tensor,
                      templates: Sequence[Packet] | None) -> None:
        """:meth:`decompress` of each packet of ``wire`` (a :class:`Slices` wire of these
        slices) into ``out[a_m:b_m]``; ``templates`` as for :meth:`aggregate_slices`."""
        offset = 0
        for (a, b), template in zip(bounds, self._templates(templates, bounds, out)):
            size = template.nbytes
            self.decompress(template.from_raw(wire[offset:offset + size]), out=out[a:b])
            offset += size

    def _templates(self, templates, bounds, out: torch.Tensor) -> Sequence[Packet]:
        if templates is not None:
            return templates
        # a fused codec's Slices carry no packets: its layout from zero slices of these sizes
        return [self.compress(torch.zeros(b - a, dtype=out.dtype, device=out.device)) for a, b in bounds]

    # -- aggregation -----------------------------------------------------------------
    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        """The aggregate of all workers' packets (rank order): the mean of the decoded."""
        total = self.decompress(packets[0]).clone()
        for p in packets[1:]:
            total.add_(self.decompress(p))
        return total.div_(len(packets))

    def sum_dtype(self, world_size: int, dtype: torch.dtype = torch.float32) -> torch.dtype | None:
        """dtype in which packets of ``world_size`` workers sum in compressed form (the dtype
        of :meth:`summand`), or None if they do not. ``dtype`` is the compressed tensors'
        dtype; only codecs that send the tensor as it is (``none``) depend on it."""
        return None

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        """Flat tensor this worker contributes to an allreduce-sum. A new tensor, except where
        the codec says otherwise (``none``: the wire itself, read-only, which may be the
        caller's gradient): a caller that sums into it in place copies it first, as PSync does."""
        raise NotImplementedError(f"{self.name} packets do not sum")

    def summand_numel(self, packet: Packet, world_size: int) -> int | None:
        """Elements of :meth:`summand`, known without building it (PSync sizes the allreduce
        with it before choosing); None: PSync builds the summand to size it."""
        return None

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        """The aggregate (same as :meth:`aggregate`) from the allreduced ``summand`` sum;
        ``total`` is the caller's to consume: the aggregate may be computed in its memory."""
        raise NotImplementedError(f"{self.name} packets do not sum")

    # -- description -----------------------------------------------------------------
    def wire_nbytes(self, shape: Sequence[int]) -> int:
        """Expected wire bytes for a float32 tensor of this shape (docs/algorithms.md, the "Codecs" table)."""
        return self.compress(torch.zeros(tuple(shape))).nbytes

    @property
    def spec(self) -> str:
        """The spec string that builds this codec back (``build(c.spec) == c``)."""
        params = [
            f"{spec_key(f.name)}={_fmt(getattr(self, f.name))}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None  # None = "not given" (the other form)
        ]
        return self.name + (":" + ",".join(params) if params else "")

    def __str__(self) -> str:
        return self.spec


def spec_key(field_name: str) -> str:
    """The spec-string key of a field: ``in_`` -> ``in`` (keywords cannot be field names)."""
    base = field_name[:-1]
    return base if field_name.endswith("_") and keyword.iskeyword(base) else field_name


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
