"""The training-step phases of the device suite (:mod:`benchmarks.gpu_suite`): what a step
costs on one GPU, for the timeline model and the step-overhead table.

* :func:`measure_compute`: ResNet-50 (torchvision), bf16 autocast, channels-last, forward and
  forward + backward at batch 32 and 128 on 224×224 images (the compute the timeline
  model needs; ``gradzip bench model --compute-s``).
* :func:`measure_methods`: each method of :data:`METHODS` on ResNet-50 at batch 32: the
  median time of a whole step (zero_grad, forward, backward, ``step()``) minus the same
  step with ``torch.optim.SGD`` (no exchange): the method's overhead on one GPU, with world
  size 1 over NCCL (in this process), and with 2 ranks of gloo over CUDA tensors (two
  processes sharing the GPU: gloo carries the CUDA tensors through the host).
* :func:`measure_cdsgd`: CD-SGD's step under ``torch.profiler`` (world size 1): its exchange
  (compress, decompress, the global update) runs on a side stream while the next step's
  forward and backward run; the trace (DIR/cdsgd_trace.json.gz, for ui.perfetto.dev) and
  the share of the side stream's kernel time that overlaps the main stream's.

A dry run (CPU) uses a small CNN at batch 2 and 4 on 32×32 images, two methods, gloo.
"""
from __future__ import annotations

import gzip
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gradzip.comm import init_from_env
from gradzip.comm.launch import free_port, run_processes
from gradzip.optim import METHODS as ALGOS

#: (label, algorithm, options) of the step-overhead table; compressed stages from step 2.
METHODS = (("ssgd", "ssgd", {}),
           ("efsgd topk 1%", "efsgd", {"compressor": "topk:ratio=0.01"}),
           ("efsgd scaled_sign", "efsgd", {"compressor": "scaled_sign"}),
           ("efsgd 1bit", "efsgd", {"compressor": "1bit"}),
           ("bitsgd", "bitsgd", {}),
           ("ssgd qsgd", "ssgd", {"compressor": "qsgd"}),
           ("ssgd terngrad", "ssgd", {"compressor": "terngrad"}),
           ("ssgd randomk 1%", "ssgd", {"compressor": "randomk:ratio=0.01,unbiased=true"}),
           ("dgc", "dgc", {}),
           ("powersgd", "powersgd", {"start_iter": 2}),
           ("cdsgd", "cdsgd", {}),
           ("cser", "cser", {}),
           ("onebitadam", "onebitadam", {"freeze_step": 2}))
DRY_METHODS = METHODS[:2]
LR = 0.01
_group: list = []   # the world-size-1 group of this process, made once


def _model(dry: bool, device: str) -> torch.nn.Module:
    """The model, initialised from seed 0 (every rank the same replica)."""
    torch.manual_seed(0)
    if dry:
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                                    torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
                                    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10))
        return model.to(device)
    import torchvision
    return torchvision.models.resnet50().to(device, memory_format=torch.channels_last)


def _batch(dry: bool, batch: int, device: str, seed: int = 0):
    side, classes = (32, 10) if dry else (224, 1000)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, side, side, generator=g).to(device)
    if not dry:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, torch.randint(classes, (batch,), generator=g).to(device)


def _step(model, opt, x, y, device: str, backward: bool = True) -> None:
    if opt is not None:
        opt.zero_grad(set_to_none=False)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    if backward:
        loss.backward()
    if opt is not None:
        opt.step()


def _timed(fn, device: str, steps: int, warmup: int) -> float:
    """Median seconds of ``fn()`` (host clock from the main stream idle to the main stream
    idle: a step is many kernels and host work, as the training loop sees it; a side
    stream, CD-SGD's exchange, may still run, as it does in training)."""
    times = []
    for i in range(warmup + steps):
        if device == "cuda":
            torch.cuda.current_stream().synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.current_stream().synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_compute(settings) -> list[dict]:
    """Forward and forward + backward times per batch size (bf16 autocast)."""
    model = _model(settings.dry, settings.device)
    rows = []
    for batch in ((2, 4) if settings.dry else (32, 128)):
        x, y = _batch(settings.dry, batch, settings.device)
        with torch.no_grad():
            fwd = _timed(lambda: _step(model, None, x, y, settings.device, backward=False), settings.device,
                         settings.repeat, settings.warmup)
        both = _timed(lambda: _step(model, None, x, y, settings.device), settings.device, settings.repeat,
                      settings.warmup)
        model.zero_grad(set_to_none=True)
        rows.append({"model": "cnn" if settings.dry else "resnet50", "batch": batch, "forward_ms": fwd * 1e3,
                     "forward_backward_ms": both * 1e3, "images_per_s": batch / both})
    return rows


