"""Triton kernels of ``qsgd`` and ``terngrad`` (docs/algorithms.md §codec: qsgd, §codec:
terngrad): the codes, drawn with the counter-based uniforms (:mod:`.rng`) and packed in the
same pass, with the error-feedback residual when asked (their decode and the mean of n
packets: :mod:`.mean`). The scalars a packet needs (qsgd's ``‖v‖₂``, terngrad's ``max |v|``)
stay on the device: the encode reads them from the packet's wire, no host synchronisation.

Float contract: one IEEE float32 operation at a time, in the reference's order (qsgd:
``scale = s / ‖v‖`` and ``step = ‖v‖ / s`` by ``div_rn``, ``ξ = min(⌊|v|·scale + u⌋, s)``
as a product then a sum, the code ``s ± ξ`` by the sign bit of ``v`` as ``copysign`` takes
it; terngrad: ``u·s < |v|``); the residual ``v − (code − s)·step`` and ``v − sign·s``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import counter_rng
from .launch import BLOCK, blocks, run, store_packed
from .rng import uniform


@triton.jit(do_not_specialize=["n", "nbytes", "k0", "k1"])
def _qsgd_encode(x_ptr, norm_ptr, packed_ptr, res_ptr, n, nbytes, k0, k1, LEVELS: tl.constexpr,
                 BITS: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    v = tl.load(x_ptr + offs, mask=inside, other=0.0)
    norm = tl.load(norm_ptr)
    s = tl.full((), LEVELS, tl.float32)
    scale = tl.where(norm > 0, tl.math.div_rn(s, norm), 0.0)
    y = tl.abs(v) * scale + uniform(offs, k0, k1)
    xi = tl.minimum(tl.floor(y), s)
    negative = (v.to(tl.uint32, bitcast=True) >> 31) == 1
    code = tl.where(negative, s - xi, s + xi)
    code = tl.where(inside, code.to(tl.int32), 0)
    store_packed(packed_ptr, code, pid * (BLOCK // 8), nbytes, BITS, BLOCK // 8)
    if RESIDUAL:
        step = tl.math.div_rn(norm, s)
        tl.store(res_ptr + offs, v - (code.to(tl.float32) - s) * step, mask=inside)


@triton.jit(do_not_specialize=["n", "nbytes", "k0", "k1"])
def _terngrad_encode(x_ptr, s_ptr, packed_ptr, res_ptr, n, nbytes, k0, k1, RESIDUAL: tl.constexpr,
                     BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    v = tl.load(x_ptr + offs, mask=inside, other=0.0)
    s = tl.load(s_ptr)
    keep = (uniform(offs, k0, k1) * s < tl.abs(v)).to(tl.int32)
    code = tl.where(inside, (keep << 1) | (keep & (v > 0).to(tl.int32)), 0)
    store_packed(packed_ptr, code, pid * (BLOCK // 8), nbytes, 2, BLOCK // 8)
    if RESIDUAL:
        sign = tl.where(code == 3, 1.0, tl.where(code == 2, -1.0, 0.0))
        tl.store(res_ptr + offs, v - sign * s, mask=inside)


def _blocks(seed: int, n: int):
    """``(start, stop, k0, k1)`` per counter block of ``n`` entries (:mod:`gradzip.kernels.counter_rng`)."""
    for start in range(0, max(n, 1), counter_rng.BLOCK):
        k0, k1 = counter_rng.keys(seed, start // counter_rng.BLOCK)
        yield start, min(n, start + counter_rng.BLOCK), k0, k1


def qsgd_encode(v: torch.Tensor, norm: torch.Tensor, levels: int, bits: int, seed: int, packed: torch.Tensor,
                residual: torch.Tensor | None) -> None:
    """QSGD's codes of the flat contiguous float32 ``v`` (``norm``: its 1-entry float32 ‖v‖₂ on
    the device) into ``packed``; with ``residual`` (flat contiguous float32), ``v − C(v)``."""
    for start, stop, k0, k1 in _blocks(seed, v.numel()):
        part = packed[start // 8 * bits:]
        run(_qsgd_encode, blocks(stop - start), v[start:stop], norm, part,
            v if residual is None else residual[start:stop], stop - start, part.numel(), k0, k1,
            LEVELS=levels, BITS=bits, RESIDUAL=residual is not None, BLOCK=BLOCK)


def terngrad_encode(v: torch.Tensor, s: torch.Tensor, seed: int, packed: torch.Tensor,
                    residual: torch.Tensor | None) -> None:
    """TernGrad's codes of the flat contiguous float32 ``v`` (``s``: its 1-entry float32 max |v|)."""
    for start, stop, k0, k1 in _blocks(seed, v.numel()):
        part = packed[start // 4:]
        run(_terngrad_encode, blocks(stop - start), v[start:stop], s, part,
            v if residual is None else residual[start:stop], stop - start, part.numel(), k0, k1,
            RESIDUAL=residual is not None, BLOCK=BLOCK)
