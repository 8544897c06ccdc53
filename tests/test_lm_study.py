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
    assert "2 epochs = 88 steps" in out.stdout and "`--lr-schedule cosine:warmup=4,final=0.1`" in out.stdout
    assert "AdamW's validation loss at its last evaluations" in out.stdout
    assert {p: p.stat().st_mtime for p in (ROOT / "docs" / "benchmarks").glob("lm*")} == before


def test_each_study_has_its_own_section_plot_and_records():
    """The one-epoch study (constant rate) keeps the page's first section and plot; the
    longer one gets its own, and the records file holds both, grouped by settings."""
    from benchmarks import lm
    assert lm.title_of(lm.ONE_EPOCH) == lm.TITLE and lm.plot_of(lm.ONE_EPOCH).name == "bench_lm_loss.png"
    assert lm.title_of(lm.SETTINGS) == f"{lm.TITLE}, {lm.SETTINGS['epochs']} epochs, {lm.SETTINGS['lr_schedule']}"
    assert lm.plot_of(lm.SETTINGS) != lm.plot_of(lm.ONE_EPOCH)
    runs = [{"settings": s, "seed": i} for i, s in enumerate((lm.ONE_EPOCH, lm.SETTINGS, dict(lm.ONE_EPOCH)))]
    assert [[r["seed"] for r in g] for g in lm.studies(runs)] == [[0, 2], [1]]
