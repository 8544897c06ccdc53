"""auto:<codec> against the fixed choices and PyTorch DDP, side by side in one run (issue 33).

For every (model, worker count, network) the step-time harness of benchmarks/step_vs_ddp.py
(:func:`benchmarks.step_vs_ddp.measure`: real gloo processes, every variant built once, warmed
up, then timed in interleaved rounds; the slowest worker's median step per round, the median
over rounds) runs the variants

* ``ddp``: DistributedDataParallel + ``torch.optim.SGD``, the uncompressed choice ("nothing");
* on loopback also ``ddp-allreduce-hook`` (PyTorch's own uncompressed hook) and ``ssgd``
  (gradzip's S-SGD): the floors of the two paths below where auto compresses nothing;

and, per path P (``ddp``: DDP + SGD with gradzip's codec hook, ``gradzip.ddp.hook``;
``efsgd``: gradzip's EF-SGD optimizer) and codec C in ``1bit`` and ``topk:ratio=0.01``:

* ``P@C``: C on every bucket ("the codec everywhere");
* ``P@auto:C``: ``auto:C`` (docs/algorithms.md §Auto codec choice): per bucket C or
  uncompressed, decided in the warm-up from costs measured there (codec probe and link
  probe, no ``link=`` given: the rule, then its trial against nothing compressed in real
  steps), executed from then on.
 Models: ``mlp10m`` (10M parameters, 3x32x32),
``resnet18`` (ResNet-18's 11.2M parameters in its 62 tensors; 3x8x8 inputs keep its compute
small on a 2-core host) and ``mixed`` (``mlp:hidden=2048x2048x16x…``: two large layers and 200
layers of 16: a model whose buckets disagree). Networks: ``loopback`` (127.0.0.1) and link
rates (each worker in a network namespace of its own behind a ``tc``-shaped link, as
``gradzip bench net``; needs root).

The targets the table is read against (issue 33): on loopback ``auto:C`` ≤ 1.05× DDP; on
shaped links within 10% of the best fixed choice of the same run (``min(ddp, efsgd@C)``),
and below both on the mixed model. ``--accuracy`` adds the digits accuracy of ``auto:C``
against ``C`` (``gradzip compare``, 4 workers, ``--link`` declared so that the decisions are
those of a slow network). ``--write`` replaces the sections of docs/benchmarks/auto.md::

    sudo .venv/bin/python -m benchmarks.auto_codec --models mlp10m,resnet18,mixed --workers 2,4 \\
        --network loopback,1gbit,100mbit --rounds 3 --steps 4 --accuracy --write
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import step_vs_ddp
from benchmarks.docs_section import PAGES, ROOT, replace_section
from gradzip.bench import emulated
from gradzip.bench.units import format_rate
from gradzip.errors import GradzipError
from gradzip.comm.launch import WorkerError, run_processes

PAGE = PAGES / "auto.md"
STEP_HEADING = "auto:<codec>: step time against DDP and the fixed codecs"
ACCURACY_HEADING = "auto:<codec>: accuracy on digits"
CODECS = ("1bit", "topk:ratio=0.01")
PATHS = ("ddp", "efsgd")
#: model -> (registry spec, input shape)
MODELS = {"mlp10m": ("mlp10m", (3, 32, 32)), "resnet18": ("resnet18", (3, 8, 8)),
          "mixed": ("mlp:hidden=" + "x".join(["2048", "2048"] + ["16"] * 200), (3, 32, 32))}
LOOPBACK_TARGET, SHAPED_TARGET = 1.05, 1.10
#: the link rates the accuracy run's ``gradzip compare`` projects to
PROJECTED = "100mbit,10gbit"


def variants(bandwidth: float | None = None) -> list[str]:
    """Every variant of one run; on loopback also PyTorch's own ``allreduce_hook``, what any
    communication hook costs against DDP's built-in allreduce (the floor of the ``ddp@``
    path), and gradzip's S-SGD, gradzip's own uncompressed step (the floor of the ``efsgd@``
    path where auto compresses nothing: EF-SGD then sends the gradient as S-SGD does)."""
    hook = ["ddp-allreduce-hook", "ssgd"] if bandwidth is None else []
    return ["ddp", *hook] + [v for path in PATHS for c in CODECS for v in (f"{path}@{c}", f"{path}@auto:{c}")]


def run_setting(model: str, n: int, bandwidth: float | None, args) -> dict[str, Any]:
    spec_model, shape = MODELS[model]
    spec = {"model": spec_model, "shape": list(shape), "batch": args.batch, "threads": 1, "warmup": args.warmup,
            "rounds": args.rounds, "steps": args.steps, "variants": variants(bandwidth), "timeout_s": args.timeout}
    if bandwidth is None:
        ranks = run_processes(n, step_vs_ddp.measure, spec, timeout_s=args.timeout)
    else:
        ranks = step_vs_ddp.run_shaped(n, bandwidth, spec)
    result = step_vs_ddp.summarize(ranks, n, bandwidth)
    result["model"] = model
    return result


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per path and codec: the three times, auto's ratios to DDP and to the best fixed choice,
    what it chose."""
    rows = {r["variant"]: r for r in result["rows"]}
    out = []
    for path in PATHS:
        for c in CODECS:
            out.append(_verdict(path, c, rows["ddp"], rows[f"{path}@{c}"], rows[f"{path}@auto:{c}"],
                                rows.get("ddp-allreduce-hook"), rows.get("ssgd")))
    return out