def step_overheads(comm, dry: bool, device: str, batch: int, steps: int, warmup: int, deadline: float) -> dict:
    """Per method of the table: median step seconds, and the plain SGD step's under ``"sgd"``;
    methods past ``deadline`` (``time.time()``) are recorded as skipped."""
    model = _model(dry, device)
    x, y = _batch(dry, batch, device, seed=comm.rank)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, Any] = {"sgd": _timed(lambda: _step(model, sgd, x, y, device), device, steps, warmup)}
    del sgd
    for label, algo, options in (DRY_METHODS if dry else METHODS):
        if time.time() > deadline:
            out[label] = "skipped: budget"
            continue
        try:
            model = _model(dry, device)   # every rank the same replica again (the SGD steps moved them apart)
            opt = ALGOS[algo](model.parameters(), lr=LR, comm=comm, **options)
            out[label] = _timed(lambda: _step(model, opt, x, y, device), device, steps, warmup)
            getattr(opt, "synchronize", lambda: None)()
            getattr(opt, "close", lambda: None)()
            del opt
        except Exception as exc:   # recorded: one method's failure does not hide the others'
            out[label] = f"error: {type(exc).__name__}: {exc}"[:300]
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def _world_of_one():
    """This process's group of one rank (NCCL for CUDA tensors where CUDA is; gloo otherwise)."""
    if not _group:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        _group.append(init_from_env())
    return _group[0]


def _two_rank_worker(comm, dry: bool, steps: int, warmup: int, deadline: float) -> dict:
    device = "cpu" if dry else "cuda"
    return step_overheads(comm, dry, device, 2 if dry else 32, steps, warmup, deadline)


def measure_methods(settings, left_s: float) -> dict:
    """Step overheads with world size 1 (this process) and 2 gloo ranks (two processes)."""
    batch = 2 if settings.dry else 32
    steps, warmup = (2, 1) if settings.dry else (8, 3)
    deadline = time.time() + 0.45 * left_s
    one = step_overheads(_world_of_one(), settings.dry, settings.device, batch, steps, warmup, deadline)
    deadline = time.time() + 0.9 * (left_s - (time.time() - (deadline - 0.45 * left_s)))
    try:
        two = run_processes(2, _two_rank_worker, settings.dry, 2 if settings.dry else 5, 1 if settings.dry else 2,
                            deadline, timeout_s=max(60.0, left_s))
        slowest = {k: max(r[k] for r in two) if all(isinstance(r[k], float) for r in two) else two[0][k]
                   for k in two[0]}
    except Exception as exc:
        slowest = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"batch": batch, "world_1": one, "gloo_2": slowest,
            "transport_1": "nccl" if settings.device == "cuda" else "gloo"}


