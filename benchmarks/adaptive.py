"""Compressed adaptive optimizers on the transformer task: dense Adam(W), Compressed(AdamW,
topk 1%), 1-bit Adam, 0/1 Adam, 1-bit LAMB and LAMB.

Two parts, both on ``modadd`` (modular addition, no file) with the ``transformer`` model:

1. **Accuracy and bytes** (``--part accuracy``): 4 workers on threads (``gradzip.simulate``;
   the numbers are those of gloo), 3 seeds, the same learning rate schedule-free setup for
   every method; final test loss / accuracy (mean over seeds, workers' average model) and
   the bytes each worker put on the wire.
2. **Time per step** (``--part speed``, needs root): the same methods as real gloo processes
   in network namespaces with 1 Gbit/s tc-shaped links (``gradzip.bench.emulated``), the
   compressed stage measured (warm-ups set to 0 steps: 1-bit Adam / LAMB compress from step
   1, 0/1 Adam runs its local-step phase; the emulated bench feeds synthetic flat inputs, which the
   transformer reads as token ids in ``[0, 10)``).

Compressed(inner) and LAMB come from ``gradzip.optim`` (another branch builds them): rows whose
class is missing are left out and the output says so. "Adam (dense)" is 1-bit Adam with the
identity codec and its warm-up longer than the run (Adam without bias correction, decoupled
weight decay; the spec's test limit), "AdamW (dense)" is ``torch.optim.AdamW`` behind
Compressed(none) where Compressed exists.

    python -m benchmarks.adaptive --part accuracy --write
    python -m benchmarks.adaptive --part speed --write       # root: network namespaces
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.docs_section import replace_section

import gradzip  # noqa: E402
from gradzip.bench import emulated  # noqa: E402
from gradzip.train import datasets, models  # noqa: E402


def methods(args, steps: int) -> dict:
    """label -> factory(params, comm) (None where the class is not in gradzip.optim)."""
    o = gradzip.optim
    lr, wd, betas = args.lr, args.weight_decay, (0.9, 0.98)
    freeze = max(1, int(args.freeze_fraction * steps))
    compressed, lamb = getattr(o, "Compressed", None), getattr(o, "LAMB", None)
    out = {
        "Adam (dense, = 1-bit Adam's warm-up)": lambda p, c: o.OneBitAdam(
            p, lr, betas=betas, weight_decay=wd, compressor="none", freeze_step=steps + 1, comm=c),
        "AdamW (dense)": None if compressed is None else lambda p, c: compressed(
            torch.optim.AdamW(p, lr, betas=betas, weight_decay=wd), compressor="none", comm=c),
        "Compressed(AdamW, topk 1%)": None if compressed is None else lambda p, c: compressed(
            torch.optim.AdamW(p, lr, betas=betas, weight_decay=wd), compressor="topk:ratio=0.01", comm=c),
        f"1-bit Adam (T_w {freeze})": lambda p, c: o.OneBitAdam(
            p, lr, betas=betas, weight_decay=wd, freeze_step=freeze, comm=c),
        "0/1 Adam": lambda p, c: o.ZeroOneAdam(
            p, lr, betas=betas, weight_decay=wd, var_freeze_step=freeze, comm=c),
        f"1-bit LAMB (T_w {freeze})": lambda p, c: o.OneBitLAMB(
            p, args.lamb_lr, betas=betas, weight_decay=wd, freeze_step=freeze, comm=c),
        "LAMB (dense)": None if (compressed is None or lamb is None) else lambda p, c: compressed(
            lamb(p, args.lamb_lr, betas=betas, weight_decay=wd), compressor="none", comm=c),
    }
    return out


def train(comm, make, ds, args, seed: int) -> dict:
    """One run on this worker: ``args.epochs`` epochs, then the workers' average model
    evaluated on the test split (replicas of 0/1 Adam differ between syncs)."""
    model = models.build(args.model, ds.input_shape, ds.num_classes, seed=seed)
    opt = make(list(model.parameters()), comm)
    per_step = args.batch_size
    steps_per_epoch = len(ds.train_x) // comm.world_size // per_step
    for epoch in range(args.epochs):
        order = datasets.shard(len(ds.train_x), comm.rank, comm.world_size, epoch, seed)
        for b in range(steps_per_epoch):
            idx = order[b * per_step:(b + 1) * per_step]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(ds.train_x[idx]), ds.train_y[idx]).backward()
            opt.step()
    sent = opt.bytes_sent
    with torch.no_grad():   # the workers' average (outside the optimizer's byte counters)
        for p in model.parameters():
            p.copy_(comm.allreduce(p.detach().clone()) / comm.world_size)
        out = model(ds.test_x)
        loss = F.cross_entropy(out, ds.test_y).item()
        acc = (out.argmax(1) == ds.test_y).float().mean().item()
    return {"loss": loss, "acc": acc, "bytes": sent, "steps": args.epochs * steps_per_epoch}


def accuracy_part(args) -> str:
    ds = datasets.load(args.dataset)
    steps = args.epochs * (len(ds.train_x) // args.workers // args.batch_size)
    table, missing = [], []
    began = time.perf_counter()
    for label, make in methods(args, steps).items():
        if make is None:
            missing.append(label)
            continue
        runs = []
        for seed in range(args.seeds):
            runs.append(gradzip.simulate(args.workers, lambda comm: train(comm, make, ds, args, seed))[0])
            print(f"{label} seed {seed}: {runs[-1]}", flush=True)
        mean = lambda k: statistics.mean(r[k] for r in runs)
        per_seed = " ".join(f"{r['acc']:.3f}" for r in runs)
        table.append(f"| {label} | {mean('loss'):.3f} | {mean('acc'):.3f} | {per_seed} | {mean('bytes') / 1e6:.2f} |")
    command = "python -m benchmarks.adaptive " + " ".join(sys.argv[1:])
    text = (f"Command: `{command}` ({args.dataset}, {args.model}, {args.workers} workers on threads, "
            f"{args.epochs} epochs = {steps} steps of batch {args.batch_size} per worker, lr {args.lr} "
            f"(LAMB {args.lamb_lr}), weight decay {args.weight_decay}, betas (0.9, 0.98), seeds "
            f"0..{args.seeds - 1}; {(time.perf_counter() - began) / 60:.1f} min). Test loss and accuracy of "
            "the workers' average model after the last step, mean over seeds; MB = bytes this worker put "
            "on the wire.\n\n| method | test loss | test acc | acc per seed | MB sent / worker |\n|---|---|---|---|---|\n"
            + "\n".join(table) + "\n")
    if missing:
        text += f"\nNot in this build of gradzip.optim (left out): {', '.join(missing)}.\n"
    return text


def speed_part(args) -> str:
    algos = {"onebitadam": {"freeze_step": 0}, "zerooneadam": {"var_freeze_step": 0},
             "onebitlamb": {"freeze_step": 0}, "ssgd": {}}

    class AdaptiveNetBench(emulated.NetBench):
        def configs(self, n):
            cfgs = super().configs(n)
            for cfg in cfgs:   # the methods' own options (bench net passes only a codec)
                cfg["options"] = {**cfg["options"], **algos.get(cfg["algo"], {})}
                if cfg["algo"] != "ssgd":
                    cfg["momentum"] = 0.0
            return cfgs

    bench = AdaptiveNetBench(workers=[args.workers], bandwidths=[1e9], latencies=[0.0],
                             algos=[(a, None) for a in algos], model=args.model, shape="2",
                             batch_size=args.batch_size, steps=args.speed_steps, warmup=2,
                             out=args.out)
    results = bench.run(command="python -m benchmarks.adaptive --part speed")
    lines = ["| method | ms/step | compute | compress | communicate | MB sent / worker / step |", "|---|---|---|---|---|---|"]
    for rec in results["records"]:
        for r in rec["runs"]:
            lines.append(f"| {r['method']} | {1e3 * r['iteration_s']:.1f} | {1e3 * r['compute_s']:.1f} | "
                         f"{1e3 * r['compress_s']:.1f} | {1e3 * r['communicate_s']:.1f} | "
                         f"{r['bytes_per_step'] / 1e6:.3f} |")
    return (f"{args.workers} gloo workers in network namespaces, 1 Gbit/s links, {args.model}, batch "
            f"{args.batch_size}, {args.speed_steps} measured steps after 2, compressed stages from step 1 "
            "(Compressed(AdamW) and LAMB are not CLI methods: not measured here).\n\n" + "\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["accuracy", "speed"], default="accuracy")
    ap.add_argument("--dataset", default="modadd:p=97,train=0.5")
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lamb-lr", type=float, default=1e-2)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--freeze-fraction", type=float, default=0.2, help="warm-up steps / all steps")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--speed-steps", type=int, default=10)
    ap.add_argument("--out", default="runs/adaptive-net")
    ap.add_argument("--write", action="store_true", help="update docs/adaptive.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    text = accuracy_part(args) if args.part == "accuracy" else speed_part(args)
    print(text)
    if args.write:
        title = ("Adaptive optimizers on the transformer task" if args.part == "accuracy"
                 else "Adaptive optimizers: time per step on 1 Gbit/s links")
        replace_section(title, text, doc=Path(__file__).resolve().parents[1] / "docs/adaptive.md")


if __name__ == "__main__":
    main()
