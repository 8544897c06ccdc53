"""Fused kernels of ``1bit``, ``qsgd``, ``terngrad`` (gradzip.kernels.quantize) and the
counter-based uniforms they draw (gradzip.kernels.counter_rng): every fused path gives the
torch reference's bits (wire, decoded values, residual, aggregate), on odd, empty and
one-element tensors, non-contiguous and 16-bit inputs; the uniforms follow their plain-Python
rule and look uniform."""
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gradzip import kernels
from gradzip.compressors import _util, build
from gradzip.compressors.bitpack import pack_bits, unpack_bits
from gradzip.kernels import counter_rng, quantize

SPECS = ["1bit", "qsgd", "qsgd:levels=1", "qsgd:levels=3", "qsgd:levels=64", "qsgd:levels=127", "terngrad"]
SHAPES = [(), (0,), (1,), (7,), (13,), (0, 3), (3, 0), (5, 3), (37, 41), (4099,), (3, 1, 5), (9, 4, 5)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def sample(shape, seed, dtype=torch.float32, transpose=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if x.numel():
        x.view(-1)[:: 5] = 0.0  # zeros (sign +, no mass) and a -0.0
        x.view(-1)[-1] = -0.0
    if transpose and x.dim() >= 2:
        x = x.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, not contiguous
    return x.to(dtype)


def run(codec, x, seed, mode):
    """Everything a codec computes for ``x``, under one kernel mode."""
    with kernels.use(mode):
        p = codec.compress(x, seed)
        plain = codec.decompress(p)
        buf = torch.full(x.shape, float("nan"), dtype=x.dtype)
        into = codec.decompress(p, out=buf)
        res = torch.full(x.shape, float("nan"), dtype=x.dtype)
        rp = codec.compress_residual(x, seed, res)
        other = codec.compress(x * 0.5, seed + 1)
        agg = codec.aggregate([p, other, p])  # fused for float32: decode-and-add passes
    assert into is buf
    return p, plain, buf, rp, res, agg


def assert_same(a, b):
    p, plain, buf, rp, res, agg = a
    q, plain2, buf2, rq, res2, agg2 = b
    for packet, other in ((p, q), (rp, rq)):
        assert packet.wire.keys() == other.wire.keys()
        for k in packet.wire:
            assert packet.wire[k].dtype == other.wire[k].dtype, k
            assert torch.equal(packet.wire[k], other.wire[k]), k
    for t, u in ((plain, plain2), (buf, buf2), (res, res2), (agg, agg2)):
        assert t.dtype == u.dtype and t.shape == u.shape
        assert torch.equal(t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32),
                           u.view(torch.int16) if u.element_size() == 2 else u.view(torch.int32)) \
            if t.numel() else True  # bit for bit (-0.0 included)


# -- bit identity, fused vs reference ---------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_equals_reference_on_every_shape(spec, dtype):
    codec = build(spec)
    for i, shape in enumerate(SHAPES):
        for transpose in (False, True):
            x = sample(shape, seed=i, dtype=dtype, transpose=transpose)
            assert_same(run(codec, x, 7 + i, "torch"), run(codec, x, 7 + i, "numba"))


@pytest.mark.parametrize("spec", ["1bit", "qsgd", "terngrad"])
def test_fused_equals_reference_for_float64(spec):
    """float64 inputs, with entries that float32 cannot hold (a tiny negative one rounds to
    −0.0 there: 1bit compares in float64 on both paths, so its bit is 0)."""
    codec = build(spec)
    for i, shape in enumerate([(7,), (37, 41), (4099,), (3, 1, 5)]):
        for transpose in (False, True):
            x = sample(shape, seed=i, dtype=torch.float64)
            x.view(-1)[1] = -1e-300
            x.view(-1)[2] = 1e-300
            if transpose and x.dim() >= 2:
                x = x.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, not contiguous
            assert_same(run(codec, x, 7 + i, "torch"), run(codec, x, 7 + i, "numba"))


@settings(max_examples=30, deadline=None)
@given(spec=st.sampled_from(SPECS), rows=st.integers(0, 70), cols=st.integers(0, 9),
       seed=st.integers(-2**63, 2**64), dtype=st.sampled_from(DTYPES), scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e30]))
