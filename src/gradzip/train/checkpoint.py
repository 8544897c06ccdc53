"""Checkpoints that resume a run exactly: one file per rank, written atomically, checked
on load, never deleted for being damaged.

Layout: ``DIR/step-<000000123>/rank-<r>-of-<n>.pt``, one directory per checkpointed step,
and beside each file its checksum, ``rank-<r>-of-<n>.sha256`` (``sha256sum`` format, so
``sha256sum -c`` checks it by hand). A file holds what the caller saves and the file's
identity: the rank, world size and step it was written for, and the run's identity (a
random number drawn when a run starts from scratch, kept by every resume of it).

Writing (:func:`save`): the file, then its checksum computed from what was written, each
through :func:`gradzip.files.write_atomically` (temporary, ``fsync``, rename): a crash
mid-write leaves the old state or the new one, never a torn file that passes for a
checkpoint. After every rank has written step ``s`` (a barrier), each rank keeps its
newest ``keep`` steps (at least :data:`MIN_KEEP`) and deletes the older ones
(:func:`prune`): a step found damaged later has a complete one before it.

Resuming (:func:`gather_held`, then :func:`choose`): the ranks agree on the newest step
that every rank holds and whose every file is sound (:func:`examine`): it matches its
checksum, loads (``torch.load(weights_only=True)``: a checkpoint cannot run code), and is
the file of its rank, world size and step, of the same run as the other ranks' files. A
file found unsound is moved aside (renamed ``NAME.rejected-<UTC time>``, its checksum
likewise), never deleted, and one line names it and the step taken instead. When no step
that every rank holds is sound, the resume is refused naming the file, and nothing is
changed, unless the caller asks to start over. When the ranks hold no step in common, the
run starts from scratch if they hold one step between them (the run's first checkpoint was
interrupted), and is refused the same way otherwise (a rank's files are missing). The
files of steps after the one resumed (they are recomputed) are deleted
(:func:`discard_after`), the temporaries of killed writes too (:func:`remove_temporaries`).

Listing tolerates step directories that another rank removes at the same moment (each
rank's :func:`prune` removes a step directory once it is empty).
"""
from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import GradzipError, first_line
from ..files import leftovers, names, write_atomically, write_text
from ..validation import is_int

_STEP_DIR = re.compile(r"^step-(\d+)$")
_RANK_FILE = re.compile(r"^rank-\d+-of-(\d+)\.pt$")
_CHUNK = 1 << 20
#: The fewest steps each rank keeps: the newest, and one to fall back to if it is damaged.
MIN_KEEP = 2
#: The option that lets a resume start from scratch when no step is sound (named in messages).
START_OVER = "--start-over-if-damaged"


def rank_file(root: str | os.PathLike, step: int, rank: int, world_size: int) -> Path:
    return Path(root) / f"step-{step:09d}" / f"rank-{rank}-of-{world_size}.pt"


def checksum_file(path: Path) -> Path:
    """The checksum file of the rank file ``path``."""
    return path.with_suffix(".sha256")


def check_keep(keep: Any) -> int:
    """``keep`` steps per rank (:func:`prune`), or a :class:`GradzipError`."""
    if not is_int(keep) or keep < MIN_KEEP:
        raise GradzipError(f"--keep-checkpoints must be an integer >= {MIN_KEEP} (the newest step and one to "
                           f"resume from if it is damaged), got {keep!r}")
    return int(keep)


def save(root: str | os.PathLike, step: int, rank: int, world_size: int, payload: dict[str, Any],
         run: int = 0) -> Path:
    """Write this rank's ``payload`` for ``step`` of run ``run`` (its identity, recorded
    in the file) atomically, then its checksum; returns the file's path. On failure (disk
    full, permissions) nothing of this step is left behind and a :class:`GradzipError`
    names the directory and the space needed."""
    final = rank_file(root, step, rank, world_size)
    record = {"identity": {"rank": rank, "world_size": world_size, "step": step, "run": run}, "payload": payload}
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(final, lambda f: torch.save(record, f), binary=True)
        write_text(checksum_file(final), f"{sha256(final)}  {final.name}\n")
    except (OSError, RuntimeError, ValueError) as exc:  # torch.save: RuntimeError (inline_container.cc) on a full disk
        for leftover in (checksum_file(final), final):
            _unlink(leftover)
        raise GradzipError(_write_failure(final, exc, payload)) from None
    return final


