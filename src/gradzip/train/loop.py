"""The training loop one worker runs: data shard, model, method, timers, evaluation.

:func:`run_worker` is what every rank executes, whatever launched it (``gradzip.simulate``
threads, :func:`gradzip.launch.run_processes`, or ``torchrun``). It returns, on every
rank, the evaluation history and a summary; rank 0's are the run's record.

Time per step is split into *compute* (forward + backward), *compress* (codec work:
compress, decode, packing — measured inside PSync), *communicate* (time blocked waiting
for collectives) and *update* (the rest of ``optimizer.step()``). Bytes are what this
worker's exchanges put on the wire (``gradzip.comm.base`` explains the count).
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import consistency, optim, seeds
from ..version import __version__
from ..comm import Group
from ..errors import GradzipError
from ..trace import Tracer, maybe_span
from . import checkpoint, datasets, models
from .config import method_class


@dataclass
class RunConfig:
    """One training run (the CLI's flags, and what ``summary.json`` records)."""

    algo: str = "ssgd"
    options: dict[str, Any] = field(default_factory=dict)  # method options: compressor=, threshold=, ...
    label: str = ""
    dataset: str = "digits"
    data_dir: str | None = None
    download: bool = False        # fetch missing dataset files (off: no surprise network traffic)
    model: str = "mlp"
    epochs: int = 20
    batch_size: int = 32          # per worker; the global batch is batch_size * workers
    lr: float = 0.1
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    seed: int = 0
    trace: bool = False           # record a timeline (gradzip.trace) of every step
    eval_on: str = "auto"         # "local" model, the workers' "average", or "auto" (average where they differ)
    nonfinite: str = "raise"      # a NaN/Inf gradient: "raise", "skip" the step on every worker, or "off"
    checkpoint_dir: str | None = None   # write checkpoints here (per rank, atomically)
    checkpoint_every: int = 0     # steps between checkpoints; 0: at the end of every epoch
    resume: bool = False          # continue from the newest checkpoint in checkpoint_dir, if any
    progress: bool = True

    @property
    def name(self) -> str:
        return self.label or self.algo


def make_optimizer(cfg: RunConfig, params, comm: Group) -> optim.DistributedOptimizer:
    """The method named ``cfg.algo`` with the common hyper-parameters and its own options;
    an option the method does not take is an error that names the method's options."""
    cls = method_class(cfg.algo)
    accepted = set(optim.method_options(cls))
    unknown = sorted(set(cfg.options) - accepted)
    if unknown:
        raise GradzipError(
            f"method {cfg.algo!r} takes no option {', '.join(unknown)}; its options: "
            f"{', '.join(sorted(accepted)) or 'none'}"
        )
    return cls(params, lr=cfg.lr, comm=comm, momentum=cfg.momentum, nesterov=cfg.nesterov,
               weight_decay=cfg.weight_decay, seed=cfg.seed, nonfinite=cfg.nonfinite, **cfg.options)


#: RunConfig fields that do not change a run's numbers: they may differ between workers and
#: between a run and its resumption (a resumed run may also train for more epochs).
_FREE_FIELDS = ("label", "data_dir", "download", "trace", "progress", "checkpoint_dir", "checkpoint_every", "resume")


def trajectory_fields(cfg: RunConfig) -> dict[str, Any]:
    """The settings that determine a run's numbers (compared across workers and against a
    checkpoint)."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _FREE_FIELDS}


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1024) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on ``(x, y)``."""
    model.eval()
    correct, loss = 0, 0.0
    for i in range(0, len(x), batch):
        out = model(x[i:i + batch])
        loss += F.cross_entropy(out, y[i:i + batch], reduction="sum").item()
        correct += (out.argmax(1) == y[i:i + batch]).sum().item()
    model.train()
    return correct / len(x), loss / len(x)


def evaluation_model(model: torch.nn.Module, opt: optim.DistributedOptimizer, comm: Group,
                     eval_on: str) -> torch.nn.Module:
    """The model to evaluate, without touching training state: the optimizer's evaluation
    parameters if it has any, else the model's own; averaged over the workers (one
    allreduce of parameters and float buffers) for ``"average"``, or for ``"auto"`` when the
    method's replicas differ. Collective when averaging: every rank must call it."""
    if eval_on not in ("auto", "average", "local"):
        raise GradzipError(f"eval_on must be 'auto', 'average' or 'local', got {eval_on!r}")
    override = opt.evaluation_parameters()
    average = eval_on == "average" or (eval_on == "auto" and opt.replicas_differ)
    if override is None and not (average and comm.world_size > 1):
        return model
    copy = deepcopy(model)
    params = list(copy.parameters())
    with torch.no_grad():
        if override is not None:
            for p, value in zip(params, override):
                p.copy_(value)
        if average and comm.world_size > 1:
            tensors = params + [b for b in copy.buffers() if b.is_floating_point()]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            comm.allreduce(flat).div_(comm.world_size)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
    return copy


PHASES = ("compute", "compress", "communicate", "wait", "update")


def _phase_times(compute_s: float, step_s: float, t) -> list[float]:
    """[compute, compress, communicate, wait, update] seconds; ``update`` is the part of
    ``optimizer.step()`` that was neither codec work nor waiting on the network."""
    return [compute_s, t.compress_s, t.communicate_s, t.wait_s,
            max(0.0, step_s - t.wait_s - t.inline_compress_s)]


def run_worker(comm: Group, cfg: RunConfig, after_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Train ``cfg`` on this worker; ``{"summary": ..., "history": [...]}``. Wall time
    counts from the first step (set-up, i.e. data loading and the first collective, is
    ``setup_time_s``).

    Before training, the workers compare their settings (:mod:`gradzip.consistency`). With
    ``cfg.checkpoint_dir`` the run writes checkpoints (:mod:`gradzip.train.checkpoint`):
    model, optimizer (residuals, errors, global/local models, momentum, counters), data
    position, random generators and the records so far; with ``cfg.resume`` it continues
    from the newest one every rank holds, and ends with the same bits as a run never
    interrupted. ``after_step(steps_done)`` is called after every step (tests inject faults
    with it)."""
    setup_began = time.perf_counter()
    ds = datasets.load(cfg.dataset, cfg.data_dir, download=cfg.download)
    model = models.build(cfg.model, ds.input_shape, ds.num_classes, seed=cfg.seed)
    consistency.verify(comm, {**trajectory_fields(cfg), "gradzip version": __version__,
                              "world size": comm.world_size, "training samples": len(ds.train_x),
                              "parameter shapes": [tuple(p.shape) for p in model.parameters()]},
                       what="run settings")
    for p in model.parameters():  # identical start on every worker, whatever built it
        comm.broadcast(p.data, src=0)
    opt = make_optimizer(cfg, model.parameters(), comm)
    opt.verify_consistent()
    steps_per_epoch = len(ds.train_x) // comm.world_size // cfg.batch_size
    if steps_per_epoch < 1:
        raise GradzipError(
            f"{cfg.dataset} has {len(ds.train_x)} training samples, fewer than one batch of "
            f"{cfg.batch_size} per worker for {comm.world_size} workers; lower --batch-size"
        )
    total = steps_per_epoch * cfg.epochs
    loop = {"done": 0, "history": [], "loss_sum": torch.zeros(()), "compute_s": 0.0, "step_s": 0.0,
            "previous": [0.0] * len(PHASES), "diverged": False, "wall_time_s": 0.0}
    # the global generators (dropout, augmentation in user code) start from the run's seed
    # and this rank, whatever launched the process; a resume restores their saved state
    torch.manual_seed(seeds.worker_seed(cfg.seed, comm.rank))
    random.seed(seeds.worker_seed(cfg.seed, comm.rank))
    resumed_from = _resume(comm, cfg, model, opt, loop)
    tracer = Tracer(comm.rank) if cfg.trace else None
    opt.tracer = tracer
    bar = _progress(cfg, comm, total, loop["done"])
    comm.barrier()  # start every worker's clock together
    began = time.perf_counter() - loop["wall_time_s"]
    history = loop["history"]

    def save_checkpoint() -> None:
        loop["wall_time_s"] = time.perf_counter() - began
        _save(comm, cfg, model, opt, loop)

    first_epoch, first_batch = divmod(loop["done"], steps_per_epoch)
    first_epoch += 1
    for epoch in range(first_epoch, cfg.epochs + 1):
        order = datasets.shard(len(ds.train_x), comm.rank, comm.world_size, epoch, cfg.seed)
        for b in range(first_batch if epoch == first_epoch else 0, steps_per_epoch):
            idx = order[b * cfg.batch_size:(b + 1) * cfg.batch_size]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(ds.train_x[idx]), ds.train_y[idx])
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            loop["compute_s"] += t1 - t0
            loop["step_s"] += t2 - t1
            if tracer is not None:
                tracer.add("compute", t0, t1, step=opt.steps)
                tracer.add("step", t1, t2, cat="optimizer", step=opt.steps)
            loop["loss_sum"] += loss.detach()
            loop["done"] += 1
            if bar is not None:
                bar.update(1)
            if after_step is not None:
                after_step(loop["done"])
            if cfg.checkpoint_dir and cfg.checkpoint_every and loop["done"] % cfg.checkpoint_every == 0 \
                    and b < steps_per_epoch - 1:  # at an epoch's end: after its record, below
                save_checkpoint()
        # one small allreduce per epoch: the train loss and this epoch's phase times, averaged
        phases = _phase_times(loop["compute_s"], loop["step_s"], opt.timings)
        epoch_stats = torch.tensor([loop["loss_sum"].item() / steps_per_epoch,
                                    *(a - b for a, b in zip(phases, loop["previous"]))], dtype=torch.float64)
        loop["previous"], loop["loss_sum"] = phases, torch.zeros(())
        epoch_stats = comm.allreduce(epoch_stats).div_(comm.world_size).tolist()
        train_loss = epoch_stats[0]
        loop["diverged"] = loop["diverged"] or not math.isfinite(train_loss)
        wall = time.perf_counter() - began
        with maybe_span(tracer, "evaluate", cat="harness"):
            evaluated = evaluation_model(model, opt, comm, cfg.eval_on)  # waits for a background exchange
            record = {"algo": cfg.name, "epoch": epoch, "step": opt.steps, "train_loss": train_loss,
                      "bytes_sent_per_worker": opt.bytes_sent, "wall_time_s": wall,
                      **{f"time_{k}_s": v for k, v in zip(PHASES, epoch_stats[1:])},
                      "skipped_steps": opt.skipped_steps, **opt.metrics()}
            if comm.rank == 0:
                record["test_accuracy"], record["test_loss"] = evaluate(evaluated, ds.test_x, ds.test_y)
            if bar is not None:
                bar.set_postfix(loss=f"{train_loss:.3f}", acc=f"{record['test_accuracy']:.3f}")
        history.append(record)
        if cfg.checkpoint_dir and (loop["done"] == total or not cfg.checkpoint_every
                                   or loop["done"] % cfg.checkpoint_every == 0):
            save_checkpoint()
    if bar is not None:
        bar.close()
    mine = torch.tensor(_phase_times(loop["compute_s"], loop["step_s"], opt.timings), dtype=torch.float64)
    per_worker = comm.allgather(mine)  # one row of phase times per worker
    wall = time.perf_counter() - began
    summary = {
        "algo": cfg.name,
        "method": cfg.algo,
        "options": {k: str(v) for k, v in cfg.options.items()},
        "workers": comm.world_size,
        "dataset": cfg.dataset,
        "model": cfg.model,
        "epochs": cfg.epochs,
        "batch_size_per_worker": cfg.batch_size,
        "lr": cfg.lr,
        "momentum": cfg.momentum,
        "seed": cfg.seed,
        "steps": opt.steps,
        "skipped_steps": opt.skipped_steps,
        "resumed_from_step": resumed_from,
        "final_test_accuracy": history[-1].get("test_accuracy") if history else None,
        "best_test_accuracy": max((h.get("test_accuracy") or 0.0) for h in history) if history else None,
        "diverged": loop["diverged"],
        "bytes_sent_per_worker": opt.bytes_sent,
        "compression_ratio": opt.compression_ratio,
        "parameters": sum(p.numel() for p in model.parameters()),
        "eval_on": cfg.eval_on,
        **opt.metrics(),
        "wall_time_s": wall,
        "setup_time_s": began + loop["wall_time_s"] - setup_began,  # this process's set-up
        "time_per_step_s": wall / max(loop["done"], 1),
        # phase times: mean over workers, and every worker's own row
        **{f"time_{k}_s": per_worker[:, i].mean().item() for i, k in enumerate(PHASES)},
        "time_per_worker_s": {k: per_worker[:, i].tolist() for i, k in enumerate(PHASES)},
    }
    return {"summary": summary, "history": history, "config": dataclasses.asdict(cfg),
            "trace": tracer.events if tracer is not None else None}


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


def _save(comm: Group, cfg: RunConfig, model, opt, loop: dict[str, Any]) -> None:
    """This rank's checkpoint at ``loop["done"]`` steps; once every rank has written it (a
    barrier), the earlier ones are deleted."""
    step = loop["done"]
    checkpoint.save(cfg.checkpoint_dir, step, comm.rank, comm.world_size, {
        "format": 1, "gradzip_version": __version__, "config": trajectory_fields(cfg),
        "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": _rng_state(),
        "loop": loop,
    })
    comm.barrier()
    checkpoint.prune(cfg.checkpoint_dir, comm.rank, comm.world_size, keep_from=step)


def _resume(comm: Group, cfg: RunConfig, model, opt, loop: dict[str, Any]) -> int | None:
    """Load the newest checkpoint every rank holds into ``model``, ``opt`` and ``loop``;
    the step resumed from, or None. Collective."""
    if not cfg.checkpoint_dir:
        return None
    step = checkpoint.newest_common(comm, cfg.checkpoint_dir)
    if step is None:
        return None
    if not cfg.resume:
        raise GradzipError(
            f"{cfg.checkpoint_dir} already holds a checkpoint (step {step}); continue that run with "
            "--resume DIR, or write checkpoints to an empty directory"
        )
    saved = checkpoint.load(cfg.checkpoint_dir, step, comm.rank, comm.world_size)
    now = trajectory_fields(cfg)
    for name in sorted((set(now) | set(saved["config"])) - set(_FREE_FIELDS)):
        if name != "epochs" and saved["config"].get(name) != now.get(name):
            raise GradzipError(
                f"cannot resume from {cfg.checkpoint_dir}: it was written with {name}="
                f"{saved['config'].get(name)!r}, this run has {name}={now.get(name)!r}; resume with "
                "the same settings (only the number of epochs may change), or start in a new directory"
            )
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    loop.update(saved["loop"])
    _set_rng_state(saved["rng"])
    return step


def run_many(comm: Group, cfgs: list[RunConfig]) -> list[dict[str, Any]]:
    """Several runs in the same group, one after the other (``gradzip compare``)."""
    return [run_worker(comm, cfg) for cfg in cfgs]


def _progress(cfg: RunConfig, comm: Group, total: int, done: int):
    if not cfg.progress or comm.rank != 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc=f"{cfg.name} ({comm.world_size} workers)",
                unit="step", leave=False, dynamic_ncols=True)
