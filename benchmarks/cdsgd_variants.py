"""CD-SGD's free choices, measured: warm-up length and the local learning rate.

docs/algorithms.md §OD-SGD leaves ``local_lr`` free (default lr / n) and the authors warm up with S-SGD.
This runs, on mnist-5k / LeNet with 4 workers (threads), S-SGD and CD-SGD (k = 5) with
warm-up 0 or 60 steps and local_lr ∈ {lr/n, lr, 0}, plus OD-SGD, over seeds.

    python -m benchmarks.cdsgd_variants --write
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from benchmarks.docs_section import PAGES, replace_section

import torch  # noqa: E402

import gradzip  # noqa: E402
from gradzip.train.config import RunConfig  # noqa: E402
from gradzip.train.loop import run_many  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist-5k"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lr, n = args.lr, 4
    variants = [("S-SGD", "ssgd", {}),
                ("CD-SGD, warm-up 0, local_lr = lr/n", "cdsgd", {"k": 5}),
                ("CD-SGD, warm-up 60, local_lr = lr/n", "cdsgd", {"k": 5, "warmup_steps": 60}),
                ("CD-SGD, warm-up 0, local_lr = lr", "cdsgd", {"k": 5, "local_lr": lr}),
                ("CD-SGD, warm-up 60, local_lr = lr", "cdsgd", {"k": 5, "warmup_steps": 60, "local_lr": lr}),
                ("CD-SGD, warm-up 0, local_lr = 0 (no local step)", "cdsgd", {"k": 5, "local_lr": 0.0}),
                ("OD-SGD, warm-up 60, local_lr = lr/n", "odsgd", {"warmup_steps": 60})]
    results: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        cfgs = [RunConfig(algo=a, options=o, label=label, dataset="mnist", data_dir=str(SHARED), model="lenet",
                          epochs=args.epochs, lr=lr, seed=seed, progress=False) for label, a, o in variants]
        for run in gradzip.simulate(n, lambda comm: run_many(comm, cfgs))[0]:
            results.setdefault(run["summary"]["algo"], []).append(100 * run["summary"]["final_test_accuracy"])
    ref = statistics.mean(results["S-SGD"])
    rows = [f"| {k} | {statistics.mean(v):.2f} ± {statistics.stdev(v) if len(v) > 1 else 0:.2f} | "
            f"{statistics.mean(v) - ref:+.2f} | {' '.join(f'{x:.1f}' for x in v)} |" for k, v in results.items()]
    text = (f"Command: `python -m benchmarks.cdsgd_variants {' '.join(sys.argv[1:])}` — mnist-5k, LeNet, "
            f"{n} workers (threads), {args.epochs} epochs (31 steps each), lr {lr}, momentum 0, seeds "
            f"0..{args.seeds - 1}.\n\n| variant | test acc % | vs S-SGD | per seed |\n|---|---|---|---|\n"
            + "\n".join(rows) + "\n")
    print(text)
    if args.write:
        replace_section("CD-SGD: warm-up and local learning rate", text, PAGES / "cdsgd.md")


if __name__ == "__main__":
    main()
