"""Small vectorized kernels shared by the codecs (not part of the public surface)."""
from __future__ import annotations

import functools
import math
from typing import ClassVar, Sequence

import numpy as np
import torch

from .. import kernels
from .base import Packet, Slices
from .bitpack import pack_bits, packed_nbytes, unpack_bits

#: Elements per piece when a CPU codec encodes a large tensor piece by piece (a multiple
#: of 8, so every piece packs to whole bytes): the temporaries of one piece stay in cache
#: instead of making several trips through memory.
CHUNK = 1 << 18
#: Piece by piece or not: None = only on the CPU with one torch thread (what torchrun
#: gives each of several local workers). With several threads every small op is a
#: parallel region, and an oversubscribed machine stalls each one, so whole-tensor ops
#: (a few large parallel regions) are the safer choice there; GPUs never split.
PIECEWISE: bool | None = None


def piecewise(tensor: torch.Tensor) -> bool:
    """Whether to process ``tensor`` in pieces of :data:`CHUNK` entries (see above)."""
    if tensor.device.type != "cpu":
        return False
    return torch.get_num_threads() == 1 if PIECEWISE is None else PIECEWISE


def generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator on ``device`` seeded with ``seed`` (any Python int)."""
    return torch.Generator(device=device).manual_seed(int(seed) % (1 << 64))


def shared_generator(seed: int) -> torch.Generator:
    """The generator for choices every worker must repeat (random-k indices, block
    offsets): always on the CPU, so workers on different devices draw the same numbers."""
    return generator(seed, "cpu")


def as_float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` flattened, in float32 (no copy when it already is; never modified)."""
    return tensor.reshape(-1).to(torch.float32)


def encode_chunks(flat: torch.Tensor, bits: int, codes_of, chunk: int | None = None) -> torch.Tensor:
    """``pack_bits(codes_of(flat), bits)``, computed piece by piece on the CPU (same bytes).
    ``codes_of`` maps a flat slice to its uint8 codes, in order; ``chunk`` (default
    :data:`CHUNK`) must be a multiple of 8. Unless :func:`piecewise`, one call does all."""
    chunk = chunk or CHUNK
    numel = flat.numel()
    if numel <= chunk or not piecewise(flat):
        return pack_bits(codes_of(flat), bits)
    out = torch.empty(packed_nbytes(numel, bits), dtype=torch.uint8)
    step = chunk * bits // 8
    for i, start in enumerate(range(0, numel, chunk)):
        piece = pack_bits(codes_of(flat[start : start + chunk]), bits)
        out[i * step : i * step + piece.numel()] = piece
    return out


def decode_chunks(packed: torch.Tensor, bits: int, count: int, dtype: torch.dtype, fill) -> torch.Tensor:
    """A flat ``dtype`` tensor of ``count`` entries: ``fill(codes, out)`` writes the values of
    unpacked ``codes`` into ``out``, piece by piece on the CPU (see :func:`encode_chunks`)."""
    out = torch.empty(count, dtype=dtype, device=packed.device)
    chunk = CHUNK if piecewise(packed) else count
    step = chunk * bits // 8
    for i, start in enumerate(range(0, count, max(chunk, 1))):
        size = min(chunk, count - start)
        fill(unpack_bits(packed[i * step : i * step + packed_nbytes(size, bits)], bits, size), out[start : start + size])
    return out


#: Input dtypes the fused elementwise kernels encode (compare and subtract in); other
#: dtypes (16-bit floats) take the torch reference path, decoding is fused for every float.
FUSED_DTYPES = (torch.float32, torch.float64)


