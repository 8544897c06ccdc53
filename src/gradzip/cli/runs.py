"""What a ``gradzip train`` / ``compare`` invocation runs: its run configurations from the
flags (:func:`_configs`), their checks before anything starts, and launching the workers
(threads, local processes or torchrun's), with their traces."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .. import optim, trace
from ..train import stragglers
from ..comm import init_from_env, simulate
from ..comm.liveness import announce_failure
from ..errors import GradzipError
from ..exchange.hierarchy import check_workers_per_node
from ..comm.launch import run_processes
from ..train import checkpoint, datasets, models, sharded
from ..train.config import RunConfig, make_optimizer, method_class, method_label, parse_algos
from ..train.loop import run_many
from .parser import _given_options


def _configs(args) -> list:
    common = dict(dataset=args.dataset, data_dir=args.data_dir, download=args.download, model=args.model, epochs=args.epochs,
                  batch_size=args.batch_size, momentum=args.momentum, nesterov=args.nesterov,
                  weight_decay=args.weight_decay, seed=args.seed, eval_on=args.eval_on,
                  nonfinite=args.nonfinite, device=args.device, amp=args.amp, trace=bool(args.trace),
                  progress=not args.quiet,
                  lr_scaling=args.lr_scaling, base_batch=args.base_batch or 0, warmup_epochs=args.warmup_epochs,
                  lr_schedule=args.lr_schedule,
                  sam_rho=args.sam_rho, transport=args.transport, round_bytes=args.round_bytes, link=args.link,
                  recalibrate_every=args.recalibrate_every,
                  workers_per_node=args.workers_per_node,
                  straggler=stragglers.canonical(args.straggler), eval_every=args.eval_every or 0, **_checkpointing(args))
    given = _given_options(args)
    if args.command == "train":
        algo = _train_algo(args)
        options = {**given, **_sharded_options(args, algo)}
        label = method_label(algo, given.get("compressor"))
        return [RunConfig(algo=algo, options=options, label=label, lr=_lr(args, algo, given), **common)]
    cfgs, used = [], set()
    for algo, codec in parse_algos(args.algos, also=sharded.SHARDED):
        accepted = sharded.METHOD_FLAGS if sharded.is_sharded(algo) else optim.method_options(optim.METHODS[algo])
        options = {k: v for k, v in given.items() if k in accepted}  # each method takes what it knows
        if codec is not None:
            options["compressor"] = codec
        if sharded.is_sharded(algo):
            options.update(_sharded_options(args, algo))
        used |= set(options)
        label = method_label(algo, codec)
        run = dict(common)
        if run["checkpoint_dir"]:  # one subdirectory per method
            run["checkpoint_dir"] = str(Path(run["checkpoint_dir"]) / _file_safe(label))
        cfgs.append(RunConfig(algo=algo, options=options, label=label, lr=_lr(args, algo, options), **run))
    flags = {**given, **{k: v for k, v in (("weights", args.weights), ("error_memory", args.error_memory),
                                           ("replicas", args.hsdp)) if v is not None}}
    unused = sorted(set(flags) - used)
    if unused:
        shown = [{"replicas": "hsdp"}.get(u, u).replace("_", "-") for u in unused]
        raise GradzipError(f"no method in --algos takes --{', --'.join(shown)}")
    for cfg in cfgs:
        checkpoint.check_directory(cfg.checkpoint_dir)
    return cfgs



def _lr(args, algo: str, options: dict) -> float:
    """``--lr``, or the method's own default where it is not given (``default_lr``)."""
    if args.lr is not None:
        return args.lr
    return sharded.DEFAULT_LR if sharded.is_sharded(algo) else method_class(algo).default_lr(options)


def _train_algo(args) -> str:
    """``--algo``, or ``fsdp`` / ``hsdp`` for ``--fsdp`` / ``--hsdp R``."""
    if not (args.fsdp or args.hsdp):
        return args.algo
    if args.algo != "ssgd":
        raise GradzipError(f"--fsdp trains with FSDP2 instead of a method: drop --algo {args.algo}")
    return "hsdp" if args.hsdp else "fsdp"


def _sharded_options(args, algo: str) -> dict[str, Any]:
    """The FSDP2 flags as a sharded run's options (``weights``, ``error_memory``, and
    ``replicas`` for hsdp); a :class:`GradzipError` where they are given to a method."""
    options = {"weights": args.weights, "error_memory": args.error_memory,
               "replicas": args.hsdp if algo == "hsdp" else None}
    options = {k: v for k, v in options.items() if v is not None}
    if options and args.command == "train" and not sharded.is_sharded(algo):
        flags = ", ".join("--" + k.replace("_", "-") for k in options)
        raise GradzipError(f"{flags} belong to FSDP2 runs: add --fsdp (or --hsdp R)")
    if algo == "hsdp" and args.hsdp is None:
        raise GradzipError("hsdp in --algos needs the number of replicas: add --hsdp R")
    return options


def _file_safe(label: str) -> str:
    """A method label (``efsgd@topk:ratio=0.01``) as a file or directory name."""
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", label)


