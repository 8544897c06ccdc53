"""The timeline model of one training iteration per method, its validation against the
emulated network and its projection to large clusters.

**Iteration** (:func:`timeline`): the spans of one steady-state iteration on two tracks
(the training thread, a background exchange); its period is

* ``compute + compress + communicate + update`` for a method that exchanges inside
  ``step()`` (local SGD, PowerSGD, any method with ``overlap_backward=False``, ...);
* ``forward + max(backward end, last bucket done) + decode + update`` for one whose
  exchange starts during backward (``overlap_backward``: S-SGD, EF-SGD, BIT-SGD, CSEA,
  DGC, CSER's gradient exchange; :func:`backward_timeline`, :func:`backward_period`);
* ``max(compute, compress + communicate) + update`` for one that overlaps the exchange
  with the next step's computation (``overlaps_exchange``: OD-SGD, CD-SGD): the max, not
  the sum, taken per step and then averaged (:func:`overlapped_period`).

The network time is the alpha-beta model of :mod:`gradzip.bench.costs`, applied to the
collectives the method's own ``step()`` issues (:mod:`gradzip.bench.profiling`).

:func:`validate` compares the model with a ``gradzip bench net`` results file: compute,
codec and update times are the ones measured in those very runs (the slowest worker's,
per step), the network time is the model's; the prediction should be within
:data:`TOLERANCE` of the measured iteration. :func:`project` predicts the iteration time of
each method for many worker counts and link rates (a ResNet-50-sized model by default,
:mod:`gradzip.bench.shapes`) with codec times measured on this machine. Both return rows
(dicts); rendering them is the caller's (``gradzip bench model``, ``benchmarks/``).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..train.stragglers import Straggler
from ..train.config import method_label
from .profiling import MethodProfile, profile_method
from .shapes import model_shapes, resnet50_shapes

#: Predicted iteration time must be within this fraction of the measured one.
TOLERANCE = 0.10   # issue 15: the model within 10% of the emulated runs
#: Bytes/s of a link inside a node (veth to the node's bridge, unshaped) when the results
#: hold no unshaped run to measure this host's ceiling: 10 Gbit/s.
INTRA_BPS = 10e9 / 8


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


#: Share of the compute (forward + backward) that is backward: backward costs about twice
#: the forward's FLOPs (a gradient for the input and one for the weights per layer).
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class Bucket:
    """One bucket of an exchange that starts during backward (:mod:`gradzip.optim.core.overlap`),
    in launch order (reverse parameter order). ``share``: the fraction of backward's time
    spent on its parameters' gradients; ``compress``: encoding seconds, run by the gradient
    hook on the training thread (it delays the rest of backward); ``communicate``: seconds
    on the link; ``decode``: seconds in ``step()`` once its collective completed."""

    share: float
    compress: float
    communicate: float
    decode: float = 0.0


def backward_timeline(forward: float, backward: float, buckets: Sequence[Bucket], update: float,
                      tail: float = 0.0) -> Timeline:
    """The event model of one iteration of a method whose exchange starts during backward
    (``overlap_backward``). Track ``main``: forward, then per bucket its share of backward
    and its encoding (the hook's); when that is done the bucket's collective joins the
    ``link`` track, which carries one collective at a time in launch order (FIFO, as one
    process group does). ``step()`` then decodes each bucket once its collective is done,
    runs ``tail`` (the step's other exchanges and collectives, e.g. CSER's error reset,
    in sequence) and the update. So the period is ``forward + max(backward end, last
    bucket done) + decode + tail + update`` with the buckets' communication hidden behind
    the rest of backward as far as the link keeps up: one bucket = no overlap (the
    sequential sum); many small buckets on a fast link = only the last bucket's
    communication shows."""
    t = Timeline()
    clock, link, done = forward, 0.0, []
    t.spans.append(("forward", "main", 0.0, forward))
    for b in buckets:
        for phase, seconds in (("backward", b.share * backward), ("compress", b.compress)):
            t.spans.append((phase, "main", clock, clock + seconds))
            clock += seconds
        start = max(clock, link)
        link = start + b.communicate
        t.spans.append(("communicate", "link", start, link))
        done.append(link)
    rest = backward * (1.0 - sum(b.share for b in buckets))   # backward not covered by a bucket
    if rest > 0:
        t.spans.append(("backward", "main", clock, clock + rest))
        clock += rest
    for b, ready in zip(buckets, done):
        clock = max(clock, ready)
        t.spans.append(("decode", "main", clock, clock + b.decode))
        clock += b.decode
    for phase, seconds in (("tail", tail), ("update", update)):
        t.spans.append((phase, "main", clock, clock + seconds))
        clock += seconds
    t.period = clock
    return t


def overlapped_period(compute: float, compress: float, communicate: Sequence[float], update: float) -> float:
    """Mean period over the profiled steps of a method that overlaps its exchange with the
    next step (:func:`timeline` with ``overlaps``), one step per network time in
    ``communicate``: the max is taken per step, so a periodic exchange (CD-SGD's
    full-precision step every k) that outlasts one step's compute costs what it does in
    that step, which the max of the means would hide."""
    return statistics.fmean(timeline(compute, compress, c, update, True).period for c in communicate)


def backward_period(profile: MethodProfile, compute: float, compress: float, update: float,
                    parts: Sequence[dict[str, Any]], wait: float = 0.0, scale: float = 1.0) -> float:
    """Mean period of :func:`backward_timeline` over profiled steps (``parts``:
    :meth:`MethodProfile.bucket_costs`, network seconds times ``scale``). ``compute`` is
    split :data:`BACKWARD_SHARE` to backward (``wait``, a straggler's, comes before the
    forward), and backward's time over the buckets in proportion to their elements, as is
    the codec work ``compress`` (its decoding part as in the profile; what the step's
    other exchanges code goes to the ``tail``).

    Assumption: backward time per parameter ∝ its elements (exact for dense layers at a
    fixed batch). A convolution's FLOPs also scale with its output's spatial size, so in a
    CNN the last layers (the first buckets, many parameters on small maps) take less of
    backward than their elements say: their buckets are ready earlier than modelled, and
    the model errs on the side of less overlap."""
    decode = compress * profile.decode_s / profile.compress_s if profile.compress_s > 0 else 0.0
    encode, periods = compress - decode, []
    for part in parts:
        sizes = [elements for elements, _ in part["buckets"]]
        coded = sum(sizes) + part["other_elements"]
        per = (encode / coded, decode / coded) if coded else (0.0, 0.0)
        buckets = [Bucket(n / sum(sizes), n * per[0], seconds * scale, n * per[1])
                   for n, seconds in part["buckets"]]
        tail = part["other_s"] * scale + part["other_elements"] * (per[0] + per[1])
        periods.append(backward_timeline((1 - BACKWARD_SHARE) * compute + wait, BACKWARD_SHARE * compute,
                                         buckets, update, tail).period)
    return statistics.fmean(periods)


def predict(profile: MethodProfile, compute: float, bandwidth_Bps: float, alpha_s: float,
            codec_scale: float = 1.0, transport: str | None = None, hierarchy: int = 1,
            intra_Bps: float | None = None, intra_alpha_s: float = 0.0,
            straggler_wait: float = 0.0) -> dict[str, Any]:
    """Predicted phases and iteration time of ``profile`` at ``bandwidth_Bps``; the times
    measured on this machine (codec, update) are multiplied by ``codec_scale``.
    ``transport`` None: the collectives as recorded; else every PSync exchange priced for
    that transport (``exact``, ``twophase``, ``auto``) and, with ``hierarchy`` = k > 1,
    hierarchically with k workers per node behind one uplink of ``bandwidth_Bps`` and links
    of ``intra_Bps`` inside a node (:meth:`MethodProfile.comm_cost`). Also returns
    ``wire_bytes`` per step and worker and the transports used. ``straggler_wait``: the
    expected synchronous wait ``E[max of K delays]``
    (:meth:`gradzip.train.stragglers.Straggler.expected_wait`), added to the compute: every
    worker's exchange starts when the slowest worker's does."""
    if transport is None:
        comm, wire, uses = profile.comm_time(bandwidth_Bps, alpha_s), profile.wire_bytes_per_step, ["recorded"]
        steps = profile.comm_times(bandwidth_Bps, alpha_s)
        compress = profile.compress_s * codec_scale
    else:
        cost = profile.comm_cost(bandwidth_Bps, alpha_s, transport, hierarchy, intra_Bps, intra_alpha_s)
        comm, wire, uses, steps = cost["seconds"], cost["wire_bytes"], cost["transports"], cost["per_step"]
        compress = profile.codec_time(uses, hierarchy) * codec_scale
    update = profile.update_s * codec_scale
    if profile.overlaps_backward and not profile.overlaps:
        parts = profile.bucket_costs(bandwidth_Bps, alpha_s, transport, hierarchy, intra_Bps, intra_alpha_s)
        period = backward_period(profile, compute, compress, update, parts, straggler_wait)
    elif profile.overlaps:
        period = overlapped_period(compute + straggler_wait, compress, steps, update)
    else:
        period = timeline(compute + straggler_wait, compress, comm, update, profile.overlaps).period
    return {"iteration": period, "compute": compute, "straggler_wait": straggler_wait, "compress": compress,
            "communicate": comm, "update": update, "wire_bytes": wire, "uses": uses}


def host_ceilings(measured: dict[str, Any]) -> dict[int, float]:
    """Bytes/s one link carries at most on this host, per worker count: the ring bytes of
    the unshaped runs' check allreduce over its time (none without unshaped runs)."""
    out = {}
    for record in measured["records"]:
        check = record.get("check")
        if record["bandwidth_bps"] is None and check:
            out[record["workers"]] = check["counted_wire_bytes"] / check["measured_s"]
    return out


def check_rate(record: dict[str, Any]) -> float | None:
    """Bytes/s one link of a shaped topology delivered in its shaping check: the check
    allreduce's ring bytes over its measured time (None without a check). Below the
    shaped rate where ``n`` workers' processes and other jobs contend for the CPUs (the
    ring's steps wait for descheduled peers): the rate this host sustains on these links."""
    check = record.get("check")
    if not check or not check.get("measured_s"):
        return None
    return check["counted_wire_bytes"] / check["measured_s"]


def validate(measured: dict[str, Any], alpha_s: float, host_Bps: float | None = None,
             intra_Bps: float | None = None, calibrate: bool = True) -> list[dict[str, Any]]:
    """Predicted vs measured iteration time for every shaped run of a ``bench net``
    results file. Compute, codec and update come from the run itself (the slowest
    worker's local work per step, mean over steps); the network time from the model,
    with the collectives the method's own ``step()`` issues on a recording group with the
    run's ``transport`` (a method with ``overlap_backward`` on, flat: :func:`backward_period`,
    its codec work in ``step()`` after the buckets). The link rate is capped at ``host_Bps``,
    by default what an unshaped run of as many workers achieved (:func:`host_ceilings`):
    this host's own limit, and with ``calibrate`` at what the topology's own shaping check
    achieved (:func:`check_rate`: one measured rate per topology, the same for every
    method). An overlapping method's period is the mean over the profiled steps (one period
    of a periodic method) of ``max(local, hidden + communicate of that step)``
    (:func:`overlapped_period`'s rule): CD-SGD's full-precision exchange every k steps
    cannot hide behind one step's compute, which a max of the means would pretend.
    A hierarchical run (``workers_per_node`` k > 1) is priced by
    :meth:`MethodProfile.comm_cost` with k workers per node behind the shaped uplink and
    node links of ``intra_Bps`` (default: the host ceiling, else :data:`INTRA_BPS`); its
    bytes are split into the uplink's (``bytes_*``) and the node's (``intra_bytes_*``)."""
    settings = measured["settings"]
    shape = [int(s) for s in str(settings["shape"]).lower().split("x")]
    shapes = model_shapes(settings["model"], shape)
    rows, profiles = [], {}
    ceilings = host_ceilings(measured) if host_Bps is None else {}
    for record in measured["records"]:
        if record["bandwidth_bps"] is None or record["workers"] < 2:
            continue
        n, k = record["workers"], record.get("workers_per_node", 1)
        bandwidth = record["bandwidth_bps"] / 8
        host = host_Bps or ceilings.get(n)
        if host:
            bandwidth = min(bandwidth, host)
        sustained = check_rate(record) if calibrate and k == 1 else None
        if sustained:
            bandwidth = min(bandwidth, sustained)
        alpha = alpha_s + record["latency_s"]
        for run in record["runs"]:
            if run.get("peer"):   # PyTorch's DDP rows: measured for comparison, not modelled
                continue
            transport = run.get("transport", "auto")
            options = dict(run["options"], **({"transport": transport} if transport != "auto" else {}))
            key = (run["method"], tuple(sorted(options.items())), n)
            if key not in profiles:
                profiles[key] = profile_method(run["method"], options, shapes, n,
                                               steps=5, warmup=0, label=run["algo"])
            prof = profiles[key]
            intra_measured = run.get("intra_bytes_per_step", 0.0)
            if k > 1:
                cost = prof.comm_cost(bandwidth, alpha, transport, k, intra_Bps or host or INTRA_BPS, alpha)
                comm, bytes_model, intra_model = cost["seconds"], cost["wire_bytes"], cost["intra_bytes"]
            else:
                comm, bytes_model, intra_model = prof.comm_time(bandwidth, alpha), prof.wire_bytes_per_step, 0.0
            local = run["critical_local_s"]
            if prof.overlaps:   # per step: the k-th step's full-precision exchange may outlast the compute
                hidden = run["hidden_compress_s"] + run.get("hidden_other_s", 0.0)
                predicted = statistics.fmean(max(local, hidden + c) for c in prof.comm_times(bandwidth, alpha))
            elif prof.overlaps_backward and k == 1:   # the hooks' encoding is inside the measured compute
                after = run["compress_s"] + run["update_s"] + run["loop_s"]
                predicted = backward_period(prof, local - after, 0.0, after, prof.bucket_costs(bandwidth, alpha))
            else:
                predicted = local + comm
            rows.append({"workers": n, "workers_per_node": k, "bandwidth_bps": record["bandwidth_bps"],
                         "latency_s": record["latency_s"], "algo": run["algo"], "transport": transport,
                         "overlaps": prof.overlaps,
                         "measured_s": run["iteration_s"], "predicted_s": predicted,
                         "local_s": local, "communicate_model_s": comm, "model_Bps": bandwidth,
                         "communicate_measured_s": run["communicate_s"],
                         "bytes_measured": run["bytes_per_step"] - intra_measured, "bytes_model": bytes_model,
                         "intra_bytes_measured": intra_measured, "intra_bytes_model": intra_model,
                         "error": predicted / run["iteration_s"] - 1})
    return rows


def project(algos: Sequence[tuple[str, str | None]], workers: Sequence[int], bandwidths_bps: Sequence[float],
            compute_s: float, alpha_s: float, codec_scale: float = 1.0, shapes=None, steps: int = 5,
            log: Callable[[str], None] | None = None, time_at_most: int | None = 8,
            transports: Sequence[str | None] = (None,), hierarchy: int = 1,
            intra_bps: float | None = None, straggler: Straggler | None = None,
            bucket_bytes: int | None = None) -> list[dict[str, Any]]:
    """Predicted iteration time of each method for every (workers, bandwidth, transport):
    ``transports`` None (the collectives as the method issues them today), ``exact``,
    ``twophase`` or ``auto`` (:func:`predict`); ``hierarchy`` k > 1 with ``intra_bps``
    links inside a node. Each row says which transports the method's exchanges took
    (``uses``); ``speedup`` is over the first method with the same transport. With a
    ``straggler``, each iteration waits ``E[max of K delays]`` more (K = workers);
    ``bucket_bytes``: every method's (None: their default)."""
    shapes = shapes or resnet50_shapes()
    rows = []
    for n in workers:
        for algo, codec in algos:
            options = {"compressor": codec} if codec else {}
            if bucket_bytes is not None:
                options["bucket_bytes"] = bucket_bytes
            label = method_label(algo, codec)
            if log:
                log(f"[bench model] profiling {label} for {n} workers ...")
            prof = profile_method(algo, options, shapes, n, steps=steps, warmup=0, label=label,
                                  time_at_most=time_at_most)
            wait = straggler.expected_wait(n, compute_s) if straggler is not None else 0.0
            k = hierarchy if n % hierarchy == 0 else 1
            for bw in bandwidths_bps:
                for transport in transports:
                    p = predict(prof, compute_s, bw / 8, alpha_s, codec_scale, transport, k,
                                intra_bps / 8 if intra_bps else None, straggler_wait=wait)
                    rows.append({"workers": n, "bandwidth_bps": bw, "algo": label, "overlaps": prof.overlaps,
                                 "transport": transport or "recorded", "hierarchy": k, "uses": "+".join(p.pop("uses")),
                                 "timed_at": prof.timed_at, "decode_s": prof.decode_s * codec_scale,
                                 "wire_bytes_per_step": p.pop("wire_bytes"), **{f"{k_}_s": v for k_, v in p.items()}})
    for r in rows:
        base = next(x for x in rows if x["workers"] == r["workers"] and x["bandwidth_bps"] == r["bandwidth_bps"]
                    and x["algo"] == rows[0]["algo"] and x["transport"] == r["transport"])
        r["speedup"] = base["iteration_s"] / r["iteration_s"]
    return rows
