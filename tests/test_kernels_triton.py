"""The Triton kernels (gradzip.kernels.triton) give the torch reference's bits for every codec
that has them: wire bytes, decoded values, residuals, summands, sums and the aggregate of n
packets, on odd sizes, 0 and 1 entries, 0-d and non-contiguous tensors, 16-bit and 64-bit
inputs. Without a CUDA device they run under Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, set by conftest); ``python -m benchmarks.gpu_suite`` runs the same
tests on CUDA (``-m cuda``). Sizes stay small: the interpreter runs numpy per program."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from gradzip import kernels  # noqa: E402
from gradzip.compressors import build  # noqa: E402

from cases import codec_input, codec_outputs, same_bits, same_outputs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(DEVICE == "cpu" and not kernels.interpreted(),
                                                    reason="no CUDA device and TRITON_INTERPRET is not set"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]   # numpy under the interpreter: inf, NaN

def make(shape, dtype=torch.float32, seed=0, special=True, layout="contiguous", ties=False) -> torch.Tensor:
    """:func:`cases.codec_input` on the device."""
    return codec_input(shape, dtype, seed, special, layout, ties, DEVICE)


def check(spec: str, x: torch.Tensor) -> None:
    codec = build(spec)
    with kernels.use("triton"):
        assert type(codec.impl(x.device)).__name__.endswith("Triton"), spec
    ref = codec_outputs(codec, x, "torch")
    got = codec_outputs(codec, x, "triton")
    assert same_outputs(ref, got) == [], (spec, tuple(x.shape), x.dtype)


#: (shape, dtype, layout): 0-d, empty, odd sizes over one and several programs, a matrix
#: not contiguous, 16-bit and 64-bit inputs.
CASES = [((), torch.float32, "contiguous"), ((0,), torch.float32, "contiguous"), ((1,), torch.float32, "contiguous"),
         ((2053,), torch.float32, "contiguous"), ((33, 65), torch.float32, "transposed"),
         ((13, 3), torch.float16, "contiguous"), ((7,), torch.bfloat16, "contiguous"),
         ((11,), torch.float64, "contiguous")]
ELEMENTWISE = ["sign", "scaled_sign", "scaled_sign:scale=rms", "2bit", "2bit:threshold=0.5", "fp16", "bf16"]
SPARSE = ["topk:ratio=0.1", "topk:ratio=0.6", "dgc:ratio=0.05,sample_ratio=0.5", "randomk:ratio=0.1",
          "randomk:ratio=0.3,unbiased=true"]
QUANTIZE = ["qsgd", "qsgd:levels=1", "qsgd:levels=5", "qsgd:levels=127", "terngrad", "1bit"]


@pytest.mark.parametrize("spec", ELEMENTWISE)
@pytest.mark.parametrize("shape,dtype,layout", CASES)
def test_elementwise_codecs_are_bit_identical(spec, shape, dtype, layout):
    check(spec, make(shape, dtype, seed=len(shape) + sum(shape), layout=layout))


@pytest.mark.parametrize("spec", QUANTIZE)
@pytest.mark.parametrize("shape,dtype,layout", CASES[:6])
def test_quantizing_codecs_are_bit_identical(spec, shape, dtype, layout):
    check(spec, make(shape, dtype, seed=len(shape) + sum(shape), special=False, layout=layout))


@pytest.mark.parametrize("spec", ["sign", "scaled_sign", "2bit", "qsgd", "terngrad", "1bit", "bf16"])
def test_the_aggregate_of_more_packets_than_one_launch_takes(spec):
    """Eleven packets: two launches of the n-packet kernel, the partial sum kept between."""
    codec = build(spec)
    x = make((1001,), seed=3, special=False)
    packets = [codec.compress(x * (k - 5), seed=k) for k in range(11)]
    with kernels.use("torch"):
        ref = codec.aggregate(packets)
    with kernels.use("triton"):
        got = codec.aggregate(packets)
    assert same_bits(ref, got)


@pytest.mark.parametrize("spec", ["sign", "2bit", "scaled_sign", "qsgd:levels=5", "terngrad", "1bit"])
def test_packets_at_odd_byte_offsets_inside_a_bucket(spec):
    """Packets read back from one received buffer (``Packet.from_raw``) at odd offsets, as an
    allgather delivers them: the same decode and aggregate."""
    codec = build(spec)
    x = make((37,), seed=4)
    with kernels.use("torch"):
        packet = codec.compress(x, seed=1)
    raw = torch.cat([torch.zeros(3, dtype=torch.uint8, device=x.device)] + packet.raw())
    moved = packet.from_raw(raw[3:])
    assert any(w.dtype == torch.uint8 and w.storage_offset() % 2 for w in moved.wire.values())
    with kernels.use("torch"):
        ref = codec.decompress(packet), codec.aggregate([packet, packet])
    with kernels.use("triton"):
        got = codec.decompress(moved), codec.aggregate([moved, packet])
    for a, b in zip(ref, got):
        assert same_bits(a, b)


@pytest.mark.parametrize("shape", [(3, 1000), (70, 3), (5, 1024 * 3 + 8), (2100, 1)])
def test_onebit_column_sums_over_blocks_and_unaligned_lines(shape):
    """1bit's column means over several blocks of 64 lines, lines of whole bytes (bits in the
    sums' pass) and not (bits in a pass of their own), one and many columns."""
    check("1bit", make(shape, seed=sum(shape), special=False))


