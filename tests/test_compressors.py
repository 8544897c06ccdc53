"""Codecs (spec, "Compressors"): each rule, wire sizes, unbiasedness, shared randomness,
the two aggregation paths, spec strings."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.compressors import Compressor, Packet, _util, build, keep_count, names
from gradzip import kernels
from gradzip.errors import GradzipError
from gradzip.kernels import counter_rng

from cases import sparse_index_dtype

SHAPES = [(), (1,), (7,), (33,), (5, 3), (10, 9), (4, 3, 3, 3), (3, 1, 5)]
EXTRA_SPECS = [
    "2bit:threshold=0.3",
    "qsgd:levels=1",
    "qsgd:levels=3",
    "qsgd:levels=127",
    "topk:ratio=0.3",
    "topk2bit:ratio=0.3",
    "int4:block=5",
    "dct:chunk=3,topk=2",
    "randomk:ratio=0.3,unbiased=true",
    "randblock:ratio=0.25",
    "randblock:in=2,out=3,layer=1",
    "randblock:in=3,out=2,layer=2",
]
ALL_SPECS = names() + EXTRA_SPECS


def randn(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def distinct(shape, seed=0):
    """Values with distinct magnitudes, no zeros, both signs."""
    d = math.prod(shape)
    g = torch.Generator().manual_seed(seed)
    mags = (torch.randperm(d, generator=g).float() + 1) / d
    signs = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0)
    return (mags * signs).reshape(shape)


# -- every codec --------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_any_shape_and_dtype_input_untouched(spec, dtype):
    c = build(spec)
    for shape in SHAPES:
        t = randn(shape, seed=len(shape), dtype=dtype)
        before = t.clone()
        p = c.compress(t, seed=5)
        assert torch.equal(t, before), "compress modified its input"
        for w in p.wire.values():  # only `none` sends the input itself (base: memory rules)
            shared = w.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            assert shared == (spec == "none"), "wire aliases input"
        out = c.decompress(p)
        assert out.shape == t.shape and out.dtype == t.dtype
        assert torch.isfinite(out.float()).all()
        agg = c.aggregate([p, p])
        assert agg.shape == t.shape and agg.dtype == t.dtype


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_non_contiguous_input_same_as_contiguous(spec):
    c = build(spec)
    v = randn((6, 5), seed=2).t()
    assert not v.is_contiguous()
    assert torch.equal(c.decompress(c.compress(v, seed=3)), c.decompress(c.compress(v.contiguous(), seed=3)))


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_zero_tensor_decodes_to_zero_or_sign(spec):
    c = build(spec)
    out = c.decompress(c.compress(torch.zeros(6, 5), seed=1))
    expected = torch.ones(6, 5) if spec == "sign" else torch.zeros(6, 5)  # sign(0) = +1
    assert torch.equal(out, expected)


@pytest.mark.parametrize("spec", ["2bit", "1bit", "sign", "scaled_sign", "qsgd", "qsgd:levels=3", "terngrad"])
@pytest.mark.parametrize("shape", [(1000,), (37, 41), (9, 4, 5, 5)])
def test_piecewise_cpu_encoding_gives_the_same_packet(spec, shape, monkeypatch):
    c = build(spec)
    v = randn(shape, seed=3)
    whole = c.compress(v, seed=4)
    monkeypatch.setattr(_util, "PIECEWISE", True)
    monkeypatch.setattr(_util, "CHUNK", 64)  # large tensors are encoded piece by piece
    pieces = c.compress(v, seed=4)
    for key in whole.wire:
        torch.testing.assert_close(pieces.wire[key], whole.wire[key], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(c.decompress(pieces), c.decompress(whole), rtol=1e-6, atol=1e-6)
    piecewise_decode = c.decompress(whole)
    monkeypatch.setattr(_util, "CHUNK", 1 << 30)
    assert torch.equal(piecewise_decode, c.decompress(whole))


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_a_codec_that_reads_no_seed_makes_one_packet_for_every_seed(spec):
    """``uses_seed = False`` lets PSync pass 0 instead of a seed derived per tensor: a promise
    that the packet is the same for any seed; the random codecs read theirs."""
    codec = build(spec)
    v = randn((37, 41))
    a, b = codec.compress(v, 1), codec.compress(v, 987654321)
    same = a.wire.keys() == b.wire.keys() and all(torch.equal(a.wire[k], b.wire[k]) for k in a.wire)
    if not codec.uses_seed:
        assert same
    if spec in ("qsgd", "terngrad", "randomk", "randblock"):
        assert codec.uses_seed and not same


# -- the rules, one codec at a time ------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
def test_none_fp16_bf16(shape):
    v = randn(shape)
    assert torch.equal(build("none").decompress(build("none").compress(v)), v)
    for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        c = build(name)
        assert torch.equal(c.decompress(c.compress(v)), v.to(dt).float())
        assert c.compress(v).wire["x"].dtype == dt


def test_none_from_sums_gives_each_member_its_shape_whatever_its_wire_shape():
    """The members' aggregates are views of the bucket's sum in their packets' shapes: in one
    call where each wire has its packet's shape (as ``compress`` makes it), else one by one
    (a packet laid out flat, as another worker's from raw bytes may be)."""
    codec = build("none")
    tensors = [randn(s, seed=i) for i, s in enumerate([(3, 4), (5,), (2, 1, 3)])]
    sizes = [t.numel() for t in tensors]
    flat_wires = [Packet({"x": t.reshape(-1)}, t.shape, t.dtype) for t in tensors]
    for packets in ([codec.compress(t) for t in tensors], flat_wires):
        total = torch.cat([t.reshape(-1) for t in tensors]) * 2
        out = codec.from_sums(total, packets, sizes, 2)
        assert [o.shape for o in out] == [t.shape for t in tensors]
        assert all(torch.equal(o, t) and o.data_ptr() >= total.data_ptr() for o, t in zip(out, tensors))


def q_reference(values: np.ndarray, t: float) -> np.ndarray:
    """Q(p) = t·sign(p)·[|p| >= t], element by element, in float32."""
    t32 = np.float32(t)
    out = np.zeros_like(values, dtype=np.float32)
    for i, p in enumerate(values):
        if p >= t32:
            out[i] = t32
        elif p <= -t32:
            out[i] = -t32
    return out


def test_2bit_rule_and_residual_element_by_element():
    t = 0.25
    c = build(f"2bit:threshold={t}")
    t32 = float(np.float32(t))
    edge = torch.tensor([t32, -t32, np.nextafter(np.float32(t32), 0), -np.nextafter(np.float32(t32), 0), 0.0, -0.0])
    v = torch.cat([randn(57, seed=3) * 0.4, edge]).float()
    q = c.decompress(c.compress(v))
    ref = q_reference(v.numpy(), t)
    np.testing.assert_array_equal(q.numpy(), ref)
    np.testing.assert_array_equal((v - q).numpy(), v.numpy() - ref)  # residual e = p - Q(p)
    assert q[-6:].tolist() == [t32, -t32, 0.0, 0.0, 0.0, 0.0]


def test_2bit_wire_is_mxnet_layout():
    c = build("2bit:threshold=0.5")
    p = c.compress(torch.tensor([0.7, -0.5, 0.1, 0.5, -0.9]))
    assert p.wire["codes"].tolist() == [0b11100011, 0b10000000]
    assert "threshold" not in p.wire


def test_2bit_error_feedback_equals_mxnet_residual_loop():
    t, steps = 0.3, 12
    c = build(f"2bit:threshold={t}")
    grads = [randn((4, 9), seed=s) * 0.2 for s in range(steps)]
    t32 = np.float32(t)
    e_mx = np.zeros(36, dtype=np.float32)  # MXNet: e += v; compare; subtract the quantum
    e = torch.zeros(4, 9)
    for g in grads:
        sent_mx = np.zeros(36, dtype=np.float32)
        for i, gi in enumerate(g.reshape(-1).numpy()):
            e_mx[i] += gi
            if e_mx[i] >= t32:
                sent_mx[i] = t32
                e_mx[i] -= t32
            elif e_mx[i] <= -t32:
                sent_mx[i] = -t32
                e_mx[i] += t32
        p = e + g  # gradzip: error feedback around the stateless codec
        q = c.decompress(c.compress(p))
        e = p - q
        np.testing.assert_array_equal(q.reshape(-1).numpy(), sent_mx)
        np.testing.assert_array_equal(e.reshape(-1).numpy(), e_mx)
    assert np.abs(e_mx).max() > 0 and (np.abs(e_mx) < t32).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_1bit_column_means(shape):
    v = randn(shape, seed=7)
    if len(shape) >= 2:  # one all-non-negative column: its negative mean is 0
        v.reshape(shape[0], -1)[:, 0].abs_()
    c = build("1bit")
    p = c.compress(v)
    out = c.decompress(p).double()
    rows = shape[0] if shape else 1
    m = v.double().reshape(rows, -1)
    o = out.reshape(rows, -1)
    for col in range(m.shape[1]):
        x = m[:, col]
        pos = x[x >= 0].mean().item() if (x >= 0).any() else 0.0
        neg = x[x < 0].mean().item() if (x < 0).any() else 0.0
        assert p.wire["means"][0, col].item() == pytest.approx(pos, rel=1e-6, abs=1e-7)
        assert p.wire["means"][1, col].item() == pytest.approx(neg, rel=1e-6, abs=1e-7)
        sent_pos, sent_neg = p.wire["means"][:, col].double()
        assert torch.equal(o[:, col], torch.where(x >= 0, sent_pos, sent_neg))  # exactly the sent means


def test_sign_and_scaled_sign():
    v = torch.cat([randn(40, seed=1), torch.tensor([0.0, -0.0])]).reshape(6, 7)
    s = build("sign").decompress(build("sign").compress(v))
    assert torch.equal(s, torch.where(v >= 0, 1.0, -1.0))
    c = build("scaled_sign")
    p = c.compress(v)
    scale = v.abs().sum() / v.numel()
    torch.testing.assert_close(c.decompress(p), scale * torch.where(v >= 0, 1.0, -1.0))
    assert p.wire["scale"].dtype == torch.float32


@pytest.mark.parametrize("levels", [1, 2, 5, 16, 127])
def test_qsgd_codes_on_the_grid(levels):
    v = randn((8, 5), seed=levels)
    c = build(f"qsgd:levels={levels}")
    out = c.decompress(c.compress(v, seed=3))
    norm = torch.linalg.vector_norm(v)
    ratio = out * levels / norm  # = sign(v)·ξ with ξ ∈ {floor(r), ceil(r)}
    r = v.abs() * levels / norm
    assert torch.allclose(ratio, ratio.round(), atol=1e-4)
    xi = ratio.abs().round()
    assert ((xi == r.floor()) | (xi == r.ceil())).all()
    assert (torch.sign(out) * torch.sign(v) >= 0).all()


def test_int8_blocks_scales_and_error():
    """Per block of B entries one float32 scale max|v|/127, codes round(v/s) (half to even),
    error at most s/2; a zero block codes 0 with scale 0; the last block may be shorter."""
    c = build("int8:block=4")
    v = torch.tensor([1.0, -2.0, 0.5, 127.0, 0.0, 0.0, 0.0, 0.0, 3.0, -1.5])
    p = c.compress(v)
    assert p.wire["codes"].dtype == torch.int8
    assert torch.equal(p.wire["scales"], torch.tensor([127.0, 0.0, 3.0]) / 127)   # float32, per block
    assert p.wire["codes"].tolist() == [1, -2, 0, 127, 0, 0, 0, 0, 127, -64]   # 0.5 -> 0, -63.5 -> -64
    x = randn((1000,), seed=3) * 10
    scales = c.compress(x).wire["scales"]
    err = (c.decompress(c.compress(x)) - x).abs().view(-1, 4)
    assert bool((err <= scales[:, None] / 2 + 1e-6).all())


def test_int4_codes_in_four_bits_per_block():
    c = build("int4:block=4")
    v = torch.tensor([7.0, -3.5, 1.0, 0.4, 0.0, 0.0, 0.0, 0.0, 14.0])
    p = c.compress(v)
    assert p.wire["scales"].tolist() == [1.0, 0.0, 2.0]
    # codes 7, -4 (−3.5 rounds half to even), 1, 0 | 0 0 0 0 | 7, stored + 8, two a byte, first high
    assert p.wire["codes"].tolist() == [0xF4, 0x98, 0x88, 0x88, 0xF0]
    assert c.decompress(p).tolist() == [7.0, -4.0, 1.0, 0.0, 0, 0, 0, 0, 14.0]
    assert p.nbytes == 5 + 12


def test_terngrad_values():
    v = randn((6, 6), seed=2)
    c = build("terngrad")
    out = c.decompress(c.compress(v, seed=1))
    s = v.abs().max()
    assert set(out.unique().tolist()) <= {-s.item(), 0.0, s.item()}
    assert (torch.sign(out) * torch.sign(v) >= 0).all()
    assert out.reshape(-1)[v.abs().argmax()] == v.reshape(-1)[v.abs().argmax()]  # p = 1 there


@pytest.mark.parametrize("shape", SHAPES + [(300, 200)])
@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.5, 1.0])
def test_topk_exact(shape, ratio):
    v = distinct(shape, seed=int(ratio * 100))
    c = build(f"topk:ratio={ratio}")
    p = c.compress(v)
    out = c.decompress(p)
    d = v.numel()
    k = keep_count(ratio, d)
    keep = torch.zeros(d, dtype=torch.bool)
    keep[v.reshape(-1).abs().argsort(descending=True)[:k]] = True
    assert torch.equal(out.reshape(-1), torch.where(keep, v.reshape(-1), 0.0))
    assert p.wire["indices"].dtype == sparse_index_dtype(d) and p.wire["values"].numel() == k


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "dgc:ratio=0.01"])
@pytest.mark.parametrize("numel", [1, 256, 257, 65536, 65537])
@pytest.mark.parametrize("mode", ["torch", "numba"])
def test_sparse_index_width_boundaries(spec, numel, mode):
    """Indices travel in the narrowest integer holding numel - 1 (uint8 up to 256 entries,
    uint16 up to 65536, int32 above): the largest index of each width survives the wire
    (raw bytes back to a packet), decoding and the aggregate, on both kernel paths."""
    from gradzip import kernels
    if mode == "numba" and not kernels.numba_available():
        pytest.skip("numba not installed")
    v = torch.zeros(numel)
    v[0] = -3.0
    v[-1] = 5.0          # the last entry, index numel - 1; k >= 2 keeps both wherever numel > 1
    c = build(spec)
    with kernels.use(mode):
        p = c.compress(v)
        assert p.wire["indices"].dtype == sparse_index_dtype(numel) and p.nbytes == c.wire_nbytes((numel,))
        back = p.from_raw(torch.cat(p.raw()))
        out = torch.full((numel,), 7.0)
        dense = c.decompress(back, out=out)
        mean = c.aggregate([back, p])
    assert dense is out and torch.equal(dense, v)
    assert torch.equal(mean, v)


