"""Dataset files written by tests: IDX (MNIST layout, optionally gzipped) in a directory."""
from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np


def idx_bytes(magic: int, dims, payload: bytes) -> bytes:
    return struct.pack(">i", magic) + struct.pack(f">{len(dims)}I", *dims) + payload


def mnist_arrays(n_train=12, n_test=5, side=28, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, side, side), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, side, side), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(n_test) % 10).astype(np.uint8),
    }


def mnist_file_bytes(arrays, gz=True) -> dict:
    out = {}
    for stem, a in arrays.items():
        raw = idx_bytes(2051 if a.ndim == 3 else 2049, a.shape, a.tobytes())
        out[stem + (".gz" if gz else "")] = gzip.compress(raw, mtime=0) if gz else raw
    return out


def write_files(directory: Path, files: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (directory / name).write_bytes(content)
    return directory
