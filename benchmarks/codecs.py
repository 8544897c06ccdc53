"""Codec throughput: compress + decompress of a float32 tensor, next to ``torch.clone``.

For every registered codec (default parameters; ratio 0.01 for the sparsifiers) and each
size, measures the median time of ``compress`` and of ``decompress`` over ``--repeat``
rounds, interleaved (one round runs every codec once, in a rotating order, so a noisy
machine slows all of them alike), and reports

* GB/s = fp32 input bytes / median(compress + decompress),
* "× clone" = that throughput over ``torch.clone``'s (a memory-bandwidth reference: one read
  and one write of the tensor; above 1 means faster than a copy),
* wire / fp32 = measured ``packet.nbytes`` over the fp32 input bytes.

Usage::

    python -m benchmarks.codecs --sizes 1000000 16000000 --repeat 7 --out docs/benchmarks.md

Without ``--out`` the markdown is printed; with it, the "## Codecs" section of that file
is replaced (or appended, or the file created).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

from benchmarks.docs_section import replace_section
from gradzip.compressors import build, names

SPARSE = {"topk", "randomk", "randblock"}


def codec_specs() -> list[str]:
    return [f"{n}:ratio=0.01" if n in SPARSE else n for n in names()]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(size: int, repeat: int, device: torch.device) -> list[dict]:
    gen = torch.Generator().manual_seed(size)
    x = torch.randn(size, generator=gen).to(device)
    codecs = {spec: build(spec) for spec in codec_specs()}
    times: dict[str, list[tuple[float, float]]] = {"clone": []}
    wire: dict[str, int] = {}
    for spec, c in codecs.items():  # warm-up (allocator, LUT caches) and wire size
        wire[spec] = c.compress(x, seed=0).nbytes
        c.decompress(c.compress(x, seed=0))
        times[spec] = []
    x.clone()
    order = ["clone", *codecs]
    for r in range(repeat):
        shift = r % len(order)
        for spec in order[shift:] + order[:shift]:
            _sync(device)
            t0 = time.perf_counter()
            if spec == "clone":
                x.clone()
                _sync(device)
                t1 = t2 = time.perf_counter()
            else:
                packet = codecs[spec].compress(x, seed=r)
                _sync(device)
                t1 = time.perf_counter()
                codecs[spec].decompress(packet)
                _sync(device)
                t2 = time.perf_counter()
            times[spec].append((t1 - t0, t2 - t1))
    rows = []
    clone_s = statistics.median(a + b for a, b in times["clone"])
    for spec in order:
        total = statistics.median(a + b for a, b in times[spec])
        rows.append(
            {
                "codec": "torch.clone (reference)" if spec == "clone" else spec,
                "compress_ms": statistics.median(a for a, _ in times[spec]) * 1e3,
                "decompress_ms": statistics.median(b for _, b in times[spec]) * 1e3,
                "gbps": 4 * size / total / 1e9,
                "vs_clone": clone_s / total,
                "wire": 1.0 if spec == "clone" else wire[spec] / (4 * size),
            }
        )
    return rows


def markdown(results: dict[tuple[int, int], list[dict]], command: str, device: torch.device) -> str:
    lines = [
        "Compress + decompress of one float32 tensor (median of interleaved repeats), next to",
        "`torch.clone` of the same tensor as the memory-bandwidth reference. GB/s = fp32 input",
        "bytes / median(compress + decompress); × clone = codec throughput / clone throughput;",
        "wire / fp32 = measured `packet.nbytes` / input bytes. `none` does no work (its wire is",
        "the input itself), so its row only measures call overhead; `powersgd` sends 1-D tensors "
        "dense (algorithms.md §codec: powersgd), so on this flat input it measures only its pass-through. "
        "With several threads on a",
        "machine that other jobs oversubscribe, every parallel torch op can wait for a",
        "descheduled thread (clone's time at 1M elements shows one such wait), so those times",
        "mostly count ops; the 1-thread tables then show the codecs' own cost. Produced by:",
        "",
        "```",
        command,
        "```",
        "",
        f"torch {torch.__version__}, device {device}, Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs visible, load average "
        f"{os.getloadavg()[0]:.1f} when it finished (other jobs share this machine).",
    ]
    for (threads, size), rows in results.items():
        lines += [
            "",
            f"### {size:,} elements ({4 * size / 1e6:.0f} MB fp32), {threads} torch thread{'s' if threads > 1 else ''}",
            "",
            "| codec | compress ms | decompress ms | GB/s | × clone | wire / fp32 |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| `{r['codec']}` | {r['compress_ms']:.2f} | {r['decompress_ms']:.2f} | "
                f"{r['gbps']:.2f} | {r['vs_clone']:.2f} | {r['wire']:.4f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 16_000_000])
    ap.add_argument("--repeat", type=int, default=7, help="interleaved rounds; the median is reported")
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="torch.set_num_threads values to measure one after the other (default: torch's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="markdown file whose '## Codecs' section to write")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    command = "python -m benchmarks.codecs " + " ".join(sys.argv[1:] if argv is None else argv)
    results = {}
    for threads in args.threads or [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        for size in args.sizes:
            results[threads, size] = measure(size, args.repeat, device)
    text = markdown(results, command.strip(), device)
    print("## Codecs\n\n" + text)
    if args.out:
        replace_section("Codecs", text, doc=args.out)


if __name__ == "__main__":
    main()
