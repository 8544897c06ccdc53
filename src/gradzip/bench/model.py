"""``gradzip bench model``: a timeline model of one training iteration per method.

**Network** (alpha-beta, ring collectives, one full-duplex link of ``B`` bytes/s per
worker, ``alpha`` seconds per message step):

* allreduce of ``S`` bytes: ``2(n-1)`` steps of ``S/n`` bytes,
  ``T = 2(n-1)·alpha + 2(n-1)/n · S / B``;
* allgather of ``S`` bytes from each worker: ``n-1`` steps of ``S`` bytes,
  ``T = (n-1)·alpha + (n-1) · S / B``.

The byte counts are :func:`gradzip.comm.base.allreduce_wire_bytes` /
``allgather_wire_bytes``, the ones every run reports.

**Method**: which collectives a method issues and how large they are is not written down
here: :func:`profile_method` runs the method's own ``step()`` (any class in
``gradzip.optim.METHODS``) on a :class:`RecordingGroup`, a world of ``n`` that records
every collective instead of sending it, and times its codec work
(``optimizer.timings.compress_s``) and the rest of the step on this machine. So a method
added later is modelled without changes here; its class attribute ``overlaps_exchange``
says whether the exchange of step t runs while step t+1 computes.

**Iteration** (:func:`timeline`): the spans of one steady-state iteration on two tracks
(the training thread, a background exchange); its period is

* ``compute + compress + communicate + update`` for a method that exchanges inside
  ``step()`` (S-SGD, EF-SGD, BIT-SGD, ...);
* ``max(compute, compress + communicate) + update`` for one that overlaps the exchange
  with the next step's computation (OD-SGD, CD-SGD): the max, not the sum.

``gradzip bench model --measured runs/bench-net/results.json`` validates the model
against the emulated network: compute, codec and update times are the ones measured in
those very runs (the slowest worker's, per step), the network time is the model's; the
predicted iteration time must be within 15% of the measured one. Then it projects to
8-256 workers at 10 / 25 / 56 / 100 Gbit/s for a ResNet-50-sized model (25.6M
parameters, its real tensor shapes) at a given compute time per iteration, with codec
times measured here, and plots iteration time and speedup over S-SGD.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..comm.base import Group, Work, allgather_wire_bytes, allreduce_wire_bytes
from ..errors import GradzipError

#: Predicted iteration time must be within this fraction of the measured one.
TOLERANCE = 0.15


# ----------------------------------------------------------------------------- network


def allreduce_time(nbytes: int, n: int, bandwidth_Bps: float, alpha_s: float = 0.0) -> float:
    """Seconds for a ring allreduce of ``nbytes`` among ``n`` workers."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * alpha_s + allreduce_wire_bytes(nbytes, n) / bandwidth_Bps


