"""``synthetic``: a learnable generated classification task (no file), fixed by its options."""
from __future__ import annotations

import math
import os

import numpy as np
import torch

from ... import seeds, specs
from ...errors import GradzipError
from ...validation import is_int

from .base import Dataset, normalize, typed_options

_SYNTH_DEFAULTS = {"n": 8192, "test": 2048, "shape": (1, 28, 28), "classes": 10, "seed": 0}
_SYNTH_LATENT = 16      # dimension of the latent Gaussian the labels depend on
_SYNTH_NOISE = 0.5      # std of the per-feature noise added to the rendered inputs


def _parse_shape(text: str) -> tuple:
    try:
        shape = tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) not in (1, 3) or min(shape) < 1:
        raise GradzipError(f"synthetic shape must be CxHxW (e.g. 3x32x32) or a feature count "
                           f"(e.g. 784) with positive sizes, got {text!r}.")
    return shape


def _available_bytes() -> int | None:
    """Memory this process can still allocate without swapping (Linux ``MemAvailable``,
    else free physical pages); None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _check_memory(n: int, test: int, shape: tuple) -> None:
    """Refuse, in one line, a task too large to generate here. Peak use is at most two
    float32 arrays per split (inputs + their noise) and two per latent basis image: about
    ``8·dim·(n + test + 16)`` bytes."""
    dim = math.prod(shape)
    need = 8 * dim * (n + test + _SYNTH_LATENT)
    available = _available_bytes()
    if available is not None and need > available:
        raise GradzipError(
            f"synthetic: {n} + {test} samples of shape {'x'.join(map(str, shape))} ({dim:,} features each) "
            f"need about {_gb(need)} of memory to generate, more than the {_gb(available)} "
            "available here; use a smaller shape or fewer samples (n=, test=).")


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:,.0f} GB" if nbytes >= 1e11 else f"{nbytes / 1e9:.3g} GB"


def parse_options(options: list[specs.Option]) -> dict:
    """The keyword arguments of :func:`synthetic` from a spec's options (``n=4096``,
    ``shape=3x32x32``, ...)."""
    kinds = {key: _parse_shape if key == "shape" else int for key in _SYNTH_DEFAULTS}
    return typed_options("synthetic", options, kinds, "synthetic:n=4096,shape=3x32x32,classes=10")


def synthetic(n: int = 8192, test: int = 2048, shape: tuple | str = (1, 28, 28),
              classes: int = 10, seed: int = 0) -> Dataset:
    """A learnable generated classification task (no file), fixed by its arguments.

    A latent ``z ~ N(0, I_16)`` is rendered into an input ``x = z @ A + 0.5 * noise`` of the
    given ``shape`` (``A``: 16 fixed random, spatially smooth basis images, or random
    feature directions for a flat shape); the label is ``argmax(z @ W + b)`` of a fixed
    random linear teacher whose biases are calibrated so the classes are about equally
    frequent. The teacher, basis and each split come from their own generators derived
    from ``seed``, so the test set does not change with ``n``. The input noise keeps every
    model below 100% (what each scores: docs/benchmarks/accuracy.md,
    "Datasets: what synthetic scores").
    """
    if isinstance(shape, str):
        shape = _parse_shape(shape)
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (1, 3) or min(shape) < 1:
        raise GradzipError(f"synthetic shape must be (C, H, W) or (features,) with positive "
                           f"sizes, got {shape!r}.")
    for label, value, low in (("n", n, 1), ("test", test, 1), ("classes", classes, 2)):
        if not is_int(value, (int, np.integer)) or value < low:
            raise GradzipError(f"synthetic option {label} must be an integer >= {low}, "
                               f"got {value!r}.")
    if not is_int(seed, (int, np.integer)):
        raise GradzipError(f"synthetic option seed must be an integer, got {seed!r}.")
    n, test, classes, seed = int(n), int(test), int(classes), int(seed)
    dim = math.prod(shape)
    r = _SYNTH_LATENT
    _check_memory(n, test, shape)

    g = torch.Generator().manual_seed(seeds.hashed("synthetic-teacher", seed, shape, classes))
    if len(shape) == 3:
        c, h, w = shape
        coarse = torch.randn(r, c, max(2, h // 4), max(2, w // 4), generator=g)
        basis = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear",
                                                align_corners=False).reshape(r, dim)
    else:
        basis = torch.randn(r, dim, generator=g)
    # each basis image carries unit variance per feature on average
    basis = basis / basis.norm(dim=1, keepdim=True) * math.sqrt(dim / r)
    teacher = torch.randn(r, classes, generator=g)
    teacher = teacher / teacher.norm(dim=0, keepdim=True)
    bias = torch.zeros(classes)
    pool = torch.randn(20000, r, generator=g) @ teacher
    for _ in range(300):  # calibrate biases so classes are balanced (in log-frequency)
        freq = torch.bincount((pool + bias).argmax(1), minlength=classes).double() / len(pool)
        if freq.min() > 0.9 / classes and freq.max() < 1.1 / classes:
            break
        bias -= 0.3 * (torch.log(freq.clamp_min(1e-4)) - math.log(1.0 / classes)).float()

    def split(count: int, part: str):
        gs = torch.Generator().manual_seed(seeds.hashed("synthetic", part, seed, shape, classes))
        z = torch.randn(count, r, generator=gs)
        x = z @ basis
        x.add_(torch.randn(count, dim, generator=gs), alpha=_SYNTH_NOISE)
        y = (z @ teacher + bias).argmax(1).to(torch.int64)
        return x.reshape(count, *shape), y

    train_x, train_y = split(n, "train")
    test_x, test_y = split(test, "test")
    train_x, test_x = normalize(train_x, test_x)
    spec = (f"synthetic:n={n},test={test},shape={'x'.join(map(str, shape))},"
            f"classes={classes},seed={seed}")
    return Dataset(spec, train_x, train_y, test_x, test_y, classes)

