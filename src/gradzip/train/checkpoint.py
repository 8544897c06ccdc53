"""Checkpoints that resume a run exactly: one file per rank, written atomically.

Layout: ``DIR/step-<000000123>/rank-<r>-of-<n>.pt``, one directory per checkpointed step.
A file is written to a temporary name in the same directory, flushed to disk
(``fsync``) and renamed over its final name, so a crash mid-write leaves either the old
state or the new one, never a torn file. After every rank has written step ``s`` (a
barrier), each rank deletes its files of earlier steps: at any moment the newest step
that every rank holds is complete, and a resume agrees on it (:func:`newest_common`).

What a file holds is up to the caller (the training loop saves model, optimizer, data
position, random generators and the run's records so far); it is read back with
``torch.load(weights_only=True)``, so a checkpoint cannot run code when loaded.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import GradzipError

_STEP_DIR = re.compile(r"^step-(\d+)$")
#: How many of its newest steps each rank offers when the ranks agree on one to resume.
_OFFERED = 4


def rank_file(root: str | os.PathLike, step: int, rank: int, world_size: int) -> Path:
    return Path(root) / f"step-{step:09d}" / f"rank-{rank}-of-{world_size}.pt"


def save(root: str | os.PathLike, step: int, rank: int, world_size: int, payload: dict[str, Any]) -> Path:
    """Write this rank's ``payload`` for ``step`` atomically; returns the file's path."""
    final = rank_file(root, step, rank, world_size)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except OSError as exc:
        raise GradzipError(f"cannot write checkpoint {final}: {exc.strerror or exc}; check that "
                           "--checkpoint-dir is writable and the disk has space") from exc
    return final


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


def newest_common(comm, root: str | os.PathLike) -> int | None:
    """The newest step every rank holds a file for (None: start from scratch). Collective:
    each rank offers its newest few steps (one control allgather)."""
    mine = steps_held(root, comm.rank, comm.world_size)[-_OFFERED:]
    offer = torch.full((_OFFERED,), -1, dtype=torch.int64)
    offer[:len(mine)] = torch.tensor(mine, dtype=torch.int64)
    if comm.world_size > 1:
        offers = comm.allgather_control(offer).reshape(comm.world_size, -1).tolist()
    else:
        offers = [offer.tolist()]
    common = set.intersection(*({s for s in row if s >= 0} for row in offers))
    if common:
        return max(common)
    held = [sorted(s for s in row if s >= 0) for row in offers]
    if any(held):
        raise GradzipError(
            f"checkpoint directory {root} holds no step that every rank has (steps per rank: "
            + "; ".join(f"rank {r}: {h or 'none'}" for r, h in enumerate(held))
            + "); resume with the same number of workers, or start in a new directory"
        )
    sizes = world_sizes_present(root) if Path(root).is_dir() else set()
    if sizes:
        raise GradzipError(
            f"checkpoint directory {root} holds checkpoints of {', '.join(map(str, sorted(sizes)))} "
            f"workers, not {comm.world_size}; resume with that many workers or start in a new directory"
        )
    return None


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
            f"delete the directory {path.parent} to resume from the checkpoint before it"
        ) from None


def prune(root: str | os.PathLike, rank: int, world_size: int, keep_from: int) -> None:
    """Delete this rank's files of steps before ``keep_from`` (and step directories left
    empty), and temporary files a killed write of this rank left behind. Call only once
    every rank holds ``keep_from``."""
    for tmp in Path(root).glob(f"step-*/.rank-{rank}-of-{world_size}.pt.tmp-*"):
        tmp.unlink(missing_ok=True)
    for step in steps_held(root, rank, world_size):
        if step < keep_from:
            path = rank_file(root, step, rank, world_size)
            path.unlink(missing_ok=True)
            try:
                path.parent.rmdir()
            except OSError:  # other ranks' files are still there
                pass

