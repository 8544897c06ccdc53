"""The runs behind ``gradzip bench net``: real gloo workers on an emulated cluster network.

For every (worker count, link bandwidth, latency) it builds a
:class:`~gradzip.bench.netns.Topology` (one network namespace per worker, a bridge in a "switch" namespace, every link shaped
both ways), starts one worker process per namespace (``ip netns exec``; gloo bound to the
worker's interface with ``GLOO_SOCKET_IFNAME``, ``MASTER_ADDR`` = rank 0's 198.18 address)
and in them:

1. **checks the shaping**: an fp32 allreduce of a known size ``B`` must take
   ``2(n-1)/n · B · 8 / bandwidth`` (the ring's bytes over one link) within 15%; the
   interface's own byte counter shows the headers gloo/TCP/IP add to the counted bytes;
2. **trains** each method for a few steps with the ordinary harness
   (:func:`gradzip.train.loop.run_worker`, tracing on) on synthetic data, one torch thread
   per worker, and reads each step's phases from the trace: iteration (compute start to
   the next compute start), compute, compress (+ decode), communicate (blocked on the
   network), update, and what ran hidden on a background thread. ``ddp`` rows
   (``ddp``, ``ddp@fp16``, ``ddp@powersgd:rank=R``) train PyTorch's own DDP with its
   hooks on the same data instead (:mod:`gradzip.bench.peers`).

:meth:`NetBench.run` returns the merged records as a dict and writes them to
``OUT/results.json`` (``gradzip bench model --measured`` validates against it). Only the
namespaces' own 198.18.0.0/15 addresses carry traffic; every namespace is removed
afterwards, also on Ctrl-C.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import allocator
from ..comm import allreduce_wire_bytes, init_from_env
from ..errors import GradzipError
from ..files import write_text
from ..train.config import method_label
from ..train.config import RunConfig
from ..train.loop import run_worker
from . import netns, peers
from .units import format_rate

#: The shaping check passes when measured / predicted is within this fraction of 1.
CHECK_TOLERANCE = 0.15
MASTER_PORT = 29517   # private to each topology's namespaces: no collision possible


def transport_label(label: str, transport: str) -> str:
    """A run's name in the tables: the method's, with ``[transport]`` unless it is ``auto``."""
    return label if transport == "auto" else f"{label}[{transport}]"


def _log(message: str) -> None:
    print(message, file=sys.stderr)


def check_bytes(bandwidth_bps: float | None, workers: int, target_s: float = 0.5,
                cap_bytes: int = 100 << 20) -> int:
    """Size of the shaping check's allreduce: about ``target_s`` on the link, 1 MiB to cap."""
    if bandwidth_bps is None or workers < 2:
        return 16 << 20
    per_link = 2 * (workers - 1) / workers
    nbytes = int(bandwidth_bps / 8 * target_s / per_link)
    return max(1 << 20, min(cap_bytes, nbytes)) // 4 * 4


# ----------------------------------------------------------------------------- worker side


def step_breakdown(events: list[dict], warmup: int) -> list[dict[str, float]]:
    """Per-step phase seconds of one worker from its trace events, steps after ``warmup``.

    iteration = this step's compute start to the next one's (the last step: to its end);
    compute = the compute span; compress = compress + decode spans on the training
    thread inside ``optimizer.step()``; communicate = communicate and wait spans there
    (time blocked on the network or on a background exchange); update = the rest of
    the step; loop = the harness between
    steps; hidden_* = compress / communicate / other (e.g. a global update) spans of
    other threads in the iteration; intra_bytes = bytes a hierarchical exchange sent
    inside the node in the iteration (its ``scope="node"`` spans, any thread);
    intra_in_compute = the seconds of those spans the training thread waited inside the
    compute span (the node's reduce-scatter, started from a gradient hook)."""
    main = [e for e in events if e.get("tid") == "MainThread" and e.get("ph") == "X"]
    computes = sorted((e for e in main if e["name"] == "compute"), key=lambda e: e["ts"])
    steps = sorted((e for e in main if e["name"] == "step"), key=lambda e: e["ts"])
    codec_names, rows = ("compress", "decode"), []
    for i, (c, s) in enumerate(zip(computes, steps)):
        start, s_end = c["ts"], s["ts"] + s["dur"]
        end = computes[i + 1]["ts"] if i + 1 < len(computes) else s_end
        inside = [e for e in main if s["ts"] <= e["ts"] < s_end]
        codec = sum(e["dur"] for e in inside if e["name"] in codec_names)
        wait = sum(e["dur"] for e in inside if e["name"] in ("communicate", "wait"))
        hidden = [e for e in events if e.get("tid") != "MainThread" and start <= e["ts"] < end]
        rows.append({
            "step": c.get("args", {}).get("step", i + 1),
            "iteration": (end - start) / 1e6,
            "compute": c["dur"] / 1e6,
            "compress": codec / 1e6,
            "communicate": wait / 1e6,
            "update": max(0.0, s["dur"] - codec - wait) / 1e6,
            "loop": max(0.0, (end - start) - c["dur"] - s["dur"]) / 1e6,
            "hidden_compress": sum(e["dur"] for e in hidden if e["name"] in codec_names) / 1e6,
            "hidden_communicate": sum(e["dur"] for e in hidden if e["name"] == "communicate") / 1e6,
            "hidden_other": sum(e["dur"] for e in hidden
                                if e["name"] not in codec_names + ("communicate",)) / 1e6,
            "intra_in_compute": sum(e["dur"] for e in main if e["name"] == "communicate"
                                    and c["ts"] <= e["ts"] < c["ts"] + c["dur"]
                                    and e.get("args", {}).get("scope") == "node") / 1e6,
            "intra_bytes": sum(e.get("args", {}).get("bytes") or 0 for e in events
                               if e["name"] == "communicate" and start <= e["ts"] < end
                               and e.get("args", {}).get("scope") == "node"),
        })
    return rows[warmup:]