@pytest.mark.parametrize("spec", SPARSE)
@pytest.mark.parametrize("shape,dtype,layout", CASES[:7])
def test_sparsifiers_are_bit_identical(spec, shape, dtype, layout):
    """Finite inputs (``topk``'s choice among NaN entries is left open), ties included."""
    check(spec, make(shape, dtype, seed=len(shape) + sum(shape), special=False, layout=layout, ties=True))


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "dgc:ratio=0.01,sample_ratio=0.05", "randomk:ratio=0.01"])
def test_sparsifiers_on_a_tensor_large_enough_to_sample(spec):
    """A threshold read off a sample, candidates compacted by the scan kernel (topk from 2**15
    entries, dgc from 64 sampled ones), randomk's draw over several programs."""
    check(spec, make((40_000,), seed=11, special=False))


def test_the_counter_hash_equals_its_python_torch_and_numba_statements():
    """Triton's hash of every entry (``sparse.below`` with a bound that keeps them all) is the
    plain-Python rule's, torch's and numba's (the uniforms are its top 24 bits: qsgd and
    terngrad above check them through their codes)."""
    from gradzip.kernels import counter_rng
    seed, n = 2**40 + 123, 5000
    idx, hashes = kernels.triton_module("sparse").below(seed, n, 1 << 32, torch.device(DEVICE))
    order = torch.argsort(idx)
    got = hashes[order].cpu()
    assert torch.equal(idx[order].cpu(), torch.arange(n))
    assert torch.equal(got, counter_rng.hashes(seed, 0, n))
    assert got[:50].tolist() == [counter_rng.hash_at(seed, j) for j in range(50)]
    if kernels.numba_available():
        from gradzip.kernels import draws
        numba_idx, numba_hashes = draws.below(seed, n, 1 << 32)
        assert torch.equal(numba_idx, torch.arange(n)) and torch.equal(numba_hashes, got)


@pytest.mark.parametrize("d,k", [(1, 1), (7, 3), (3000, 30)])
def test_randomk_draws_the_k_entries_of_smallest_hash_on_the_device(d, k):
    from gradzip.kernels import counter_rng
    codec = build(f"randomk:ratio={k / d}")
    seed = d + k
    hashes = [counter_rng.hash_at(seed, j) for j in range(d)]
    with kernels.use("triton"):
        got = codec.indices(d, seed, DEVICE)
    assert got.device.type == DEVICE and got.tolist() == sorted(sorted(range(d), key=hashes.__getitem__)[:k])
