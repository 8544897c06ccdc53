"""The :class:`Dataset` every loader returns, and the normalisation they all apply."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ... import specs
from ...errors import GradzipError


@dataclass
class Dataset:
    """A classification dataset held in memory.

    ``train_x`` / ``test_x`` are float32, ``(N, C, H, W)`` for images or ``(N, F)`` for
    flat features, normalized with the train split's per-channel mean and std;
    ``train_y`` / ``test_y`` are int64 class indices in ``[0, num_classes)``. A
    language-modelling dataset (``text``) holds token ids instead: int64 ``(N, T)`` inputs
    and ``(N, T)`` targets, a class per position. ``info``: what else identifies the data
    (e.g. the corpus's source, size and hash), recorded in ``summary.json``.
    """

    name: str
    train_x: torch.Tensor = field(repr=False)
    train_y: torch.Tensor = field(repr=False)
    test_x: torch.Tensor = field(repr=False)
    test_y: torch.Tensor = field(repr=False)
    num_classes: int
    info: dict = field(default_factory=dict, repr=False)

    @property
    def input_shape(self) -> tuple:
        """One sample's shape: ``(C, H, W)`` for images, ``(features,)`` for flat data."""
        return tuple(self.train_x.shape[1:])

    @property
    def targets_per_sample(self) -> int:
        """Targets each sample carries: 1 for classification, ``T`` for a sequence of ``T`` tokens."""
        return max(1, self.train_y[0].numel()) if len(self.train_y) else 1

    def __repr__(self) -> str:
        return (f"Dataset({self.name!r}, train={len(self.train_y)}, test={len(self.test_y)}, "
                f"input_shape={self.input_shape}, num_classes={self.num_classes})")



def normalize(train_x: torch.Tensor, test_x: torch.Tensor):
    """Standardize both splits with the train split's per-channel mean / std.

    Images ``(N, C, H, W)``: one mean / std per channel. Flat ``(N, F)``: one mean / std
    over all features (treated as a single channel).
    """
    dims = (0, 2, 3) if train_x.dim() == 4 else tuple(range(train_x.dim()))
    std, mean = torch.std_mean(train_x, dim=dims, keepdim=True)
    std = torch.where(std > 0, std, torch.ones_like(std))
    if train_x.dim() != 4:
        mean, std = mean.reshape(()), std.reshape(())
    # in place: the float32 copies made by the loaders are ours, and CIFAR-10 is 600 MB
    out = []
    for x in (train_x, test_x):
        x = x.float().contiguous()
        out.append(x.sub_(mean).div_(std))
    return out[0], out[1]


#: How :func:`typed_options` names what a converter expects.
_EXPECTED = {int: "an integer", float: "a number"}


def typed_options(dataset: str, options: list[specs.Option], kinds: dict[str, Callable[[str], object]],
                  example: str, names: dict[str, str] | None = None) -> dict:
    """A dataset spec's options as its loader's keyword arguments: each key (case-insensitive)
    one of ``kinds``, its value converted by ``kinds[key]`` (``int``, ``float``, ``str``, or a
    parser that raises its own :class:`GradzipError`), under ``names.get(key, key)``. A key
    not in ``kinds`` or an item without ``=`` names the valid keys and ``example``; a value
    ``int`` / ``float`` refuses names what it needs."""
    out: dict = {}
    for opt in options:
        key = opt.key.lower()
        if not opt.has_value or key not in kinds:
            raise GradzipError(f"bad {dataset} option {opt.item!r}; options are {', '.join(kinds)} (e.g. {example}).")
        try:
            out[(names or {}).get(key, key)] = kinds[key](opt.value)
        except GradzipError:   # a parser's own message (a GradzipError is a ValueError too)
            raise
        except ValueError:
            raise GradzipError(f"{dataset} option {key} needs {_EXPECTED.get(kinds[key], 'another value')}, got "
                               f"{opt.value!r}.") from None
    return out