@pytest.mark.parametrize("chunk", [None, 4096])
def test_topk_large_tensor_sampled_threshold_and_fallback(chunk, monkeypatch):
    if chunk:
        monkeypatch.setattr(_util, "PIECEWISE", True)
        monkeypatch.setattr(_util, "CHUNK", chunk)  # candidates found piece by piece
    c = build("topk:ratio=0.01")
    v = randn(100_000, seed=11)
    adversarial = torch.full((100_000,), 0.001)
    adversarial[::64] = 1.0 + torch.arange(1563) / 1563  # large values only where the sample looks
    for x in (v, adversarial):
        k = keep_count(0.01, x.numel())
        expected = torch.zeros_like(x)
        top = torch.topk(x.abs(), k).indices
        expected[top] = x[top]
        assert torch.equal(c.decompress(c.compress(x)), expected)


def test_randomk_values_and_scaling():
    v = distinct((40, 25), seed=4)
    d = v.numel()
    for unbiased in (False, True):
        c = build(f"randomk:ratio=0.05,unbiased={unbiased}")
        p = c.compress(v, seed=9)
        out = c.decompress(p).reshape(-1)
        idx = p.meta["indices"]
        k = keep_count(0.05, d)
        assert idx.numel() == k and torch.equal(idx, idx.unique())  # k distinct, sorted
        scale = d / k if unbiased else 1.0
        assert torch.equal(out[idx], v.reshape(-1)[idx] * scale)
        assert (out != 0).sum() == k
        assert p.nbytes == 4 * k and "indices" not in p.wire


