"""Datasets for the training harness: in-memory tensors, one loader per name.

``load(name, data_dir)`` returns a :class:`Dataset` whose tensors are already normalized
(per-channel mean / std of the train split, applied to both splits). Datasets:

- ``digits``: scikit-learn's 8x8 digits (embedded, no download): 1x8x8 images, 10 classes,
  a fixed stratified 80/20 split (1437 train / 360 test), the same for every run.
- ``synthetic``: generated, no file. Options as a spec string,
  ``synthetic:n=8192,test=2048,shape=1x28x28,classes=10,seed=0`` (these are the defaults;
  ``shape=784`` gives flat features). See :func:`synthetic`.
- ``modadd``: modular addition ``(a, b) -> (a + b) mod p`` as two float32 token ids
  (not normalized), for the ``transformer`` model; ``modadd:p=97,train=0.5,seed=0``. See
  :mod:`.algorithmic`.
- ``text``: byte-level language modelling for the ``gpt`` model: the Python standard
  library's source files (embedded: no download; the Python version is recorded) or a text
  file from ``data_dir`` (``text:file=input.txt``), cut into sequences of ``context`` bytes
  with next-byte targets; ``text:context=128,bytes=0``. See :mod:`.text`.
- ``mnist``, ``fashion-mnist``: the standard IDX files (``train-images-idx3-ubyte.gz`` ...,
  gzipped or not) in ``data_dir/<name>/`` or ``data_dir``; downloaded into
  ``data_dir/<name>/`` from the standard mirrors (MD5-checked) when missing.
- ``cifar10``: ``cifar-10-python.tar.gz`` or its extracted ``cifar-10-batches-py/`` in
  ``data_dir/cifar10/`` or ``data_dir``; downloaded into ``data_dir/cifar10/`` when missing.

A ``SHA256SUMS`` file (``sha256sum`` format) beside the data files is verified when present.
No dataset depends on the run's seed: each is a fixed function of its name, so test sets
are the same across runs; the per-epoch shuffling is :func:`shard`'s job.

Modules: :mod:`.registry` (names -> loaders; :func:`register` adds one), :mod:`.base` (``Dataset``, normalisation),
:mod:`.sampler` (``shard``), :mod:`.generated` (``synthetic``), :mod:`.digits`,
:mod:`.algorithmic` (``modadd``), :mod:`.text` (``text``), :mod:`.storage` (finding, downloading and checking files), :mod:`.mnist` (IDX),
:mod:`.cifar`.
"""
from .base import Dataset
from .generated import synthetic
from .mnist import read_idx
from .registry import load, names, register
from .sampler import shard
from .storage import MD5, MIRRORS

__all__ = ["Dataset", "names", "load", "register", "synthetic", "shard", "read_idx", "MIRRORS", "MD5"]
