"""The backward overlap's edit guard (docs/algorithms.md §PSync, "Overlap with backward"):
what a snapshot of a large gradient costs. torch's fingerprint (two passes: the bit
patterns' integer sum and position-weighted row sums, :mod:`gradzip.optim.core.fingerprint`,
what CUDA and 16-bit gradients still take) against the one-pass digest of
:mod:`gradzip.kernels.digest`, and the digest made in the copy into the bucket buffer
(:func:`gradzip.kernels.digest.copy_parts`, how S-SGD's and EF-SGD's uncompressed buckets
take it in backward) against that copy alone; ``sum()`` (one read pass) and the copy are the
streaming limits. Float32, 1 torch thread, rounds interleaved; median of the rounds
(:mod:`benchmarks.passes`).

Usage::

    python -m benchmarks.edit_guard --sizes 1000000 10000000 --repeat 31
"""
from __future__ import annotations

import torch

from benchmarks import passes
from gradzip import kernels
from gradzip.kernels import digest
from gradzip.optim.core.fingerprint import fingerprint


def _torch_fingerprint(x: torch.Tensor) -> torch.Tensor:
    with kernels.use("torch"):
        return fingerprint(x)


def measure(size: int, repeat: int) -> dict[str, float]:
    """Median seconds of each way over ``repeat`` interleaved rounds."""
    x, out = torch.randn(size), torch.empty(size)
    ways = {
        "torch fingerprint (2 passes)": lambda: _torch_fingerprint(x),
        "digest (kernels.digest)": lambda: digest.digest(x),
        "sum()": lambda: x.sum(),
        "copy into a reused buffer": lambda: out.copy_(x),
        "copy + digest (copy_parts)": lambda: digest.copy_parts([x], out, 0),
    }
    return passes.medians(ways, repeat)


def main(argv: list[str] | None = None) -> None:
    args = passes.parse(__doc__.split("\n\n")[0], argv)
    torch.set_num_threads(1)
    passes.print_table({size: measure(size, args.repeat) for size in args.sizes},
                       {"digest / torch fingerprint": ("digest (kernels.digest)", "torch fingerprint (2 passes)"),
                        "copy + digest / copy": ("copy + digest (copy_parts)", "copy into a reused buffer")})


if __name__ == "__main__":
    main()