def trial_text(decisions: dict[str, str] | None) -> str:
    """What auto's trials said (docs/algorithms.md §Auto codec choice, "Trial"): per decision
    ``kept`` or ``none``, with the two step times, or ``-`` where none ran."""
    out = []
    for line in (decisions or {}).values():
        found = re.search(r"against none: ([\d.]+) ms against ([\d.]+) ms a period"
                          r"( \(best of \d+ each[^)]*\))?, (kept|none taken)", line)
        if found:
            retried = ", retried" if found[3] else ""
            out.append(f"{'kept' if found[4] == 'kept' else 'none'} ({found[1]} vs {found[2]} ms{retried})")
    return ", ".join(dict.fromkeys(out)) or "-"


def _verdict(path: str, c: str, ddp: dict, fixed: dict, auto: dict, hook: dict | None = None,
             ssgd: dict | None = None) -> dict[str, Any]:
    best = min(ddp["median_s"], fixed["median_s"])
    chosen = auto.get("auto") or []
    by_round = [a / d for a, d in zip(auto["rounds_s"], ddp["rounds_s"])]

    def over_ddp(row: dict | None) -> float | None:
        return None if row is None else row["median_s"] / ddp["median_s"]

    return {"trial": trial_text(auto.get("auto_decisions")), "path": path, "codec": c, "ddp_s": ddp["median_s"], "fixed_s": fixed["median_s"], "auto_s": auto["median_s"],
            "auto_over_ddp": over_ddp(auto), "auto_over_best": auto["median_s"] / best,
            "by_round": (min(by_round), max(by_round)),
            "hook_over_ddp": over_ddp(hook), "ssgd_over_ddp": over_ddp(ssgd),
            "compressed": sum(x != "none" for x in chosen), "units": len(chosen),
            "below_both": auto["median_s"] < min(ddp["median_s"], fixed["median_s"])}


