"""The fused sparsifier kernels (gradzip/kernels/sparse.py) against the torch reference
(``kernels.use("torch")``): ``topk`` and ``dgc`` give the same wire (values bit for bit,
indices in the same order), the same ``selected``, the same decoded tensor (plain and
into ``out``), the same residual and the same aggregate, on every dtype the kernels take,
odd sizes, 0-d, empty and 1-element tensors, non-contiguous inputs, ties at the
threshold, zeros of both signs, infinities and NaN.

Bit for bit means equal bit patterns, except that a NaN may come out as another NaN
(torch itself gives different NaN bits on its vector and scalar paths)."""
from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradzip import kernels
from gradzip.compressors import build
from gradzip.compressors.dgc import _select
from gradzip.compressors.sparsify import _topk_select
from gradzip.kernels import sparse

from cases import same_bits

pytestmark = pytest.mark.skipif(not kernels.numba_available(), reason="numba is not installed")

SPECS = ["topk:ratio=0.01", "topk:ratio=0.3", "dgc:ratio=0.01", "dgc:ratio=0.001,sample_ratio=0.05",
         "dgc:ratio=0.3", "randomk:ratio=0.01", "randomk:ratio=0.3,unbiased=true"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Same dtype, shape and bits (any NaN matches any NaN: cases.same_bits)."""
    assert same_bits(got, want), what


def make(kind: str, shape, dtype, seed: int) -> torch.Tensor:
    """A test tensor: normal, heavy-tailed, ties (few distinct magnitudes), sparse with
    signed zeros, or with NaN and infinities sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for s in shape:
        numel *= s
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    if kind == "heavy":
        x = x ** 3
    elif kind == "ties":
        x = torch.randint(-3, 4, (numel,), generator=g).to(torch.float64) * 0.5
    elif kind == "zeros":
        # 0.4% non-zero: at ratio 0.01 zeros are selected too (the threshold is 0)
        x = torch.where(torch.rand(numel, generator=g) < 0.996, torch.zeros(()), x)
        x = torch.where(torch.rand(numel, generator=g) < 0.5, -x, x)   # -0.0 too
    elif kind == "special" and numel:
        pick = torch.randint(numel, (max(1, numel // 500),), generator=g)
        x[pick] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])[torch.arange(pick.numel()) % 4].double()
    elif kind == "allzero":   # of both signs
        x = torch.zeros(numel, dtype=torch.float64) * torch.randn(numel, generator=g, dtype=torch.float64).sign()
    return x.to(dtype).view(shape)


def both(fn):
    """``fn()`` on the reference path and on the fused one."""
    with kernels.use("torch"):
        want = fn()
    with kernels.use("numba"):
        got = fn()
    return got, want


def assert_same_packets(got, want, what=""):
    assert got.wire.keys() == want.wire.keys(), what
    for name in want.wire:
        assert_same(got.wire[name], want.wire[name], f"{what} wire {name}")
    assert got.meta.keys() == want.meta.keys() and got.shape == want.shape and got.dtype == want.dtype, what
    for name, value in want.meta.items():
        if isinstance(value, torch.Tensor):
            assert_same(got.meta[name], value, f"{what} meta {name}")
        else:
            assert got.meta[name] == value, f"{what} meta {name}"


def check_codec(spec: str, x: torch.Tensor, seed: int = 5) -> None:
    codec = build(spec)
    what = f"{spec} {x.dtype} {tuple(x.shape)}"
    got, want = both(lambda: codec.compress(x, seed))
    assert_same_packets(got, want, what)
    # the residual in the same pass, into a buffer holding garbage
    def residual():
        out = torch.full(x.shape, 7.0, dtype=x.dtype)
        return codec.compress_residual(x, seed, out), out
    (gp, gr), (wp, wr) = both(residual)
    assert_same_packets(gp, wp, what + " compress_residual")
    assert_same(gr, wr, what + " residual")
    # decoding, plain and into a reused buffer
    dec = both(lambda: codec.decompress(want))
    assert_same(*dec, what + " decompress")
    into = both(lambda: codec.decompress(want, out=torch.full(x.shape, 3.0, dtype=x.dtype)))
    assert_same(*into, what + " decompress(out=)")
    assert_same(into[1], dec[1], what)
    # compress into an earlier packet's buffers
    def reused():
        earlier = codec.compress(torch.ones_like(x), 1)
        return codec.compress(x, seed, reuse=earlier)
    assert_same_packets(*both(reused), what + " reuse")
    # the aggregate of three workers
    others = [codec.compress(make("normal", x.shape, x.dtype, s), s) for s in (1, 2)]
    agg = both(lambda: codec.aggregate([want] + others))
    assert_same(*agg, what + " aggregate")


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (37, 41), (40_001,), (3, 0, 2)])
def test_fused_matches_the_reference(spec, dtype, shape):
    check_codec(spec, make("normal", shape, dtype, seed=len(shape)), seed=3)