def _write_failure(final: Path, exc: BaseException, payload: Any) -> str:
    if isinstance(exc, OSError):
        reason = exc.strerror or str(exc)
    else:
        reason = first_line(exc, last=True)
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


def _step_dirs(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, directory) of the step directories in ``root``, oldest first."""
    found = ((_STEP_DIR.match(name), name) for name in names(root))
    return sorted((int(match.group(1)), Path(root) / name) for match, name in found if match)


def steps_held(root: str | os.PathLike, rank: int, world_size: int) -> list[int]:
    """The steps for which this rank's file exists in ``root``, oldest first."""
    return [step for step, _ in _step_dirs(root) if rank_file(root, step, rank, world_size).is_file()]


def world_sizes_present(root: str | os.PathLike) -> set[int]:
    """World sizes of the rank files in ``root`` (to explain a mismatch)."""
    return {int(match.group(1)) for _, directory in _step_dirs(root) for name in names(directory)
            if (match := _RANK_FILE.match(name))}


def gather_held(comm, root: str | os.PathLike) -> list[list[int]]:
    """Per rank, the steps it holds in ``root`` (collective: two control allgathers).
    Raises when ``root`` holds only checkpoints of another world size."""
    mine = steps_held(root, comm.rank, comm.world_size)
    longest = max(row[0] for row in _rows(comm, [len(mine)]))
    held = [sorted(s for s in row if s >= 0) for row in _rows(comm, mine + [-1] * (longest - len(mine)))]
    if not any(held):
        sizes = world_sizes_present(root)
        if sizes:
            raise GradzipError(
                f"checkpoint directory {root} holds checkpoints of {', '.join(map(str, sorted(sizes)))} "
                f"workers, not {comm.world_size}; resume with that many workers or start in a new directory"
            )
    return held


#: What :func:`examine` finds wrong with a rank's file (code = index + 1, exchanged by the
#: ranks); ``{rank}``, ``{world}``, ``{step}``: the identity the file records.
PROBLEMS = ("has no checksum file (its write was interrupted)",
            "has an unreadable checksum file",
            "cannot be read",
            "does not match its SHA-256 checksum (the file is damaged)",
            "matches its checksum but does not load as a checkpoint (empty or truncated when written)",
            "records no rank, step and run (not a checkpoint of this gradzip version)",
            "holds the state of rank {rank} of {world} workers at step {step}, not its own (files swapped, "
            "renamed or copied)",
            "belongs to another run than the other ranks' files of its step")
_OTHER_RUN = len(PROBLEMS)


def verify(root: str | os.PathLike, step: int, rank: int, world_size: int) -> str | None:
    """What is wrong with the bytes of this rank's file of ``step`` (one of the first four
    :data:`PROBLEMS`; None: it matches its checksum)."""
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


@dataclass
class Examined:
    """What :func:`examine` found: ``code`` 0 (sound) or a :data:`PROBLEMS` index + 1, the
    file's identity as recorded (``run``, ``rank``, ``world_size``, ``step``; zeros when it
    records none), the caller's payload when the file loads, and a detail for one line."""

    code: int
    identity: tuple[int, int, int, int] = (0, 0, 0, 0)
    payload: Any = None
    detail: str = ""


def examine(root: str | os.PathLike, step: int, rank: int, world_size: int) -> Examined:
    """Whether this rank's file of ``step`` is sound: it matches its checksum, loads, and
    records this rank, world size and step (the run is compared across ranks by :func:`choose`)."""
    problem = verify(root, step, rank, world_size)
    if problem is not None:
        return Examined(PROBLEMS.index(problem) + 1)
    try:
        with open(rank_file(root, step, rank, world_size), "rb") as f:
            record = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises several types for a bad file
        said = f": {first_line(exc)}" if str(exc).strip() else ""
        return Examined(5, detail=f"{type(exc).__name__}{said}")
    identity = record.get("identity") if isinstance(record, dict) and set(record) == {"identity", "payload"} else None
    keys = ("run", "rank", "world_size", "step")
    if not isinstance(identity, dict) or not all(is_int(identity.get(k)) for k in keys):
        return Examined(6)
    recorded = tuple(int(identity[k]) for k in keys)
    if recorded[1:] != (rank, world_size, step):
        return Examined(7, recorded)
    return Examined(0, recorded, record["payload"])


