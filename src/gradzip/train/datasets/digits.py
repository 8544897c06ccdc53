"""``digits``: scikit-learn's 8x8 digits, embedded in scikit-learn (no download).

The data file is read from scikit-learn's installed package without importing scikit-learn
(which, with the SciPy modules it loads, takes longer than ``import torch``), and the
80/20 split is :func:`stratified_split`, scikit-learn's ``train_test_split(stratify=y,
random_state=0)`` restated with numpy (tests/test_data.py checks they agree).
"""
from __future__ import annotations

import gzip
import importlib.util
from math import ceil
from pathlib import Path

import numpy as np
import torch

from ...errors import GradzipError
from .base import Dataset, normalize

_DIGITS_TEST_FRACTION = 0.2
_DIGITS_SPLIT_SEED = 0


def load() -> Dataset:
    """The digits, 1x8x8 images of 10 classes, in a fixed stratified 80/20 split."""
    with gzip.open(_data_file(), "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    x = data[:, :-1].reshape(-1, 8, 8).astype(np.float32)[:, None, :, :]  # (1797, 1, 8, 8), values 0..16
    y = data[:, -1].astype(np.int64)
    train, test = stratified_split(y, ceil(_DIGITS_TEST_FRACTION * len(y)), _DIGITS_SPLIT_SEED)
    train_x, test_x = normalize(torch.from_numpy(x[train]), torch.from_numpy(x[test]))
    return Dataset("digits", train_x, torch.from_numpy(y[train]), test_x, torch.from_numpy(y[test]), 10)


def _data_file() -> Path:
    """scikit-learn's ``datasets/data/digits.csv.gz``, found without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(next(iter(spec.submodule_search_locations or ()), "")) / "datasets" / "data" / "digits.csv.gz" \
        if spec is not None else None
    if path is None or not path.is_file():
        raise GradzipError("the digits dataset is read from scikit-learn's package data, and scikit-learn is not "
                           "installed here (or lacks datasets/data/digits.csv.gz): pip install scikit-learn")
    return path


def stratified_split(y: np.ndarray, n_test: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices of ``y``: every class split in proportion, ``n_test`` in the
    test part, both parts shuffled; the draws of scikit-learn's ``StratifiedShuffleSplit``
    (``train_test_split(..., stratify=y, random_state=seed)``), from ``RandomState(seed)``."""
    rng = np.random.RandomState(seed)
    n_train = len(y) - n_test
    _, y_indices, class_counts = np.unique(y, return_inverse=True, return_counts=True)
    class_indices = np.split(np.argsort(y_indices, kind="stable"), np.cumsum(class_counts)[:-1])
    n_i = _approximate_mode(class_counts, n_train, rng)
    t_i = _approximate_mode(class_counts - n_i, n_test, rng)
    train, test = [], []
    for i, members in enumerate(class_indices):
        shuffled = members.take(rng.permutation(class_counts[i]), mode="clip")
        train.extend(shuffled[:n_i[i]])
        test.extend(shuffled[n_i[i]:n_i[i] + t_i[i]])
    return rng.permutation(train), rng.permutation(test)


def _approximate_mode(class_counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of ``n_draws`` to take from each class: the proportional share rounded
    down, the rest given to the largest remainders (ties drawn from ``rng``)."""
    continuous = class_counts / class_counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    if need_to_add > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (inds,) = np.where(remainder == value)
            add_now = min(len(inds), need_to_add)
            floored[rng.choice(inds, size=add_now, replace=False)] += 1
            need_to_add -= add_now
            if need_to_add == 0:
                break
    return floored.astype(int)