def test_fused_equals_reference_property(spec, rows, cols, seed, dtype, scale):
    codec = build(spec)
    x = (sample((rows, cols) if cols else (rows,), seed=rows * 10 + cols) * scale).to(dtype)
    assume(bool(torch.isfinite(x).all()))  # 1e30 overflows float16: non-finite, below
    assert_same(run(codec, x, seed, "torch"), run(codec, x, seed, "numba"))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(1000,), (37, 41), (9, 4, 5, 5)])
def test_fused_equals_piecewise_reference(spec, shape, monkeypatch):
    """With one torch thread the CPU reference encodes piece by piece (1bit's column sums
    too): the fused path reproduces those pieces' sums."""
    monkeypatch.setattr(_util, "PIECEWISE", True)
    monkeypatch.setattr(_util, "CHUNK", 64)
    codec = build(spec)
    x = sample(shape, seed=3)
    assert_same(run(codec, x, 4, "torch"), run(codec, x, 4, "numba"))


@pytest.mark.parametrize("spec", ["qsgd", "qsgd:levels=5", "terngrad"])
def test_fused_equals_reference_across_counter_blocks(spec, monkeypatch):
    """Tensors of more than 2^32 entries change keys every 2^32 entries; a small block makes
    the fused path (one kernel call per block) and the reference cross several."""
    monkeypatch.setattr(counter_rng, "BLOCK", 64)
    codec = build(spec)
    x = sample((1001,), seed=5)
    assert_same(run(codec, x, 9, "torch"), run(codec, x, 9, "numba"))
    with kernels.use("numba"):
        blocked = codec.compress(x, 9)
    monkeypatch.setattr(counter_rng, "BLOCK", 1 << 32)
    with kernels.use("numba"):
        assert not torch.equal(blocked.wire["codes"], codec.compress(x, 9).wire["codes"])


@pytest.mark.parametrize("spec", SPECS)
def test_non_finite_input_gives_codes_in_range(spec):
    """Bit identity is promised for finite tensors (a NaN's uint8 cast in the reference is
    unspecified; the optimizers stop NaN/Inf before compressing unless ``nonfinite="off"``).
    The fused path still writes only codes of its width, and decodes without a crash."""
    codec = build(spec)
    x = sample((9, 5), seed=1)
    x[1, 2], x[4, 4], x[7, 0] = float("nan"), float("inf"), -float("inf")
    with kernels.use("numba"):
        p = codec.compress(x, 3)
        out = codec.decompress(p)
    assert out.shape == x.shape
    if spec != "1bit":
        width = codec.bits if spec.startswith("qsgd") else 2
        codes = unpack_bits(p.wire["codes"], width, x.numel())
        assert torch.equal(pack_bits(codes, width), p.wire["codes"])
        assert int(codes.max()) <= (2 * codec.levels if spec.startswith("qsgd") else 3)


@pytest.mark.parametrize("spec", SPECS)
def test_reuse_writes_into_the_earlier_packet(spec):
    """``compress(reuse=p)`` on the fused path writes the wire into ``p``'s buffers (no new
    tensors) and gives the bits a fresh compress gives."""
    codec = build(spec)
    x, y = sample((37, 41), seed=1), sample((37, 41), seed=2)
    with kernels.use("numba"):
        old = codec.compress(x, 3)
        ptrs = {k: t.data_ptr() for k, t in old.wire.items()}
        fresh = codec.compress(y, 4)
        again = codec.compress(y, 4, reuse=old)
        res = torch.empty_like(y)
        old2 = codec.compress(x, 3)
        ptrs2 = {k: t.data_ptr() for k, t in old2.wire.items()}
        with_res = codec.compress_residual(y, 4, res, reuse=old2)
    for k in fresh.wire:
        assert again.wire[k].data_ptr() == ptrs[k], k
        assert with_res.wire[k].data_ptr() == ptrs2[k], k
        assert torch.equal(again.wire[k], fresh.wire[k]) and torch.equal(with_res.wire[k], fresh.wire[k])
    with kernels.use("numba"):  # a packet of another size is not reused
        small = codec.compress(sample((5,), seed=1), 3)
        other = codec.compress(y, 4, reuse=small)
    assert torch.equal(other.wire[next(iter(fresh.wire))], fresh.wire[next(iter(fresh.wire))])


