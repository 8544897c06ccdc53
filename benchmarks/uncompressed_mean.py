"""The mean of an allreduced sum and its non-finite check (the ``none`` codec's
``from_sums``, the DDP hook's uncompressed buckets): torch's two passes (``div_`` then the
sum of :func:`gradzip.guards.nonfinite.all_finite`) against
:func:`gradzip.kernels.sums.mean_in_place` (one pass), against ``div_`` alone (what
PyTorch's ``allreduce_hook`` does, unchecked) and a copy into a reused buffer (one read and
one write: the streaming limit). Float32, 1 torch thread, rounds interleaved, each
measurement on a buffer freshly refilled from the same sum; median of the rounds.

Usage::

    python -m benchmarks.uncompressed_mean --sizes 1000000 10000000 --repeat 31
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from gradzip.guards.nonfinite import all_finite
from gradzip.kernels.sums import mean_in_place


def measure(size: int, repeat: int, n: int = 3) -> dict[str, float]:
    """Median seconds of each way over ``repeat`` interleaved rounds."""
    total, buffer, out = torch.randn(size), torch.empty(size), torch.empty(size)
    ways = {
        "torch: div_ + sum check": lambda: buffer.div_(n) is None or all_finite([buffer]),
        "fused (kernels.sums)": lambda: mean_in_place(buffer, n),
        "div_ alone (unchecked)": lambda: buffer.div_(n),
        "copy into a reused buffer": lambda: out.copy_(buffer),
    }
    buffer.copy_(total)
    mean_in_place(buffer, n)   # compiled or loaded from numba's cache before the clock
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeat):
        for name, way in ways.items():
            buffer.copy_(total)
            began = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--repeat", type=int, default=31)
    args = ap.parse_args(argv)
    if args.repeat < 1 or min(args.sizes) < 1:
        ap.error(f"--repeat and every --sizes must be >= 1, got --repeat {args.repeat} --sizes "
                 f"{' '.join(map(str, args.sizes))}")
    torch.set_num_threads(1)
    results = {size: measure(size, args.repeat) for size in args.sizes}
    names = list(next(iter(results.values())))
    print("| float32 entries | " + " | ".join(f"{name} ms" for name in names) + " | fused / div_ alone |")
    print("|---:|" + "---:|" * (len(names) + 1))
    for size, t in results.items():
        print(f"| {size:,} | " + " | ".join(f"{t[name] * 1e3:.2f}" for name in names)
              + f" | {t['fused (kernels.sums)'] / t['div_ alone (unchecked)']:.2f} |")
    print(f"\n{os.cpu_count()} CPUs, load average {', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end")


if __name__ == "__main__":
    main()
