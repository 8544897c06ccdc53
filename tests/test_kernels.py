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
    with pytest.raises(GradzipError, match=r"GRADZIP_KERNELS='fast'.*auto, numba, torch"):
        kernels.mode()
    with pytest.raises(GradzipError, match=r"'cuda' is not one of auto, numba, torch"):
        with kernels.use("cuda"):
            pass


def test_numba_mode_without_numba_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(kernels, "numba_available", lambda: False)
    with kernels.use("numba"), pytest.raises(GradzipError, match="pip install numba"):
        kernels.enabled(torch.zeros(3))
    with kernels.use("auto"):
        assert not kernels.enabled(torch.zeros(3))   # auto falls back to the reference path


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
