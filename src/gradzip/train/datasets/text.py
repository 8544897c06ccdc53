"""``text``: byte-level language modelling, for the ``gpt`` model (no download).

The corpus is a byte stream; its tokens are its bytes (a vocabulary of 256, so a test loss
in nats is ``loss / ln 2`` bits per byte). The stream is cut into non-overlapping
sequences of ``context`` bytes: sequence ``j`` is the input ``stream[jT : jT + T]`` and its
targets are the next bytes, ``stream[jT + 1 : jT + T + 1]`` (``T = context``); every 20th
sequence (``j % 20 == 19``) is held out for validation, the rest are the training samples
(each sample is a whole sequence: ``train_x`` and ``train_y`` are ``(N, T)`` int64).

Two sources:

- the embedded corpus (the default): the Python standard library's own source files, the
  ``*.py`` files directly in ``sysconfig.get_paths()["stdlib"]`` (no subdirectories), sorted
  by name, concatenated. Every machine with Python has them; their text changes with the
  Python version, which :attr:`Dataset.info` records (``python``, with the corpus's size and
  SHA-256) and ``summary.json`` repeats.
- ``file=NAME``: a plain text file in the data directory (``--data-dir``), read as bytes,
  e.g. tiny-shakespeare's ``input.txt``.

Options (spec ``text:context=128,bytes=0,file=``, these the defaults): ``context`` the
sequence length, ``bytes`` the stream cut to its first ``bytes`` bytes (0: all of it),
``file`` as above.
"""
from __future__ import annotations

import hashlib
import platform
import sysconfig
from pathlib import Path

import torch

from ... import specs
from ...errors import GradzipError
from . import storage
from .base import Dataset, typed_options

#: Every HELD_OUT-th sequence (the last of each run of HELD_OUT) is a validation sequence.
HELD_OUT = 20
VOCAB = 256


def parse_options(options: list[specs.Option]) -> dict:
    """:func:`load`'s keyword arguments from a spec's options (``bytes`` is ``nbytes``)."""
    return typed_options("text", options, {"context": int, "bytes": int, "file": str},
                         "text:context=128,bytes=1000000 or text:file=input.txt", names={"bytes": "nbytes"})


def stdlib_files() -> list[Path]:
    """The embedded corpus's files: the ``*.py`` directly in the standard library's
    directory, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"), key=lambda p: p.name.encode())
    if not files:
        raise GradzipError(f"this Python has no standard library sources in {root} (the embedded text corpus); "
                           "use a text file instead: --dataset text:file=NAME --data-dir DIR.")
    return files


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise GradzipError(f"cannot read {path} ({exc.strerror or storage.one_line(exc)}); check the file.") from None


def load(data_dir, context: int = 128, nbytes: int = 0, file: str = "") -> Dataset:
    """The ``text`` dataset (module docstring; ``nbytes`` is the option ``bytes``); ``data_dir``
    is needed only with ``file``."""
    if isinstance(context, bool) or not isinstance(context, int) or not 1 <= context <= 1 << 20:
        raise GradzipError(f"text context must be an integer in [1, 1048576], got {context!r}.")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise GradzipError(f"text bytes must be an integer >= 0 (0: the whole corpus), got {nbytes!r}.")
    if file:
        root = storage.require_dir("text", data_dir, download=False)
        path = root / file
        if not path.is_file():
            raise GradzipError(f"text file {str(path)!r} was not found; put the file there or give its name "
                               "in the data directory with text:file=NAME.")
        storage.verify_sha256sums(path.parent, [path])
        stream, info = _read(path), {"source": str(path), "files": 1}
    else:
        files = stdlib_files()
        stream = b"".join(_read(f) for f in files)
        info = {"source": "python-stdlib", "python": platform.python_version(), "files": len(files)}
    if nbytes:
        stream = stream[:nbytes]
    count = (len(stream) - 1) // context
    if count < HELD_OUT:
        raise GradzipError(f"the text corpus has {len(stream)} bytes, fewer than {HELD_OUT} sequences of "
                           f"{context} + 1; use a larger corpus (bytes=) or a shorter context.")
    info.update(bytes=len(stream), sha256=hashlib.sha256(stream).hexdigest(), token="byte")
    data = torch.frombuffer(bytearray(stream), dtype=torch.uint8).to(torch.int64)
    x = data[:count * context].view(count, context)
    y = data[1:count * context + 1].view(count, context)
    held = torch.arange(count) % HELD_OUT == HELD_OUT - 1
    name = f"text:context={context}" + (f",bytes={nbytes}" if nbytes else "") + (f",file={file}" if file else "")
    return Dataset(name, x[~held], y[~held], x[held], y[held], VOCAB, info=info)
