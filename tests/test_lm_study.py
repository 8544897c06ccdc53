"""benchmarks/lm.py (issue 34's study), as CI runs it: the tiny dry run, every stage once
(runs through the harness, records, projections, the tables), nothing written to docs/."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_study_runs_end_to_end_in_a_tiny_dry_run():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    before = {p: p.stat().st_mtime for p in (ROOT / "docs" / "benchmarks").glob("lm*")}
    out = subprocess.run([sys.executable, "-m", "benchmarks.lm", "--dry-run", "--methods", "adamw,sparseloco,demo"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    for row in ("| AdamW (DDP) |", "| SparseLoCo H=2, top-k 2% + 2-bit |", "| DeMo (DCT chunk 64, top-32, sign) |"):
        assert row in out.stdout
    assert "proj. ms/step 1 / 10 / 100 Gbit/s" in out.stdout and "Validation loss against steps" in out.stdout
    assert {p: p.stat().st_mtime for p in (ROOT / "docs" / "benchmarks").glob("lm*")} == before
