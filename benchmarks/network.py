"""The emulated-network and timeline-model sections of docs/benchmarks/, with their plots.

Takes the flags of ``gradzip bench net`` / ``gradzip bench model`` (it runs the same
library code and prints the same tables), plus

* ``--write``: replace the matching ``## ...`` section: ``net`` in emulated-network.md, ``model``
  in timeline-model.md (``--measured``) and projections.md (projections);
* ``--plots PREFIX`` (model): where the PNGs go (default docs/bench).

Run from the checkout root::

    sudo .venv/bin/python -m benchmarks.network net --workers 2,4 \\
        --bandwidth unshaped,100mbit,1gbit,10gbit --algos ssgd,efsgd@topk:ratio=0.01,bitsgd,cdsgd \\
        --warmup 5 --steps 10 --out runs/bench-net --write
    python -m benchmarks.network model --measured runs/bench-net/results.json --no-projection --write
    python -m benchmarks.network model --compute-ms 100 --local-scale 0 --plots docs/bench_free --write
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402

from benchmarks.docs_section import PAGES, replace_section  # noqa: E402
from gradzip.bench import cli, tables, timeline  # noqa: E402
from gradzip.errors import GradzipError  # noqa: E402

NET_HEADING = "Emulated network: time per iteration"
VALIDATION_HEADING = "Timeline model: predicted vs measured"
PROJECTION_HEADING = "Timeline model: projection to large clusters"
NET_PAGE, VALIDATION_PAGE, PROJECTION_PAGE = (PAGES / name for name in
                                              ("emulated-network.md", "timeline-model.md", "projections.md"))


def _rel(path: str) -> str:
    """A plot's path as the pages under docs/benchmarks/ link it."""
    return os.path.relpath(Path(path).resolve(), PAGES)


def _check_summary(records) -> str:
    checks = [r["check"] for r in records if r.get("check") and r["check"]["predicted_s"] is not None]
    ok = sum(bool(c["ok"]) for c in checks)
    ceilings = [f"{r['workers']} workers: {r['check']['counted_wire_bytes'] * 8 / r['check']['measured_s'] / 1e9:.1f} Gbit/s"
                for r in records if r.get("check") and r["check"]["predicted_s"] is None]
    text = f"**{ok} of {len(checks)} shaped checks within 15%.**"
    if ceilings:
        text += (" The unshaped rows are what this host moves per link at all (gloo over veth, the "
                 "workers and other jobs sharing the CPUs): " + "; ".join(ceilings) + ". A link faster "
                 "than that cannot be filled here, so those rows measure the host, not the link (the "
                 "model below caps the link rate at this ceiling); the slower links' misses come from "
                 "workers descheduled between the ring's steps on an oversubscribed machine.")
    return text


def write_net_section(result: dict[str, Any], command: str) -> None:
    """The 'Emulated network' section from a ``bench net`` result."""
    s = result["settings"]
    body = f"""Real gloo worker processes, each in a network namespace of its own, linked by a veth
pair to a bridge in a "switch" namespace; every link is shaped with `tc tbf` in both
directions, so each worker has its own link of the given rate (`gradzip.bench.netns`).
Workload: `{s['model']}` on synthetic {s['shape']} data, batch {s['batch_size']} per worker,
{s['threads']} torch thread per worker, {s['warmup']} warm-up steps then {s['steps']} measured
steps per method; the phases come from each worker's trace (`gradzip.bench.emulated.step_breakdown`).
Produced by:

```
{command}
```

First the shaping check: an fp32 allreduce of the given size (slowest worker, median of
{s['check_repeats']} after one warm-up; the verdict is on the median, the last column shows
the fastest repeat, since other jobs can only add time) against the ring's bytes over one
link at the link rate. "interface MB" is the worker's `tx_bytes` counter during the allreduce: the counted
bytes plus what gloo, TCP and IP add (veth segments up to 64 KB, so few headers).

{tables.check_table(result['records'])}

{_check_summary(result['records'])}

Time per iteration: the median over the measured steps of each phase (mean over the
workers). *compute* = forward + backward; *compress* = codec work and packing (compress,
residual, decode); *communicate* = time the step blocked on the network; *update + loop* =
the rest of `optimizer.step()` and of the training loop; *hidden* = exchange work that ran
on a background thread (methods that overlap). MB sent / step is the counted ring bytes of
one worker.

{tables.time_table(result['records'])}

Noise: {tables.noise_line(result)} Every worker has one intra-op thread, but 4 workers share
2 cores here, with other jobs, so compute times at 4 workers are inflated and vary; the
timeline model (timeline-model.md) is fed the compute times measured in these same runs. The kernel here has no
`sch_netem` (`CONFIG_NET_SCH_NETEM` unset), so these runs have no added latency;
`--latency-ms` works where netem exists and otherwise stops with that message.
"""
    replace_section(NET_HEADING, body, NET_PAGE)
    print(f"updated section '{NET_HEADING}' of {NET_PAGE}")