@pytest.mark.parametrize("spec", SPECS)
def test_decompress_into_out_of_another_layout_or_dtype(spec):
    codec = build(spec)
    x = sample((6, 5), seed=2)
    with kernels.use("numba"):
        p = codec.compress(x, 1)
        plain = codec.decompress(p)
        t = torch.full((5, 6), float("nan")).t()  # non-contiguous out
        assert codec.decompress(p, out=t) is t and torch.equal(t, plain)
        with pytest.raises(ValueError, match="shape"):
            codec.decompress(p, out=torch.empty(30))
        with pytest.raises(ValueError, match="float32"):
            codec.decompress(p, out=torch.empty(6, 5, dtype=torch.float16))


# -- the codecs' rules, element by element, in plain Python ---------------------------------------
@pytest.mark.parametrize("levels", [1, 3, 16, 127])
@pytest.mark.parametrize("mode", ["torch", "numba"])
def test_qsgd_codes_follow_the_counter_uniforms(levels, mode):
    """``ξ_j = min(⌊s·|v_j|/‖v‖ + u_j⌋, s)`` with ``u_j = counter_rng.uniform_at(seed, j)``,
    in float32, entry by entry (the draws depend on the seed and the index only)."""
    codec = build(f"qsgd:levels={levels}")
    x = sample((300,), seed=levels)
    seed = 12345 + levels
    with kernels.use(mode):
        p = codec.compress(x, seed)
    codes = unpack_bits(p.wire["codes"], codec.bits, x.numel()).tolist()
    norm = np.float32(math.sqrt(defined_square_sum(x.numpy())))  # docs/algorithms.md §codec: qsgd
    assert p.wire["norm"].item() == norm
    scale = np.float32(np.float32(levels) / norm)
    for j, a in enumerate(x.tolist()):
        y = np.float32(np.float32(abs(np.float32(a)) * scale) + np.float32(counter_rng.uniform_at(seed, j)))
        xi = min(math.floor(y), levels)
        assert codes[j] == (levels + xi if a >= 0 else levels - xi), j


@pytest.mark.parametrize("mode", ["torch", "numba"])
def test_terngrad_codes_follow_the_counter_uniforms(mode):
    codec = build("terngrad")
    x = sample((300,), seed=4)
    seed = 99
    with kernels.use(mode):
        p = codec.compress(x, seed)
    codes = unpack_bits(p.wire["codes"], 2, x.numel()).tolist()
    s = np.float32(x.abs().max().item())
    for j, a in enumerate(x.tolist()):
        keep = np.float32(np.float32(counter_rng.uniform_at(seed, j)) * s) < abs(np.float32(a))
        assert codes[j] == ((3 if a > 0 else 2) if keep else 0), j


