"""The decode-and-accumulate of n packets (the allgather aggregate; the two-phase server's
mean of a slice): one pass over the n packets into one float32 output, not n decodes and n
additions. One kernel for every codec whose aggregate is the mean of its decoded packets;
a codec says how a packet decodes (``KIND``):

* ``cast`` (``fp16`` / ``bf16``): the 16-bit value, widened;
* ``signs`` (``scaled_sign``): ``±scale`` by the bit;
* ``qsgd``: ``(code − s)·(‖v‖ / s)``; ``terngrad``: ``sign(code)·s``;
* ``onebit`` (``1bit``): the column's non-negative mean where the bit is 1, else its
  negative mean.

Float contract: each decoded value as the reference computes it (float32 products and
``div_rn`` quotients, one operation at a time), added in worker order into a float32
accumulator that starts from the first packet's value (not from 0: ``clone`` then ``add_``),
divided once by the count (``div_rn``); with more than :data:`.launch.MAX_PACKETS` packets
the partial sum waits in the output between launches. ``MODE`` residual (one packet): ``x −``
its decode (1bit's error-feedback residual).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .launch import finish, load_codes, over_packets, target, widen16

#: How a packet decodes (``KIND``, module docstring).
KINDS = {"cast": 0, "signs": 1, "qsgd": 2, "terngrad": 3, "onebit": 4}


@triton.jit
def decoded(wire_ptr, scalar_ptr, offs, inside, nbytes, cols, KIND: tl.constexpr, LEVELS: tl.constexpr,
            BITS: tl.constexpr):
    """The decoded float32 values of the entries ``offs`` of one packet (module docstring)."""
    if KIND == 0:
        return widen16(tl.load(wire_ptr + offs, mask=inside, other=0))
    code = load_codes(wire_ptr, offs, nbytes, BITS)
    if KIND == 4:
        col = offs % cols
        pos = tl.load(scalar_ptr + col, mask=inside, other=0.0)
        return tl.where(code == 1, pos, tl.load(scalar_ptr + cols + col, mask=inside, other=0.0))
    scalar = tl.load(scalar_ptr)
    if KIND == 1:
        return tl.where(code == 1, scalar, -scalar)
    if KIND == 2:
        s = tl.full((), LEVELS, tl.float32)
        return (code.to(tl.float32) - s) * tl.math.div_rn(scalar, s)
    return tl.where(code == 3, 1.0, tl.where(code == 2, -1.0, 0.0)) * scalar


@triton.jit(do_not_specialize=["n", "nbytes", "cols"])
def _mean(ptrs, scalars, out_ptr, x_ptr, count_ptr, n, nbytes, cols, KIND: tl.constexpr, LEVELS: tl.constexpr,
          BITS: tl.constexpr, RESIDUAL: tl.constexpr, DIVIDE: tl.constexpr, NP: tl.constexpr, FIRST: tl.constexpr,
          LAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    if not FIRST:
        acc = tl.load(out_ptr + offs, mask=inside, other=0.0)
    for i in tl.static_range(NP):
        d = decoded(ptrs[i], scalars[i], offs, inside, nbytes, cols, KIND, LEVELS, BITS)
        if FIRST and i == 0:
            acc = d
        else:
            acc = acc + d
    if RESIDUAL:
        acc = tl.load(x_ptr + offs, mask=inside, other=0.0) - acc
    elif LAST and DIVIDE:
        acc = tl.math.div_rn(acc, tl.load(count_ptr))
    tl.store(out_ptr + offs, acc, mask=inside)


def mean(kind: str, wires: Sequence[torch.Tensor], scalars: Sequence[torch.Tensor] | None, shape, *,
         cols: int = 1, levels: int = 0, bits: int = 1, divide: bool = True, out: torch.Tensor | None = None,
         x: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 mean of the decoded packets (``kind``: one of :data:`KINDS`; their wires and
    per-packet scalars: scale, norm or ``(2, cols)`` means); ``divide=False`` with one packet: its decode; ``x`` (one
    packet, flat contiguous float32): ``x −`` its decode. Into ``out`` where it fits."""
    device = wires[0].device
    result = target(out, shape, torch.float32, device)
    n = result.numel()
    count = torch.tensor([len(wires)], dtype=torch.float32, device=device)
    wires = [w.contiguous().reshape(-1) for w in wires]
    scalars = [s.contiguous() for s in scalars] if scalars is not None else wires
    over_packets(_mean, n, [wires, scalars], result, result if x is None else x, count, n, wires[0].numel(),
                 max(cols, 1), KIND=KINDS[kind], LEVELS=levels, BITS=bits, RESIDUAL=x is not None,
                 DIVIDE=divide and x is None)
    return finish(result, out)
