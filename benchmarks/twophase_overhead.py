"""Local work of the two-phase exchange (PSync ``transport="twophase"``) on the transformer's
31 tensors (``transformer`` on ``modadd:p=31``, 104k parameters) with N thread workers
(gradzip.simulate), this checkout against a reference copy of the package (default: the
``main`` branch, extracted with ``git archive``), side by side in one run, rounds
alternating between the two (docs/benchmarks/transports-and-nodes.md, "Two-phase exchange: local work"):

* ms per exchange of one PSync two-phase exchange of the 31 tensors, per codec;
* ms per ``step()`` of 1-bit Adam and 0/1 Adam in their compressed stage (their default
  codec ``scaled_sign:scale=rms`` over two-phase) and of dense AdamW (``Compressed``,
  ``none``), on fixed random gradients.

    python -m benchmarks.twophase_overhead --workers 4 --exchanges 30 --rounds 3

The threads share one process, so what is measured is the codec and bookkeeping work of
every worker (the in-process all-to-all is a memory copy), not a network. Each figure is
the minimum over rounds of the mean over exchanges (the least-disturbed round).
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
OPTIMIZERS = ("onebitadam", "zerooneadam", "adamw")
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


def measure_step(method: str, workers: int, steps: int, warmup: int = 3) -> float:
    """Mean ms per ``step()`` (slowest worker) of ``method`` after ``warmup`` steps (the
    first one dense: the compressed stage starts at step 2)."""
    import torch
    import gradzip
    from gradzip.comm import simulate

    shapes = transformer_shapes()

    def worker(comm):
        torch.set_num_threads(1)
        params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(0)) * 0.1)
                  for s in shapes]   # the same replica on every worker
        g = torch.Generator().manual_seed(comm.rank)
        grads = [torch.randn(s, generator=g) * 0.01 for s in shapes]
        o = gradzip.optim
        opt = (o.OneBitAdam(params, 1e-3, freeze_step=1, comm=comm) if method == "onebitadam" else
               o.ZeroOneAdam(params, 1e-3, var_freeze_step=1, comm=comm) if method == "zerooneadam" else
               o.Compressed(torch.optim.AdamW(params, 1e-3), compressor="none", comm=comm))

        def step():
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            opt.step()

        for _ in range(warmup):
            step()
        began = time.perf_counter()
        for _ in range(steps):
            step()
        return time.perf_counter() - began

    return 1e3 * max(simulate(workers, worker)) / steps


def _measure_main(args) -> None:
    res = {c: measure(c, args.workers, args.exchanges) for c in args.codecs}
    res.update({m: measure_step(m, args.workers, args.exchanges) for m in args.optimizers})
    print(json.dumps(res))


def _run(src: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": src}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", "--workers", str(args.workers),
           "--exchanges", str(args.exchanges), "--codecs", *args.codecs, "--optimizers", *args.optimizers]
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
    ap.add_argument("--optimizers", nargs="*", default=list(OPTIMIZERS), choices=OPTIMIZERS)
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
    print(f"{args.workers} thread workers, transformer (31 tensors), min over {args.rounds} rounds of the mean "
          f"over {args.exchanges}")
    print(f"| what | {args.reference} ms | this ms | {args.reference} / this |")
    print("|---|---|---|---|")
    for name in [*args.codecs, *args.optimizers]:
        ref, this = best["reference"][name], best["this"][name]
        what = f"one two-phase exchange, `{name}`" if name in args.codecs else f"`{name}` step()"
        print(f"| {what} | {ref:.2f} | {this:.2f} | {ref / this:.2f}x |")


if __name__ == "__main__":
    main()
