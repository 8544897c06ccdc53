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

    python -m benchmarks.large_batch --epochs 10 --seeds 3 --jobs 16 --write
    python -m benchmarks.large_batch --from runs/large_batch.json --write    # tables only
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks import grid
from benchmarks.docs_section import DOCS, replace_section

import gradzip
from gradzip.guards.nonfinite import NonFiniteGradient
from gradzip.optim import scaled_lr
from gradzip.train.config import RunConfig
from gradzip.train.loop import run_many

LARGE_BATCH_DOC = DOCS / "large_batch.md"


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


def run_one(task: tuple[dict, int, int, int]) -> dict:
    """One (global batch, method, seed) run: ``workers`` workers on threads."""
    settings, per_worker, index, seed = task
    args = argparse.Namespace(**{**settings, "seed": seed})
    cfg = configs(args, per_worker)[index]
    began = time.perf_counter()
    try:
        s = gradzip.simulate(settings["workers"], lambda comm: run_many(comm, [cfg]))[0][0]["summary"]
    except NonFiniteGradient as exc:   # diverged: a row of the table, not the end of the study
        global_batch = settings["workers"] * per_worker
        return {"global_batch": global_batch, "method": cfg.label, "index": index, "seed": seed,
                "final_acc": None, "best_acc": None, "sharpness": None, "diverged": str(exc).split(":")[0],
                "lr_peak": scaled_lr(cfg.lr, global_batch, cfg.base_batch, cfg.lr_scaling), "steps": None,
                "wall_s": time.perf_counter() - began}
    return {"global_batch": s["global_batch"], "method": s["algo"], "index": index, "seed": seed,
            "final_acc": s["final_test_accuracy"], "best_acc": s["best_test_accuracy"], "sharpness": s["sharpness"],
            "lr_peak": s["lr_peak"], "steps": s["steps"], "wall_s": time.perf_counter() - began}


def table(res: dict) -> str:
    """The docs' section from a results file: per (global batch, method) the mean over seeds."""
    st, runs = res["settings"], res["runs"]
    seeds = sorted({r["seed"] for r in runs})
    lines = [f"| global batch | method | final acc | final acc per seed | best acc | sharpness (rho={st['rho']}) "
             "| peak lr | steps |", "|---:|---|---:|---|---:|---:|---:|---:|"]
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["global_batch"], r["index"]), []).append(r)
    for (b, _), rs in sorted(groups.items()):
        rs.sort(key=lambda r: r["seed"])
        ok = [r for r in rs if r["final_acc"] is not None]   # the others diverged (NaN/Inf gradient)

        def mean(k: str) -> str:
            return f"{statistics.mean(r[k] for r in ok):.4f}" if ok else "–"

        per_seed = " ".join("diverged" if r["final_acc"] is None else f"{r['final_acc']:.3f}" for r in rs)
        note = f" ({len(rs) - len(ok)} of {len(rs)} diverged)" if len(ok) < len(rs) else ""
        steps = next((r["steps"] for r in ok), "–")
        lines.append(f"| {b} | {rs[0]['method']} | {mean('final_acc')}{note} | {per_seed} | {mean('best_acc')} | "
                     f"{mean('sharpness')} | {rs[0]['lr_peak']:.4g} | {steps} |")
    return (f"digits, {st['model']}, {st['workers']} workers (threads) per run, {st['epochs']} epochs, momentum 0.9 "
            f"(LAMB: betas 0.9/0.999), base batch {st['base_batch']}, warm-up {st['warmup_epochs']} epochs, seeds "
            f"{', '.join(map(str, seeds))} (mean over seeds); {res['wall_s']:.0f} s wall in all.\n"
            f"`{res.get('command', '')}`\n\n" + "\n".join(lines))


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
    ap.add_argument("--seed", type=int, default=0, help="the first seed")
    ap.add_argument("--seeds", type=int, default=1, help="seeds seed .. seed + seeds - 1")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel processes (one torch thread each)")
    ap.add_argument("--json", default="runs/large_batch.json", help="results file")
    ap.add_argument("--from", dest="source", help="tabulate an earlier results file, run nothing")
    ap.add_argument("--write", action="store_true", help="write the table into docs/large_batch.md")
    args = ap.parse_args()
    if args.source:
        res = grid.load(args.source)
    else:
        settings = {k: v for k, v in vars(args).items() if k not in ("source", "write", "json", "jobs")}
        n_methods = len(configs(args, args.per_worker[0]))
        tasks = [(settings, pw, i, seed) for pw in args.per_worker for i in range(n_methods)
                 for seed in range(args.seed, args.seed + args.seeds)]
        began = time.perf_counter()

        def report(task, r):
            if r["final_acc"] is None:
                print(f"B={r['global_batch']:5d} {r['method']:55s} seed {r['seed']} {r['diverged']}", flush=True)
                return
            print(f"B={r['global_batch']:5d} {r['method']:55s} seed {r['seed']} acc {r['final_acc']:.4f} "
                  f"sharpness {r['sharpness']:.4f} peak lr {r['lr_peak']:.4g} steps {r['steps']}", flush=True)

        runs = grid.run_grid(run_one, tasks, args.jobs, report)
        res = grid.save(args.json, settings, runs, began, command="python -m benchmarks.large_batch " + " ".join(sys.argv[1:]))
        print(f"results: {args.json}")
    body = table(res)
    print(body)
    if args.write:
        replace_section("Measured: accuracy and sharpness against the global batch", body, LARGE_BATCH_DOC)


if __name__ == "__main__":
    main()