def target_text(result: dict[str, Any], v: dict[str, Any]) -> str:
    if result["bandwidth_bps"] is None:
        return "met" if v["auto_over_ddp"] <= LOOPBACK_TARGET else "**missed**"
    ok = v["auto_over_best"] <= SHAPED_TARGET
    text = "met" if ok else "**missed**"
    if result["model"] == "mixed":
        text += ", below both" if v["below_both"] else ", **not below both**"
    return text


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| model | workers | network | path P | codec C | ddp ms | P@C ms | P@auto:C ms | auto / ddp | "
             "auto / ddp by round | PyTorch's hook / ddp | gradzip S-SGD / ddp | auto / best fixed | "
             "units auto compresses | trial: rule vs none | target |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in results:
        for v in verdicts(r):
            lines.append(f"| {r['model']} | {r['workers']} | {r['network']} | {v['path']} | {v['codec']} | "
                         f"{v['ddp_s'] * 1e3:.1f} | "
                         f"{v['fixed_s'] * 1e3:.1f} | {v['auto_s'] * 1e3:.1f} | **{v['auto_over_ddp']:.2f}** | "
                         f"{v['by_round'][0]:.2f}–{v['by_round'][1]:.2f} | "
                         f"{_ratio(v.get('hook_over_ddp'))} | {_ratio(v.get('ssgd_over_ddp'))} | "
                         f"**{v['auto_over_best']:.2f}** | {v['compressed']}/{v['units']} | {v.get('trial', '-')} | "
                         f"{target_text(r, v)} |")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def accuracy(args) -> str:
    """digits: auto:C against C (EF-SGD, 4 gloo workers, ``--link`` declared), ``gradzip compare``."""
    algos = ",".join(f"efsgd@{v}" for c in CODECS for v in (c, f"auto:{c}"))
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "gradzip.cli", "compare", "--algos", algos, "--workers", "4",
               "--epochs", str(args.epochs), "--link", args.accuracy_link, "--bandwidth", PROJECTED, "--quiet",
               "--no-plot", "--out", out]
        shown_table = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout.strip()
        summaries = json.loads((Path(out) / "summary.json").read_text())
    by = {s["algo"]: s for s in summaries}
    lines = ["| codec C | efsgd@C test acc | efsgd@auto:C test acc | difference (points) | auto's decision |",
             "|---|---:|---:|---:|---|"]
    for c in CODECS:
        fixed, auto = by[f"efsgd@{c}"], by[f"efsgd@auto:{c}"]
        diff = 100 * (auto["final_test_accuracy"] - fixed["final_test_accuracy"])
        decided = next(iter(auto.get("auto", {}).values()), "-").split("; link")[0]
        lines.append(f"| {c} | {fixed['final_test_accuracy']:.4f} | {auto['final_test_accuracy']:.4f} | "
                     f"{diff:+.2f} | {decided} |")
    shown = ("gradzip compare --algos " + algos + f" --workers 4 --epochs {args.epochs} --link {args.accuracy_link} "
             f"--bandwidth {PROJECTED}")
    return (f"EF-SGD on digits (mlp), 4 gloo workers, {args.epochs} epochs; `--link {args.accuracy_link}` is "
            "declared so that every worker's auto decides as on that network, whatever this host's loopback "
            "measures. Target: within 1 point of the codec's own run. Produced by:\n\n"
            f"```\n{shown}\n```\n\n" + "\n".join(lines) + "\n\nThe table `gradzip compare` printed (its "
            "projected columns re-decide auto at each rate: `auto k/m`, the units it compresses there):\n\n"
            f"```\n{shown_table}\n```\n")


