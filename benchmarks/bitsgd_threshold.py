"""Choose the 2-bit threshold for mean gradients: BIT-SGD accuracy across thresholds.

MXNet compares its threshold (0.5) with batch-*summed* gradients; gradzip quantizes mean
gradients (docs/algorithms.md §codec: 2bit), so its default must be chosen for that
scale. This sweep trains BIT-SGD at several thresholds next to S-SGD on the same task and
prints a markdown table (and writes it into docs/benchmarks/accuracy.md with --write).

    python -m benchmarks.bitsgd_threshold --workers 4 --epochs 10
"""
from __future__ import annotations

import argparse
import sys

from benchmarks.docs_section import PAGES, replace_section

import gradzip  # noqa: E402
from gradzip.train.config import RunConfig  # noqa: E402
from gradzip.train.loop import run_many  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05])
    ap.add_argument("--tasks", nargs="+", default=["digits:mlp", "digits:lenet"],
                    help="DATASET:MODEL pairs (e.g. mnist:lenet with --data-dir)")
    ap.add_argument("--data-dir")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--momenta", type=float, nargs="+", default=[0.0, 0.9])
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks/accuracy.md")
    args = ap.parse_args()

    rows = []
    for task in args.tasks:
        dataset, model = task.split(":")
        base = dict(dataset=dataset, model=model, data_dir=args.data_dir, epochs=args.epochs,
                    lr=args.lr, progress=False)
        cfgs = []
        for m in args.momenta:
            cfgs.append(RunConfig(algo="ssgd", label=f"ssgd m={m:g}", momentum=m, **base))
            cfgs += [RunConfig(algo="bitsgd", options={"threshold": t}, label=f"bitsgd m={m:g} t={t:g}",
                               momentum=m, **base) for t in args.thresholds]
        accs: dict[str, list[float]] = {}
        for seed in range(args.seeds):
            for c in cfgs:
                c.seed = seed
            runs = gradzip.simulate(args.workers, lambda comm: run_many(comm, cfgs))[0]
            for r in runs:
                accs.setdefault(r["summary"]["algo"], []).append(r["summary"]["final_test_accuracy"])
        for label, values in accs.items():
            mean = sum(values) / len(values)
            rows.append(f"| {task} | {label} | {mean:.4f} | {' '.join(f'{v:.4f}' for v in values)} |")
            print(rows[-1], flush=True)
    table = "\n".join(["| task | method | mean test acc | per seed |", "|---|---|---|---|", *rows])
    command = "python -m benchmarks.bitsgd_threshold " + " ".join(sys.argv[1:])
    text = (f"Command: `{command}` ({args.workers} workers on threads, {args.epochs} epochs, "
            f"batch 32 per worker, lr {args.lr}, seeds 0..{args.seeds - 1}).\n\n{table}\n")
    print(text)
    if args.write:
        replace_section("BIT-SGD threshold on mean gradients", text, PAGES / "accuracy.md")


if __name__ == "__main__":
    main()
