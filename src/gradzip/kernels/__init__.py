"""The kernel backends behind the codecs: one pass over memory where the reference chain of
torch ops makes several (docs/benchmarks/codecs.md, "Codecs").

Three implementations of every fused codec operation, one chosen per codec instance and
device (:func:`backend`; a codec keeps its choice: ``Compressor.impl``):

* ``torch``: the reference, the codec's own torch code (every device);
* ``numba``: CPU kernels (``@njit``, compiled on first use and cached on disk beside this
  package; the wheel brings its own LLVM, no compiler is needed; the alternatives measured
  are in docs/benchmarks/codecs.md, "Codecs", "Kernel technology");
* ``triton``: GPU kernels (:mod:`gradzip.kernels.triton`, the ``gradzip[gpu]`` extra); on
  CPU tensors only under Triton's interpreter (``TRITON_INTERPRET=1``: the tests).

numba and triton are imported only when a kernel first runs, so ``import gradzip`` stays
light. Every fused kernel is tested bit-identical to the torch reference: the same wire
bytes and the same decoded values. A floating-point sum (a norm, a mean) is either a torch
call shared by every path or summed in an order the codec defines (docs/algorithms.md),
which its torch path follows too.

The mode comes from the environment variable ``GRADZIP_KERNELS``, or :func:`use` in code
and tests: ``auto`` (the default: numba on the CPU, Triton on CUDA, each where it can be
imported, else the reference), ``numba`` (numba on the CPU or a clear error; the reference
elsewhere), ``triton`` (Triton on every device or a clear error) or ``torch`` (the
reference everywhere).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
from typing import Callable, Iterator

import torch

from ..errors import GradzipError

MODES = ("auto", "numba", "triton", "torch")
#: The numba kernels pack bits through little-endian words (every platform numba runs on is).
LITTLE_ENDIAN = sys.byteorder == "little"
#: The implementations a codec can run (:func:`backend`'s answers).
BACKENDS = ("torch", "numba", "triton")
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
    """Run the block with ``kernel_mode`` (one of :data:`MODES`) in force."""
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


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401  (imported here first, lazily; the kernels in gradzip.kernels.triton)
    except ImportError:
        return False
    return True


def interpreted() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``): kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0")


def backend(device: torch.device | str) -> str:
    """The implementation (:data:`BACKENDS`) that runs for tensors on ``device`` in the mode in
    force; a mode that cannot be served raises a one-line error naming the fix."""
    return _backend(mode(), torch.device(device).type, interpreted())


def _backend(kernel_mode: str, device_type: str, interpret: bool) -> str:
    cpu = device_type == "cpu"
    if kernel_mode == "torch":
        return "torch"
    if kernel_mode == "numba":
        if not cpu:
            return "torch"
        if not LITTLE_ENDIAN:
            raise GradzipError(f"{_ENV}=numba: the numba kernels need a little-endian machine; set {_ENV}=auto")
        if not numba_available():
            raise GradzipError(f"{_ENV}=numba but numba cannot be imported; pip install numba, or set {_ENV}=auto")
        return "numba"
    if kernel_mode == "triton":
        if not triton_available():
            raise GradzipError(f"{_ENV}=triton but triton cannot be imported; pip install 'gradzip[gpu]', "
                               f"or set {_ENV}=auto")
        if device_type != "cuda" and not (cpu and interpret):
            raise GradzipError(f"{_ENV}=triton on {device_type} tensors needs a CUDA device, or TRITON_INTERPRET=1 "
                               f"(Triton's interpreter) for CPU tensors; or set {_ENV}=auto")
        return "triton"
    if cpu:
        return "numba" if LITTLE_ENDIAN and numba_available() else "torch"
    return "triton" if device_type == "cuda" and triton_available() else "torch"


def triton_module(name: str):
    """The module ``gradzip.kernels.triton.<name>`` of Triton kernels, imported (with triton)
    on first use: a codec's Triton implementation asks for it when it is built."""
    return importlib.import_module(f"{__name__}.triton.{name}")


def enabled(*tensors: torch.Tensor) -> bool:
    """Whether the numba kernels run for these tensors: all on the CPU, and the mode picks
    numba there (:func:`backend`)."""
    return all(backend(t.device) == "numba" for t in tensors)


def njit(fn: Callable | None = None, *, fastmath: frozenset = frozenset()) -> Callable:
    """``numba.njit(cache=True, nogil=True)`` applied on the first call, not at import;
    ``@njit(fastmath={"reassoc"})`` passes LLVM's fast-math flags (a kernel that states why).

    nogil: the kernels release the GIL, so workers on threads (``gradzip.simulate``) and a
    background exchange thread run them in parallel."""
    if fn is None:
        return functools.partial(njit, fastmath=frozenset(fastmath))
    compiled: list[Callable] = []
    flags = {"fastmath": set(fastmath)} if fastmath else {}

    @functools.wraps(fn)
    def run(*args):
        if not compiled:
            import numba
            try:
                compiled.append(numba.njit(cache=True, nogil=True, **flags)(fn))
            except RuntimeError:  # no file to cache beside (a function typed at a prompt)
                compiled.append(numba.njit(nogil=True, **flags)(fn))
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


def reused(old: torch.Tensor | None, numel: int, dtype: torch.dtype = torch.uint8,
           device: torch.device | str = "cpu") -> torch.Tensor:
    """``old`` (a wire tensor of a packet given as ``compress(reuse=)``), flat, when it is a
    contiguous tensor on ``device`` of ``numel`` entries of ``dtype``; else a new one: where
    every fused codec writes its wire."""
    if (old is not None and old.dtype == dtype and old.numel() == numel and old.is_contiguous()
            and old.device == torch.device(device)):
        return old.reshape(-1)
    return torch.empty(numel, dtype=dtype, device=device)


def decode_target(out: torch.Tensor | None, shape, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Where a fused decode writes: ``out`` itself when it is a contiguous tensor on ``device``
    of this shape and dtype, else a new tensor (the codec then ends with ``base.deliver``,
    which copies into ``out`` or names its mismatch)."""
    if (out is not None and out.shape == shape and out.dtype == dtype and out.is_contiguous()
            and out.device == torch.device(device)):
        return out
    return torch.empty(shape, dtype=dtype, device=device)
