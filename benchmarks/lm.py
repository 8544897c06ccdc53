"""Every adaptive and low-communication method on the language-model workload, side by side
(issue 34; docs/benchmarks/lm.md): AdamW (DDP), Compressed(AdamW) with 1bit / top-k and
error feedback, 1-bit Adam, 0/1 Adam, 1-bit LAMB, DiLoCo (H = 50, 100, 500), streaming
DiLoCo with 4-bit outer gradients, SparseLoCo, DeMo.

Each (method, seed) run is ``gradzip.train.loop.run_worker`` (the harness of ``gradzip
train``) with ``--model gpt --dataset text`` (the embedded Python-stdlib corpus) on
``--workers`` workers as threads of one process (``gradzip.simulate``; the numbers are those
of gloo), one torch thread, ``--eval-every`` steps between validation evaluations of the
workers' average model. Runs go ``--jobs`` at a time in separate processes
(:mod:`benchmarks.grid`).

**Resumable, in parts.** Every run writes checkpoints into ``RESULTS/ck/<run>`` and, when
done, its record into ``RESULTS/<run>.json``; a new call skips the finished runs and resumes
an interrupted one from its last checkpoint (bit for bit). ``--methods`` and ``--seeds``
pick a part; ``--write`` writes docs/benchmarks/lm.md's section (and the plot) from every
finished run of these settings, however many that is, and keeps the compact records in
docs/benchmarks/lm-runs.json, so ``--from docs/benchmarks/lm-runs.json --write`` rewrites the
page without running anything::

    python -m benchmarks.lm --results runs/lm --jobs 2 --seeds 0 --write      # one seed of every method
    python -m benchmarks.lm --results runs/lm --jobs 2 --seeds 0,1,2 --write  # the rest, later
    python -m benchmarks.lm --from docs/benchmarks/lm-runs.json --write
    python -m benchmarks.lm --dry-run                                         # seconds: CI

**Two studies.** The default settings (:data:`SETTINGS`) train 4 epochs with every method's
(inner) rate under the same ``--lr-schedule cosine:warmup=100,final=0.1``; ``--preset
one-epoch`` (:data:`ONE_EPOCH`) is the first study, one epoch at a constant rate. Each has its
own section of the page and its own plot (:func:`title_of`, :func:`plot_of`); the records
file keeps both, and ``--from`` rewrites every study it holds.

Projections: each run's own compute, codec and update seconds per step and its bytes fed to
the timeline model (:func:`gradzip.bench.projection.project_runs`) at 1, 10 and 100 Gbit/s.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import grid
from benchmarks.docs_section import DOCS, PAGES, replace_section

import gradzip
from gradzip.bench import projection
from gradzip.train import datasets
from gradzip.train.config import RunConfig
from gradzip.train.loop import run_worker

PAGE = PAGES / "lm.md"
RECORDS = PAGES / "lm-runs.json"
TITLE = "Methods for a transformer: the language-model study"
BANDWIDTHS = (1e9, 1e10, 1e11)

#: The study's settings (the CLI flags of the same names override them): several epochs, every
#: method's (inner) rate warmed up and decayed by the same ``--lr-schedule``.
SETTINGS = {"model": "gpt:layers=2,d=64,heads=4", "dataset": "text:context=64,bytes=2400000", "workers": 4,
            "batch_size": 8, "epochs": 4, "lr": 3e-3, "lamb_lr": 1e-2, "eval_every": 250, "freeze_fraction": 0.2,
            "checkpoint_every": 250, "lr_schedule": "cosine:warmup=100,final=0.1"}
#: The first study's (``--preset one-epoch``): one epoch at a constant rate. Its records carry no
#: ``lr_schedule`` (constant); its section keeps the page's first title.
ONE_EPOCH = {"model": "gpt:layers=2,d=64,heads=4", "dataset": "text:context=64,bytes=2400000", "workers": 4,
             "batch_size": 8, "epochs": 1, "lr": 3e-3, "lamb_lr": 1e-2, "eval_every": 100, "freeze_fraction": 0.2,
             "checkpoint_every": 100}
#: The dry run's (CI): seconds.
DRY = {"model": "gpt:layers=1,d=16,heads=2", "dataset": "text:context=16,bytes=12000", "workers": 2,
       "batch_size": 8, "epochs": 2, "lr": 2e-3, "lamb_lr": 1e-2, "eval_every": 20, "freeze_fraction": 0.2,
       "checkpoint_every": 20, "lr_schedule": "cosine:warmup=4,final=0.1"}


def schedule_of(s: dict) -> str:
    """The study's ``--lr-schedule`` (``"constant"`` for the one-epoch records, which have none)."""
    return s.get("lr_schedule", "constant")


