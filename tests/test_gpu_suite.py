"""benchmarks.gpu_suite: the device suite's dry run (CPU, tiny sizes, Triton's interpreter)
runs every phase and writes its JSON and markdown, so the suite a device session runs in
one call cannot rot between sessions."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_dry_run_runs_every_phase(tmp_path):
    out = tmp_path / "suite"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_suite", "--out", str(out), "--dry-run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "gpu_suite.json").read_text())
    phases = ("tests", "codecs", "aggregate", "topk", "powersgd", "compute", "methods", "cdsgd")
    assert [p for p in phases if not isinstance(result[p], list) and "skipped" in result[p]] == []
    assert result["tests"]["ok"] and result["tests"]["counts"]["passed"] >= 2
    assert {r["codec"] for r in result["codecs"]} >= {"sign", "qsgd", "1bit", "bf16", "randomk:ratio=0.01"}
    assert all(r["triton"]["vs_copy"] > 0 for r in result["codecs"])
    methods = result["methods"]
    assert all(isinstance(v, float) for v in methods["world_1"].values()), methods["world_1"]
    assert all(isinstance(v, float) for v in methods["gloo_2"].values()), methods["gloo_2"]
    assert result["cdsgd"]["host"]["lanes"] == 2
    text = (out / "gpu_suite.md").read_text()
    assert "**Codecs**" in text and "**Step overhead**" in text and "**CD-SGD overlap**" in text
    assert (out / "cdsgd_trace.json.gz").exists() and (out / "pytest.log").exists()


def test_every_cuda_test_is_in_a_file_the_suite_collects():
    from benchmarks.gpu_suite import CUDA_TEST_FILES
    marked = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                    if p.name != "test_gpu_suite.py" and "pytest.mark." + "cuda" in p.read_text())
    assert marked and set(marked) <= set(CUDA_TEST_FILES), marked
