"""Bytes per worker per step of BIT-SGD, CD-SGD and EF-SGD (1bit, topk 1%) at n = 8 and
n = 256 under a transport: the two-phase compressed allreduce should stay flat in n
(target: n=256 at most 1.15x n=8; docs/algorithms.md §Transports of PSync).

Each method's own ``step()`` runs on a ``RecordingGroup`` (gradzip.bench.profiling): at 8
workers in full, at 256 as a dry run at the real count (nothing sent, every byte counted).

    python -m benchmarks.twophase_bytes --transport twophase --model resnet50 [--bucket-mb 16]

Two-phase slices each bucket of the plan into n slices, so the per-slice overhead of a codec
(1bit: two fp32 means per slice) grows with n / bucket size; the factor 2(n-1)/n alone is
1.138 between n = 8 and n = 256.
"""
from __future__ import annotations

import argparse

from gradzip.bench.profiling import profile_method
from gradzip.bench.shapes import resnet50_shapes

METHODS = [("BIT-SGD", "bitsgd", {}), ("CD-SGD", "cdsgd", {}), ("EF-SGD 1bit", "efsgd", {"compressor": "1bit"}),
           ("EF-SGD topk 1%", "efsgd", {"compressor": "topk:ratio=0.01"})]
SMALL_CNN = [(64, 3, 3, 3), (64,), (128, 64, 3, 3), (128,), (256, 128, 3, 3), (256,), (512, 256, 3, 3), (512,),
             (10, 512), (10,)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", default="twophase", choices=["auto", "allreduce", "allgather", "twophase"])
    ap.add_argument("--model", default="resnet50", choices=["resnet50", "small-cnn"])
    ap.add_argument("--workers", type=int, nargs=2, default=[8, 256])
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="every method's bucket_bytes in MiB (default: the methods' default, 4)")
    args = ap.parse_args()
    shapes = resnet50_shapes() if args.model == "resnet50" else SMALL_CNN
    small, large = args.workers
    bucket = {} if args.bucket_mb is None else {"bucket_bytes": int(args.bucket_mb * (1 << 20))}
    print(f"| method | n={small} bytes | n={large} bytes | ratio |  ({args.model}, transport={args.transport}, "
          f"buckets {args.bucket_mb or 4:g} MiB)")
    for label, algo, options in METHODS:
        options = {**options, "transport": args.transport, **bucket}
        sent = [profile_method(algo, options, shapes, n, steps=1, warmup=0, time_at_most=small).wire_bytes_per_step
                for n in (small, large)]
        print(f"| {label} | {sent[0]:.0f} | {sent[1]:.0f} | {sent[1] / sent[0]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
