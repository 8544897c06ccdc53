"""CD-SGD's speed on the emulated network: time per iteration of S-SGD, BIT-SGD, OD-SGD
and CD-SGD (k = 5) over a bandwidth sweep, with the overlap ratio
measured iteration time / max(compute, compress + communicate), of the means over steps,
and per step (``overlap_bound_s`` of ``gradzip bench net``: the mean over steps of
max(compute, the exchange beside it)). The two differ for a periodic method: CD-SGD's
full-precision step every k sends ~16x the bytes of a 2-bit one, and where that exchange
outlasts one step's compute, the step waits for it however well the rest overlaps, which
the max of the means does not see.

Runs ``gradzip bench net`` (real gloo processes in network namespaces, every link shaped
with tc) into its own output directory, then tabulates its results.json:

    python -m benchmarks.cdsgd_speed --write
    python -m benchmarks.cdsgd_speed --from runs/cdsgd-net/results.json --write   # tables only
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.docs_section import PAGES, replace_section

LABELS = {"ssgd": "S-SGD", "bitsgd": "BIT-SGD", "odsgd": "OD-SGD", "cdsgd": "CD-SGD k=5"}


def rate(bps) -> str:
    if bps is None:
        return "unshaped"
    return f"{bps / 1e9:g} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:g} Mbit/s"


def tables(results: dict) -> str:
    lines = ["| workers | link | method | ms/iter | compute | compress | communicate | blocked on net | "
             "overlap ratio | per step | vs S-SGD | vs BIT-SGD |", "|" + "---|" * 12]
    for rec in results["records"]:
        runs = {r["method"]: r for r in rec["runs"]}
        for method in ("ssgd", "bitsgd", "odsgd", "cdsgd"):
            r = runs.get(method)
            if r is None:
                continue
            it = r["iteration_s"]
            # exchange work wherever it ran: on the training thread (compress_s, communicate_s
            # = blocked) or on the communication thread (hidden_*: overlapped methods)
            compress = r["compress_s"] + r.get("hidden_compress_s", 0.0)
            network = r.get("hidden_communicate_s", 0.0) or r["communicate_s"]
            blocked = r["communicate_s"]
            bound = max(r["compute_s"], compress + network)
            per_step = f"{it / r['overlap_bound_s']:.2f}" if r.get("overlap_bound_s") else "-"
            vs = lambda other: f"{it / runs[other]['iteration_s']:.2f}" if other in runs else "-"
            lines.append(f"| {rec['workers']} | {rate(rec['bandwidth_bps'])} | {LABELS[method]} | {1e3 * it:.0f} | "
                         f"{1e3 * r['compute_s']:.0f} | {1e3 * compress:.0f} | {1e3 * network:.0f} | "
                         f"{1e3 * blocked:.0f} | {it / bound:.2f} | {per_step} | {vs('ssgd')} | {vs('bitsgd')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="source", help="tabulate an earlier results.json, run nothing")
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--bandwidth", default="100mbit,300mbit,1gbit")
    ap.add_argument("--model", default="resnet18:width=32")
    ap.add_argument("--steps", default="10", help="a multiple of k = 5: whole periods")
    ap.add_argument("--threads", default="1", help="torch intra-op threads per worker (the exchange thread "
                    "and the training thread share the cores: see docs/benchmarks/cdsgd.md)")
    ap.add_argument("--out", default="runs/cdsgd-net")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    source = Path(args.source or Path(args.out) / "results.json")
    command = f"python -m benchmarks.cdsgd_speed {' '.join(sys.argv[1:])}"
    if not args.source:
        subprocess.run([sys.executable, "-m", "gradzip.cli", "bench", "net", "--workers", args.workers,
                        "--bandwidth", args.bandwidth, "--algos", "ssgd,bitsgd,odsgd,cdsgd", "--model", args.model,
                        "--steps", args.steps, "--threads", args.threads, "--out", args.out], check=True)
    results = json.loads(source.read_text())
    s = results["settings"]
    text = (f"Command: `{command}` (runs `{results['command']}`): model {s['model']}, batch {s['batch_size']} per "
            f"worker, {s['threads']} intra-op thread per worker, {s['steps']} measured steps after {s['warmup']}, "
            f"host: {results.get('host', {})}. Times are per iteration, mean over measured steps, slowest "
            "worker; 'compress' and 'communicate' count the exchange's work wherever it ran (training thread or communication thread); 'blocked on net' = the time the training thread waited for it; overlap "
            "ratio = iteration / max(compute, compress + communicate) of the means; 'per step' = iteration / the mean over steps of max(compute, the exchange beside it), which counts the k-th step's full-precision exchange where it outlasts that step's compute; 'vs' columns are ratios of ms/iter "
            "within the same run.\n\n" + tables(results) + "\n")
    print(text)
    if args.write:
        replace_section("CD-SGD speed on the emulated network", text, PAGES / "cdsgd.md")


if __name__ == "__main__":
    main()
