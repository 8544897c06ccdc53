"""The C allocator settings gradzip's launchers give worker processes.

A training step allocates tensors of the gradients' size (aggregates, residuals, summands)
and frees them a step later. glibc's ``malloc`` serves anything above 32 MB (and, by its
dynamic threshold, often less) straight from ``mmap`` and returns it to the system on
``free``, so every step touches fresh pages: a 64 MB tensor costs its page faults, worth
about a tenth of a copy into a reused buffer on the development machine (docs/benchmarks/step-vs-ddp.md,
"Step time against PyTorch DDP", measured both ways). ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` keep such blocks in the heap for the next step instead.

glibc reads these variables when a process starts, so they are set in the environment of
the workers a launcher starts (:func:`gradzip.comm.launch.run_processes`, the emulated-network
bench), never in a running process; under ``torchrun`` export them yourself. A value the
user already set wins, and ``GRADZIP_MALLOC=system`` leaves the environment untouched
(``gradzip``, or unset: these settings; anything else is refused).
Other C libraries ignore them.
"""
from __future__ import annotations

import os
from typing import Mapping

from .errors import GradzipError

#: Blocks up to 1 GiB come from the heap; up to 2 GiB of freed memory is kept for reuse.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(2 << 30)}


def worker_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with :data:`MALLOC_ENV` added, unless
    ``GRADZIP_MALLOC=system`` or the user set either variable."""
    env = dict(os.environ if base is None else base)
    choice = env.get("GRADZIP_MALLOC", "").strip().lower()
    if choice not in ("", "gradzip", "system"):
        raise GradzipError(f"GRADZIP_MALLOC={env['GRADZIP_MALLOC']!r} is not a choice; set it to system (glibc's own "
                           "settings) or gradzip (the default), or unset it")
    if choice == "system" or any(k in env for k in MALLOC_ENV):
        return env
    env.update(MALLOC_ENV)
    return env
