"""``mnist`` and ``fashion-mnist``: the IDX file parser and the loader (files found in the
data directory, or downloaded)."""
from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import numpy as np
import torch

from ...errors import GradzipError

from . import storage
from .base import Dataset, normalize

_IDX_IMAGES, _IDX_LABELS = 2051, 2049

_MNIST_FILES = {  # logical name -> standard gzipped file name
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
_TORCHVISION_DIR = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}


def read_idx(path: str | os.PathLike, expect_magic: int | None = None) -> np.ndarray:
    """Parse one IDX file of unsigned bytes (gzipped or not) into a uint8 array.

    Checks the magic number (``expect_magic``: 2051 for images, 2049 for labels), that the
    data is unsigned bytes, and that the payload has exactly the size the header declares.
    """
    path = Path(path)
    data = storage.read_bytes(path)
    if len(data) < 4:
        raise GradzipError(f"{path} is truncated (only {len(data)} bytes, no IDX header); "
                           f"delete it and download it again.")
    (magic,) = struct.unpack(">i", data[:4])
    ndim = magic & 0xFF
    if data[0:2] != b"\x00\x00" or data[2] != 0x08 or (
            expect_magic is not None and magic != expect_magic):
        want = f"{expect_magic}" if expect_magic is not None else "an IDX ubyte magic"
        raise GradzipError(f"{path} has magic number {magic}, expected {want}; it is not "
                           f"this IDX file (wrong or corrupt file): replace it.")
    if ndim < 1 or len(data) < 4 + 4 * ndim:
        raise GradzipError(f"{path} is truncated inside its IDX header; delete it and "
                           f"download it again.")
    dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    payload = len(data) - 4 - 4 * ndim
    need = math.prod(dims)
    if payload < need:
        raise GradzipError(f"{path} is truncated: its header declares {dims} "
                           f"({need} bytes) but it holds {payload}; delete it and download "
                           f"it again.")
    if payload > need:
        raise GradzipError(f"{path} has {payload - need} bytes after the {need} its header "
                           f"{dims} declares; it is corrupt: replace it.")
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _idx_candidates(gz_name: str) -> list[str]:
    raw = gz_name[:-3]
    return [gz_name, raw, raw.replace("-idx", ".idx")]


def _find_idx_files(directory: Path) -> dict:
    found = {}
    for key, gz_name in _MNIST_FILES.items():
        for cand in _idx_candidates(gz_name):
            if (directory / cand).is_file():
                found[key] = directory / cand
                break
    return found


def _check_not_other_dataset(name: str, files: dict) -> None:
    """Refuse a full MNIST file where Fashion-MNIST is wanted, and the reverse."""
    for other in ("mnist", "fashion-mnist"):
        if other == name:
            continue
        for path in files.values():
            known = storage.MD5[other].get(path.name)
            if known and path.stat().st_size < (64 << 20) and storage.hash_file(path, "md5") == known:
                raise GradzipError(f"{path} is the {other} file, not {name}; put the {name} "
                                   f"files in their own directory ({name}/ under the data "
                                   f"directory).")


def load(name: str, root: Path, download: bool) -> Dataset:
    """Dataset ``name`` (``mnist`` or ``fashion-mnist``) from its IDX files in ``root/<name>/``,
    torchvision's ``root/<Name>/raw/`` or ``root``; missing files are downloaded into the
    first of those that has some (else ``root/<name>/``) when ``download`` is true."""
    candidates = [root / name, root / _TORCHVISION_DIR[name] / "raw", root]
    directory, files = None, {}
    for cand in candidates:
        got = _find_idx_files(cand) if cand.is_dir() else {}
        if len(got) == len(_MNIST_FILES):
            directory, files = cand, got
            break
    if directory is None:
        # download the missing files into the first directory that has some, else root/name
        target = next((c for c in candidates if c.is_dir() and _find_idx_files(c)), root / name)
        files = _find_idx_files(target) if target.is_dir() else {}
        missing = [gz for key, gz in _MNIST_FILES.items() if key not in files]
        expected = list(_MNIST_FILES.values())
        if not download:
            raise storage.not_found(name, [target], expected, "downloading is off")
        try:
            for gz_name in missing:
                storage.download([m + gz_name for m in storage.MIRRORS[name]], target / gz_name,
                          storage.MD5[name][gz_name])
        except OSError as exc:
            raise storage.not_found(name, [target], expected, str(exc)) from None
        directory, files = target, _find_idx_files(target)
    storage.verify_sha256sums(directory, files.values())
    _check_not_other_dataset(name, files)

    arrays = {}
    for key, path in files.items():
        arrays[key] = read_idx(path, _IDX_IMAGES if key.endswith("images") else _IDX_LABELS)
    for split in ("train", "test"):
        img, lab = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        ipath, lpath = files[f"{split}_images"], files[f"{split}_labels"]
        if img.ndim != 3:
            raise GradzipError(f"{ipath} has {img.ndim} dimensions, expected 3 "
                               f"(count, rows, cols); replace it with an IDX image file.")
        if lab.ndim != 1:
            raise GradzipError(f"{lpath} has {lab.ndim} dimensions, expected 1; replace it "
                               f"with an IDX label file.")
        if 0 in img.shape:
            raise GradzipError(f"{ipath} holds no image data (shape {img.shape}); replace it "
                               f"with the {name} image file.")
        if len(img) != len(lab):
            raise GradzipError(f"{ipath} holds {len(img)} images but {lpath} holds "
                               f"{len(lab)} labels; the files do not belong together: "
                               f"replace them with a matching pair.")
        if len(lab) and int(lab.max()) >= 10:
            raise GradzipError(f"{lpath} has label {int(lab.max())}, outside 0..9; replace "
                               f"it with the {name} label file.")
    if arrays["train_images"].shape[1:] != arrays["test_images"].shape[1:]:
        raise GradzipError(f"the train images are {arrays['train_images'].shape[1:]} but the "
                           f"test images are {arrays['test_images'].shape[1:]} in "
                           f"{directory}; the files do not belong together.")

    def images(a):
        return torch.from_numpy(a.astype(np.float32) / 255.0).unsqueeze(1)

    train_x, test_x = normalize(images(arrays["train_images"]), images(arrays["test_images"]))
    return Dataset(name, train_x, torch.from_numpy(arrays["train_labels"].astype(np.int64)),
                   test_x, torch.from_numpy(arrays["test_labels"].astype(np.int64)), 10)

