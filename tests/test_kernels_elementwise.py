"""The fused elementwise codecs (gradzip.kernels.elementwise behind sign, scaled_sign, 2bit;
buffer reuse of fp16 / bf16) are bit-identical to their torch reference path
(``kernels.use("torch")``): wire bytes, decoded values, residuals, summands, sums and
aggregates, on odd, empty, 1-element, 0-d, multi-dimensional and non-contiguous tensors,
16-bit and 64-bit floats, and the special values (±0, ±inf, NaN, subnormals, ±threshold)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")

from gradzip import kernels  # noqa: E402
from gradzip.compressors import _util, build  # noqa: E402
from gradzip.kernels import elementwise as ek  # noqa: E402

from cases import SPECIAL, codec_input, codec_outputs, same_bits, same_outputs, same_packet  # noqa: E402

FUSED = ["sign", "scaled_sign", "scaled_sign:scale=rms", "2bit", "2bit:threshold=0.5", "2bit:threshold=1e-40"]
CASTS = ["fp16", "bf16"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

same = same_bits   # any NaN matches any NaN (cases.same_bits: torch's own NaN bits differ by loop)


def make(shape, dtype, seed, special=True, layout="contiguous") -> torch.Tensor:
    return codec_input(shape, dtype, seed, special, layout)


def check_identical(spec, x):
    codec = build(spec)
    assert same_outputs(codec_outputs(codec, x, "torch"), codec_outputs(codec, x, "numba")) == []


@pytest.mark.parametrize("spec", FUSED + CASTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (13,), (1001,), (3, 5, 7), (0, 4),
                                   (1024,), (2053,), (33, 65)])  # whole encoder blocks + a tail
def test_fused_path_is_bit_identical_to_the_torch_reference(spec, dtype, shape):
    check_identical(spec, make(shape, dtype, seed=sum(shape) + len(shape)))


@pytest.mark.parametrize("spec", FUSED)
@pytest.mark.parametrize("layout", ["transposed", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_non_contiguous_inputs_are_bit_identical(spec, layout, dtype):
    x = make((41, 53), dtype, seed=2, layout=layout)
    assert not x.is_contiguous()
    check_identical(spec, x)


@settings(max_examples=40, deadline=None)
@given(spec=st.sampled_from(FUSED), dtype=st.sampled_from([torch.float32, torch.float64]),
       values=st.lists(st.one_of(st.floats(width=32), st.sampled_from(SPECIAL)), max_size=70))
def test_hypothesis_values_are_bit_identical(spec, dtype, values):
    check_identical(spec, torch.tensor(values, dtype=torch.float64).to(dtype))


@pytest.mark.parametrize("spec", ["sign", "scaled_sign", "2bit"])
def test_piecewise_reference_matches_the_fused_path(spec, monkeypatch):
    """With the reference encoding piece by piece (one torch thread, large tensors),
    ``scaled_sign``'s ‖v‖₁ is a sum of per-piece sums: the fused path sums the same pieces."""
    monkeypatch.setattr(_util, "CHUNK", 64)
    monkeypatch.setattr(_util, "PIECEWISE", True)
    check_identical(spec, make((3003,), torch.float32, seed=9, special=False))


@pytest.mark.parametrize("spec", FUSED + CASTS)
def test_compress_writes_into_the_reused_packets_buffers(spec):
    """``compress(x, reuse=old)`` fills ``old``'s wire tensors (no allocation) with the same
    bytes a fresh compress gives; a packet of another size is not reused."""
    codec = build(spec)
    x, y = make((2501,), torch.float32, seed=1), make((2501,), torch.float32, seed=2)
    with kernels.use("numba"):
        old = codec.compress(x, seed=1)
        ptrs = {k: w.data_ptr() for k, w in old.wire.items()}
        again = codec.compress(y, seed=2, reuse=old)
        assert {k: w.data_ptr() for k, w in again.wire.items()} == ptrs
        assert same_packet(again, codec.compress(y, seed=2))
        residual = torch.empty_like(y)
        third = codec.compress_residual(x, 1, residual, reuse=again)
        assert {k: w.data_ptr() for k, w in third.wire.items()} == ptrs
        assert same_packet(third, codec.compress(x, seed=1))
        small = codec.compress(make((7,), torch.float32, seed=3), seed=1, reuse=third)
        assert all(w.data_ptr() != ptrs[k] for k, w in small.wire.items() if w.numel() != third.wire[k].numel())
    with kernels.use("torch"):
        assert same_packet(third, codec.compress(x, seed=1))


@pytest.mark.parametrize("spec,kernel", [("sign", "sign_encode"), ("scaled_sign", "sign_encode_l1"),
                                         ("2bit", "twobit_encode")])