def title_of(s: dict) -> str:
    """The page section of the runs with settings ``s``: the first study's keeps :data:`TITLE`."""
    if schedule_of(s) == "constant" and s["epochs"] == 1:
        return TITLE
    return f"{TITLE}, {s['epochs']} epochs, {schedule_of(s)}"


def plot_of(s: dict) -> Path:
    """The plot of the runs with settings ``s`` (the first study's keeps its name)."""
    return DOCS / ("bench_lm_loss.png" if title_of(s) == TITLE else f"bench_lm_loss_{s['epochs']}ep.png")


def methods(steps: int, s: dict) -> dict:
    """key -> (label, gradzip method, options, lr) for a run of ``steps`` steps."""
    freeze = max(1, int(s["freeze_fraction"] * steps))
    onebit = {"bias_correction": True, "momentum_bound": True}
    short = max(2, steps // 40)   # the dry run's periods
    h = (lambda H: H) if steps >= 1000 else (lambda H: short * max(1, H // 50))
    tau = min(5, h(100) // 4 - 1)   # streaming: the exchange in flight over τ < H/4 inner steps
    return {
        "adamw": ("AdamW (DDP)", "adamw", {}, s["lr"]),
        "adamw-1bit": ("Compressed(AdamW, 1bit + EF)", "adamw", {"compressor": "1bit"}, s["lr"]),
        "adamw-topk": ("Compressed(AdamW, top-k 1% + EF)", "adamw", {"compressor": "topk:ratio=0.01"}, s["lr"]),
        "onebitadam": ("1-bit Adam", "onebitadam", {"freeze_step": freeze, **onebit}, s["lr"]),
        "zerooneadam": ("0/1 Adam", "zerooneadam", {"var_freeze_step": freeze, **onebit}, s["lr"]),
        "onebitlamb": ("1-bit LAMB", "onebitlamb", {"freeze_step": freeze, **onebit}, s["lamb_lr"]),
        "diloco-50": (f"DiLoCo H={h(50)}", "diloco", {"H": h(50)}, s["lr"]),
        "diloco-100": (f"DiLoCo H={h(100)}", "diloco", {"H": h(100)}, s["lr"]),
        "diloco-500": (f"DiLoCo H={h(500)}", "diloco", {"H": h(500)}, s["lr"]),
        "streaming-int4": (f"Streaming DiLoCo H={h(100)}, 4 fragments, τ={tau}, α=0.5, int4", "diloco",
                           {"H": h(100), "fragments": 4, "delay": tau, "alpha": 0.5, "compressor": "int4"}, s["lr"]),
        "sparseloco": (f"SparseLoCo H={h(50)}, top-k 2% + 2-bit", "sparseloco", {"H": h(50)}, s["lr"]),
        "demo": ("DeMo (DCT chunk 64, top-32, sign)", "demo", {}, s["lr"]),
    }


def steps_of(s: dict) -> int:
    """Steps of one run: the epochs over the training sequences, ``batch_size`` per worker."""
    ds = datasets.load(s["dataset"])
    return s["epochs"] * (len(ds.train_x) // s["workers"] // s["batch_size"])


def run_one(task: tuple) -> dict:
    """One (method, seed) run, resumed from its checkpoints where it has some; its record."""
    key, seed, s, steps, results, command = task
    label, algo, options, lr = methods(steps, s)[key]
    name = f"{key}-s{seed}"
    cfg = RunConfig(algo=algo, options=options, label=key, dataset=s["dataset"], model=s["model"], epochs=s["epochs"],
                    batch_size=s["batch_size"], lr=lr, lr_schedule=schedule_of(s), seed=seed,
                    eval_every=s["eval_every"], progress=False,
                    checkpoint_dir=str(Path(results) / "ck" / name), checkpoint_every=s["checkpoint_every"],
                    resume=True)
    began = time.perf_counter()
    out = gradzip.simulate(s["workers"], lambda comm: run_worker(comm, cfg))[0]
    summary, history = out["summary"], out["history"]
    rows = projection.project_runs([{"summary": summary, "history": history}], BANDWIDTHS)[0].get("projections", [])
    keep = ("algo", "method", "options", "seed", "steps", "parameters", "final_test_loss", "bits_per_byte",
            "final_test_accuracy", "bytes_sent_per_worker", "tokens_per_s", "time_per_step_s", "dataset_info",
            "resumed_from_step", "diverged")
    record = {"key": key, "label": label, "seed": seed, "lr": lr, "settings": s, "command": command,
              "summary": {k: summary.get(k) for k in keep},
              "history": [{k: h[k] for k in ("step", "test_loss", "train_loss", "bytes_sent_per_worker")}
                          for h in history],
              "projection": [{"bandwidth_bps": r["bandwidth_bps"], "iteration_s": r["iteration_s"],
                              "compute_s": r["compute_s"], "compress_s": r["compress_s"],
                              "communicate_s": r["communicate_s"], "update_s": r["update_s"]} for r in rows],
              "wall_s": time.perf_counter() - began}
    Path(results, f"{name}.json").write_text(json.dumps(record, indent=1))
    return record


def run(args, s: dict, command: str) -> list[dict]:
    """The runs of ``--methods`` × ``--seeds`` that ``--results`` does not hold yet."""
    steps = steps_of(s)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    todo = [(k, seed, s, steps, str(results), command) for seed in args.seeds for k in args.methods
            if not (results / f"{k}-s{seed}.json").exists()]
    print(f"{len(todo)} runs of {steps} steps to do in {results}", flush=True)

    def report(task, r):
        print(f"{r['label']} seed {task[1]}: val loss {r['summary']['final_test_loss']:.4f}, "
              f"{r['summary']['bytes_sent_per_worker'] / 1e6:.1f} MB/worker ({r['wall_s']:.0f} s)", flush=True)

    grid.run_grid(run_one, todo, args.jobs, report)
    return collect(results, s)


def collect(results: Path, s: dict) -> list[dict]:
    """The finished runs in ``results`` made with the settings ``s``."""
    out = [json.loads(p.read_text()) for p in sorted(Path(results).glob("*-s*.json"))]
    return [r for r in out if r["settings"] == s]


# -- the page ----------------------------------------------------------------------------------
def _by_method(records: list[dict]) -> dict:
    keys = list(methods(1000, records[0]["settings"]))
    out = {}
    for k in keys:
        mine = sorted((r for r in records if r["key"] == k), key=lambda r: r["seed"])
        if mine:
            out[k] = mine
    return out


def _mb(x: float) -> str:
    return f"{x / 1e6:.3g}"


def _reach(runs: list[dict], target: float) -> str:
    """Mean MB sent per worker when the validation loss first reaches ``target`` (or ``-``)."""
    sent = []
    for r in runs:
        hit = next((h["bytes_sent_per_worker"] for h in r["history"] if h["test_loss"] <= target), None)
        if hit is None:
            return "not reached"
        sent.append(hit)
    return _mb(statistics.mean(sent))


def _curve(runs: list[dict]) -> list[tuple[int, float]]:
    """(step, validation loss averaged over the seeds) at every evaluation."""
    return [(h["step"], statistics.mean(r["history"][i]["test_loss"] for r in runs))
            for i, h in enumerate(runs[0]["history"])]


def _step_at(curve: list[tuple[int, float]], loss: float) -> str:
    """The step at which ``curve`` (AdamW's) first reaches ``loss``, interpolated linearly
    between its evaluations (``> last step`` when it never does)."""
    prev = (0, math.inf)
    for step, value in curve:
        if value <= loss:
            if not math.isfinite(prev[1]):
                return f"≤ {step}"
            return f"{prev[0] + (step - prev[0]) * (prev[1] - loss) / (prev[1] - value):.0f}"
        prev = (step, value)
    return f"> {curve[-1][0]}"


def tables(records: list[dict]) -> str:
    """The section's text: settings, the main table, loss against steps, bytes and projections."""
    s = records[0]["settings"]
    by = _by_method(records)
    base = by.get("adamw")
    base_loss = statistics.mean(r["summary"]["final_test_loss"] for r in base) if base else None
    base_bytes = statistics.mean(r["summary"]["bytes_sent_per_worker"] for r in base) if base else None
    base_proj = ([statistics.mean(r["projection"][i]["iteration_s"] for r in base) for i in range(len(BANDWIDTHS))]
                 if base else None)
    first = records[0]["summary"]
    info = first["dataset_info"]
    seeds = sorted({r["seed"] for r in records})
    lines = [
        "Commands (each ran the runs that were not done yet): "
        + ", ".join(f"`{c}`" for c in dict.fromkeys(r["command"] for r in records)) + f". {s['model']} ({first['parameters']:,} parameters) on {s['dataset']} (the embedded "
        f"corpus: {info['files']} files of the Python {info.get('python', '?')} standard library, "
        f"{info['bytes'] / 1e6:.2f} MB, sha256 {info['sha256'][:12]}…; 5% of the sequences held out), "
        f"{s['workers']} workers on threads, batch {s['batch_size']} sequences per worker, {s['epochs']} "
        f"epoch{'s' if s['epochs'] > 1 else ''} = {first['steps']} steps; AdamW lr {s['lr']} (inner lr of DiLoCo and "
        f"SparseLoCo too; 1-bit LAMB {s['lamb_lr']}), {_schedule_text(s)}, default betas, no weight decay; warm-ups (T_w, 0/1 Adam's T_v) "
        f"{s['freeze_fraction']:.0%} of the steps, with bias correction and the momentum bound; seeds "
        f"{', '.join(map(str, seeds))}. Validation loss of the workers' average model every {s['eval_every']} steps "
        f"and at the end; MB = bytes one worker put on the wire.",
        "",
        "| method | final val. loss (mean; seeds) | bits/byte | vs AdamW | AdamW's step at this loss | MB sent / "
        "worker | AdamW's bytes / method's | MB to reach AdamW's loss +2% | proj. ms/step 1 / 10 / 100 Gbit/s "
        "(× AdamW's) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k, runs in by.items():
        losses = [r["summary"]["final_test_loss"] for r in runs]
        loss = statistics.mean(losses)
        sent = statistics.mean(r["summary"]["bytes_sent_per_worker"] for r in runs)
        proj = [statistics.mean(r["projection"][i]["iteration_s"] for r in runs) for i in range(len(BANDWIDTHS))]
        diverged = any(r["summary"]["diverged"] or not math.isfinite(r["summary"]["final_test_loss"]) for r in runs)
        rel = f"{(loss / base_loss - 1) * 100:+.1f}%" if base_loss else "-"
        ratio = f"{base_bytes / sent:.0f}×" if base_bytes and sent else "-"
        reach = _reach(runs, base_loss * 1.02) if base_loss else "-"
        at = _step_at(_curve(base), loss) if base else "-"
        cells = " / ".join(f"{p * 1e3:.1f}" + (f" ({p / b:.2f}×)" if base_proj else "")
                           for p, b in zip(proj, base_proj or proj))
        lines.append(f"| {runs[0]['label']} | {loss:.4f}{' (diverged)' if diverged else ''}; "
                     f"{' '.join(f'{x:.4f}' for x in losses)} | {loss / math.log(2):.3f} | {rel} | {at} | {_mb(sent)} | "
                     f"{ratio} | {reach} | {cells} |")
    steps = [h["step"] for h in next(iter(by.values()))[0]["history"]]
    lines += ["", "Validation loss against steps (mean over seeds; MB sent per worker at the last point):", "",
              "| method | " + " | ".join(str(t) for t in steps) + " | MB |",
              "|---|" + "---|" * (len(steps) + 1)]
    for k, runs in by.items():
        points = [statistics.mean(r["history"][i]["test_loss"] for r in runs) for i in range(len(steps))]
        lines.append(f"| {runs[0]['label']} | " + " | ".join(f"{p:.3f}" for p in points)
                     + f" | {_mb(statistics.mean(r['summary']['bytes_sent_per_worker'] for r in runs))} |")
    if base:
        lines += ["", _flattened(_curve(base))]
    lines += ["", f"![validation loss against steps and against MB sent](../{plot_of(s).name})", ""]
    return "\n".join(lines)


def _schedule_text(s: dict) -> str:
    """The rate schedule in words."""
    spec = schedule_of(s)
    if spec == "constant":
        return "a constant rate (no warm-up, no decay)"
    return (f"`--lr-schedule {spec}` (linear warm-up, then cosine decay to the final factor at the last step, "
            "on every method's rate; DiLoCo's and SparseLoCo's inner rate, their outer rate constant)")


def _flattened(curve: list[tuple[int, float]]) -> str:
    """AdamW's last evaluations and how much its loss still fell over the run's last quarter."""
    step, value = next((t, v) for t, v in curve if t >= 0.75 * curve[-1][0])
    return ("AdamW's validation loss at its last evaluations (mean over seeds): "
            + ", ".join(f"{v:.4f} at step {t}" for t, v in curve[-4:])
            + f"; over the run's last quarter (from step {step}) it fell {(1 - curve[-1][1] / value) * 100:.2f}%.")


def plot(records: list[dict]) -> None:
    """Validation loss against steps and against MB sent per worker, one line per method (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, runs in enumerate(_by_method(records).values()):
        style = {"marker": "o", "ms": 3, "label": runs[0]["label"], "ls": "-" if i < 10 else "--"}  # 10 colours
        steps = [h["step"] for h in runs[0]["history"]]
        loss = [statistics.mean(r["history"][j]["test_loss"] for r in runs) for j in range(len(steps))]
        sent = [max(statistics.mean(r["history"][j]["bytes_sent_per_worker"] for r in runs), 1) / 1e6
                for j in range(len(steps))]
        by_step.plot(steps, loss, **style)
        by_bytes.plot(sent, loss, **style)
    by_step.set(xlabel="step", ylabel="validation loss (nats/byte)", title="validation loss per step")
    by_bytes.set(xlabel="MB sent per worker (log)", ylabel="validation loss (nats/byte)", xscale="log",
                 title="validation loss per byte sent")
    for ax in (by_step, by_bytes):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=7)
    s = records[0]["settings"]
    fig.suptitle(f"{s['model']} on {s['dataset']}, {s['workers']} workers, {s['epochs']} epoch(s), "
                 f"lr schedule {schedule_of(s)}")
    fig.tight_layout()
    fig.savefig(plot_of(s), dpi=100)
    plt.close(fig)


def write(records: list[dict]) -> None:
    """The section of these runs' settings (:func:`title_of`), its plot, and the compact
    records: these runs replace those of the same settings; other studies' records stay."""
    s = records[0]["settings"]
    replace_section(title_of(s), tables(records), PAGE)
    plot(records)
    kept = [r for r in json.loads(RECORDS.read_text())["runs"] if r["settings"] != s] if RECORDS.exists() else []
    RECORDS.write_text(json.dumps({"runs": kept + records}, indent=1))
    print(f"wrote {PAGE}, {plot_of(s)}, {RECORDS}")


def studies(records: list[dict]) -> list[list[dict]]:
    """``records`` grouped by their settings, in the order first seen."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(json.dumps(r["settings"], sort_keys=True), []).append(r)
    return list(groups.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="runs/lm", help="directory of the runs' records and checkpoints")
    p.add_argument("--methods", default=None, help=f"comma-separated keys (default: all: {', '.join(methods(1000, SETTINGS))})")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--preset", choices=["long", "one-epoch"], default="long",
                   help="the settings: the longer study with the rate schedule (default), or the first one-epoch one")
    for key, value in SETTINGS.items():
        p.add_argument("--" + key.replace("_", "-"), type=type(value), default=None)
    p.add_argument("--write", action="store_true", help="write docs/benchmarks/lm.md from the finished runs")
    p.add_argument("--from", dest="source", help="a records file (docs/benchmarks/lm-runs.json): write from it, run nothing")
    p.add_argument("--dry-run", action="store_true", help="a tiny configuration into a temporary directory (CI)")
    args = p.parse_args(argv)
    if args.source:
        saved = json.loads(Path(args.source).read_text())
        for records in studies(saved["runs"]):
            print(tables(records))
            if args.write:
                write(records)
        return 0
    s = dict(DRY if args.dry_run else ONE_EPOCH if args.preset == "one-epoch" else SETTINGS)
    s.update({k: getattr(args, k) for k in SETTINGS if getattr(args, k) is not None})
    args.seeds = [int(x) for x in args.seeds.split(",")] if not args.dry_run else [0]
    known = methods(1000, s)
    args.methods = args.methods.split(",") if args.methods else list(known)
    unknown = [m for m in args.methods if m not in known]
    if unknown:
        p.error(f"unknown method(s) {', '.join(unknown)}; valid: {', '.join(known)}")
    command = "python -m benchmarks.lm " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    if args.dry_run:
        with tempfile.TemporaryDirectory() as tmp:
            args.results = tmp
            records = run(args, s, command)
        print(tables(records))
        return 0
    records = run(args, s, command)
    if records:
        print(tables(records))
        if args.write:
            write(records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
