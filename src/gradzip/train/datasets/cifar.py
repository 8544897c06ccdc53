"""``cifar10``: the CIFAR-10 python batches (a restricted unpickler) and the loader (the
archive or its extracted directory in the data directory, or downloaded)."""
from __future__ import annotations

import codecs
import importlib
import io
import pickle
import tarfile
import zlib
from pathlib import Path

import numpy as np
import torch

from ...errors import GradzipError

from . import storage
from .base import Dataset, normalize

_CIFAR_TAR = "cifar-10-python.tar.gz"
_CIFAR_DIR = "cifar-10-batches-py"
_CIFAR_BATCHES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


class _SafeUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only (what the CIFAR batches hold)."""

    def find_class(self, module, name):
        allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
                   ("_codecs", "encode"): codecs.encode}
        for sub, func in (("multiarray", "_reconstruct"), ("numeric", "_frombuffer")):
            for mod in (f"numpy.core.{sub}", f"numpy._core.{sub}"):
                allowed[(mod, func)] = (sub, func)
        target = allowed.get((module, name))
        if target is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        if isinstance(target, tuple):  # numpy moved numpy.core to numpy._core in 2.0
            for prefix in ("numpy._core.", "numpy.core."):
                try:
                    return getattr(importlib.import_module(prefix + target[0]), target[1])
                except (ImportError, AttributeError):
                    continue
            raise pickle.UnpicklingError(f"this numpy has no {module}.{name}")
        return target


def _parse_cifar_batch(raw: bytes, where: str):
    try:
        obj = _SafeUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as exc:  # any unpickling failure means a corrupt or foreign file
        raise GradzipError(f"{where} is not a CIFAR-10 batch ({type(exc).__name__}: {storage.one_line(exc)}); "
                           f"replace it with the file from {_CIFAR_TAR}.") from None
    if not isinstance(obj, dict):
        raise GradzipError(f"{where} is not a CIFAR-10 batch (not a dict); replace it.")
    obj = {k.decode() if isinstance(k, bytes) else k: v for k, v in obj.items()}
    data, labels = obj.get("data"), obj.get("labels")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != 3072 or labels is None:
        raise GradzipError(f"{where} has no uint8 (N, 3072) 'data' with 'labels'; it is not a "
                           f"CIFAR-10 batch: replace it.")
    if len(data) == 0:
        raise GradzipError(f"{where} holds no images; the file is corrupt: replace it.")
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise GradzipError(f"{where} has 'labels' that are not integers; it is not a CIFAR-10 "
                           f"batch: replace it.") from None
    if labels.shape != (len(data),):
        raise GradzipError(f"{where} holds {len(data)} images but {labels.size} labels; the "
                           f"file is corrupt: replace it.")
    if labels.size and (labels.min() < 0 or labels.max() >= 10):
        raise GradzipError(f"{where} has labels outside 0..9; replace it.")
    return data.reshape(-1, 3, 32, 32), labels


def _cifar_sources(root: Path):
    """(kind, path) for each place CIFAR-10 may already be, best first."""
    out = []
    for base in (root / "cifar10", root):
        out.append(("dir", base / _CIFAR_DIR))
        out.append(("tar", base / _CIFAR_TAR))
    out.append(("dir", root))  # data_dir is the batches directory itself
    return out


def load(root: Path, download: bool) -> Dataset:
    """CIFAR-10 from the archive or its extracted batches directory in ``root/cifar10/`` or
    ``root`` (or ``root`` itself); downloaded into ``root/cifar10/`` when missing and
    ``download`` is true. The archive is read in memory, nothing is extracted."""
    source = None
    for kind, path in _cifar_sources(root):
        if kind == "dir" and path.is_dir() and all((path / b).is_file() for b in _CIFAR_BATCHES):
            source = (kind, path)
            break
        if kind == "tar" and path.is_file():
            source = (kind, path)
            break
    if source is None:
        target = root / "cifar10" / _CIFAR_TAR
        where = [root / "cifar10", root]
        expected = [_CIFAR_TAR, f"or {_CIFAR_DIR}/ with " + ", ".join(_CIFAR_BATCHES)]
        if not download:
            raise storage.not_found("cifar10", where, expected, "downloading is off")
        try:
            storage.download([m + _CIFAR_TAR for m in storage.MIRRORS["cifar10"]], target,
                      storage.MD5["cifar10"][_CIFAR_TAR])
        except OSError as exc:
            raise storage.not_found("cifar10", where, expected, str(exc)) from None
        source = ("tar", target)

    kind, path = source
    batches = {}
    if kind == "dir":
        files = [path / b for b in _CIFAR_BATCHES]
        storage.verify_sha256sums(path, files)
        for b, f in zip(_CIFAR_BATCHES, files):
            batches[b] = _parse_cifar_batch(f.read_bytes(), str(f))
    else:
        storage.verify_sha256sums(path.parent, [path])
        try:  # read the members in memory; nothing is extracted to disk
            with tarfile.open(path, "r:gz") as tar:
                for b in _CIFAR_BATCHES:
                    member = f"{_CIFAR_DIR}/{b}"
                    try:
                        fobj = tar.extractfile(member)
                    except KeyError:
                        fobj = None
                    if fobj is None:
                        raise GradzipError(f"{path} has no file {member}; it is not the "
                                           f"CIFAR-10 python archive: replace it.")
                    batches[b] = _parse_cifar_batch(fobj.read(), f"{path}:{member}")
        except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
            raise GradzipError(f"{path} is a corrupt or truncated archive ({storage.one_line(exc)}); delete it "
                               f"and download it again.") from None

    train = [batches[b] for b in _CIFAR_BATCHES[:-1]]
    train_x = torch.from_numpy(np.concatenate([x for x, _ in train]).astype(np.float32) / 255.0)
    train_y = torch.from_numpy(np.concatenate([y for _, y in train]))
    test_x = torch.from_numpy(batches["test_batch"][0].astype(np.float32) / 255.0)
    test_y = torch.from_numpy(batches["test_batch"][1])
    train_x, test_x = normalize(train_x, test_x)
    return Dataset("cifar10", train_x, train_y, test_x, test_y, 10)
