"""The ``gradzip`` command's flags: one parser for ``train``, ``compare`` and ``bench``, a
one-line error and exit code 2 for a bad value (:func:`build_parser`, :func:`parse_args`)."""
from __future__ import annotations

import argparse
from typing import Any, Sequence

from .. import compressors, optim, specs
from ..bench.cli import add_parser as add_bench
from ..exchange import planner
from ..comm.base import DEFAULT_TIMEOUT_S
from ..errors import GradzipError
from ..optim.core.options import FLOAT32_MAX
from ..train import checkpoint, config_file, datasets, device, models
from ..bench import projection
from ..train.config import SEED_LIMIT

DEFAULT_COMPARE = ("ssgd,efsgd@topk:ratio=0.01,efsgd@auto:topk:ratio=0.01,efsgd@1bit,efsgd@auto:1bit,bitsgd,ssgd@qsgd,"
                   "ssgd@terngrad")


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


def link_rate(raw: str) -> str:
    """``--link``: a rate the plans' link model takes (:func:`gradzip.exchange.planner.as_link`)."""
    try:
        planner.as_link(raw)
    except GradzipError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return raw


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
    g.add_argument("--lr-schedule", default="constant", metavar="SPEC",
                   help="the rate over the run, the same for every method (DiLoCo: the inner rate): constant, "
                        "constant:warmup=W (linear warm-up over W steps), or cosine:warmup=W,final=m (then cosine "
                        "decay to m x the rate at the last step; m default 0.1) (default: %(default)s)")
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
    g.add_argument("--link", metavar="RATE", type=link_rate, default=None,
                   help="the link the exchange plans are priced on, e.g. 1gbit: auto:<codec>'s choices (measured "
                        "at the first step when not given) and two-phase's (10gbit when not given) "
                        "(docs/algorithms.md §Auto codec choice)")
    g.add_argument("--recalibrate-every", type=positive_int, default=None, metavar="STEPS",
                   help="auto:<codec>: measure and decide again every STEPS steps, logging each bucket that "
                        "switches (default: decide once, at the first step)")
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