def measure_cdsgd(settings, out: Path) -> dict:
    """CD-SGD's side-stream exchange against the next step's compute: the kernel lanes of a
    profiler trace (CUDA streams), and the host spans of gradzip's own tracer (the exchange
    thread against the training thread's forward + backward)."""
    from torch.profiler import ProfilerActivity, profile
    from gradzip.trace import Tracer
    device = settings.device
    model = _model(settings.dry, device)
    x, y = _batch(settings.dry, 2 if settings.dry else 32, device)
    opt = ALGOS["cdsgd"](model.parameters(), lr=LR, comm=_world_of_one())
    for _ in range(3 if settings.dry else 7):   # past the full-precision step (k = 5)
        _step(model, opt, x, y, device)
    opt.tracer = tracer = Tracer()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            opt.zero_grad(set_to_none=False)
            with tracer.span("compute"):
                _step(model, None, x, y, device)
                if device == "cuda":
                    torch.cuda.current_stream().synchronize()
            opt.step()
        opt.synchronize()
        if device == "cuda":
            torch.cuda.synchronize()
    raw = out / "cdsgd_trace.raw.json"
    prof.export_chrome_trace(str(raw))
    events = json.loads(raw.read_text()).get("traceEvents", []) + tracer.events
    with gzip.open(out / "cdsgd_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    raw.unlink()
    getattr(opt, "close", lambda: None)()
    spans = [e for e in tracer.events if e["tid"] != "MainThread" or e["name"] == "compute"]
    result = {"trace": "cdsgd_trace.json.gz", "host": overlap(spans, "phase", main="MainThread")}
    if device == "cuda":
        result["kernels"] = overlap(events, "kernel")
    return result


def overlap(events: list[dict], category: str, main: Any = None) -> dict:
    """Busy time per lane (CUDA stream for ``kernel`` events, else the thread) of a trace's
    ``category`` events; the main lane is ``main`` (default: the busiest); ``side_overlap``
    = the share of the other lanes' busy time during which the main lane is busy too."""
    lanes: dict[Any, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") == category and e.get("ph") == "X":
            key = e.get("args", {}).get("stream", e.get("tid")) if category == "kernel" else e.get("tid")
            lanes.setdefault(key, []).append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
    if not lanes:
        return {"lanes": 0, "side_overlap": None}
    merged = {k: _union(v) for k, v in lanes.items()}
    busy = {k: sum(b - a for a, b in v) for k, v in merged.items()}
    main = main if main in busy else max(busy, key=busy.get)
    side = [iv for k, v in merged.items() if k != main for iv in v]
    side_busy = sum(b - a for a, b in _union(side))
    both = sum(max(0.0, min(b, d) - max(a, c)) for a, b in _union(side) for c, d in merged[main])
    return {"lanes": len(lanes), "main_busy_ms": busy[main] / 1e3, "side_busy_ms": side_busy / 1e3,
            "side_overlap": both / side_busy if side_busy else None}


def _union(intervals):
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def markdown(result: dict) -> list[str]:
    """The training-step tables of the docs section."""
    lines: list[str] = []
    compute = result.get("compute")
    if isinstance(compute, list) and compute:
        lines += ["**Compute** (bf16 autocast, channels-last; median of a step):", "",
                  "| model | batch | forward ms | forward + backward ms | images/s |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['model']} | {r['batch']} | {r['forward_ms']:.1f} | {r['forward_backward_ms']:.1f} | "
                  f"{r['images_per_s']:.0f} |" for r in compute]
        lines.append("")
    methods = result.get("methods")
    if isinstance(methods, dict) and "world_1" in methods:
        one, two = methods["world_1"], methods.get("gloo_2", {})
        lines += [f"**Step overhead** over a plain SGD step at batch {methods['batch']} (ms; world size 1 over "
                  f"{methods['transport_1']}, and 2 gloo ranks over CUDA tensors on the one GPU):", "",
                  "| method | step ms (1 rank) | overhead ms (1 rank) | step ms (2 gloo ranks) | overhead ms |",
                  "|---|---:|---:|---:|---:|"]
        for label in (k for k in one if k != "sgd"):
            lines.append(f"| {label} | {_ms(one.get(label))} | {_ms(one.get(label), one.get('sgd'))} | "
                         f"{_ms(two.get(label))} | {_ms(two.get(label), two.get('sgd'))} |")
        lines.append(f"| (plain SGD) | {_ms(one.get('sgd'))} | | {_ms(two.get('sgd'))} | |")
        lines.append("")
    cd = result.get("cdsgd")
    if isinstance(cd, dict) and "host" in cd:
        parts = []
        for view, what in (("kernels", "CUDA kernels: side stream vs main stream"),
                           ("host", "host spans: the exchange thread vs the training thread's compute")):
            r = cd.get(view)
            if r and r.get("side_overlap") is not None:
                parts.append(f"{r['side_overlap']:.0%} of {r['side_busy_ms']:.1f} ms ({what})")
        lines += [f"**CD-SGD overlap** (3 profiled steps; trace {cd['trace']}): "
                  f"{'; '.join(parts) or 'no side lane seen'} overlaps the next step's compute.", ""]
    return lines


def _ms(value, base=None) -> str:
    if not isinstance(value, float):
        return "—" if value is None else str(value).split(":")[0]
    if base is not None:
        return f"{(value - base) * 1e3:.1f}" if isinstance(base, float) else "—"
    return f"{value * 1e3:.1f}"
