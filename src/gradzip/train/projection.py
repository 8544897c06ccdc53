"""Where compression wins: the time per epoch a finished run would take on a real network.

On loopback every codec costs more than the bytes it saves. :func:`project_runs` takes what
a run measured — its compute, codec and update seconds per step (mean over workers; the
median over the epochs after the first, :func:`steady_times`) and its bytes — and feeds them to the timeline model of ``gradzip bench model``
(:func:`gradzip.bench.timeline.timeline`, :mod:`gradzip.bench.costs`): the network time of
the collectives the method issues per step at ``n`` workers (recorded by
:func:`gradzip.bench.profiling.profile_method` on the run's parameter shapes) at each link
rate, scaled so that at the run's own worker count the modelled bytes per step equal the
bytes the run sent (periodic methods: the whole run's mean). Codec time at another worker
count is scaled as the profile's (decoding grows with ``n`` for an allgather). An epoch at
``n`` workers is ``training_samples // n // batch_size`` iterations (the same per-worker
batch: weak scaling). The speed-up is over the projection of the run's plain S-SGD, or,
without one, over S-SGD modelled with this run's compute and update times.

An auto:<codec> run (docs/algorithms.md §Auto codec choice) is profiled with ``link=`` each
projected rate, so the profile executes what auto would decide on that link (its coding costs
probed on this machine), and its bytes are that decision's, not rescaled to the run's; the
row says how many of the exchange's units auto compresses there (``auto``).

These are projections, not measurements: the printed table and the plot say so.
"""
from __future__ import annotations

import statistics
from typing import Any, Sequence

from ..bench.profiling import profile_method
from ..bench.timeline import backward_period, overlapped_period, timeline
from ..bench.units import format_rate
from ..errors import GradzipError
from ..planner import Link

#: Per-message latency of the projection (a data-centre link; ``gradzip bench model``'s default).
ALPHA_S = 10e-6
#: What the main job projects to when no ``--bandwidth`` is given.
DEFAULT_BANDWIDTHS = "100mbit,1gbit,10gbit"
#: Steps of each method profiled for its collectives (two periods of CD-SGD's default k=5).
PROFILE_STEPS = 10


def is_plain_ssgd(summary: dict[str, Any]) -> bool:
    """The uncompressed S-SGD run (the speed-ups' basis)."""
    return summary.get("method") == "ssgd" and summary.get("options", {}).get("compressor", "none") == "none"


def steady_times(summary: dict[str, Any], history: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Seconds per step of each phase (compute, compress, update; mean over workers): the
    median over the run's epochs after the first (which holds the codecs' one-time
    compilation and warm-up), or the whole run's mean where it has one epoch."""
    epochs = [h for h in history if h.get("time_compute_s") is not None]
    later = epochs[1:] or None
    out = {}
    for phase in ("compute", "compress", "update"):
        if later is None:
            out[phase] = summary[f"time_{phase}_s"] / max(summary["steps"], 1)
            continue
        per_step = [h[f"time_{phase}_s"] / max(h["step"] - prev["step"], 1) for prev, h in zip(epochs, epochs[1:])]
        out[phase] = statistics.median(per_step)
    return out


def _profile(algo: str, options: dict[str, Any], shapes, n: int, timed_at: int, cache: dict):
    """The method's profile at ``n`` workers (codec times measured at ``timed_at``), once per call
    of :func:`project_runs`."""
    key = (algo, tuple(sorted((k, str(v)) for k, v in options.items())), tuple(map(tuple, shapes)), n, timed_at)
    if key not in cache:
        cache[key] = profile_method(algo, options, shapes, n, steps=PROFILE_STEPS, warmup=0, time_at_most=timed_at)
    return cache[key]


def is_auto(options: dict[str, Any]) -> bool:
    """Whether a method's options choose a codec by cost (``auto:<codec>``) for any exchange."""
    return any(isinstance(v, str) and v.startswith("auto:") for v in options.values())


