"""The timeline model against emulated runs of 2, 4 and 8 workers (issue 15): one grid,
one table, the largest error.

Three ``gradzip bench net`` grids on a small model (an MLP of 1.6M parameters, batch 2,
so that the network, not 8 processes' compute on a few cores, sets the pace), each
validated by :func:`gradzip.bench.timeline.validate`:

* ``flat``: 2, 4, 8 workers at each ``--bandwidth``; S-SGD, EF-SGD top-k, BIT-SGD, CD-SGD
  (``transport=auto``);
* ``transports``: BIT-SGD with ``transport=allgather`` and ``transport=twophase``, 4 and 8
  workers, the same links: the two-phase speedup measured side by side in one run;
* ``hierarchical``: 4 and 8 workers, 2 per node behind one shaped uplink, S-SGD and
  BIT-SGD (auto, two-phase).

It prints per row the measured and predicted iteration time, ``|predicted - measured| /
measured`` and the largest of them, and the measured and predicted ratio
``bitsgd[allgather] / bitsgd[twophase]`` per worker count and link. Needs root (network
namespaces, tc). From the checkout root::

    sudo .venv/bin/python -m benchmarks.model_validation --out runs/model-validation

(about 30 minutes on 2 shared cores, most of it starting 8 processes per topology);
``--from DIR`` re-validates the grids already in DIR without running anything.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gradzip.bench import cli, tables, timeline
from gradzip.bench.units import format_rate

MODEL = ["--model", "mlp:hidden=1024x512", "--shape", "1x32x32", "--batch-size", "2", "--steps", "5"]
# CD-SGD's grid warms up one whole period (k = 5): its first exchanges (codec kernels loaded
# by 8 processes on the background thread) end inside the next step, and 5 measured steps
# then hold exactly one full-precision exchange.
GRIDS = {
    "flat": ["--workers", "2,4,8", "--algos", "ssgd,efsgd@topk:ratio=0.01,bitsgd,cdsgd", "--warmup", "5"],
    "transports": ["--workers", "4,8", "--algos", "bitsgd", "--transports", "allgather,twophase", "--warmup", "2"],
    "hierarchical": ["--workers", "4,8", "--workers-per-node", "2", "--algos", "ssgd,bitsgd",
                     "--transports", "auto,twophase", "--warmup", "2"],
}


def run_grid(name: str, out: Path, bandwidth: str, round_bytes: int | None = None) -> dict:
    """One ``gradzip bench net`` grid into ``out/name``; its results."""
    flags = [*GRIDS[name], *MODEL, "--bandwidth", bandwidth, "--out", str(out / name),
             *(["--round-bytes", str(round_bytes)] if round_bytes is not None else [])]
    args = cli.add_parser(argparse.ArgumentParser().add_subparsers()).parse_args(["net", *flags])
    return cli.run_net(args, "gradzip bench net " + " ".join(flags))


def speedups(rows: list[dict]) -> list[str]:
    """Measured and predicted ``bitsgd[allgather] / bitsgd[twophase]`` per topology."""
    out = []
    for r in rows:
        if r["algo"] != "bitsgd[twophase]":
            continue
        other = next((x for x in rows if x["algo"] == "bitsgd[allgather]" and x["workers"] == r["workers"]
                      and x["bandwidth_bps"] == r["bandwidth_bps"]
                      and x["workers_per_node"] == r["workers_per_node"]), None)
        if other:
            out.append(f"| {r['workers']} | {format_rate(r['bandwidth_bps'])} | "
                       f"{other['measured_s'] / r['measured_s']:.2f}× | {other['predicted_s'] / r['predicted_s']:.2f}× |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.model_validation",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--bandwidth", default="100mbit,50mbit", help="link rates (default: %(default)s)")
    parser.add_argument("--grids", default=",".join(GRIDS), help="which grids (default: %(default)s)")
    parser.add_argument("--alpha-us", type=float, default=100.0, help="per-message latency (default: %(default)s)")
    parser.add_argument("--round-bytes", type=int, default=None,
                        help="two-phase all-to-alls in rounds of at most this many bytes (bench net --round-bytes)")
    parser.add_argument("--out", default="runs/model-validation", help="results (default: %(default)s)")
    parser.add_argument("--from", dest="from_dir", help="validate the grids in this directory, run nothing")
    args = parser.parse_args(argv)
    out = Path(args.from_dir or args.out)
    rows, loads = [], []
    for name in (g.strip() for g in args.grids.split(",") if g.strip()):
        path = out / name / "results.json"
        if args.from_dir:
            if not path.exists():
                print(f"(no {path}: grid {name} skipped)", file=sys.stderr)
                continue
            result = json.loads(path.read_text())
        else:
            result = run_grid(name, out, args.bandwidth, args.round_bytes)
        host = result["host"]
        loads.append(f"{name}: {host['loadavg'][0]:.1f} on {host.get('cpus', '?')} CPUs")
        rows += timeline.validate(result, args.alpha_us * 1e-6)
    print("### Model vs emulated network (under load)\n")
    print(tables.validation_table(rows) + "\n")
    worst = max(rows, key=lambda r: abs(r["error"]))
    within = sum(abs(r["error"]) <= timeline.TOLERANCE for r in rows)
    print(f"{within} of {len(rows)} within {timeline.TOLERANCE:.0%}; max |predicted - measured| / measured = "
          f"{abs(worst['error']):.1%} ({worst['workers']} workers, {format_rate(worst['bandwidth_bps'])}, "
          f"`{worst['algo']}`)\n")
    lines = speedups(rows)
    if lines:
        print("### Two-phase BIT-SGD against the allgather route, same run\n")
        print("| workers | link | measured allgather / twophase | predicted |\n|---:|---|---:|---:|")
        print("\n".join(lines) + "\n")
    print(f"load average (1 min) at the end of each grid (the host that ran it): {'; '.join(loads)}")
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "validation.json").write_text(json.dumps(rows, indent=1))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