def test_randomk_dense_ratios_draw_exact_subsets():
    for ratio in (0.02, 0.3, 0.6, 0.99, 1.0):
        c = build(f"randomk:ratio={ratio}")
        idx = c.compress(torch.ones(1000), seed=3).meta["indices"]
        assert idx.numel() == keep_count(ratio, 1000) and torch.equal(idx, idx.unique())


@pytest.mark.parametrize("mode", ["torch", "numba"])
@pytest.mark.parametrize("spec,d", [("topk:ratio=0.1", 200), ("topk:ratio=0.01", 70_000), ("dgc:ratio=0.5", 100)])
def test_sparsifiers_break_ties_to_the_smaller_index_and_list_indices_ascending(spec, d, mode):
    """docs/algorithms.md §codec: topk: equal magnitudes at the k-th place go to the smaller
    indices, and the wire lists the entries in ascending index order (torch.topk leaves both to
    the device). Magnitudes in few distinct values: every k-th place is a tie."""
    if mode == "numba" and not kernels.numba_available():
        pytest.skip("numba is not installed")
    g = torch.Generator().manual_seed(d)
    x = torch.randint(-3, 4, (d,), generator=g).float() * 0.5
    codec = build(spec)
    k = keep_count(codec.ratio, d)
    order = sorted(range(d), key=lambda j: (-abs(float(x[j])), j))
    with kernels.use(mode):
        packet = codec.compress(x, seed=1)
    got = packet.wire["indices"].long()[: packet.meta.get("selected", k)].tolist()
    assert got == sorted(got) and got == sorted(order[:k])


