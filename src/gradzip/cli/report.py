"""What a run leaves behind: ``metrics.jsonl``, ``summary.json``, a plot, a printed table."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from ..units import format_rate
from ..files import write_atomically, write_text
from ..bench import projection

COLUMNS = [  # header, summary key, format
    ("method", "algo", "{}"),
    ("test acc", "final_test_accuracy", "{:.4f}"),
    ("MB sent/worker", "bytes_sent_per_worker", "{:.3f}"),
    ("R_C", "compression_ratio", "{:.1f}"),
    ("time s", "wall_time_s", "{:.1f}"),
    ("compute s", "time_compute_s", "{:.2f}"),
    ("compress s", "time_compress_s", "{:.2f}"),
    ("wait s", "time_wait_s", "{:.2f}"),
]
#: What the time columns measure (summary.json also has ``time_communicate_s``: seconds spent
#: waiting on collectives on any thread; it is not a column because on the training thread it
#: is ``wait s`` itself, and the network time of a collective running behind the backward pass
#: or a step's computation is not measured).
TIME_LEGEND = ("time s: training wall time (set-up excluded); compute s: forward and backward; compress s: codec "
               "work, wherever it ran; wait s: time the training thread was blocked on the exchange (its "
               "collectives, and for a method that exchanges in the background, as OD-SGD and CD-SGD, on that "
               "exchange, codec work included); seconds per worker, mean over the workers")


def _cell(summary: dict[str, Any], key: str, fmt: str) -> str:
    value = summary.get(key)
    if value is None:
        return "-"
    if key == "bytes_sent_per_worker":
        value = value / 1e6
    if key == "final_test_accuracy" and summary.get("diverged"):
        return f"{value:.4f} (diverged)"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return fmt.format(value)


#: Shown only when some run has a value other than 0 / None for it: the language-model
#: columns (sequence data), then the rare events.
OCCASIONAL = [("test loss", "final_test_loss", "{:.4f}"), ("bits/byte", "bits_per_byte", "{:.4f}"),
              ("tokens/s", "tokens_per_s", "{:.0f}"),
              ("skipped", "skipped_steps", "{}"), ("resumed at", "resumed_from_step", "{}")]
#: The occasional columns that need a language model's run to be shown (test loss is in every summary).
_LM_ONLY = {"final_test_loss": "tokens_per_s"}


def table(summaries: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of the runs, one row each, and what its time columns measure; with
    the runs' ``projections`` (:mod:`gradzip.bench.projection`) one column per (worker count,
    link rate), labelled as projections ("-" for a run not projected), and the projection's
    lines under the table (:func:`gradzip.bench.projection.legend`)."""
    columns = COLUMNS + [c for c in OCCASIONAL if any(s.get(_LM_ONLY.get(c[1], c[1])) for s in summaries)]
    rows = [[h for h, _, _ in columns]] + [[_cell(s, k, f) for _, k, f in columns] for s in summaries]
    heads = next((s["projections"] for s in summaries if s.get("projections")), [])
    rows[0] += [projection.column(p) for p in heads]
    for row, s in zip(rows[1:], summaries):
        row += [projection.cell(p) for p in s["projections"]] if s.get("projections") else ["-"] * len(heads)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + [TIME_LEGEND] + projection.legend(summaries))


def write(out_dir: str | Path, runs: Sequence[dict[str, Any]], *, plot: bool = True) -> Path:
    """``metrics.jsonl`` (one record per evaluation, every run), ``summary.json`` (the
    summary of a single run, or a list for several) and, with ``plot``, ``accuracy.png``,
    each written whole or not at all (:func:`gradzip.files.write_atomically`: a full disk
    leaves the previous file, never an empty or truncated one)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "metrics.jsonl", "".join(json.dumps(record) + "\n" for run in runs for record in run["history"]))
    summaries = [run["summary"] for run in runs]
    write_text(out / "summary.json", json.dumps(summaries[0] if len(runs) == 1 else summaries, indent=2))
    if plot:
        plot_accuracy(runs, out / "accuracy.png")
    return out


def _own_projection(summary: dict[str, Any]) -> dict[str, Any] | None:
    """The run's projection at its own worker count and the first link rate (the plot's)."""
    return next((p for p in summary.get("projections") or () if p["workers"] == summary["workers"]), None)


def plot_accuracy(runs: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Test accuracy (a language model's runs: test loss) against epochs and against MB sent
    per worker, one line per run; with projections, also against the projected time (epoch
    x projected seconds per epoch) at the run's own worker count and the first projected
    link rate. The image's format is ``path``'s suffix (png without one); the file is
    written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    own = [_own_projection(run["summary"]) for run in runs]
    with_time = all(p is not None for p in own)
    key, name = (("test_loss", "test loss") if all(run["summary"].get("tokens_per_s") for run in runs)
                 else ("test_accuracy", "test accuracy"))
    fig, axes = plt.subplots(1, 3 if with_time else 2, figsize=(16 if with_time else 11, 4))
    by_epoch, by_bytes = axes[0], axes[1]
    for run, proj in zip(runs, own):
        hist = [h for h in run["history"] if h.get(key) is not None]
        label = run["summary"]["algo"]
        acc = [h[key] for h in hist]
        by_epoch.plot([h["epoch"] for h in hist], acc, marker="o", ms=3, label=label)
        by_bytes.plot([max(h["bytes_sent_per_worker"], 1) / 1e6 for h in hist], acc, marker="o", ms=3, label=label)
        if with_time:
            axes[2].plot([h["epoch"] * proj["epoch_s"] for h in hist], acc, marker="o", ms=3, label=label)
    by_epoch.set(xlabel="epoch", ylabel=name, title=f"{name} per epoch")
    by_bytes.set(xlabel="MB sent per worker (log)", ylabel=name, title=f"{name} per byte", xscale="log")
    if with_time:
        axes[2].set(xlabel=f"PROJECTED time (s) at {format_rate(own[0]['bandwidth_bps'])}",
                    ylabel=name, title=f"{name} per projected time (timeline model)")
    for ax in axes:
        ax.grid(alpha=0.3)
    by_bytes.legend(fontsize=8)
    s = runs[0]["summary"]
    fig.suptitle(f"{s['dataset']} / {s['model']}, {s['workers']} workers")
    fig.tight_layout()
    try:
        write_atomically(path, lambda f: fig.savefig(f, format=Path(path).suffix[1:] or "png", dpi=110), binary=True)
    finally:
        plt.close(fig)
