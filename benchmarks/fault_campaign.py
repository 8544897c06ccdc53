"""Kill workers of real torchrun jobs, again and again, and check that nothing is lost.

For each method and repetition: a ``torchrun --max-restarts 3`` job of ``gradzip train
--resume DIR --checkpoint-every N`` on 2 gloo workers; once a random checkpoint (every
10 steps) is on disk, after a random delay of up to 0.1 s (so some kills land while a
checkpoint is being written), one random rank gets SIGKILL (a dead worker) or SIGSTOP (a stuck one, which its peer must
detect within ``--timeout``). The job must complete, and its final checkpoint must equal,
bit for bit, that of the same run never interrupted. It prints (``--write``: into
docs/reliability.md) one row per run and the totals.

    python -m benchmarks.fault_campaign --repeats 3 --write
"""
from __future__ import annotations

import argparse
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.docs_section import DOCS, replace_section
from benchmarks.faults import kill_during
from gradzip.cli import main as gradzip_main
from gradzip.train import checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from checkpoint_diff import differences  # noqa: E402  (test tooling, not shipped)

DOC = DOCS / "reliability.md"
METHODS = ["efsgd", "cdsgd", "powersgd", "cser", "dgc", "localsgd"]


def train_args(algo: str, timeout: float) -> list[str]:
    return ["train", "--algo", algo, "--epochs", "4", "--batch-size", "8", "--checkpoint-every", "10",
            "--quiet", "--no-plot", "--timeout", str(timeout)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--stops", type=int, default=1, help="SIGSTOP runs (stuck worker) in total")
    ap.add_argument("--timeout", type=float, default=10.0, help="--timeout of the jobs (seconds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    rng = random.Random(args.seed)
    methods = args.methods.split(",")
    plan = [(m, signal.SIGKILL) for m in methods for _ in range(args.repeats)]
    plan += [(methods[i % len(methods)], signal.SIGSTOP) for i in range(args.stops)]
    rows, began = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        references = {}
        for method, sig in plan:
            if method not in references:
                ref = Path(tmp) / f"ref-{method}"
                assert gradzip_main([*train_args(method, args.timeout), "--workers", "2",
                                     "--checkpoint-dir", str(ref)]) == 0
                references[method] = ref
            ck = Path(tmp) / f"run-{len(rows)}"
            rank, after, delay = rng.randrange(2), 10 * rng.randint(1, 30), rng.uniform(0.0, 0.1)
            command = [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
                       "--monitor-interval", "0.2", "-m", "gradzip.cli", *train_args(method, args.timeout),
                       "--resume", str(ck)]
            run = kill_during(command, ck, rank=rank, world_size=2, after_step=after, signal=sig,
                              delay_s=delay, timeout_s=600)
            final = checkpoint.steps_held(ck, 0, 2)[-1:]
            identical = run.returncode == 0 and bool(final) and not any(
                differences(checkpoint.load(ck, final[0], r, 2),
                            checkpoint.load(references[method], final[0], r, 2)) for r in range(2))
            named = re.search(r"gradzip: error: (rank \d+: peer rank \d+[^;(]*)", run.stderr)
            rows.append((method, signal.Signals(sig).name, rank, after, round(delay, 2), run.killed_after_step,
                         run.stderr.count("exitcode"), run.returncode, identical,
                         named.group(1).strip() if named else "-", round(run.seconds, 1)))
            print(rows[-1], flush=True)
    lines = [f"`python -m benchmarks.fault_campaign --methods {args.methods} --repeats {args.repeats} "
             f"--stops {args.stops} --timeout {args.timeout:g} --seed {args.seed}` "
             f"({len(rows)} jobs, {time.perf_counter() - began:.0f} s in all):", "",
             "| method | signal | rank | after checkpoint | + delay (s) | newest checkpoint at the fault "
             "| workers failed (torchrun) | job exit | final bits = uninterrupted | survivor's message | job s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    faulted = [r for r in rows if r[5] is not None]
    ok = sum(1 for r in faulted if r[7] == 0 and r[8])
    lines += ["", f"**{ok} of {len(faulted)} jobs hit by a fault completed with the bits of the uninterrupted "
                  f"run**" + (f" ({len(rows) - len(faulted)} ended before the fault could be sent)."
                              if len(rows) > len(faulted) else ".")]
    table = "\n".join(lines)
    print(table)
    if args.write:
        replace_section("Fault campaign", table, doc=DOC)


if __name__ == "__main__":
    main()
