"""Which samples each worker trains on in each epoch (the harness's distributed sampler)."""
from __future__ import annotations

import numpy as np
import torch

from ... import seeds
from ...errors import GradzipError
from ...validation import is_int


def shard(n: int, rank: int, world_size: int, epoch: int, seed: int) -> torch.Tensor:
    """This rank's sample indices (int64) for one epoch.

    One permutation of ``range(n)``, drawn from a ``torch.Generator`` seeded by
    ``(seed, epoch)`` and therefore identical on every rank, is truncated to a multiple of
    ``world_size`` (dropping fewer than ``world_size`` samples) and dealt round-robin: rank
    ``r`` takes elements ``r, r + world_size, ...`` (like ``DistributedSampler`` with
    ``drop_last=True``). Shards of one epoch are disjoint and equally long.
    """
    for label, value in (("n", n), ("rank", rank), ("world_size", world_size),
                         ("epoch", epoch), ("seed", seed)):
        if not is_int(value, (int, np.integer)):
            raise GradzipError(f"shard() needs an integer {label}, got {value!r}.")
    if world_size < 1:
        raise GradzipError(f"world_size must be at least 1, got {world_size}.")
    if not 0 <= rank < world_size:
        raise GradzipError(f"rank must be in [0, {world_size}) for world_size {world_size}, "
                           f"got {rank}.")
    if epoch < 0:
        raise GradzipError(f"epoch must be non-negative, got {epoch}.")
    if n < world_size:
        raise GradzipError(f"a dataset of {n} samples cannot be split among {world_size} "
                           f"workers; use more samples or fewer workers.")
    gen = torch.Generator().manual_seed(seeds.hashed("shard", int(seed), int(epoch)))
    perm = torch.randperm(int(n), generator=gen)
    usable = n - n % world_size
    return perm[:usable][rank::world_size].clone()

