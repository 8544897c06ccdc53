"""DGC's sampled-threshold selection against exact ``torch.topk``: throughput at 1M–25M elements.

For each size and density, on the same tensor, side by side and interleaved (the machine
is shared, so rounds alternate the methods and the median is reported):

* ``torch.topk``: ``torch.topk(x.abs(), k)`` (exact, what a plain top-k codec does);
* ``gradzip topk``: ``gradzip.compressors.sparsify.topk_indices`` (exact, pre-filtered);
* ``dgc select``: :func:`gradzip.compressors.dgc.sampled_threshold_select` (a threshold
  from a strided 1% sample, refined into [0.8k, 1.3k]);
* ``dgc codec``: the whole ``dgc`` compress (selection, trimming to k, values, padding).

It prints a markdown table (``--write``: into docs/benchmarks/codecs.md).

    python -m benchmarks.dgc_threshold --threads 1 2 --write
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from benchmarks.docs_section import PAGES, replace_section

import torch  # noqa: E402

from gradzip.compressors import build  # noqa: E402
from gradzip.compressors.dgc import sampled_threshold_select  # noqa: E402
from gradzip.compressors.sparsify import topk_indices  # noqa: E402


def timed(fn, repeat: int) -> float:
    best = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t0)
    return min(best)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e6, 4e6, 16e6, 25e6])
    ap.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median reported)")
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks/codecs.md")
    args = ap.parse_args()

    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for size in args.sizes:
            numel = int(size)
            x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
            for rho in args.densities:
                k = max(1, math.ceil(rho * numel))
                codec = build(f"dgc:ratio={rho}")
                stats: dict = {}
                methods = {
                    "torch.topk": lambda: torch.topk(x.abs(), k, sorted=False),
                    "gradzip topk": lambda: topk_indices(x, k),
                    "dgc select": lambda: sampled_threshold_select(x, k, 0.01, seed=1, stats=stats),
                    "dgc codec": lambda: codec.compress(x, seed=1),
                }
                times: dict[str, list[float]] = {m: [] for m in methods}
                for r in range(args.rounds):
                    order = list(methods) if r % 2 == 0 else list(reversed(methods))
                    for name in order:
                        times[name].append(timed(methods[name], 1))
                med = {m: statistics.median(v) for m, v in times.items()}
                selected = sampled_threshold_select(x, k, 0.01, seed=1, stats=stats).numel()
                row = (f"| {threads} | {numel / 1e6:g}M | {rho:g} | "
                       + " | ".join(f"{numel / med[m] / 1e6:.0f}" for m in methods)
                       + f" | {med['torch.topk'] / med['dgc select']:.1f}x | {med['torch.topk'] / med['dgc codec']:.1f}x"
                       + f" | {selected / k:.2f} | {stats['passes']} |")
                rows.append(row)
                print(row, flush=True)
    header = ("| threads | elements | density | torch.topk Melem/s | gradzip topk Melem/s | dgc select Melem/s "
              "| dgc codec Melem/s | select speed-up vs torch.topk | codec speed-up | selected / k | passes over the tensor |")
    table = "\n".join([header, "|" + "---|" * 11, *rows])
    command = "python -m benchmarks.dgc_threshold " + " ".join(sys.argv[1:])
    text = (f"Command: `{command}` (CPU, float32 normal data, median of {args.rounds} interleaved rounds; "
            "throughput = elements / time). \"dgc select\" returns the threshold's candidates "
            "(between 0.8k and 1.3k of them: a first pass aims at 1.5k, the excess is trimmed among the "
            "candidates, and a second pass happens only after an unlucky sample); \"dgc codec\" also trims "
            "them to k and builds the packet (values + int32 indices). \"gradzip topk\" is the `topk` "
            "codec's exact top-k (pre-filtered by a 1/64 sample). With 1 torch thread the passes run "
            "piece by piece (cache-sized pieces), as gradzip does for one-thread workers.\n\n"
            f"{table}\n")
    print(text)
    if args.write:
        replace_section("DGC threshold selection vs torch.topk", text, PAGES / "codecs.md")


if __name__ == "__main__":
    main()
