"""Files written whole or not at all.

:func:`write_atomically` is how gradzip writes every file it leaves behind (checkpoints,
their checksums, a run's outputs, traces, benchmark results): the content goes to a
temporary file in the target's directory (``.NAME.tmp-PID``), is flushed to disk
(``fsync``) and renamed over the target (``os.replace``, atomic on POSIX), and the
directory is synced. A failure part-way (a full disk, a kill) leaves the target as it was
before, never a truncated or empty file under its name; the temporary is removed on an
exception (a kill leaves it behind, and its name says what it is).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any, Callable


def temporary_name(path: Path) -> Path:
    """The temporary file this process writes ``path`` through (same directory)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def names(directory: str | os.PathLike) -> list[str]:
    """The names in ``directory``; none when it does not exist, is not a directory, or was
    removed while being listed (by another process cleaning up)."""
    try:
        with os.scandir(directory) as entries:
            return [entry.name for entry in entries]
    except (FileNotFoundError, NotADirectoryError):
        return []


def leftovers(path: Path) -> list[Path]:
    """Temporaries of ``path`` that writes killed before their rename left behind (any process's)."""
    prefix = f".{path.name}.tmp-"
    return [path.with_name(name) for name in names(path.parent) if name.startswith(prefix)]


def write_atomically(path: str | os.PathLike, write: Callable[[IO[Any]], Any], *, binary: bool = False) -> Path:
    """Write ``path`` whole or not at all: ``write(f)`` fills the temporary file ``f``
    (opened for text, or bytes with ``binary``), which is then synced and renamed over
    ``path``. On any exception the temporary is removed, ``path`` keeps its old content
    (or stays absent) and the exception propagates (an ``OSError`` names ``path``, not the
    temporary). The directory must exist."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(exc, OSError) and exc.filename == str(tmp):
            exc.filename = str(path)
        raise
    sync_directory(path.parent)
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    """``text`` as the whole content of ``path``, written atomically."""
    return write_atomically(path, lambda f: f.write(text))


def sync_directory(path: Path) -> None:
    """Make a rename in ``path`` durable (best effort: some systems cannot sync a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
