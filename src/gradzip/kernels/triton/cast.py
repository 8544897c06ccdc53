"""Triton kernel of ``fp16`` / ``bf16`` (docs/algorithms.md §codec: none, fp16, bf16) where
torch makes several passes: the summand ``x/n`` cast back to 16 bits (one pass instead of
three); the mean of n packets is :mod:`.mean`'s (one pass over them instead of 3n). The casts of
``compress`` and ``decompress`` stay torch's own ``copy_``, already one pass at copy speed.

Float contract: ``x/n`` is a float32 ``div_rn`` of the widened value, rounded to 16 bits to
nearest even (bfloat16 through its bits: :func:`.launch.narrow`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import BLOCK, blocks, narrow, run, widen16


@triton.jit(do_not_specialize=["n"])
def _summand(x_ptr, out_ptr, count_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    v = widen16(tl.load(x_ptr + offs, mask=inside, other=0))
    tl.store(out_ptr + offs, narrow(tl.math.div_rn(v, tl.load(count_ptr)), out_ptr.dtype.element_ty), mask=inside)


def summand(wire: torch.Tensor, world_size: int) -> torch.Tensor:
    """``(wire.float() / n).to(wire.dtype)``, flat, in one pass."""
    x = wire.contiguous().reshape(-1)
    out = torch.empty_like(x)
    count = torch.tensor([world_size], dtype=torch.float32, device=x.device)
    run(_summand, blocks(x.numel()), x, out, count, x.numel(), BLOCK=BLOCK)
    return out
