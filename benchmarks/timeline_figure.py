"""Render Chrome/Perfetto traces written by ``gradzip train --trace`` as a PNG timeline,
several methods side by side (like the CD-SGD slides' "timeline tracing" figure).

    gradzip train --algo bitsgd --workers 2 --epochs 1 --trace runs/bit.json
    gradzip train --algo cdsgd  --workers 2 --epochs 1 --trace runs/cd.json
    python -m benchmarks.timeline_figure runs/bit.json runs/cd.json --labels BIT-SGD CD-SGD \\
        --steps 5 --out docs/timeline.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"compute": "#4c72b0", "compress": "#dd8452", "decode": "#c44e52", "communicate": "#55a868",
          "global_update": "#8172b3", "wait": "#bbbbbb"}


def load(path: str, steps: int, skip: int) -> tuple[list[dict], float]:
    """The spans of ``steps`` consecutive steps after ``skip`` warm-up steps, from the first
    worker's compute span of that window; times in ms from the window's start."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e["ph"] == "X"]
    computes = sorted(e["ts"] for e in events if e["name"] == "compute" and e["pid"] == 0)
    start = computes[skip]
    end = computes[skip + steps] if skip + steps < len(computes) else max(e["ts"] + e["dur"] for e in events)
    window = [e for e in events if e["ts"] < end and e["ts"] + e["dur"] > start and e["name"] in COLORS]
    return [dict(e, ts=(e["ts"] - start) / 1e3, dur=e["dur"] / 1e3) for e in window], (end - start) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--labels", nargs="+")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip", type=int, default=10, help="steps to skip at the start (warm-up)")
    ap.add_argument("--out", default="docs/timeline.png")
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    labels = args.labels or [Path(t).stem for t in args.traces]
    fig, axes = plt.subplots(len(args.traces), 1, figsize=(12, 1.9 * len(args.traces) + 0.6), squeeze=False)
    for ax, path, label in zip(axes[:, 0], args.traces, labels):
        spans, length = load(path, args.steps, args.skip)
        tracks = sorted({(e["pid"], e["tid"]) for e in spans},
                        key=lambda pt: (pt[0], "exchange" in pt[1]))
        for y, (pid, tid) in enumerate(tracks):
            for e in spans:
                if (e["pid"], e["tid"]) == (pid, tid):
                    ax.broken_barh([(e["ts"], e["dur"])], (y - 0.4, 0.8), color=COLORS[e["name"]])
        ax.set_yticks(range(len(tracks)))
        ax.set_yticklabels([f"worker {p}" + (" comm" if "exchange" in t else "") for p, t in tracks], fontsize=8)
        ax.set_xlim(0, length)
        ax.invert_yaxis()
        ax.set_title(f"{label}: {args.steps} steps in {length:.0f} ms ({length / args.steps:.1f} ms/step)",
                     fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("ms")
    handles = [matplotlib.patches.Patch(color=c, label=n) for n, c in COLORS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(COLORS), fontsize=8)
    if args.title:
        fig.suptitle(args.title, x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