# -- the defined summation orders (docs/algorithms.md §codec: 1bit, qsgd), in numpy ----------------
def _fold(acc):
    """Lanes added pairwise: ``k + (k + h)`` with ``h`` halving (the last axis, a power of two
    times the result's width ``acc.shape[-1] >> levels``)."""
    return acc[..., : acc.shape[-1] // 2] + acc[..., acc.shape[-1] // 2:]


def defined_square_sum(x):
    """``Σ x_j²`` in the order §codec: qsgd defines: float32 squares; blocks of 64 lines of
    1024 float64 lanes, each lane summing its line entries from 0.0, the lanes folded
    pairwise; the block sums summed the same way until one is left."""
    vals = (x.reshape(-1) * x.reshape(-1)).astype(np.float64)
    while True:
        blocks = max(1, -(-vals.size // 65536))
        grid = np.zeros(blocks * 65536)
        grid[: vals.size] = vals
        acc = np.zeros((blocks, 1024))
        for r, line in enumerate(np.moveaxis(grid.reshape(blocks, 64, 1024), 1, 0)):
            acc = acc + line
        while acc.shape[1] > 1:
            acc = _fold(acc)
        vals = acc[:, 0]
        if blocks == 1:
            return float(vals[0])


def defined_means(x):
    """1bit's ``(2, cols)`` means of ``x`` (rows × cols float32) in the order §codec: 1bit
    defines: lines of ``w = cols·2^j ≥ 1024`` entries, blocks of 64 lines; float32 lanes sum
    the clamped entries line by line from 0.0; widened, folded pairwise to the columns;
    the block sums added pairwise (row ``b`` + row ``b + ⌈count/2⌉``); float64 sum / count,
    rounded to float32 once."""
    rows, cols = x.shape
    w = cols
    while w < 1024:
        w *= 2
    blocks = max(1, -(-(-(-x.size // w)) // 64))
    grid = np.zeros(blocks * 64 * w, np.float32)
    grid[: x.size] = x.reshape(-1)
    grid = grid.reshape(blocks, 64, w)
    out = []
    for part in (np.where(grid > 0, grid, np.float32(0)), np.where(grid < 0, grid, np.float32(0))):
        acc = np.zeros((blocks, w), np.float32)
        for r in range(64):
            acc = acc + part[:, r]  # float32 adds
        acc = acc.astype(np.float64)
        while acc.shape[1] > cols:
            acc = _fold(acc)
        while acc.shape[0] > 1:
            half = (acc.shape[0] + 1) // 2
            top = acc[:half].copy()
            top[: acc.shape[0] - half] += acc[half:]
            acc = top
        out.append(acc[0])
    nonneg = (x >= 0).sum(0)
    return np.stack([out[0] / np.maximum(nonneg, 1), out[1] / np.maximum(rows - nonneg, 1)]).astype(np.float32)


@pytest.mark.parametrize("mode", ["torch", "numba"])
@pytest.mark.parametrize("numel", [1, 1000, 65536 + 1, 3 * 65536 + 999])
def test_qsgd_norm_is_summed_in_its_defined_order(mode, numel):
    """The wire norm is ``float32(sqrt(Σ v²))`` summed in the defined order (several blocks:
    the partial block and the sum of the block sums), on both paths; torch's own
    ``vector_norm`` (the earlier rule) gives other bits for most of these tensors."""
    x = sample((numel,), seed=numel) * 3
    with kernels.use(mode):
        p = build("qsgd").compress(x, 1)
    assert p.wire["norm"].item() == np.float32(math.sqrt(defined_square_sum(x.numpy())))


@pytest.mark.parametrize("mode", ["torch", "numba"])
@pytest.mark.parametrize("shape", [(3 * 65536 + 77, 1), (1000, 3), (300, 5), (130, 1500), (2, 1025)])
def test_1bit_means_are_summed_in_their_defined_order(mode, shape):
    """The wire means follow the defined order: a vector across several blocks and a
    partial one, columns that share lines (3 columns: lines of 1536), wider rows than a line
    (1500 columns, more than 64 rows: two blocks)."""
    x = sample(shape, seed=sum(shape))
    with kernels.use(mode):
        p = build("1bit").compress(x)
    assert np.array_equal(p.wire["means"].numpy().view(np.int32), defined_means(x.numpy()).view(np.int32))


def test_fused_reductions_run_no_torch_reduction(monkeypatch):
    """The fused compress makes the reduction in its own pass: torch's ``aminmax``,
    ``vector_norm`` and ``Tensor.sum`` are not called (they were: a second pass each)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a torch reduction ran on the fused path")

    x = sample((37, 41), seed=2)
    monkeypatch.setattr(torch, "aminmax", refuse)
    monkeypatch.setattr(torch.linalg, "vector_norm", refuse)
    monkeypatch.setattr(torch.Tensor, "sum", refuse)
    with kernels.use("numba"):
        for spec in ("terngrad", "qsgd", "1bit"):
            build(spec).compress_residual(x, 1, torch.empty_like(x))
            build(spec).compress(x, 1)


@pytest.mark.parametrize("mode", ["torch", "numba"])
@pytest.mark.parametrize("zeros", [[0.0], [-0.0], [0.0, -0.0], [-0.0] * 50 + [0.0] * 50, []])
def test_terngrad_scale_of_a_zero_tensor_is_plus_zero(mode, zeros):
    """``s = max|v|`` is +0.0 for a zero tensor on both paths, so it decodes to +0.0
    (torch's ``aminmax`` gave −0.0 for some of these, by its order)."""
    x = torch.tensor(zeros, dtype=torch.float32)
    with kernels.use(mode):
        codec = build("terngrad")
        p = codec.compress(x, 3)
        out = codec.decompress(p)
    assert p.wire["scale"].view(torch.int32).item() == 0
    assert torch.equal(out.view(torch.int32), torch.zeros(len(zeros), dtype=torch.int32))


def test_terngrad_scale_is_max_abs_with_nan_and_inf():
    """The fused max: exact for any finite tensor, +inf with an infinity, NaN with a NaN."""
    x = sample((1001,), seed=6)
    x[500] = -7.25
    for extra, want in ((None, 7.25), (float("-inf"), math.inf), (float("nan"), math.nan)):
        y = x.clone()
        if extra is not None:
            y[17] = extra
        with kernels.use("numba"):
            s = build("terngrad").compress(y, 1).wire["scale"].item()
        assert s == want or (math.isnan(want) and math.isnan(s))


# -- the uniforms --------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, -1, 2**63 + 5, 2**64 - 1, 2**70 + 3])
def test_uniforms_follow_the_plain_python_rule(seed):
    starts = [0, 5, counter_rng.CHUNK - 3, 2**32 - 7]  # across a piece and a counter block
    for start in starts:
        got = counter_rng.uniforms(seed, start, 20).tolist()
        assert got == [counter_rng.uniform_at(seed, j) for j in range(start, start + 20)], start


def test_uniforms_in_pieces_equal_one_call(monkeypatch):
    whole = counter_rng.uniforms(7, 3, 1000)
    monkeypatch.setattr(counter_rng, "CHUNK", 64)
    assert torch.equal(counter_rng.uniforms(7, 3, 1000), whole)
    assert torch.equal(torch.cat([counter_rng.uniforms(7, 3, 500), counter_rng.uniforms(7, 503, 500)]), whole)


def test_hash_is_a_bijection_and_matches_the_reference_hash():
    """The keyed hash is a bijection of the 32-bit counter (checked on 2^16 counters: no
    collision), and ``mix32`` is hash-prospector's ``x ^= x>>16; x *= 0x21f0aaad; ...``."""
    assert counter_rng.mix32(0) == 0
    x = 0x12345678
    y = x ^ (x >> 16)
    y = (y * 0x21F0AAAD) % 2**32
    y ^= y >> 15
    y = (y * 0x735A2D97) % 2**32
    assert counter_rng.mix32(x) == y ^ (y >> 15)
    values = {counter_rng.hash_at(3, j) for j in range(1 << 16)}
    assert len(values) == 1 << 16


@pytest.mark.parametrize("seed", [0, 1, 2, 2**40])
def test_uniforms_look_uniform(seed):
    """Chi-square over 64 bins of 2^18 draws, mean and variance, lag-1 and cross-seed
    correlation, all with fixed seeds (so deterministic): within 5 standard errors."""
    n = 1 << 18
    u = counter_rng.uniforms(seed, 0, n).double()
    assert u.min() >= 0 and u.max() < 1
    counts = torch.bincount((u * 64).long(), minlength=64).double()
    chi2 = ((counts - n / 64) ** 2 / (n / 64)).sum().item()
    assert chi2 < 63 + 5 * math.sqrt(2 * 63)  # E = 63, sd = sqrt(126)
    se_mean = math.sqrt(1 / 12 / n)
    assert abs(u.mean().item() - 0.5) < 5 * se_mean
    assert abs(u.var().item() - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    c = u - 0.5
    for other in (c[1:] * c[:-1], c * (counter_rng.uniforms(seed + 1, 0, n).double() - 0.5)):
        r = other.mean().item() / (1 / 12)
        assert abs(r) < 5 / math.sqrt(other.numel())


def test_numba_uniform_follows_the_plain_python_rule():
    """The kernels' inline draw (an intrinsic in 32-bit operations) is ``uniform_at``, on
    either side of 2^31 and up to the block's last counter, for the integer types it gets."""
    numba = pytest.importorskip("numba")
    uniform = counter_rng.numba_uniform()

    @numba.njit
    def draws(js, k0, k1, out):
        for i in range(js.size):
            out[i] = uniform(js[i], k0, k1)

    js = np.array([0, 1, 2, 255, 2**16 + 1, 2**31 - 1, 2**31, 2**31 + 9, 2**32 - 2, 2**32 - 1], np.int64)
    for seed in (0, 1, -1, 2**63 + 5, 2**64 - 1):
        k0, k1 = counter_rng.keys(seed)
        expect = [counter_rng.uniform_at(seed, int(j)) for j in js]
        for j_, ks in ((js, (np.uint64(k0), np.uint64(k1))), (js.astype(np.uint32), (np.uint32(k0), np.uint32(k1)))):
            out = np.empty(js.size, np.float32)
            draws(j_, *ks, out)
            assert out.tolist() == expect, (seed, ks)


def test_fused_kernels_hash_on_32_bit_vector_lanes():
    """The draws vectorise on 32-bit lanes (issue 14: on 64-bit lanes, numba's typing of
    uint32 arithmetic, the hash ran at half width and cost qsgd and terngrad most of their
    time): the kernel's optimised LLVM IR multiplies vectors of i32, never of i64. (terngrad's
    kernel, the quicker to compile; qsgd's draws the same way.)"""
    numba = pytest.importorskip("numba")
    quantize._compile_helpers()
    fn = numba.njit(quantize._terngrad_encode.py_func)
    k = np.uint64(5)
    fn(np.ones(64, np.float32), np.float32(1), k, k, np.zeros(64, np.uint8), np.empty(0, np.float32))
    ir = "\n".join(fn.inspect_llvm().values())
    assert re.search(r"mul <\d+ x i32>", ir)
    assert not re.search(r"mul <\d+ x i64>", ir)


def test_fused_kernels_draw_the_reference_uniforms():
    """terngrad with ``v_j = 1`` except one entry ``2``: ``s = 2`` and entry j is kept exactly
    when ``2·u_j < 1``; the kept pattern is the uniforms' top bit, fused and reference."""
    x = torch.ones(5000)
    x[17] = 2.0
    u = counter_rng.uniforms(31, 0, 5000)
    for mode in ("torch", "numba"):
        with kernels.use(mode):
            out = build("terngrad").decompress(build("terngrad").compress(x, 31))
        expect = torch.where(u * 2 < 1, 2.0, 0.0)
        expect[17] = 2.0
        assert torch.equal(out, expect), mode


# -- the packing helpers --------------------------------------------------------------------------
@pytest.mark.parametrize("bits", range(1, 9))
def test_kernel_packing_is_bitpack_layout(bits):
    """qsgd's codes for every width ``b`` (levels 1..127 cover b = 2..8; 1 and 2 are 1bit
    and terngrad): the fused wire unpacks with bitpack and packs back to itself, is the
    reference's, and decodes to the reference's values (sizes around words and pieces)."""
    levels = {1: None, 2: 1, 3: 2, 4: 4, 5: 8, 6: 16, 7: 32, 8: 64}[bits]
    if levels is None:
        codec = build("1bit")
    else:
        codec = build(f"qsgd:levels={levels}")
        assert codec.bits == bits
    piece = quantize.PIECE if levels else quantize.ONEBIT_PIECE
    for n in (1, 7, 8, 9, 15, 16, 17, 63, 64, 65, piece - 1, piece, piece + 9, 2 * piece + 71):
        x = sample((n,), seed=n)
        with kernels.use("numba"):
            packet = codec.compress(x, 2)
            decoded = codec.decompress(packet)
        wire = packet.wire["codes" if levels else "bits"]
        assert wire.numel() == math.ceil(n * bits / 8)
        assert torch.equal(pack_bits(unpack_bits(wire, bits, n), bits), wire)
        with kernels.use("torch"):
            assert torch.equal(codec.compress(x, 2).wire["codes" if levels else "bits"], wire)
            assert torch.equal(codec.decompress(packet), decoded)


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_qsgd_kernels_take_unaligned_packet_buffers(offset):
    """A packet may sit at any byte of a bucket's message (PSync's transports): the kernels,
    which store and load the codes as 8-byte words, encode into and decode from a buffer at
    an odd address the bits of an aligned one (sizes with and without a partial group)."""
    codec = build("qsgd")
    assert codec.bits == 6
    for n in (16, 17, 1000, quantize.PIECE + 33):
        x = sample((n,), seed=n)
        with kernels.use("numba"):
            packet = codec.compress(x, 5)
            expect = codec.decompress(packet)
        codes = packet.wire["codes"]
        norm = packet.wire["norm"].item()
        scale = np.float32(codec.levels) / np.float32(norm)
        step = np.float32(norm) / np.float32(codec.levels)
        moved = torch.zeros(codes.numel() + offset, dtype=torch.uint8)[offset:]
        quantize.qsgd_encode(x, scale, codec.levels, 6, 5, moved, None, step)
        assert torch.equal(moved, codes)
        out = torch.empty(n)
        quantize.qsgd_decode(moved, codec.levels, 6, step, out)
        assert torch.equal(out, expect)


def test_helpers_compile_once_even_when_threads_race(monkeypatch):
    """Worker threads (``gradzip.simulate``) make their first kernel call at the same time:
    a thread that finds the helpers already compiled by another must not compile them
    again (numba refuses to jit a jitted function: a TypeError killed a threaded run)."""
    with kernels.use("numba"):
        build("terngrad").compress(torch.ones(3), 1)  # the helpers are compiled
    monkeypatch.setattr(quantize, "_helpers_ready", [])  # ... as another thread sees them
    quantize._compile_helpers()
    with kernels.use("numba"):
        assert torch.equal(build("terngrad").decompress(build("terngrad").compress(torch.ones(3), 1)), torch.ones(3))


@pytest.mark.parametrize("spec,kernel", [("1bit", "onebit_decode"), ("qsgd", "qsgd_decode"), ("terngrad", "terngrad_decode")])
def test_aggregate_decodes_and_adds_in_one_pass(spec, kernel, monkeypatch):
    """float32 on the CPU: the aggregate decodes the first packet and adds every other one
    in its decode pass (no decoded temporary per packet), with the reference's bits."""
    codec = build(spec)
    xs = [sample((37, 41), seed=s) for s in range(3)]
    with kernels.use("torch"):
        expected = codec.aggregate([codec.compress(x, 5 + i) for i, x in enumerate(xs)])
    calls = []
    real = getattr(quantize, kernel)
    monkeypatch.setattr(quantize, kernel, lambda *a, **k: calls.append(k.get("add", False)) or real(*a, **k))
    with kernels.use("numba"):
        packets = [codec.compress(x, 5 + i) for i, x in enumerate(xs)]
        got = codec.aggregate(packets)
    assert calls == [False, True, True]
    assert torch.equal(got, expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_the_cpu_uniforms():
    """The counter-based uniforms do not depend on the device (torch.rand's did)."""
    assert torch.equal(counter_rng.uniforms(77, 5, 100_000, "cuda").cpu(), counter_rng.uniforms(77, 5, 100_000))