def step_text(args, command: str, host: dict[str, Any], results: list[dict[str, Any]]) -> str:
    """The step-time section: how the numbers were taken, the command, the table."""
    return (f"Step time per variant, side by side in one run per (model, workers, network) "
            f"(benchmarks/step_vs_ddp.py's harness: batch {args.batch} per worker, 1 torch thread per worker, "
            f"{args.warmup} warm-up steps, then interleaved rounds of steps, as many as each command below says "
            "(`--rounds`, `--steps`); the slowest "
            "worker's median step of a round, median over rounds). auto decides in the warm-up from what it "
            "measured there (no `link=`): the rule from the probes at its first step (under DDP for its initial "
            "buckets; the buckets DDP rebuilds after that step execute those decisions per parameter), then, "
            "where the rule compresses a unit, the trial of its "
            "choices against nothing compressed in blocks of 3 steps (each block's first untimed; 2 more blocks where the "
            "first two did not decide, none not 25% faster and the rule not twice as fast: *retried*; the rule kept "
            "only on a win of 10%; column *trial*: which it kept, and the two step times it compared). *auto / ddp by round*: the ratio of "
            "the two in each round, lowest–highest (how far one round's pairing moves on this host). *gradzip S-SGD*: gradzip's own uncompressed step (loopback "
            "only; what EF-SGD's step is where auto compresses nothing: it then sends the gradient as S-SGD "
            "does). *PyTorch's hook*: DDP with PyTorch's own `allreduce_hook` (loopback "
            "only), what any communication hook pays against DDP's built-in allreduce, in the same run. "
            "Best fixed: the faster of `ddp` (nothing compressed) and "
            "`P@C` (C on every bucket). Targets: loopback auto / ddp ≤ 1.05; shaped links auto / best fixed "
            "≤ 1.10, and on `mixed` below both. Host: "
            f"{host['cpus']} CPUs, load average {', '.join(f'{x:.1f}' for x in host['loadavg'])} at the end. "
            f"Produced by:\n\n```\n{command}\n```\n\n" + table(results) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.auto_codec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp10m,resnet18,mixed", help=f"of {', '.join(MODELS)}")
    parser.add_argument("--workers", default="2,4", help="comma-separated worker counts (default: %(default)s)")
    parser.add_argument("--network", default="loopback,1gbit,100mbit",
                        help="comma-separated: loopback or link rates (namespaces, root) (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=32, help="batch per worker (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=15,
                        help="warm-up steps per variant: auto's decision (step 1) and its trial (6 exchanges, 12 "
                             "where retried, and the verdict's) fall in them (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant and round (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--accuracy", action="store_true", help="also the digits accuracy of auto:C against C")
    parser.add_argument("--accuracy-link", default="100mbit", help="--link of the accuracy runs (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=10, help="epochs of the accuracy runs (default: %(default)s)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--from", dest="source",
                        help="tabulate earlier --json files (comma-separated, their rows in that order), run nothing")
    parser.add_argument("--write", action="store_true", help=f"replace the sections of {PAGE.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.auto_codec " + " ".join(argv)
    try:
        models = [] if args.source else [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = [m for m in models if m not in MODELS]
        if unknown or not (models or args.accuracy or args.source):
            raise GradzipError(f"unknown model(s) {', '.join(unknown) or '(none)'}; valid: {', '.join(MODELS)}")
        workers = [int(w) for w in args.workers.split(",") if w.strip()]
        networks = [step_vs_ddp.parse_network(s) for s in args.network.split(",") if s.strip()]
        results = []
        for model in models:
            for n in workers:
                for bandwidth in networks:
                    print(f"[auto_codec] {model}, {n} workers, {format_rate(bandwidth) if bandwidth else 'loopback'}",
                          file=sys.stderr, flush=True)
                    results.append(run_setting(model, n, bandwidth, args))
                    print(table(results[-1:]), file=sys.stderr, flush=True)
        accuracy_text = accuracy(args) if args.accuracy else None
    except (GradzipError, WorkerError, subprocess.CalledProcessError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    host = emulated.host_info()
    taken = args   # the settings the results were taken with
    if args.source:   # earlier runs' results (one file or several, comma-separated), tabulated again
        runs = [json.loads(Path(f).read_text()) for f in args.source.split(",") if f.strip()]
        command = "\n".join(data["command"] for data in runs)
        host, results = runs[-1]["host"], [r for data in runs for r in data["results"]]
        taken = parser.parse_args(runs[0]["command"].split()[3:])
    text = step_text(taken, command, host, results)
    if results:
        print(text)
    if accuracy_text:
        print(accuracy_text)
    if args.write and results:
        replace_section(STEP_HEADING, text, PAGE)
    if args.write and accuracy_text:
        replace_section(ACCURACY_HEADING, accuracy_text, PAGE)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "host": host, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
