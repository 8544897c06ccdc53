"""The training loop one worker runs: data shard, model, method, timers, evaluation.

:func:`run_worker` is what every rank executes, whatever launched it (``gradzip.simulate``
threads, :func:`gradzip.comm.launch.run_processes`, or ``torchrun``). It returns, on every
rank, the evaluation history and a summary; rank 0's are the run's record.

Time per step is split into *compute* (forward + backward, less the exchange work that
gradient hooks run during backward, plus an injected straggler delay: ``cfg.straggler``,
:mod:`gradzip.train.stragglers`, slept before the forward pass, so it also holds back an exchange
that gradient hooks start during backward;
the seconds injected are also recorded as ``straggler_delay_s``), *compress* (codec work:
compress, decode, packing — measured inside PSync), *communicate* (time blocked waiting
for collectives) and *update* (the rest of ``optimizer.step()``). Bytes are what this
worker's exchanges put on the wire (``gradzip.comm.base`` explains the count).

One-time costs (numba compiling or loading its kernels, first-use allocation, the first
forward and backward) land in the first steps a process runs. The summary's
``steady_step_s`` holds each phase's seconds per step without them: measured over the steps
after this process's first :func:`warmup_steps`, their count in ``steady_steps``
(the projection of :mod:`gradzip.bench.projection` rests on them).
"""
from __future__ import annotations

import dataclasses
import math
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..guards import consistency
from .. import optim, seeds
from . import stragglers
from ..version import __version__
from ..comm import Group
from ..errors import GradzipError
from ..optim.landscape import sharpness
from ..trace import Tracer, maybe_span
from ..validation import is_int
from . import checkpoint, datasets, models, sharded
from . import resume as resume_lib
from .device import Precision, resolve_device
from .config import SEED_LIMIT, RunConfig, collective_fields, lr_rule, lr_schedule, make_optimizer, trajectory_fields
from .evaluation import evaluate_shared, evaluation_model


PHASES = ("compute", "compress", "communicate", "wait", "update")


def _phase_times(compute_s: float, step_s: float, t) -> list[float]:
    """[compute, compress, communicate, wait, update] seconds; ``update`` is the part of
    ``optimizer.step()`` that was neither codec work nor waiting on the network."""
    return [compute_s, t.compress_s, t.communicate_s, t.wait_s,
            max(0.0, step_s - t.wait_s - t.inline_compress_s)]


def warmup_steps(steps: int, steps_per_epoch: int) -> int:
    """Of the ``steps`` a process runs, how many are left out of ``steady_step_s`` as warm-up:
    the first epoch, or the first half of a shorter run (none of a one-step run)."""
    return min(steps_per_epoch, steps // 2)


def _exchange_blocked_s(opt) -> float:
    """Seconds the training thread has spent in the method's exchanges (codec work and
    waits): what a method overlapping backward (``overlaps_backward``) spends inside
    ``loss.backward()`` is moved from compute to the step, so no phase counts it twice."""
    t = opt.timings
    return t.inline_compress_s + t.wait_s


@dataclass
class LoopState:
    """Where the loop is: what a checkpoint saves besides model, optimizer and generators."""

    done: int = 0                  # steps done (hence epoch and batch: the data order is a function of seed and epoch)
    history: list[dict[str, Any]] = field(default_factory=list)   # one record per epoch so far
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(()))  # this epoch's train loss so far
    compute_s: float = 0.0         # clock readings, summed over the steps done
    step_s: float = 0.0
    previous: list[float] = field(default_factory=lambda: [0.0] * len(PHASES))  # phase times at the last epoch's end
    diverged: bool = False
    wall_time_s: float = 0.0       # training time before this process's start (a resumed run)
    straggler_s: float = 0.0       # injected straggler delays slept so far (counted in compute_s too)
    scaler: dict[str, Any] | None = None   # the fp16 GradScaler's state at the last checkpoint (--amp fp16)

    def as_dict(self) -> dict[str, Any]:
        """The fields by name, not copied (a checkpoint's ``"loop"``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> "LoopState":
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(saved, dict) or set(saved) != names:
            raise GradzipError("the checkpoint's loop state has other fields than this gradzip version's; "
                               "resume with the version that wrote it, or start in a new directory")
        return cls(**saved)


@dataclass
class _Job:
    """One run on one worker: what the loop's helpers share."""

    comm: Group
    cfg: RunConfig
    ds: Any
    model: torch.nn.Module
    opt: optim.DistributedOptimizer
    steps_per_epoch: int
    state: LoopState
    settings: dict[str, str]       # the optimizer's resolved settings (describe()), saved with a checkpoint
    device: torch.device = torch.device("cpu")
    precision: Precision | None = None   # autocast and, for fp16, the agreed GradScaler step
    after_step: Callable[[int], None] | None = None
    lr_rule: tuple[float, float, int] | None = None   # (η_base, η*, T_w): the large-batch schedule
    schedule: optim.Schedule | None = None   # --lr-schedule (None: a factor of 1 at every step)
    base_lrs: tuple[float, ...] = ()   # the rates of opt.lr_groups() before any step: what the schedule scales
    sam: optim.SAM | None = None   # SAM around ``opt`` (--sam-rho)
    tracer: Tracer | None = None
    bar: Any = None
    began: float = 0.0             # perf_counter() at which the run's clock (resumed: its clock) started
    straggler: stragglers.Straggler | None = None
    last_compute_s: float = 0.0    # the previous step's compute without its delay (slow:rank=R,factor=F)
    run: int = 0                   # the run's identity, recorded in its checkpoints (checkpoint.new_run)
    started: int = 0               # steps done when this process began (a resumed run: more than 0)
    warm_at: int = 0               # steps done when this process's warm-up ends (warmup_steps)
    warm: tuple[int, list[float]] | None = None   # (steps done, phase times) at that point

    @property
    def total(self) -> int:
        return self.steps_per_epoch * self.cfg.epochs