def flat_input(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, contiguous (a copy only when it is not) and flat: a kernel's input."""
    return tensor.detach().contiguous().reshape(-1)


def wire_buffer(reuse: Packet | None, name: str, numel: int, dtype: torch.dtype = torch.uint8,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``name`` wire tensor of the ``reuse`` packet when it fits (:func:`kernels.reused`),
    else a new one on ``device``."""
    return kernels.reused(None if reuse is None else reuse.wire.get(name), numel, dtype, device)


def value_table(values: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """The decoded value of each code, in ``dtype``: what :func:`decode_lut`'s table holds."""
    return torch.tensor(tuple(values), dtype=dtype)


def fused_counts(packets: Sequence[Packet], wire: str, values: Sequence, decode, accumulate) -> torch.Tensor:
    """``Σ_j values[code_j]`` per entry over the packets (their ``wire`` codes), as a float32
    tensor of their shape, counted in that output itself by the fused ``decode`` of the first
    packet and ``accumulate`` of the others (exact while the counts stay below 2**24): the
    first half of the sign and 2bit fused aggregates."""
    out = torch.empty(packets[0].shape, dtype=torch.float32)
    flat = kernels.array(out.view(-1))
    table = kernels.array(value_table(values, torch.float32))
    decode(kernels.array(packets[0].wire[wire].contiguous()), table, flat)
    for p in packets[1:]:
        accumulate(kernels.array(p.wire[wire].contiguous()), table, flat)
    return out


def fused_slices(values: Sequence[torch.Tensor | None], wires: Sequence[torch.Tensor] = ()) -> bool:
    """Whether a numba implementation's ``*_slices`` kernels take these tensors
    (:meth:`~.capabilities.Slicing.compress_slices`): all contiguous, ``values`` float32
    (None: absent)."""
    values = [t for t in values if t is not None]
    return all(t.is_contiguous() for t in (*values, *wires)) and all(t.dtype == torch.float32 for t in values)


def laid_out(wire: torch.Tensor, offsets: np.ndarray) -> Slices:
    """A fused override's :class:`Slices`: packet m's bytes start at ``offsets[m]`` of
    ``wire`` and run to the next packet's start (the last to the end)."""
    return Slices(wire, np.diff(offsets, append=wire.numel()).tolist())


def rows(wires: Sequence[torch.Tensor]) -> torch.Tensor:
    """The workers' equally long wire buffers as the rows of one contiguous uint8 matrix."""
    return torch.stack(list(wires)) if len(wires) > 1 else wires[0].contiguous().view(1, -1)


@functools.lru_cache(maxsize=64)
def _lut(values: tuple, bits: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Table (256, 8 // bits): row ``byte`` = the values of the codes packed in ``byte``."""
    per = 8 // bits
    byte = torch.arange(256).unsqueeze(1)
    shifts = torch.arange(per - 1, -1, -1) * bits
    codes = (byte >> shifts) & ((1 << bits) - 1)
    return torch.tensor(values, dtype=dtype)[codes].to(device)


def decode_lut(packed: torch.Tensor, bits: int, values: tuple, count: int, dtype: torch.dtype) -> torch.Tensor:
    """Decode packed ``bits``-bit codes (1, 2 or 4 bits) straight to ``values[code]``:
    one table gather per byte instead of unpacking and mapping. Flat, ``count`` long."""
    table = _lut(tuple(values), bits, dtype, str(packed.device))
    return torch.index_select(table, 0, packed.to(torch.int32)).view(-1)[:count]


def scatter_mean(packets: Sequence[Packet], items, numel: int) -> torch.Tensor:
    """``(Σ_j scatter(values_j at indices_j)) / n`` in one dense buffer: ``items(p)`` gives a
    packet's (indices, values). Accumulates in float32 (or wider), returns the packets'
    dtype, shaped like them."""
    first = packets[0]
    acc = torch.promote_types(first.dtype, torch.float32)
    total = torch.zeros(numel, dtype=acc, device=items(first)[1].device)
    for p in packets:
        idx, val = items(p)
        total.index_add_(0, idx, val.to(acc))
    total.div_(len(packets))
    return total.to(first.dtype).view(first.shape)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """``(rows, cols)`` of the matrix view of a tensor, PyTorch's: ``shape[0]`` × the
    product of the rest; a 0-d tensor is 1 × 1, a vector of n entries n × 1, and a
    ``(0, k)`` tensor 0 × k (the 1-bit and PowerSGD codecs and the DDP hook share it)."""
    if len(shape) == 0:
        return 1, 1
    return int(shape[0]), math.prod(int(s) for s in shape[1:])


def magnitude_keys(values: torch.Tensor) -> torch.Tensor:
    """The magnitudes of a float tensor as integers that order as they do (its bits with the
    sign bit cleared: +0 lowest, +inf above every finite value, NaN above +inf): what the
    sparsifiers rank, exactly and alike on every device."""
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()]
    return values.view(as_int) & torch.iinfo(as_int).max


def largest(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The positions (ascending, int64) of the ``k`` largest entries of the integer tensor
    ``keys``, a tie going to the lower position (docs/algorithms.md §codec: topk): one answer
    on every device, where ``torch.topk``'s choice among ties and its order are its own."""
    if k >= keys.numel():
        return torch.arange(keys.numel(), device=keys.device)
    kth = torch.topk(keys, k, sorted=False).values.min()
    above = keys > kth
    ties = keys == kth
    keep = above | (ties & (torch.cumsum(ties, 0) <= k - above.sum()))
    return keep.nonzero().view(-1)


def above_threshold(flat: torch.Tensor, threshold) -> torch.Tensor:
    """Indices (ascending, int64) of the entries of a flat tensor with ``|x| >= threshold``
    (a number or a 0-d tensor): one pass, piece by piece where :func:`piecewise` (the
    temporaries stay in cache). The candidate scan of sampled top-k selections."""
    numel = flat.numel()
    piece = CHUNK if piecewise(flat) else max(numel, 1)
    idx = [torch.nonzero(torch.abs(flat[lo:lo + piece]) >= threshold).view(-1) + lo
           for lo in range(0, numel, piece)]
    return torch.cat(idx) if len(idx) > 1 else idx[0]


class EncodesResidual:
    """Mixin of an implementation whose ``_encode(tensor, seed, reuse, residual)`` writes the
    packet and, given ``residual`` (flat, contiguous float32 on the tensor's device), the
    error-feedback residual ``v − C(v)`` in the same pass: ``compress`` and
    ``compress_residual`` (float32 tensors; others take the reference's two calls) go
    through it, an ``out`` that is not contiguous through a buffer then copied."""

    def compress(self, tensor: torch.Tensor, seed: int = 0, reuse: Packet | None = None) -> Packet:
        return self._encode(tensor, seed, reuse, None)

    def compress_residual(self, tensor: torch.Tensor, seed: int, out: torch.Tensor,
                          reuse: Packet | None = None) -> Packet:
        if tensor.dtype != torch.float32:
            return super().compress_residual(tensor, seed, out, reuse)
        residual = kernels.decode_target(out, tensor.shape, torch.float32, tensor.device)
        packet = self._encode(tensor, seed, reuse, residual.view(-1))
        if residual is not out:
            out.copy_(residual)
        return packet

    def _encode(self, tensor: torch.Tensor, seed: int, reuse: Packet | None,
                residual: torch.Tensor | None) -> Packet:
        raise NotImplementedError


class MeanOfDecoded:
    """Mixin of a Triton implementation whose float32 packets decode through
    :func:`gradzip.kernels.triton.mean.mean` (``KIND``; the codes in wire ``WIRE``, each
    packet's scalar in wire ``SCALAR``; :meth:`mean_options` the rest): the decode, and the
    mean of n packets in one pass over them; other dtypes take the reference."""

    KIND: ClassVar[str]
    WIRE: ClassVar[str]
    SCALAR: ClassVar[str]

    def mean_options(self, packet: Packet) -> dict:
        return {}

    def decompress(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        if packet.dtype != torch.float32:
            return super().decompress(packet, out)
        return self.mean_of([packet], divide=False, out=out)

    def aggregate(self, packets: Sequence[Packet]) -> torch.Tensor:
        if packets[0].dtype != torch.float32:
            return super().aggregate(packets)
        return self.mean_of(packets)

    def mean_of(self, packets: Sequence[Packet], **options) -> torch.Tensor:
        return self.mean.mean(self.KIND, [p.wire[self.WIRE] for p in packets], [p.wire[self.SCALAR] for p in packets],
                              packets[0].shape, **self.mean_options(packets[0]), **options)


def decode_add_mean(impl, packets: Sequence[Packet], add) -> torch.Tensor:
    """The mean of the decoded float32 packets, fused: the first decoded (``impl.decompress``,
    a new tensor), each other one decoded and added in one pass by ``add(packet, total)``
    (the same float32 sums in the same order as ``total.add_(decompress(p))``), then divided
    by n: ``Operations.aggregate``'s bits in n passes over the output instead of 3n."""
    total = impl.decompress(packets[0])
    for p in packets[1:]:
        add(p, total)
    return total.div_(len(packets))
