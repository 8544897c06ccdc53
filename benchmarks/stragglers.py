"""Stragglers: the lecture's brainteaser, emulated and modelled, and time-to-accuracy with
a slow worker.

1. **Synchronous wait against K.** K workers (threads of this process; a sleeping worker
   needs no core, so K may exceed the cores) each sleep their seeded delay
   (:mod:`gradzip.train.stragglers`) and meet at a barrier, for ``--steps`` steps; the mean
   time from one barrier to the next, less the barrier's own cost (measured with no
   delay), is the measured synchronous wait. Next to it: the spec's E[max of K] (exp:
   μ·H_K; normal: μ + σ·e_K), modelled up to 256 workers, and the asymptotes μ·ln K and
   μ + σ·√(2 ln K).
2. **Time to accuracy** on digits with 4 workers (threads), no straggler and one worker
   2× slower (``slow:rank=3,factor=2``): S-SGD, local SGD, DiLoCo, CD-SGD. A-SGD rows come
   from the A-SGD branch (the table leaves room for them).

    python -m benchmarks.stragglers --write          # both parts, docs/stragglers.md
    python -m benchmarks.stragglers --part wait --steps 100
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

from benchmarks.docs_section import DOCS, replace_section

import torch  # noqa: E402

import gradzip  # noqa: E402
from gradzip.train import stragglers  # noqa: E402
from gradzip.train.config import RunConfig  # noqa: E402
from gradzip.train.loop import run_many  # noqa: E402

DOC = DOCS / "stragglers.md"


def measured_wait(K: int, spec: str | None, steps: int, seed: int = 0) -> float:
    """Mean seconds from one barrier to the next on rank 0 when every worker sleeps its
    delay first (no delay: the barrier's own cost)."""
    s = stragglers.parse(spec)

    def worker(comm):
        comm.barrier()
        times = []
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            if s is not None:
                time.sleep(s.delay(seed, comm.rank, step))
            comm.barrier()
            times.append(time.perf_counter() - t0)
        return statistics.mean(times)

    return gradzip.simulate(K, worker)[0]


def wait_tables(specs: list[str], workers: list[int], steps: int) -> str:
    out = []
    for spec in specs:
        s = stragglers.parse(spec)
        rows = [f"### `{spec}`\n", "| K | measured wait ms | E[max] ms (spec) | measured / spec | "
                + ("μ·ln K ms" if s.kind == "exp" else "μ + σ·√(2 ln K) ms") + " |", "|---:|---:|---:|---:|---:|"]
        for K in sorted(set(workers) | {16, 32, 64, 128, 256}):
            model = s.expected_wait(K)
            asym = s.mean * math.log(K) if s.kind == "exp" else s.mean + s.std * math.sqrt(2 * math.log(K))
            if K in workers:
                base = measured_wait(K, None, max(10, steps // 4))
                got = measured_wait(K, spec, steps) - base
                print(f"[stragglers] {spec} K={K}: measured {got * 1e3:.2f} ms, spec {model * 1e3:.2f} ms",
                      file=sys.stderr)
                rows.append(f"| {K} | {got * 1e3:.2f} | {model * 1e3:.2f} | {got / model:.3f} | {asym * 1e3:.2f} |")
            else:
                rows.append(f"| {K} | (modelled) | {model * 1e3:.2f} | | {asym * 1e3:.2f} |")
        out.append("\n".join(rows))
    return "\n\n".join(out)


METHODS = [("S-SGD", "ssgd", {}, {}), ("local SGD H=8", "localsgd", {"H": 8}, {}),
           ("DiLoCo H=8 (inner SGD)", "diloco", {"H": 8, "inner": "sgd"}, {}),
           ("CD-SGD k=5", "cdsgd", {"k": 5, "warmup_steps": 20}, {})]


def accuracy_table(epochs: int, target: float, seed: int) -> str:
    rows = ["| method | straggler | final acc | time to {:.0%} s | wall s | compute s (mean/worker) |".format(target),
            "|---|---|---:|---:|---:|---:|"]
    for straggler in (None, "slow:rank=3,factor=2"):
        cfgs = [RunConfig(algo=algo, options=opts, label=label, dataset="digits", model="mlp", epochs=epochs,
                          lr=0.1, seed=seed, progress=False, straggler=straggler)
                for label, algo, opts, _ in METHODS]
        results = gradzip.simulate(4, lambda comm: run_many(comm, cfgs))[0]
        for r in results:
            s, hist = r["summary"], r["history"]
            reach = next((h["wall_time_s"] for h in hist if h["test_accuracy"] >= target), None)
            rows.append(f"| {s['algo']} | {straggler or 'none'} | {s['final_test_accuracy']:.3f} | "
                        f"{'—' if reach is None else f'{reach:.1f}'} | {s['wall_time_s']:.1f} | "
                        f"{s['time_compute_s']:.1f} |")
            print(f"[stragglers] {rows[-1]}", file=sys.stderr)
    rows.append("| A-SGD | none / slow:rank=3,factor=2 | (from the A-SGD branch) | | | |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["wait", "accuracy", "both"], default="both")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--specs", nargs="+", default=["exp:mean=0.02", "normal:mean=0.05,std=0.01"])
    ap.add_argument("--steps", type=int, default=200, help="steps per K for the measured wait")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true", help="update docs/stragglers.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    command = "python -m benchmarks.stragglers " + " ".join(sys.argv[1:])
    if args.part in ("wait", "both"):
        body = (f"`{command}`: K threads sleep their seeded delays and meet at a barrier, {args.steps} steps "
                "per K; the barrier's own cost (no delay) is subtracted.\n\n" + wait_tables(args.specs, args.workers,
                                                                                        args.steps))
        print(body)
        if args.write:
            replace_section("Synchronous wait against K (measured)", body, DOC)
    if args.part in ("accuracy", "both"):
        body = (f"`{command}`: digits, mlp, 4 workers (threads), batch 32/worker, lr 0.1, {args.epochs} epochs, "
                f"seed {args.seed}; the straggler's delay counts as compute.\n\n"
                + accuracy_table(args.epochs, args.target, args.seed))
        print(body)
        if args.write:
            replace_section("Time to accuracy with a slow worker (measured)", body, DOC)


if __name__ == "__main__":
    main()
