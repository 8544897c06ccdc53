"""Where compression wins: the time per epoch a finished run would take on a real network.

On loopback every codec costs more than the bytes it saves. :func:`project_runs` takes what
a run measured — its compute, codec and update seconds per step (mean over workers, over the
steps after each process's warm-up: :func:`steady_times`) and its bytes — and feeds them to the timeline model of ``gradzip bench model``
(:func:`gradzip.bench.timeline.timeline`, :mod:`gradzip.bench.costs`): the network time of
the collectives the method issues per step at ``n`` workers (recorded by
:func:`gradzip.bench.profiling.profile_method` on the run's parameter shapes) at each link
rate, scaled so that at the run's own worker count the modelled bytes per step equal the
bytes the run sent (periodic methods: the whole run's mean). Codec time at another worker
count is scaled as the profile's (decoding grows with ``n`` for an allgather). An epoch at
``n`` workers is ``training_samples // n // batch_size`` iterations (the same per-worker
batch: weak scaling). The speed-up is over the projection of the run's plain S-SGD, or,
without one, over S-SGD modelled with this run's compute and update times. A method the
profile cannot run (A-SGD: :class:`~gradzip.bench.profiling.Unprofilable`) is not projected;
its summary says why instead.

An auto:<codec> run (docs/algorithms.md §Auto codec choice) is profiled with ``link=`` each
projected rate, so the profile executes what auto would decide on that link (its coding costs
probed on this machine), and its bytes are that decision's (the profile's); its codec seconds
are the run's measured ones scaled, as a fixed codec's are, by the profile's ratio of that
decision's coding to the coding of the decision the run executed (its summary's
``auto_choices``: nothing compressed, every unit, or the rule on the run's own link,
``auto_link``; unscaled where the two decisions are the same), so that the projections of auto and of a fixed codec rest
on the same measured codec speed; the row says how many of the exchange's units auto
compresses there (``auto``).

These are projections, not measurements: the printed table and the plot say so; so does a
note where the times rest on fewer than :data:`STEADY_MIN_STEPS` steps after the warm-up.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from .profiling import Unprofilable, profile_method
from .timeline import backward_period, overlapped_period, timeline
from .units import format_rate
from ..errors import GradzipError
from ..exchange.planner import Link

#: Per-message latency of the projection (a data-centre link; ``gradzip bench model``'s default).
ALPHA_S = 10e-6
#: What the main job projects to when no ``--bandwidth`` is given.
DEFAULT_BANDWIDTHS = "100mbit,1gbit,10gbit"
#: Steps of each method profiled for its collectives (two periods of CD-SGD's default k=5).
PROFILE_STEPS = 10
#: Fewer measured steps after the warm-up than this, and a projection comes with the caveat
#: that the run was too short to measure steady state (the load of the machine and any
#: one-time cost the warm-up did not cover weigh on so few steps).
STEADY_MIN_STEPS = 50


def is_plain_ssgd(summary: dict[str, Any]) -> bool:
    """The uncompressed S-SGD run (the speed-ups' basis)."""
    return summary.get("method") == "ssgd" and summary.get("options", {}).get("compressor", "none") == "none"


def steady_times(summary: dict[str, Any]) -> dict[str, float]:
    """Seconds per step of each phase (compute, compress, update; mean over workers) after
    each process's warm-up steps (the loop's ``steady_step_s``: first epoch, or the first
    half of a shorter run, left out); the whole run's mean where no step came after it."""
    if summary.get("steady_steps"):
        return {phase: summary["steady_step_s"][phase] for phase in ("compute", "compress", "update")}
    return {phase: summary[f"time_{phase}_s"] / max(summary["steps"], 1) for phase in ("compute", "compress", "update")}


def is_short(summary: dict[str, Any]) -> bool:
    """Whether the run's measured times rest on too few steps after the warm-up."""
    return summary.get("steady_steps", 0) < STEADY_MIN_STEPS


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


def _ran_profile(summary: dict[str, Any], algo: str, options: dict[str, Any], shapes, run_n: int, cache: dict):
    """The profile of the decision an auto:<codec> run executed (its summary's
    ``auto_choices``): nothing compressed (a link that is free), every unit compressed (a link
    no byte crosses), or the rule on the run's own link (``auto_link``; None where the summary
    has neither, as one written by an older gradzip)."""
    choices = summary.get("auto_choices") or []
    link = next(iter((summary.get("auto_link") or {}).values()), None)
    if choices and all(c == "none" for c in choices):
        link = (math.inf, 0.0)
    elif choices and all(c != "none" for c in choices):
        link = (1e-9, 0.0)
    if link is None:
        return None
    return _profile(algo, {**options, "link": Link(*link)}, shapes, run_n, run_n, cache)


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
    if auto:   # the codec work of that link's decision, at the run's measured codec speed
        ran = _ran_profile(summary, algo, options, shapes, run_n, cache)
        base = here if ran is not None and ran.auto_choices == here.auto_choices else ran   # the same decision
        compress_s = (compress_s * there.compress_s / base.compress_s if base is not None and base.compress_s > 0
                      else there.compress_s)
    elif here.compress_s > 0:
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
                 workers_at: Sequence[int] | None = None, alpha_s: float = ALPHA_S) -> list[dict[str, Any]]:
    """For every run (``{"summary", "history"}`` of ``gradzip train`` / ``compare``), what its
    projection adds to its summary: ``projections``, one dict per (worker count, link rate)
    with the projected ``epoch_s``, ``iteration_s``, its phases, ``speedup`` over S-SGD and the
    ``measured_steps`` the times rest on; or, for a method the profile cannot run,
    ``projection_skipped`` (why). ``workers_at`` defaults to each run's own count."""
    if any(not (b and b > 0) for b in bandwidths_bps):
        raise GradzipError("--bandwidth for the projection needs finite rates > 0, e.g. 1gbit,10gbit")
    times = [steady_times(r["summary"]) for r in runs]
    cache: dict = {}
    base = next(((r["summary"], t) for r, t in zip(runs, times) if is_plain_ssgd(r["summary"])), None)
    out = []
    for run, own in zip(runs, times):
        s = run["summary"]
        if "parameter_shapes" not in s or "training_samples" not in s:
            raise GradzipError(f"the summary of {s.get('algo')!r} lacks parameter_shapes / training_samples "
                               "(written by an older gradzip); rerun it to project it")
        try:
            out.append({"projections": _rows(s, own, base, bandwidths_bps, workers_at, alpha_s, cache)})
        except Unprofilable as exc:
            out.append({"projection_skipped": str(exc)})
    return out


