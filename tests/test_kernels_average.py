"""gradzip.kernels.average: the in-place mean of an allreduced sum and its finiteness, one
pass, bit for bit torch's ``div_`` and ``all_finite``."""
import math

import pytest
import torch

from gradzip import kernels
from gradzip.kernels.average import mean_in_place


@pytest.mark.parametrize("mode", ["numba", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_the_mean_is_div_bit_for_bit(mode, dtype, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(100_003, generator=g, dtype=dtype) * 1e3
    x[::97] = torch.finfo(dtype).max   # the largest finite values stay finite
    x[5] = -0.0
    x[7] = torch.finfo(dtype).tiny / 3   # subnormal
    with kernels.use(mode):
        mean = x.clone()
        assert mean_in_place(mean, n)
    expected = x.clone().div_(n)
    assert torch.equal(mean.view(-1).view(torch.int64 if dtype == torch.float64 else torch.int32),
                       expected.view(torch.int64 if dtype == torch.float64 else torch.int32))


@pytest.mark.parametrize("mode", ["numba", "torch"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", [0, 4_999, 9_999])
def test_any_non_finite_entry_is_seen(mode, bad, where):
    x = torch.randn(10_000)
    x[where] = bad
    with kernels.use(mode):
        assert not mean_in_place(x, 3)
    assert not math.isfinite(x[where].item())


def test_other_layouts_and_dtypes_take_torch():
    x = torch.randn(8, 6).t()   # not contiguous
    y = x.clone()
    assert mean_in_place(x, 2) and torch.equal(x, y.div_(2))
    h = torch.randn(100, dtype=torch.float16)
    assert mean_in_place(h.clone(), 2)
    assert mean_in_place(torch.empty(0), 2)