def _period(summary: dict[str, Any], times: dict[str, float], n: int, bandwidth_Bps: float, alpha_s: float,
            shapes, algo: str, options: dict[str, Any], compress_s: float, cache: dict) -> dict[str, Any]:
    """One projected iteration of ``algo`` at ``n`` workers with the run's measured
    compute and update ``times`` (per step) and codec seconds ``compress_s``."""
    run_n = summary["workers"]
    auto = is_auto(options)
    if auto:   # what auto decides on this link (module docstring)
        options = {**options, "link": Link(bandwidth_Bps, alpha_s)}
    here = _profile(algo, options, shapes, run_n, run_n, cache)
    there = here if n == run_n else _profile(algo, options, shapes, n, run_n, cache)
    measured_bytes = (summary["bytes_sent_per_worker"] / max(summary["steps"], 1)
                      if algo == summary["method"] and not auto else None)
    scale = measured_bytes / here.wire_bytes_per_step if measured_bytes and here.wire_bytes_per_step else 1.0
    communicate = there.comm_time(bandwidth_Bps, alpha_s) * scale
    if here.compress_s > 0:
        compress_s *= there.compress_s / here.compress_s
    if there.overlaps_backward and not there.overlaps:   # the exchange starts during backward
        period = backward_period(there, times["compute"], compress_s, times["update"],
                                 there.bucket_costs(bandwidth_Bps, alpha_s), scale=scale)
    elif there.overlaps:   # per step: the max of compute and that step's exchange
        period = overlapped_period(times["compute"], compress_s, [c * scale for c in there.comm_times(bandwidth_Bps, alpha_s)],
                                   times["update"])
    else:
        period = timeline(times["compute"], compress_s, communicate, times["update"], False).period
    return {"iteration_s": period, "compute_s": times["compute"], "compress_s": compress_s,
            "communicate_s": communicate, "update_s": times["update"], "overlaps": there.overlaps,
            **({"auto": there.auto_choices} if auto else {})}


def project_runs(runs: Sequence[dict[str, Any]], bandwidths_bps: Sequence[float],
                 workers_at: Sequence[int] | None = None, alpha_s: float = ALPHA_S) -> list[list[dict[str, Any]]]:
    """For every run (``{"summary", "history"}`` of ``gradzip train`` / ``compare``), its
    projections: one dict per (worker count, link rate) with the projected ``epoch_s``,
    ``iteration_s``, its phases and ``speedup`` over S-SGD. ``workers_at`` defaults to
    each run's own count."""
    if any(not (b and b > 0) for b in bandwidths_bps):
        raise GradzipError("--bandwidth for the projection needs finite rates > 0, e.g. 1gbit,10gbit")
    times = [steady_times(r["summary"], r["history"]) for r in runs]
    cache: dict = {}
    base = next(((r["summary"], t) for r, t in zip(runs, times) if is_plain_ssgd(r["summary"])), None)
    out = []
    for run, own in zip(runs, times):
        s = run["summary"]
        if "parameter_shapes" not in s or "training_samples" not in s:
            raise GradzipError(f"the summary of {s.get('algo')!r} lacks parameter_shapes / training_samples "
                               "(written by an older gradzip); rerun it to project it")
        shapes = [tuple(x) for x in s["parameter_shapes"]]
        rows = []
        for n in (workers_at or [s["workers"]]):
            steps = s["training_samples"] // n // s["batch_size_per_worker"]
            for bw in bandwidths_bps:
                p = _period(s, own, n, bw / 8, alpha_s, shapes, s["method"], dict(s.get("options", {})),
                            own["compress"], cache)
                if base is not None:
                    b = _period(base[0], base[1], n, bw / 8, alpha_s, shapes, "ssgd", {}, base[1]["compress"], cache)
                    basis = "the S-SGD run"
                else:
                    b = _period(s, own, n, bw / 8, alpha_s, shapes, "ssgd", {}, 0.0, cache)
                    basis = "S-SGD modelled with this run's compute and update times"
                rows.append({"workers": n, "bandwidth_bps": bw, "alpha_s": alpha_s, "steps_per_epoch": steps,
                             "epoch_s": steps * p["iteration_s"], **p,
                             "speedup": b["iteration_s"] / p["iteration_s"] if p["iteration_s"] > 0 else None,
                             "speedup_over": basis})
        out.append(rows)
    return out


def column(row: dict[str, Any]) -> str:
    """The table header of one projection: ``proj. s/epoch 1 Gbit/s x4``."""
    return f"proj. s/epoch {format_rate(row['bandwidth_bps'])} x{row['workers']}"


def cell(row: dict[str, Any]) -> str:
    """``"12.3 (2.1x)"``: projected seconds per epoch and the speed-up over S-SGD; an
    auto:<codec> run adds how many of its units auto compresses on that link (``auto 3/5``)."""
    speed = "" if row.get("speedup") is None else f" ({row['speedup']:.2f}x)"
    chosen = row.get("auto")
    auto = "" if chosen is None else f" auto {sum(c != 'none' for c in chosen)}/{len(chosen)}"
    return f"{row['epoch_s']:.3g}{speed}{auto}"
