"""PowerSGD step time: gradzip's DDP hook against PyTorch's ``powerSGD_hook``, side by side.

Two gloo processes on this machine train the same model under DistributedDataParallel
(same bucket layout, same options: ``start_iter`` 2, warm start, error feedback,
``min_compression_rate`` 2), alternating in every round between:

* ``ddp``: DDP's default allreduce (no hook), for scale;
* ``torch``: ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``, unmodified;
  per bucket three allreduces back to back (uncompressed tensors, P, Q), the later ones
  issued from future callbacks. With more than one DDP bucket it aborts on gloo here
  (below), so it is timed with ONE bucket (``bucket_cap_mb`` 1000);
* ``torch-serial``: the same hook with each bucket's future waited for inside the hook
  (the same numbers, no abort), for the layout with several buckets;
* ``gradzip``: ``gradzip.integrations.ddp.powersgd_hook`` (uncompressed tensors fused with P: two
  rounds per bucket; bucket b's P round overlaps backward, its Q round overlaps bucket
  b+1's P round; every collective issued from the hook's thread in bucket order);
* ``gradzip-sync``: the same with ``overlap=False`` (each bucket finished inside its own
  hook call): the effect of the overlap alone.

Reported: the median step time (forward + backward + hook + SGD step, after the dense
warm-up steps) over the rounds, and ratios against ``torch``, per PowerSGD rank. The
machine is shared and noisy: only ratios measured in the same run mean anything.

``--probe N`` first runs the unmodified PyTorch hook N times with several buckets (a few
compressed steps each) and counts the runs gloo aborts ("Received data size doesn't match
expected size": its callbacks issue collectives in a different order on the two ranks,
see gradzip.integrations.ddp).

    python -m benchmarks.powersgd_vs_torch --ranks 1 2 4 --write
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.docs_section import PAGES, replace_section

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

#: layout -> (bucket_cap_mb, implementations timed)
LAYOUTS = {"1 bucket": (1000.0, ("ddp", "torch", "gradzip", "gradzip-sync")),
           "several buckets": (None, ("ddp", "torch-serial", "gradzip", "gradzip-sync"))}


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 32, 3), nn.ReLU(), nn.Flatten(),
        nn.Linear(32 * 24 * 24, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def serial(hook):
    def run(state, bucket):
        fut = hook(state, bucket)
        fut.wait()
        return fut
    return run


def build(impl, r, width, cap):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradzip.integrations.ddp

    ddp = DDP(make_model(width), bucket_cap_mb=cap)
    state = None
    if impl.startswith("torch"):
        state = torch_psgd.PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=2,
                                         min_compression_rate=2, random_seed=0)
        hook = torch_psgd.powerSGD_hook
        ddp.register_comm_hook(state, serial(hook) if impl == "torch-serial" else hook)
    elif impl.startswith("gradzip"):
        state = gradzip.integrations.ddp.PowerSGDState(rank=r, start_iter=2, min_compression_rate=2, random_seed=0,
                                          model=ddp, overlap=(impl == "gradzip"))
        def counting(st, bucket):
            state.buckets_seen = max(getattr(state, "buckets_seen", 0), bucket.index() + 1)
            return gradzip.integrations.ddp.powersgd_hook(st, bucket)
        ddp.register_comm_hook(state, counting)
    return ddp, state


def worker(comm, layouts, ranks, rounds, steps, width, batch):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(comm.rank)
    data = [(torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(4)]
    times, buckets = {}, {}
    for rnd in range(rounds):
        for layout, (cap, impls) in layouts.items():
            for r in ranks:
                for impl in (impls if rnd % 2 == 0 else tuple(reversed(impls))):
                    ddp, state = build(impl, r, width, cap)
                    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

                    def step(i):
                        x, y = data[i % len(data)]
                        opt.zero_grad()
                        F.cross_entropy(ddp(x), y).backward()
                        opt.step()

                    for i in range(4):   # 2 dense steps, then the first compressed ones (Q drawn)
                        step(i)
                    dist.barrier()
                    t0 = time.perf_counter()
                    for i in range(steps):
                        step(i)
                    dist.barrier()
                    times.setdefault((layout, r, impl), []).append((time.perf_counter() - t0) / steps)
                    if impl == "gradzip":
                        buckets[layout] = state.buckets_seen
    return times, buckets


def probe(comm, width, batch, steps=4):
    """The unmodified PyTorch hook with several buckets, a few compressed steps."""
    ddp, _ = build("torch", 1, width, None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(2 + steps):
        x, y = torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--probe", type=int, default=3, help="unmodified PyTorch runs with several buckets")
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks/step-vs-ddp.md")
    args = ap.parse_args()

    from gradzip.comm.launch import WorkerError, run_processes

    aborts, messages = 0, set()
    for _ in range(args.probe):
        try:
            run_processes(2, probe, args.width, args.batch)
        except WorkerError as exc:
            aborts += 1
            text = str(exc)
            messages.add("a worker killed by SIGABRT; its stderr: gloo \"Received data size doesn't match "
                         "expected size\"" if ("code -6" in text or "Connection reset" in text or "Received data size" in text) else "a worker failed: " + text.strip().splitlines()[-1][:120])
    print(f"unmodified PyTorch hook, several buckets: {aborts} of {args.probe} runs aborted {sorted(messages)}",
          flush=True)

    times, buckets = run_processes(2, worker, LAYOUTS, args.ranks, args.rounds, args.steps, args.width, args.batch)[0]
    params = sum(p.numel() for p in make_model(args.width).parameters())
    sections = []
    for layout, (_, impls) in LAYOUTS.items():
        ref = impls[1]
        rows = []
        for r in args.ranks:
            med = {impl: statistics.median(times[(layout, r, impl)]) for impl in impls}
            rows.append(f"| {r} | " + " | ".join(f"{1e3 * med[i]:.1f}" for i in impls)
                        + f" | **{med['gradzip'] / med[ref]:.2f}** | {med['gradzip-sync'] / med[ref]:.2f}"
                        + f" | {med['gradzip'] / med['gradzip-sync']:.2f} |")
            print(layout, rows[-1], flush=True)
        header = ("| PowerSGD rank | " + " | ".join(f"{i} ms/step" for i in impls)
                  + f" | gradzip / {ref} | gradzip-sync / {ref} | overlap effect: gradzip / gradzip-sync |")
        sections.append(f"**{layout}** ({buckets.get(layout, '?')} DDP buckets per step)\n\n"
                        + "\n".join([header, "|" + "---|" * (len(impls) + 4), *rows]))
    command = "python -m benchmarks.powersgd_vs_torch " + " ".join(sys.argv[1:])
    text = (f"Command: `{command}` (2 gloo processes on this 2-core machine, 1 torch thread each; "
            f"model: 2 convs + 4 linears, {params / 1e6:.1f}M parameters, batch {args.batch} per worker; "
            f"options start_iter 2, warm start, error feedback, min_compression_rate 2; median over "
            f"{args.rounds} interleaved rounds of {args.steps} compressed steps; lower is better).\n\n"
            f"PyTorch's unmodified hook with several buckets: **{aborts} of {args.probe} runs aborted** "
            f"({'; '.join(sorted(messages)) or 'none'}), so with several buckets it is timed as "
            "`torch-serial` (each bucket's future waited for in the hook: same numbers, no overlap "
            "between buckets), and unmodified only with one bucket. With one bucket, `gradzip` and "
            "`gradzip-sync` do exactly the same work (the last bucket finishes everything), so their ratio "
            "there is this run's noise level.\n\n" + "\n\n".join(sections) + "\n")
    print(text)
    if args.write:
        replace_section("PowerSGD: gradzip DDP hook vs PyTorch's powerSGD_hook", text, PAGES / "step-vs-ddp.md")


if __name__ == "__main__":
    main()
