"""A grid of independent runs (method × seed × ...) in parallel processes, and its results
as a JSON file that a later ``--from results.json --write`` turns into the docs' tables
(so a grid run on a bigger machine can be written into the docs here).

Every run is one call ``fn(task)`` of a module-level function on a picklable task; with
``jobs > 1`` the calls run in ``jobs`` *spawned* processes (no fork of a process holding
threads), each with one torch thread, so N runs of the in-process ThreadGroup use N
cores. Results come back in task order."""
from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch


def _one_thread() -> None:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


def run_grid(fn: Callable[[Any], dict], tasks: Iterable[Any], jobs: int = 1,
             report: Callable[[Any, dict], None] | None = None) -> list[dict]:
    """``[fn(t) for t in tasks]``, ``jobs`` at a time in spawned processes (1: here);
    ``report(task, result)`` as each finishes (progress lines)."""
    tasks = list(tasks)
    if jobs <= 1:
        _one_thread()
        out = []
        for t in tasks:
            out.append(fn(t))
            if report:
                report(t, out[-1])
        return out
    results: list[dict | None] = [None] * len(tasks)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_one_thread) as pool:
        futures = {pool.submit(fn, t): i for i, t in enumerate(tasks)}
        for fut in concurrent.futures.as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            if report:
                report(tasks[i], results[i])
    return results   # type: ignore[return-value]


def save(path: str | Path, settings: dict, runs: list[dict], began: float, **extra) -> dict:
    """Write ``{"settings", "runs", "wall_s", ...}`` to ``path`` (made if missing); return it."""
    payload = {"settings": settings, "runs": runs, "wall_s": time.perf_counter() - began, **extra}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1))
    return payload


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
