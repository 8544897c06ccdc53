"""Timeline tracing: one span per phase, written as Chrome / Perfetto trace JSON.

A :class:`Tracer` belongs to one worker (its rank is the trace's process id); each thread
that records spans (the training loop, a communication thread) gets a track of its own.
Open the file at https://ui.perfetto.dev or chrome://tracing to see where each step's
time goes and what overlaps what, like the "timeline tracing" figures of the CD-SGD
slides. Timestamps come from ``time.perf_counter`` (CLOCK_MONOTONIC on Linux, shared by
all processes of the machine), so the tracks of different workers line up.
"""
from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from .files import write_text


class Tracer:
    """Collects complete ("X") events for one worker."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, name: str, start: float, end: float, cat: str = "phase", **args: Any) -> None:
        """A span from ``start`` to ``end`` (``time.perf_counter()`` seconds) on this thread."""
        event = {"name": name, "cat": cat, "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6,
                 "pid": self.rank, "tid": threading.current_thread().name}
        if args:
            event["args"] = args
        with self._lock:
            self.events.append(event)

    @contextmanager
    def span(self, name: str, cat: str = "phase", **args: Any) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, start, time.perf_counter(), cat, **args)


@contextmanager
def maybe_span(tracer: "Tracer | None", name: str, cat: str = "phase", **args: Any) -> Iterator[None]:
    """``tracer.span(...)`` when tracing, else nothing."""
    if tracer is None:
        yield
    else:
        with tracer.span(name, cat, **args):
            yield


def forwarding_tracer(parts: Callable[[Any], Iterable[Any]]) -> property:
    """A ``tracer`` property for an object whose ``parts(obj)`` record spans of their own
    (a method's exchanges, a hierarchical exchange's inner one): it keeps the
    :class:`Tracer` set on the object and hands it to each part, so one assignment reaches
    them all (``None``: nothing traced)."""
    def get(obj: Any) -> "Tracer | None":
        return getattr(obj, "_tracer", None)

    def put(obj: Any, tracer: "Tracer | None") -> None:
        obj._tracer = tracer
        for part in parts(obj):
            part.tracer = tracer
    return property(get, put, doc="The Tracer this object and its parts record spans into.")


def write(path: str | Path, events_per_worker: Sequence[Sequence[dict[str, Any]]]) -> Path:
    """Merge the workers' events into one trace file (one process track per worker)."""
    events: list[dict[str, Any]] = []
    for rank, worker_events in enumerate(events_per_worker):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"worker {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        events.extend(worker_events)
    origin = min((e["ts"] for e in events if e["ph"] == "X"), default=0.0)
    for e in events:
        if e["ph"] == "X":
            e["ts"] = round(e["ts"] - origin, 3)
            e["dur"] = round(e["dur"], 3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
