"""The codec protocol (docs/algorithms.md, "Codecs"): the core every codec has, and where its
kernels come from.

The core: ``compress(tensor, seed) -> Packet``, ``decompress(packet) -> tensor``,
``compress_residual`` (the error-feedback form of ``compress``) and ``aggregate(packets)``
(the allgather route: every worker gets every packet; default: the mean of the decoded
tensors, ``sign`` overrides it with a majority vote). Optional capabilities are small
protocols of their own (:mod:`gradzip.compressors.capabilities`): packets that sum in
compressed form (``Summing``; ``sum_dtype`` is the question every codec answers, None: it
does not) and many slices at once for the two-phase transport (``Slicing``, with a default
of one call per slice that every codec inherits).

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

Kernels: a codec with fused kernels lists its implementations by backend
(``implementations``: ``torch``, the reference, and ``numba`` / ``triton``), and
:meth:`Compressor.impl` gives the one for a device, chosen once per codec instance, device
and kernel mode (:func:`gradzip.kernels.backend`) and kept on the instance: the codec's
methods call it and test nothing per call.

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
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch

from .. import kernels
from ..validation import require
from .capabilities import Slices, Slicing  # noqa: F401  (Slices: re-exported)


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


class Operations(Slicing):
    """The core operations of a codec (module docstring), with the defaults every codec and
    every implementation of one (:class:`Implementation`) share; and the two-phase
    :class:`~gradzip.compressors.capabilities.Slicing` defaults."""

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

    # -- aggregation -----------------------------------------------------------------
    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        """The aggregate of all workers' packets (rank order): the mean of the decoded."""
        total = self.decompress(packets[0]).clone()
        for p in packets[1:]:
            total.add_(self.decompress(p))
        return total.div_(len(packets))



@dataclass(frozen=True)
class Compressor(Operations):
    """Base class of every codec. Subclasses are frozen dataclasses: their fields are the
    spec-string parameters (``topk:ratio=0.01``), validated in ``__post_init__``."""

    name: ClassVar[str] = ""
    #: Random choices must be identical on every worker (same step, same tensor).
    shared_randomness: ClassVar[bool] = False
    #: ``compress`` reads its seed (random choices). False (``none``, ``fp16``, ``bf16``): the
    #: result is the same for every seed, and PSync passes 0 instead of deriving one per tensor.
    uses_seed: ClassVar[bool] = True
    #: The packet's wire is the input itself and its summand the input, flat (``none``): PSync
    #: sends a run of such members as they are, in one pass (no seed, spare or residual).
    sends_input: ClassVar[bool] = False
    #: ``E[C(v)] = v``: error feedback would only add the codec's variance to the next step,
    #: so the DDP hook leaves it off by default and refuses it. ``randomk`` makes it a field.
    unbiased: ClassVar[bool] = False
    #: A NaN/Inf anywhere in any worker's tensor makes the aggregate non-finite (``none``,
    #: ``fp16``, ``bf16``): PSync's aggregate check then also guards the inputs.
    propagates_nonfinite: ClassVar[bool] = False
    #: ``decompress(compress(v)) == v`` for every finite ``v`` (``none``): the residual
    #: ``v − C(v)`` is zero, which PSync may return as None (``PSync.omit_zero_residuals``).
    lossless: ClassVar[bool] = False
    #: The codec's implementations by backend (:data:`gradzip.kernels.BACKENDS`): each a class
    #: built with the codec; ``torch`` (the reference) serves a backend the codec lacks.
    implementations: ClassVar[Mapping[str, Callable[["Compressor"], Any]]] = {}

    def impl(self, device: torch.device) -> Any:
        """This codec's implementation for tensors on ``device``: resolved once per kernel mode
        and device (:func:`gradzip.kernels.backend`) and kept on the instance."""
        key = (kernels.mode(), kernels.interpreted(), device)
        chosen = self.__dict__.get("_impls")
        if chosen is None:
            chosen = {}
            object.__setattr__(self, "_impls", chosen)   # a cache, not a field: frozen, equal, hashable as before
        found = chosen.get(key)
        if found is None:
            table = self.implementations
            found = chosen[key] = table.get(kernels.backend(device), table["torch"])(self)
        return found

    def __getstate__(self) -> dict:
        """The instance's fields, without the implementations it resolved (a copy resolves its own)."""
        return {k: v for k, v in self.__dict__.items() if k != "_impls"}

    def sum_dtype(self, world_size: int, dtype: torch.dtype = torch.float32) -> torch.dtype | None:
        """dtype in which packets of ``world_size`` workers sum in compressed form (the dtype
        of ``summand``), or None if they do not: the question every codec answers; a codec
        that sums has the :class:`~gradzip.compressors.capabilities.Summing` capability.
        ``dtype`` is the compressed tensors' dtype; only codecs that send the tensor as it
        is (``none``) depend on it."""
        return None

    # -- description -----------------------------------------------------------------
    def wire_nbytes(self, shape: Sequence[int]) -> int:
        """Expected wire bytes for a float32 tensor of this shape (docs/algorithms.md, the "Codecs" table)."""
        return self.compress(torch.zeros(tuple(shape))).nbytes

    @property
    def error_feedback_by_default(self) -> bool:
        """Whether a method keeps error memory for this codec unless told otherwise: on for a
        biased codec (its error is carried into the next step), off for an unbiased one
        (:attr:`unbiased`: the memory would only add its variance) and for ``none`` (its
        residual is zero). The one rule of every method, hook and integration."""
        return not self.unbiased and self.name != "none"

    def refuse_error_feedback(self, on: bool, where: str) -> None:
        """Raise :class:`GradzipError` (``"<where>: ..."``) if error feedback is ``on`` with an
        unbiased codec: its memory carries the codec's variance into the next step and grows."""
        require(not (on and self.unbiased), where,
                f"error feedback with the unbiased codec {self.spec!r} accumulates its variance and "
                "diverges; leave error_feedback unset (off for unbiased codecs)")

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


