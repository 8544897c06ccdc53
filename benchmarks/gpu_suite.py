"""The device suite (issue 31): everything the GPU needs measured, in one command that ends
within its time budget (8 minutes on one H100 by default), so that one call of a lent
machine does it all::

    PYTHONPATH=src python -m benchmarks.gpu_suite --out DIR            # on a CUDA machine
    PYTHONPATH=src python -m benchmarks.gpu_suite --out DIR --dry-run  # CPU, tiny, interpreter (CI)

Phases, in order (each timed; one that would start past its share of ``--budget-s`` is
skipped and recorded as such, and DIR/gpu_suite.json is rewritten after every phase, so a
run cut short still leaves what it measured):

1. ``tests``: ``pytest -m cuda`` (the Triton kernels' bit-identity tests and the CUDA
   checks; on a CUDA machine every one must run: zero skips); its log in DIR/pytest.log.
2. ``codecs``: compress + decompress of every codec with kernels, torch path against Triton
   path, at 1M / 16M / 64M float32 entries, as a multiple of a device-to-device copy of the
   same tensor (and compress alone, randomk's target).
3. ``aggregate``: the mean of 8 packets (the allgather aggregate, one pass) against reading
   the 8 packets once and writing the float32 output once at the copy's rate.
4. ``topk``: ``topk`` and ``dgc`` at 1% against ``torch.topk(|x|, k)``; ``powersgd``: PowerSGD's
   orthogonalisation of ResNet-50's ``P̂`` per step, torch's (a kernel only where it shows).
5. ``compute``, ``methods``, ``cdsgd`` (:mod:`benchmarks.gpu_steps`): ResNet-50 bf16 forward +
   backward at batch 32 and 128; each gradzip method's step overhead on one GPU (world size 1
   over NCCL, and 2 ranks of gloo over CUDA tensors); the CD-SGD exchange on its side stream
   overlapping the next step's compute (a profiler trace, DIR/cdsgd_trace.json).

It writes DIR/gpu_suite.json (every number) and DIR/gpu_suite.md (the section for docs/).
``--dry-run`` runs every phase on the CPU at tiny sizes, the Triton kernels under Triton's
interpreter (``TRITON_INTERPRET=1``) and a small model in place of ResNet-50: the plumbing,
checked in CI (tests/test_gpu_suite.py), so the suite cannot rot between device sessions.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks import gpu_steps

ROOT = Path(__file__).resolve().parents[1]

#: The codecs measured (every one with kernels; the sparsifiers at 1%).
CODECS = ("sign", "scaled_sign", "2bit", "1bit", "qsgd", "terngrad", "fp16", "bf16",
          "topk:ratio=0.01", "dgc:ratio=0.01", "randomk:ratio=0.01")
MODES = ("torch", "triton")
#: The test files holding the tests marked ``cuda`` (tests/test_gpu_suite.py checks that no
#: other file has one): collecting only these keeps the device free of the other tests'
#: imports (tomli-w, say, is not on the device image) and of their collection time.
CUDA_TEST_FILES = ("tests/test_kernels_triton.py", "tests/test_compressors.py", "tests/test_kernels_quantize.py")
#: Each phase's share of the budget (fractions, cumulative deadlines from the start).
DEADLINES = {"tests": 0.38, "codecs": 0.58, "aggregate": 0.66, "topk": 0.70, "powersgd": 0.72,
             "compute": 0.77, "methods": 0.93, "cdsgd": 1.0}


class Settings:
    """Sizes and repeats of a full run or a dry run."""

    def __init__(self, dry: bool):
        self.dry = dry
        self.device = "cpu" if dry else "cuda"
        self.sizes = (4099,) if dry else (1 << 20, 16 << 20, 64 << 20)
        self.aggregate_sizes = (4099,) if dry else (16 << 20, 64 << 20)
        self.repeat = 1 if dry else 10
        self.warmup = 0 if dry else 3
        self.packets = 8


def timer(device: str) -> Callable[[Callable[[], Any]], float]:
    """A function timing one call of ``fn`` in seconds: CUDA events around it on a GPU (the
    device's own clock, nothing else queued), the host clock otherwise."""
    import torch
    if device == "cuda":
        def once(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return once

    def once(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return once


def median_s(fn: Callable[[], Any], settings: Settings, repeat: int | None = None) -> float:
    once = timer(settings.device)
    for _ in range(settings.warmup):
        once(fn)
    return statistics.median(once(fn) for _ in range(repeat or settings.repeat))


# -- phase: tests ---------------------------------------------------------------------------
def run_tests(settings: Settings, out: Path, timeout_s: float) -> dict:
    """``pytest -m cuda`` in a child process; its counts, and whether it may be trusted (on CUDA:
    nothing failed, nothing skipped)."""
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider"]
    if settings.dry:   # the plumbing only: two interpreter tests
        cmd += [CUDA_TEST_FILES[0], "-k", "test_packets_at_odd_byte_offsets_inside_a_bucket and sign"]
    else:   # the kernels compile on first use: 8 processes compile them side by side
        cmd += list(CUDA_TEST_FILES) + (["-n", "8"] if importlib.util.find_spec("xdist") else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    began = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        log, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        log, code = f"{exc.stdout or ''}{exc.stderr or ''}\n[timed out after {timeout_s:.0f} s]", -1
    (out / "pytest.log").write_text(log)
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", log)}
    ok = code == 0 and counts.get("passed", 0) > 0 and (settings.dry or not counts.get("skipped"))
    return {"command": " ".join(cmd[1:]), "returncode": code, "counts": counts, "ok": ok,
            "seconds": time.perf_counter() - began}


# -- phase: codecs ---------------------------------------------------------------------------
def measure_codecs(settings: Settings) -> list[dict]:
    """Per size: the copy's time, and per codec and path the median compress and decompress
    (reused buffers, as PSync calls them); ``vs_copy`` = copy / (compress + decompress)."""
    import torch
    from gradzip import kernels
    from gradzip.compressors import build
    rows = []
    for size in settings.sizes:
        x = torch.randn(size, generator=torch.Generator().manual_seed(size)).to(settings.device)
        buf = torch.empty_like(x)
        copy_s = median_s(lambda: buf.copy_(x), settings)
        for spec in CODECS:
            codec = build(spec)
            row = {"size": size, "codec": spec, "copy_ms": copy_s * 1e3}
            for mode in MODES:
                with kernels.use(mode):
                    packet = codec.compress(x, seed=1)
                    row["wire_bytes"] = packet.nbytes
                    state = {"p": packet}
                    c = median_s(lambda: state.__setitem__("p", codec.compress(x, seed=2, reuse=state["p"])), settings)
                    d = median_s(lambda: codec.decompress(state["p"], out=buf), settings)
                row[mode] = {"compress_ms": c * 1e3, "decompress_ms": d * 1e3, "vs_copy": copy_s / (c + d),
                             "compress_vs_copy": copy_s / c}
            rows.append(row)
            del codec
        del x, buf
    return rows


# -- phase: aggregate ------------------------------------------------------------------------
def measure_aggregate(settings: Settings) -> list[dict]:
    """The mean of ``settings.packets`` packets per codec and path, against the floor of
    reading them once and writing the float32 output once at the copy's rate (bytes read +
    written per second of ``out.copy_(x)``)."""
    import torch
    from gradzip import kernels
    from gradzip.compressors import build
    rows = []
    for size in settings.aggregate_sizes:
        x = torch.randn(size, generator=torch.Generator().manual_seed(size + 1)).to(settings.device)
        buf = torch.empty_like(x)
        copy_s = median_s(lambda: buf.copy_(x), settings)
        rate = 8 * size / copy_s   # bytes read + written per second
        for spec in CODECS:
            codec = build(spec)
            with kernels.use("torch"):
                packets = [codec.compress(x * (1 + k / 8), seed=k) for k in range(settings.packets)]
            floor_s = (sum(p.nbytes for p in packets) + 4 * size) / rate
            row = {"size": size, "codec": spec, "packets": len(packets), "floor_ms": floor_s * 1e3}
            for mode in MODES:
                with kernels.use(mode):
                    t = median_s(lambda: codec.aggregate(packets), settings)
                row[mode] = {"ms": t * 1e3, "vs_floor": floor_s / t}
            rows.append(row)
            del packets
        del x, buf
    return rows


# -- phase: topk -----------------------------------------------------------------------------
def measure_topk(settings: Settings) -> list[dict]:
    """``topk`` and ``dgc`` at 1% (their Triton path) against ``torch.topk(|x|, k)``."""
    import torch
    from gradzip import kernels
    from gradzip.compressors import build, keep_count
    rows = []
    for size in settings.sizes:
        x = torch.randn(size, generator=torch.Generator().manual_seed(size + 2)).to(settings.device)
        k = keep_count(0.01, size)
        ref = median_s(lambda: torch.topk(torch.abs(x), k, sorted=False), settings)
        row = {"size": size, "k": k, "torch_topk_ms": ref * 1e3}
        for spec in ("topk:ratio=0.01", "dgc:ratio=0.01"):
            codec = build(spec)
            with kernels.use("triton"):
                t = median_s(lambda: codec.compress(x, seed=3), settings)
            row[spec] = {"ms": t * 1e3, "vs_torch_topk": ref / t}
        rows.append(row)
        del x
    return rows


# -- phase: powersgd -------------------------------------------------------------------------
def measure_orthogonalize(settings) -> list[dict]:
    """PowerSGD's orthogonalisation of ``P̂`` for ResNet-50 (torch's, as the method runs it: one
    call per group of equally shaped matrices), per step, at rank 1, 2 and 4: whether a
    kernel could gain anything against the step it sits in (the Gram-Schmidt of ``r <= 2``
    is a few small launches per group; QR above)."""
    import torch
    from gradzip.bench.shapes import resnet50_shapes
    from gradzip.compressors.powersgd import effective_rank, matrix_shape, orthogonalize, should_compress
    shapes = resnet50_shapes()[:8] if settings.dry else resnet50_shapes()
    rows = []
    for rank in (1, 2, 4):
        groups: dict[tuple[int, int], int] = {}
        for shape in shapes:
            if should_compress(shape, rank, 2.0):
                key = (matrix_shape(shape)[0], effective_rank(shape, rank))
                groups[key] = groups.get(key, 0) + 1
        ps = [torch.randn(count, n, r, device=settings.device) for (n, r), count in groups.items()]
        work = [p.clone() for p in ps]

        def run():
            for w, p in zip(work, ps):
                orthogonalize(w.copy_(p))
        t = median_s(run, settings)
        rows.append({"rank": rank, "groups": len(ps), "entries": sum(p.numel() for p in ps), "ms": t * 1e3})
    return rows


# -- the report ------------------------------------------------------------------------------
def environment(settings: Settings) -> dict:
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": settings.device,
            "dry_run": settings.dry}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if settings.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
    return info


def markdown(result: dict, command: str) -> str:
    """The docs section: every phase's table, the command, the environment."""
    env = result["environment"]
    lines = [f"Command: `{command}` ({env.get('gpu', 'CPU dry run')}; torch {env['torch']}, triton {env['triton']}).",
             ""]
    tests = result.get("tests")
    if isinstance(tests, dict) and "counts" in tests:
        counts = ", ".join(f"{v} {k}" for k, v in tests["counts"].items())
        lines += [f"**Tests** (`{tests['command']}`): {counts}; {'ok' if tests['ok'] else 'NOT OK'}.", ""]
    codecs = result.get("codecs")
    if isinstance(codecs, list) and codecs:
        lines += ["**Codecs**: compress + decompress as a multiple of a device-to-device copy (× copy; compress "
                  "alone in brackets), torch path → Triton path.", "",
                  "| codec | size | torch × copy | Triton × copy | Triton compress / decompress ms |",
                  "|---|---:|---:|---:|---|"]
        for r in codecs:
            t, g = r["torch"], r["triton"]
            lines.append(f"| `{r['codec']}` | {_size(r['size'])} | {t['vs_copy']:.2f} ({t['compress_vs_copy']:.2f}) | "
                         f"{g['vs_copy']:.2f} ({g['compress_vs_copy']:.2f}) | "
                         f"{g['compress_ms']:.3f} / {g['decompress_ms']:.3f} |")
        lines.append("")
    agg = result.get("aggregate")
    if isinstance(agg, list) and agg:
        lines += [f"**Aggregate of {agg[0]['packets']} packets** against reading them once and writing the "
                  "output once at the copy's rate (× floor).", "",
                  "| codec | size | floor ms | torch ms (× floor) | Triton ms (× floor) |", "|---|---:|---:|---:|---:|"]
        for r in agg:
            lines.append(f"| `{r['codec']}` | {_size(r['size'])} | {r['floor_ms']:.3f} | {r['torch']['ms']:.3f} "
                         f"({r['torch']['vs_floor']:.2f}) | {r['triton']['ms']:.3f} ({r['triton']['vs_floor']:.2f}) |")
        lines.append("")
    topk = result.get("topk")
    if isinstance(topk, list) and topk:
        lines += ["**Top-k 1%** against `torch.topk(|x|, k)` (× = torch.topk's time over the codec's).", "",
                  "| size | torch.topk ms | topk ms (×) | dgc ms (×) |", "|---:|---:|---:|---:|"]
        for r in topk:
            a, b = r["topk:ratio=0.01"], r["dgc:ratio=0.01"]
            lines.append(f"| {_size(r['size'])} | {r['torch_topk_ms']:.3f} | {a['ms']:.3f} ({a['vs_torch_topk']:.2f}) | "
                         f"{b['ms']:.3f} ({b['vs_torch_topk']:.2f}) |")
        lines.append("")
    ortho = result.get("powersgd")
    if isinstance(ortho, list) and ortho:
        parts = ", ".join(f"rank {r['rank']}: {r['ms']:.3f} ms ({r['groups']} groups)" for r in ortho)
        lines += [f"**PowerSGD's orthogonalisation** of P̂ per step, ResNet-50, torch: {parts}; a kernel pays only "
                  "where this is a visible share of the step (the compute table below).", ""]
    lines += gpu_steps.markdown(result)
    skipped = [k for k, v in result.items() if isinstance(v, dict) and v.get("skipped")]
    if skipped:
        missed = ", ".join(f"{k} ({result[k]['skipped']})" for k in skipped)
        lines += [f"Not measured (budget or error): {missed}.", ""]
    return "\n".join(lines).rstrip() + "\n"


def _size(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else str(n)


# -- the run ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for gpu_suite.json, gpu_suite.md, logs, the trace")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, Triton's interpreter (CI)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget of the whole run")
    parser.add_argument("--skip", default="", help="comma-separated phases to leave out")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"   # before any kernel module is imported
    settings = Settings(args.dry_run)
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_suite: no CUDA device; run it with --dry-run on a machine without one", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.gpu_suite " + " ".join(argv if argv is not None else sys.argv[1:])
    result: dict[str, Any] = {"environment": environment(settings), "command": command}
    began = time.perf_counter()
    skip = {s for s in args.skip.split(",") if s}
    phases = {
        "tests": lambda left: run_tests(settings, out, left),
        "codecs": lambda left: measure_codecs(settings),
        "aggregate": lambda left: measure_aggregate(settings),
        "topk": lambda left: measure_topk(settings),
        "powersgd": lambda left: measure_orthogonalize(settings),
        "compute": lambda left: gpu_steps.measure_compute(settings),
        "methods": lambda left: gpu_steps.measure_methods(settings, left),
        "cdsgd": lambda left: gpu_steps.measure_cdsgd(settings, out),
    }
    for name, run in phases.items():
        deadline = DEADLINES[name] * args.budget_s
        elapsed = time.perf_counter() - began
        if name in skip:
            result[name] = {"skipped": "--skip"}
        elif elapsed > deadline:
            result[name] = {"skipped": f"budget: {elapsed:.0f} s gone, its share ended at {deadline:.0f} s"}
        else:
            t0 = time.perf_counter()
            print(f"[gpu_suite] {name} ...", flush=True)
            try:
                result[name] = run(deadline - elapsed)
            except Exception as exc:   # recorded, and the next phase still runs
                result[name] = {"skipped": f"error: {type(exc).__name__}: {exc}"[:500]}
            result.setdefault("phase_seconds", {})[name] = time.perf_counter() - t0
            print(f"[gpu_suite] {name}: {time.perf_counter() - t0:.1f} s", flush=True)
            if settings.device == "cuda":
                torch.cuda.empty_cache()
        result["seconds"] = time.perf_counter() - began
        (out / "gpu_suite.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "gpu_suite.md").write_text(markdown(result, command))
    print((out / "gpu_suite.md").read_text())
    tests = result.get("tests", {})
    failed = [k for k, v in result.items() if isinstance(v, dict) and str(v.get("skipped", "")).startswith("error")]
    return 0 if tests.get("ok", "tests" in skip) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