@pytest.mark.parametrize("kind", ["heavy", "ties", "zeros", "special", "allzero"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "dgc:ratio=0.01", "dgc:ratio=0.004", "randomk:ratio=0.02,unbiased=true"])
def test_fused_matches_the_reference_on_awkward_values(spec, dtype, kind):
    """Ties at the threshold, signed zeros, NaN and infinities, an all-zero tensor; large
    enough (70001 entries) for the sampled selection of both codecs."""
    check_codec(spec, make(kind, (70_001,), dtype, seed=11), seed=4)


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "dgc:ratio=0.01", "randomk:ratio=0.01"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_input(spec, dtype):
    x = make("normal", (211, 193), dtype, seed=2).t()
    assert not x.is_contiguous()
    check_codec(spec, x)
    check_codec(spec, make("normal", (200_000,), dtype, seed=3)[::3])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.sampled_from(SPECS), dtype=st.sampled_from(DTYPES),
       kind=st.sampled_from(["normal", "heavy", "ties", "zeros", "special", "allzero"]),
       numel=st.one_of(st.integers(0, 70), st.integers(6_000, 80_000)), seed=st.integers(0, 2**31 - 1))
def test_fused_matches_the_reference_hypothesis(spec, dtype, kind, numel, seed):
    check_codec(spec, make(kind, (numel,), dtype, seed), seed=seed)


def test_the_selection_is_the_reference_selection():
    """The fused candidate scan changes nothing of either selection: same indices, same
    order, and the values are those of the tensor."""
    x = make("heavy", (300_001,), torch.float32, seed=9)
    want = _topk_select(x, 3000)[0]
    idx, values = _topk_select(x, 3000, lambda t, e: sparse.scan(x, t, None, e))
    assert torch.equal(idx, want) and torch.equal(values, x[want])
    want, _ = _select(x, 3000, 0.01, 7)
    got, values = _select(x, 3000, 0.01, 7, scan=lambda t, e: sparse.scan(x, t, None, e))
    assert torch.equal(got.long(), want) and torch.equal(values, x[want])


@pytest.mark.parametrize("dtype", DTYPES)
def test_scan_casts_the_threshold_as_torch_compares(dtype):
    """A Python threshold is rounded to the tensor's dtype as torch's ``>=`` rounds it;
    NaN, negative and infinite thresholds; a scratch too small (a second pass, the copy
    into the residual done once and right)."""
    x = torch.tensor([1.0, 1.0009765625, 1.00048828125, -1.0004, 0.0, -0.0, 3.0, -float("inf"),
                      float("nan"), 2.0, -2.5] * 301, dtype=torch.float64).to(dtype)
    for threshold in (1.0004, 1.0005, 1.00048828125, 0.0, -0.0, -1.0, 2.0, float("inf"),
                      float("nan"), 1e-30, torch.tensor(2.0, dtype=dtype)):
        want = torch.nonzero(x.abs() >= threshold).view(-1)
        out = torch.full_like(x, 5.0)
        idx, values = sparse.scan(x, threshold, out, expect=1)
        assert torch.equal(idx.long(), want), threshold
        assert_same(values, x[want], str(threshold))
        assert_same(out, x)