def _checkpointing(args) -> dict[str, Any]:
    """``--checkpoint-dir`` / ``--checkpoint-every`` / ``--resume`` / ``--keep-checkpoints`` /
    ``--start-over-if-damaged`` as RunConfig fields."""
    if args.resume and args.checkpoint_dir and Path(args.resume) != Path(args.checkpoint_dir):
        raise GradzipError("--resume DIR continues writing checkpoints into DIR; give --checkpoint-dir "
                           "the same directory or leave it out")
    directory = args.resume or args.checkpoint_dir
    if args.checkpoint_every and not directory:
        raise GradzipError("--checkpoint-every needs a directory: add --checkpoint-dir DIR (or --resume DIR)")
    if directory and os.path.isfile(directory):  # (train: checked with its contents in _configs)
        raise GradzipError(f"checkpoint directory {directory} exists and is not a directory")
    if args.start_over_if_damaged and not args.resume:
        raise GradzipError(f"{checkpoint.START_OVER} says what --resume DIR does when no checkpoint verifies: "
                           "add --resume DIR, or leave it out")
    return {"checkpoint_dir": directory, "checkpoint_every": args.checkpoint_every or 0,
            "resume": bool(args.resume), "keep_checkpoints": args.keep_checkpoints,
            "start_over": args.start_over_if_damaged}


def _statable(path: str, flag: str) -> None:
    """A path the system can look up (it may not exist): not over-long, not below a file."""
    try:
        os.stat(path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:  # ValueError: an embedded NUL
        raise GradzipError(f"{flag} {path!r}: {getattr(exc, 'strerror', None) or exc}") from None


def _writable_directory(path: str, flag: str) -> None:
    """Create ``path`` now, so that a bad ``--out`` fails before training, not after."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GradzipError(f"{flag} {path}: cannot create this directory ({exc.strerror or exc})") from None


def _validate(cfgs, workers: int, backend: str = "gloo") -> None:
    """Fail fast, in this process, on what would otherwise fail inside every worker."""

    ds = datasets.load(cfgs[0].dataset, cfgs[0].data_dir, download=cfgs[0].download)
    model = models.build(cfgs[0].model, ds.input_shape, ds.num_classes)
    models.check_fits(cfgs[0].model, model, ds.train_x[:1], ds.train_y[:1], cfgs[0].dataset)
    for cfg in cfgs:
        if sharded.is_sharded(cfg.algo):
            sharded.check(cfg, workers, backend)
            continue
        check_workers_per_node(cfg.workers_per_node, workers)   # the optimizer below sees a world of one
        make_optimizer(RunConfig(**{**vars(cfg), "workers_per_node": None}), model.parameters(), None)
        stragglers.check_rank(stragglers.parse(cfg.straggler), workers)
    if len(ds.train_x) // workers < cfgs[0].batch_size:
        raise GradzipError(
            f"{cfgs[0].dataset} has {len(ds.train_x)} training samples: fewer than one batch of "
            f"{cfgs[0].batch_size} per worker for {workers} workers; lower --batch-size or --workers"
        )


def _under_torchrun(workers: int | None) -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and workers is None


def _run(cfgs, workers: int | None, backend: str, timeout_s: float) -> list[list[dict]]:
    """Every worker's results (rank order; under torchrun, this process's only)."""

    if _under_torchrun(workers):
        try:
            return [run_many(init_from_env(timeout_s=timeout_s), cfgs)]
        except BaseException as exc:
            announce_failure(exc)  # the peers' errors then name this rank and its error
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    n = workers or 1
    _validate(cfgs, n, backend)
    if backend == "threads":
        return simulate(n, lambda comm: run_many(comm, cfgs), timeout_s=timeout_s)
    return run_processes(n, run_many, cfgs, timeout_s=timeout_s)


def _trace_paths(path: str, labels: list[str]) -> list[Path]:
    """One trace file per run: ``path`` itself for one run, else ``stem-<method>.json``.
    Under torchrun each process writes its own worker's events (``stem.rank<r>.json``)."""
    base = Path(path)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        base = base.with_name(f"{base.stem}.rank{os.environ['RANK']}{base.suffix or '.json'}")
    if len(labels) == 1:
        return [base]
    return [base.with_name(f"{base.stem}-{_file_safe(label)}{base.suffix or '.json'}") for label in labels]


def _writable_file(path: Path, flag: str) -> None:
    """Create ``path`` (and its directory) now and remove it again, so that a bad
    ``--trace`` fails before training, not after."""
    try:
        existed = path.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except (OSError, ValueError) as exc:  # ValueError: an embedded NUL
        raise GradzipError(f"{flag} {path}: cannot write this file ({getattr(exc, 'strerror', None) or exc})") from None


def _write_traces(paths: list[Path], per_worker: list[list[dict]]) -> None:
    for i, target in enumerate(paths):
        written = trace.write(target, [worker[i]["trace"] for worker in per_worker])
        print(f"wrote trace {written}")