def load(root: str | os.PathLike, step: int, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's payload of ``step``, if its file is sound (:func:`examine`); a one-line
    :class:`GradzipError` naming the file and what is wrong with it otherwise."""
    found = examine(root, step, rank, world_size)
    if found.code:
        path = rank_file(root, step, rank, world_size)
        detail = f" ({found.detail})" if found.detail else ""
        raise GradzipError(f"checkpoint file {path} {_problem(found.code, found.identity)}{detail}")
    return found.payload


def _problem(code: int, identity) -> str:
    _, rank, world, step = identity
    return PROBLEMS[code - 1].format(rank=rank, world=world, step=step)


@dataclass
class Found:
    """The step a run resumes from, this rank's payload of it, and the run's identity."""

    step: int
    payload: Any
    run: int


@dataclass
class _Rejected:
    step: int
    rows: list[list[int]]     # per rank: [code, run, rank, world_size, step] (the identity its file records)

    def bad(self) -> list[int]:
        """The ranks whose file of this step is unsound."""
        return [r for r, row in enumerate(self.rows) if row[0]]

    def what(self, root, rank: int) -> str:
        """``checkpoint file PATH PROBLEM`` for ``rank``'s file of this step."""
        code, *identity = self.rows[rank]
        return f"checkpoint file {rank_file(root, self.step, rank, len(self.rows))} {_problem(code, identity)}"


def _rows(comm, values: list[int]) -> list[list[int]]:
    """Every rank's ``values`` (as many on every rank), in rank order: one control allgather."""
    if not values:
        return [[] for _ in range(comm.world_size)]
    return comm.allgather_control(torch.tensor(values, dtype=torch.int64)).reshape(comm.world_size, -1).tolist()


def new_run(comm) -> int:
    """A fresh run identity, the same on every rank (rank 0's draw). Collective."""
    return _rows(comm, [secrets.randbits(62)])[0][0]


def choose(comm, root: str | os.PathLike, held: list[list[int]], note: Callable[[str], None] | None = None,
           start_over: bool = False) -> Found | None:
    """The newest step that every rank holds (``held``: :func:`gather_held`) and whose
    every file is sound, with this rank's payload and the run's identity; None: start from
    scratch (nothing held; a first checkpoint interrupted; or ``start_over``). Files found
    unsound are moved aside (never deleted) when the run goes on, and ``note`` says so in
    one line; with no sound step and no ``start_over`` a :class:`GradzipError` names the
    file and nothing is changed. Collective: one small allgather per step examined, one
    more when files are moved aside; every rank returns or raises alike."""
    common = sorted(set.intersection(*(set(h) for h in held)), reverse=True)
    rejected: list[_Rejected] = []
    found = None
    for step in common:
        mine = examine(root, step, comm.rank, comm.world_size)
        rows = _rows(comm, [mine.code, *mine.identity])
        _mark_other_runs(rows)
        if not any(r[0] for r in rows):
            found = Found(step, mine.payload, rows[0][1])
            break
        rejected.append(_Rejected(step, rows))
    if found is None and any(held) and not start_over:
        if rejected or len(set().union(*held)) > 1:
            raise GradzipError(_refusal(root, rejected, held))
    moved = _move_aside(comm, root, rejected) if rejected else []
    if note is not None and (rejected or (found is None and any(held))):
        note(_outcome(root, moved, held, found, start_over))
    return found


def _mark_other_runs(rows: list[list[int]]) -> None:
    """Among the files of a step that are otherwise sound, those of a run other than the
    most common one (ties: the lowest rank's) get the "another run" code."""
    runs = [row[1] for row in rows if not row[0]]
    if len(set(runs)) > 1:
        common = max(Counter(runs).items(), key=lambda kv: (kv[1], -runs.index(kv[0])))[0]
        for row in rows:
            if not row[0] and row[1] != common:
                row[0] = _OTHER_RUN


def _move_aside(comm, root, rejected: list[_Rejected]) -> list[str]:
    """Rename this rank's unsound files of the ``rejected`` steps to ``NAME.rejected-<UTC
    time>`` (their checksums likewise); per unsound file of every rank, newest step first,
    ``"FILE PROBLEM: moved aside to NAME"``. Collective (one allgather of the times used)."""
    stamps = _rows(comm, [_rename_aside(rank_file(root, r.step, comm.rank, comm.world_size)) if r.rows[comm.rank][0]
                          else 0 for r in rejected])
    lines = []
    for i, r in enumerate(rejected):
        for rank in r.bad():
            if stamps[rank][i] < 0:
                raise GradzipError(f"{r.what(root, rank)}, and it cannot be moved aside (renamed): make its "
                                   "directory writable, or start in a new directory")
            moved = _aside(rank_file(root, r.step, rank, len(r.rows)), stamps[rank][i])
            lines.append(f"{r.what(root, rank)}: moved aside to {moved.name}")
    return lines


def _aside(path: Path, stamp: int) -> Path:
    return path.with_name(f"{path.name}.rejected-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(stamp))}")


def _rename_aside(path: Path) -> int:
    """Rename ``path`` and its checksum file to their :func:`_aside` names at the first
    second from now that names no existing file; the second used (-1: could not rename)."""
    stamp = int(time.time())
    while _aside(path, stamp).exists() or _aside(checksum_file(path), stamp).exists():
        stamp += 1
    try:
        for name in (path, checksum_file(path)):
            if name.exists():
                os.replace(name, _aside(name, stamp))
    except OSError:
        return -1
    return stamp


def _per_rank(held: list[list[int]]) -> str:
    return "; ".join(f"rank {r}: {', '.join(map(str, h)) or 'none'}" for r, h in enumerate(held))


def _refusal(root, rejected: list[_Rejected], held: list[list[int]]) -> str:
    if rejected:
        others = sum(len(r.bad()) for r in rejected) - 1
        what = (rejected[0].what(root, rejected[0].bad()[0])
                + (f" (and {others} more file(s) of {len(rejected)} step(s) fail too)" if others else "")
                + "; no step that every rank holds is sound")
    else:
        what = f"the ranks hold no step in common ({_per_rank(held)}): a rank's files are missing"
    return (f"cannot resume from {root}: {what}. Nothing was changed: restore the files, or resume with {START_OVER} "
            "to start from scratch (the files that fail are kept, renamed), or start in a new directory")


def _outcome(root, moved: list[str], held: list[list[int]], found: Found | None, start_over: bool) -> str:
    """The one line :func:`choose` notes when it skips steps or starts from scratch over files."""
    first = moved[0] + (f" (and {len(moved) - 1} more file(s) moved aside likewise)" if len(moved) > 1 else "") \
        if moved else f"checkpoint directory {root} holds no step that every rank has ({_per_rank(held)})"
    if found is not None:
        return f"{first}; resuming from step {found.step}, the newest step that verifies on every rank"
    if start_over:
        return f"{first}; no step verifies on every rank: starting from scratch ({START_OVER})"
    return f"{first}, as when the run's first checkpoint was interrupted: starting from scratch"


def newest_common(comm, root: str | os.PathLike, note: Callable[[str], None] | None = None,
                  start_over: bool = False) -> int | None:
    """The step :func:`choose` resumes from (None: from scratch). Collective."""
    found = choose(comm, root, gather_held(comm, root), note, start_over)
    return found.step if found is not None else None


def remove_temporaries(root: str | os.PathLike, rank: int, world_size: int) -> None:
    """Delete the temporary files a killed write of this rank left in ``root``."""
    for step, _ in _step_dirs(root):
        path = rank_file(root, step, rank, world_size)
        for tmp in leftovers(path) + leftovers(checksum_file(path)):
            _unlink(tmp)


def _remove_step(root: str | os.PathLike, step: int, rank: int, world_size: int) -> None:
    path = rank_file(root, step, rank, world_size)
    _unlink(checksum_file(path))
    _unlink(path)
    try:
        path.parent.rmdir()
    except OSError:  # other ranks' files (or files moved aside) are still there
        pass


def discard_after(root: str | os.PathLike, rank: int, world_size: int, step: int | None) -> None:
    """Delete this rank's files of steps after ``step`` (all of them for None): a resume
    from ``step`` recomputes them. Call after :func:`choose`, which has moved unsound files
    aside: what is deleted here is sound but of a step not every rank completed."""
    for held in steps_held(root, rank, world_size):
        if step is None or held > step:
            _remove_step(root, held, rank, world_size)


def prune(root: str | os.PathLike, rank: int, world_size: int, keep: int) -> None:
    """Keep this rank's newest ``keep`` steps; delete its older ones (and step directories
    left empty) and the temporary files a killed write of this rank left behind. Call only
    once every rank holds the newest step (after the barrier that follows its save)."""
    remove_temporaries(root, rank, world_size)
    for step in steps_held(root, rank, world_size)[:-check_keep(keep)]:
        _remove_step(root, step, rank, world_size)
