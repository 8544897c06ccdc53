"""Two checkouts of gradzip side by side: "fused × copy" of chosen codecs (compress +
decompress with reused buffers, as ``benchmarks.codecs`` measures it) for the package at
``--base`` (another checkout's ``src`` directory) and at ``--head`` (default: this one's).

Each round runs one short process per version, alternating which goes first, and each
process times its codec and ``out.copy_(x)`` interleaved: the ratio is measured side by
side in one process, and a busy machine slows both versions alike. Reported: the median
over rounds of each version's ratio, and its fused compress / decompress ms.

Usage (issue 14, the quantising codecs' before/after)::

    git worktree add /tmp/gz-main main
    python -m benchmarks.codec_versions --base /tmp/gz-main/src --codecs 1bit qsgd terngrad \\
        --sizes 1000000 16000000 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

#: One measurement in a fresh process of one version: JSON {codec: [ratio, compress ms, decompress ms]}.
_ONE = """
import json, statistics, sys, time, torch
torch.set_num_threads(1)
from gradzip.compressors import build
size, repeat, specs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
x = torch.randn(size, generator=torch.Generator().manual_seed(size))
out = torch.empty_like(x)
def med(fn):
    times = []
    for _ in range(repeat):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3
result = {}
for spec in specs:
    codec = build(spec)
    packet = codec.compress(x, 1)
    codec.decompress(packet, out=out)
    copy, comp, dec = [], [], []
    for _ in range(3):  # the copy interleaved with the codec
        copy.append(med(lambda: out.copy_(x)))
        comp.append(med(lambda: codec.compress(x, 1, reuse=packet)))
        dec.append(med(lambda: codec.decompress(packet, out=out)))
    c, d = statistics.median(comp), statistics.median(dec)
    result[spec] = [statistics.median(copy) / (c + d), c, d]
print(json.dumps(result))
"""


def run_version(src: str, size: int, repeat: int, specs: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=src)
    done = subprocess.run([sys.executable, "-c", _ONE, str(size), str(repeat), *specs], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    here = pathlib.Path(__file__).resolve().parent.parent / "src"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the src directory of the version to compare against")
    parser.add_argument("--head", default=str(here), help="the src directory of this version (default: this checkout's)")
    parser.add_argument("--codecs", nargs="+", default=["1bit", "qsgd", "terngrad"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1_000_000, 16_000_000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per median in a process")
    args = parser.parse_args(argv)
    print("| codec | size | base × copy | head × copy | base compress / decompress ms | head compress / decompress ms |")
    print("|---|---:|---:|---:|---|---|")
    for size in args.sizes:
        runs = {"base": [], "head": []}
        for r in range(args.rounds):
            order = ("base", "head") if r % 2 == 0 else ("head", "base")
            for name in order:
                runs[name].append(run_version(getattr(args, name), size, args.repeat, args.codecs))
        for spec in args.codecs:
            cells = {name: [statistics.median(run[spec][i] for run in runs[name]) for i in range(3)]
                     for name in runs}
            b, h = cells["base"], cells["head"]
            print(f"| `{spec}` | {size:,} | {b[0]:.2f} | {h[0]:.2f} | {b[1]:.2f} / {b[2]:.2f} | {h[1]:.2f} / {h[2]:.2f} |")


if __name__ == "__main__":
    main()
