"""``modadd``: modular addition, ``(a, b) -> (a + b) mod p``, a generated sequence task (no
file) where a small transformer needs Adam (Power et al. 2022, "Grokking"; the
``transformer`` model of :mod:`gradzip.train.models`).

Inputs are the two tokens ``a, b`` in ``[0, p)``, held as float32 token ids (exact below
2**24; not normalized: the model embeds them), shape ``(N, 2)``; the label is ``(a + b) mod
p``, one of ``p`` classes, so tokens and classes share one vocabulary. All ``p²`` pairs are
split once by a fixed permutation (``seed``): ``train`` of them (a fraction) for training,
the rest for testing. Spec: ``modadd:p=97,train=0.5,seed=0`` (the defaults).
"""
from __future__ import annotations

import torch

from ... import specs
from ...errors import GradzipError
from .base import Dataset, typed_options


def parse_options(options: list[specs.Option]) -> dict:
    """:func:`modadd`'s keyword arguments from a spec's options."""
    return typed_options("modadd", options, {"p": int, "train": float, "seed": int}, "modadd:p=97,train=0.5,seed=0")


def modadd(p: int = 97, train: float = 0.5, seed: int = 0) -> Dataset:
    """All pairs ``(a, b)`` of ``[0, p)²`` labelled ``(a + b) mod p``, split ``train`` / rest."""
    if isinstance(p, bool) or not isinstance(p, int) or not 2 <= p <= 4096:
        raise GradzipError(f"modadd p must be an integer in [2, 4096], got {p!r}.")
    if not (isinstance(train, (int, float)) and 0 < train < 1):
        raise GradzipError(f"modadd train must be a fraction in (0, 1), got {train!r}.")
    a, b = torch.meshgrid(torch.arange(p), torch.arange(p), indexing="ij")
    x = torch.stack([a.reshape(-1), b.reshape(-1)], dim=1)
    y = (x[:, 0] + x[:, 1]) % p
    order = torch.randperm(p * p, generator=torch.Generator().manual_seed(int(seed)))
    cut = min(max(1, round(train * p * p)), p * p - 1)
    tr, te = order[:cut], order[cut:]
    return Dataset(f"modadd:p={p},train={train},seed={seed}", x[tr].float(), y[tr], x[te].float(), y[te], p)
