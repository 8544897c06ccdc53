"""What the reliability features cost per step: the non-finite guard and checkpoints.

On ``--workers`` gloo processes (127.0.0.1), with a model of realistic size and fixed
random gradients, it times ``optimizer.step()`` under ``nonfinite`` = ``off`` / ``raise``
/ ``skip`` side by side, interleaved over rounds (median per round, median of rounds), and
the time and size of one checkpoint (model + optimizer state, written atomically, then
the barrier that lets earlier checkpoints go).

    python -m benchmarks.reliability_overhead --write    # -> docs/reliability.md
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.docs_section import DOCS, replace_section

DOC = DOCS / "reliability.md"
POLICIES = ("off", "raise", "skip")

#: What the table measures (written above it into docs/reliability.md, "Overheads").
PROSE = """`nonfinite=raise` costs one `sum()` per gradient tensor before compression and one per
decoded aggregate after it (the codec-overflow check; the aggregate is the same on every
worker, so no communication); `skip` adds one 8-byte-per-worker allgather per step (a
latency: on 127.0.0.1 about 1–2 ms, more on a real network). A checkpoint costs a write of
the model and the optimizer state (EF-SGD and BIT-SGD keep a residual as large as the
model, hence twice the model's size), its SHA-256 (0.06–0.09 s for 40 MB here, see "Checkpoints") and a barrier;
with `--checkpoint-every N` it is paid once per N steps. "guard alone" times the gradient
check by itself."""


def worker(comm, model_name: str, algos: list[str], rounds: int, steps: int):
    import torch

    import gradzip
    from gradzip.train import checkpoint, models

    model = models.build(model_name, (3, 32, 32) if model_name.startswith("resnet") else (64,), 10, seed=0)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(comm.rank)
    grads = [torch.randn(p.shape, generator=g) * 1e-3 for p in params]
    out = {"parameters": sum(p.numel() for p in params)}
    for spec in algos:
        algo, _, codec = spec.partition("@")
        options = {"compressor": codec} if codec else {}
        opts = {pol: gradzip.optim.METHODS[algo](params, lr=1e-3, comm=comm, nonfinite=pol, **options)
                for pol in POLICIES}
        times = {pol: [] for pol in POLICIES}
        for r in range(rounds + 1):  # round 0 warms up
            for pol in POLICIES:
                per_step = []
                for _ in range(steps):
                    for p, gr in zip(params, grads):
                        p.grad = gr.clone()
                    comm.barrier()
                    t0 = time.perf_counter()
                    opts[pol].step()
                    per_step.append(time.perf_counter() - t0)
                if r:
                    times[pol].append(statistics.median(per_step))
        guard = {}
        for pol in POLICIES:
            t0 = time.perf_counter()
            for _ in range(steps):
                opts[pol].gradients_finite(params)
            guard[pol] = (time.perf_counter() - t0) / steps
        with tempfile.TemporaryDirectory() as root:
            state = {"model": model.state_dict(), "optimizer": opts["raise"].state_dict()}
            t0 = time.perf_counter()
            path = checkpoint.save(root, 1, comm.rank, comm.world_size, state)
            comm.barrier()
            saved_s = time.perf_counter() - t0
            size = path.stat().st_size
            t0 = time.perf_counter()
            checkpoint.load(root, 1, comm.rank, comm.world_size)
            loaded_s = time.perf_counter() - t0
        out[spec] = {"step_s": {p: statistics.median(v) for p, v in times.items()}, "guard_s": guard,
                     "checkpoint_bytes": size, "save_s": saved_s, "load_s": loaded_s}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--model", default="mlp10m")
    ap.add_argument("--algos", default="ssgd,efsgd@topk:ratio=0.01,bitsgd")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--write", action="store_true", help="update docs/reliability.md")
    args = ap.parse_args()

    from gradzip.comm.launch import run_processes

    began = time.perf_counter()
    res = run_processes(args.workers, worker, args.model, args.algos.split(","), args.rounds, args.steps)[0]
    n = res.pop("parameters")
    lines = [PROSE, "", f"`python -m benchmarks.reliability_overhead --workers {args.workers} --model {args.model} "
             f"--algos {args.algos} --rounds {args.rounds} --steps {args.steps}` ({n / 1e6:.1f}M parameters, "
             f"{args.workers} gloo processes on 127.0.0.1, rank 0's numbers, {time.perf_counter() - began:.0f} s):",
             "",
             "| method | step, off (ms) | raise / off | skip / off | guard alone, raise (ms) | guard alone, skip (ms) "
             "| checkpoint MB/rank | save + barrier (ms) | load (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for spec, r in res.items():
        s = r["step_s"]
        lines.append(f"| {spec} | {s['off'] * 1e3:.1f} | {s['raise'] / s['off']:.3f} | {s['skip'] / s['off']:.3f} "
                     f"| {r['guard_s']['raise'] * 1e3:.2f} | {r['guard_s']['skip'] * 1e3:.2f} "
                     f"| {r['checkpoint_bytes'] / 1e6:.1f} | {r['save_s'] * 1e3:.0f} | {r['load_s'] * 1e3:.0f} |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        replace_section("Overheads", table, doc=DOC)


if __name__ == "__main__":
    main()
