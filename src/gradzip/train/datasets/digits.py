"""``digits``: scikit-learn's 8x8 digits, embedded in scikit-learn (no download)."""
from __future__ import annotations

import numpy as np
import torch

from .base import Dataset, normalize

_DIGITS_TEST_FRACTION = 0.2
_DIGITS_SPLIT_SEED = 0


def load() -> Dataset:
    """The digits, 1x8x8 images of 10 classes, in a fixed stratified 80/20 split."""
    # scikit-learn is imported here, not at the top: only this dataset needs it, and
    # importing it costs about a second
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = d.images.astype(np.float32)[:, None, :, :]  # (1797, 1, 8, 8), values 0..16
    y = d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=_DIGITS_TEST_FRACTION,
                                          stratify=y, random_state=_DIGITS_SPLIT_SEED)
    train_x, test_x = normalize(torch.from_numpy(xtr), torch.from_numpy(xte))
    return Dataset("digits", train_x, torch.from_numpy(ytr), test_x, torch.from_numpy(yte), 10)

