"""Step time of gradzip's optimizers against PyTorch DDP, side by side in one run (issue 14, item 3).

N gloo worker processes (default 2) train the same model (``mlp10m``: 10M parameters,
built from one seed on every worker, so all replicas start identical) on synthetic data,
batch 32 per worker, one torch thread each; every step is real: ``zero_grad``, forward,
cross-entropy, backward, ``step()``. Variants:

* ``ddp``: ``DistributedDataParallel`` + ``torch.optim.SGD`` (the peer; the ratio's base);
* ``ddp-allreduce-hook``: the same with torch's own ``allreduce_hook`` (uncompressed: what
  any communication hook pays over DDP's built-in allreduce, which divides while it copies
  the gradients into the bucket);
* ``ddp-fp16``: the same with torch's ``fp16_compress_hook`` (the peer's codec);
* ``ssgd-unguarded``: SSGD with ``nonfinite="off"`` (no NaN/Inf check of the aggregate,
  which for S-SGD with ``none`` under ``"raise"`` also guards the gradients: what the
  guard costs, one read pass a step, which DDP does not pay);
* ``ssgd``, ``efsgd-topk1%``, ``bitsgd``, ``cdsgd``: ``gradzip.optim`` SSGD,
  EFSGD(compressor ``topk:ratio=0.01``), BitSGD, CDSGD (default 2-bit codec, k 5), each
  on the bare model (no DDP); ``METHOD@CODEC`` (e.g. ``efsgd@auto:1bit``): any method of
  ``gradzip.optim.METHODS`` with that compressor, ``ddp@CODEC`` DDP + SGD with gradzip's codec
  hook of that codec (benchmarks/auto_codec.py's variants), ``ddp-unguarded@CODEC`` the same
  hook with ``nonfinite="off"`` (what its NaN/Inf check costs). CD-SGD's ``step()`` returns before its exchange ends; its
  next step waits for it, and ``synchronize()`` closes every round (timed as part of the
  round's last step). Its full-precision step every k = 5 and that closing wait are hidden
  by a median: the table's "mean" column (the round's mean step) counts them; use a
  ``--steps`` multiple of 5.

All variants are built once, warmed up, then timed **interleaved**: each round runs every
variant for ``--steps`` steps, in an order rotated from round to round, so a load drift
on the shared machine hits every variant alike. Per round and variant: the median step
time of each worker, the slowest worker's counts; reported: the median over rounds (and
min / max), the ratio to ``ddp`` of the same run, the bytes one worker sends per step
(counted by gradzip's exchanges; for DDP the ring allreduce of its fp32 / fp16 buckets).

The physical limits of the run: the time of one reused-buffer copy of all gradients
(``out.copy_(x)``, the floor of any pass over them), and on a shaped link the link time of
S-SGD's ring allreduce bytes (``2(n-1)/n · 4P`` bytes at the link's rate).

Two network settings (``--network``, comma-separated): ``loopback`` (the workers on
127.0.0.1, :func:`gradzip.comm.launch.run_processes`) and a rate such as ``1gbit``: each
worker in a network namespace of its own with a tc-shaped link of that rate to a switch
(:class:`gradzip.bench.netns.Topology`; needs root). ``--write`` replaces the section
"Step time against PyTorch DDP" of docs/benchmarks/step-vs-ddp.md; without it the table is only printed.
Run from the checkout root on an idle machine::

    sudo .venv/bin/python -m benchmarks.step_vs_ddp --network loopback,1gbit --rounds 7 --steps 10 --write
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.docs_section import PAGES, ROOT, replace_section
from gradzip.bench import emulated, netns
from gradzip.bench.units import format_rate, parse_rate
from gradzip.comm import allreduce_wire_bytes, init_from_env
from gradzip.errors import GradzipError
from gradzip.comm.launch import WorkerError, run_processes
from gradzip.integrations import ddp as ddp_hooks
from gradzip.optim import CDSGD, METHODS, SSGD, BitSGD, EFSGD
from gradzip.train import models

HEADING = "Step time against PyTorch DDP"
PAGE = PAGES / "step-vs-ddp.md"
#: The variants (:func:`build`), in the default order; the first given is the ratios' base.
VARIANTS = ("ddp", "ddp-allreduce-hook", "ddp-fp16", "ssgd", "ssgd-unguarded", "efsgd-topk1%", "bitsgd", "cdsgd")
SHAPE = (3, 32, 32)
CLASSES = 10
LR = 0.01


def check_variants(variants: Sequence[str]) -> None:
    """Each a variant of :data:`VARIANTS`, or ``METHOD@CODEC`` of a registered method."""
    def known(v: str) -> bool:
        algo, at, codec = v.partition("@")
        return v in VARIANTS or bool(at and codec and (algo in ("ddp", "ddp-unguarded") or algo in METHODS))

    unknown = [v for v in variants if not known(v)]
    if unknown or not variants:
        raise GradzipError(f"unknown variant(s) {', '.join(unknown) or '(none given)'}; valid: {', '.join(VARIANTS)}, "
                           f"or METHOD@CODEC with METHOD ddp (gradzip's DDP codec hook), ddp-unguarded (the same with "
                           f"nonfinite='off') or one of {', '.join(METHODS)}")


class HookedSGD(torch.optim.SGD):
    """``torch.optim.SGD`` over a DDP model whose gradients gradzip's codec hook exchanges
    (``ddp@CODEC``): the hook state's bytes and auto:<codec>'s choices, as a gradzip optimizer
    reports them."""

    def __init__(self, params, state):
        super().__init__(params, lr=LR)
        self.hook_state = state

    @property
    def bytes_sent(self) -> int:
        return self.hook_state.bytes_sent

    def _latest(self) -> list:
        """The decisions in use: those of the latest step (the hook decides for DDP's initial
        buckets at step 1, whose decisions the rebuilt buckets execute per parameter; a
        recalibration decides for all of them at one step)."""
        made = list(self.hook_state.decisions.values())
        last = max((d.step for d in made), default=None)
        return [d for d in made if d.step == last]

    def auto_choices(self) -> list[str]:
        return [c for d in self._latest() for c in d.choices]

    def auto_decisions(self) -> dict[str, str]:
        return {f"bucket {i}": d.describe() for i, d in enumerate(self._latest())}


def build(variant: str, comm, model_name: str, shape: tuple = SHAPE):
    """(model to call, optimizer, finish) for one variant: ``finish()`` ends a round (waits
    for a background exchange)."""
    model = models.build(model_name, shape, CLASSES, seed=0)
    if variant.startswith("ddp"):
        model = DDP(model)
        if variant == "ddp-fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif variant == "ddp-allreduce-hook":   # PyTorch's own uncompressed hook: what any comm hook pays
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        elif variant.startswith(("ddp@", "ddp-unguarded@")):   # unguarded: what the NaN/Inf check costs
            kind, _, codec = variant.partition("@")
            state = ddp_hooks.hook(codec, model=model, **({"nonfinite": "off"} if kind == "ddp-unguarded" else {}))
            model.register_comm_hook(state, ddp_hooks.codec_hook)
            return model, HookedSGD(model.parameters(), state), lambda: None
        return model, torch.optim.SGD(model.parameters(), lr=LR), lambda: None
    params = model.parameters()
    if variant == "ssgd":
        opt = SSGD(params, LR, comm=comm)
    elif variant == "ssgd-unguarded":   # what the NaN/Inf guard costs (one read pass a step)
        opt = SSGD(params, LR, comm=comm, nonfinite="off")
    elif variant == "efsgd-topk1%":
        opt = EFSGD(params, LR, comm=comm, compressor="topk:ratio=0.01")
    elif variant == "bitsgd":
        opt = BitSGD(params, LR, comm=comm)
    elif variant == "cdsgd":
        opt = CDSGD(params, LR, comm=comm)
        return model, opt, opt.synchronize
    elif "@" in variant:
        algo, _, codec = variant.partition("@")
        opt = METHODS[algo](params, LR, comm=comm, compressor=codec)
        return model, opt, getattr(opt, "synchronize", lambda: None)
    else:
        raise GradzipError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
    return model, opt, lambda: None


def copy_seconds(numel: int, repeats: int = 9) -> float:
    """Median time of ``out.copy_(x)`` of ``numel`` float32 values into a reused buffer."""
    x, out = torch.randn(numel), torch.empty(numel)
    out.copy_(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out.copy_(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(comm, spec: dict[str, Any]) -> dict[str, Any]:
    """What each worker runs: every variant warmed up, then ``rounds`` interleaved rounds;
    per variant the per-round median step seconds of this worker, and the bytes it sent."""
    torch.set_num_threads(spec["threads"])
    rank, variants = comm.rank, spec["variants"]
    shape = tuple(spec.get("shape", SHAPE))
    g = torch.Generator().manual_seed(1000 + rank)
    data = [(torch.randn(spec["batch"], *shape, generator=g), torch.randint(0, CLASSES, (spec["batch"],), generator=g))
            for _ in range(4)]
    built = {v: build(v, comm, spec["model"], shape) for v in variants}
    counter = {v: 0 for v in variants}

    def step(v):
        model, opt, _ = built[v]
        x, y = data[counter[v] % len(data)]
        counter[v] += 1
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for v in variants:
        for _ in range(spec["warmup"]):
            step(v)
        built[v][2]()
    rounds: dict[str, list[float]] = {v: [] for v in variants}
    means: dict[str, list[float]] = {v: [] for v in variants}
    bytes0 = {v: getattr(built[v][1], "bytes_sent", 0) for v in variants}
    for r in range(spec["rounds"]):
        shift = r % len(variants)
        for v in variants[shift:] + variants[:shift]:
            _, _, finish = built[v]
            comm.barrier()
            times = []
            for i in range(spec["steps"]):
                t0 = time.perf_counter()
                step(v)
                if i == spec["steps"] - 1:
                    finish()
                times.append(time.perf_counter() - t0)
            rounds[v].append(statistics.median(times))
            means[v].append(statistics.fmean(times))
    measured = spec["rounds"] * spec["steps"]
    sent = {v: (getattr(built[v][1], "bytes_sent", 0) - bytes0[v]) / measured for v in variants}
    numel = sum(p.numel() for p in built[variants[0]][0].parameters())
    auto = {v: built[v][1].auto_choices() for v in variants if getattr(built[v][1], "auto_choices", None)}
    decided = {v: built[v][1].auto_decisions() for v in auto}
    return {"rank": rank, "rounds": rounds, "means": means, "bytes_per_step": sent, "parameters": numel,
            "copy_s": copy_seconds(numel), "auto": auto, "auto_decisions": decided}


# ----------------------------------------------------------------------------- launching


def namespace_worker(spec_path: str, rank: int) -> None:
    """What a worker runs inside its namespace: :func:`measure`, its result written to
    ``rank{rank}.json`` beside the spec; leaves with ``os._exit`` (see
    :func:`gradzip.bench.emulated.worker_main`)."""
    code = 1
    try:
        spec = json.loads(Path(spec_path).read_text())
        comm = init_from_env(timeout_s=spec["timeout_s"])
        try:
            out = measure(comm, spec)
            Path(spec_path).with_name(f"rank{rank}.json").write_text(json.dumps(out))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_shaped(n: int, bandwidth: float, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """:func:`measure` on ``n`` workers, each in its own namespace behind a link of
    ``bandwidth`` bits/s (both ways); the per-rank results in rank order."""
    netns.check_available()
    with tempfile.TemporaryDirectory(prefix="step_vs_ddp-") as tmp:
        spec_path = Path(tmp, "spec.json")
        spec_path.write_text(json.dumps(spec))
        with netns.Topology(n, bandwidth) as topo:
            emulated.run_ranks(topo, "from benchmarks.step_vs_ddp import namespace_worker; "
                                     f"namespace_worker({str(spec_path)!r}, {{rank}})",
                               Path(tmp), spec["timeout_s"], spec["threads"], what="step_vs_ddp", cwd=ROOT,
                               env={"PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path[1:]])})
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(n)]


# ----------------------------------------------------------------------------- results


def summarize(ranks: list[dict[str, Any]], n: int, bandwidth: float | None) -> dict[str, Any]:
    """One network setting's rows: per variant the slowest worker's per-round median, then
    the median (min, max) over rounds, the ratio to the first variant, bytes per step; and
    the physical limits (reused copy of the gradients, the link time of S-SGD's bytes)."""
    variants = list(ranks[0]["rounds"])
    params = ranks[0]["parameters"]
    dense = allreduce_wire_bytes(4 * params, n)
    rows = []
    for v in variants:
        per_round = [max(r["rounds"][v][i] for r in ranks) for i in range(len(ranks[0]["rounds"][v]))]
        round_means = [max(r["means"][v][i] for r in ranks) for i in range(len(ranks[0]["means"][v]))]
        sent = statistics.fmean(r["bytes_per_step"][v] for r in ranks)
        if v in ("ddp", "ddp-allreduce-hook"):
            sent = dense
        elif v == "ddp-fp16":
            sent = allreduce_wire_bytes(2 * params, n)
        rows.append({"variant": v, "median_s": statistics.median(per_round), "min_s": min(per_round),
                     "max_s": max(per_round), "rounds_s": per_round, "mean_s": statistics.median(round_means),
                     "bytes_per_step": sent, **({"auto": ranks[0]["auto"][v], "auto_decisions": ranks[0]["auto_decisions"][v]}
                                                if v in ranks[0].get("auto", {}) else {})})
    base = rows[0]["median_s"]
    for row in rows:
        row["ratio"] = row["median_s"] / base
    return {"network": "loopback" if bandwidth is None else format_rate(bandwidth), "bandwidth_bps": bandwidth,
            "workers": n, "parameters": params, "rows": rows,
            "copy_s": statistics.median(r["copy_s"] for r in ranks),
            "link_s": dense * 8 / bandwidth if bandwidth else None}


def table(result: dict[str, Any]) -> str:
    """The markdown table of one network setting, with its limits line."""
    base = result["rows"][0]["variant"]
    lines = [f"| variant | ms/step (median) | min | max | × {base} | ms/step (mean) | MB sent / step |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['variant']} | {r['median_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.1f} | "
                     f"{r['max_s'] * 1e3:.1f} | **{r['ratio']:.2f}** | {r['mean_s'] * 1e3:.1f} | "
                     f"{r['bytes_per_step'] / 1e6:.2f} |")
    limits = (f"Limits: one reused-buffer copy of the {result['parameters'] / 1e6:.1f}M gradients "
              f"(`out.copy_(x)`) {result['copy_s'] * 1e3:.2f} ms")
    if result["link_s"] is not None:
        limits += (f"; S-SGD's ring allreduce bytes over one {result['network']} link "
                   f"{result['link_s'] * 1e3:.1f} ms")
    return f"**{result['network']}**, {result['workers']} workers\n\n" + "\n".join(lines) + "\n\n" + limits + "."


def parse_network(text: str) -> float | None:
    """``"loopback"`` -> None, a link rate (``"1gbit"``) -> bits/s."""
    if text.strip().lower() == "loopback":
        return None
    bandwidth = parse_rate(text)
    if bandwidth is None:
        raise GradzipError(f"--network {text.strip()!r} is 'loopback' here; give loopback or a rate such as 1gbit")
    return bandwidth


def run(args) -> list[dict[str, Any]]:
    spec = {"model": args.model, "batch": args.batch, "threads": args.threads, "warmup": args.warmup,
            "rounds": args.rounds, "steps": args.steps, "variants": list(args.variants),
            "timeout_s": args.timeout}
    results = []
    for bandwidth in args.network:
        print(f"[step_vs_ddp] {args.workers} workers, {format_rate(bandwidth) if bandwidth else 'loopback'} ...",
              file=sys.stderr, flush=True)
        if bandwidth is None:
            ranks = run_processes(args.workers, measure, spec, timeout_s=args.timeout)
        else:
            ranks = run_shaped(args.workers, bandwidth, spec)
        results.append(summarize(ranks, args.workers, bandwidth))
    return results


def section(results: list[dict[str, Any]], args, command: str) -> str:
    return (f"gradzip's optimizers against PyTorch's DDP in the same run: `{args.model}` "
            f"({results[0]['parameters'] / 1e6:.1f}M parameters), {args.workers} gloo worker processes, "
            f"batch {args.batch} per worker on synthetic {'x'.join(map(str, SHAPE))} data, {args.threads} "
            f"torch thread per worker; forward + backward + `step()` per step; {args.warmup} warm-up steps, "
            f"then {args.rounds} rounds of {args.steps} steps per variant, interleaved in a rotating order. "
            "ms/step: the slowest worker's median step of a round, median (min, max) over rounds; "
            "× ddp: against DDP + `torch.optim.SGD` of the same run (lower is better). "
            "ms/step (mean): the mean step of a round, median over rounds; it counts what a median "
            "hides, CD-SGD's full-precision step every k and its closing `synchronize()`. "
            "MB sent / step: one worker's counted bytes (DDP: its ring allreduce of fp32 or fp16 buckets). "
            "Shaped settings put each worker in a namespace of its own with a `tc tbf` link of that "
            "rate (`gradzip.bench.netns`). Produced by:\n\n"
            f"```\n{command}\n```\n\n" + "\n\n".join(table(r) for r in results) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_vs_ddp",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="gloo worker processes (default: %(default)s)")
    parser.add_argument("--network", default="loopback,1gbit",
                        help="comma-separated settings: loopback, or a link rate such as 1gbit "
                             "(namespaces, needs root) (default: %(default)s)")
    parser.add_argument("--model", default="mlp10m", help="model of the registry (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=32, help="batch per worker (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per variant (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant and round (default: %(default)s)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset, the first is the ratios' base (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the workers are given up")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--write", action="store_true", help=f"replace the section '{HEADING}' of {PAGE.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.step_vs_ddp " + " ".join(argv)
    try:
        args.network = [parse_network(s) for s in args.network.split(",") if s.strip()]
        if not args.network:
            raise GradzipError("--network needs at least one setting: loopback, or a rate such as 1gbit")
        args.variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
        check_variants(args.variants)
        for flag, value, low in (("--workers", args.workers, 2), ("--batch", args.batch, 1), ("--threads", args.threads, 1),
                                 ("--warmup", args.warmup, 0), ("--rounds", args.rounds, 1), ("--steps", args.steps, 1)):
            if value < low:
                raise GradzipError(f"{flag} must be >= {low}, got {value}")
        results = run(args)
    except (GradzipError, WorkerError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    text = section(results, args, command)
    print(text)
    if args.write:
        replace_section(HEADING, text, PAGE)
        print(f"updated section '{HEADING}' of {PAGE.relative_to(ROOT)}", file=sys.stderr)
    if args.json:
        try:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"command": command, "host": emulated.host_info(),
                                                   "results": results}, indent=1))
        except OSError as exc:
            print(f"{parser.prog}: error: --json {args.json}: {exc.strerror or exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
