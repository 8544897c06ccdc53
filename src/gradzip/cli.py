"""``gradzip``: train one method, or compare several on the same task.

    gradzip train   --algo efsgd --compressor topk:ratio=0.01 --workers 2 --out runs/ef
    gradzip compare --algos ssgd,efsgd@topk:ratio=0.01,bitsgd --workers 4 --out runs/cmp

``--workers N`` starts N processes on 127.0.0.1 joined by gloo; ``--backend threads`` runs
them as threads of this process; started by ``torchrun`` (RANK / WORLD_SIZE set), each
process joins torchrun's group instead. Errors are one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

import torch.distributed as dist

from . import compressors, optim, specs, stragglers, trace
from .bench.cli import add_parser as add_bench
from .bench.cli import run as run_bench
from .comm import PeerFailure, init_from_env, simulate
from .comm.base import DEFAULT_TIMEOUT_S
from .comm.liveness import announce_failure
from .errors import GradzipError
from .hierarchy import check_workers_per_node
from .launch import WorkerError, run_processes
from .optim.options import FLOAT32_MAX
from .bench import emulated, netns
from .bench.units import format_rate, parse_ints, parse_rates
from .train import checkpoint, config_file, datasets, device, models, projection, report, sharded
from .train.config import SEED_LIMIT, RunConfig, make_optimizer, method_class, method_label, parse_algos
from .train.loop import run_many

DEFAULT_COMPARE = "ssgd,efsgd@topk:ratio=0.01,efsgd@1bit,bitsgd,ssgd@qsgd,ssgd@terngrad"


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump) and exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _checked(kind, test, what):
    def convert(raw: str):
        try:
            value = kind(raw)
        except (ValueError, TypeError, KeyError, OverflowError):
            raise argparse.ArgumentTypeError(f"expected {what}, got {raw!r}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {raw!r}")
        return value
    return convert


positive_int = _checked(int, lambda v: v >= 1, "an integer >= 1")
at_least_two = _checked(int, lambda v: v >= checkpoint.MIN_KEEP, f"an integer >= {checkpoint.MIN_KEEP}")
# Written so that NaN fails every test (every comparison with NaN is False). The upper bound
# is float32's largest value: the models train in float32, where anything above is inf.
non_negative = _checked(float, lambda v: 0 <= v <= FLOAT32_MAX, "a number >= 0 and finite (<= 3.4e38)")
fraction = _checked(float, lambda v: 0 <= v < 1, "a number in [0, 1)")
positive = _checked(float, lambda v: 0 < v <= FLOAT32_MAX, "a number > 0 and finite (<= 3.4e38)")
seed_int = _checked(int, lambda v: 0 <= v < SEED_LIMIT, "an integer in [0, 2**32)")
seconds = _checked(float, lambda v: 0 < v <= 365 * 86400, "seconds > 0 (at most a year)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE",
                   help="a TOML file of settings: KEY = VALUE per flag, KEY the flag without its dashes "
                        "(batch-size = 64); flags on the command line override it. --out DIR writes the run's "
                        "own to DIR/config.toml, which repeats the run exactly")
    g = p.add_argument_group("task")
    g.add_argument("--dataset", default="digits",
                   help=f"one of {', '.join(datasets.names())} (digits is embedded; default: %(default)s)")
    g.add_argument("--data-dir", help="directory with the dataset's files (mnist, fashion-mnist, cifar10, text:file=NAME)")
    g.add_argument("--download", action="store_true",
                   help="download missing dataset files into --data-dir (checksums verified)")
    g.add_argument("--model", default="mlp", help=f"one of {', '.join(models.names())} (default: %(default)s)")
    g.add_argument("--epochs", type=positive_int, default=20, help="default: %(default)s")
    g.add_argument("--batch-size", type=positive_int, default=32, help="per worker (default: %(default)s)")
    g.add_argument("--lr", type=non_negative, default=None,
                   help="learning rate (default: the method's own: 0.1 for the SGD methods, 3 for LARS and "
                        "0.01 for LAMB (their trust ratios scale it), 0.001 for 1-bit / 0/1 Adam, "
                        "1-bit LAMB, AdamW and DiLoCo's AdamW)")
    g.add_argument("--momentum", type=fraction, default=0.0,
                   help="default: %(default)s (BIT-SGD with momentum 0.9 at lr 0.1 is unstable: docs/benchmarks/accuracy.md)")
    g.add_argument("--nesterov", action="store_true")
    g.add_argument("--weight-decay", type=non_negative, default=0.0)
    g.add_argument("--seed", type=seed_int, default=0)
    g.add_argument("--device", choices=list(device.DEVICES), default="cpu",
                   help="cpu, cuda (rank r on cuda:LOCAL_RANK %% device_count) or auto (cuda where available) "
                        "(default: %(default)s)")
    g.add_argument("--amp", choices=list(device.AMP), default="none",
                   help="mixed precision: autocast in bf16, or fp16 with a GradScaler (gradients unscaled "
                        "before compression; a step with an inf/NaN skipped on every worker) (default: %(default)s)")
    b = p.add_argument_group("large batch (docs/large_batch.md)")
    b.add_argument("--lr-scaling", choices=["none", "linear", "sqrt"], default="none",
                   help="scale --lr with the global batch (--batch-size x workers) over --base-batch (default: %(default)s)")
    b.add_argument("--base-batch", type=positive_int, default=None,
                   help="the global batch --lr is tuned for (default: --batch-size)")
    b.add_argument("--warmup-epochs", type=non_negative, default=0.0,
                   help="ramp linearly from --lr to the scaled rate over these epochs (Goyal et al.)")
    b.add_argument("--sam-rho", type=non_negative, default=0.0,
                   help="> 0: SAM around the method (two passes per step, no extra communication)")
    g.add_argument("--transport", choices=["auto", "allreduce", "allgather", "twophase"], default="auto",
                   help="how PSync moves packets: auto (exact collectives; the two-phase compressed allreduce "
                        "only where it costs <= 1/2), or pin one; twophase changes the numbers "
                        "(docs/algorithms.md §Transports; default: %(default)s)")
    g.add_argument("--round-bytes", type=positive_int, default=None,
                   help="two-phase: send each all-to-all in rounds of at most this many bytes per message "
                        "(default: whole messages); on slow links that several workers share, e.g. 131072 "
                        "(docs/benchmarks/transports-and-nodes.md, \"Two-phase across nodes\")")
    w = p.add_argument_group("workers")
    w.add_argument("--workers", type=positive_int, default=None,
                   help="worker count (default: 1 for train, 4 for compare; under torchrun: its world)")
    w.add_argument("--backend", choices=["gloo", "threads"], default="gloo",
                   help="gloo: real processes on 127.0.0.1; threads: in this process (default: %(default)s)")
    w.add_argument("--straggler", metavar="SPEC", default=None,
                   help="inject per-worker per-step delays after the backward pass, seeded by (seed, rank, "
                        "step) and counted as compute: exp:mean=S | normal:mean=S,std=S | slow:rank=R,factor=F "
                        "(docs/stragglers.md)")
    g.add_argument("--eval-on", choices=["auto", "average", "local"], default="auto",
                   help="evaluate rank 0's model (local), the workers' average, or auto: the average "
                        "for methods whose replicas differ (default: %(default)s)")
    f = p.add_argument_group("sharded training (FSDP2; docs/integrations.md)")
    f.add_argument("--hsdp", type=positive_int, default=None, metavar="R",
                   help="HSDP: R replicas across nodes, FSDP2 sharding inside each node of workers/R (ranks "
                        "node-major); train: run HSDP; compare: R for the hsdp[@CODEC] entries of --algos")
    f.add_argument("--weights", metavar="SPEC", default=None,
                   help="FSDP2/HSDP runs: the parameters' all-gather codec, e.g. int8 (default: exact)")
    f.add_argument("--error-memory", choices=["full", "shard"], default=None,
                   help="FSDP2 runs: the error feedback's memory: full (exact: the unsharded gradient's size) or "
                        "shard (its top-k, a shard's size) (default: full; --error-feedback false: none)")
    r = p.add_argument_group("reliability")
    r.add_argument("--checkpoint-dir", metavar="DIR",
                   help="write checkpoints here: one file per worker, written atomically (compare: "
                        "one subdirectory per method)")
    r.add_argument("--checkpoint-every", type=positive_int, metavar="STEPS",
                   help="steps between checkpoints (default: at the end of every epoch)")
    r.add_argument("--resume", metavar="DIR",
                   help="continue from the newest checkpoint in DIR that verifies on every worker, bit "
                        "for bit, and keep writing checkpoints there; starts from scratch if DIR holds "
                        "none or does not exist (so the same command serves torchrun --max-restarts); "
                        "a file that fails verification is moved aside (renamed *.rejected-TIME, never "
                        "deleted) and an older step taken; refuses, naming the file, when no step "
                        "verifies, and a step-... directory or a directory of other files")
    r.add_argument("--keep-checkpoints", type=at_least_two, default=2, metavar="K",
                   help="steps of checkpoints each worker keeps: the newest K (default: %(default)s, the "
                        "newest and one to resume from if it is damaged)")
    r.add_argument(checkpoint.START_OVER, action="store_true",
                   help="with --resume: when no checkpointed step verifies on every worker, start from "
                        "scratch instead of refusing (the files that fail are kept, renamed)")
    r.add_argument("--workers-per-node", type=int, default=None, metavar="K",
                   help="hierarchical exchange: K workers per node (ranks node-major, as torchrun numbers "
                        "them); fp32 reduce-scatter inside a node, the codec across nodes (default: flat)")
    r.add_argument("--nonfinite", choices=["raise", "skip", "off"], default="raise",
                   help="a NaN/Inf gradient on any worker: raise (stop every worker), skip the step "
                        "on every worker (one small extra collective per step), or off (default: %(default)s)")
    r.add_argument("--timeout", type=seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="how long a worker waits inside one collective for a lost or stuck peer before "
                        "failing with its rank named; it does not bound a worker's own computation "
                        "(default: %(default)s; docs/reliability.md)")
    o = p.add_argument_group("output")
    o.add_argument("--out", help="directory for metrics.jsonl, summary.json and accuracy.png")
    o.add_argument("--no-plot", action="store_true", help="skip accuracy.png")
    o.add_argument("--eval-every", type=positive_int, default=None, metavar="STEPS",
                   help="evaluate (a record in metrics.jsonl) every STEPS steps too, not only at each epoch's end")
    o.add_argument("--trace", metavar="FILE",
                   help="write a Chrome/Perfetto trace (one track per worker, one span per phase); "
                        "compare writes one file per method, FILE with the method's name added")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    j = p.add_argument_group("projection (timeline model)")
    j.add_argument("--bandwidth", default=projection.DEFAULT_BANDWIDTHS, metavar="LIST",
                   help="link rates to project the run to, e.g. 1gbit,10gbit (bits/s); the table adds the "
                        "PROJECTED seconds per epoch and the speed-up over S-SGD at each, from this run's "
                        "measured compute, codec and update times and its bytes; 'none': no projection "
                        "(default: %(default)s)")
    j.add_argument("--workers-at", metavar="LIST",
                   help="worker counts to project to, e.g. 4,16,64 (default: the run's own)")
    j.add_argument("--emulate", action="store_true",
                   help="instead of projecting, run the command at each --bandwidth on emulated links: "
                        "one network namespace per worker, each link shaped with tc (needs root, ip, tc; "
                        "as gradzip bench net); results in --out DIR/emulated-<rate>")


_FLAG_TYPES = {int: int, float: float, str: str,
               bool: _checked(specs.parse_bool, lambda v: True, "true or false")}


def _method_flags(p: argparse.ArgumentParser) -> None:
    """One flag per method option (from the methods' signatures): adding a method adds its
    flags here without CLI code. Unset flags leave the method's default."""
    takers: dict[str, list[str]] = {}
    kinds: dict[str, type] = {}
    for algo, cls in optim.METHODS.items():
        for name, kind in optim.method_options(cls).items():
            takers.setdefault(name, []).append(algo)
            kinds[name] = kind
    g = p.add_argument_group("method options", f"codec specs: NAME[:param=value,...], NAME in {', '.join(compressors.names())}")
    for name, algos in takers.items():
        g.add_argument("--" + name.replace("_", "-"), dest=f"opt_{name}", type=_FLAG_TYPES[kinds[name]],
                       metavar=kinds[name].__name__.upper(), help=f"({', '.join(algos)})")


def _given_options(args) -> dict[str, Any]:
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gradzip", description="Communication-efficient distributed data-parallel training.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = sub.add_parser("train", help="train one method", description="Train one method.")
    train.add_argument("--algo", default="ssgd", choices=list(optim.METHODS), help="default: %(default)s")
    train.add_argument("--fsdp", action="store_true",
                       help="train with PyTorch FSDP2 instead of a method: gradzip's --compressor inside its "
                            "reduce-scatter (plain FSDP2 without one); with --hsdp R, HSDP")
    _method_flags(train)
    _common(train)

    compare = sub.add_parser("compare", help="compare several methods on the same task (the main job)",
                             description="Run several methods on the same task, one after the other.")
    compare.add_argument("--algos", default=DEFAULT_COMPARE,
                         help="comma-separated methods, each optionally METHOD@CODEC "
                              "(default: %(default)s)")
    _method_flags(compare)
    _common(compare)

    add_bench(sub)  # gradzip bench net|model (src/gradzip/bench)
    parser.commands = {"train": train, "compare": compare}  # the parsers --config applies to
    return parser


def parse_args(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The command line ``argv``, with the settings of its ``--config FILE`` where the
    command line gives none (a :class:`GradzipError` for a bad file)."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is None:
        return args
    config_file.apply(parser.commands[args.command], args.config, args.command)
    return parser.parse_args(argv)


def _configs(args) -> list:
    common = dict(dataset=args.dataset, data_dir=args.data_dir, download=args.download, model=args.model, epochs=args.epochs,
                  batch_size=args.batch_size, momentum=args.momentum, nesterov=args.nesterov,
                  weight_decay=args.weight_decay, seed=args.seed, eval_on=args.eval_on,
                  nonfinite=args.nonfinite, device=args.device, amp=args.amp, trace=bool(args.trace),
                  progress=not args.quiet,
                  lr_scaling=args.lr_scaling, base_batch=args.base_batch or 0, warmup_epochs=args.warmup_epochs,
                  sam_rho=args.sam_rho, transport=args.transport, round_bytes=args.round_bytes,
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parse_args(argv, parser)
    except GradzipError as exc:
        print(f"gradzip: error: {exc}", file=sys.stderr)
        return 2
    code = _main(args, argv, parser)
    if args.command != "bench" and _under_torchrun(args.workers):
        # Under torchrun, leave without the interpreter's finalisation: torch's C++ threads
        # can abort it ("terminate called without an active exception", seen here in about
        # 1 run in 10 after the process group was destroyed), turning a finished run into a
        # failed job. Everything is written and flushed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def run() -> None:
    """The ``gradzip`` command (console script, ``python -m gradzip``): :func:`main` on the
    command line, then out with its exit code, stdout and stderr flushed, without the
    interpreter's finalisation: tearing down torch's modules took 2 to 3 s on the loaded
    2-core machine, a quarter of a short run (docs/benchmarks/startup.md). Everything a
    command writes is written and closed by then, and its worker processes are joined."""
    try:
        code = main()
    except SystemExit as exc:   # argparse: --help, a usage error
        code = exc.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def _main(args, argv, parser) -> int:
    try:
        if args.command == "bench":
            return run_bench(args, argv)
        if args.data_dir:
            _statable(args.data_dir, "--data-dir")
        cfgs = _configs(args)
        device.resolve_device(args.device)  # --device cuda without CUDA: one line, before anything starts
        if args.out:
            _writable_directory(args.out, "--out")
        traces = _trace_paths(args.trace, [cfg.name for cfg in cfgs]) if args.trace else []
        for path in traces:
            _writable_file(path, "--trace")
        rates, workers_at = _projection_args(args)
        if args.command == "compare" and args.workers is None and "RANK" not in os.environ:
            args.workers = 4
        if args.out and os.environ.get("RANK", "0") == "0":  # the settings first: a failed run can be repeated
            config_file.write(Path(args.out) / config_file.NAME,
                              config_file.effective(parser.commands[args.command], args))
        if args.emulate:
            return _run_emulated(parser, args, rates)
        per_worker = _run(cfgs, args.workers, args.backend, args.timeout)
    except GradzipError as exc:
        print(f"gradzip: error: {exc}", file=sys.stderr)
        return 2
    except (PeerFailure, WorkerError) as exc:  # a run that failed, not bad input: exit 1
        print(f"gradzip: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gradzip: interrupted", file=sys.stderr)
        return 130
    try:  # the results first, what is derived from them after: a failing plot or trace loses nothing else
        if not (os.environ.get("RANK", "0") != "0" and _under_torchrun(args.workers)):
            _report(args, per_worker[0], rates, workers_at)
        if traces:
            _write_traces(traces, per_worker)
    except OSError as exc:
        print(f"gradzip: error: cannot write {exc.filename or 'an output'}: {exc.strerror or exc} (the run "
              "itself completed)", file=sys.stderr)
        return 1
    return 0


def _projection_args(args) -> tuple[list[float], list[int] | None]:
    """``--bandwidth`` (bits/s; empty for 'none') and ``--workers-at``, checked before training."""
    text = args.bandwidth.strip().lower()
    rates = [] if text in ("none", "off", "") else parse_rates(args.bandwidth)
    if any(r is None for r in rates):
        raise GradzipError(f"--bandwidth {args.bandwidth!r}: the projection needs finite rates such as "
                           "1gbit,10gbit ('none' turns it off)")
    workers_at = parse_ints(args.workers_at, "--workers-at", 1) if args.workers_at else None
    if workers_at and not rates:
        raise GradzipError("--workers-at needs link rates to project to: drop --bandwidth none")
    return rates, workers_at


def emulation_settings(parser, args, out: Path) -> dict[str, Any]:
    """The config table each emulated worker runs (``gradzip <command> --config``): this
    run's settings without the worker count (the workers join torchrun-style), backend,
    projection and emulation, writing into ``out``."""
    table = config_file.effective(parser.commands[args.command], args)
    for key in ("workers", "backend", "workers-at", "emulate", "trace"):
        table.pop(key, None)
    table.update({"bandwidth": "none", "quiet": True, "out": str(out)})
    return table


def _run_emulated(parser, args, rates: list[float]) -> int:
    """``--emulate``: the command once per link rate, each worker a process in its own
    network namespace with a tc-shaped link (:mod:`gradzip.bench.netns`); each run's table
    printed, its outputs in ``--out/emulated-<rate>``."""
    if not args.out:
        raise GradzipError("--emulate writes each rate's results into --out DIR: add --out")
    if not rates:
        raise GradzipError("--emulate runs at the --bandwidth rates: give some, e.g. --bandwidth 1gbit,10gbit")
    if args.workers_at:
        raise GradzipError("--emulate runs at --workers, not --workers-at (which only projects); drop one")
    n = args.workers or 1
    for rate in rates:
        out = Path(args.out) / f"emulated-{_file_safe(format_rate(rate).replace(' ', '').replace('/', 'p'))}"
        _writable_directory(str(out), "--out")
        settings = config_file.write(out / "worker-config.toml", emulation_settings(parser, args, out))
        code = (f"import sys; from gradzip.cli import main; "
                f"sys.exit(main([{args.command!r}, '--config', {str(settings)!r}]))")
        print(f"emulated links of {format_rate(rate)}, {n} workers (tc-shaped, one namespace per worker) ...",
              flush=True)
        with netns.Topology(n, rate) as topo:
            emulated.run_ranks(topo, code, out, args.timeout * 10, max(1, (os.cpu_count() or 1) // n),
                               what="--emulate", cwd=os.getcwd())
        summaries = json.loads((out / "summary.json").read_text())
        print(f"MEASURED on emulated {format_rate(rate)} links, {n} workers:")
        print(report.table(summaries if isinstance(summaries, list) else [summaries]))
    return 0


def _project(runs: list[dict], rates: list[float], workers_at: list[int] | None) -> None:
    """Every run's projection into its summary (``projections``, or ``projection_skipped``: a
    method the profile cannot run, a sharded run) at those rates and worker counts (none for a
    one-worker run without ``--workers-at``: it sends nothing). The projection is derived
    output: one that fails is a note on stderr, never the loss of the run."""
    if not rates or (workers_at is None and all(r["summary"]["workers"] == 1 for r in runs)):
        return
    for run in runs:
        if sharded.is_sharded(run["summary"]["method"]):
            run["summary"]["projection_skipped"] = "FSDP2 / HSDP runs have no timeline model"
    runs = [r for r in runs if "projection_skipped" not in r["summary"]]
    if not runs:
        return
    try:
        added = projection.project_runs(runs, rates, workers_at)
    except GradzipError as exc:
        print(f"gradzip: note: no projection: {exc}", file=sys.stderr)
        return
    for run, fields in zip(runs, added):
        run["summary"].update(fields)


def _report(args, runs: list[dict], rates: list[float], workers_at: list[int] | None) -> None:
    """The runs' records written (``--out``) before anything derived from them, then the
    projection, the table, the summary again with the projections, and the plot."""
    if args.out:
        report.write(args.out, runs, plot=False)
    _project(runs, rates, workers_at)
    print(report.table([r["summary"] for r in runs]))
    if args.out:
        out = report.write(args.out, runs, plot=not args.no_plot)
        print(f"wrote {out}/{config_file.NAME}, {out}/metrics.jsonl, {out}/summary.json" + ("" if args.no_plot else f", {out}/accuracy.png"))


if __name__ == "__main__":
    run()
