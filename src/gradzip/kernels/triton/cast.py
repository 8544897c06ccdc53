"""Triton kernels of ``fp16`` / ``bf16`` (docs/algorithms.md §codec: none, fp16, bf16) where
torch makes several passes: the summand ``x/n`` cast back to 16 bits (one pass instead of
three), and the mean of n packets (one pass over them instead of 3n). The casts of
``compress`` and ``decompress`` stay torch's own ``copy_``, already one pass at copy speed.

Float contract: ``x/n`` is a float32 ``div_rn`` of the widened value, rounded to 16 bits to
nearest even (bfloat16 through its bits: :func:`.launch.narrow`); the mean adds the widened
packets one worker after another in float32 and divides once.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .launch import BLOCK, blocks, chunks, narrow, run, widen16


@triton.jit(do_not_specialize=["n"])
def _summand(x_ptr, out_ptr, count_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    v = widen16(tl.load(x_ptr + offs, mask=inside, other=0))
    tl.store(out_ptr + offs, narrow(tl.math.div_rn(v, tl.load(count_ptr)), out_ptr.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["n"])
def _mean(ptrs, out_ptr, count_ptr, n, NP: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
          BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    if not FIRST:
        acc = tl.load(out_ptr + offs, mask=inside, other=0.0)
    for i in tl.static_range(NP):
        d = widen16(tl.load(ptrs[i] + offs, mask=inside, other=0))
        if FIRST and i == 0:
            acc = d
        else:
            acc = acc + d
    if LAST:
        acc = tl.math.div_rn(acc, tl.load(count_ptr))
    tl.store(out_ptr + offs, acc, mask=inside)


def summand(wire: torch.Tensor, world_size: int) -> torch.Tensor:
    """``(wire.float() / n).to(wire.dtype)``, flat, in one pass."""
    x = wire.contiguous().reshape(-1)
    out = torch.empty_like(x)
    count = torch.tensor([world_size], dtype=torch.float32, device=x.device)
    run(_summand, blocks(x.numel()), x, out, count, x.numel(), BLOCK=BLOCK)
    return out


def mean(wires: Sequence[torch.Tensor], shape) -> torch.Tensor:
    """The float32 mean of n 16-bit packets: widened, added in worker order, divided once."""
    device = wires[0].device
    out = torch.empty(shape, dtype=torch.float32, device=device)
    n = out.numel()
    count = torch.tensor([len(wires)], dtype=torch.float32, device=device)
    flat = [w.contiguous().reshape(-1) for w in wires]
    for first, last, chunk in chunks(flat):
        run(_mean, blocks(n), chunk, out, count, n, NP=len(chunk), FIRST=first, LAST=last, BLOCK=BLOCK)
    return out