def allgather_time(nbytes: int, n: int, bandwidth_Bps: float, alpha_s: float = 0.0) -> float:
    """Seconds for a ring allgather of ``nbytes`` from each of ``n`` workers."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * alpha_s + allgather_wire_bytes(nbytes, n) / bandwidth_Bps


def collective_time(kind: str, nbytes: int, n: int, bandwidth_Bps: float, alpha_s: float = 0.0) -> float:
    if kind == "allreduce":
        return allreduce_time(nbytes, n, bandwidth_Bps, alpha_s)
    if kind == "allgather":
        return allgather_time(nbytes, n, bandwidth_Bps, alpha_s)
    if kind == "broadcast":  # pipelined: the message crosses each link once
        return 0.0 if n <= 1 else (n - 1) * alpha_s + nbytes / bandwidth_Bps
    raise GradzipError(f"unknown collective {kind!r}")


# ----------------------------------------------------------------------------- recording


class _DryRun(Exception):
    """Raised by a dry :class:`RecordingGroup` when a step waits for a collective."""


class RecordingGroup(Group):
    """A world of ``world_size`` seen from rank 0 that sends nothing: every collective is
    recorded as ``(kind, payload bytes)`` and completes at once as if every worker had
    contributed this worker's tensor (allreduce: the tensor itself; allgather: ``n``
    copies). Byte counting is the base class's, as for a real group. ``dry=True``: waiting
    on a collective raises :class:`_DryRun` instead (sizes only, no decoding)."""

    def __init__(self, world_size: int, rank: int = 0, dry: bool = False):
        super().__init__()
        self.world_size, self.rank, self.dry = int(world_size), int(rank), dry
        self.calls: list[tuple[str, int]] = []
        self._family = [self]

    def new_group(self) -> "RecordingGroup":
        """Another group of the same workers; its collectives go to the same record."""
        child = RecordingGroup(self.world_size, self.rank, self.dry)
        child.calls = self.calls
        child._family = self._family
        self._family.append(child)
        return child

    def total_bytes(self) -> int:
        """Bytes counted by this group and the groups made from it."""
        return sum(g.bytes_sent for g in self._family)

    def _done(self, result, nbytes):
        if self.dry:
            def fail():
                raise _DryRun()
            return Work(fail, nbytes)
        return Work.completed(result, nbytes)

    def _allreduce(self, tensor, nbytes):
        self.calls.append(("allreduce", tensor.numel() * tensor.element_size()))
        return self._done(tensor, nbytes)

    def _allgather(self, tensor, nbytes):
        self.calls.append(("allgather", tensor.numel() * tensor.element_size()))
        return self._done(tensor.unsqueeze(0).expand(self.world_size, *tensor.shape), nbytes)

    def _broadcast(self, tensor, src, nbytes):
        self.calls.append(("broadcast", tensor.numel() * tensor.element_size()))
        return self._done(tensor, nbytes)

    def allgather_control(self, tensor):
        """Answered locally, unrecorded: the model leaves out the few bytes and the latency
        of a method's coordination (settings digest, non-finite agreement)."""
        return tensor.unsqueeze(0).expand(self.world_size, *tensor.shape).clone()


@dataclass
class MethodProfile:
    """What one method does per step, for ``n`` workers (means over the profiled steps)."""

    label: str
    workers: int
    overlaps: bool
    calls: list[list[tuple[str, int]]]   # per profiled step: (kind, payload bytes) per collective
    wire_bytes_per_step: float           # what the group counted (ring bytes), mean per step
    compress_s: float                    # codec work per step (compress + decode), measured here
    update_s: float                      # the rest of step(), measured here
    decode_s: float = 0.0                # the decoding part of compress_s
    timed_at: int = 0                    # worker count the times were measured at

    def comm_time(self, bandwidth_Bps: float, alpha_s: float) -> float:
        """Mean network seconds per step."""
        return statistics.fmean(sum(collective_time(k, b, self.workers, bandwidth_Bps, alpha_s) for k, b in step)
                                for step in self.calls)


def _parameters(shapes: Sequence[tuple[int, ...]], seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.05)
        p.grad = torch.randn(shape, generator=g) * 0.01
        params.append(p)
    return params


