"""Fault injection for the reliability tests (tests/test_elastic.py) and the fault campaign
(benchmarks/fault_campaign.py), not shipped with the package: kill a worker of a running
``torchrun`` job once it has checkpointed, and let the job restart and resume.

:func:`kill_during` starts a command (a ``torchrun ... gradzip.cli train --resume DIR``
line), waits until the checkpoint directory holds a step of at least ``after_step``,
sends ``signal`` to the worker process of rank ``rank`` (found below the torchrun agent by
its ``RANK`` environment variable), and waits for the job to end.
"""
from __future__ import annotations

import os
import signal as signals
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from gradzip.errors import GradzipError
from gradzip.train import checkpoint


def torchrun_workers(agent_pid: int) -> dict[int, int]:
    """rank -> pid of the worker processes whose parent is ``agent_pid`` (Linux /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        env = dict(e.split(b"=", 1) for e in environ if b"=" in e)
        if parent == agent_pid and b"RANK" in env:
            found[int(env[b"RANK"])] = int(entry.name)
    return found


@dataclass
class FaultRun:
    returncode: int
    stdout: str
    stderr: str
    killed_after_step: int | None   # the newest checkpoint when the signal was sent (None: not sent)
    seconds: float


def kill_during(command: list[str], checkpoint_dir: str | Path, *, rank: int, world_size: int,
                after_step: int = 1, signal: int = signals.SIGKILL, delay_s: float = 0.0,
                timeout_s: float = 600.0, env: dict | None = None) -> FaultRun:
    """Run ``command``; once rank ``rank`` holds a checkpoint of step >= ``after_step``,
    wait ``delay_s`` more and send ``signal`` to that rank's worker; wait for the end."""
    began = time.monotonic()
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    killed = None
    try:
        deadline = began + timeout_s
        while job.poll() is None and time.monotonic() < deadline:
            held = checkpoint.steps_held(checkpoint_dir, rank, world_size)
            if held and held[-1] >= after_step:
                time.sleep(delay_s)
                victim = torchrun_workers(job.pid).get(rank)
                if victim is not None and job.poll() is None:
                    killed = checkpoint.steps_held(checkpoint_dir, rank, world_size)[-1]
                    try:
                        os.kill(victim, signal)
                    except ProcessLookupError:
                        killed = None
                break
            time.sleep(0.01)
        remaining = max(1.0, deadline - time.monotonic())
        stdout, stderr = job.communicate(timeout=remaining)
    except subprocess.TimeoutExpired:
        job.kill()
        stdout, stderr = job.communicate()
        raise GradzipError(f"the job did not finish in {timeout_s:.0f} s: {stderr[-2000:]}") from None
    finally:
        if job.poll() is None:
            job.kill()
    return FaultRun(job.returncode, stdout, stderr, killed, time.monotonic() - began)
