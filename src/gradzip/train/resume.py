"""What a run's checkpoint holds and how a run resumes from one (docs/reliability.md,
"Checkpoints and exact resume"): :func:`save` writes this rank's file (the run's settings and
environment, model, optimizer, generators and the loop's state) and prunes older steps;
:func:`resume` takes the newest step every rank holds and verifies, refusing one of other
settings in one line naming the setting that was changed (:func:`_check_resumable`) and
noting another backend or thread count (:func:`_note_environment`). The files themselves
(names, checksums, choosing, damage) are :mod:`.checkpoint`'s; the loop calls these two."""
from __future__ import annotations

import random
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..comm import Group, ThreadGroup, TorchGroup
from ..errors import GradzipError
from ..guards import consistency
from ..optim.core.agreement import derived_setting
from ..version import __version__
from . import checkpoint
from .config import FREE_FIELDS, trajectory_fields


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


#: What a gradzip checkpoint's payload holds (anything else is not one).
_PAYLOAD_KEYS = {"format", "gradzip_version", "config", "settings", "environment", "model", "optimizer", "rng",
                 "loop"}


def _environment(comm: Group) -> dict[str, Any]:
    """What the workers ran on that can change the numbers without changing a setting:
    the backend (threads sum in rank order, gloo's ring in its own) and torch's intra-op
    thread count (CPU kernels split sums by it). Recorded in checkpoints; a resume on
    another is noted (:func:`_note_environment`)."""
    if isinstance(comm, TorchGroup):
        backend = str(dist.get_backend(comm.group))
    else:
        backend = "threads" if isinstance(comm, ThreadGroup) else type(comm).__name__
    return {"backend": backend, "threads": torch.get_num_threads()}


def save(job) -> None:
    """This rank's checkpoint at ``state.done`` steps; once every rank has written it (a
    barrier), steps older than the newest ``cfg.keep_checkpoints`` are deleted."""
    comm, cfg, state = job.comm, job.cfg, job.state
    state.wall_time_s = time.perf_counter() - job.began
    state.scaler = job.precision.state_dict()
    checkpoint.save(cfg.checkpoint_dir, state.done, comm.rank, comm.world_size, {
        "format": 3, "gradzip_version": __version__, "config": trajectory_fields(cfg), "settings": job.settings,
        "environment": _environment(comm), "model": job.model.state_dict(), "optimizer": job.opt.state_dict(),
        "rng": _rng_state(), "loop": state.as_dict(),
    }, run=job.run)
    comm.barrier()
    checkpoint.prune(cfg.checkpoint_dir, comm.rank, comm.world_size, keep=cfg.keep_checkpoints)


def resume(job) -> int | None:
    """Load the newest checkpoint every rank holds and that verifies (:func:`checkpoint.choose`)
    into the model, the optimizer and the loop state (model and optimizer state first: the
    optimizer's first step comes after), and take its run identity; the step resumed from,
    or None (a new run identity). Collective."""
    comm, cfg = job.comm, job.cfg
    if not cfg.checkpoint_dir:
        return None
    checkpoint.remove_temporaries(cfg.checkpoint_dir, comm.rank, comm.world_size)
    held = checkpoint.gather_held(comm, cfg.checkpoint_dir)
    if any(held) and not cfg.resume:
        raise GradzipError(
            f"{cfg.checkpoint_dir} already holds a checkpoint (step {max(max(h) for h in held if h)}); continue "
            "that run with --resume DIR, or write checkpoints to an empty directory"
        )
    note = (lambda text: print(f"gradzip: note: {text}", file=sys.stderr, flush=True)) if comm.rank == 0 else None
    found = checkpoint.choose(comm, cfg.checkpoint_dir, held, note, start_over=cfg.start_over)
    checkpoint.discard_after(cfg.checkpoint_dir, comm.rank, comm.world_size, found.step if found else None)
    if found is None:
        job.run = checkpoint.new_run(comm)
        if cfg.resume and not any(held) and note is not None:
            note(f"no checkpoint in {cfg.checkpoint_dir}: starting from scratch")
        return None
    step, saved, job.run = found.step, found.payload, found.run
    path = checkpoint.rank_file(cfg.checkpoint_dir, step, comm.rank, comm.world_size)
    if not isinstance(saved, dict) or not _PAYLOAD_KEYS <= set(saved):
        raise GradzipError(f"{path} is not a gradzip checkpoint (it lacks "
                           f"{', '.join(sorted(_PAYLOAD_KEYS - set(saved if isinstance(saved, dict) else ())))}); "
                           "give the directory a gradzip run wrote, or start in a new directory")
    _check_resumable(job, saved, step)
    _note_environment(comm, saved["environment"], note)
    job.model.load_state_dict(saved["model"])
    job.opt.load_state_dict(saved["optimizer"])
    job.state = type(job.state).from_dict(saved["loop"])
    job.precision.load_state_dict(job.state.scaler)
    _set_rng_state(saved["rng"])
    return step


