"""gradzip.kernels.sums: the mean of an allreduced sum in place and its finiteness in one
pass, bit for bit torch's ``div_``, on the fused path and the reference path."""
from __future__ import annotations

import pytest
import torch

from gradzip import kernels
from gradzip.kernels.sums import mean_in_place

PATHS = ["numba", "torch"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 12])
def test_the_mean_is_torchs_division_bit_for_bit(path, dtype, n):
    g = torch.Generator().manual_seed(n)
    # wide magnitudes and subnormals: a reciprocal multiply or a flushed subnormal would show
    total = torch.randn(40_003, generator=g, dtype=dtype) * torch.logspace(-40, 30, 40_003, dtype=dtype)
    total[:7] = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38, 1.0], dtype=dtype)
    expected = total.clone().div_(n)
    with kernels.use(path):
        assert mean_in_place(total, n)
    assert torch.equal(total, expected) and torch.equal(total.signbit(), expected.signbit())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 4_000, 9_999])
def test_any_nan_or_inf_anywhere_is_found_and_the_rest_still_divided(path, bad, where):
    total = torch.ones(10_000)
    total[where] = bad
    with kernels.use(path):
        assert not mean_in_place(total, 2)
    assert (total[torch.arange(10_000) != where] == 0.5).all()


@pytest.mark.parametrize("path", PATHS)
def test_a_sum_that_overflows_from_finite_entries_is_still_finite(path):
    total = torch.full((1_000,), 3e38)              # the sum overflows; every entry is finite
    with kernels.use(path):
        assert mean_in_place(total, 1)
    total = torch.tensor([3e38, 3e38, -float("inf")])   # the sum is NaN: the exact look finds the Inf
    with kernels.use(path):
        assert not mean_in_place(total, 1)


def test_other_dtypes_and_layouts_take_the_reference_path():
    half = torch.tensor([1.0, 3.0, 60000.0, 60000.0], dtype=torch.float16)   # the fp16 sum overflows
    expected = half.clone().div_(3)
    assert mean_in_place(half, 3) and torch.equal(half, expected)
    strided = torch.arange(12.0).reshape(3, 4).t()                     # not contiguous
    expected = strided.clone().div_(3)
    assert mean_in_place(strided, 3) and torch.equal(strided, expected)
    assert not mean_in_place(torch.tensor([1.0, float("nan")], dtype=torch.bfloat16), 2)
    empty = torch.empty(0)
    assert mean_in_place(empty, 4) and empty.numel() == 0