def run_worker(comm: Group, cfg: RunConfig, after_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Train ``cfg`` on this worker; ``{"summary": ..., "history": [...]}``. Wall time
    counts from the first step (set-up, i.e. data loading and the first collective, is
    ``setup_time_s``).

    Before training, the workers compare their settings (:mod:`gradzip.guards.consistency`),
    including those that change the sequence of collectives (checkpointing, epochs,
    evaluation). With ``cfg.checkpoint_dir`` the run writes checkpoints
    (:mod:`gradzip.train.checkpoint`): model, optimizer (residuals, errors, global/local
    models, momentum, counters), data position, random generators and the records so far;
    with ``cfg.resume`` it continues from the newest one every rank holds and that
    verifies (keeping ``cfg.keep_checkpoints`` steps; a damaged file is moved aside, never
    deleted), and ends with the same bits as a run never interrupted. ``after_step(steps_done)``
    is called after every step (tests inject faults with it)."""
    setup_began = time.perf_counter()
    job = _prepare(comm, cfg, after_step)
    resumed_from = resume_lib.resume(job)
    job.tracer = Tracer(comm.rank) if cfg.trace else None
    job.opt.tracer = job.tracer
    job.bar = _progress(cfg, comm, job.total, job.state.done)
    comm.barrier()  # start every worker's clock together
    job.began = time.perf_counter() - job.state.wall_time_s
    job.started = job.state.done
    job.warm_at = job.started + warmup_steps(job.total - job.started, job.steps_per_epoch)
    _mark_warm(job)
    first_epoch, first_batch = divmod(job.state.done, job.steps_per_epoch)
    for epoch in range(first_epoch + 1, cfg.epochs + 1):
        _train_epoch(job, epoch, first_batch if epoch == first_epoch + 1 else 0)
        job.state.history.append(_record(job, epoch))
        if cfg.checkpoint_dir and (job.state.done == job.total or not cfg.checkpoint_every
                                   or job.state.done % cfg.checkpoint_every == 0):
            resume_lib.save(job)
    if job.bar is not None:
        job.bar.close()
    summary = _summary(job, resumed_from, setup_began)
    if hasattr(job.opt, "close"):  # no step follows: stop its threads (A-SGD: the server's receiver)
        job.opt.close()
    return {"summary": summary, "history": job.state.history,
            "config": dataclasses.asdict(cfg), "trace": job.tracer.events if job.tracer is not None else None}


def _prepare(comm: Group, cfg: RunConfig, after_step) -> _Job:
    """Data, model (identical on every worker), optimizer, after the workers agreed on the
    settings; the global generators seeded from the run's seed and this rank."""
    checkpoint.check_directory(cfg.checkpoint_dir)
    checkpoint.check_keep(cfg.keep_checkpoints)
    if not is_int(cfg.seed) or not 0 <= cfg.seed < SEED_LIMIT:
        raise GradzipError(f"seed must be an integer in [0, 2**32), got {cfg.seed!r}")
    ds = datasets.load(cfg.dataset, cfg.data_dir, download=cfg.download)
    device = resolve_device(cfg.device, comm.rank)
    model = models.build(cfg.model, ds.input_shape, ds.num_classes, seed=cfg.seed).to(device)
    models.check_fits(cfg.model, model, ds.train_x[:1].to(device), ds.train_y[:1].to(device), cfg.dataset)
    consistency.verify(comm, {**trajectory_fields(cfg), **collective_fields(cfg), "gradzip version": __version__,
                              "world size": comm.world_size, "training samples": len(ds.train_x),
                              "parameter shapes": [tuple(p.shape) for p in model.parameters()]},
                       what="run settings")
    for p in model.parameters():  # identical start on every worker, whatever built it
        comm.broadcast(p.data, src=0)
    if sharded.is_sharded(cfg.algo):   # FSDP2 / HSDP: the model sharded, gradzip inside FSDP2
        model, opt = sharded.prepare(cfg, model, comm, device)
    else:
        opt = make_optimizer(cfg, model.parameters(), comm)
    opt.verify_consistent()
    steps_per_epoch = len(ds.train_x) // comm.world_size // cfg.batch_size
    if steps_per_epoch < 1:
        raise GradzipError(
            f"{cfg.dataset} has {len(ds.train_x)} training samples, fewer than one batch of "
            f"{cfg.batch_size} per worker for {comm.world_size} workers; lower --batch-size"
        )
    # the global generators (dropout, augmentation in user code) start from the run's seed
    # and this rank, whatever launched the process; a resume restores their saved state
    torch.manual_seed(seeds.worker_seed(cfg.seed, comm.rank))
    random.seed(seeds.worker_seed(cfg.seed, comm.rank))
    settings = {k: str(v) for k, v in opt.describe().items() if k != "gradzip version"}
    straggler = stragglers.parse(cfg.straggler)
    stragglers.check_rank(straggler, comm.world_size)
    return _Job(comm, cfg, ds, model, opt, steps_per_epoch, LoopState(), settings, device,
                Precision(cfg.amp, device, comm), after_step,
                lr_rule=lr_rule(cfg, comm.world_size, steps_per_epoch),
                schedule=lr_schedule(cfg, steps_per_epoch * cfg.epochs),
                base_lrs=tuple(g["lr"] for g in opt.lr_groups()),
                sam=optim.SAM(opt, rho=cfg.sam_rho) if cfg.sam_rho > 0 else None, straggler=straggler)


def _set_lr(job: _Job) -> None:
    """The rate of the step about to run (``opt.steps + 1``): the large-batch rule's (or the
    group's own), times ``--lr-schedule``'s factor; a function of the step, so a resumed run
    needs no scheduler state."""
    step = job.opt.steps + 1
    for group, base in zip(job.opt.lr_groups(), job.base_lrs):
        rate = optim.lr_at(step, *job.lr_rule) if job.lr_rule is not None else base
        group["lr"] = rate if job.schedule is None else rate * optim.schedule_factor(step, job.total, job.schedule)


def _train_epoch(job: _Job, epoch: int, first_batch: int) -> None:
    """The steps of ``epoch`` from ``first_batch`` on; a checkpoint every
    ``checkpoint_every`` steps (one at the epoch's end is written after its record)."""
    cfg, comm, state, opt = job.cfg, job.comm, job.state, job.opt
    order = datasets.shard(len(job.ds.train_x), comm.rank, comm.world_size, epoch, cfg.seed)
    for b in range(first_batch, job.steps_per_epoch):
        idx = order[b * cfg.batch_size:(b + 1) * cfg.batch_size]
        if job.lr_rule is not None or job.schedule is not None:
            _set_lr(job)
        t0 = time.perf_counter()
        blocked = _exchange_blocked_s(opt)
        # seeded by (seed, rank, step), slept before the forward pass so that it also delays an
        # exchange the gradient hooks start during backward; counted as compute
        slept = _straggle(job, state.done + 1, job.last_compute_s) if job.straggler is not None else 0.0
        if job.sam is None:
            opt.zero_grad(set_to_none=True)
            x, y = job.ds.train_x[idx].to(job.device), job.ds.train_y[idx].to(job.device)
            with job.precision.autocast():
                loss = F.cross_entropy(job.model(x), y)
            job.precision.backward(loss)
            in_backward = _exchange_blocked_s(opt) - blocked   # codec work the gradient hooks did
            t1 = time.perf_counter()
            job.precision.step(opt)
        else:
            loss, forward_s = _sam_step(job, idx)
            t1, in_backward = t0 + slept + forward_s, 0.0   # SAM's passes run with the hooks idle
        job.last_compute_s = t1 - t0 - slept - in_backward   # the next step's slow:factor delay
        t2 = time.perf_counter()
        state.compute_s += t1 - t0 - in_backward
        state.step_s += t2 - t1 + in_backward
        if job.tracer is not None:
            job.tracer.add("compute", t0, t1, step=opt.steps)
            job.tracer.add("step", t1, t2, cat="optimizer", step=opt.steps)
        state.loss_sum += loss.detach().to(state.loss_sum.device, state.loss_sum.dtype)
        state.done += 1
        _mark_warm(job)
        if job.bar is not None:
            job.bar.update(1)
        if job.after_step is not None:
            job.after_step(state.done)
        if cfg.eval_every and state.done % cfg.eval_every == 0 and b < job.steps_per_epoch - 1:
            state.history.append(_record(job, state.done / job.steps_per_epoch))   # at an epoch's end: its record
        if cfg.checkpoint_dir and cfg.checkpoint_every and state.done % cfg.checkpoint_every == 0 \
                and b < job.steps_per_epoch - 1:  # at an epoch's end: after its record
            resume_lib.save(job)


def _mark_warm(job: _Job) -> None:
    """Note the phase times once this process's warm-up steps are done."""
    if job.state.done == job.warm_at:
        job.warm = (job.state.done, _phase_times(job.state.compute_s, job.state.step_s, job.opt.timings))


def _sam_step(job: _Job, idx) -> tuple[torch.Tensor, float]:
    """One SAM step (two forward/backward passes, then the method's step): the first
    pass's loss and the seconds spent in the two passes."""
    x, y, spent = job.ds.train_x[idx].to(job.device), job.ds.train_y[idx].to(job.device), [0.0]

    def closure():
        began = time.perf_counter()
        loss = F.cross_entropy(job.model(x), y)
        loss.backward()
        spent[0] += time.perf_counter() - began
        return loss
    return job.sam.step(closure), spent[0]


def _straggle(job: _Job, step: int, compute_s: float) -> float:
    """Sleep this worker's straggler delay for ``step`` (1-based, over the whole run),
    record it and return it. ``compute_s``: the previous step's compute, which a
    ``slow:rank=R,factor=F`` worker stretches by F (none on a run's first step)."""
    delay = job.straggler.delay(job.cfg.seed, job.comm.rank, step, compute_s)
    if delay > 0:
        with maybe_span(job.tracer, "straggler", cat="harness", step=step):
            time.sleep(delay)
    job.state.straggler_s += delay
    return delay


def _since_last_record(done: int, steps_per_epoch: int, every: int) -> int:
    """Steps since the previous record, whose place is a function of the step count alone
    (so a resumed run needs no more state): at every epoch's end, and, with ``every``
    (``--eval-every``), at the multiples of ``every`` inside an epoch."""
    last = (done - 1) // steps_per_epoch * steps_per_epoch
    if every:
        last = max(last, (done - 1) // every * every)
    return done - last


def _record(job: _Job, epoch: float) -> dict[str, Any]:
    """The record of the steps since the previous one (an epoch's, or a part of one with
    ``--eval-every``; ``epoch``: the epoch, or the epochs done as a fraction), the same on
    every worker: train loss and phase times averaged over the workers (one small
    allreduce), test accuracy and loss of the evaluation model (every worker evaluates its
    share of the test set: one more small allreduce)."""
    comm, state, opt = job.comm, job.state, job.opt
    phases = _phase_times(state.compute_s, state.step_s, opt.timings)
    steps = _since_last_record(state.done, job.steps_per_epoch, job.cfg.eval_every)
    epoch_stats = torch.tensor([state.loss_sum.item() / steps,
                                *(a - b for a, b in zip(phases, state.previous))], dtype=torch.float64)
    state.previous, state.loss_sum = phases, torch.zeros(())
    epoch_stats = comm.allreduce(epoch_stats).div_(comm.world_size).tolist()
    train_loss = epoch_stats[0]
    state.diverged = state.diverged or not math.isfinite(train_loss)
    wall = time.perf_counter() - job.began
    with maybe_span(job.tracer, "evaluate", cat="harness"):
        # (waits for a background exchange; None: a sharded model, evaluated by its own rule below)
        evaluated = None if sharded.is_sharded(job.cfg.algo) else evaluation_model(job.model, opt, comm,
                                                                                      job.cfg.eval_on)
        record = {"algo": job.cfg.name, "epoch": epoch, "step": opt.steps, "train_loss": train_loss,
                  "bytes_sent_per_worker": opt.bytes_sent, "wall_time_s": wall,
                  **{f"time_{k}_s": v for k, v in zip(PHASES, epoch_stats[1:])},
                  "skipped_steps": opt.skipped_steps, "lr": opt.lr_groups()[0]["lr"], **opt.metrics()}
        x, y = job.ds.test_x.to(job.device), job.ds.test_y.to(job.device)
        if evaluated is None:   # its forward passes gather parameters: every worker, the whole set
            record["test_accuracy"], record["test_loss"] = opt.evaluate(x, y)
        else:
            record["test_accuracy"], record["test_loss"] = evaluate_shared(evaluated, comm, x, y)
        if job.bar is not None:
            job.bar.set_postfix(loss=f"{train_loss:.3f}", acc=f"{record['test_accuracy']:.3f}")
    return record


def _summary(job: _Job, resumed_from: int | None, setup_began: float) -> dict[str, Any]:
    """The run's summary; collective (one allgather of every worker's phase times)."""
    comm, cfg, state, opt, history = job.comm, job.cfg, job.state, job.opt, job.state.history
    phases = _phase_times(state.compute_s, state.step_s, opt.timings)
    warm_steps, warm = job.warm
    mine = torch.tensor([*phases, state.straggler_s, *warm, state.compute_s + state.step_s], dtype=torch.float64)
    # one row per worker: phase times, injected delay, phase times at warm-up's end, time in steps
    per_worker = comm.allgather(mine)
    warm_phases = per_worker[:, len(PHASES) + 1:2 * len(PHASES) + 1]
    steady = (per_worker[:, :len(PHASES)] - warm_phases).mean(0) / max(state.done - warm_steps, 1)
    wall = time.perf_counter() - job.began
    final_loss = history[-1].get("test_loss") if history else None
    per_sample = job.ds.targets_per_sample
    tokens = state.done * cfg.batch_size * comm.world_size * per_sample
    return {
        "algo": cfg.name,
        "method": cfg.algo,
        # JSON scalars as they are (the projection rebuilds the method from them), the rest as text
        "options": {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in cfg.options.items()},
        "workers": comm.world_size,
        "dataset": cfg.dataset,
        "model": cfg.model,
        "epochs": cfg.epochs,
        "batch_size_per_worker": cfg.batch_size,
        "lr": cfg.lr,
        "momentum": cfg.momentum,
        "global_batch": cfg.batch_size * comm.world_size,
        "lr_peak": job.lr_rule[1] if job.lr_rule is not None else cfg.lr,
        "lr_schedule": job.schedule.spec() if job.schedule is not None else "constant",
        "sam_rho": cfg.sam_rho,
        "sharpness": _sharpness(job),
        "seed": cfg.seed,
        "steps": opt.steps,
        "skipped_steps": opt.skipped_steps,
        "resumed_from_step": resumed_from,
        "final_test_accuracy": history[-1].get("test_accuracy") if history else None,
        "best_test_accuracy": max((h.get("test_accuracy") or 0.0) for h in history) if history else None,
        "final_test_loss": final_loss,
        # a byte-level language model: the test loss (nats per byte) in bits per byte
        "bits_per_byte": final_loss / math.log(2) if final_loss is not None and job.ds.info.get("token") == "byte"
        else None,
        # training tokens (targets) per second of the steps (mean over workers; evaluation left out)
        "tokens_per_s": tokens / per_worker[:, -1].mean().item() if per_sample > 1 and state.done else None,
        "dataset_info": job.ds.info or None,
        "diverged": state.diverged,
        "bytes_sent_per_worker": opt.bytes_sent,
        "compression_ratio": opt.compression_ratio,
        "transports": opt.transports() if hasattr(opt, "transports") else None,
        **({"auto": opt.auto_decisions(), "auto_link": opt.auto_links(),   # auto:<codec>'s decisions, links and
            "auto_choices": opt.auto_choices()}                             # the codec each unit ran with
           if getattr(opt, "auto_decisions", dict)() else {}),
        "parameters": sum(p.numel() for p in job.model.parameters()),
        "parameter_shapes": [list(p.shape) for p in job.model.parameters()],   # for the projection
        "training_samples": len(job.ds.train_x),
        "eval_on": cfg.eval_on,
        "device": str(job.device),
        "amp": cfg.amp,
        **opt.metrics(),
        "wall_time_s": wall,
        "setup_time_s": job.began + state.wall_time_s - setup_began,  # this process's set-up
        "time_per_step_s": wall / max(state.done, 1),
        # phase times: mean over workers, and every worker's own row
        **{f"time_{k}_s": per_worker[:, i].mean().item() for i, k in enumerate(PHASES)},
        "time_per_worker_s": {k: per_worker[:, i].tolist() for i, k in enumerate(PHASES)},
        # seconds per step after this process's warm-up (mean over workers), and on how many steps
        "steady_step_s": {k: steady[i].item() for i, k in enumerate(PHASES)},
        "steady_steps": state.done - warm_steps,
        "warmup_steps": warm_steps - job.started,
        "straggler": job.straggler.spec if job.straggler is not None else None,
        "straggler_delay_s": per_worker[:, len(PHASES)].tolist(),   # injected, per worker (in time_compute_s)
    }


#: Training samples (the first ones) on which the summary's sharpness is measured.
SHARPNESS_SAMPLES = 512


def _sharpness(job: _Job) -> float | None:
    """The evaluation model's sharpness (:func:`gradzip.sharpness`) at ``cfg.sharpness_rho`` on
    the first :data:`SHARPNESS_SAMPLES` training samples; None when not asked. Collective
    where the evaluation model is (every rank computes the same value)."""
    rho = job.cfg.sharpness_rho
    if not rho:
        return None
    model = evaluation_model(job.model, job.opt, job.comm, job.cfg.eval_on)
    x, y = job.ds.train_x[:SHARPNESS_SAMPLES], job.ds.train_y[:SHARPNESS_SAMPLES]
    batches = [(x[i:i + 256], y[i:i + 256]) for i in range(0, len(x), 256)]
    return sharpness(model, F.cross_entropy, batches, rho, seed=job.cfg.seed)


def run_many(comm: Group, cfgs: list[RunConfig]) -> list[dict[str, Any]]:
    """Several runs in the same group, one after the other (``gradzip compare``)."""
    return [run_worker(comm, cfg) for cfg in cfgs]


def _progress(cfg: RunConfig, comm: Group, total: int, done: int):
    if not cfg.progress or comm.rank != 0:
        return None
    from tqdm.auto import tqdm

    # one bar, one writer: a thread lock, not tqdm's default multiprocessing one, whose
    # semaphore a worker that leaves with os._exit never unlinks (the resource tracker then
    # warned "1 leaked semaphore" at the end of every `gradzip compare`)
    if not hasattr(tqdm, "_lock"):
        tqdm.set_lock(threading.RLock())
    return tqdm(total=total, initial=done, desc=f"{cfg.name} ({comm.world_size} workers)",
                unit="step", leave=False, dynamic_ncols=True)