def _steps(algo, options, shapes, workers, steps, warmup, dry=False):
    """Run a method's ``step()`` on a recording group: per measured step its collectives,
    wire bytes, codec seconds (compress + decode, wherever they ran), decode seconds and
    the rest of the time ``step()`` held the training thread. A method that exchanges in
    the background is waited for (its ``synchronize()``) after each step, outside the
    timing. Dry: every step on a fresh optimizer whose step counter is set to ``t - 1``
    (so periodic steps come out right), its collectives sized but never decoded."""
    from .. import optim
    from ..trace import Tracer

    if algo not in optim.METHODS:
        raise GradzipError(f"unknown method {algo!r}; valid methods: {', '.join(optim.METHODS)}")
    cls = optim.METHODS[algo]
    params = _parameters(shapes)
    grads = [p.grad.clone() for p in params]

    def make():
        group = RecordingGroup(workers, dry=dry)
        opt = cls(params, lr=0.01, comm=group, **options)
        opt.tracer = Tracer()
        return group, opt

    group, opt = make()
    calls, compress, decode, update, sent = [], [], [], [], []
    for i in range(warmup + steps):
        if dry:
            group, opt = make()
            opt.steps = i
        for p, g in zip(params, grads):
            p.grad = g.clone()
        group.calls.clear()
        opt.tracer.events = []
        before, b0 = opt.timings, group.total_bytes()
        t0 = time.perf_counter()
        try:
            opt.step()
        except _DryRun:
            pass
        elapsed = time.perf_counter() - t0
        try:
            getattr(opt, "synchronize", lambda: None)()
        except _DryRun:
            pass
        after = opt.timings
        if i >= warmup:
            calls.append(list(group.calls))
            compress.append(after.compress_s - before.compress_s)
            decode.append(sum(e["dur"] for e in opt.tracer.events if e["name"] == "decode") / 1e6)
            update.append(max(0.0, elapsed - (after.inline_compress_s - before.inline_compress_s)
                              - (after.wait_s - before.wait_s)))
            sent.append(group.total_bytes() - b0)
        if dry:
            pool = getattr(opt, "_pool", None)
            if pool is not None:
                pool.shutdown(wait=True)
    return cls, calls, statistics.fmean(sent), statistics.median(compress), statistics.median(decode), \
        statistics.median(update)


_TIMED: dict = {}  # timing runs by (method, options, shapes, workers, steps, warmup), reused above the cap


def profile_method(algo: str, options: dict[str, Any], shapes: Sequence[tuple[int, ...]], workers: int, *,
                   steps: int = 2, warmup: int = 1, label: str | None = None,
                   time_at_most: int | None = None) -> MethodProfile:
    """Run ``steps`` (after ``warmup``) of method ``algo``'s own ``step()`` on parameters of
    ``shapes`` with random gradients, on a :class:`RecordingGroup` of ``workers``.

    ``time_at_most``: above this worker count, times are measured at that count and the
    collectives sized by a dry run at ``workers`` (no decoding; only the collectives a step
    issues before it first waits for one); decoding time is scaled by the number of packets decoded
    (``n`` for an allgather, 1 for an allreduce)."""
    n_t = workers if time_at_most is None else max(1, min(workers, time_at_most))
    key = (algo, tuple(sorted((k, str(v)) for k, v in options.items())), tuple(map(tuple, shapes)), n_t, steps, warmup)
    if key not in _TIMED:
        _TIMED[key] = _steps(algo, options, shapes, n_t, steps, warmup)
    cls, calls, sent, compress, decode, update = _TIMED[key]
    if n_t != workers:
        gathers_t = any(k == "allgather" for step in calls for k, _ in step)
        _, calls, sent, _, _, _ = _steps(algo, options, shapes, workers, steps, 0, dry=True)
        gathers = any(k == "allgather" for step in calls for k, _ in step)
        scaled = decode * (workers if gathers else 1) / (n_t if gathers_t else 1)
        compress, decode = compress - decode + scaled, scaled
    return MethodProfile(label or algo, workers, bool(getattr(cls, "overlaps_exchange", False)), calls,
                         sent, compress, update, decode, n_t)


# ----------------------------------------------------------------------------- timeline


@dataclass
class Timeline:
    """One steady-state iteration: spans ``(phase, track, start, end)`` and its period."""

    spans: list[tuple[str, str, float, float]] = field(default_factory=list)
    period: float = 0.0


def timeline(compute: float, compress: float, communicate: float, update: float, overlaps: bool) -> Timeline:
    """The event model of one iteration. Without overlap every phase is on the training
    thread, one after the other. With overlap the exchange of step t (compress, then the
    collectives) runs on a background track while step t+1 computes; the next step's
    update waits for both, so the period is ``max(compute, compress + communicate) + update``."""
    t = Timeline()
    if not overlaps:
        clock = 0.0
        for phase, seconds in (("compute", compute), ("compress", compress),
                               ("communicate", communicate), ("update", update)):
            t.spans.append((phase, "main", clock, clock + seconds))
            clock += seconds
        t.period = clock
        return t
    t.spans.append(("compute", "main", 0.0, compute))
    t.spans.append(("compress", "exchange", 0.0, compress))
    t.spans.append(("communicate", "exchange", compress, compress + communicate))
    ready = max(compute, compress + communicate)
    t.spans.append(("update", "main", ready, ready + update))
    t.period = ready + update
    return t


