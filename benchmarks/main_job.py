"""Wall time of the main job: ``gradzip compare`` on digits, 4 worker processes, the
default methods, timed end to end as a user runs it (process start-up included).

    python -m benchmarks.main_job --write
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.docs_section import PAGES, host, replace_section


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks/main-job.md")
    ap.add_argument("extra", nargs="*", help="extra flags for gradzip compare")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "gradzip.cli", "compare", "--quiet", "--out", out, *args.extra]
        began = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - began
        summaries = json.loads((Path(out) / "summary.json").read_text())
    printed = "\n".join(line for line in proc.stdout.strip().splitlines() if not line.startswith("wrote "))
    shown = "gradzip compare " + " ".join(["--out", "runs/compare", *args.extra])
    text = (f"`{shown}` (defaults: digits, mlp, 4 gloo worker processes, {summaries[0]['epochs']} epochs, "
            f"{len(summaries)} methods) took **{wall:.1f} s** wall time end to end, measured by "
            f"`python -m benchmarks.main_job --write` on {host()}. Its printed table:\n\n```\n{printed}\n```\n")
    print(text)
    if args.write:
        replace_section("Main job wall time", text, PAGES / "main-job.md")


if __name__ == "__main__":
    main()
