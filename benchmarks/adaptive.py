"""Compressed adaptive optimizers on the transformer task: AdamW (dense), Compressed(AdamW,
topk 1%), 1-bit Adam, 0/1 Adam, 1-bit LAMB and LAMB (dense) (docs/adaptive.md).

Two parts, both on ``modadd`` (modular addition, no file) with the ``transformer`` model:

1. **Accuracy and bytes** (``--part accuracy``): every (method, seed) run is 4 workers on
   threads (``gradzip.simulate``; the numbers are those of gloo), one torch thread; runs go
   ``--jobs`` at a time in separate processes. Final test loss / accuracy of the workers'
   average model (mean and per seed) and the bytes each worker put on the wire.
2. **Time per step** (``--part speed``, needs root): the same six methods as real gloo
   processes in network namespaces with 1 Gbit/s tc-shaped links
   (``gradzip.bench.emulated``, lr 1e-3), the compressed stage measured (the warm-ups
   cover the 2 unmeasured steps: 1-bit Adam / LAMB compress from step 3, 0/1 Adam runs its
   local-step phase, syncing every step as its I_u starts at 1; ε 1e-3); ms/step and the ratio to AdamW (dense) side by side in one run. The emulated bench
   feeds synthetic inputs, which the transformer reads as token ids in ``[0, 10)``.

The methods' exchange is main's: CAR = PSync with the two-phase transport
(``transport="auto"`` means that for 1-bit Adam / 0/1 Adam / 1-bit LAMB). "AdamW (dense)"
is ``torch.optim.AdamW`` in ``Compressed(none)`` (DDP + AdamW, bias-corrected), "LAMB
(dense)" is ``gradzip.optim.LAMB`` in ``Compressed(none)``.

Every part writes a JSON file (``--json``); ``--from FILE --write`` turns one into the
docs' section without running anything::

    python -m benchmarks.adaptive --part accuracy --jobs 16 --json runs/adaptive.json --write
    python -m benchmarks.adaptive --part speed --json runs/adaptive-speed.json --write   # root
    python -m benchmarks.adaptive --from runs/adaptive.json --write
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks import grid
from benchmarks.docs_section import DOCS, replace_section

import gradzip
from gradzip.bench import emulated
from gradzip.train import datasets, models

ADAPTIVE_DOC = DOCS / "adaptive.md"
BETAS = (0.9, 0.98)
TITLES = {"accuracy": "Adaptive optimizers on the transformer task",
          "speed": "Adaptive optimizers: time per step on 1 Gbit/s links"}

#: key -> (label, CLI algo, codec of the CLI algo) for the speed part; the order of the tables
METHODS = {
    "adamw": ("AdamW (dense)", "adamw", None),
    "adamw-topk": ("Compressed(AdamW, topk 1%)", "adamw", "topk:ratio=0.01"),
    "onebitadam": ("1-bit Adam", "onebitadam", None),
    "zerooneadam": ("0/1 Adam", "zerooneadam", None),
    "onebitlamb": ("1-bit LAMB", "onebitlamb", None),
    "lamb": ("LAMB (dense)", "lamb", None),
}


def make_optimizer(key: str, params, comm, s: dict, steps: int):
    """The method ``key`` with the settings ``s`` (a run's of ``steps`` steps): ``eps`` for
    every row where given (else each optimizer's own: 1e-8, LAMB 1e-6), ``momentum_mask`` and
    ``momentum_bound`` for the three 1-bit methods (older result files: defaults)."""
    o, lr, wd = gradzip.optim, s["lr"], s["weight_decay"]
    freeze = max(1, int(s["freeze_fraction"] * steps))
    adam = dict(betas=BETAS, weight_decay=wd, **({"eps": s["eps"]} if s.get("eps") is not None else {}))
    onebit = dict(adam, comm=comm, momentum_mask=s.get("momentum_mask", "off"),
                  momentum_bound=s.get("momentum_bound", False))
    if key == "adamw":
        return o.Compressed(torch.optim.AdamW(params, lr, **adam), compressor="none", comm=comm)
    if key == "adamw-topk":
        return o.Compressed(torch.optim.AdamW(params, lr, **adam), compressor="topk:ratio=0.01", comm=comm)
    if key == "onebitadam":
        return o.OneBitAdam(params, lr, freeze_step=freeze, **onebit)
    if key == "zerooneadam":
        return o.ZeroOneAdam(params, lr, var_freeze_step=freeze, **onebit)
    if key == "onebitlamb":
        return o.OneBitLAMB(params, s["lamb_lr"], freeze_step=freeze, **onebit)
    if key == "lamb":
        return o.Compressed(o.LAMB(params, s["lamb_lr"], **adam), compressor="none", comm=comm)
    raise ValueError(key)


def train(comm, key: str, ds, s: dict, seed: int) -> dict:
    """One run on this worker: ``s["epochs"]`` epochs, then the workers' average model
    evaluated on both splits (replicas of 0/1 Adam differ between syncs)."""
    model = models.build(s["model"], ds.input_shape, ds.num_classes, seed=seed)
    per_step = s["batch_size"]
    steps_per_epoch = len(ds.train_x) // comm.world_size // per_step
    opt = make_optimizer(key, list(model.parameters()), comm, s, s["epochs"] * steps_per_epoch)
    for epoch in range(s["epochs"]):
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
        train_acc = (model(ds.train_x).argmax(1) == ds.train_y).float().mean().item()
    return {"loss": F.cross_entropy(out, ds.test_y).item(), "acc": (out.argmax(1) == ds.test_y).float().mean().item(),
            "train_acc": train_acc, "bytes": sent, "steps": s["epochs"] * steps_per_epoch}


def run_one(task: tuple[str, int, dict]) -> dict:
    """One (method, seed) run of the accuracy part: ``s["workers"]`` workers on threads."""
    key, seed, s = task
    ds = datasets.load(s["dataset"])
    began = time.perf_counter()
    out = gradzip.simulate(s["workers"], lambda comm: train(comm, key, ds, s, seed))[0]
    return {"method": key, "seed": seed, **out, "wall_s": time.perf_counter() - began}


def accuracy_part(args, settings: dict) -> dict:
    tasks = [(key, seed, settings) for key in args.methods for seed in range(args.first_seed, args.first_seed + args.seeds)]
    began = time.perf_counter()

    def report(task, r):
        print(f"{METHODS[task[0]][0]} seed {task[1]}: test acc {r['acc']:.3f} loss {r['loss']:.3f} "
              f"train acc {r['train_acc']:.3f} ({r['wall_s']:.0f} s)", flush=True)

    runs = grid.run_grid(run_one, tasks, args.jobs, report)
    return grid.save(args.json, settings, runs, began, part="accuracy", command=_command())


def accuracy_table(res: dict) -> str:
    s, runs = res["settings"], res["runs"]
    steps = runs[0]["steps"] if runs else 0
    rows = []
    for key, (label, _, _) in METHODS.items():
        mine = sorted((r for r in runs if r["method"] == key), key=lambda r: r["seed"])
        if not mine:
            continue
        mean = lambda k: statistics.mean(r[k] for r in mine)   # noqa: E731
        accs = [r["acc"] for r in mine]
        rows.append(f"| {label} | {mean('loss'):.3f} | {mean('acc'):.3f} | {min(accs):.3f} | "
                    f"{' '.join(f'{a:.3f}' for a in accs)} | {mean('train_acc'):.3f} | {mean('bytes') / 1e6:.2f} |")
    seeds = sorted({r["seed"] for r in runs})
    return (f"Command: `{res.get('command', '')}` ({s['dataset']}, {s['model']}, {s['workers']} workers on threads "
            f"per run, {s['epochs']} epochs = {steps} steps of batch {s['batch_size']} per worker, lr {s['lr']} "
            f"(LAMB {s['lamb_lr']}), weight decay {s['weight_decay']}, betas {BETAS}, eps {s.get('eps') or 'the default (1e-8, LAMB 1e-6)'}, "
            f"the 1-bit methods' momentum mask {s.get('momentum_mask', 'off')} and bound "
            f"{'on' if s.get('momentum_bound') else 'off'}, warm-ups (T_w, 0/1 Adam's "
            f"T_v) {s['freeze_fraction']:.0%} of the steps, seeds {', '.join(map(str, seeds))}; "
            f"{res['wall_s'] / 60:.1f} min wall). Test loss and accuracy of the workers' average model after the "
            "last step (mean over seeds, and the worst seed); MB = bytes one worker put on the wire.\n\n"
            "| method | test loss | test acc | worst seed | acc per seed | train acc | MB sent / worker |\n"
            "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


#: Unmeasured steps of the speed part: 2 dense (the methods' warm-ups), then 2 compressed, in
#: which each process loads its codec kernels (numba: ~1 s the first time), out of the timings.
WARMUP_STEPS = 4


def speed_part(args, settings: dict) -> dict:
    chosen = {key: METHODS[key] for key in args.methods}
    # the dense warm-up covers the bench's 2 unmeasured steps (from v = 0 the first compressed
    # step divides by ε alone and overflows), ε 1e-3 for the coordinates v leaves at 0
    own = {"onebitadam": {"freeze_step": 2, "eps": 1e-3}, "zerooneadam": {"var_freeze_step": 2, "eps": 1e-3},
           "onebitlamb": {"freeze_step": 2, "eps": 1e-3}}

    class AdaptiveNetBench(emulated.NetBench):
        def configs(self, n):
            cfgs = super().configs(n)
            for cfg in cfgs:   # the methods' own options (bench net passes only a codec); β1 is their momentum
                cfg["options"] = {**cfg["options"], **own.get(cfg["algo"], {})}
                cfg["momentum"], cfg["lr"] = 0.0, 1e-3
            return cfgs

    began = time.perf_counter()
    bench = AdaptiveNetBench(workers=[args.workers], bandwidths=[1e9], latencies=[0.0],
                             algos=[(algo, codec) for _, algo, codec in chosen.values()], model=args.model, shape="2",
                             batch_size=args.batch_size, steps=args.speed_steps, warmup=WARMUP_STEPS, out=args.out)
    results = bench.run(command=_command())
    runs = []
    for rec in results["records"]:
        for (key, _), r in zip(chosen.items(), rec["runs"]):   # the runs come in the order of the algos
            runs.append({"method": key, "bench_label": r["method"], "iteration_s": r["iteration_s"],
                         "compute_s": r["compute_s"], "compress_s": r["compress_s"],
                         "communicate_s": r["communicate_s"], "bytes_per_step": r["bytes_per_step"]})
    return grid.save(args.json, settings, runs, began, part="speed", command=_command())


def speed_table(res: dict) -> str:
    s, runs = res["settings"], res["runs"]
    base = next((r["iteration_s"] for r in runs if r["method"] == "adamw"), None)
    lines = ["| method | ms/step | × AdamW (dense) | compute | compress | communicate | MB sent / worker / step |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        ratio = f"{r['iteration_s'] / base:.2f}" if base else "-"
        lines.append(f"| {METHODS[r['method']][0]} | {1e3 * r['iteration_s']:.1f} | {ratio} | {1e3 * r['compute_s']:.1f} | "
                     f"{1e3 * r['compress_s']:.1f} | {1e3 * r['communicate_s']:.1f} | {r['bytes_per_step'] / 1e6:.3f} |")
    return (f"Command: `{res.get('command', '')}`: {s['workers']} gloo workers in network namespaces, 1 Gbit/s links, "
            f"{s['model']}, batch {s['batch_size']}, lr 1e-3, {s['speed_steps']} measured steps after {WARMUP_STEPS} "
            "unmeasured ones (2 dense warm-up steps, then 2 compressed ones that load the codec kernels), compressed stages from step 3 (ε 1e-3; 0/1 Adam: its local-step phase with I_u = 1, a sync every step); times in ms per step "
            "(compute / compress / communicate: the mean over steps of each phase); MB / step: the optimizer's "
            "bytes over all steps, the 2 dense warm-up steps included (the compressed stage alone sends less).\n\n" + "\n".join(lines) + "\n")


def _command() -> str:
    return "python -m benchmarks.adaptive " + " ".join(sys.argv[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["accuracy", "speed"], default="accuracy")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of: " + ", ".join(METHODS))
    ap.add_argument("--dataset", default="modadd:p=31,train=0.9")
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lamb-lr", type=float, default=1e-2)
    ap.add_argument("--weight-decay", type=float, default=1.0)
    ap.add_argument("--eps", type=float, default=None, help="every row's epsilon (default: each optimizer's own)")
    ap.add_argument("--momentum-mask", choices=["off", "auto"], default="off",
                    help="the 1-bit methods' momentum mask (gradzip.optim.onebit)")
    ap.add_argument("--momentum-bound", action="store_true",
                    help="the 1-bit methods' momentum bound (gradzip.optim.onebit)")
    ap.add_argument("--section", default=None, help="the docs/adaptive.md section --write replaces "
                                                    "(default: the part's own)")
    ap.add_argument("--freeze-fraction", type=float, default=0.2, help="warm-up steps / all steps")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="(method, seed) runs in parallel processes")
    ap.add_argument("--speed-steps", type=int, default=10)
    ap.add_argument("--out", default="runs/adaptive-net", help="the speed part's per-rank files")
    ap.add_argument("--json", default=None, help="results file (default runs/adaptive-<part>.json)")
    ap.add_argument("--from", dest="source", help="tabulate an earlier results file, run nothing")
    ap.add_argument("--write", action="store_true", help="update docs/adaptive.md")
    args = ap.parse_args()
    if args.source:
        res = grid.load(args.source)
    else:
        args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in args.methods if m not in METHODS]
        if unknown:
            ap.error(f"unknown --methods {', '.join(unknown)}; choose from {', '.join(METHODS)}")
        args.json = args.json or f"runs/adaptive-{args.part}.json"
        torch.set_num_threads(1)
        settings = {k: v for k, v in vars(args).items() if k not in ("source", "write", "json", "out", "jobs", "section")}
        res = (accuracy_part if args.part == "accuracy" else speed_part)(args, settings)
        print(f"results: {args.json}")
    text = accuracy_table(res) if res["part"] == "accuracy" else speed_table(res)
    print(text)
    if args.write:
        replace_section(args.section or TITLES[res["part"]], text, doc=ADAPTIVE_DOC)


if __name__ == "__main__":
    main()