def predict(profile: MethodProfile, compute: float, bandwidth_Bps: float, alpha_s: float,
            codec_scale: float = 1.0) -> dict[str, float]:
    """Predicted phases and iteration time of ``profile`` at ``bandwidth_Bps``; the times
    measured on this machine (codec, update) are multiplied by ``codec_scale``."""
    comm = profile.comm_time(bandwidth_Bps, alpha_s)
    compress, update = profile.compress_s * codec_scale, profile.update_s * codec_scale
    tl = timeline(compute, compress, comm, update, profile.overlaps)
    return {"iteration": tl.period, "compute": compute, "compress": compress, "communicate": comm,
            "update": update}


# ----------------------------------------------------------------------------- models


def resnet50_shapes(num_classes: int = 1000) -> list[tuple[int, ...]]:
    """The parameter tensors of torchvision's ResNet-50 (25,557,032 parameters at 1000
    classes): 7x7 stem, bottleneck stages of 3/4/6/3 blocks, batch-norm weights and biases."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for width, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3)):
        for b in range(blocks):
            shapes += [(width, cin, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,),
                       (4 * width, width, 1, 1), (4 * width,), (4 * width,)]
            if b == 0:
                shapes += [(4 * width, cin, 1, 1), (4 * width,), (4 * width,)]
            cin = 4 * width
    return shapes + [(num_classes, 2048), (num_classes,)]


def model_shapes(model: str, input_shape: Sequence[int], classes: int = 10) -> list[tuple[int, ...]]:
    """Parameter shapes of a harness model (``gradzip.train.models``), or ``resnet50``."""
    if model == "resnet50":
        return resnet50_shapes()
    from ..train import models

    return [tuple(p.shape) for p in models.build(model, tuple(input_shape), classes).parameters()]


# ----------------------------------------------------------------------------- validation


def host_ceilings(measured: dict[str, Any]) -> dict[int, float]:
    """Bytes/s one link carries at most on this host, per worker count: the ring bytes of
    the unshaped runs' check allreduce over its time (none without unshaped runs)."""
    out = {}
    for record in measured["records"]:
        check = record.get("check")
        if record["bandwidth_bps"] is None and check:
            out[record["workers"]] = check["counted_wire_bytes"] / check["measured_s"]
    return out


def validate(measured: dict[str, Any], alpha_s: float, host_Bps: float | None = None) -> list[dict[str, Any]]:
    """Predicted vs measured iteration time for every shaped run of a ``bench net``
    results file. Compute, codec and update come from the run itself (the slowest
    worker's local work per step, mean over steps); the network time from the model,
    with the collectives the method's own ``step()`` issues on a recording group. The link
    rate is capped at ``host_Bps``, by default what an unshaped run of as many workers
    achieved (:func:`host_ceilings`): this host's own limit."""
    settings = measured["settings"]
    shape = [int(s) for s in str(settings["shape"]).lower().split("x")]
    shapes = model_shapes(settings["model"], shape)
    rows, profiles = [], {}
    ceilings = host_ceilings(measured) if host_Bps is None else {}
    for record in measured["records"]:
        if record["bandwidth_bps"] is None or record["workers"] < 2:
            continue
        n = record["workers"]
        bandwidth = record["bandwidth_bps"] / 8
        host = host_Bps or ceilings.get(n)
        if host:
            bandwidth = min(bandwidth, host)
        alpha = alpha_s + record["latency_s"]
        for run in record["runs"]:
            key = (run["method"], tuple(sorted(run["options"].items())), n)
            if key not in profiles:
                profiles[key] = profile_method(run["method"], dict(run["options"]), shapes, n,
                                               steps=5, warmup=0, label=run["algo"])
            prof = profiles[key]
            comm = prof.comm_time(bandwidth, alpha)
            local = run["critical_local_s"]
            if prof.overlaps:
                predicted = max(local, run["hidden_compress_s"] + run.get("hidden_other_s", 0.0) + comm)
            else:
                predicted = local + comm
            rows.append({"workers": n, "bandwidth_bps": record["bandwidth_bps"], "latency_s": record["latency_s"],
                         "algo": run["algo"], "overlaps": prof.overlaps,
                         "measured_s": run["iteration_s"], "predicted_s": predicted,
                         "local_s": local, "communicate_model_s": comm, "model_Bps": bandwidth,
                         "communicate_measured_s": run["communicate_s"],
                         "bytes_measured": run["bytes_per_step"], "bytes_model": prof.wire_bytes_per_step,
                         "error": predicted / run["iteration_s"] - 1})
    return rows


