"""Damage checkpoint files between a run and its resume, and check that nothing is lost.

For each scenario and repetition: a copy of one prepared checkpoint directory (``gradzip
train --workers 2``, gloo, 2 epochs of digits, ``--checkpoint-every 7``: steps 42 and 44
kept), the damage applied, then ``gradzip train --resume DIR --epochs 3`` (a separate
process, so its exit code and stderr are the user's). Checked, per job: the exit code and
the step resumed from against the scenario's expectation; exactly one ``gradzip:`` line on
stderr and no traceback; nothing lost: every file the resume rejected is still on disk
(renamed ``*.rejected-*``, same bytes), a refused resume left the directory byte for byte
as it was, and a completed one ends with the bits of the uninterrupted 3-epoch run
(``tests/checkpoint_diff.differences``). It prints (``--write``: into docs/reliability.md)
one row per job and the totals.

    python -m benchmarks.damage_campaign --repeats 2 --write
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.docs_section import replace_section
from gradzip.train import checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from checkpoint_diff import differences  # noqa: E402  (test tooling, not shipped)

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
TRAIN = ["train", "--algo", "efsgd", "--workers", "2", "--checkpoint-every", "7", "--quiet", "--no-plot",
         "--bandwidth", "none", "--timeout", "60"]
NEWEST, BEFORE, FINAL = 44, 42, 66


def gradzip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradzip.cli", *TRAIN, *args], capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _regenerate_checksum(path: Path) -> None:
    checkpoint.checksum_file(path).write_text(f"{checkpoint.sha256(path)}  {path.name}\n")


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def _file(ck: Path, step: int, rank: int) -> Path:
    return checkpoint.rank_file(ck, step, rank, 2)


def _swap(ck: Path, other: Path) -> None:
    a, b = _file(ck, NEWEST, 0), _file(ck, NEWEST, 1)
    a.rename(a.with_name("swap")), b.rename(a), a.with_name("swap").rename(b)
    _regenerate_checksum(a), _regenerate_checksum(b)


def _empty(ck: Path, other: Path) -> None:
    _file(ck, NEWEST, 1).write_bytes(b"")
    _regenerate_checksum(_file(ck, NEWEST, 1))


def _copied_from_another_run(ck: Path, other: Path) -> None:
    for path in (_file(other, NEWEST, 1), checkpoint.checksum_file(_file(other, NEWEST, 1))):
        shutil.copy2(path, _file(ck, NEWEST, 1).with_name(path.name))


def _both_steps_damaged(ck: Path, other: Path) -> None:
    _flip(_file(ck, NEWEST, 0)), _flip(_file(ck, BEFORE, 1))


def _rank_files_missing(ck: Path, other: Path) -> None:
    for step in (BEFORE, NEWEST):
        for path in (_file(ck, step, 1), checkpoint.checksum_file(_file(ck, step, 1))):
            path.unlink()


#: name -> (damage, extra flags, expected exit code, expected step resumed from, a phrase of the one line)
SCENARIOS = {
    "none (control)": (lambda ck, other: None, [], 0, NEWEST, None),
    "rank 1's .sha256 of the newest step removed": (
        lambda ck, other: checkpoint.checksum_file(_file(ck, NEWEST, 1)).unlink(), [], 0, BEFORE, "no checksum file"),
    "a byte of rank 1's newest .pt flipped": (lambda ck, other: _flip(_file(ck, NEWEST, 1)), [], 0, BEFORE,
                                              "does not match its SHA-256"),
    "rank 1's newest .pt emptied, checksum regenerated": (_empty, [], 0, BEFORE, "does not load"),
    "rank 0's and rank 1's newest .pt swapped, checksums regenerated": (_swap, [], 0, BEFORE, "not its own"),
    "rank 1's newest files copied from another run": (_copied_from_another_run, [], 0, BEFORE, "another run"),
    "both kept steps damaged": (_both_steps_damaged, [], 2, None, "no step that every rank holds is sound"),
    "both kept steps damaged, --start-over-if-damaged": (_both_steps_damaged, ["--start-over-if-damaged"], 0, None,
                                                         "starting from scratch"),
    "rank 1's files all removed": (_rank_files_missing, [], 2, None, "hold no step in common"),
}


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _unsound(ck: Path) -> list[str]:
    """The rank files a resume must reject: those :func:`checkpoint.examine` finds unsound,
    and those of another run than rank 0's file of the same step."""
    bad = []
    for step in (BEFORE, NEWEST):
        found = [checkpoint.examine(ck, step, r, 2) if _file(ck, step, r).is_file() else None for r in range(2)]
        for r, f in enumerate(found):
            if f is not None and (f.code or (found[0] is not None and not found[0].code
                                             and f.identity[0] != found[0].identity[0])):
                bad.append(str(_file(ck, step, r).relative_to(ck)))
    return bad


