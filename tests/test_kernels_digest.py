"""gradzip.kernels.digest: the one-pass digest of the edit guard, alone and made in a copy."""
from __future__ import annotations

import pytest
import torch

from gradzip import kernels
from gradzip.kernels import digest as dg
from gradzip.optim.core.fingerprint import fingerprint


def _words(x: torch.Tensor) -> torch.Tensor:
    flat = torch.view_as_real(x) if x.is_complex() else x
    return flat.reshape(-1).view(torch.int32)


def _reference(x: torch.Tensor) -> list[int]:
    """The module docstring's three sums, written out in Python integers."""
    a, b = dg._column_weights()
    s = t = u = 0
    for i, w in enumerate(_words(x).tolist()):
        w &= 0xFFFFFFFF
        r, j = divmod(i, dg.ROW)
        c = ((r * 0x9E3779B9) & 0xFFFFFFFF) | 1
        s += w
        t += c * int(a[j]) * w
        u += c * int(b[j]) * (w >> 16)
    return [v & 0xFFFFFFFF for v in (s, t, u)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64, torch.int32])
def test_the_digest_is_the_documented_sums(dtype):
    x = (torch.randn(3 * dg.ROW + 17, generator=torch.Generator().manual_seed(3)) * 100).to(dtype)
    assert dg.applies(x)
    assert dg.digest(x).view(torch.int64).tolist() == _reference(x)


def test_copy_parts_copies_like_cat_and_digests_the_large_parts_as_digest_does():
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(n, generator=gen) for n in (3, dg.SMALL + 1, 7, 5, 2 * dg.SMALL, dg.SMALL)]
    parts.append(torch.arange(dg.SMALL + 9, dtype=torch.float64).float())
    out = torch.full((sum(p.numel() for p in parts),), float("nan"))
    made = dg.copy_parts(parts, out, dg.SMALL)
    assert torch.equal(out, torch.cat(parts))
    assert [m is not None for m in made] == [p.numel() > dg.SMALL for p in parts]
    for part, m in zip(parts, made):
        if m is not None:
            assert torch.equal(m, dg.digest(part)) and torch.equal(m, fingerprint(part))


def test_a_part_of_another_dtype_or_the_torch_mode_is_copied_without_a_digest():
    out = torch.empty(2 * dg.SMALL, dtype=torch.float64)
    made = dg.copy_parts([torch.randn(2 * dg.SMALL)], out, dg.SMALL)   # cast by the copy: no digest
    assert made == [None]
    with kernels.use("torch"):
        x = torch.randn(2 * dg.SMALL)
        out = torch.empty_like(x)
        assert dg.copy_parts([x], out, dg.SMALL) == [None] and torch.equal(out, x)
        assert not dg.applies(x)


def test_where_the_kernel_does_not_apply():
    x = torch.randn(64, 80)
    assert dg.applies(x) and not dg.applies(x.t()) and not dg.applies(x.half())
    assert not dg.applies(torch.empty(0)) and not dg.applies(x.bfloat16())


@pytest.mark.parametrize("n", [1, 2, 1000, dg.SMALL + 3])
def test_sign_flips_that_cancel_in_the_plain_sums_and_swaps_are_seen(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    before = dg.digest(x)
    if n >= 2:
        pair = x.clone()
        pair[:2] = torch.tensor([1.0, -1.0])
        flipped = pair.clone()
        flipped[:2] = torch.tensor([-1.0, 1.0])   # moves s by +2^31 - 2^31, t by 2^31 (odd - odd)
        assert not torch.equal(dg.digest(pair), dg.digest(flipped))
        swapped = x.clone()
        swapped[:2] = x[:2].flip(0)
        assert torch.equal(swapped, x) or not torch.equal(dg.digest(swapped), before)
    assert not torch.equal(dg.digest(-x), before)
    one_bit = x.clone()
    one_bit.view(torch.int32)[-1] ^= 1
    assert not torch.equal(dg.digest(one_bit), before)
