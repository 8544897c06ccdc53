"""gradzip.optim.core.fingerprint: equal values give equal bytes; the edits a gradient sees between
backward and step() (issue 35 item 1) change them, in every floating dtype."""
from __future__ import annotations

import pytest
import torch

from gradzip.optim.core.fingerprint import ROW, SMALL, changed, fingerprint, snapshot

EDITS = {
    "scale": lambda x: x.mul_(0.5),
    "sign flip": lambda x: x.neg_(),
    "zero": lambda x: x.zero_(),
    "clamp": lambda x: torch.view_as_real(x).clamp_(-0.1, 0.1) if x.is_complex() else x.clamp_(-0.1, 0.1),
    "swap two entries": lambda x: x[:2].copy_(x[:2].flip(0)),
    "one ulp": lambda x: _bits(x)[0].add_(1),
    "tiny noise in the last entry": lambda x: x[-1:].add_(x[-1:].abs() * 1e-6),
}


def _bits(x: torch.Tensor) -> torch.Tensor:
    flat = torch.view_as_real(x).reshape(-1) if x.is_complex() else x.reshape(-1)
    return flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[flat.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64])
@pytest.mark.parametrize("n", [1, 2, 7, ROW, 3 * ROW + 5])
def test_every_edit_changes_the_fingerprint_and_a_copy_does_not(dtype, n):
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype) + 0.25
    before = fingerprint(g)
    assert before.dtype == torch.uint8 and torch.equal(before, fingerprint(g.clone()))
    for name, edit in EDITS.items():
        x = g.clone()
        edit(x)
        if torch.equal(_bits(x), _bits(g)):   # e.g. swapping one entry with itself
            continue
        assert not torch.equal(fingerprint(x), before), f"{name} not seen ({dtype}, {n} entries)"


def test_symmetric_values_flipped_are_seen_and_empty_tensors_have_one():
    """A sign flip of ``[1, -1]`` keeps the plain sum and the bit-pattern sum: the
    position-weighted sums see it."""
    for g in (torch.tensor([1.0, -1.0]), torch.tensor([1.0, 1.0, -1.0, -1.0])):
        assert not torch.equal(fingerprint(g), fingerprint(-g))
    assert fingerprint(torch.empty(0)).numel() == 0


@pytest.mark.parametrize("n", [1, 7, SMALL, SMALL + 1, 3 * ROW + SMALL])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64])
def test_snapshots_see_every_edit_of_any_tensor_of_a_set(n, dtype):
    """``changed``: False for the tensors as they were (small ones compared by their bytes,
    large ones by fingerprint), True after any edit of any one of them; a NaN kept is no change."""
    gen = torch.Generator().manual_seed(n)
    tensors = [(torch.randn(k, generator=gen) + 0.25).to(dtype) for k in (n, 3, SMALL + 7)]
    tensors[1][0] = float("nan")
    taken = [snapshot(t) for t in tensors]
    assert [t.numel() <= SMALL for t in tensors] == [s.numel() == t.numel() * t.element_size()
                                                    for t, s in zip(tensors, taken)]
    assert not changed(zip(tensors, taken))
    for i in range(len(tensors)):
        for name, edit in EDITS.items():
            edited = [t.clone() for t in tensors]
            edit(edited[i])
            if torch.equal(_bits(edited[i]), _bits(tensors[i])):
                continue
            assert changed(zip(edited, taken)), f"{name} of tensor {i} not seen ({dtype}, {n} entries)"


def test_a_snapshot_is_a_copy_and_a_strided_tensor_is_read_as_its_values():
    g = torch.randn(6, 5)
    taken = snapshot(g.t())      # not contiguous: its values in row-major order of the view
    g.mul_(2)                    # the snapshot is not a view of g
    assert changed([(g.t(), taken)])
    assert not changed([(g.t(), snapshot(g.t()))])


@pytest.mark.parametrize("count", [1, 2, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64])
def test_a_snapshot_of_many_small_tensors_sees_an_edit_of_any_one(count, dtype):
    """``snapshot(list)``: the bytes of all, copied in one call (a list of one too: not a view
    of it); ``changed`` sees any edit of any member, and a NaN kept is no change."""
    gen = torch.Generator().manual_seed(count)
    tensors = [(torch.randn(k % 7 + 1, 3, generator=gen) + 0.25).to(dtype) for k in range(count)]
    tensors[0].view(-1)[0] = float("nan")
    taken = snapshot(tensors)
    assert not changed([(tensors, taken)])
    for i in range(count):
        for name, edit in EDITS.items():
            edited = [t.clone() for t in tensors]
            edit(edited[i])
            if torch.equal(_bits(edited[i]), _bits(tensors[i])):
                continue
            assert changed([(edited, taken)]), f"{name} of tensor {i} not seen ({dtype}, {count})"
        tensors[i].view(-1)[-1:].mul_(1)   # an edit in place that changes nothing: still no change
    assert not changed([(tensors, taken)])
    tensors[-1].view(-1)[-1:].add_(1)
    assert changed([(tensors, taken)])