def write_model_sections(result: dict[str, Any]) -> None:
    """The timeline model's sections (validation, projection) from a ``bench model`` result
    with its plots' paths added."""
    command = result["command"]
    if "validation" in result:
        rows = result["validation"]
        within = sum(abs(r["error"]) <= timeline.TOLERANCE for r in rows)
        worst = max((abs(r["error"]) for r in rows), default=0.0)
        body = f"""The timeline model (`gradzip.bench.timeline`) beside the emulated runs of
[emulated-network.md](emulated-network.md). The model takes the local work of each step from the run itself (the slowest
worker's compute + codec + update, mean over steps) and adds the alpha-beta network time
of the collectives the method issues (ring allreduce `2(n-1)α + 2(n-1)/n·S/B`, ring
allgather `(n-1)α + (n-1)·S/B`, α = {result['validation_alpha_s'] * 1e6:g} µs per message step, B = the link
rate, capped at the host ceiling that the unshaped run of as many workers measured).
For a method that overlaps its exchange (`cdsgd`) the prediction is
`max(local work, background codec + update + network)`, per step, then averaged (CD-SGD's
full-precision step every k); for one whose exchange starts during backward (`ssgd`,
`efsgd`, `bitsgd`, ...) the buckets' collectives run behind the rest of backward
(`timeline.backward_timeline`: backward = 2/3 of compute, split over the buckets by elements).
Which collectives, and how many bytes, comes from running the method's own `step()` on a
recording group; the last column checks those bytes against the bytes the run counted.
Produced by:

```
{command}
```

**{within} of {len(rows)} predictions within {timeline.TOLERANCE:.0%}** of the measured iteration time
(largest error {worst:.1%}).

{tables.validation_table(rows)}

![predicted vs measured]({_rel(result['validation_plot'])})
"""
        replace_section(VALIDATION_HEADING, body, VALIDATION_PAGE)
        print(f"updated section '{VALIDATION_HEADING}' of {VALIDATION_PAGE}")
    if "projection" in result:
        ps = result["projection_settings"]
        rows = result["projection"]
        plots = "\n\n".join(f"![projection]({_rel(p)})" for p in result["projection_plots"])
        if ps["codec_scale"] == 0:
            local = ("Here codec and update times are set to zero (`--local-scale 0`): compute and the "
                     "network alone, i.e. the most that fewer bytes can buy. Bytes on the wire per step "
                     "and worker:\n\n" + tables.codec_table(rows))
        else:
            local = ("Codec work per step as measured here (CPU, loaded machine: treat as an upper bound "
                     "for an accelerator; `--local-scale` rescales codec and update times):\n\n"
                     + tables.codec_table(rows))
        transports = list(dict.fromkeys(r.get("transport", "recorded") for r in rows))
        shown = "auto" if "auto" in transports else transports[0]
        k = ps.get("workers_per_node", 1)
        hier = (f" Hierarchical (`--workers-per-node {k}`): inside a node a reduce-scatter and an allgather "
                f"of fp32 on {ps['intra_bps'] / 1e9:g} Gbit/s links, across nodes the exchange of a 1/{k} shard "
                f"among the workers of equal local rank, the node's {k} workers sharing one uplink of the "
                "given rate; codec work on the shard (1/k).") if k > 1 else ""
        body = f"""The same model projected to clusters: `{ps['model']}` ({ps['parameters'] / 1e6:.1f}M parameters, its
real tensor shapes), {ps['compute_s'] * 1e3:g} ms of compute per iteration (given, about
ResNet-50 at batch 32 on a V100), α = {ps['alpha_s'] * 1e6:g} µs, codec and update times measured on
this machine ({ps['threads']} CPU thread, × {ps['codec_scale']:g}) by running each method's `step()` on a
recording group of each worker count up to {ps['profile_max_workers']}; above it the collectives are sized by
a dry run at the real count and the decoding time is scaled by the packets decoded (an
allgather decodes n packets, an allreduce one). Methods that overlap
the exchange with the next step's compute (`overlaps_exchange`) cost
`max(compute, compress + communicate) + update`, the others the sum.
Transports (`--transports`, spec "Transports of PSync"; `gradzip.bench.costs`): *recorded* =
the collectives the methods issue today; otherwise every PSync exchange is priced from its
codec and tensor shapes: *exact* = allreduce of summands (2-bit codes as int8 up to 127
workers, int16 up to 32767) or allgather of packets, the fewer bytes; *twophase* = per
bucket an all-to-all of per-slice packets `Σ_(j≠i) |C(v_i[S_j])|` (`(n-1)α` + bytes/B) and a
ring allgather of the recompressed slices `(n-1)·max_j |C(S_j)|` (`(n-1)α` + bytes/B),
codec work: every slice compressed, one packet's worth decoded twice; *auto* = two-phase per
bucket where it costs ≤ 1/2 of the exact transports. Each cell names the transport used;
speedups are over the first method with the same transport; the plots show *{shown}*.{hier}
Produced by:

```
{command}
```

{local}

Predicted iteration time and speedup over the first method:

{tables.projection_table(rows)}

{plots}
"""
        heading = PROJECTION_HEADING if ps["codec_scale"] == 1 else (
            f"{PROJECTION_HEADING}, codec and update free" if ps["codec_scale"] == 0
            else f"{PROJECTION_HEADING}, local work x {ps['codec_scale']:g}")
        heading += f", {k} workers per node" if k > 1 else ""
        replace_section(heading, body, PROJECTION_PAGE)
        print(f"updated section '{heading}' of {PROJECTION_PAGE}")


