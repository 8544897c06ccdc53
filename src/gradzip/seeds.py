"""Every seed gradzip derives from a run's seed, in one place: one function per purpose.

Each formula is pinned: results, checkpoints and tests depend on the exact values, so a
purpose keeps its formula (the integer ones predate the hashed ones). New purposes use
:func:`mix` (integers) or :func:`hashed` (any values with a string form).
"""
from __future__ import annotations

import hashlib

_MASK64 = (1 << 64) - 1


def mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 chain): the same inputs give the same seed
    on every worker and every run; any change gives an unrelated one. Used for the codecs'
    randomness (per step, tensor and, for private randomness, rank)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1


def hashed(*parts) -> int:
    """A 63-bit seed from values of any kind, by their ``str`` (SHA-256); distinct tuples
    give unrelated seeds. Used for data: shuffling and the synthetic dataset."""
    text = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & ((1 << 63) - 1)


def exchange_seed(seed: int, salt: int = 0) -> int:
    """The seed of a method's exchange number ``salt`` (a method with two exchanges gives
    them different salts)."""
    return seed * 1000 + salt


def worker_seed(seed: int, rank: int) -> int:
    """The seed of a worker's global RNGs (torch, ``random``) in the training loop: dropout
    and augmentation differ across workers, and are repeatable."""
    return seed * 1_000_003 + rank


def straggler_seed(seed: int, rank: int, step: int) -> int:
    """The seed of the delay a straggler emulation (:mod:`gradzip.train.stragglers`) injects on
    ``rank`` at ``step``: the same for every method compared in one run."""
    return mix(seed, rank, step, 0x57A66)
