"""Start-up: the wall time of a short ``gradzip train`` and of ``gradzip --help`` against
``python -c "import torch"``, measured side by side (issue 36, item 9).

    python -m benchmarks.startup --rounds 7 --write

Each round runs the three commands one after the other (their order rotates from round
to round), each a fresh process as a user starts it: ``gradzip`` is run as the console
script pip installs (a file that imports the entry point pyproject.toml names), so the
worker processes start as they do for a user. One unmeasured round first fills the caches a user's second
run finds filled (the OS file cache, bytecode, numba's kernel cache). On a shared machine
the times move with the load, so the table gives min and median of each command and three
ratios to ``import torch``: of the minimums, of the medians, and the median over rounds of
each round's own ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:   # Python < 3.11
    import tomli as tomllib

from benchmarks.docs_section import PAGES, host, replace_section

TRAIN = ["train", "--algo", "ssgd", "--workers", "2", "--epochs", "1", "--bandwidth", "none", "--no-plot"]
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def console_script() -> str:
    """The file pip writes for the ``gradzip`` entry point of pyproject.toml (less its argv[0]
    rewrite)."""
    module, function = tomllib.loads(PYPROJECT.read_text())["project"]["scripts"]["gradzip"].split(":")
    return f"import sys\nfrom {module} import {function}\nif __name__ == '__main__':\n    sys.exit({function}())\n"


def commands(script: Path, out: Path) -> dict[str, list[str]]:
    """The three commands by their label."""
    return {
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        "gradzip --help": [sys.executable, str(script), "--help"],
        "gradzip " + " ".join(TRAIN): [sys.executable, str(script), *TRAIN, "--quiet", "--out", str(out)],
    }


def timed(cmd: list[str], env: dict[str, str]) -> float:
    """Wall seconds of ``cmd`` (a failure stops the benchmark with its output)."""
    began = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return seconds


def measure(rounds: int) -> tuple[dict[str, list[float]], list[dict]]:
    """Seconds per command per round, and the train runs' summaries."""
    # an installed package has its bytecode compiled; a developer's PYTHONDONTWRITEBYTECODE
    # would make every run compile gradzip's sources again
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryDirectory() as tmp:
        script, out = Path(tmp) / "gradzip", Path(tmp) / "run"
        script.write_text(console_script())
        cmds = commands(script, out)
        labels = list(cmds)
        for label in labels:   # warm-up round, not counted
            timed(cmds[label], env)
        times: dict[str, list[float]] = {label: [] for label in labels}
        summaries = []
        for r in range(rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                times[label].append(timed(cmds[label], env))
                if label.startswith("gradzip train"):
                    summaries.append(json.loads((out / "summary.json").read_text()))
                print(f"round {r + 1}: {label}: {times[label][-1]:.2f} s", file=sys.stderr)
    return times, summaries


def table(times: dict[str, list[float]], summaries: list[dict]) -> str:
    """The markdown table: min / median seconds and the ratios to ``import torch``: of the
    minimums (the least disturbed runs), of the medians, and the median of each round's own."""
    base = next(iter(times.values()))
    lines = ["| command | min s | median s | min / min of import torch | median / median | "
             "median of per-round ratios |", "|---|---:|---:|---:|---:|---:|"]
    for label, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base)]
        lines.append(f"| `{label}` | {min(ts):.2f} | {statistics.median(ts):.2f} | {min(ts) / min(base):.2f}x | "
                     f"{statistics.median(ts) / statistics.median(base):.2f}x | {statistics.median(ratios):.2f}x |")
    setup = statistics.median(s["setup_time_s"] for s in summaries)
    wall = statistics.median(s["wall_time_s"] for s in summaries)
    return "\n".join(lines) + (f"\n\nInside the train command (medians): each worker's set-up after its imports "
                               f"(`setup_time_s`: data, model, optimizer, settings check) {setup:.2f} s, "
                               f"training and evaluation (`wall_time_s`) {wall:.2f} s.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks/startup.md")
    args = ap.parse_args()
    times, summaries = measure(args.rounds)
    text = (f"Measured by `python -m benchmarks.startup --rounds {args.rounds}{' --write' if args.write else ''}` "
            f"on {host()}: {args.rounds} rounds, "
            f"each running the three commands one after the other in a rotating order, after one unmeasured "
            f"round.\n\n{table(times, summaries)}\n")
    print(text)
    if args.write:
        replace_section("Start-up", text, PAGES / "startup.md")


if __name__ == "__main__":
    main()
