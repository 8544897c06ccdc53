"""Counter-based uniforms for the stochastic codecs (``qsgd``, ``terngrad``, ``randomk``):
``u_j = hash(seed, j)``, the same numbers on every device, in any order, piece by piece.

Why not ``torch.rand(generator=...)``: on one CPU thread it alone runs at ~0.6 GB/s, slower
than the whole rest of a codec, and its numbers depend on how the tensor is cut into pieces'
calls. A counter-based draw depends only on the seed and the entry's index ``j``, so the
fused kernel computes it inline (one pass over memory) and the torch reference, chunked or
whole, on CPU or CUDA, gets the very same bits.

The rule (docs/algorithms.md §codec: qsgd; all arithmetic modulo 2^32):

* keys: ``a = seed mod 2^64``, ``lo, hi`` its 32-bit halves,
  ``k0 = H(H(lo ^ 0x6a09e667) ^ hi)``, and per block ``b = ⌊j / 2^32⌋`` of 2^32 entries
  ``k1 = H(k0 ^ 0xbb67ae85 ^ H(b))``;
* ``x = (j mod 2^32) ^ k0; x ^= x >> 16; x *= 0x21f0aaad; x ^= k1;
  x ^= x >> 15; x *= 0x735a2d97; x ^= x >> 15`` (hash-prospector's two-round 32-bit hash,
  the second key mixed in between the rounds);
* ``u_j = (x >> 8) · 2^-24``: uniform on the 2^24 multiples of 2^-24 in [0, 1), exact in float32.

``H`` is the same hash without keys. Both multipliers are below 2^31, so the torch reference
computes it in int64 without overflow. For a fixed seed, ``j -> x`` is a bijection of each
block: every 24-bit value occurs equally often over a full block.

Four statements of the rule, tested equal: :func:`hash_at` (plain Python), :func:`uniforms`
and :func:`hashes` (torch, int64), :func:`numba_uniform` / :func:`numba_hash` (the numba
kernels' inline draw, in 32-bit lanes) and :mod:`gradzip.kernels.triton.rng` (Triton, uint32).

``randomk`` draws its k-subset from the same hashes (docs/algorithms.md §codec: randomk):
the k entries of smallest hash, which :func:`smallest_hashes` finds.
"""
from __future__ import annotations

import functools
import math

import torch

MASK = 0xFFFFFFFF
M1 = 0x21F0AAAD
M2 = 0x735A2D97
#: Entries per counter block (``k1`` changes from one block to the next; tests make it
#: small to reach a second block; a multiple of 8, at most 2^32).
BLOCK = 1 << 32
#: Entries per piece of the torch reference (its int64 temporaries stay small).
CHUNK = 1 << 18


def mix32(x: int) -> int:
    """``H``: the unkeyed 32-bit hash, on a Python int."""
    x &= MASK
    x ^= x >> 16
    x = (x * M1) & MASK
    x ^= x >> 15
    x = (x * M2) & MASK
    return x ^ (x >> 15)


def keys(seed: int, block: int = 0) -> tuple[int, int]:
    """``(k0, k1)`` of ``seed`` (any Python int) for entries ``block·2^32 ... (block+1)·2^32 − 1``."""
    a = int(seed) % (1 << 64)
    k0 = mix32(mix32((a & MASK) ^ 0x6A09E667) ^ (a >> 32))
    return k0, mix32(k0 ^ 0xBB67AE85 ^ mix32(block))