class Implementation(Operations):
    """A codec's operations on one backend (``Compressor.implementations``), built with the
    codec (``self.codec``, whose fields it reads). The reference implementation states the
    codec in torch code; a kernel backend's subclasses it, overriding what its kernels do
    and leaving the rest (dtypes or layouts its kernels do not take) to the reference."""

    #: Modules of Triton kernels this implementation calls (``gradzip.kernels.triton.<name>``),
    #: imported (with triton) when it is built and kept as attributes of the same name.
    kernel_modules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, codec: "Compressor"):
        self.codec = codec
        for name in self.kernel_modules:
            setattr(self, name, kernels.triton_module(name))


def device_of(packet: Packet) -> torch.device:
    """Where a packet's wire lives (a packet without wire tensors: ``meta["device"]``, else CPU)."""
    for t in packet.wire.values():
        return t.device
    return packet.meta.get("device", torch.device("cpu"))


class OnImplementation:
    """Mixin of a :class:`Compressor` whose core and slicing operations run on its
    implementation for the tensors' device (:meth:`Compressor.impl`), chosen once per
    instance and device: the codec's methods test nothing per call."""

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        return self.impl(tensor.device).compress(tensor, seed, reuse)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        return self.impl(tensor.device).compress_residual(tensor, seed, out, reuse)

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.impl(device_of(packet)).decompress(packet, out)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        return self.impl(device_of(packets[0])).aggregate(packets)

    def compress_slices(self, x, bounds, seeds, residual=None) -> Slices:
        return self.impl(x.device).compress_slices(x, bounds, seeds, residual)

    def aggregate_slices(self, wires, bounds, out, templates) -> None:
        self.impl(out.device).aggregate_slices(wires, bounds, out, templates)

    def decode_slices(self, wire, bounds, out, templates) -> None:
        self.impl(out.device).decode_slices(wire, bounds, out, templates)


class SumsOnImplementation(OnImplementation):
    """:class:`OnImplementation` for a codec with the ``Summing`` capability: its summand
    and aggregate from the sum run on the implementation too."""

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        return self.impl(device_of(packet)).summand(packet, world_size)

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        return self.impl(total.device).from_sum(total, packet, world_size)