def _check_resumable(job, saved: dict[str, Any], step: int) -> None:
    """Refuse a checkpoint of other settings or one past this run's end. The settings are
    compared field by field, the run's own first (``--seed``, ``--model``, ``--lr``, ...:
    the checkpoint's ``config`` against this run's), then the method's resolved settings
    (``describe()``: an option given explicitly at its default value is the same setting),
    those that follow from others last (:func:`gradzip.optim.core.agreement.derived_setting`: a
    parameter's values, a transport plan), so that the refusal names the setting that
    was changed, not one that follows from it."""
    cfg = job.cfg
    own = [{k: v for k, v in fields.items() if k not in ("options", "epochs", *FREE_FIELDS)}
           for fields in (saved["config"], trajectory_fields(cfg))]
    for then, now, later in ((*own, None), (saved["settings"], job.settings, derived_setting)):
        names = consistency.differing([then, now], later)
        if names:
            name = names[0]
            raise GradzipError(
                f"cannot resume from {cfg.checkpoint_dir}: it was written with {name}="
                f"{then.get(name, consistency.NOT_SET)!r}, this run has {name}={now.get(name, consistency.NOT_SET)!r}"
                f"{consistency.more_fields(names)}; resume with the same settings (only the number of epochs may "
                "change), or start in a new directory"
            )
    if job.schedule is not None and job.schedule.name == "cosine" and saved["config"].get("epochs") != cfg.epochs:
        raise GradzipError(
            f"cannot resume from {cfg.checkpoint_dir}: --lr-schedule {cfg.lr_schedule} decays over the whole run, "
            f"which was {saved['config'].get('epochs')} epochs when it was written and is {cfg.epochs} now; resume "
            f"with --epochs {saved['config'].get('epochs')}, or start in a new directory"
        )
    if step > job.total:
        epochs = -(-step // job.steps_per_epoch)
        raise GradzipError(
            f"cannot resume from {cfg.checkpoint_dir}: its checkpoint is at step {step} (epoch {epochs}), past "
            f"the end of this run ({cfg.epochs} epochs, {job.total} steps); resume with --epochs {epochs} or "
            "more, or start in a new directory"
        )


def _note_environment(comm: Group, saved: dict[str, Any], note: Callable[[str], None] | None) -> None:
    """Say, in one line, when the checkpoint was written on another backend or thread
    count than this run's (:func:`_environment`): the run resumes, but need not repeat an
    uninterrupted run's numbers bit for bit. Collective (one small allgather)."""
    now = _environment(comm)
    row = torch.tensor([saved["threads"], now["threads"], int(saved["backend"] != now["backend"])], dtype=torch.int64)
    rows = comm.allgather_control(row).reshape(comm.world_size, -1).tolist()
    changed = [r for r, (then_threads, now_threads, other) in enumerate(rows) if then_threads != now_threads or other]
    if changed and note is not None:
        then_threads, now_threads, _ = rows[changed[0]]
        note(f"the checkpoint was written by workers on {saved['backend']} with {then_threads} torch thread(s) "
             f"each, this run's are on {now['backend']} with {now_threads} (rank(s) {', '.join(map(str, changed))}): "
             "it resumes, but may not repeat an uninterrupted run's numbers bit for bit (CPU kernels split sums "
             f"by thread count, backends sum in different orders); resume on {saved['backend']} with "
             f"OMP_NUM_THREADS={then_threads} to repeat them (docs/reliability.md, Determinism)")