@pytest.mark.parametrize("d,k", [(256, 2), (40, 10), (40, 30)])
def test_randomk_indices_uniform(d, k):
    c = build(f"randomk:ratio={k / d}")
    n = 2000
    counts = torch.zeros(d)
    for seed in range(n):
        idx = c.compress(torch.ones(d), seed=seed).meta["indices"]
        assert idx.numel() == k
        counts[idx] += 1
    p = k / d
    assert ((counts / n - p).abs() <= 5 * math.sqrt(p * (1 - p) / n)).all()


@pytest.mark.parametrize("mode", ["torch", "numba"])
@pytest.mark.parametrize("d,k", [(1, 1), (7, 3), (1000, 10), (70_000, 700), (5000, 4999)])
def test_randomk_draws_the_k_entries_of_smallest_hash(d, k, mode):
    """The k-subset is the k entries of smallest counter hash (docs/algorithms.md §codec:
    randomk), stated here in plain Python: every backend draws it."""
    if mode == "numba" and not kernels.numba_available():
        pytest.skip("numba is not installed")
    c = build(f"randomk:ratio={k / d}")
    k = c.count(d)
    seed = d * 7 + k
    hashes = [counter_rng.hash_at(seed, j) for j in range(d)]
    expected = sorted(sorted(range(d), key=hashes.__getitem__)[:k])
    with kernels.use(mode):
        assert c.indices(d, seed).tolist() == expected


def test_randblock_ratio_form_contiguous():
    v = distinct((20, 13), seed=5)
    c = build("randblock:ratio=0.1")
    out = c.decompress(c.compress(v, seed=3)).reshape(-1)
    k = keep_count(0.1, v.numel())
    nz = out.nonzero().view(-1)
    assert nz.numel() == k and nz[-1] - nz[0] == k - 1
    assert torch.equal(out[nz], v.reshape(-1)[nz])


@pytest.mark.parametrize("shape", [(), (10,), (10, 7), (10, 7, 3), (2, 3)])
def test_randblock_layer_form_aligned_block(shape):
    a, b = 3, 4
    c = build(f"randblock:in={a},out={b},layer=1")
    v = distinct(shape, seed=1)
    seen = set()
    for seed in range(30):
        p = c.compress(v, seed=seed)
        out = c.decompress(p)
        mask = out != 0
        assert torch.equal(out[mask], v[mask])
        if not shape:
            assert mask.item()
            continue
        rows = mask.reshape(shape[0], -1).any(1).nonzero().view(-1).tolist()
        r = math.ceil(shape[0] / a)
        if rows:
            i = rows[0] // r
            assert rows == list(range(i * r, min(shape[0], (i + 1) * r)))
        if len(shape) >= 2 and rows:
            cols = mask.any(0).reshape(shape[1], -1).any(1).nonzero().view(-1).tolist()
            w = math.ceil(shape[1] / b)
            j = cols[0] // w
            assert cols == list(range(j * w, min(shape[1], (j + 1) * w)))
            assert mask.sum() == len(rows) * len(cols) * math.prod(shape[2:])
        seen.add(tuple(mask.reshape(-1).tolist()))
    if shape:
        assert len(seen) > 1


