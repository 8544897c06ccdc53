"""Elastic restart (issue 7, part 4; benchmarks/faults.py): under ``torchrun
--max-restarts``, a worker killed with SIGKILL mid-run brings the job down, torchrun starts
it again, and ``--resume`` continues from the last checkpoint: the job completes with the
same bits as a run that was never interrupted."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

import cases
from benchmarks.faults import kill_during
from gradzip.cli import main
from gradzip.train import checkpoint

TRAIN = ["train", "--algo", "efsgd", "--epochs", "4", "--batch-size", "8", "--checkpoint-every", "25",
         "--quiet", "--no-plot", "--timeout", "60"]
STEPS = 4 * (1437 // 2 // 8)  # digits: 1437 training samples, 2 workers, batch 8


def torchrun_command(*args: str) -> list[str]:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    return [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
            "--monitor-interval", "0.2", "-m", "gradzip.cli", *args]


@pytest.mark.slow
def test_sigkill_under_torchrun_restarts_and_resumes_exactly(tmp_path):
    ck, out = tmp_path / "ck", tmp_path / "out"
    run = kill_during(torchrun_command(*TRAIN, "--resume", str(ck), "--out", str(out)), ck,
                      rank=1, world_size=2, after_step=25, timeout_s=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.killed_after_step is not None and run.killed_after_step < STEPS, "killed too late"
    # the job failed (the survivor named the lost rank, or the agent saw the kill first) ...
    assert "peer rank 1 is gone" in run.stderr or "exitcode: -9" in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]  # one-line errors only
    # ... and torchrun's restart resumed it
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] is not None and summary["resumed_from_step"] >= run.killed_after_step
    assert summary["steps"] == STEPS and summary["final_test_accuracy"] > 0.85

    # the same run, never interrupted (2 local gloo processes): the same final bits
    whole = tmp_path / "whole"
    assert main([*TRAIN, "--workers", "2", "--checkpoint-dir", str(whole)]) == 0
    for rank in (0, 1):  # model, optimizer, data position, generators, records: all of it
        cases.assert_bitwise_equal(checkpoint.load(ck, STEPS, rank, 2), checkpoint.load(whole, STEPS, rank, 2),
                                   f"rank {rank}")