def _rows(s: dict[str, Any], own: dict[str, float], base, bandwidths_bps, workers_at, alpha_s: float,
          cache: dict) -> list[dict[str, Any]]:
    """One run's projections (:func:`project_runs`)."""
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
                         "speedup_over": basis, "measured_steps": s.get("steady_steps") or s["steps"]})
    return rows


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


def legend(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """The lines under the table about the projection: what the projected columns are, the
    steps the measured times rest on (with the caveat for a run too short to measure steady
    state), the fastest method at each (worker count, link rate) where two or more runs are
    projected (:func:`fastest`), and why a run was not projected."""
    projected = [s for s in summaries if s.get("projections")]
    lines = []
    if projected:
        first = projected[0]["projections"][0]
        lines.append(f"proj.: PROJECTED, not measured: seconds per epoch the timeline model (gradzip bench model) "
                     f"predicts from this run's measured compute, codec and update times and its bytes, per link "
                     f"rate and worker count (alpha {first['alpha_s'] * 1e6:g} us); (Nx): speed-up over "
                     f"{first['speedup_over']}"
                     + ("; auto k/m: the units auto:<codec> compresses on that link, of m"
                        if any("auto" in p for s in projected for p in s["projections"]) else ""))
        lines.append(_basis(projected))
        if len(projected) > 1:
            lines += [fastest(projected, i) for i in range(len(projected[0]["projections"]))]
    lines += [f"{s['algo']}: not projected: {s['projection_skipped']}" for s in summaries if s.get("projection_skipped")]
    return lines


def _basis(projected: Sequence[dict[str, Any]]) -> str:
    """On how many steps the projected runs' measured times rest."""
    fewest = min(projected, key=lambda s: s["projections"][0]["measured_steps"])
    steps, warmup = fewest["projections"][0]["measured_steps"], fewest.get("warmup_steps", 0)
    some = "" if all(s["projections"][0]["measured_steps"] == steps for s in projected) else "at least "
    text = (f"proj. rests on {some}{steps} measured steps per run, after each worker's first {warmup} (warm-up: "
            "one-time costs such as compiling kernels left out)")
    if any(is_short(s) for s in projected):
        text += (f"; CAVEAT: a run this short cannot measure steady state (fewer than {STEADY_MIN_STEPS} steps "
                 "after the warm-up): rerun with more --epochs before relying on the projection")
    return text


def fastest(projected: Sequence[dict[str, Any]], i: int) -> str:
    """The line naming the method fastest to its run's accuracy at projection ``i`` (a worker
    count and link rate): the least projected time for the run's epochs among the runs that
    did not diverge, with its accuracy cost (final test accuracy against the S-SGD run's, or
    the most accurate run's) and the short-run caveat."""
    row = projected[0]["projections"][i]
    where = f"fastest at {format_rate(row['bandwidth_bps'])} x{row['workers']}"
    finished = [s for s in projected if not s.get("diverged") and s["projections"][i]["iteration_s"] > 0]
    if not finished:
        return f"{where}: none (every run diverged)"
    best = min(finished, key=lambda s: s["epochs"] * s["projections"][i]["epoch_s"])
    ref = next((s for s in projected if is_plain_ssgd(s)), None) or \
        max(finished, key=lambda s: s.get("final_test_accuracy") or 0.0)
    p = best["projections"][i]
    speed = "" if p.get("speedup") is None else f", {p['speedup']:.2f}x S-SGD"
    acc, ref_acc = best.get("final_test_accuracy"), ref.get("final_test_accuracy")
    cost = "" if acc is None or ref_acc is None else \
        f"; test acc {acc:.4f}, {acc - ref_acc:+.4f} against {ref['algo']}'s {ref_acc:.4f}"
    caveat = " (caveat: too short a run to measure steady state)" if is_short(best) else ""
    return (f"{where}: {best['algo']}, {best['epochs'] * p['epoch_s']:.3g} s projected for its "
            f"{best['epochs']} epochs{speed}{cost}{caveat}")