# -- wire sizes --------------------------------------------------------------------------
def expected_nbytes(spec: str, shape) -> int:
    d = math.prod(shape)
    c = build(spec)
    name = c.name
    cols = (math.prod(shape[1:]) if len(shape) >= 2 else 1)
    if name == "none":
        return 4 * d
    if name in ("fp16", "bf16"):
        return 2 * d
    if name == "2bit":
        return math.ceil(d / 4)
    if name == "1bit":
        return math.ceil(d / 8) + 8 * cols
    if name == "sign":
        return math.ceil(d / 8)
    if name == "scaled_sign":
        return math.ceil(d / 8) + 4
    if name == "qsgd":
        return math.ceil(d * math.ceil(math.log2(2 * c.levels + 1)) / 8) + 4
    if name == "terngrad":
        return math.ceil(d / 4) + 4
    if name == "int8":
        return d + 4 * math.ceil(d / c.block)
    if name == "int4":
        return math.ceil(d / 2) + 4 * math.ceil(d / c.block)
    index_bytes = sparse_index_dtype(d).itemsize
    if name == "topk":
        return (4 + index_bytes) * keep_count(c.ratio, d)
    if name == "dct":   # per chunk k' values and in-chunk indices
        from gradzip.compressors.dct import chunk_size
        rows, cols = (shape[0] if shape else 1, cols) if len(shape) >= 2 else (1, d)
        c1, c2 = chunk_size(rows, c.chunk), chunk_size(cols, c.chunk)
        k = min(c.topk, c1 * c2)
        return (rows // c1) * (cols // c2) * k * (4 + sparse_index_dtype(c1 * c2).itemsize)
    if name == "topk2bit":   # indices, 2-bit codes, τ and M
        k = keep_count(c.ratio, d)
        return index_bytes * k + math.ceil(k / 4) + 8
    if name in ("randomk",) or (name == "randblock" and c.ratio is not None):
        return 4 * keep_count(c.ratio, d)
    if name == "dgc":
        return (4 + index_bytes) * min(keep_count(c.ratio, d), d)
    if name == "powersgd":  # P = M Q (rows x r'), or dense when not worth compressing
        rows = shape[0] if shape else 1
        r = min(c.rank, rows, d // max(rows, 1))
        compress = len(shape) >= 2 and (rows + d // rows) * r * c.min_compression_rate < d
        return 4 * r * rows if compress else 4 * d
    raise AssertionError(spec)


@pytest.mark.parametrize("spec", [s for s in ALL_SPECS if "in=" not in s])
@pytest.mark.parametrize("shape", [(), (1,), (7,), (13,), (33,), (5, 3), (7, 11), (4, 3, 3, 3), (3, 5, 1, 7)])
def test_nbytes_formula(spec, shape):
    c = build(spec)
    p = c.compress(randn(shape), seed=2)
    assert p.nbytes == expected_nbytes(spec, shape)
    assert c.wire_nbytes(shape) == expected_nbytes(spec, shape)


def test_qsgd_bits_per_level():
    for levels, bits in [(1, 2), (2, 3), (3, 3), (4, 4), (16, 6), (31, 6), (32, 7), (63, 7), (64, 8), (127, 8)]:
        assert build(f"qsgd:levels={levels}").compress(torch.zeros(64)).wire["codes"].numel() == 8 * bits


# -- unbiasedness --------------------------------------------------------------------------
def mean_of_compressions(c: Compressor, v, n):
    total = torch.zeros_like(v, dtype=torch.float64)
    for seed in range(n):
        total += c.decompress(c.compress(v, seed=seed)).double()
    return total / n


def assert_unbiased(mean, v, var, n):
    se = (var / n).sqrt()
    err = (mean - v.double()).abs()
    assert (err <= 5 * se + 1e-6).all(), f"max err/se {(err / (se + 1e-12)).max().item():.1f}"


N_STAT = 3000


def test_qsgd_unbiased():
    v = randn(24, seed=8)
    s = 4
    c = build(f"qsgd:levels={s}")
    norm = torch.linalg.vector_norm(v.double())
    r = v.double().abs() * s / norm
    f = r - r.floor()
    var = (norm / s) ** 2 * f * (1 - f)
    assert_unbiased(mean_of_compressions(c, v, N_STAT), v, var, N_STAT)


def test_terngrad_unbiased():
    v = randn(24, seed=9)
    c = build("terngrad")
    s = v.double().abs().max()
    var = s * v.double().abs() - v.double() ** 2
    assert_unbiased(mean_of_compressions(c, v, N_STAT), v, var, N_STAT)


def test_randomk_unbiased_and_biased_not_scaled():
    v = randn(20, seed=10)
    d, ratio = 20, 0.25
    k = keep_count(ratio, d)
    var = v.double() ** 2 * (d / k - 1)
    unbiased = build(f"randomk:ratio={ratio},unbiased=true")
    assert_unbiased(mean_of_compressions(unbiased, v, N_STAT), v, var, N_STAT)
    biased = build(f"randomk:ratio={ratio}")
    mean = mean_of_compressions(biased, v, N_STAT)  # E = (k/d)·v: not scaled
    assert_unbiased(mean, v * k / d, var * (k / d) ** 2, N_STAT)
    with pytest.raises(AssertionError):
        assert_unbiased(mean, v, var, N_STAT)


def test_unbiased_check_detects_bias():
    v = randn(24, seed=8)
    c = build("2bit:threshold=0.5")  # deterministic and biased
    with pytest.raises(AssertionError):
        assert_unbiased(mean_of_compressions(c, v, 200), v, torch.full((24,), 1e-4, dtype=torch.float64), 200)


# -- shared randomness ---------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["randomk:ratio=0.05", "randblock:ratio=0.05", "randblock:in=4,out=3,layer=2"])
def test_same_seed_same_coordinates_on_every_worker(spec):
    c = build(spec)
    assert c.shared_randomness
    shape = (20, 15)
    workers = [distinct(shape, seed=w) for w in range(3)]
    differ = 0
    for seed in range(10):
        masks = [c.decompress(c.compress(v, seed=seed)) != 0 for v in workers]
        assert all(torch.equal(m, masks[0]) for m in masks)
        other = c.decompress(c.compress(workers[0], seed=seed + 100)) != 0
        differ += not torch.equal(other, masks[0])
    assert differ >= 3


def test_private_randomness_depends_on_seed():
    v = randn(200, seed=1)
    for spec in ("qsgd", "terngrad"):
        c = build(spec)
        a, b = c.compress(v, seed=1), c.compress(v, seed=1)
        assert torch.equal(c.decompress(a), c.decompress(b))
        assert not torch.equal(c.decompress(a), c.decompress(c.compress(v, seed=2)))


@pytest.mark.parametrize("shape,a,b,c_", [((10, 7, 3), 3, 2, 4), ((12, 8), 4, 4, 2), ((10,), 16, 4, 3), ((9, 2), 2, 5, 1)])
def test_randblock_layer_frequency_and_expected_wire(shape, a, b, c_):
    c = build(f"randblock:in={a},out={b},layer={c_}")
    v = distinct(shape, seed=3)
    n = 1500
    nbytes = torch.tensor([float(c.compress(v, seed=s).nbytes) for s in range(n)], dtype=torch.float64)
    sent = torch.tensor([bool(c.compress(v, seed=s).wire) for s in range(n)], dtype=torch.float64)
    d = v.numel()
    parts = c_ * a * (b if len(shape) >= 2 else 1)  # a 1-d tensor uses dim 0 only
    expected = 4 * d / parts
    assert abs(sent.mean() - 1 / c_) <= 5 * math.sqrt((1 / c_) * (1 - 1 / c_) / n) + 1e-9
    assert abs(nbytes.mean() - expected) <= 5 * nbytes.std() / math.sqrt(n) + 1e-9
    assert c.wire_nbytes(shape) == round(expected)
    empty = c.compress(v, seed=int((sent == 0).nonzero()[0])) if (sent == 0).any() else None
    if empty is not None:
        assert empty.nbytes == 0 and torch.equal(c.decompress(empty), torch.zeros(shape))


# -- aggregation ---------------------------------------------------------------------------
def worker_packets(c, n, shape=(9, 7), scale=1.0):
    seeds = [42] * n if c.shared_randomness else list(range(n))  # what the exchange passes
    return [c.compress(randn(shape, seed=w) * scale, seed=s) for w, s in zip(range(n), seeds)]


SUMMING = [s for s in ALL_SPECS if build(s).sum_dtype(4) is not None]


def test_which_codecs_sum():
    assert [s for s in names() if build(s).sum_dtype(4) is not None] == [
        "none", "fp16", "bf16", "2bit", "sign", "randomk", "randblock", "powersgd"
    ]
    # 2bit: int8 to 127 workers, then int16 to 32767 (spec "Summand width"; was None from 128)
    assert build("2bit").sum_dtype(127) == torch.int8 and build("2bit").sum_dtype(128) == torch.int16
    assert build("2bit").sum_dtype(32767) == torch.int16 and build("2bit").sum_dtype(32768) is None
    assert build("sign").sum_dtype(127) == torch.int8 and build("sign").sum_dtype(128) == torch.int16
    assert build("sign").sum_dtype(32768) is None
    assert build("none").sum_dtype(4, torch.float16) == torch.float16
    assert build("fp16").sum_dtype(4) == torch.float16 and build("randomk").sum_dtype(4) == torch.float32


@pytest.mark.parametrize("spec", SUMMING)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_sum_path_equals_aggregate(spec, n):
    c = build(spec)
    packets = worker_packets(c, n)
    summands = [c.summand(p, n) for p in packets]
    assert all(s.dtype == c.sum_dtype(n) and s.dim() == 1 for s in summands)
    total = summands[0].clone()
    for s in summands[1:]:  # the allreduce, in sum_dtype
        total += s
    via_sum = c.from_sum(total, packets[0], n)
    agg = c.aggregate(packets)
    assert via_sum.shape == agg.shape == packets[0].shape and via_sum.dtype == agg.dtype
    if spec in ("2bit", "2bit:threshold=0.3", "sign", "none") or n == 1 and c.name != "fp16":
        assert torch.equal(via_sum, agg) if c.name != "none" else torch.allclose(via_sum, agg, rtol=1e-6, atol=1e-7)
    else:
        tol = {"fp16": 2e-3, "bf16": 2e-2}.get(c.name, 1e-6)
        torch.testing.assert_close(via_sum, agg, rtol=tol, atol=tol)
    if c.name != "sign":  # the default aggregate: the mean of the decoded tensors
        mean = sum(c.decompress(p) for p in packets) / n
        torch.testing.assert_close(agg, mean, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", SUMMING)
def test_from_sums_of_a_bucket_equals_each_members_from_sum(spec):
    """``from_sums`` (PSync decodes a one-codec bucket in one call; ``none``: one division
    of the whole buffer) gives every member the bits its own ``from_sum`` gives."""
    c, n = build(spec), 3
    shapes = [(9, 7), (5,), (2, 3, 4)]
    per_tensor = [worker_packets(c, n, shape) for shape in shapes]
    totals = []
    for packets in per_tensor:
        total = c.summand(packets[0], n).clone()
        for p in packets[1:]:
            total += c.summand(p, n)
        totals.append(total)
    mine = [packets[0] for packets in per_tensor]
    together = c.from_sums(torch.cat(totals), mine, [t.numel() for t in totals], n)
    alone = [c.from_sum(t.clone(), p, n) for t, p in zip(totals, mine)]
    assert len(together) == len(alone)
    for a, b in zip(together, alone):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def test_summand_is_a_new_tensor_except_nones_wire():
    """A collective may sum into a summand in place; ``none``'s is its wire itself (no copy:
    PSync copies it into its bucket buffer, tests/test_exchange_reuse.py)."""
    for spec in SUMMING:
        c = build(spec)
        p = c.compress(randn((5, 4)), seed=1)
        before = c.decompress(p).clone()
        s = c.summand(p, 2)
        if spec == "none":
            assert s.data_ptr() == p.wire["x"].data_ptr() and torch.equal(s.view(5, 4), before)
            continue
        s.zero_()
        assert torch.equal(c.decompress(p), before), spec


def test_fp16_sum_divides_first_no_overflow():
    c = build("fp16")
    packets = [c.compress(torch.full((8,), 60000.0)) for _ in range(4)]  # 4 × 60000 > fp16 max
    total = sum(c.summand(p, 4) for p in packets)
    assert torch.isfinite(total).all()
    torch.testing.assert_close(c.from_sum(total, packets[0], 4), torch.full((8,), 60000.0), rtol=1e-3, atol=0)


def test_sign_majority_vote():
    c = build("sign")
    votes = torch.tensor([[1.0, 1.0, -1.0, -1.0, 2.0], [1.0, -1.0, -1.0, 3.0, -2.0], [-1.0, -1.0, -1.0, 1.0, 0.5]])
    packets = [c.compress(v) for v in votes]
    assert c.aggregate(packets).tolist() == [1.0, -1.0, -1.0, 1.0, 1.0]
    assert c.aggregate(packets[:2]).tolist() == [1.0, 0.0, -1.0, 0.0, 0.0]  # ties -> 0


def test_sparse_aggregate_scatter_adds():
    c = build("topk:ratio=0.2")
    a, b = distinct((10,), 1), distinct((10,), 2)
    expected = (c.decompress(c.compress(a)) + c.decompress(c.compress(b))) / 2
    assert torch.equal(c.aggregate([c.compress(a), c.compress(b)]), expected)


def test_received_packet_with_shared_meta_decodes():
    c = build("randomk:ratio=0.2")
    mine, theirs = c.compress(distinct((30,), 1), seed=5), c.compress(distinct((30,), 2), seed=5)
    received = mine.like(theirs.wire)
    assert torch.equal(c.decompress(received), c.decompress(theirs))


# -- spec strings --------------------------------------------------------------------------
def test_registry_order_and_build():
    assert names() == ("none fp16 bf16 2bit 1bit sign scaled_sign qsgd terngrad int8 int4 topk randomk randblock dgc "
                       "powersgd topk2bit dct").split()
    c = build("topk:ratio=0.01")
    assert c.name == "topk" and c.ratio == 0.01 and str(c) == "topk:ratio=0.01"
    assert build(None) == build("none") and build(c) is c
    assert build(" TopK : ratio = 0.5 ").ratio == 0.5
    assert build("randblock") == build("randblock:ratio=0.01")
    rb = build("randblock:in=4,out=2")
    assert (rb.in_, rb.out, rb.layer, rb.ratio) == (4, 2, 1, None)
    assert rb.spec == "randblock:in=4,out=2,layer=1"
    assert build("randomk:ratio=0.1,unbiased=yes").unbiased is True


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_spec_round_trip(spec):
    c = build(spec)
    assert build(c.spec) == c
    assert build(c.spec).spec == c.spec


@pytest.mark.parametrize(
    "spec,words",
    [
        ("zip", ["unknown compressor", "none", "topk", "randblock"]),
        ("topk:ratio=0", ["topk", "ratio", "(0, 1]", "0"]),
        ("topk:ratio=2", ["topk", "ratio", "(0, 1]", "2"]),
        ("topk:ratio=nan", ["ratio"]),
        ("randomk:ratio=-0.1", ["randomk", "ratio"]),
        ("2bit:threshold=-1", ["2bit", "threshold", "-1", "> 0"]),
        ("2bit:threshold=0", ["threshold"]),
        ("2bit:threshold=inf", ["threshold"]),
        ("qsgd:levels=x", ["levels", "'x'", "int"]),
        ("qsgd:levels=0", ["levels", "[1, 127]", "0"]),
        ("qsgd:levels=128", ["levels", "128"]),
        ("qsgd:levels=1.5", ["levels"]),
        ("topk:k=5", ["no parameter", "'k'", "ratio"]),
        ("none:ratio=0.1", ["no parameter"]),
        ("topk:ratio", ["param=value"]),
        ("topk:ratio=0.1,ratio=0.2", ["twice"]),
        ("randblock:ratio=0.1,in=2", ["randblock", "either", "ratio=0.1", "in=2"]),
        ("randblock:in=0,out=2", ["in", ">= 1", "0"]),
        ("randblock:layer=-3", ["layer", "-3"]),
        ("randblock:in_x=2", ["no parameter", "in (int)"]),
        ("randomk:unbiased=maybe", ["unbiased", "bool"]),
    ],
)
def test_spec_errors(spec, words):
    with pytest.raises(GradzipError) as err:
        build(spec)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_direct_construction_is_validated():
    from gradzip.compressors.randomk import RandBlock
    from gradzip.compressors.sparsify import TopK

    with pytest.raises(GradzipError):
        TopK(ratio=0)
    with pytest.raises(GradzipError):
        RandBlock(ratio=0.1, layer=2)
    assert TopK(ratio=1) == build("topk:ratio=1")
    with pytest.raises(GradzipError):
        build(3.5)


KEYS = ["ratio", "threshold", "levels", "in", "out", "layer", "unbiased", "in_", "k", ""]
VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-300, 300).map(str),
    st.sampled_from(["true", "false", "yes", "0", "1", "1e-3", "0.5", "", "x", "1_0", "=", "None"]),
    st.text(max_size=6),
)
PARAM = st.tuples(st.sampled_from(KEYS) | st.text(max_size=4), VALUES).map(lambda kv: f"{kv[0]}={kv[1]}")
SPEC = st.tuples(
    st.sampled_from(names()) | st.text(max_size=8),
    st.lists(PARAM | st.text(max_size=5), max_size=4),
).map(lambda t: t[0] + (":" + ",".join(t[1]) if t[1] else ""))


@settings(max_examples=400, deadline=None)
@given(SPEC)
def test_any_spec_builds_or_raises_gradzip_error(spec):
    try:
        c = build(spec)
    except GradzipError:
        return
    assert build(c.spec) == c  # and what builds prints back to itself
    out = c.decompress(c.compress(randn((4, 3)), seed=1))
    assert out.shape == (4, 3)


# -- devices -------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_cuda_agrees_with_cpu(spec):
    """Every codec on CUDA (its Triton kernels where it has them) against the CPU: the same
    draws (counter-based, hashed where the tensor lives), decoded values equal to rounding
    (PowerSGD's matrix products are the device's own)."""
    c = build(spec)
    v = randn((64, 33), seed=1)
    pc, pg = c.compress(v, seed=3), c.compress(v.cuda(), seed=3)
    out = c.decompress(pg)
    assert out.device.type == "cuda" and out.shape == v.shape
    torch.testing.assert_close(out.cpu(), c.decompress(pc), rtol=1e-5, atol=1e-6)
    assert c.aggregate([pg, pg]).device.type == "cuda"


def test_unbiased_is_a_property_of_the_codec():
    """``Compressor.unbiased`` (``E[C(v)] = v``): qsgd, terngrad and randomk with
    ``unbiased=true``; a class attribute, not a spec parameter, except randomk's field."""
    for name in names():
        assert build(name).unbiased is (name in ("qsgd", "terngrad")), name
    assert build("randomk:ratio=0.1,unbiased=true").unbiased is True
    assert build("randomk:ratio=0.1").unbiased is False
    assert build("qsgd").spec == "qsgd:levels=16"
    with pytest.raises(GradzipError, match="no parameter 'unbiased'"):
        build("qsgd:unbiased=false")


# -- decoding into a caller's buffer, and the residual in one call ----------------------------
@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("shape", [(37, 41), (1,), (0,), (9, 4, 5)])
def test_decompress_into_out_and_compress_residual_match_the_plain_calls(spec, shape):
    """``decompress(p, out=buf)`` writes the very bits ``decompress(p)`` returns into ``buf``
    and returns ``buf``; ``compress_residual(t, seed, out)`` gives the same packet as
    ``compress(t, seed)`` and ``out == t − decompress(packet)`` bit for bit."""
    codec = build(spec)
    x = randn(shape, seed=3)
    packet = codec.compress(x, seed=11)
    plain = codec.decompress(packet)
    buf = torch.full(shape, float("nan"))
    got = codec.decompress(packet, out=buf)
    assert got is buf and torch.equal(buf, plain)
    residual = torch.full(shape, float("nan"))
    again = codec.compress_residual(x, 11, residual)
    assert again.wire.keys() == packet.wire.keys()
    for name, wire in packet.wire.items():
        assert torch.equal(again.wire[name], wire), name
    assert torch.equal(residual, x - plain)
    with pytest.raises(ValueError, match="shape"):
        codec.decompress(packet, out=torch.empty(tuple(shape) + (2,)))
