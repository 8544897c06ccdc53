"""Local work of one two-phase exchange (PSync ``transport="twophase"``) of the transformer's
31 tensors (``transformer`` on ``modadd:p=31``, 104k parameters) on N thread workers
(gradzip.simulate): ms per exchange of this checkout against a reference copy of the
package (default: the ``main`` branch, extracted with ``git archive``), side by side in
one run, rounds alternating between the two (docs/benchmarks.md, "Two-phase exchange:
local work").

    python -m benchmarks.twophase_overhead --workers 4 --exchanges 30 --rounds 3

The threads share one process, so what is measured is the codec and bookkeeping work of
every worker (the in-process all-to-all is a memory copy), not a network. The figure per
codec is the minimum over rounds of the mean over exchanges (the least-disturbed round).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

CODECS = ("scaled_sign:scale=rms", "2bit")
ROOT = Path(__file__).resolve().parent.parent


def transformer_shapes() -> list[tuple[int, ...]]:
    from gradzip.train import datasets, models
    ds = datasets.load("modadd:p=31")
    return [tuple(p.shape) for p in models.build("transformer", ds.input_shape, ds.num_classes).parameters()]


def measure(codec: str, workers: int, exchanges: int, warmup: int = 3) -> float:
    """Mean ms per exchange (slowest worker) of ``exchanges`` two-phase exchanges."""
    import torch
    from gradzip.comm import simulate
    from gradzip.exchange import PSync

    shapes = transformer_shapes()

    def worker(comm):
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(comm.rank)
        tensors = [torch.randn(s, generator=g) * 0.01 for s in shapes]
        psync = PSync(comm, codec, transport="twophase")
        for step in range(warmup):
            psync(tensors, step)
        began = time.perf_counter()
        for step in range(warmup, warmup + exchanges):
            psync(tensors, step)
        return time.perf_counter() - began

    return 1e3 * max(simulate(workers, worker)) / exchanges


def _measure_main(args) -> None:
    print(json.dumps({c: measure(c, args.workers, args.exchanges) for c in args.codecs}))


def _run(src: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": src}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", "--workers", str(args.workers),
           "--exchanges", str(args.exchanges), "--codecs", *args.codecs]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _extract(ref: str, into: str) -> str:
    archive = Path(into) / "ref.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src/gradzip"], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into)
    return str(Path(into) / "src")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--exchanges", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--codecs", nargs="+", default=list(CODECS))
    ap.add_argument("--reference", default="main", help="git ref of the reference copy")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        return _measure_main(args)
    with tempfile.TemporaryDirectory() as tmp:
        ref_src = _extract(args.reference, tmp)
        best = {"reference": {}, "this": {}}
        for _ in range(args.rounds):
            for name, src in (("reference", ref_src), ("this", str(ROOT / "src"))):
                for codec, ms in _run(src, args).items():
                    best[name][codec] = min(ms, best[name].get(codec, float("inf")))
    print(f"two-phase exchange of the transformer's 31 tensors, {args.workers} thread workers, "
          f"ms per exchange (min over {args.rounds} rounds of {args.exchanges} exchanges)")
    print(f"| codec | {args.reference} ms | this ms | {args.reference} / this |")
    print("|---|---|---|---|")
    for codec in args.codecs:
        ref, this = best["reference"][codec], best["this"][codec]
        print(f"| `{codec}` | {ref:.2f} | {this:.2f} | {ref / this:.2f}x |")


if __name__ == "__main__":
    main()
