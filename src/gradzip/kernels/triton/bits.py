"""Triton kernels of ``sign``, ``scaled_sign`` and ``2bit`` (docs/algorithms.md §codec: sign,
scaled_sign, §codec: 2bit): the codes of one or two bits an entry, with the error-feedback
residual in the same pass, the decode (any output dtype, through the codec's table of
decoded values), and the aggregate of n packets in one pass over them (the vote counts of
``sign`` and ``2bit``, exact in float32; ``scaled_sign``'s mean: :mod:`.mean`).

Float contract (see :mod:`gradzip.kernels.triton`): codes compare in the input's dtype (the
threshold already rounded to it); the residual ``v − table[code]`` is one subtraction, in
float32 for 16-bit inputs then rounded once (as torch computes a 16-bit difference); the
counts are integers.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .launch import BLOCK, blocks, finish, load_codes, run, narrow, over_packets, store_packed, target, widen16


@triton.jit(do_not_specialize=["n", "nbytes"])
def _encode(x_ptr, thr_ptr, table_ptr, packed_ptr, res_ptr, n, nbytes,
            BITS: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    v = widen16(tl.load(x_ptr + offs, mask=inside, other=0))
    if BITS == 1:   # sign: v >= 0 (NaN: 0)
        code = (v >= 0).to(tl.int32)
    else:           # 2bit: 11 where v >= t, 10 where v <= -t, else 00 (NaN: 00)
        t = widen16(tl.load(thr_ptr))
        code = 3 * (v >= t).to(tl.int32) + 2 * (v <= -t).to(tl.int32)
    code = tl.where(inside, code, 0)
    store_packed(packed_ptr, code, pid * (BLOCK // 8), nbytes, BITS, BLOCK // 8)
    if RESIDUAL:
        r = v - widen16(tl.load(table_ptr + code))
        tl.store(res_ptr + offs, narrow(r, res_ptr.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["n", "nbytes"])
def _decode(packed_ptr, table_ptr, out_ptr, n, nbytes, BITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    code = load_codes(packed_ptr, offs, nbytes, BITS)
    tl.store(out_ptr + offs, tl.load(table_ptr + code), mask=inside)


@triton.jit(do_not_specialize=["n", "nbytes"])
def _counts(ptrs, out_ptr, step_ptr, n, nbytes, NP: tl.constexpr, BITS: tl.constexpr,
            FIRST: tl.constexpr, LAST: tl.constexpr, BLOCK: tl.constexpr):
    """Σ_i of the packets' codes as −1, 0, +1 (``sign``: bit 1 = +1, 0 = −1; ``2bit``: 11 = +1,
    10 = −1), counted into the float32 output (exact: |count| < 2**24); on the last chunk
    ``sign`` writes the vote ``sign(count)``, ``2bit`` ``float32(count)·step``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    if FIRST:
        c = tl.zeros((BLOCK,), tl.int32)
    else:
        c = tl.load(out_ptr + offs, mask=inside, other=0).to(tl.int32)
    for i in tl.static_range(NP):
        code = load_codes(ptrs[i], offs, nbytes, BITS)
        if BITS == 1:
            c += 2 * code - 1
        else:
            c += (code == 3).to(tl.int32) - (code == 2).to(tl.int32)
    if LAST:
        if BITS == 1:
            r = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
        else:
            r = c.to(tl.float32) * tl.load(step_ptr)
    else:
        r = c.to(tl.float32)
    tl.store(out_ptr + offs, r, mask=inside)


@triton.jit(do_not_specialize=["n"])
def _from_counts(total_ptr, step_ptr, out_ptr, n, VOTE: tl.constexpr, BLOCK: tl.constexpr):
    """The aggregate from an allreduced count: ``sign(count)`` in the output's dtype (VOTE),
    else ``float32(count)·step``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    c = tl.load(total_ptr + offs, mask=inside, other=0)
    if VOTE:
        r = narrow(tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0)), out_ptr.dtype.element_ty)
    else:
        r = c.to(tl.float32) * tl.load(step_ptr)
    tl.store(out_ptr + offs, r, mask=inside)


# -- the calls the codecs make (torch tensors in) --------------------------------------------
def encode(x: torch.Tensor, bits: int, packed: torch.Tensor, threshold: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, table: torch.Tensor | None = None) -> None:
    """The codes of the flat contiguous ``x`` into ``packed`` (``bits`` 1: ``x >= 0``; 2: MXNet's
    2-bit codes against ``threshold``, a 1-entry tensor of ``x``'s dtype); with ``residual``
    (``x``'s shape and dtype, any layout), ``x − table[code]`` into it (``table``: the decoded
    value of each code, ``x``'s dtype, on the device)."""
    n = x.numel()
    res = target(residual, (n,), x.dtype, x.device) if residual is not None else x
    run(_encode, blocks(n), x, x if threshold is None else threshold, x if table is None else table, packed, res,
        n, packed.numel(), BITS=bits, RESIDUAL=residual is not None, BLOCK=BLOCK)
    if residual is not None and res is not residual:
        residual.copy_(res.view(residual.shape))


def decode(packed: torch.Tensor, bits: int, table: torch.Tensor, shape, out: torch.Tensor | None) -> torch.Tensor:
    """``table[code]`` for every entry of a tensor of ``shape`` (``table``'s dtype), into ``out``
    where it fits (else a new tensor, copied into ``out``)."""
    result = target(out, shape, table.dtype, packed.device)
    n = result.numel()
    run(_decode, blocks(n), packed.contiguous(), table, result, n, packed.numel(), BITS=bits, BLOCK=BLOCK)
    return finish(result, out)


def counts(wires: Sequence[torch.Tensor], bits: int, shape, step: float | None) -> torch.Tensor:
    """The float32 aggregate of n packets' codes (:func:`_counts`): ``sign``'s majority vote
    (``step`` None), ``2bit``'s ``float32(Σ code)·step`` (``step`` rounded to float32 as
    torch rounds a scalar multiplying a float32 tensor)."""
    device = wires[0].device
    out = torch.empty(shape, dtype=torch.float32, device=device)
    n = out.numel()
    step_t = torch.tensor([0.0 if step is None else step], dtype=torch.float32, device=device)
    over_packets(_counts, n, [[w.contiguous() for w in wires]], out, step_t, n, wires[0].numel(), BITS=bits)
    return out


def from_counts(total: torch.Tensor, shape, dtype: torch.dtype, step: float | None) -> torch.Tensor:
    """The aggregate from an allreduced integer count: ``sign(total)`` in ``dtype`` (``step``
    None), else ``float32(total)·step`` (float32)."""
    total = total.contiguous()
    out = torch.empty(shape, dtype=dtype if step is None else torch.float32, device=total.device)
    step_t = torch.tensor([0.0 if step is None else step], dtype=torch.float32, device=total.device)
    run(_from_counts, blocks(out.numel()), total, step_t, out, out.numel(), VOTE=step is None, BLOCK=BLOCK)
    return out
