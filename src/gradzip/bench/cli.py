"""The ``gradzip bench`` subcommands: ``net`` (emulated network) and ``model`` (timeline model).

``gradzip.cli`` adds this parser with :func:`add_parser` and hands the parsed arguments
to :func:`run`; everything else about the benchmarks lives in this package.
"""
from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    """Add ``bench {net,model}`` to the top-level subparsers ``sub``."""
    from . import model, net

    bench = sub.add_parser("bench", help="network benchmarks: emulated links (net), timeline model (model)",
                           description="Network benchmarks. `net` runs real gloo workers in network "
                                       "namespaces with tc-shaped links (needs root); `model` validates "
                                       "the timeline model against them and projects to large clusters.")
    kinds = bench.add_subparsers(dest="bench", required=True, parser_class=type(bench))
    net.add_arguments(kinds.add_parser("net", help="measure methods on emulated per-worker links (root, tc)",
                                       description=net.__doc__.split("\n\n")[0]))
    model.add_arguments(kinds.add_parser("model", help="timeline model: validate, then project to 8-256 workers",
                                         description=model.__doc__.split("\n\n")[0]))
    return bench


def run(args, argv=None) -> int:
    """Run the parsed ``gradzip bench ...`` command; its exit code."""
    from . import model, net

    rest = None
    if argv is not None:
        argv = list(argv)
        rest = argv[argv.index(args.bench) + 1:] if args.bench in argv else argv
    return (net.main if args.bench == "net" else model.main)(args, rest)
