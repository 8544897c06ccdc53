"""Large batch on digits: test accuracy and sharpness against the global batch, for SGD
with and without linear scaling + warm-up, LARS, LAMB and SAM (docs/large_batch.md).

The lecture's claim (Keskar et al.; Goyal et al.; You et al.; Foret et al.): at a fixed
number of epochs, plain SGD loses accuracy as the global batch grows (fewer, equally long
steps) and lands in sharper minima; scaling the learning rate with a warm-up recovers much
of it, LARS / LAMB go further, SAM finds flatter minima. Every method: ``--workers``
workers on threads (``gradzip.simulate``; the numbers are the same on gloo), the global
batch ``workers × per-worker batch``, the same epochs and seed; the learning rate of the
scaled methods is tuned for a global batch of ``--base-batch``. Sharpness:
:func:`gradzip.sharpness` at ``--rho`` on 512 training samples (larger = sharper).

    python -m benchmarks.large_batch --epochs 10 --write
"""
from __future__ import annotations

import argparse
import time

from benchmarks.docs_section import replace_section, DOC

import gradzip
from gradzip.train.config import RunConfig
from gradzip.train.loop import run_many

LARGE_BATCH_DOC = DOC.parent / "large_batch.md"


def configs(args, per_worker: int) -> list[RunConfig]:
    base = dict(dataset="digits", model=args.model, epochs=args.epochs, batch_size=per_worker, momentum=0.9,
                progress=False, sharpness_rho=args.rho, base_batch=args.base_batch, seed=args.seed)
    warm = dict(warmup_epochs=args.warmup_epochs)
    return [
        RunConfig(algo="ssgd", label="SGD", lr=args.lr, **base),
        RunConfig(algo="ssgd", label="SGD + linear scaling + warm-up", lr=args.lr, lr_scaling="linear", **warm, **base),
        RunConfig(algo="lars", label="LARS (sqrt scaling + warm-up)", lr=args.lars_lr, lr_scaling="sqrt", **warm, **base),
        RunConfig(algo="lamb", label="LAMB (sqrt scaling + warm-up)", lr=args.lamb_lr, lr_scaling="sqrt", **warm,
                  **{**base, "momentum": 0.0}),
        RunConfig(algo="ssgd", label=f"SAM rho={args.sam_rho} (SGD + linear scaling + warm-up)", lr=args.lr,
                  lr_scaling="linear", sam_rho=args.sam_rho, **warm, **base),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--per-worker", type=int, nargs="+", default=[8, 32, 128, 256],
                    help="per-worker batches (global = workers x this; digits has 1437 training samples)")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.05, help="SGD's rate, tuned for --base-batch")
    ap.add_argument("--lars-lr", type=float, default=2.0)
    ap.add_argument("--lamb-lr", type=float, default=0.005)
    ap.add_argument("--base-batch", type=int, default=32)
    ap.add_argument("--warmup-epochs", type=float, default=2.0)
    ap.add_argument("--sam-rho", type=float, default=0.05)
    ap.add_argument("--rho", type=float, default=0.05, help="sharpness radius")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true", help="write the table into docs/large_batch.md")
    args = ap.parse_args()

    rows, began = [], time.perf_counter()
    for per_worker in args.per_worker:
        cfgs = configs(args, per_worker)
        for run in gradzip.simulate(args.workers, lambda comm: run_many(comm, cfgs))[0]:
            s = run["summary"]
            rows.append((s["global_batch"], s["algo"], s["final_test_accuracy"], s["best_test_accuracy"],
                         s["sharpness"], s["lr_peak"], s["steps"]))
            print(f"B={s['global_batch']:5d} {s['algo']:55s} acc {s['final_test_accuracy']:.4f} "
                  f"sharpness {s['sharpness']:.4f} peak lr {s['lr_peak']:.4g} steps {s['steps']}", flush=True)
    wall = time.perf_counter() - began
    table = ["| global batch | method | final acc | best acc | sharpness (rho={}) | peak lr | steps |".format(args.rho),
             "|---:|---|---:|---:|---:|---:|---:|"]
    table += [f"| {b} | {m} | {a:.4f} | {best:.4f} | {sh:.4f} | {lr:.4g} | {st} |" for b, m, a, best, sh, lr, st in rows]
    body = (f"digits, {args.model}, {args.workers} workers (threads), {args.epochs} epochs, momentum 0.9 (LAMB: "
            f"betas 0.9/0.999), base batch {args.base_batch}, warm-up {args.warmup_epochs} epochs, seed {args.seed}; "
            f"{wall:.0f} s in all.\n`python -m benchmarks.large_batch " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("write", "per_worker"))
            + f" --per-worker {' '.join(map(str, args.per_worker))}`\n\n" + "\n".join(table))
    print(body)
    if args.write:
        replace_section("Measured: accuracy and sharpness against the global batch", body, LARGE_BATCH_DOC)


if __name__ == "__main__":
    main()
