"""Shared by the one-pass micro-benchmarks (``uncompressed_mean``, ``edit_guard``): ways of
doing one thing to a float32 tensor, timed in interleaved rounds on 1 torch thread, the
median of the rounds per size, printed as one table row per size with the ratios asked."""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable


def parse(description: str, argv: list[str] | None) -> argparse.Namespace:
    """``--sizes`` (entries) and ``--repeat`` (rounds), each refused in one line below 1."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--repeat", type=int, default=31)
    args = ap.parse_args(argv)
    if args.repeat < 1 or min(args.sizes) < 1:
        ap.error(f"--repeat and every --sizes must be >= 1, got --repeat {args.repeat} --sizes "
                 f"{' '.join(map(str, args.sizes))}")
    return args


def medians(ways: dict[str, Callable[[], object]], repeat: int,
            before: Callable[[], object] = lambda: None) -> dict[str, float]:
    """Median seconds of each way over ``repeat`` rounds, the ways interleaved in each round;
    ``before`` runs (untimed) before each timing. Every way runs once first, untimed (a
    numba kernel compiles or loads from its cache)."""
    for way in ways.values():
        before()
        way()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeat):
        for name, way in ways.items():
            before()
            began = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t) for name, t in times.items()}


def print_table(results: dict[int, dict[str, float]], ratios: dict[str, tuple[str, str]]) -> None:
    """One row per size: every way in ms, then each ratio ``label: (way, over way)``; the
    host's CPUs and load after it."""
    names = list(next(iter(results.values())))
    print("| float32 entries | " + " | ".join(f"{name} ms" for name in names) + " | "
          + " | ".join(ratios) + " |")
    print("|---:|" + "---:|" * (len(names) + len(ratios)))
    for size, t in results.items():
        print(f"| {size:,} | " + " | ".join(f"{t[name] * 1e3:.2f}" for name in names) + " | "
              + " | ".join(f"{t[a] / t[b]:.2f}" for a, b in ratios.values()) + " |")
    print(f"\n{os.cpu_count()} CPUs, load average {', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end")