def validation_table(rows: list[dict]) -> str:
    from .net import format_rate

    lines = ["| workers | link | method | measured ms | predicted ms | error | local work ms | network ms (model) | blocked on network ms (measured) | MB / step measured = model |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        same = "yes" if abs(r["bytes_measured"] - r["bytes_model"]) < 1 else f"**no** ({r['bytes_model'] / 1e6:.3f})"
        flag = "" if abs(r["error"]) <= TOLERANCE else " **>15%**"
        lines.append(f"| {r['workers']} | {format_rate(r['bandwidth_bps'])} | `{r['algo']}` | {r['measured_s'] * 1e3:.0f} | "
                     f"{r['predicted_s'] * 1e3:.0f} | {r['error']:+.1%}{flag} | {r['local_s'] * 1e3:.0f} | "
                     f"{r['communicate_model_s'] * 1e3:.0f} | {r['communicate_measured_s'] * 1e3:.0f} | "
                     f"{r['bytes_measured'] / 1e6:.3f} {same} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- projection


def project(algos: Sequence[tuple[str, str | None]], workers: Sequence[int], bandwidths_bps: Sequence[float],
            compute_s: float, alpha_s: float, codec_scale: float = 1.0, shapes=None, steps: int = 5,
            log=None, time_at_most: int | None = 8) -> list[dict[str, Any]]:
    """Predicted iteration time of each method for every (workers, bandwidth)."""
    shapes = shapes or resnet50_shapes()
    rows = []
    for n in workers:
        for algo, codec in algos:
            options = {"compressor": codec} if codec else {}
            label = algo + (f"@{codec}" if codec else "")
            if log:
                log(f"[bench model] profiling {label} for {n} workers ...", file=sys.stderr)
            prof = profile_method(algo, options, shapes, n, steps=steps, warmup=0, label=label,
                                  time_at_most=time_at_most)
            for bw in bandwidths_bps:
                p = predict(prof, compute_s, bw / 8, alpha_s, codec_scale)
                rows.append({"workers": n, "bandwidth_bps": bw, "algo": label, "overlaps": prof.overlaps,
                             "timed_at": prof.timed_at, "decode_s": prof.decode_s * codec_scale,
                             "wire_bytes_per_step": prof.wire_bytes_per_step, **{f"{k}_s": v for k, v in p.items()}})
    for r in rows:
        base = next(x for x in rows if x["workers"] == r["workers"] and x["bandwidth_bps"] == r["bandwidth_bps"]
                    and x["algo"] == rows[0]["algo"])
        r["speedup"] = base["iteration_s"] / r["iteration_s"]
    return rows


def projection_table(rows: list[dict]) -> str:
    from .net import format_rate

    algos = list(dict.fromkeys(r["algo"] for r in rows))
    head = " | ".join(f"`{a}` ms (speedup)" for a in algos)
    lines = [f"| workers | link | {head} |", "|---:|---|" + "---:|" * len(algos)]
    keys = list(dict.fromkeys((r["workers"], r["bandwidth_bps"]) for r in rows))
    for n, bw in keys:
        cells = []
        for a in algos:
            r = next(x for x in rows if x["workers"] == n and x["bandwidth_bps"] == bw and x["algo"] == a)
            cells.append(f"{r['iteration_s'] * 1e3:.0f} ({r['speedup']:.2f}×)")
        lines.append(f"| {n} | {format_rate(bw)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def codec_table(rows: list[dict]) -> str:
    seen, lines = set(), ["| method | workers | compress + decode ms (measured here) | update ms | MB on the wire / step / worker | overlaps exchange |",
                          "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        key = (r["algo"], r["workers"])
        if key in seen:
            continue
        seen.add(key)
        lines.append(f"| `{r['algo']}` | {r['workers']} | {r['compress_s'] * 1e3:.0f} | {r['update_s'] * 1e3:.0f} | "
                     f"{r['wire_bytes_per_step'] / 1e6:.2f} | {'yes' if r['overlaps'] else 'no'} |")
    return "\n".join(lines)


def plot_projection(rows: list[dict], path_prefix: str) -> list[Path]:
    """Two PNGs: against worker count (one panel per bandwidth) and against bandwidth
    (one panel per worker count); iteration time on top, speedup over S-SGD below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.8, 4.4))
    for algo in dict.fromkeys(r["algo"] for r in rows):
        sel = [r for r in rows if r["algo"] == algo]
        ax.scatter([r["measured_s"] * 1e3 for r in sel], [r["predicted_s"] * 1e3 for r in sel], label=algo, s=18)
    top = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.3
    low = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 / 1.3
    ax.plot([low, top], [low, top], color="gray", lw=0.8)
    ax.fill_between([low, top], [low * 0.85, top * 0.85], [low * 1.15, top * 1.15], color="gray", alpha=0.15,
                    label="±15%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import NullFormatter, ScalarFormatter

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--measured", metavar="RESULTS",
                   help="a `gradzip bench net` results.json to validate against (default: none)")
    p.add_argument("--alpha-us", type=float, default=None,
                   help="per-message latency alpha in microseconds (default: 100 for the validation, "
                        "i.e. gloo over veth; 10 for the projection)")
    p.add_argument("--host-gbit", type=float, default=None,
                   help="cap on one link's throughput set by this host (validation only; default: none)")
    p.add_argument("--algos", default=None,
                   help="methods to project, METHOD[@CODEC] (default: ssgd,efsgd@topk:ratio=0.01,bitsgd, "
                        "plus cdsgd when it is registered)")
    p.add_argument("--workers", default="8,16,32,64,128,256", help="projection worker counts (default: %(default)s)")
    p.add_argument("--bandwidth", default="10gbit,25gbit,56gbit,100gbit", help="projection link rates (default: %(default)s)")
    p.add_argument("--compute-ms", type=float, default=100.0,
                   help="compute (forward + backward) per iteration in the projection (default: %(default)s, "
                        "about ResNet-50 at batch 32 on a V100)")
    p.add_argument("--local-scale", dest="codec_scale", type=float, default=1.0,
                   help="multiply the codec and update times measured on this machine's CPU (e.g. 0.1 for "
                        "an accelerator 10x faster at them; default: %(default)s)")
    p.add_argument("--profile-steps", type=int, default=5,
                   help="steps of each method profiled per worker count (a period of CD-SGD's k=5; "
                        "default: %(default)s)")
    p.add_argument("--profile-max-workers", type=int, default=8,
                   help="measure codec times at most at this worker count; above it, decoding is scaled "
                        "by the packets decoded (default: %(default)s)")
    p.add_argument("--model", default="resnet50",
                   help="parameter shapes for the projection: resnet50 (25.6M) or a harness model name "
                        "with --shape (default: %(default)s)")
    p.add_argument("--shape", default="3x224x224", help="input shape for a harness --model (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads while profiling codecs (default: %(default)s)")
    p.add_argument("--no-projection", action="store_true", help="only the validation")
    p.add_argument("--plots", default="docs/bench", help="PNG path prefix (default: %(default)s)")
    p.add_argument("--out", default="runs/bench-model.json", help="predictions as JSON (default: %(default)s)")
    p.add_argument("--write", action="store_true", help="update docs/benchmarks.md's model sections")


def default_algos() -> str:
    from .. import optim

    return "ssgd,efsgd@topk:ratio=0.01,bitsgd" + (",cdsgd" if "cdsgd" in optim.METHODS else "")


def main(args, argv: list[str] | None = None) -> int:
    from .net import _ints, parse_algos, parse_rate

    if args.profile_steps < 1:
        raise GradzipError(f"--profile-steps must be >= 1, got {args.profile_steps}")
    if args.profile_max_workers < 1:
        raise GradzipError(f"--profile-max-workers must be >= 1, got {args.profile_max_workers}")
    for name, value in (("--compute-ms", args.compute_ms), ("--local-scale", args.codec_scale)):
        if not (value >= 0 and math.isfinite(value)):
            raise GradzipError(f"{name} must be a finite number >= 0, got {value}")
    if args.alpha_us is not None and not args.alpha_us >= 0:
        raise GradzipError(f"--alpha-us must be >= 0, got {args.alpha_us}")
    if args.host_gbit is not None and not args.host_gbit > 0:
        raise GradzipError(f"--host-gbit must be > 0, got {args.host_gbit}")
    if args.threads < 1:
        raise GradzipError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    command = "gradzip bench model " + " ".join(argv if argv is not None else sys.argv[3:])
    result: dict[str, Any] = {"command": command}
    if args.measured:
        path = Path(args.measured)
        if not path.exists():
            raise GradzipError(f"--measured {path}: no such file; run `gradzip bench net` first")
        measured = json.loads(path.read_text())
        alpha = (100.0 if args.alpha_us is None else args.alpha_us) * 1e-6
        rows = validate(measured, alpha, args.host_gbit * 1e9 / 8 if args.host_gbit else None)
        result["validation"] = rows
        result["validation_alpha_s"] = alpha
        print("### Model vs emulated network\n")
        print(validation_table(rows) + "\n")
        within = sum(abs(r["error"]) <= TOLERANCE for r in rows)
        print(f"{within} of {len(rows)} predictions within {TOLERANCE:.0%} of the measured iteration time\n")
        if rows:
            result["validation_plot"] = str(plot_validation(rows, f"{args.plots}_model_validation.png"))
    if not args.no_projection:
        algos = parse_algos(args.algos or default_algos())
        workers = _ints(args.workers, "--workers", 1)
        bws = [parse_rate(b) for b in args.bandwidth.split(",") if b.strip()]
        if any(b is None for b in bws):
            raise GradzipError("--bandwidth for the projection needs finite rates")
        shapes = resnet50_shapes() if args.model == "resnet50" else model_shapes(
            args.model, [int(s) for s in args.shape.split("x")])
        alpha = (10.0 if args.alpha_us is None else args.alpha_us) * 1e-6
        rows = project(algos, workers, bws, args.compute_ms / 1e3, alpha, args.codec_scale, shapes, log=print,
                       time_at_most=args.profile_max_workers, steps=args.profile_steps)
        result["projection"] = rows
        result["projection_settings"] = {"model": args.model, "parameters": sum(math.prod(s) for s in shapes),
                                         "compute_s": args.compute_ms / 1e3, "alpha_s": alpha,
                                         "codec_scale": args.codec_scale, "threads": args.threads,
                                         "profile_max_workers": args.profile_max_workers,
                                         "profile_steps": args.profile_steps}
        print("### Projection\n")
        print(codec_table(rows) + "\n")
        print(projection_table(rows) + "\n")
        result["projection_plots"] = [str(p) for p in plot_projection(rows, f"{args.plots}_projection")]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}" + "".join(f", {p}" for p in result.get("projection_plots", [])))
    if args.write:
        from .report import write_model_sections

        write_model_sections(result, measured if args.measured else None)
    return 0
