"""The ``gradzip bench`` subcommands: ``net`` (emulated network) and ``model`` (timeline model).

``gradzip.cli`` adds this parser with :func:`add_parser` and hands the parsed arguments
to :func:`run`. Each subcommand runs the library (:mod:`gradzip.bench.emulated`,
:mod:`gradzip.bench.timeline`), prints its tables (:mod:`gradzip.bench.tables`) and writes
its results as JSON. Updating docs/benchmarks/ and drawing plots is the job of
``python -m benchmarks.network``, which takes the same flags plus ``--write`` / ``--plots``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from ..train import stragglers
from ..exchange.planner import TRANSPORTS as PSYNC_TRANSPORTS
from ..exchange.twophase import check_round_bytes
from ..errors import GradzipError
from ..files import write_text
from ..train.config import parse_algos
from . import emulated, peers, tables, timeline
from .costs import TRANSPORTS
from .shapes import model_shapes, resnet50_shapes
from .units import parse_ints, parse_non_negatives, parse_rates

NET_HELP = "Measure methods on real gloo workers in network namespaces with tc-shaped links (needs root)."
MODEL_HELP = ("The timeline model of one iteration per method: validate it against `gradzip bench net`, "
              "then project to large clusters.")
_MOVED = ("{flag} moved out of the package: run `python -m benchmarks.network {kind} ... {flag}` from a "
          "source checkout (the installed package writes no docs or plots)")


def add_parser(sub) -> argparse.ArgumentParser:
    """Add ``bench {net,model}`` to the top-level subparsers ``sub``."""
    bench = sub.add_parser("bench", help="network benchmarks: emulated links (net), timeline model (model)",
                           description="Network benchmarks. `net` runs real gloo workers in network "
                                       "namespaces with tc-shaped links (needs root); `model` validates "
                                       "the timeline model against them and projects to large clusters.")
    kinds = bench.add_subparsers(dest="bench", required=True, parser_class=type(bench))
    net = kinds.add_parser("net", help="measure methods on emulated per-worker links (root, tc)", description=NET_HELP)
    add_net_arguments(net)
    model = kinds.add_parser("model", help="timeline model: validate, then project to 8-256 workers",
                             description=MODEL_HELP)
    add_model_arguments(model)
    for p in (net, model):  # flags that moved to benchmarks/network.py: a one-line pointer
        p.add_argument("--write", action="store_true", help=argparse.SUPPRESS)
        if p is model:
            p.add_argument("--plots", default=None, help=argparse.SUPPRESS)
    return bench


def run(args, argv=None) -> int:
    """Run the parsed ``gradzip bench ...`` command; its exit code."""
    rest = None
    if argv is not None:
        argv = list(argv)
        rest = argv[argv.index(args.bench) + 1:] if args.bench in argv else argv
    for flag, value in (("--write", args.write), ("--plots", getattr(args, "plots", None))):
        if value:
            raise GradzipError(_MOVED.format(flag=flag, kind=args.bench))
    command = f"gradzip bench {args.bench} " + " ".join(rest if rest is not None else sys.argv[3:])
    (run_net if args.bench == "net" else run_model)(args, command.strip())
    return 0


# ----------------------------------------------------------------------------- net


def add_net_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="2,4", help="comma-separated worker counts (default: %(default)s)")
    p.add_argument("--bandwidth", default="100mbit,1gbit,10gbit",
                   help="comma-separated link rates (bits/s: 100mbit, 1gbit, ...; 'unshaped') (default: %(default)s)")
    p.add_argument("--latency-ms", default="0",
                   help="comma-separated one-way worker-to-worker latencies in ms (netem; default: %(default)s)")
    p.add_argument("--algos", default="ssgd,efsgd@topk:ratio=0.01,bitsgd",
                   help="methods, METHOD[@CODEC] comma-separated; PyTorch's own DDP as peers: ddp, ddp@fp16, "
                        "ddp@powersgd:rank=R[,buckets=one|each] (default: %(default)s)")
    p.add_argument("--model", default="resnet18:width=32", help="default: %(default)s (2.8M parameters)")
    p.add_argument("--shape", default="3x32x32", help="synthetic input shape (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="per worker (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="measured steps per method (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="steps before them, not measured (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker (default: %(default)s)")
    p.add_argument("--check-mb", type=float, default=100.0, help="largest shaping-check allreduce (default: %(default)s)")
    p.add_argument("--straggler", metavar="SPEC", default=None,
                   help="inject per-worker per-step delays in the runs: exp:mean=S | normal:mean=S,std=S | "
                        "slow:rank=R,factor=F (seeded by seed, rank, step; counted as compute)")
    p.add_argument("--workers-per-node", type=int, default=1,
                   help="k workers per node: their links go unshaped to a node bridge, each node has ONE "
                        "shaped uplink, and the methods exchange hierarchically (default: %(default)s, flat)")
    p.add_argument("--transports", default="auto",
                   help="run every gradzip method once per PSync transport, comma-separated: auto, allreduce, "
                        "allgather, twophase; rows other than auto are labelled METHOD[TRANSPORT] (default: %(default)s)")
    p.add_argument("--round-bytes", type=int, default=None,
                   help="two-phase: each all-to-all in rounds of at most this many bytes per message "
                        "(default: whole messages)")
    p.add_argument("--out", default="runs/bench-net", help="results.json and logs (default: %(default)s)")
    p.add_argument("--from", dest="from_results", metavar="RESULTS",
                   help="run nothing: print the tables of an earlier results.json")


def net_bench(args) -> emulated.NetBench:
    """The :class:`~gradzip.bench.emulated.NetBench` the ``bench net`` flags describe."""
    latencies = [ms / 1e3 for ms in parse_non_negatives(args.latency_ms, "--latency-ms")]
    for name, value, low in (("--batch-size", args.batch_size, 1), ("--steps", args.steps, 1),
                             ("--warmup", args.warmup, 0), ("--threads", args.threads, 1)):
        if value < low:
            raise GradzipError(f"{name} must be >= {low}, got {value}")
    if not args.check_mb > 0:
        raise GradzipError(f"--check-mb must be > 0, got {args.check_mb}")
    for n in parse_ints(args.workers, "--workers", 1):
        if args.workers_per_node < 1 or n % args.workers_per_node:
            raise GradzipError(f"--workers-per-node {args.workers_per_node} must be >= 1 and divide every "
                               f"--workers count, got {n}")
    check_round_bytes(args.round_bytes, "--round-bytes")
    algos = parse_algos(args.algos, also=(peers.PEER,))
    transports = [t.strip().lower() for t in args.transports.split(",") if t.strip()]
    for t in transports or [""]:
        if t not in PSYNC_TRANSPORTS:
            raise GradzipError(f"unknown transport {t!r} in --transports; valid: {', '.join(PSYNC_TRANSPORTS)}")
    for algo, codec in algos:
        if peers.is_peer(algo):
            peers.parse_hook(codec)   # a bad hook is an error now, not after the namespaces are up
    return emulated.NetBench(workers=parse_ints(args.workers, "--workers", 1), bandwidths=parse_rates(args.bandwidth),
                             latencies=latencies, algos=algos, model=args.model, shape=args.shape,
                             batch_size=args.batch_size, steps=args.steps, warmup=args.warmup, threads=args.threads,
                             check_mb=args.check_mb, out=args.out, workers_per_node=args.workers_per_node,
                             transports=list(dict.fromkeys(transports)), round_bytes=args.round_bytes,
                             straggler=stragglers.canonical(args.straggler))



def _read_net_results(path: Path, flag: str) -> dict[str, Any]:
    """A ``results.json`` written by ``gradzip bench net``, given as ``flag``."""
    if not path.exists():
        raise GradzipError(f"{flag} {path}: no such file; run `gradzip bench net` first")
    return json.loads(path.read_text())


def run_net(args, command: str) -> dict[str, Any]:
    """``bench net``: run (or, with ``--from``, read) the emulated-network records, print
    their tables; the results dict (``command`` is the one recorded in it)."""
    if args.from_results:
        out = Path(args.from_results)
        result = _read_net_results(out, "--from")
    else:
        bench = net_bench(args)
        result = bench.run(command=command)
        out = Path(bench.out, "results.json")
    print("### Shaping check\n")
    print(tables.check_table(result["records"]) + "\n")
    print("### Time per iteration (ms, mean over steps; phases: mean over workers)\n")
    print(tables.time_table(result["records"]) + "\n")
    print(tables.noise_line(result))
    print(f"\nresults: {out}")
    return result


# ----------------------------------------------------------------------------- model


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--measured", metavar="RESULTS",
                   help="a `gradzip bench net` results.json to validate against (default: none)")
    p.add_argument("--alpha-us", type=float, default=None,
                   help="per-message latency alpha in microseconds (default: 100 for the validation, "
                        "i.e. gloo over veth; 10 for the projection)")
    p.add_argument("--host-gbit", type=float, default=None,
                   help="cap on one link's throughput set by this host (validation only; default: none)")
    p.add_argument("--nominal-links", action="store_true",
                   help="validation: model the shaped link rate as set, not as each topology's shaping check "
                        "sustained it (n processes contending for this host's CPUs slow the ring down)")
    p.add_argument("--algos", default=None,
                   help="methods to project, METHOD[@CODEC] (default: ssgd,efsgd@topk:ratio=0.01,bitsgd,cdsgd)")
    p.add_argument("--workers", default="8,16,32,64,128,256", help="projection worker counts (default: %(default)s)")
    p.add_argument("--bandwidth", default="10gbit,25gbit,56gbit,100gbit", help="projection link rates (default: %(default)s)")
    p.add_argument("--compute-ms", type=float, default=100.0,
                   help="compute (forward + backward) per iteration in the projection (default: %(default)s, "
                        "about ResNet-50 at batch 32 on a V100)")
    p.add_argument("--local-scale", dest="codec_scale", type=float, default=1.0,
                   help="multiply the codec and update times measured on this machine's CPU (e.g. 0.1 for "
                        "an accelerator 10x faster at them; default: %(default)s)")
    p.add_argument("--profile-steps", type=int, default=5,
                   help="steps of each method profiled per worker count (a period of CD-SGD's k=5; "
                        "default: %(default)s)")
    p.add_argument("--profile-max-workers", type=int, default=8,
                   help="measure codec times at most at this worker count; above it, decoding is scaled "
                        "by the packets decoded (default: %(default)s)")
    p.add_argument("--model", default="resnet50",
                   help="parameter shapes for the projection: resnet50 (25.6M) or a harness model name "
                        "with --shape (default: %(default)s)")
    p.add_argument("--shape", default="3x224x224", help="input shape for a harness --model (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads while profiling codecs (default: %(default)s)")
    p.add_argument("--straggler", metavar="SPEC", default=None,
                   help="project with per-worker delays: each synchronous iteration waits E[max of K delays] "
                        "more (exp: mean·H_K; normal: mean + std·e_K; slow: (F-1)·compute)")
    p.add_argument("--transports", default="recorded,auto",
                   help="PSync transports to project, comma-separated: recorded (the collectives the methods "
                        "issue today), exact, twophase, auto (default: %(default)s)")
    p.add_argument("--workers-per-node", type=int, default=1,
                   help="projection: hierarchical exchange with this many workers per node behind one "
                        "uplink of --bandwidth (1: flat; default: %(default)s)")
    p.add_argument("--intra-gbit", type=float, default=100.0,
                   help="projection with --workers-per-node > 1: link rate inside a node, Gbit/s "
                        "(default: %(default)s)")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="projection: every method's bucket_bytes in MB (as DDP's bucket_cap_mb; fewer, larger "
                        "exchanges pay fewer per-message latencies but overlap less of backward; default: the "
                        "methods' 25 MiB)")
    p.add_argument("--no-projection", action="store_true", help="only the validation")
    p.add_argument("--out", default="runs/bench-model.json", help="predictions as JSON (default: %(default)s)")


DEFAULT_MODEL_ALGOS = "ssgd,efsgd@topk:ratio=0.01,bitsgd,cdsgd"


def _log(message: str) -> None:
    print(message, file=sys.stderr)


def _check_model_args(args) -> None:
    if args.profile_steps < 1:
        raise GradzipError(f"--profile-steps must be >= 1, got {args.profile_steps}")
    if args.profile_max_workers < 1:
        raise GradzipError(f"--profile-max-workers must be >= 1, got {args.profile_max_workers}")
    for name, value in (("--compute-ms", args.compute_ms), ("--local-scale", args.codec_scale)):
        if not (value >= 0 and math.isfinite(value)):
            raise GradzipError(f"{name} must be a finite number >= 0, got {value}")
    if args.alpha_us is not None and not args.alpha_us >= 0:
        raise GradzipError(f"--alpha-us must be >= 0, got {args.alpha_us}")
    if args.host_gbit is not None and not args.host_gbit > 0:
        raise GradzipError(f"--host-gbit must be > 0, got {args.host_gbit}")
    if args.threads < 1:
        raise GradzipError(f"--threads must be >= 1, got {args.threads}")
    stragglers.parse(args.straggler)
    if args.workers_per_node < 1:
        raise GradzipError(f"--workers-per-node must be >= 1, got {args.workers_per_node}")
    if not args.intra_gbit > 0:
        raise GradzipError(f"--intra-gbit must be > 0, got {args.intra_gbit}")
    if args.bucket_mb is not None and not (math.isfinite(args.bucket_mb) and _bucket_bytes(args.bucket_mb) >= 1):
        raise GradzipError(f"--bucket-mb must be a finite number > 0, got {args.bucket_mb}; e.g. --bucket-mb 25")
    for t in _transports(args.transports):
        if t != "recorded" and t not in TRANSPORTS:
            raise GradzipError(f"unknown transport {t!r} in --transports; valid: recorded, {', '.join(TRANSPORTS)}")


def _bucket_bytes(mb: float) -> int:
    return int(mb * (1 << 20))


def _transports(text: str) -> list[str]:
    return [t.strip().lower() for t in text.split(",") if t.strip()] or ["recorded"]


def run_model(args, command: str) -> dict[str, Any]:
    """``bench model``: the validation (with ``--measured``) and the projection, their tables
    printed and the result written to ``--out``; the result dict (``measured`` holds the
    results file validated against)."""
    _check_model_args(args)
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"command": command}
    if args.measured:
        measured = _read_net_results(Path(args.measured), "--measured")
        alpha = (100.0 if args.alpha_us is None else args.alpha_us) * 1e-6
        rows = timeline.validate(measured, alpha, args.host_gbit * 1e9 / 8 if args.host_gbit else None,
                                 calibrate=not args.nominal_links)
        result["validation"] = rows
        result["validation_alpha_s"] = alpha
        print("### Model vs emulated network\n")
        print(tables.validation_table(rows) + "\n")
        within = sum(abs(r["error"]) <= timeline.TOLERANCE for r in rows)
        print(f"{within} of {len(rows)} predictions within {timeline.TOLERANCE:.0%} of the measured iteration time\n")
    if not args.no_projection:
        algos = parse_algos(args.algos or DEFAULT_MODEL_ALGOS)
        workers = parse_ints(args.workers, "--workers", 1)
        bws = parse_rates(args.bandwidth)
        if any(b is None for b in bws):
            raise GradzipError("--bandwidth for the projection needs finite rates")
        shapes = resnet50_shapes() if args.model == "resnet50" else model_shapes(
            args.model, [int(s) for s in args.shape.split("x")])
        alpha = (10.0 if args.alpha_us is None else args.alpha_us) * 1e-6
        transports = [None if t == "recorded" else t for t in _transports(args.transports)]
        rows = timeline.project(algos, workers, bws, args.compute_ms / 1e3, alpha, args.codec_scale, shapes,
                                log=_log, time_at_most=args.profile_max_workers, steps=args.profile_steps,
                                transports=transports, hierarchy=args.workers_per_node,
                                intra_bps=args.intra_gbit * 1e9, straggler=stragglers.parse(args.straggler),
                                bucket_bytes=None if args.bucket_mb is None else _bucket_bytes(args.bucket_mb))
        result["projection"] = rows
        result["projection_settings"] = {"model": args.model, "parameters": sum(math.prod(s) for s in shapes),
                                         "compute_s": args.compute_ms / 1e3, "alpha_s": alpha,
                                         "codec_scale": args.codec_scale, "threads": args.threads,
                                         "profile_max_workers": args.profile_max_workers,
                                         "profile_steps": args.profile_steps,
                                         "transports": _transports(args.transports),
                                         "workers_per_node": args.workers_per_node,
                                         "bucket_mb": args.bucket_mb,
                                         "intra_bps": args.intra_gbit * 1e9,
                                         "straggler": stragglers.canonical(args.straggler)}
        print("### Projection\n")
        print(tables.codec_table(rows) + "\n")
        print(tables.projection_table(rows) + "\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_text(args.out, json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return result
