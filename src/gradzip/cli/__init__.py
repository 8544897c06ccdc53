"""``gradzip``: train one method, or compare several on the same task.

    gradzip train   --algo efsgd --compressor topk:ratio=0.01 --workers 2 --out runs/ef
    gradzip compare --algos ssgd,efsgd@topk:ratio=0.01,bitsgd --workers 4 --out runs/cmp

``--workers N`` starts N processes on 127.0.0.1 joined by gloo; ``--backend threads`` runs
them as threads of this process; started by ``torchrun`` (RANK / WORLD_SIZE set), each
process joins torchrun's group instead. Errors are one line on stderr and exit code 2.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from ..bench.cli import run as run_bench
from ..comm import PeerFailure
from ..errors import GradzipError
from ..comm.launch import WorkerError
from ..bench import emulated, netns
from ..bench.units import format_rate, parse_ints, parse_rates
from ..train import config_file, device, sharded
from ..bench import projection
from . import report
from .parser import build_parser, parse_args
from .runs import (_configs, _file_safe, _run, _statable, _trace_paths, _under_torchrun, _writable_directory,
                   _writable_file, _write_traces)

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

