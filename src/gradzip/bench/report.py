"""The benchmark sections of docs/benchmarks.md (written with ``benchmarks/docs_section.py``)."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from ..errors import GradzipError

ROOT = Path(__file__).resolve().parents[3]
NET_HEADING = "Emulated network: time per iteration"
VALIDATION_HEADING = "Timeline model: predicted vs measured"
PROJECTION_HEADING = "Timeline model: projection to large clusters"


def _replace_section(heading: str, body: str) -> None:
    path = ROOT / "benchmarks" / "docs_section.py"
    if not path.exists():
        raise GradzipError(f"--write needs the repository's {path} (run from a source checkout)")
    spec = importlib.util.spec_from_file_location("gradzip_docs_section", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.replace_section(heading, body)
    print(f"updated section '{heading}' of {module.DOC}")


def _rel(path: str) -> str:
    return os.path.relpath(Path(path).resolve(), ROOT / "docs")


def _check_summary(records) -> str:
    checks = [r["check"] for r in records if r.get("check") and r["check"]["predicted_s"] is not None]
    ok = sum(bool(c["ok"]) for c in checks)
    ceilings = [f"{r['workers']} workers: {r['check']['counted_wire_bytes'] * 8 / r['check']['measured_s'] / 1e9:.1f} Gbit/s"
                for r in records if r.get("check") and r["check"]["predicted_s"] is None]
    text = f"**{ok} of {len(checks)} shaped checks within 15%.**"
    if ceilings:
        text += (" The unshaped rows are what this host moves per link at all (gloo over veth, the "
                 "workers and other jobs sharing the CPUs): " + "; ".join(ceilings) + ". A link faster "
                 "than that cannot be filled here, so those rows measure the host, not the link (the "
                 "model below caps the link rate at this ceiling); the slower links' misses come from "
                 "workers descheduled between the ring's steps on an oversubscribed machine.")
    return text


def write_net_section(result: dict[str, Any], command: str) -> None:
    from .net import check_table, noise_line, time_table

    s = result["settings"]
    body = f"""Real gloo worker processes, each in a network namespace of its own, linked by a veth
pair to a bridge in a "switch" namespace; every link is shaped with `tc tbf` in both
directions, so each worker has its own link of the given rate (`gradzip.bench.netns`).
Workload: `{s['model']}` on synthetic {s['shape']} data, batch {s['batch_size']} per worker,
{s['threads']} torch thread per worker, {s['warmup']} warm-up steps then {s['steps']} measured
steps per method; the phases come from each worker's trace (`gradzip.bench.net.step_breakdown`).
Produced by:

```
{command}
```

First the shaping check: an fp32 allreduce of the given size (slowest worker, median of
{s['check_repeats']} after one warm-up; the verdict is on the median, the last column shows
the fastest repeat, since other jobs can only add time) against the ring's bytes over one
link at the link rate. "interface MB" is the worker's `tx_bytes` counter during the allreduce: the counted
bytes plus what gloo, TCP and IP add (veth segments up to 64 KB, so few headers).

{check_table(result['records'])}

{_check_summary(result['records'])}

Time per iteration: the median over the measured steps of each phase (mean over the
workers). *compute* = forward + backward; *compress* = codec work and packing (compress,
residual, decode); *communicate* = time the step blocked on the network; *update + loop* =
the rest of `optimizer.step()` and of the training loop; *hidden* = exchange work that ran
on a background thread (methods that overlap). MB sent / step is the counted ring bytes of
one worker.

{time_table(result['records'])}

Noise: {noise_line(result)} Every worker has one intra-op thread, but 4 workers share
2 cores here, with other jobs, so compute times at 4 workers are inflated and vary; the
model below is fed the compute times measured in these same runs. The kernel here has no
`sch_netem` (`CONFIG_NET_SCH_NETEM` unset), so these runs have no added latency;
`--latency-ms` works where netem exists and otherwise stops with that message.
"""
    _replace_section(NET_HEADING, body)


def write_model_sections(result: dict[str, Any], measured: dict[str, Any] | None) -> None:
    from .model import TOLERANCE, codec_table, projection_table, validation_table

    command = result["command"]
    if "validation" in result:
        rows = result["validation"]
        within = sum(abs(r["error"]) <= TOLERANCE for r in rows)
        worst = max((abs(r["error"]) for r in rows), default=0.0)
        body = f"""The timeline model (`gradzip.bench.model`) beside the emulated runs of the section
above. The model takes the local work of each step from the run itself (the slowest
worker's compute + codec + update, mean over steps) and adds the alpha-beta network time
of the collectives the method issues (ring allreduce `2(n-1)α + 2(n-1)/n·S/B`, ring
allgather `(n-1)α + (n-1)·S/B`, α = {result['validation_alpha_s'] * 1e6:g} µs per message step, B = the link
rate, capped at the host ceiling that the unshaped run of as many workers measured).
For a method that overlaps its exchange (`cdsgd`) the prediction is
`max(local work, background codec + update + network)`.
Which collectives, and how many bytes, comes from running the method's own `step()` on a
recording group; the last column checks those bytes against the bytes the run counted.
Produced by:

```
{command}
```

**{within} of {len(rows)} predictions within {TOLERANCE:.0%}** of the measured iteration time
(largest error {worst:.1%}).

{validation_table(rows)}

![predicted vs measured]({_rel(result['validation_plot'])})
"""
        _replace_section(VALIDATION_HEADING, body)
    if "projection" in result:
        ps = result["projection_settings"]
        rows = result["projection"]
        plots = "\n\n".join(f"![projection]({_rel(p)})" for p in result["projection_plots"])
        if ps["codec_scale"] == 0:
            local = ("Here codec and update times are set to zero (`--local-scale 0`): compute and the "
                     "network alone, i.e. the most that fewer bytes can buy. Bytes on the wire per step "
                     "and worker:\n\n" + codec_table(rows))
        else:
            local = ("Codec work per step as measured here (CPU, loaded machine: treat as an upper bound "
                     "for an accelerator; `--local-scale` rescales codec and update times):\n\n"
                     + codec_table(rows))
        body = f"""The same model projected to clusters: `{ps['model']}` ({ps['parameters'] / 1e6:.1f}M parameters, its
real tensor shapes), {ps['compute_s'] * 1e3:g} ms of compute per iteration (given, about
ResNet-50 at batch 32 on a V100), α = {ps['alpha_s'] * 1e6:g} µs, codec and update times measured on
this machine ({ps['threads']} CPU thread, × {ps['codec_scale']:g}) by running each method's `step()` on a
recording group of each worker count up to {ps['profile_max_workers']}; above it the collectives are sized by
a dry run at the real count and the decoding time is scaled by the packets decoded (an
allgather decodes n packets, an allreduce one). Methods that overlap
the exchange with the next step's compute (`overlaps_exchange`) cost
`max(compute, compress + communicate) + update`, the others the sum. Produced by:

```
{command}
```

{local}

Predicted iteration time and speedup over the first method:

{projection_table(rows)}

{plots}
"""
        heading = PROJECTION_HEADING if ps["codec_scale"] == 1 else (
            f"{PROJECTION_HEADING}, codec and update free" if ps["codec_scale"] == 0
            else f"{PROJECTION_HEADING}, local work x {ps['codec_scale']:g}")
        _replace_section(heading, body)