def _nothing_lost(before: dict[str, bytes], unsound: list[str], ck: Path, code: int, reference: Path) -> bool:
    """A refused resume changed nothing; a completed one kept every unsound file (renamed,
    same bytes) and ends with the uninterrupted run's bits."""
    after = _tree(ck)
    if code != 0:
        return after == before
    kept = all(any(name.startswith(old + ".rejected-") and data == before[old] for name, data in after.items())
               for old in unsound)
    return kept and all(not differences(checkpoint.load(ck, FINAL, r, 2), checkpoint.load(reference, FINAL, r, 2))
                        for r in range(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    rows, began = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for name, epochs in (("prepared", 2), ("other", 2), ("reference", 3)):
            done = gradzip("--epochs", str(epochs), "--checkpoint-dir", str(tmp / name))
            assert done.returncode == 0, done.stderr[-2000:]
        for repeat in range(args.repeats):
            for scenario, (damage, flags, code, resumed, phrase) in SCENARIOS.items():
                ck = tmp / f"job-{len(rows)}"
                shutil.copytree(tmp / "prepared", ck)
                damage(ck, tmp / "other")
                before, unsound = _tree(ck), _unsound(ck)
                out = tmp / f"out-{len(rows)}"
                run = gradzip("--epochs", "3", "--resume", str(ck), "--out", str(out), *flags)
                lines = [line for line in run.stderr.splitlines() if line.startswith("gradzip:")]
                summary = json.loads((out / "summary.json").read_text()) if run.returncode == 0 else {}
                got = summary.get("resumed_from_step")
                one_line = len(lines) == (0 if phrase is None else 1) and "Traceback" not in run.stderr and (
                    phrase is None or phrase in lines[0])
                ok = run.returncode == code and got == resumed and one_line
                lost = not _nothing_lost(before, unsound, ck, run.returncode, tmp / "reference")
                said = lines[0].replace(str(ck), "DIR") if lines else "-"
                rows.append((scenario, run.returncode, got if run.returncode == 0 else "-", ok, "no" if not lost
                             else "YES", said if len(said) <= 160 else said[:160] + " ..."))
                print(rows[-1], flush=True)
    lines = [f"`python -m benchmarks.damage_campaign --repeats {args.repeats}` ({len(rows)} jobs, "
             f"{time.perf_counter() - began:.0f} s in all; 2 gloo workers, EF-SGD, steps {BEFORE} and {NEWEST} kept, "
             f"resumed to step {FINAL}):", "",
             "| damage before `--resume` | exit | resumed from | as expected | lost | the one `gradzip:` line |",
             "|---|---:|---:|---|---|---|"]
    lines += ["| " + " | ".join(str(x).replace("|", "\\|") for x in row) + " |" for row in rows]
    good = sum(1 for r in rows if r[3] and r[4] == "no")
    lines += ["", f"**{good} of {len(rows)} jobs behaved as expected and lost nothing.**"]
    table = "\n".join(lines)
    print(table)
    if args.write:
        replace_section("Damage campaign", table, doc=DOC)


if __name__ == "__main__":
    main()
