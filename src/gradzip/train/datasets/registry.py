"""Datasets by name: ``load("synthetic:n=4096")``. A registry, no if/elif chain.

Each name maps to a loader (:func:`register`) and says whether it reads files (then it
needs a data directory) and whether it takes spec options (only ``synthetic``). Names are
case-insensitive; a few aliases (``fashion_mnist``, ``cifar-10``) are accepted.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

from ... import specs
from ...errors import GradzipError

from . import algorithmic, cifar, digits, generated, mnist, storage, text
from .base import Dataset


@dataclass(frozen=True)
class _Entry:
    """How to load one dataset name."""

    load: Callable[..., Dataset]   # (root, download) when ``files``, (data_dir, options) when both, else (options)
    files: bool = False            # read from files in a data directory
    options: bool = False          # takes spec options (``name:key=value,...``)


_REGISTRY: dict[str, _Entry] = {}
_ALIASES: dict[str, str] = {}


def register(name: str, *, files: bool = False, options: bool = False,
             aliases: tuple[str, ...] = ()):
    """Decorator: make ``loader`` loadable by :func:`load` as ``name`` (lower-case), and
    under each of ``aliases``. With ``files`` the dataset reads a data directory and is
    called ``loader(root, download)`` (``root`` exists, from :func:`storage.require_dir`);
    otherwise ``loader(options)``, the spec's :class:`gradzip.specs.Option` list, which is
    empty unless ``options`` is true (a name without ``options`` refuses any). With both,
    ``loader(data_dir, options)``: ``data_dir`` as given (None when not), which the loader
    checks itself where its options name a file (``text:file=NAME``)::

        @register("tiny", options=True)
        def _tiny(options): ...
    """
    for key in (name, *aliases):
        if not specs.is_name(key):
            raise GradzipError(f"dataset name must be a lower-case name without ':' or ',', "
                               f"got {key!r}; register it as e.g. 'mydata'.")
        if key in _REGISTRY or key in _ALIASES:
            raise GradzipError(f"dataset name {key!r} registered twice; pick another name.")

    def add(loader: Callable[..., Dataset]) -> Callable[..., Dataset]:
        _REGISTRY[name] = _Entry(loader, files=files, options=options)
        _ALIASES.update(dict.fromkeys(aliases, name))
        return loader
    return add


def _synthetic(options: list[specs.Option]) -> Dataset:
    """``synthetic`` with a spec's options (``synthetic:n=4096,shape=3x32x32``)."""
    return generated.synthetic(**generated.parse_options(options))


register("digits")(lambda options: digits.load())
register("synthetic", options=True)(_synthetic)
register("mnist", files=True)(functools.partial(mnist.load, "mnist"))
register("fashion-mnist", files=True, aliases=("fashion_mnist", "fashionmnist"))(
    functools.partial(mnist.load, "fashion-mnist"))
register("cifar10", files=True, aliases=("cifar-10", "cifar_10"))(cifar.load)
register("modadd", options=True)(lambda options: algorithmic.modadd(**algorithmic.parse_options(options)))
register("text", files=True, options=True)(lambda data_dir, options: text.load(data_dir, **text.parse_options(options)))


def names() -> list[str]:
    """The dataset names :func:`load` accepts."""
    return list(_REGISTRY)


def load(name: str, data_dir: str | os.PathLike | None = None, *,
         download: bool = True) -> Dataset:
    """Load a dataset by name (``names()``), normalized, as in-memory tensors.

    ``data_dir`` is needed by the file-based datasets (mnist, fashion-mnist, cifar10);
    missing files are downloaded into it when ``download`` is true. No dataset depends on
    the run's seed (test sets stay comparable across runs; ``synthetic`` takes its own
    ``seed=`` option).
    """
    if not isinstance(name, str) or not name.strip():
        raise GradzipError(f"dataset name must be a non-empty string, got {name!r}; "
                           f"valid names: {', '.join(_REGISTRY)}.")
    base, rest, options = specs.split(name)
    base = _ALIASES.get(base, base)
    if base not in _REGISTRY:
        raise GradzipError(f"unknown dataset {name!r}; valid names: {', '.join(_REGISTRY)}.")
    entry = _REGISTRY[base]
    if not entry.options and rest.strip():
        raise GradzipError(f"dataset {base!r} takes no options (got {name!r}); "
                           f"use just {base!r}.")
    if not entry.files:
        return entry.load(options)
    if entry.options:
        return entry.load(data_dir, options)
    return entry.load(storage.require_dir(base, data_dir, download), download)
