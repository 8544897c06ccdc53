"""The cross-node phases of the hierarchical exchange on a shared node uplink: whole
messages against the same bytes in rounds (docs/benchmarks/transports-and-nodes.md, "Two-phase
across nodes: whole messages on a shared uplink").

Why it exists: the model validation's hierarchical grid measured ``ssgd[twophase]`` (the
fp32 codec through two-phase across nodes) 1.4x slower than the timeline model, and than
an allreduce of the same bytes. This script times the exchange *patterns* alone, with raw
``torch.distributed`` (gloo) calls and no gradzip code in the timed loop, on the emulated
network of ``gradzip bench net --workers 4 --workers-per-node 2`` (two nodes of two
workers, each node behind one shaped uplink; unshaped links inside a node). Each pattern
is what the hierarchical exchange issues for one bucket of ``S`` bytes per worker:

* a reduce-scatter inside the node (each worker keeps a shard of ``S`` bytes), then across
  nodes, between the two workers of equal local rank (two such exchanges at once, sharing
  both uplinks):

  - ``allreduce``: gloo's ring allreduce of the shard (the exact transport);
  - ``2 phases``: two whole-message ``all_to_all_single`` calls, each sending half the
    shard to the peer (the two phases of the two-phase transport, as PSync issues them);
  - ``2 phases / R``: the same two phases, each split into ``R`` rounds (``R`` calls, each
    of ``1/R`` of every message);

* then an allgather inside the node.

Every pattern moves the same bytes over the uplinks; the model
(:mod:`gradzip.bench.costs`) prices every one at ``2·(m−1)/m · S / (B/k)`` across nodes
(``m = 2`` nodes, ``k = 2`` exchanges sharing an uplink of ``B``). ``--bandwidth none``
runs the same patterns on unshaped links: what rounds cost where the link is fast.

    sudo python -m benchmarks.uplink_phases --bandwidth 100mbit,none --rounds 4,16,64 --repeat 5 --write

Needs root and ``ip``/``tc`` (as ``gradzip bench net``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.docs_section import PAGES, ROOT, replace_section

HEADING = "Two-phase across nodes: whole messages on a shared uplink"
PAGE = PAGES / "transports-and-nodes.md"
WORKERS, PER_NODE = 4, 2


def patterns(rounds: list[int]) -> list[tuple[str, int]]:
    """(name, rounds) of each timed pattern: rounds 0 is the allreduce."""
    return [("allreduce", 0), ("2 phases", 1)] + [(f"2 phases / {r}", r) for r in rounds]


def worker(rank: int, spec_path: str) -> None:
    """One rank: time every pattern ``repeat`` times (after one warm-up), write the times."""
    import os
    import time

    import torch
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    n, k = WORKERS, PER_NODE
    m = n // k
    dist.init_process_group("gloo", rank=rank, world_size=n, init_method=(
        f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"))
    nodes = [dist.new_group([node * k + j for j in range(k)]) for node in range(m)]
    cross = [dist.new_group([j + k * node for node in range(m)]) for j in range(k)]
    node_group, cross_group = nodes[rank // k], cross[rank % k]
    per = spec["shard_bytes"] // 4 // m        # float32 elements sent to each peer
    shard = torch.randn(per * m)
    full = torch.randn(per * m * k)

    def phase(r: int) -> None:
        if r == 1:
            out = torch.empty_like(shard)
            dist.all_to_all_single(out, shard, group=cross_group)
            return
        rows = shard.view(m, per)
        bounds = [per * c // r for c in range(r + 1)]
        for lo, hi in zip(bounds, bounds[1:]):
            send = rows[:, lo:hi].contiguous().view(-1)
            dist.all_to_all_single(torch.empty_like(send), send, group=cross_group)

    def once(r: int) -> float:
        dist.barrier()
        began = time.perf_counter()
        dist.reduce_scatter_tensor(shard, full, group=node_group)
        if r == 0:
            dist.all_reduce(shard, group=cross_group)
        else:
            phase(r)
            phase(r)
        dist.all_gather_into_tensor(full, shard, group=node_group)
        return time.perf_counter() - began

    times = {}
    for name, r in patterns(spec["rounds"]):
        once(r)
        times[name] = [once(r) for _ in range(spec["repeat"])]
    Path(spec["out_dir"], f"rank{rank}.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def run(bandwidth_bps: float | None, args, out_dir: Path) -> dict[str, list[float]]:
    """Every pattern on one topology: per pattern, each repeat's slowest rank (seconds)."""
    from gradzip.bench import emulated, netns

    spec = {"shard_bytes": args.shard_bytes, "rounds": args.rounds, "repeat": args.repeat, "out_dir": str(out_dir)}
    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    code = f"from benchmarks.uplink_phases import worker; worker({{rank}}, {str(spec_path)!r})"
    with netns.Topology(WORKERS, bandwidth_bps, workers_per_node=PER_NODE) as topo:
        emulated.run_ranks(topo, code, out_dir, timeout_s=600, threads=1, what="uplink-phases", cwd=ROOT)
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORKERS)]
    return {name: [max(rank[name][i] for rank in ranks) for i in range(args.repeat)] for name in ranks[0]}


def model_ms(shard_bytes: int, bandwidth_bps: float | None) -> float | None:
    """The model's time across nodes (both patterns): a ring allreduce of the shard among
    ``m`` workers, ``k`` such exchanges sharing each uplink."""
    from gradzip.bench.costs import allreduce_time
    if bandwidth_bps is None:
        return None
    return 1e3 * allreduce_time(shard_bytes, WORKERS // PER_NODE, bandwidth_bps / 8 / PER_NODE)


def markdown(results: dict, args, command: str) -> str:
    from gradzip.bench.units import format_rate
    lines = [f"Produced by `{command}` (each figure: the median over {args.repeat} repeats of the "
             "slowest worker; shard "
             f"{args.shard_bytes / 1e6:.2f} MB per worker, the `mlp:hidden=1024x512` model of the "
             "model validation grid):", "",
             "| link (per node uplink) | pattern | ms (median) | min–max ms | × allreduce | model ms (across nodes) |",
             "|---|---|---:|---:|---:|---:|"]
    for rate, rows in results.items():
        bps = None if rate == "none" else float(rate)
        base = statistics.median(rows["allreduce"])
        model = model_ms(args.shard_bytes, bps)
        for name, times in rows.items():
            med = statistics.median(times)
            lines.append(f"| {format_rate(bps)} | {name} | {1e3 * med:.0f} | {1e3 * min(times):.0f}–{1e3 * max(times):.0f} "
                         f"| {med / base:.2f} | {'–' if model is None else f'{model:.0f}'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from gradzip.bench.units import parse_ints, parse_rates
    parser = argparse.ArgumentParser(prog="python -m benchmarks.uplink_phases", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bandwidth", default="100mbit,none", help="node uplink rates; none = unshaped")
    parser.add_argument("--rounds", default="4,16,64", help="round counts of the split phases")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--shard-bytes", type=int, default=3_159_060)
    parser.add_argument("--write", action="store_true", help=f"write the section '{HEADING}' of {PAGE.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    args.rounds = parse_ints(args.rounds, "rounds", 2)
    results = {}
    with tempfile.TemporaryDirectory(prefix="uplink-phases-") as tmp:
        for i, bps in enumerate(parse_rates(args.bandwidth)):
            out_dir = Path(tmp, str(i))
            out_dir.mkdir()
            results["none" if bps is None else str(bps)] = run(bps, args, out_dir)
    command = "python -m benchmarks.uplink_phases " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(results, args, command)
    print(text)
    if args.write:
        replace_section(HEADING, text, PAGE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