def _tx_bytes() -> int:
    try:
        return int(Path(f"/sys/class/net/{netns.IFNAME}/statistics/tx_bytes").read_text())
    except OSError:
        return -1


def _shaping_check(comm, nbytes: int, repeats: int) -> list[dict[str, float]]:
    x = torch.ones(nbytes // 4)
    comm.allreduce(torch.ones(1 << 16))  # connections up
    out = []
    for _ in range(repeats + 1):
        comm.barrier()
        tx0, t0 = _tx_bytes(), time.perf_counter()
        comm.allreduce(x)
        t1 = time.perf_counter()
        comm.barrier()  # this worker's last chunk may still be queued when its allreduce returns
        out.append({"seconds": t1 - t0, "interface_bytes": _tx_bytes() - tx0})
    return out[1:]  # the first one also warms gloo's buffers


def worker_main(spec_path: str, rank: int) -> None:
    """What each worker process runs (inside its namespace); never returns.

    It leaves with ``os._exit`` once its results are written and the process group is
    destroyed: the interpreter's finalisation can abort in torch's C++ threads
    ("terminate called without an active exception", SIGABRT; the CLI does the same
    under torchrun), which would fail a finished benchmark. An error prints its
    traceback to the worker's log and exits 1."""
    code = 1
    try:
        _work(json.loads(Path(spec_path).read_text()), rank)
        code = 0
    except BaseException:  # the parent reads the worker's log, this traceback included
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_row(comm, cfg: dict[str, Any], warmup: int) -> dict[str, Any]:
    """One row of the table on this worker: a gradzip method through the harness, or a
    PyTorch DDP peer (``cfg["peer"]``); its summary and per-step phases after ``warmup``."""
    result = peers.run_peer(comm, cfg) if cfg.get("peer") else run_worker(comm, RunConfig(**cfg))
    return {"summary": result["summary"], "steps": step_breakdown(result["trace"], warmup),
            "transport": cfg.get("transport", "auto")}


def _work(spec: dict[str, Any], rank: int) -> None:
    torch.set_num_threads(spec["threads"])
    comm = init_from_env(timeout_s=spec["timeout_s"])
    try:
        out: dict[str, Any] = {"rank": rank, "world_size": comm.world_size}
        if spec["check_bytes"]:
            out["check"] = _shaping_check(comm, spec["check_bytes"], spec["check_repeats"])
        out["runs"] = [run_row(comm, cfg, spec["warmup"]) for cfg in spec["configs"]]
        Path(spec["out_dir"], f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- parent side


def run_ranks(topo: "netns.Topology", code: str, log_dir: Path, timeout_s: float, threads: int,
              what: str = "emulated-network", cwd: str | os.PathLike | None = None,
              env: dict[str, str] | None = None) -> None:
    """Run ``python -c code`` as ranks ``0..n-1`` of ``topo``, each in its own namespace with
    torchrun's variables (rendezvous on rank 0's address, gloo on the namespace's link), its
    output in ``log_dir/rank<r>.log``; ``{rank}`` in ``code`` is the rank. Returns when every
    rank exited 0; raises :class:`GradzipError` with the log's tail when one fails or all have
    not finished in ``timeout_s``, and stops the others either way."""
    procs = []
    try:
        for rank in range(topo.n):
            rank_env = dict(allocator.worker_env(), **(env or {}), RANK=str(rank), WORLD_SIZE=str(topo.n),
                            LOCAL_RANK=str(rank % topo.workers_per_node),
                            LOCAL_WORLD_SIZE=str(topo.workers_per_node), MASTER_ADDR=netns.address(0), MASTER_PORT=str(MASTER_PORT),
                            GLOO_SOCKET_IFNAME=netns.IFNAME, TP_SOCKET_IFNAME=netns.IFNAME,
                            OMP_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="")
            cmd = topo.exec_prefix(rank) + [sys.executable, "-c", code.replace("{rank}", str(rank))]
            log_file = open(Path(log_dir) / f"rank{rank}.log", "w")
            procs.append((subprocess.Popen(cmd, env=rank_env, cwd=cwd, stdout=log_file,
                                           stderr=subprocess.STDOUT), log_file))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p, _ in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                rank, code_ = bad[0]
                tail = (Path(log_dir) / f"rank{rank}.log").read_text()[-3000:]
                raise GradzipError(f"{what} worker rank {rank} exited with code {code_}:\n{tail}")
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                raise GradzipError(f"{what} workers did not finish in {timeout_s:.0f} s (logs in {log_dir})")
            time.sleep(0.1)
    finally:
        for proc, log_file in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            log_file.close()


@dataclasses.dataclass
class NetBench:
    """One ``gradzip bench net`` invocation."""

    workers: list[int]
    bandwidths: list[float | None]
    latencies: list[float]
    algos: list[tuple[str, str | None]]
    model: str = "resnet18:width=32"
    shape: str = "3x32x32"
    batch_size: int = 8
    steps: int = 8
    warmup: int = 2
    threads: int = 1
    check_repeats: int = 3
    check_mb: float = 100.0
    out: str = "runs/bench-net"
    timeout_s: float = 900.0
    seed: int = 0
    straggler: str | None = None   # gradzip.train.stragglers spec: delays injected in every run
    workers_per_node: int = 1   # > 1: k workers per node behind one shaped uplink; methods exchange hierarchically
    transports: list[str] = dataclasses.field(default_factory=lambda: ["auto"])   # every method once per transport
    round_bytes: int | None = None   # two-phase all-to-alls in rounds of at most this many bytes per message

    def configs(self, n: int) -> list[dict[str, Any]]:
        total = self.warmup + self.steps
        dataset = f"synthetic:n={n * self.batch_size * total},test=64,shape={self.shape},classes=10"
        cfgs = []
        for algo, codec in self.algos:
            if peers.is_peer(algo):   # PyTorch's DDP: the same data, model, batch, lr and seed
                hook = peers.parse_hook(codec)
                cfgs.append({"peer": True, "hook": hook, "label": peers.label(hook), "dataset": dataset,
                             "model": self.model, "epochs": 1, "batch_size": self.batch_size, "lr": 0.01,
                             "seed": self.seed})
                continue
            options = {"compressor": codec} if codec else {}
            for transport in self.transports:
                cfg = RunConfig(algo=algo, options=options, label=transport_label(method_label(algo, codec), transport),
                                dataset=dataset, model=self.model, epochs=1, batch_size=self.batch_size,
                                lr=0.01, seed=self.seed, trace=True, eval_on="local", progress=False,
                                straggler=self.straggler, transport=transport, round_bytes=self.round_bytes,
                                workers_per_node=self.workers_per_node if self.workers_per_node > 1 else None)
                cfgs.append(dataclasses.asdict(cfg))
        return cfgs

    def run_one(self, n: int, bandwidth: float | None, latency: float) -> dict[str, Any]:
        """One topology: the shaping check and every method; the per-rank outputs merged."""
        out_dir = Path(self.out, f"n{n}-{format_rate(bandwidth).replace(' ', '').replace('/', '')}-lat{latency * 1e3:g}ms")
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.glob("rank*.json"):
            old.unlink()
        nbytes = check_bytes(bandwidth, n, cap_bytes=int(self.check_mb * (1 << 20))) if n > 1 else 0
        spec = {"threads": self.threads, "timeout_s": self.timeout_s, "check_bytes": nbytes,
                "check_repeats": self.check_repeats, "warmup": self.warmup, "configs": self.configs(n),
                "out_dir": str(out_dir.resolve())}
        spec_path = out_dir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        began = time.perf_counter()
        with netns.Topology(n, bandwidth, latency, workers_per_node=self.workers_per_node) as topo:
            run_ranks(topo, "from gradzip.bench.emulated import worker_main; "
                            f"worker_main({str(spec_path.resolve())!r}, {{rank}})",
                      out_dir, self.timeout_s, self.threads, what="emulated-network")
        ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(n)]
        record = merge(ranks, n, bandwidth, latency, nbytes)
        record["workers_per_node"] = self.workers_per_node
        record["elapsed_s"] = time.perf_counter() - began
        return record

    def run(self, log: Callable[[str], None] = _log, command: str = "") -> dict[str, Any]:
        netns.check_available()
        records = []
        for n in self.workers:
            for bandwidth in self.bandwidths:
                for latency in self.latencies:
                    log(f"[bench net] {n} workers, {format_rate(bandwidth)} links, latency {latency * 1e3:g} ms ...")
                    records.append(self.run_one(n, bandwidth, latency))
        result = {"command": command, "host": host_info(), "settings": {k: v for k, v in dataclasses.asdict(self).items()},
                  "records": records}
        Path(self.out).mkdir(parents=True, exist_ok=True)
        write_text(Path(self.out, "results.json"), json.dumps(result, indent=1))
        return result


def host_info() -> dict[str, Any]:
    return {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "machine": platform.machine(), "kernel": platform.release(),
            "loadavg": list(os.getloadavg())}


PHASES = ("iteration", "compute", "compress", "communicate", "update", "loop", "hidden_compress",
          "hidden_communicate", "hidden_other")


def merge(ranks: list[dict], n: int, bandwidth: float | None, latency: float, nbytes: int) -> dict[str, Any]:
    """One topology's record from its workers' outputs: the check (slowest worker per
    repeat, median over repeats) and per method the mean over steps of the phases
    (mean over workers) and of the *critical local work*: the largest, over workers, of
    compute + compress + update + loop in that step (what a synchronous step waits for
    besides the network; a hierarchical exchange's waits on the node's links inside the
    compute span are network, not local work)."""
    record: dict[str, Any] = {"workers": n, "bandwidth_bps": bandwidth, "latency_s": latency}
    if nbytes:
        times = [max(r["check"][i]["seconds"] for r in ranks) for i in range(len(ranks[0]["check"]))]
        iface = statistics.median(r["check"][i]["interface_bytes"] for r in ranks for i in range(len(times)))
        counted = allreduce_wire_bytes(nbytes, n)
        predicted = counted * 8 / bandwidth if bandwidth else None
        measured = statistics.median(times)
        record["check"] = {"bytes": nbytes, "counted_wire_bytes": counted, "interface_bytes": iface,
                           "predicted_s": predicted, "measured_s": measured, "all_s": times,
                           "ratio": measured / predicted if predicted else None,
                           "ok": (abs(measured / predicted - 1) <= CHECK_TOLERANCE) if predicted else None}
    runs = []
    for m in range(len(ranks[0]["runs"])):
        per_rank = [r["runs"][m]["steps"] for r in ranks]
        summary = ranks[0]["runs"][m]["summary"]
        steps = len(per_rank[0])
        # the MEAN over steps, not the median: a periodic method (CD-SGD's full-precision
        # step every k, local SGD's averaging every H) pays its expensive step 1/k of the
        # time, which a median would hide. Measure whole periods (--steps a multiple of k).
        phases = {k: statistics.fmean(statistics.fmean(rows[j][k] for rows in per_rank) for j in range(steps))
                  for k in PHASES}
        local = [max(rows[j]["compute"] - rows[j].get("intra_in_compute", 0.0) + rows[j]["compress"]
                     + rows[j]["update"] + rows[j]["loop"] for rows in per_rank) for j in range(steps)]
        computes = [statistics.fmean(rows[j]["compute"] for rows in per_rank) for j in range(steps)]
        # per step, the slower of compute and the exchange running beside it (a periodic
        # exchange, CD-SGD's full-precision step, exceeds the compute of its own step only);
        # mean over workers, as the phases
        bound = [statistics.fmean(max(rows[j]["compute"], rows[j]["hidden_compress"] + rows[j]["hidden_communicate"]
                                      + rows[j]["hidden_other"]) for rows in per_rank) for j in range(steps)]
        runs.append({
            "algo": summary["algo"], "method": summary["method"], "options": summary["options"],
            "transport": ranks[0]["runs"][m].get("transport", "auto"),
            "peer": bool(summary.get("peer")),
            "model": summary["model"], "parameters": summary["parameters"],
            "steps_total": summary["steps"], "steps_measured": steps,
            "bytes_per_step": summary["bytes_sent_per_worker"] / summary["steps"],
            "intra_bytes_per_step": statistics.fmean(rows[j].get("intra_bytes", 0) for rows in per_rank
                                                     for j in range(steps)) if steps else 0.0,
            "critical_local_s": statistics.fmean(local),
            "overlap_bound_s": statistics.fmean(bound),
            "compute_cv": (statistics.pstdev(computes) / statistics.fmean(computes)) if steps > 1 else 0.0,
            **{f"{k}_s": v for k, v in phases.items()},
        })
    record["runs"] = runs
    return record
