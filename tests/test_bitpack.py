"""Bit packing: layout (big-endian stream, MXNet's 2-bit order) and round trips."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.compressors import bitpack
from gradzip.compressors.bitpack import pack_bits, packed_nbytes, unpack_bits


def reference_pack(codes: list[int], bits: int) -> list[int]:
    """A plain bit-string reference: each code MSB first, concatenated, zero-padded."""
    stream = "".join(format(c, f"0{bits}b") for c in codes)
    stream += "0" * (-len(stream) % 8)
    return [int(stream[i : i + 8], 2) for i in range(0, len(stream), 8)]


COUNTS = [0, 1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 63, 64, 65, 100, 257, 1001]


@pytest.mark.parametrize("bits", range(1, 9))
def test_matches_reference_and_round_trips(bits):
    rng = random.Random(bits)
    for count in COUNTS + [rng.randrange(2000) for _ in range(5)]:
        codes = [rng.randrange(1 << bits) for _ in range(count)]
        tensor = torch.tensor(codes, dtype=torch.uint8)
        packed = pack_bits(tensor, bits)
        assert packed.dtype == torch.uint8
        assert packed.numel() == packed_nbytes(count, bits)
        assert packed.tolist() == reference_pack(codes, bits), (bits, count)
        assert unpack_bits(packed, bits, count).tolist() == codes
        assert tensor.tolist() == codes  # input untouched


def test_mxnet_two_bit_layout():
    # first value in the top two bits: 11 10 00 11
    assert pack_bits(torch.tensor([3, 2, 0, 3]), 2).tolist() == [0b11100011]
    # a partial last byte is padded with zero codes at the bottom
    assert pack_bits(torch.tensor([3, 2, 0, 3, 2]), 2).tolist() == [0b11100011, 0b10000000]


def test_one_bit_layout_msb_first():
    codes = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.uint8)
    assert pack_bits(codes, 1).tolist() == [0b10000001, 0b10000000]


def test_accepts_bool_int64_and_offset_views():
    bools = torch.tensor([True, False, True] * 7)
    assert torch.equal(pack_bits(bools, 1), pack_bits(bools.to(torch.uint8), 1))
    wide = torch.randint(0, 8, (50,))
    assert unpack_bits(pack_bits(wide, 3), 3, 50).tolist() == wide.tolist()
    base = torch.randint(0, 4, (83,), dtype=torch.uint8)
    view = base[3:]  # storage offset not a multiple of 8, count a multiple of 8
    assert pack_bits(view, 2).tolist() == reference_pack(view.tolist(), 2)


@pytest.mark.parametrize("bits", range(1, 8))
def test_portable_fallback_matches_fast_path(bits):
    codes = torch.randint(0, 1 << bits, (203,), dtype=torch.uint8)
    fast = pack_bits(codes, bits)
    assert torch.equal(bitpack._pack_slow(codes, bits), fast)
    assert torch.equal(bitpack._unpack_slow(fast, bits, 203), codes)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8).flatmap(lambda b: st.tuples(st.just(b), st.lists(st.integers(0, (1 << b) - 1), max_size=200))))
def test_round_trip_property(case):
    bits, codes = case
    packed = pack_bits(torch.tensor(codes, dtype=torch.uint8), bits)
    assert packed.tolist() == reference_pack(codes, bits)
    assert unpack_bits(packed, bits, len(codes)).tolist() == codes
