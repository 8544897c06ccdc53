"""Fused CPU kernels behind the codecs: one pass over memory where the reference chain of
torch ops makes several (docs/benchmarks/codecs.md, "Codecs").

Technology: numba (``@njit``, compiled on first use and cached on disk beside this
package), installed from the package registries as a wheel with its own LLVM: no
compiler is needed on the user's machine (the alternatives measured are in
docs/benchmarks/codecs.md, "Codecs", "Kernel technology"). numba is imported only when a kernel first runs, so
``import gradzip`` stays light.

Every fused kernel has a pure-torch reference (the codec's own ``*_reference`` path) and
is tested bit-identical to it: the same wire bytes and the same decoded values. A
floating-point sum (a norm, a mean) is either a torch call shared by both paths or summed
in an order the codec defines (docs/algorithms.md), which its torch path follows too.

Which path runs: :func:`enabled` (a CPU tensor, numba importable, and the mode is not
``torch``). The mode comes from the environment variable ``GRADZIP_KERNELS``
(``auto``, the default: numba where it can run; ``numba``: numba or a clear error;
``torch``: the reference path everywhere), or :func:`use` in code and tests.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable, Iterator

import torch

from ..errors import GradzipError

MODES = ("auto", "numba", "torch")
_ENV = "GRADZIP_KERNELS"
_override: list[str] = []


def mode() -> str:
    """The kernel mode in force (see the module docstring)."""
    if _override:
        return _override[-1]
    value = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise GradzipError(f"{_ENV}={value!r} is not a kernel mode; set it to one of {', '.join(MODES)}")
    return value


@contextlib.contextmanager
def use(kernel_mode: str) -> Iterator[None]:
    """Run the block with ``kernel_mode`` (``auto``, ``numba`` or ``torch``) in force."""
    if kernel_mode not in MODES:
        raise GradzipError(f"kernel mode {kernel_mode!r} is not one of {', '.join(MODES)}")
    _override.append(kernel_mode)
    try:
        yield
    finally:
        _override.pop()


@functools.cache
def numba_available() -> bool:
    try:
        import numba  # noqa: F401  (the only import of numba: lazily, here)
    except ImportError:
        return False
    return True


def enabled(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels run for these tensors: all on the CPU, and the mode allows it."""
    m = mode()
    if m == "torch" or not all(t.device.type == "cpu" for t in tensors):
        return False
    if numba_available():
        return True
    if m == "numba":
        raise GradzipError(f"{_ENV}=numba but numba cannot be imported; pip install numba, or set {_ENV}=auto")
    return False


def njit(fn: Callable) -> Callable:
    """``numba.njit(cache=True, nogil=True)`` applied on the first call, not at import.

    nogil: the kernels release the GIL, so workers on threads (``gradzip.simulate``) and a
    background exchange thread run them in parallel."""
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def run(*args):
        if not compiled:
            import numba
            try:
                compiled.append(numba.njit(cache=True, nogil=True)(fn))
            except RuntimeError:  # no file to cache beside (a function typed at a prompt)
                compiled.append(numba.njit(nogil=True)(fn))
        return compiled[0](*args)

    run.py_func = fn
    return run


def array(tensor: torch.Tensor):
    """A numpy view (no copy) of a contiguous CPU tensor, for a kernel's argument; 16-bit
    floats as uint16 bit patterns (numpy has no bfloat16; kernels convert bits exactly)."""
    if not tensor.is_contiguous():
        raise ValueError("kernels take contiguous tensors (call .contiguous() first)")
    if tensor.dtype in (torch.float16, torch.bfloat16):
        tensor = tensor.view(torch.int16)
        return tensor.numpy().view("uint16")
    return tensor.numpy()


def reused(old: torch.Tensor | None, numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """``old`` (a wire tensor of a packet given as ``compress(reuse=)``), flat, when it is a
    contiguous CPU tensor of ``numel`` entries of ``dtype``; else a new one: where every fused
    codec writes its wire."""
    if (old is not None and old.dtype == dtype and old.numel() == numel and old.is_contiguous()
            and old.device.type == "cpu"):
        return old.reshape(-1)
    return torch.empty(numel, dtype=dtype)


def decode_target(out: torch.Tensor | None, shape, dtype: torch.dtype) -> torch.Tensor:
    """Where a fused decode writes: ``out`` itself when it is a contiguous CPU tensor of this
    shape and dtype, else a new tensor (the codec then ends with ``base.deliver``, which copies
    into ``out`` or names its mismatch)."""
    if (out is not None and out.shape == shape and out.dtype == dtype and out.is_contiguous()
            and out.device.type == "cpu"):
        return out
    return torch.empty(shape, dtype=dtype)
