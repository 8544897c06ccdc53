"""Checkpoints that resume a run exactly: one file per rank, written atomically, checked
on load.

Layout: ``DIR/step-<000000123>/rank-<r>-of-<n>.pt``, one directory per checkpointed step,
and beside each file its checksum, ``rank-<r>-of-<n>.sha256`` (``sha256sum`` format, so
``sha256sum -c`` checks it by hand). A file is written to a temporary name in the same
directory, flushed to disk (``fsync``) and renamed over its final name; its SHA-256 is
then computed from what was written and the checksum file is written the same way,
last. A crash mid-write leaves the old state or the new one, never a torn file that
passes for a checkpoint. After every rank has written step ``s`` (a barrier), each rank
deletes its files of earlier steps: the previous complete step is kept until the next
one is complete on every rank.

Resuming (:func:`gather_held`, then :func:`choose`): the ranks agree on the newest step
every rank holds whose every file matches its checksum; a step that fails on any rank is
skipped (one line says which file and which step was taken instead), and with none left
the run starts from scratch. A killed write leaves temporaries, which
:func:`remove_temporaries` deletes at the start of a run.

What a file holds is up to the caller (the training loop saves model, optimizer, data
position, random generators and the run's records so far); it is read back with
``torch.load(weights_only=True)``, so a checkpoint cannot run code when loaded.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import GradzipError

_STEP_DIR = re.compile(r"^step-(\d+)$")
#: How many of its newest steps each rank offers when the ranks agree on one to resume.
_OFFERED = 4
_CHUNK = 1 << 20


def rank_file(root: str | os.PathLike, step: int, rank: int, world_size: int) -> Path:
    return Path(root) / f"step-{step:09d}" / f"rank-{rank}-of-{world_size}.pt"


def checksum_file(path: Path) -> Path:
    """The checksum file of the rank file ``path``."""
    return path.with_suffix(".sha256")


def save(root: str | os.PathLike, step: int, rank: int, world_size: int, payload: dict[str, Any]) -> Path:
    """Write this rank's ``payload`` for ``step`` atomically, then its checksum; returns
    the file's path. On failure (disk full, permissions) nothing of this step is left
    behind and a :class:`GradzipError` names the directory and the space needed."""
    final = rank_file(root, step, rank, world_size)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    tmp_sum = final.with_name(f".{checksum_file(final).name}.tmp-{os.getpid()}")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        with open(tmp_sum, "w") as f:
            f.write(f"{sha256(final)}  {final.name}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_sum, checksum_file(final))
        _fsync_dir(final.parent)
    except (OSError, RuntimeError, ValueError) as exc:  # torch.save: RuntimeError (inline_container.cc) on a full disk
        for leftover in (tmp, tmp_sum, checksum_file(final), final):
            _unlink(leftover)
        raise GradzipError(_write_failure(final, exc, payload)) from None
    return final


def _write_failure(final: Path, exc: BaseException, payload: Any) -> str:
    if isinstance(exc, OSError):
        reason = exc.strerror or str(exc)
    else:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
    try:
        free = f"{shutil.disk_usage(_existing_parent(final)).free / 1e6:.1f} MB free there"
    except OSError:
        free = "free space unknown"
    needed = _tensor_bytes(payload) / 1e6
    return (f"cannot write checkpoint {final}: {reason}; this rank's checkpoint needs about {needed:.1f} MB "
            f"in {final.parent.parent} ({free}); check that --checkpoint-dir is writable and the disk has "
            "space (the previous checkpoint is kept)")


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
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


def check_directory(root: str | os.PathLike | None) -> None:
    """Refuse a checkpoint directory that is not one: a ``step-...`` directory inside one
    (checkpoints would nest in it) or a directory holding other files. A directory that
    does not exist yet, or is empty, is fine (a first start)."""
    if not root:
        return
    path = Path(root)
    if "\0" in str(path):
        raise GradzipError(f"checkpoint directory {str(path)!r} holds a NUL character")
    if _STEP_DIR.match(path.name):
        raise GradzipError(f"checkpoint directory {path} is one step of a checkpoint directory; give its "
                           f"parent, {path.parent}")
    try:
        if path.exists() and not path.is_dir():
            raise GradzipError(f"checkpoint directory {path} exists and is not a directory")
        foreign = sorted(e.name for e in path.iterdir() if not _STEP_DIR.match(e.name)) if path.is_dir() else []
    except (OSError, ValueError) as exc:  # ValueError: an embedded NUL
        raise GradzipError(f"checkpoint directory {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if foreign:
        raise GradzipError(f"checkpoint directory {path} holds files that are not gradzip checkpoints "
                           f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); give the "
                           "directory --checkpoint-dir wrote, or a new or empty one")


def steps_held(root: str | os.PathLike, rank: int, world_size: int) -> list[int]:
    """The steps for which this rank's file exists in ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and rank_file(root, int(match.group(1)), rank, world_size).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def world_sizes_present(root: str | os.PathLike) -> set[int]:
    """World sizes of the rank files in ``root`` (to explain a mismatch)."""
    sizes = set()
    for path in Path(root).glob("step-*/rank-*-of-*.pt"):
        match = re.match(r"rank-\d+-of-(\d+)\.pt$", path.name)
        if match:
            sizes.add(int(match.group(1)))
    return sizes