def test_cpu_float32_takes_the_fused_kernel(spec, kernel, monkeypatch):
    """On the CPU in mode auto, float32 compress runs the fused kernel (and mode torch does not)."""
    calls = []
    original = getattr(ek, kernel)
    monkeypatch.setattr(ek, kernel, lambda *a: calls.append(1) or original(*a))
    codec = build(spec)
    x = make((100,), torch.float32, seed=0)
    with kernels.use("auto"):
        codec.compress(x)
    assert calls == [1]
    with kernels.use("torch"):
        codec.compress(x)
    assert calls == [1]


@pytest.mark.parametrize("spec", FUSED)
def test_decompress_into_a_non_contiguous_out(spec):
    codec = build(spec)
    x = make((6, 5), torch.float32, seed=4)
    with kernels.use("numba"):
        packet = codec.compress(x)
        out = torch.full((5, 6), float("nan")).t()
        assert codec.decompress(packet, out=out) is out
        assert same(out.contiguous(), codec.decompress(packet))
        residual = torch.full((5, 6), float("nan")).t()
        codec.compress_residual(x, 0, residual)
        assert same(residual.contiguous(), x - codec.decompress(packet))


@settings(max_examples=25, deadline=None)
@given(spec=st.sampled_from(FUSED), dtype=st.sampled_from([torch.float32, torch.float64]),
       n=st.integers(0, 5000), seed=st.integers(0, 2**16))
def test_hypothesis_sizes_across_blocks_are_bit_identical(spec, dtype, n, seed):
    check_identical(spec, make((n,), dtype, seed=seed))


def defined_l1(values) -> float:
    """The ℓ1 norm in the order docs/algorithms.md §codec: sign, scaled_sign defines, in
    plain Python floats (float64): blocks of 64 rows of 1024 entries, 1024 lanes summed row
    by row from 0.0, the lanes pairwise (k + k+512, + 256, ..., + 1), the block sums again
    so until one is left."""
    vals = [abs(float(v)) for v in values]
    while True:
        sums = []
        for b in range(0, max(len(vals), 1), 65536):
            lanes = [0.0] * 1024
            for i, v in enumerate(vals[b:b + 65536]):
                lanes[i % 1024] += v
            half = 512
            while half:
                lanes = [lanes[i] + lanes[i + half] for i in range(half)]
                half //= 2
            sums.append(lanes[0])
        if len(sums) == 1:
            return sums[0]
        vals = sums


@pytest.mark.parametrize("n,dtype", [(n, d) for n in (0, 1, 1023, 1024, 5000, 65537)
                                     for d in (torch.float32, torch.float64, torch.float16)]
                         + [(3 * 65536 + 1029, torch.float32)])   # 4 blocks: the block sums folded
def test_scaled_sign_scale_sums_in_the_defined_order(n, dtype):
    """``scaled_sign``'s scale is ``float32(l1 / d)`` with ``l1`` summed in the defined order
    (float64 lanes), on both paths and in compress and compress_residual alike: the fused
    kernel sums while it encodes, so its order is the spec's, not torch's ``sum``."""
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=gen, dtype=torch.float64) * torch.rand(n, generator=gen, dtype=torch.float64) * 1e3
         ).to(dtype)
    vals = x.tolist()
    want = torch.tensor([defined_l1(vals) / max(n, 1)],
                        dtype=torch.float64).to(torch.float32)
    codec = build("scaled_sign")
    for mode in ("torch", "numba"):
        with kernels.use(mode):
            assert torch.equal(codec.compress(x).wire["scale"], want), mode
            assert torch.equal(codec.compress_residual(x, 0, torch.empty_like(x)).wire["scale"], want), mode


@pytest.mark.parametrize("spec", ["sign", "scaled_sign", "scaled_sign:scale=rms"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_inputs_take_the_fused_sign_encoder(spec, dtype, monkeypatch):
    """fp16 / bf16 inputs are encoded by the fused kernel (compares of their bits), with the
    wire of the torch path: ±0, ±inf, NaN, subnormals, whole blocks and a tail."""
    calls = []
    original = ek.sign_encode_bits
    monkeypatch.setattr(ek, "sign_encode_bits", lambda *a: calls.append(1) or original(*a))
    x = make((2053,), dtype, seed=7)
    codec = build(spec)
    with kernels.use("torch"):
        want = codec.compress(x)
    with kernels.use("auto"):
        got = codec.compress(x)
    assert calls == [1] and same_packet(got, want)


def test_pack_multipliers_place_every_code_pattern():
    """PACK8 packs every pattern of eight 0/1 bytes, and PACK4 every pattern of four 2-bit
    codes, exactly as the shift-and-or chain they replace (code 0 in the top bits)."""
    import numpy as np
    ones = np.array([[(p >> (7 - k)) & 1 for k in range(8)] for p in range(256)], np.uint8)
    words = ones.view("<u8").reshape(-1)
    assert ((words * ek.PACK8) >> ek.TOP8).tolist() == list(range(256))
    codes = np.array([[(p >> (6 - 2 * k)) & 3 for k in range(4)] for p in range(256)], np.uint8)
    words = codes.view("<u4").reshape(-1)
    assert ((words * ek.PACK4) >> ek.TOP4).tolist() == list(range(256))
