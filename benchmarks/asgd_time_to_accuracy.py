"""A-SGD against S-SGD: time per epoch, accuracy and time to a target accuracy on digits
(the issue's measurement: 4 workers, one of them 2x slower, slow links).

Runs ``gradzip compare --algos ssgd,asgd`` (real gloo processes) and tabulates its
metrics.jsonl (one record per epoch: wall time, test accuracy) and summary.json
(staleness per worker). Extra flags go to ``gradzip compare`` as they are, e.g. a
straggler (``--straggler slow:rank=3,factor=2`` where that option exists) or A-SGD's
``--staleness 2``:

    python -m benchmarks.asgd_time_to_accuracy --epochs 10 -- --straggler slow:rank=3,factor=2

Link shaping (100 Mbit/s per worker) needs the network namespaces of ``gradzip bench net``
(root, tc), which time synthetic steps rather than train: run this script inside such a
setup to measure time to accuracy on shaped links.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def time_to(history: list[dict], target: float) -> float | None:
    """Wall seconds of the first epoch whose test accuracy reaches ``target``, or None."""
    return next((h["wall_time_s"] for h in history if h.get("test_accuracy", 0.0) >= target), None)


def table(records: list[dict], summaries: list[dict], target: float) -> str:
    lines = [f"| method | epochs | s/epoch | final acc | best acc | s to {target:.0%} | staleness mean / max | "
             "max per worker |", "|" + "---|" * 8]
    for s in summaries:
        hist = [r for r in records if r.get("algo") == s["algo"]]
        per_epoch = s["wall_time_s"] / max(len(hist), 1)
        reached = time_to(hist, target)
        stale = (f"{s['staleness_mean']:.2f} / {s['staleness_max']}" if "staleness_mean" in s else "-")
        per_worker = s.get("staleness_max_per_worker", "-")
        lines.append(f"| {s['algo']} | {len(hist)} | {per_epoch:.2f} | {s['final_test_accuracy']:.4f} | "
                     f"{s['best_test_accuracy']:.4f} | {'-' if reached is None else f'{reached:.1f}'} | "
                     f"{stale} | {per_worker} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--algos", default="ssgd,asgd")
    ap.add_argument("--target", type=float, default=0.9, help="accuracy for time-to-accuracy (default: 0.9)")
    ap.add_argument("extra", nargs="*", help="extra flags for gradzip compare (after --)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "gradzip.cli", "compare", "--quiet", "--algos", args.algos,
               "--workers", str(args.workers), "--dataset", "digits", "--epochs", str(args.epochs),
               "--out", out, *args.extra]
        began = time.perf_counter()
        subprocess.run(cmd, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - began
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line]
        summaries = json.loads((Path(out) / "summary.json").read_text())
    summaries = summaries if isinstance(summaries, list) else [summaries]
    print(f"gradzip compare --algos {args.algos} --workers {args.workers} --dataset digits "
          f"--epochs {args.epochs} {' '.join(args.extra)} ({wall:.0f} s end to end)\n")
    print(table(records, summaries, args.target))


if __name__ == "__main__":
    main()