def test_out_of_range_indices_raise_as_the_reference():
    x = torch.randn(100)
    for spec in ("topk:ratio=0.1", "dgc:ratio=0.1"):
        codec = build(spec)
        packet = codec.compress(x)
        packet.wire["indices"][3] = 100
        for mode in ("torch", "numba"):
            with kernels.use(mode), pytest.raises(IndexError):
                codec.decompress(packet, out=torch.empty(100))
            with kernels.use(mode), pytest.raises(IndexError):
                codec.aggregate([packet, packet])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dgc_decode_of_repeated_indices_in_16_bits(dtype):
    """Two non-zero values added into one 16-bit entry need a rounding the kernel leaves
    to the reference; repeated indices with value 0 (the padding) it does itself."""
    codec = build("dgc:ratio=0.05")
    packet = codec.compress(torch.randn(200).to(dtype))
    for values, indices in [([0.3, 0.1, 0.7, 0.2], [5, 5, 9, 5]), ([0.3, 0.0, -0.0, 0.2], [5, 5, 5, 6])]:
        packet.wire["values"][:4] = torch.tensor(values, dtype=dtype)
        packet.wire["indices"][:4] = torch.tensor(indices, dtype=torch.int32)
        got, want = both(lambda: codec.decompress(packet, out=torch.empty(200, dtype=dtype)))
        assert_same(got, want)


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "dgc:ratio=0.01", "randomk:ratio=0.01"])
def test_compress_writes_into_the_reused_packet(spec):
    """With ``reuse``, the fused path allocates no wire: the new packet holds the earlier
    packet's tensors (the reference path ignores ``reuse``)."""
    codec = build(spec)
    x = torch.randn(50_000)
    earlier = codec.compress(torch.randn(50_000), 1)
    buffers = {name: t.data_ptr() for name, t in earlier.wire.items()}
    with kernels.use("numba"):
        packet = codec.compress(x, 2, reuse=earlier)
        assert {name: t.data_ptr() for name, t in packet.wire.items()} == buffers
        residual = torch.empty_like(x)
        again = codec.compress_residual(x, 2, residual, reuse=packet)
        assert {name: t.data_ptr() for name, t in again.wire.items()} == buffers
    with kernels.use("torch"):
        want = codec.compress(x, 2)
        assert_same(residual, x - codec.decompress(want))
    assert_same_packets(again, want)


def test_threads_have_their_own_scratch():
    """Workers on threads (``gradzip.simulate``) scan at once: each its own scratch."""
    codec = build("dgc:ratio=0.01")
    xs = [make("normal", (120_000,), torch.float32, seed=s) for s in range(4)]
    with kernels.use("torch"):
        want = [codec.compress(x, 1) for x in xs]
    got = [None] * 4

    def work(i):
        with kernels.use("numba"):
            for _ in range(5):
                got[i] = codec.compress(xs[i], 1)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for g, w in zip(got, want):
        assert_same_packets(g, w)


def test_a_huge_candidate_set_is_not_kept_as_scratch(monkeypatch):
    """A threshold of 0 selects everything: the scan still returns it all, and the thread's
    kept scratch stays within ``KEEP`` entries."""
    monkeypatch.setattr(sparse, "KEEP", 4096)
    monkeypatch.setattr(sparse._scratch, "bufs", {}, raising=False)
    x = make("zeros", (50_000,), torch.float32, seed=1)
    idx, values = sparse.scan(x, 0.0, None, expect=10)
    assert torch.equal(idx.long(), torch.arange(50_000)) and torch.equal(values, x)
    held = sparse._scratch.bufs[torch.float32][0]
    assert held.numel() <= 4096
    check_codec("dgc:ratio=0.01", x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scan_finds_candidates_at_every_position_of_its_chunks(dtype):
    """Candidates at the edges of the scan's 64-entry words and CHUNK-entry chunks, runs of
    them, a full word, a partial last chunk: the indices torch.nonzero gives, in order."""
    n = 3 * sparse.CHUNK + 77
    where = sorted({0, 1, 7, 8, 62, 63, 64, 65, 127, 128, sparse.CHUNK - 1, sparse.CHUNK, sparse.CHUNK + 63,
                    2 * sparse.CHUNK - 64, n - 2, n - 1} | set(range(300, 364)) | set(range(1000, 1100, 3)))
    x = torch.full((n,), 0.25, dtype=dtype)
    x[where] = torch.linspace(1.0, 2.0, len(where)).to(dtype) * torch.tensor([1.0, -1.0]).repeat(len(where))[:len(where)].to(dtype)
    for expect in (1, len(where)):
        out = torch.empty_like(x)
        idx, values = sparse.scan(x, 1.0, out, expect=expect)
        assert idx.tolist() == where and torch.equal(values, x[where]) and torch.equal(out, x)