# ----------------------------------------------------------------------------- plots


def plot_projection(rows: list[dict], path_prefix: str) -> list[Path]:
    """Two PNGs: against worker count (one panel per bandwidth) and against bandwidth
    (one panel per worker count); iteration time on top, speedup over S-SGD below."""
    transports = list(dict.fromkeys(r.get("transport", "recorded") for r in rows))
    shown = "auto" if "auto" in transports else transports[0]   # one transport per plot: auto where projected
    rows = [r for r in rows if r.get("transport", "recorded") == shown]
    algos = list(dict.fromkeys(r["algo"] for r in rows))
    workers = sorted({r["workers"] for r in rows})
    bws = sorted({r["bandwidth_bps"] for r in rows})
    out = []

    def get(a, n, bw, key):
        return next(x[key] for x in rows if x["algo"] == a and x["workers"] == n and x["bandwidth_bps"] == bw)

    for name, panels, xs, xlabel, pick in (
            ("workers", bws, workers, "workers", lambda a, x, panel: (a, x, panel)),
            ("bandwidth", [w for w in workers if w in (8, 32, 128, 256)] or workers, bws, "link bandwidth (Gbit/s)",
             lambda a, x, panel: (a, panel, x))):
        fig, axes = plt.subplots(2, len(panels), figsize=(3.6 * len(panels), 6.4), squeeze=False, sharex=True)
        for j, panel in enumerate(panels):
            for a in algos:
                xv = [x / 1e9 if name == "bandwidth" else x for x in xs]
                axes[0][j].plot(xv, [get(*pick(a, x, panel), "iteration_s") * 1e3 for x in xs], marker="o", label=a)
                axes[1][j].plot(xv, [get(*pick(a, x, panel), "speedup") for x in xs], marker="o", label=a)
            axes[0][j].set_yscale("log")
            title = f"{panel / 1e9:g} Gbit/s" if name == "workers" else f"{panel} workers"
            axes[0][j].set_title(title)
            axes[1][j].set_xlabel(xlabel)
            axes[1][j].axhline(1.0, color="gray", lw=0.8)
            if name == "workers":
                axes[1][j].set_xscale("log", base=2)
            else:
                axes[1][j].set_xscale("log")
        axes[0][0].set_ylabel("iteration time (ms)")
        axes[1][0].set_ylabel("speedup over S-SGD")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        path = Path(f"{path_prefix}_{name}.png")
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out


def plot_validation(rows: list[dict], path: str) -> Path:
    """Predicted against measured iteration time, log-log, with the tolerance band."""
    fig, ax = plt.subplots(figsize=(4.8, 4.4))
    for algo in dict.fromkeys(r["algo"] for r in rows):
        sel = [r for r in rows if r["algo"] == algo]
        ax.scatter([r["measured_s"] * 1e3 for r in sel], [r["predicted_s"] * 1e3 for r in sel], label=algo, s=18)
    top = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.3
    low = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 / 1.3
    ax.plot([low, top], [low, top], color="gray", lw=0.8)
    ax.fill_between([low, top], [low * (1 - timeline.TOLERANCE), top * (1 - timeline.TOLERANCE)], [low * (1 + timeline.TOLERANCE), top * (1 + timeline.TOLERANCE)], color="gray", alpha=0.15,
                    label=f"±{timeline.TOLERANCE:.0%}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("measured iteration (ms, emulated network)")
    ax.set_ylabel("predicted iteration (ms, model)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)

# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.network", description=__doc__.split("\n\n")[0])
    kinds = parser.add_subparsers(dest="bench", required=True)
    net = kinds.add_parser("net", description=cli.NET_HELP)
    cli.add_net_arguments(net)
    model = kinds.add_parser("model", description=cli.MODEL_HELP)
    cli.add_model_arguments(model)
    model.add_argument("--plots", default="docs/bench", help="PNG path prefix (default: %(default)s)")
    for p in (net, model):
        p.add_argument("--write", action="store_true", help="update the matching sections of docs/benchmarks/")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.network " + " ".join(argv)
    try:
        if args.bench == "net":
            result = cli.run_net(args, command)
            if args.write:
                write_net_section(result, result.get("command") or command)
            return 0
        result = cli.run_model(args, command)
        if result.get("validation"):
            result["validation_plot"] = str(plot_validation(result["validation"],
                                                            f"{args.plots}_model_validation.png"))
        if "projection" in result:
            result["projection_plots"] = [str(p) for p in plot_projection(result["projection"],
                                                                          f"{args.plots}_projection")]
        Path(args.out).write_text(json.dumps(result, indent=1))  # with the plots' paths
        plots = ([result["validation_plot"]] if "validation_plot" in result else []) + result.get("projection_plots", [])
        print("wrote " + ", ".join(plots or ["no plots"]))
        if args.write:
            write_model_sections(result)
        return 0
    except GradzipError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
