"""gradzip.kernels: choosing the fused or the reference path, and its errors."""
from __future__ import annotations

import pytest
import torch

from gradzip import kernels
from gradzip.errors import GradzipError


def test_the_environment_chooses_the_path(monkeypatch):
    monkeypatch.setenv("GRADZIP_KERNELS", "torch")
    assert kernels.mode() == "torch" and not kernels.enabled(torch.zeros(3))
    monkeypatch.setenv("GRADZIP_KERNELS", " Numba ")
    assert kernels.mode() == "numba"
    monkeypatch.delenv("GRADZIP_KERNELS")
    assert kernels.mode() == "auto"


def test_use_overrides_the_environment_for_its_block_only(monkeypatch):
    monkeypatch.setenv("GRADZIP_KERNELS", "auto")
    with kernels.use("torch"):
        assert kernels.mode() == "torch"
        with kernels.use("numba"):
            assert kernels.mode() == "numba"
        assert kernels.mode() == "torch"
    assert kernels.mode() == "auto"


def test_a_bad_mode_is_named_with_the_valid_ones(monkeypatch):
    monkeypatch.setenv("GRADZIP_KERNELS", "fast")
    with pytest.raises(GradzipError, match=r"GRADZIP_KERNELS='fast'.*auto, numba, triton, torch"):
        kernels.mode()
    with pytest.raises(GradzipError, match=r"'cuda' is not one of auto, numba, triton, torch"):
        with kernels.use("cuda"):
            pass


def test_numba_mode_without_numba_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(kernels, "numba_available", lambda: False)
    with kernels.use("numba"), pytest.raises(GradzipError, match="pip install numba"):
        kernels.enabled(torch.zeros(3))
    with kernels.use("auto"):
        assert not kernels.enabled(torch.zeros(3))   # auto falls back to the reference path


def test_the_backend_is_chosen_by_mode_and_device(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kernels, "numba_available", lambda: True)
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    cases = {("auto", "cpu"): "numba", ("auto", "cuda"): "triton", ("auto", "meta"): "torch",
             ("numba", "cpu"): "numba", ("numba", "cuda"): "torch", ("torch", "cpu"): "torch",
             ("torch", "cuda"): "torch", ("triton", "cuda"): "triton"}
    for (mode, device), expected in cases.items():
        with kernels.use(mode):
            assert kernels.backend(device) == expected, (mode, device)
    with kernels.use("triton"), pytest.raises(GradzipError, match="TRITON_INTERPRET=1"):
        kernels.backend("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with kernels.use("triton"):
        assert kernels.backend("cpu") == "triton"
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with kernels.use("auto"):
        assert kernels.backend("cuda") == "torch"   # auto falls back to the reference path
    with kernels.use("triton"), pytest.raises(GradzipError, match=r"pip install 'gradzip\[gpu\]'"):
        kernels.backend("cuda")


def test_a_codec_resolves_its_implementation_once_per_mode_and_device():
    from gradzip.compressors import build
    codec = build("2bit")
    cpu = torch.device("cpu")
    with kernels.use("torch"):
        ref = codec.impl(cpu)
        assert type(ref).__name__ == "TwoBitReference" and codec.impl(cpu) is ref
    if kernels.numba_available():
        with kernels.use("numba"):
            assert type(codec.impl(cpu)).__name__ == "TwoBitNumba"
    with kernels.use("torch"):
        assert codec.impl(cpu) is ref   # kept on the instance
    assert build("2bit") == codec and hash(build("2bit")) == hash(codec)   # the cache is no field


def test_import_gradzip_imports_no_triton():
    import subprocess
    import sys
    code = "import sys, gradzip, gradzip.compressors; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_reused_takes_the_old_buffer_only_when_it_fits():
    old = torch.zeros(2, 4, dtype=torch.uint8)
    same = kernels.reused(old, 8)
    assert same.data_ptr() == old.data_ptr() and same.shape == (8,)
    for other in (kernels.reused(old, 9), kernels.reused(old, 8, torch.int8), kernels.reused(old.t(), 8),
                  kernels.reused(None, 8)):
        assert other.data_ptr() != old.data_ptr()


def test_array_refuses_a_non_contiguous_tensor():
    with pytest.raises(ValueError, match="contiguous"):
        kernels.array(torch.zeros(4, 3).t())