def gather_held(comm, root: str | os.PathLike) -> list[list[int]]:
    """Per rank, the newest few steps it holds in ``root`` (collective: one control
    allgather). Raises when ``root`` holds only checkpoints of another world size."""
    mine = steps_held(root, comm.rank, comm.world_size)[-_OFFERED:]
    offer = torch.full((_OFFERED,), -1, dtype=torch.int64)
    offer[:len(mine)] = torch.tensor(mine, dtype=torch.int64)
    if comm.world_size > 1:
        offers = comm.allgather_control(offer).reshape(comm.world_size, -1).tolist()
    else:
        offers = [offer.tolist()]
    held = [sorted(s for s in row if s >= 0) for row in offers]
    if not any(held):
        sizes = world_sizes_present(root) if Path(root).is_dir() else set()
        if sizes:
            raise GradzipError(
                f"checkpoint directory {root} holds checkpoints of {', '.join(map(str, sorted(sizes)))} "
                f"workers, not {comm.world_size}; resume with that many workers or start in a new directory"
            )
    return held


#: What :func:`verify` finds wrong with a file (the ranks exchange the index).
PROBLEMS = ("has no checksum file (its write was interrupted)",
            "has an unreadable checksum file",
            "cannot be read",
            "does not match its SHA-256 checksum (the file is damaged)")


def verify(root: str | os.PathLike, step: int, rank: int, world_size: int) -> str | None:
    """What is wrong with this rank's file of ``step`` (one of :data:`PROBLEMS`; None: it
    matches its checksum)."""
    path = rank_file(root, step, rank, world_size)
    try:
        recorded = checksum_file(path).read_text().split()
    except FileNotFoundError:
        return PROBLEMS[0]
    except (OSError, UnicodeDecodeError):
        return PROBLEMS[1]
    try:
        actual = sha256(path)
    except OSError:
        return PROBLEMS[2]
    return None if recorded and recorded[0] == actual else PROBLEMS[3]


def choose(comm, root: str | os.PathLike, held: list[list[int]],
           note: Callable[[str], None] | None = None) -> int | None:
    """The newest step that every rank holds (``held``: :func:`gather_held`) and whose
    every file matches its checksum; None: start from scratch. A step skipped, or a
    start from scratch over checkpoints, is reported through ``note`` in one line.
    Collective: one 8-byte allgather per step checked."""
    common = sorted(set.intersection(*(set(h) for h in held)), reverse=True)
    rejected: list[str] = []
    for step in common:
        problem = verify(root, step, comm.rank, comm.world_size)
        code = torch.tensor([0 if problem is None else PROBLEMS.index(problem) + 1], dtype=torch.int64)
        codes = comm.allgather_control(code).reshape(-1).tolist() if comm.world_size > 1 else [int(code)]
        if not any(codes):
            if rejected and note is not None:
                note(f"{rejected[0]}{_more(rejected)}; resuming from step {step}, the newest step that "
                     "verifies on every rank")
            return step
        bad = next(r for r, c in enumerate(codes) if c)
        rejected.append(f"checkpoint file {rank_file(root, step, bad, comm.world_size)} {PROBLEMS[codes[bad] - 1]}")
    if note is not None and any(held):
        if rejected:
            note(f"{rejected[0]}{_more(rejected)}; no step verifies on every rank: starting from scratch")
        else:
            note(f"checkpoint directory {root} holds no step that every rank has (steps per rank: "
                 + "; ".join(f"rank {r}: {h or 'none'}" for r, h in enumerate(held))
                 + "): starting from scratch")
    return None


def _more(rejected: list[str]) -> str:
    return f" (and {len(rejected) - 1} older step(s) fail too)" if len(rejected) > 1 else ""


def newest_common(comm, root: str | os.PathLike, note: Callable[[str], None] | None = None) -> int | None:
    """The newest step every rank holds and whose files verify (None: start from
    scratch). Collective."""
    return choose(comm, root, gather_held(comm, root), note)


def load(root: str | os.PathLike, step: int, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's payload of ``step``."""
    path = rank_file(root, step, rank, world_size)
    try:
        with open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise GradzipError(f"checkpoint file {path} is missing; was it deleted during the resume?") from None
    except Exception as exc:  # torch raises several types for a damaged file
        raise GradzipError(
            f"checkpoint file {path} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
            f"delete the directory {path.parent} on every worker to resume from the step before it (from "
            "scratch if there is none), or start in a new directory"
        ) from None


def remove_temporaries(root: str | os.PathLike, rank: int, world_size: int) -> None:
    """Delete the temporary files a killed write of this rank left in ``root``."""
    for pattern in (f"step-*/.rank-{rank}-of-{world_size}.pt.tmp-*", f"step-*/.rank-{rank}-of-{world_size}.sha256.tmp-*"):
        for tmp in Path(root).glob(pattern):
            _unlink(tmp)


def _remove_step(root: str | os.PathLike, step: int, rank: int, world_size: int) -> None:
    path = rank_file(root, step, rank, world_size)
    _unlink(checksum_file(path))
    _unlink(path)
    try:
        path.parent.rmdir()
    except OSError:  # other ranks' files are still there
        pass


def discard_after(root: str | os.PathLike, rank: int, world_size: int, step: int | None) -> None:
    """Delete this rank's files of steps after ``step`` (all of them for None): a resume
    from ``step`` recomputes them."""
    for held in steps_held(root, rank, world_size):
        if step is None or held > step:
            _remove_step(root, held, rank, world_size)


def prune(root: str | os.PathLike, rank: int, world_size: int, keep_from: int) -> None:
    """Delete this rank's files of steps before ``keep_from`` (and step directories left
    empty), and temporary files a killed write of this rank left behind. Call only once
    every rank holds ``keep_from``."""
    remove_temporaries(root, rank, world_size)
    for step in steps_held(root, rank, world_size):
        if step < keep_from:
            _remove_step(root, step, rank, world_size)
