"""What ``gradzip bench`` prints: the records of :mod:`gradzip.bench.emulated` and the rows
of :mod:`gradzip.bench.timeline` as markdown tables (the command's own output; the prose
and plots of docs/benchmarks/ are written by ``benchmarks/network.py``)."""
from __future__ import annotations

import statistics

from .timeline import TOLERANCE
from .units import format_rate


def check_table(records: list[dict]) -> str:
    """The shaping check of every topology (shaped: against the prediction; unshaped: the host's ceiling)."""
    lines = ["| workers | link | allreduce MB | counted wire MB | interface MB (+headers) | predicted ms | measured ms (median) | measured / predicted | within 15% | fastest repeat / predicted |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in records:
        c = r.get("check")
        if not c:
            continue
        if c["predicted_s"] is None:  # unshaped: what this host carries at most
            lines.append(f"| {r['workers']} | unshaped | {c['bytes'] / 1e6:.1f} | {c['counted_wire_bytes'] / 1e6:.1f} | "
                         f"{c['interface_bytes'] / 1e6:.1f} | – | {c['measured_s'] * 1e3:.0f} | host ceiling "
                         f"{c['counted_wire_bytes'] * 8 / c['measured_s'] / 1e9:.2f} Gbit/s per link | – | – |")
            continue
        lines.append(f"| {r['workers']} | {format_rate(r['bandwidth_bps'])} | {c['bytes'] / 1e6:.1f} | "
                     f"{c['counted_wire_bytes'] / 1e6:.1f} | {c['interface_bytes'] / 1e6:.1f} "
                     f"({c['interface_bytes'] / c['counted_wire_bytes'] - 1:+.1%}) | {c['predicted_s'] * 1e3:.0f} | "
                     f"{c['measured_s'] * 1e3:.0f} | {c['ratio']:.3f} | {'yes' if c['ok'] else '**no**'} | "
                     f"{min(c['all_s']) / c['predicted_s']:.3f} |")
    return "\n".join(lines)


def time_table(records: list[dict]) -> str:
    """Time per iteration and its phases, per topology and method."""
    lines = ["| workers | link | method | iteration ms | compute | compress | communicate | update + loop | hidden (bg) | MB sent / step | MB inside the node / step | speedup vs ssgd |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        k = r.get("workers_per_node", 1)
        where = f"{format_rate(r['bandwidth_bps'])}" + (f", {k} per node" if k > 1 else "")
        base = next((x["iteration_s"] for x in r["runs"] if x["algo"] == "ssgd"), None)
        for x in r["runs"]:
            hidden = x["hidden_compress_s"] + x["hidden_communicate_s"] + x.get("hidden_other_s", 0.0)
            intra = x.get("intra_bytes_per_step", 0.0)   # hierarchical: the node's links, not the uplink
            lines.append(
                f"| {r['workers']} | {where} | `{x['algo']}` | {x['iteration_s'] * 1e3:.0f} | "
                f"{x['compute_s'] * 1e3:.0f} | {x['compress_s'] * 1e3:.0f} | {x['communicate_s'] * 1e3:.0f} | "
                f"{(x['update_s'] + x['loop_s']) * 1e3:.0f} | {hidden * 1e3:.0f} | {(x['bytes_per_step'] - intra) / 1e6:.2f} | "
                f"{intra / 1e6 if k > 1 else float('nan'):.2f} | "
                f"{(base / x['iteration_s']) if base else float('nan'):.2f} |")
    return "\n".join(lines)


def noise_line(result: dict) -> str:
    """One sentence on the host and how much compute time varied between steps."""
    cvs = [x["compute_cv"] for r in result["records"] for x in r["runs"]]
    h = result["host"]
    return (f"torch {h['torch']}, {h['cpus']} CPUs, kernel {h['kernel']}; load average {h['loadavg'][0]:.1f} "
            f"at the end (other jobs share this machine). Compute time per step varied between steps "
            f"by a coefficient of variation of {statistics.median(cvs):.0%} (median over runs; "
            f"max {max(cvs):.0%}).")


def validation_table(rows: list[dict]) -> str:
    """Predicted vs measured iteration time, one row per shaped run."""
    lines = ["| workers | link | method | measured ms | predicted ms | error | local work ms | network ms (model) | blocked on network ms (measured) | MB / step measured = model | MB inside the node measured = model |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        k = r.get("workers_per_node", 1)
        flag = "" if abs(r["error"]) <= TOLERANCE else f" **>{TOLERANCE:.0%}**"
        intra = _same(r.get("intra_bytes_measured", 0.0), r.get("intra_bytes_model", 0.0)) if k > 1 else "–"
        lines.append(f"| {r['workers']} | {format_rate(r['bandwidth_bps'])}{f', {k} per node' if k > 1 else ''} | "
                     f"`{r['algo']}` | {r['measured_s'] * 1e3:.0f} | "
                     f"{r['predicted_s'] * 1e3:.0f} | {r['error']:+.1%}{flag} | {r['local_s'] * 1e3:.0f} | "
                     f"{r['communicate_model_s'] * 1e3:.0f} | {r['communicate_measured_s'] * 1e3:.0f} | "
                     f"{_same(r['bytes_measured'], r['bytes_model'])} | {intra} |")
    return "\n".join(lines)


def _same(measured: float, model: float) -> str:
    """``measured yes``, or ``measured **no** (model)`` in MB: do the byte counts agree?"""
    return f"{measured / 1e6:.3f} " + ("yes" if abs(measured - model) < 1 else f"**no** ({model / 1e6:.3f})")


def projection_table(rows: list[dict]) -> str:
    """Predicted iteration time (speedup over the first method) per worker count, link and
    transport asked for; where that is not ``recorded``, each cell names the transport the
    method's exchanges took (``auto`` picks per bucket)."""
    algos = list(dict.fromkeys(r["algo"] for r in rows))
    head = " | ".join(f"`{a}` ms (speedup)" for a in algos)
    waits = any(r.get("straggler_wait_s") for r in rows)   # E[max of K delays], in every iteration
    lines = [f"| workers | link | transport |{' E[max δ] ms |' if waits else ''} {head} |",
             "|---:|---|---|" + ("---:|" if waits else "") + "---:|" * len(algos)]
    keys = list(dict.fromkeys((r["workers"], r["bandwidth_bps"], r.get("transport", "recorded")) for r in rows))
    for n, bw, transport in keys:
        cells = []
        if waits:
            first = next(x for x in rows if x["workers"] == n and x["bandwidth_bps"] == bw)
            cells.append(f"{first['straggler_wait_s'] * 1e3:.1f}")
        for a in algos:
            r = next(x for x in rows if x["workers"] == n and x["bandwidth_bps"] == bw and x["algo"] == a
                     and x.get("transport", "recorded") == transport)
            uses = f", {r['uses']}" if transport != "recorded" else ""
            cells.append(f"{r['iteration_s'] * 1e3:.0f} ({r['speedup']:.2f}×{uses})")
        k = next((x.get("hierarchy", 1) for x in rows if x["workers"] == n), 1)
        where = f"{transport}" + (f", {k} per node" if k > 1 else "")
        lines.append(f"| {n} | {format_rate(bw)} | {where} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def codec_table(rows: list[dict]) -> str:
    """Per method and worker count: codec and update time, bytes on the wire, overlap."""
    seen, lines = set(), ["| method | workers | transport (used) | compress + decode ms (measured here) | update ms | MB on the wire / step / worker | overlaps exchange |",
                          "|---|---:|---|---:|---:|---:|---|"]
    for r in rows:
        key = (r["algo"], r["workers"], r.get("transport"), r.get("uses"))
        if key in seen:
            continue
        seen.add(key)
        used = r.get("transport", "recorded") + (f" ({r['uses']})" if r.get("transport", "recorded") != "recorded" else "")
        lines.append(f"| `{r['algo']}` | {r['workers']} | {used} | {r['compress_s'] * 1e3:.0f} | {r['update_s'] * 1e3:.0f} | "
                     f"{r['wire_bytes_per_step'] / 1e6:.2f} | {'yes' if r['overlaps'] else 'no'} |")
    return "\n".join(lines)
