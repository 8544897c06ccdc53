"""The CSER accuracy table at small scale: test accuracy vs overall compression ratio R_C
for SGD, EF-SGD, QSparse-local-SGD, CSEA, CSER and CSER-PL (issue 5; CSER seed's table).

8 workers in-process (``gradzip.simulate``), LeNet on MNIST-5k (4,000 training images,
1,000 test), batch 16 per worker, local Nesterov momentum 0.9 (never synchronised, as the
reference code), R_C in {1, 16, 256, 1024} (R_C = 1 is SGD), codecs the random-block
sparsifiers that ``rc=`` derives (``gradzip.optim.core.ratios``). The same LR budget for every
method: each LR is tried on seed 0, the best (final test accuracy) is then run on the
other seeds; the table shows mean ± std over the seeds at that LR. Derived periods H are
capped at ``--max-H`` (32, two epochs) so that short runs still synchronise.

    python -m benchmarks.cser_table --write            # the full table: 80 runs of ~1 min on 2 shared cores
    python -m benchmarks.cser_table --report-only --write   # the table from the runs recorded so far
    python -m benchmarks.cser_table --epochs 1 --seeds 1 --lrs 0.05 --rcs 1,256   # smoke test

Every finished run is appended to ``--results`` (JSON lines) at once, and a rerun with the
same file skips the runs already there, so an interrupted table resumes; ``--write`` puts
the table into docs/cser.md (between markers) and a pointer into docs/benchmarks/accuracy.md.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.docs_section import PAGES, replace_marked, replace_section

import gradzip  # noqa: E402
from gradzip.optim.core.ratios import codec_for_ratio  # noqa: E402
from gradzip.train.config import RunConfig  # noqa: E402
from gradzip.train.loop import run_many  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "cser.md"
BEGIN, END = "<!-- cser_table:begin -->", "<!-- cser_table:end -->"

METHODS = ["sgd", "efsgd", "qsparse", "csea", "cser", "cserpl"]
TITLES = {"sgd": "SGD", "efsgd": "EF-SGD", "qsparse": "QSparse-local-SGD", "csea": "CSEA",
          "cser": "CSER", "cserpl": "CSER-PL"}
#: The CSER seed's table (CIFAR-100, WRN-40-8, 8 workers), the rows we reproduce.
PAPER = {
    1: {"sgd": "87.01±0.11"},
    16: {"efsgd": "85.69±0.31", "qsparse": "87.02±0.13", "csea": "87.15±0.09", "cser": "87.28±0.04",
         "cserpl": "86.72±0.05"},
    256: {"efsgd": "83.92±0.55", "qsparse": "diverge", "csea": "86.34±0.20", "cser": "86.68±0.07",
          "cserpl": "86.27±0.02"},
    1024: {"efsgd": "diverge", "qsparse": "diverge", "csea": "85.13±0.13", "cser": "85.66±0.07",
           "cserpl": "84.94±0.37"},
}


#: A period longer than any run: local SGD that never averages during training (the control).
NEVER = 10**9


def method_config(method: str, rc: int, max_H: int) -> tuple[str, dict] | None:
    """(gradzip algo, options) of a table cell; None where the table has no cell."""
    if method == "sgd":  # R_C = 1: S-SGD; R_C = 0 stands for the control "no communication at all"
        return ("ssgd", {}) if rc == 1 else ("localsgd", {"H": NEVER}) if rc == 0 else None
    if rc == 0:
        return None
    if rc == 1:
        return None
    if method == "efsgd":
        return "efsgd", {"compressor": codec_for_ratio(rc)}
    algo = {"qsparse": "qsparse", "csea": "csea", "cser": "cser", "cserpl": "cserpl"}[method]
    options: dict = {"rc": float(rc)}
    if algo != "csea":  # cap the derived period for short runs (see the docs)
        probe = gradzip.optim.METHODS[algo]([torch.nn.Parameter(torch.zeros(1))], lr=0.1, rc=float(rc))
        if probe.H > max_H:
            options["H"] = max_H
    return algo, options


def key(rec: dict) -> tuple:
    return rec["method"], rec["rc"], rec["lr"], rec["seed"]


def run_one(args, method, rc, algo, options, lr, seed) -> dict:
    cfg = RunConfig(algo=algo, options=options, label=f"{method}@{rc}", dataset="mnist", data_dir=args.data_dir,
                    model="lenet", epochs=args.epochs, batch_size=args.batch_size, lr=lr, momentum=0.9,
                    nesterov=True, seed=seed, progress=False)
    began = time.perf_counter()
    out = gradzip.simulate(args.workers, lambda comm: run_many(comm, [cfg]))[0][0]
    s = out["summary"]
    acc = s["final_test_accuracy"]
    return {"method": method, "rc": rc, "lr": lr, "seed": seed, "algo": algo,
            "options": {k: str(v) for k, v in options.items()}, "epochs": args.epochs, "steps": s["steps"],
            "final_test_accuracy": acc, "diverged": bool(s["diverged"] or acc is None or not math.isfinite(acc)),
            "measured_rc": s["compression_ratio"], "H": s.get("H"), "wall_s": time.perf_counter() - began,
            "curve": [h.get("test_accuracy") for h in out["history"]]}


def load(path: Path) -> dict[tuple, dict]:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                done[key(rec)] = rec
    return done


def best_lr(done, method, rc, lrs):
    scored = [(done[(method, rc, lr, 0)]["final_test_accuracy"] if not done[(method, rc, lr, 0)]["diverged"]
               else -1.0, lr) for lr in lrs if (method, rc, lr, 0) in done]
    return max(scored)[1] if scored else None


def cell(done, method, rc, lrs, seeds):
    lr = best_lr(done, method, rc, lrs)
    if lr is None:
        return None
    recs = [done[(method, rc, lr, s)] for s in range(seeds) if (method, rc, lr, s) in done]
    accs = [100 * r["final_test_accuracy"] for r in recs if not r["diverged"]]
    diverged = len(accs) < len(recs)
    rcs = [r["measured_rc"] for r in recs]
    return {"lr": lr, "n": len(recs), "accs": accs, "diverged": diverged,
            "mean": statistics.mean(accs) if accs else None,
            "std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "measured_rc": statistics.mean(rcs), "H": recs[0].get("H"), "options": recs[0]["options"]}


def table(done, args, lrs, rcs) -> str:
    head = "| R_C | " + " | ".join(TITLES[m] for m in METHODS) + " |"
    lines = [head, "|" + "---|" * (len(METHODS) + 1)]
    for rc in rcs:
        ours, paper = [], []
        for m in METHODS:
            if method_config(m, rc, args.max_H) is None:
                ours.append("")
                paper.append("")
                continue
            c = cell(done, m, rc, lrs, args.seeds)
            if c is None:
                ours.append("(not run)")
            else:
                acc = "diverge" if c["mean"] is None else f"{c['mean']:.2f} ± {c['std']:.2f}"
                if c["diverged"] and c["mean"] is not None:
                    acc += f" ({len(c['accs'])}/{c['n']} seeds; others diverged)"
                seeds = "" if c["n"] == args.seeds else f", {c['n']} seed{'s' * (c['n'] > 1)}"
                ours.append(f"**{acc}** (lr {c['lr']:g}{seeds}; R_C {c['measured_rc']:.0f})")
            paper.append(PAPER.get(rc, {}).get(m, "n/a"))
        if rc == 0:
            lines.append("| ∞: no communication (control) | " + " | ".join(ours) + " |")
            continue
        lines.append(f"| {rc} (ours) | " + " | ".join(ours) + " |")
        lines.append(f"| {rc} (paper) | " + " | ".join(paper) + " |")
    return "\n".join(lines)


def settings(args, rcs) -> str:
    rows = ["| method | R_C | algo and options | period H |", "|---|---|---|---|"]
    for rc in rcs:
        for m in METHODS:
            mc = method_config(m, rc, args.max_H)
            if mc is None:
                continue
            algo, opts = mc
            probe = gradzip.optim.METHODS[algo]([torch.nn.Parameter(torch.zeros(1))], lr=0.1, **opts)
            H = getattr(probe, "H", "")
            codecs = ", ".join(f"{n} = `{x.compressor}`" for n, x in (
                ("C1", getattr(probe, "psync1", None)), ("C2", getattr(probe, "psync2", None)),
                ("C", getattr(probe, "psync", None))) if x is not None)
            rows.append(f"| {TITLES[m]} | {rc} | `{algo}` {json.dumps(opts)}: {codecs} | {H} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--lrs", default="0.01,0.03,0.1", help="comma-separated learning rates (the tuning budget)")
    ap.add_argument("--rcs", default="1,256,1024,16,0", help="R_C values, in the order they are run; 0 is the control: "
                                                              "local SGD that never averages, evaluated on the average")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-H", type=int, default=32, help="cap on the derived period (short runs)")
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "mnist-5k"))
    ap.add_argument("--results", default="runs/cser_table.jsonl", help="JSON lines, appended per run (resume)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--write", action="store_true", help="update docs/cser.md and docs/benchmarks/accuracy.md")
    ap.add_argument("--report-only", action="store_true", help="print/write the table from --results, run nothing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lrs = [float(x) for x in args.lrs.split(",")]
    rcs = [int(x) for x in args.rcs.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = load(path)
    began = time.perf_counter()

    def do(method, rc, algo, options, lr, seed):
        if (method, rc, lr, seed) in done:
            return
        rec = run_one(args, method, rc, algo, options, lr, seed)
        done[key(rec)] = rec
        with path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"[{time.perf_counter() - began:7.0f}s] {method}@{rc} lr={lr:g} seed={seed}: "
              f"acc={rec['final_test_accuracy']} R_C={rec['measured_rc']:.1f} ({rec['wall_s']:.0f}s)", flush=True)

    if not args.report_only:
        for rc in rcs:
            for m in methods:
                mc = method_config(m, rc, args.max_H)
                if mc is None:
                    continue
                for lr in lrs:             # tuning: every LR on seed 0
                    do(m, rc, *mc, lr, 0)
                lr = best_lr(done, m, rc, lrs)
                for seed in range(1, args.seeds):   # the best LR on the other seeds
                    do(m, rc, *mc, lr, seed)
    order = sorted(rcs, key=lambda r: r if r else math.inf)
    cmd = "python -m benchmarks.cser_table " + " ".join(
        a for a in sys.argv[1:] if a not in ("--report-only",))
    body = (f"Measured by `{cmd.strip()}` ({args.workers} workers in-process, LeNet, MNIST-5k, "
            f"{args.epochs} epochs of {4000 // args.workers // args.batch_size} steps, batch {args.batch_size} "
            f"per worker, Nesterov 0.9 local, LRs {args.lrs} tuned on seed 0, mean ± std of final test "
            f"accuracy (%) over {args.seeds} seeds at the best LR; R_C in parentheses is the measured one).\n\n"
            + table(done, args, lrs, order) + "\n\nSettings:\n\n" + settings(args, order) + "\n")
    print(body)
    if args.write:
        replace_marked(BEGIN, END, body, DOC, title="# CSER family")
        replace_section("CSER accuracy table", (
            "The small-scale reproduction of the CSER paper's accuracy table (SGD, EF-SGD, QSparse-local-SGD, "
            "CSEA, CSER, CSER-PL at R_C = 1, 16, 256, 1024; 8 workers, LeNet on MNIST-5k) is in "
            f"[cser.md](../cser.md), produced by `{cmd.strip()}`."), PAGES / "accuracy.md")


if __name__ == "__main__":
    main()