def hash_at(seed: int, j: int) -> int:
    """The 32-bit hash of entry ``j``: the plain-Python statement of the rule (tests check
    the kernels and the torch reference against it)."""
    k0, k1 = keys(seed, j // BLOCK)
    return keyed_hash(j % BLOCK, k0, k1)


def keyed_hash(local: int, k0: int, k1: int) -> int:
    """The hash of the entry ``local`` entries into the block whose keys are ``k0, k1``."""
    x = (local & MASK) ^ k0
    x ^= x >> 16
    x = (x * M1) & MASK
    x ^= k1
    x ^= x >> 15
    x = (x * M2) & MASK
    return x ^ (x >> 15)


def uniform_at(seed: int, j: int) -> float:
    """``u_j`` as a Python float (exactly the float32 value the codecs use)."""
    k0, k1 = keys(seed, j // BLOCK)
    return uniform_from_keys(j % BLOCK, k0, k1)


def uniform_from_keys(local: int, k0: int, k1: int) -> float:
    """``u`` of the entry ``local`` entries into the block of keys ``k0, k1``."""
    return (keyed_hash(local, k0, k1) >> 8) * 2.0 ** -24


def uniforms(seed: int, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``u_start ... u_(start+count-1)`` in float32: the pure-torch reference, in int64
    (the multipliers keep every product below 2^63), on ``device``."""
    out = torch.empty(count, dtype=torch.float32, device=device)
    for pos, x in _hash_pieces(seed, start, count, device):
        x >>= 8
        torch.mul(x, 2.0 ** -24, out=out[pos : pos + x.numel()])  # < 2^24: exact in float32
    return out


def hashes(seed: int, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 32-bit hashes of entries ``start ... start+count-1`` as int64 (torch, on ``device``)."""
    out = torch.empty(count, dtype=torch.int64, device=device)
    for pos, x in _hash_pieces(seed, start, count, device):
        out[pos : pos + x.numel()] = x
    return out


def _hash_pieces(seed: int, start: int, count: int, device):
    """``(position, int64 hashes)`` of the entries in pieces of at most :data:`CHUNK` (one key
    pair per piece)."""
    pos = 0
    while pos < count:
        j0 = start + pos
        block, local = divmod(j0, BLOCK)
        size = min(CHUNK, count - pos, BLOCK - local)  # one key pair per piece
        k0, k1 = keys(seed, block)
        x = torch.arange(local, local + size, dtype=torch.int64, device=device)
        x ^= k0
        x ^= x >> 16
        x.mul_(M1).bitwise_and_(MASK)
        x ^= k1
        x ^= x >> 15
        x.mul_(M2).bitwise_and_(MASK)
        x ^= x >> 15
        yield pos, x
        pos += size


def hash_bound(k: int, numel: int, widen: int = 0) -> int:
    """A bound below which about ``(k + 4√k + 16)·2^widen`` of ``numel`` hashes fall (the hashes
    of a block are a permutation: uniform); at most 2^32 (every hash)."""
    want = (k + 4 * math.isqrt(k) + 16) << widen
    return min(1 << 32, -(-want * (1 << 32) // max(numel, 1)))


def smallest_hashes(seed: int, numel: int, k: int, device: torch.device | str = "cpu", below=None) -> torch.Tensor:
    """The indices (ascending, int64, on ``device``) of the ``k`` entries of ``0 ... numel − 1``
    whose hashes are smallest: ``randomk``'s k-subset (docs/algorithms.md §codec: randomk),
    uniform since the hashes of a block are a permutation of 32-bit values, and without ties
    (``numel <= 2^32``: one block). ``below(seed, numel, bound, device) -> (indices, hashes)``:
    the entries whose hash lies below ``bound`` (any order; a kernel), by default
    :func:`hashes_below`; the bound grows until at least ``k`` are found."""
    if k >= numel:
        return torch.arange(numel, device=device)
    widen = 0
    while True:
        bound = hash_bound(k, numel, widen)
        idx, found = (below or hashes_below)(seed, numel, bound, device)
        if idx.numel() >= k or bound == 1 << 32:
            break
        widen += 1
    pick = torch.topk(found, k, largest=False, sorted=False).indices
    return idx.index_select(0, pick).sort().values


def hashes_below(seed: int, numel: int, bound: int, device: torch.device | str = "cpu"):
    """``(indices, hashes)`` (int64) of the entries ``0 ... numel − 1`` whose hash is below
    ``bound``, ascending: the torch reference, piece by piece."""
    idx, found = [], []
    for pos, x in _hash_pieces(seed, 0, numel, device):
        keep = x < bound
        idx.append(torch.nonzero(keep).view(-1) + pos)
        found.append(x[keep])
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return (torch.cat(idx) if idx else empty), (torch.cat(found) if found else empty)


@functools.cache
def numba_uniform():
    """``u_j`` for the numba kernels: a numba intrinsic ``uniform(j, k0, k1) -> float32``
    (``j`` the entry's index in its block, ``k0, k1`` the block's keys, any integer types;
    each is taken mod 2^32) that emits the rule as 32-bit LLVM operations.

    Why an intrinsic: numba types arithmetic on uint32 as uint64, and LLVM then vectorises
    the hash on 64-bit lanes (half as many per vector, and no packed 32-bit multiply); in
    i32 a loop of draws runs on full-width vectors, ~4x faster. Built (numba imported) on
    the first call, like the kernels themselves."""
    return _numba_intrinsic(uniform=True)


@functools.cache
def numba_hash():
    """The 32-bit hash for the numba kernels: ``hash(j, k0, k1) -> uint32``, the intrinsic of
    :func:`numba_uniform` without the last step."""
    return _numba_intrinsic(uniform=False)


def _numba_intrinsic(uniform: bool):
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    i32 = ir.IntType(32)

    def word(builder, value):  # the low 32 bits of an integer argument
        width = value.type.width
        return value if width == 32 else (builder.trunc if width > 32 else builder.zext)(value, i32)

    @intrinsic
    def draw(typingctx, j, k0, k1):
        if not all(isinstance(t, types.Integer) for t in (j, k0, k1)):
            return None

        def codegen(context, builder, signature, args):
            j32, a, b = (word(builder, value) for value in args)
            x = builder.xor(j32, a)
            x = builder.xor(x, builder.lshr(x, ir.Constant(i32, 16)))
            x = builder.mul(x, ir.Constant(i32, M1))
            x = builder.xor(x, b)
            x = builder.xor(x, builder.lshr(x, ir.Constant(i32, 15)))
            x = builder.mul(x, ir.Constant(i32, M2))
            x = builder.xor(x, builder.lshr(x, ir.Constant(i32, 15)))
            if not uniform:
                return x
            top = builder.sitofp(builder.lshr(x, ir.Constant(i32, 8)), ir.FloatType())  # < 2^24: exact
            return builder.fmul(top, ir.Constant(ir.FloatType(), 2.0 ** -24))

        return (types.float32 if uniform else types.uint32)(j, k0, k1), codegen

    return draw
