"""The optional capabilities of a codec, each a small protocol beside the core every codec has
(``compress``, ``decompress``, ``compress_residual``, ``aggregate``: :mod:`.base`).

* :class:`Summing`: packets that sum in compressed form. ``sum_dtype(n, dtype)`` (asked of
  every codec: None where packets do not sum) is the dtype of ``summand(packet, n)``, the
  flat tensor a worker contributes to an allreduce; after the collective sum,
  ``from_sum(total, packet, n)`` returns the same aggregate as ``aggregate``. The exchange
  picks this route where it puts fewer bytes on the wire (docs/algorithms.md §Transports).
* :class:`Slicing`: many slices of one flat tensor at once (the two-phase transport,
  :mod:`gradzip.exchange.twophase`): :meth:`Slicing.compress_slices` compresses many slices ``x[a:b]``,
  each with its own seed, into one :class:`Slices` (every packet's raw wire bytes back to
  back); :meth:`Slicing.aggregate_slices` and :meth:`Slicing.decode_slices` read such buffers
  back. Each slice is still its own packet (its own scale, its own seed): the bytes and
  values are those of one call per slice, which is what the defaults here do, so every
  codec has the capability; ``sign``, ``scaled_sign`` and ``2bit`` override them with
  kernels that do all slices in one call (float32 on the CPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

# ``Packet`` in the annotations is gradzip.compressors.base.Packet (base imports this module).


@dataclass
class Slices:
    """The packets of many slices (:meth:`Slicing.compress_slices`): ``wire`` holds each
    packet's raw wire bytes (:meth:`Packet.raw`) back to back, ``nbytes`` their sizes;
    ``packets``: the per-slice packets where the codec made them one by one (the default),
    None where a fused override wrote ``wire`` directly. A receiver passes ``packets`` back
    as the ``templates`` of :meth:`Slicing.aggregate_slices` / :meth:`Slicing.decode_slices`
    (the layout of other workers' packets of the same slices)."""

    wire: torch.Tensor
    nbytes: list[int]
    packets: list[Packet] | None = None



class Slicing:
    """The two-phase capability (module docstring): by default one call per slice."""

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



class Summing:
    """The allreduce capability (module docstring): a codec whose packets sum in compressed
    form has this protocol and a ``sum_dtype`` that is not None."""

    def summand(self, packet: Packet, world_size: int) -> torch.Tensor:
        """Flat tensor this worker contributes to an allreduce-sum. A new tensor, except where
        the codec says otherwise (``none``: the wire itself, read-only, which may be the
        caller's gradient): a caller that sums into it in place copies it first, as PSync does."""
        raise NotImplementedError

    def summand_numel(self, packet: Packet, world_size: int) -> int | None:
        """Elements of :meth:`summand`, known without building it (PSync sizes the allreduce
        with it before choosing); None: PSync builds the summand to size it."""
        return None

    def from_sum(self, total: torch.Tensor, packet: Packet, world_size: int) -> torch.Tensor:
        """The aggregate (the same as the codec's ``aggregate``) from the allreduced ``summand`` sum;
        ``total`` is the caller's to consume: the aggregate may be computed in its memory."""
        raise NotImplementedError

    def from_sums(self, total: torch.Tensor, packets: list[Packet], sizes: list[int],
                  world_size: int) -> list[torch.Tensor]:
        """:meth:`from_sum` of each of several packets whose summands were sent back to back
        in ``total`` (``sizes``: their flat lengths), the same values; a codec may do it in
        fewer calls (``none``: one division of the whole bucket)."""
        return [self.from_sum(part, packet, world_size) for part, packet in zip(total.split(sizes), packets)]

    def from_sums_checked(self, total: torch.Tensor, packets: list[Packet], sizes: list[int],
                          world_size: int) -> tuple[list[torch.Tensor], bool | None]:
        """:meth:`from_sums`, and whether every aggregate is finite where the codec learns it
        on the way (``none``: in the division's own pass); None: not known, the caller checks."""
        return self.from_sums(total, packets, sizes, world_size), None
