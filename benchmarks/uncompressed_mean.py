"""The mean of an allreduced sum and its non-finite check (the ``none`` codec's
``from_sums``, the DDP hook's uncompressed buckets): torch's two passes (``div_`` then the
sum of :func:`gradzip.guards.nonfinite.all_finite`) against
:func:`gradzip.kernels.sums.mean_in_place` (one pass), against ``div_`` alone (what
PyTorch's ``allreduce_hook`` does, unchecked) and a copy into a reused buffer (one read and
one write: the streaming limit). Float32, 1 torch thread, rounds interleaved, each
measurement on a buffer freshly refilled from the same sum; median of the rounds
(:mod:`benchmarks.passes`).

Usage::

    python -m benchmarks.uncompressed_mean --sizes 1000000 10000000 --repeat 31
"""
from __future__ import annotations

import torch

from benchmarks import passes
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
    return passes.medians(ways, repeat, before=lambda: buffer.copy_(total))


def main(argv: list[str] | None = None) -> None:
    args = passes.parse(__doc__.split("\n\n")[0], argv)
    torch.set_num_threads(1)
    passes.print_table({size: measure(size, args.repeat) for size in args.sizes},
                       {"fused / div_ alone": ("fused (kernels.sums)", "div_ alone (unchecked)")})


if __name__ == "__main__":
    main()
