"""Worker functions for tests/test_faults.py (importable, so spawned gloo processes can run
them): one rank dies or hangs mid-run, the others record the PeerFailure they get."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch

from gradzip.comm import PeerFailure

import cases


def _fall(comm, how: str, out_dir: str) -> None:
    """This rank dies (SIGKILL), freezes (SIGSTOP: not even its heartbeat runs) or hangs far
    beyond any timeout (its heartbeat runs on), noting when."""
    Path(out_dir, "victim.json").write_text(json.dumps({"rank": comm.rank, "how": how, "t": time.time()}))
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(120)  # the parent terminates it long before


def _record(comm, out_dir: str, exc: PeerFailure) -> None:
    Path(out_dir, f"rank{comm.rank}.json").write_text(json.dumps(
        {"message": str(exc), "lost": list(exc.lost), "rank": exc.rank, "t": time.time()}))


def allreduce_until(comm, victim: int, how: str, out_dir: str, after_s: float = 1.0,
                    on_new_group: bool = False, pretend_remote: bool = False):
    """Small allreduces in a loop (on a ``new_group()`` if asked); after ``after_s`` seconds
    rank ``victim`` dies or hangs. The others write their PeerFailure to ``out_dir`` and
    re-raise it. ``pretend_remote``: this process cannot check its peers' pids (as if they
    ran on other machines), so only their heartbeats tell."""
    if pretend_remote:
        from gradzip.comm import liveness

        liveness.Heartbeat.current.host = None
    group = comm.new_group() if on_new_group else comm
    began = time.monotonic()
    try:
        while True:
            if comm.rank == victim and time.monotonic() - began > after_s:
                _fall(comm, how, out_dir)
            group.allreduce(torch.ones(8))
            time.sleep(0.01)
    except PeerFailure as exc:
        _record(comm, out_dir, exc)
        raise


def cdsgd_until(comm, victim: int, out_dir: str, after_s: float = 1.0):
    """CD-SGD with its exchanges on a background thread (their own group) until rank
    ``victim`` dies: the others' PeerFailure comes from the exchange thread."""
    import gradzip

    x = torch.nn.Parameter(cases.quadratic_start())
    A, b = cases.quadratic_problem(comm.rank)
    opt = gradzip.optim.METHODS["cdsgd"]([x], comm=comm, lr=0.05, k=3, compressor="2bit:threshold=0.05",
                                        overlap=True)
    began = time.monotonic()
    try:
        while True:
            if comm.rank == victim and time.monotonic() - began > after_s:
                _fall(comm, "kill", out_dir)
            opt.zero_grad()
            (0.5 * (A @ x - b).pow(2).sum()).backward()
            opt.step()
            time.sleep(0.01)
    except PeerFailure as exc:
        _record(comm, out_dir, exc)
        raise
