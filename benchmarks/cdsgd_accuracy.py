"""Accuracy of CD-SGD against S-SGD, BIT-SGD and OD-SGD, and its k-sensitivity.

Runs every method on the same task and seeds (4 workers on threads: the same math as
processes) and prints markdown tables: final test accuracy mean ± std over seeds, bytes
sent per worker, and CD-SGD at k = 2, 5, 10, 20 (the slides' k-sensitivity study).

    python -m benchmarks.cdsgd_accuracy --write
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchmarks.docs_section import PAGES, replace_section

import torch  # noqa: E402

import gradzip  # noqa: E402
from gradzip.train.config import RunConfig  # noqa: E402
from gradzip.train.loop import run_many  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist-5k"


def configs(k_values, warmup, lr):
    main = [("S-SGD", "ssgd", {}), ("BIT-SGD", "bitsgd", {}),
            ("OD-SGD", "odsgd", {"warmup_steps": warmup}),
            ("CD-SGD k=5", "cdsgd", {"k": 5, "warmup_steps": warmup}),
            ("CD-SGD k=5, local_lr=lr", "cdsgd", {"k": 5, "warmup_steps": warmup, "local_lr": lr})]
    ks = [(f"CD-SGD k={k}", "cdsgd", {"k": k, "warmup_steps": warmup}) for k in k_values if k != 5]
    return main, ks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", nargs="+", default=[f"mnist:lenet:{SHARED}:10", "digits:mlp::20"],
                    help="DATASET:MODEL:DATA_DIR:EPOCHS")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 5, 10, 20])
    ap.add_argument("--warmup-steps", type=int, default=60,
                    help="S-SGD steps before the delayed phase (the authors warm up too)")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks/cdsgd.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    main_cfgs, k_cfgs = configs(args.k, args.warmup_steps, args.lr)
    sections = []
    began = time.perf_counter()
    for task in args.tasks:
        dataset, model, data_dir, epochs = task.split(":")
        results: dict[str, list[dict]] = {}
        for seed in range(args.seeds):
            cfgs = [RunConfig(algo=algo, options=opts, label=label, dataset=dataset, model=model,
                              data_dir=data_dir or None, epochs=int(epochs), lr=args.lr, seed=seed,
                              progress=False) for label, algo, opts in main_cfgs + k_cfgs]
            for run in gradzip.simulate(args.workers, lambda comm: run_many(comm, cfgs))[0]:
                results.setdefault(run["summary"]["algo"], []).append(run["summary"])
                s = run["summary"]
                print(f"{task} seed {seed} {s['algo']}: {s['final_test_accuracy']:.4f}", flush=True)

        def row(label):
            accs = [100 * s["final_test_accuracy"] for s in results[label]]
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            ref = statistics.mean(100 * s["final_test_accuracy"] for s in results["S-SGD"])
            s0 = results[label][0]
            return (f"| {label} | {statistics.mean(accs):.2f} ± {sd:.2f} | {statistics.mean(accs) - ref:+.2f} | "
                    f"{s0['bytes_sent_per_worker'] / 1e6:.2f} | {s0['compression_ratio']:.1f} |")

        head = "| method | test acc % (mean ± std) | vs S-SGD | MB sent/worker | R_C |\n|---|---|---|---|---|"
        sections.append(f"**{dataset} / {model}, {epochs} epochs**\n\n{head}\n"
                        + "\n".join(row(label) for label, _, _ in main_cfgs) + "\n\n"
                        + f"k-sensitivity (CD-SGD):\n\n{head}\n"
                        + "\n".join(row(f"CD-SGD k={k}") for k in args.k) + "\n")
    command = "python -m benchmarks.cdsgd_accuracy " + " ".join(sys.argv[1:])
    text = (f"Command: `{command}` — {args.workers} workers (threads), batch 32 per worker, lr {args.lr}, "
            f"momentum 0, warm-up {args.warmup_steps} steps of S-SGD for OD-/CD-SGD, 2-bit threshold 0.01 on mean gradients, "
            f"local_lr = lr / workers, seeds 0..{args.seeds - 1}; {time.perf_counter() - began:.0f} s.\n\n"
            + "\n".join(sections))
    print(text)
    if args.write:
        replace_section("CD-SGD accuracy and k-sensitivity", text, PAGES / "cdsgd.md")


if __name__ == "__main__":
    main()
