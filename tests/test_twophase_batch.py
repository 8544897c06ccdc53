"""The two-phase exchange's batched codec calls (Compressor.compress_slices, aggregate_slices,
decode_slices; gradzip.exchange.twophase) give the bytes and values of one codec call per slice, bit
for bit: the fused overrides (sign, scaled_sign, 2bit) against the per-slice calls, and
PSync's two-phase exchange against a per-slice reference of the spec's box."""
import numpy as np
import pytest
import torch

from gradzip import seeds
from gradzip.exchange import planner as tp
from gradzip.exchange import twophase
from gradzip.comm import make_group, simulate
from gradzip.compressors import Compressor, build
from gradzip.exchange import PSync

CODECS = ["scaled_sign", "scaled_sign:scale=rms", "sign", "2bit:threshold=0.4", "1bit", "topk:ratio=0.3", "qsgd"]
SIZES = (1, 2, 5, 13, 30, 1027, 9000)   # d < n, d not divisible by n, a whole 1024-entry block and more


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns (so -0.0 != 0.0 and NaNs compare by payload)."""
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.uint8)


def _vector(d: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(d, generator=gen)
    x[::7] = 0.0
    x[3::11] = -0.0
    x[5::13] = 0.4   # exactly the 2bit threshold
    return x


def _layout(n: int):
    """All tensors flattened into one x: every slice's bounds in x, destination-major (as phase 1)."""
    offsets = np.cumsum((0,) + SIZES)
    return [[(int(offsets[k]) + a, int(offsets[k]) + b) for k, d in enumerate(SIZES)
             for a, b in [tp.slice_bounds(d, n)[j]] if b > a] for j in range(n)]


def _per_slice(codec, x, bounds, seeds, residual):
    packets = [codec.compress_residual(x[a:b].clone(), s, residual[a:b]) for (a, b), s in zip(bounds, seeds)]
    return torch.cat([w for p in packets for w in p.raw()]), packets


@pytest.mark.parametrize("spec", CODECS)
@pytest.mark.parametrize("n", [1, 3, 4])
def test_slices_calls_equal_one_call_per_slice(spec, n):
    codec = build(spec)
    gen = torch.Generator().manual_seed(n)
    xs = [_vector(sum(SIZES), gen) for _ in range(n)]
    blocks = _layout(n)
    bounds = [b for block in blocks for b in block]
    seeds = [1000 + m for m in range(len(bounds))]
    made = []
    for x in xs:
        res, ref_res = torch.full_like(x, 7.0), torch.full_like(x, 7.0)
        got = codec.compress_slices(x, bounds, seeds, residual=res)
        ref_wire, ref_packets = _per_slice(codec, x, bounds, seeds, ref_res)
        assert torch.equal(got.wire, ref_wire)
        assert got.nbytes == [p.nbytes for p in ref_packets]
        assert torch.equal(_bits(res), _bits(ref_res))
        plain = codec.compress_slices(x, bounds, seeds)      # without a residual: the same packets
        assert torch.equal(plain.wire, ref_wire)
        made.append((got, ref_packets))
    # one destination's block: aggregate the n workers' packets of it, decode it
    first = sum(len(block) for block in blocks[:n - 1])
    block = blocks[n - 1]
    sizes = made[0][0].nbytes[first:first + len(block)]
    start = sum(made[0][0].nbytes[:first])
    wires = [g.wire[start:start + sum(sizes)] for g, _ in made]
    templates = made[0][1][first:first + len(block)]
    packed, pos = [], 0   # the block's slices back to back in a short output
    for a, b in block:
        packed.append((pos, pos + b - a))
        pos += b - a
    out = torch.full((pos,), 7.0)
    codec.aggregate_slices(wires, packed, out, templates if made[0][0].packets is not None else None)
    ref = torch.cat([codec.aggregate([made[i][1][first + m] for i in range(n)]).reshape(-1)
                     for m in range(len(block))])
    assert torch.equal(_bits(out), _bits(ref))
    decoded = torch.full((pos,), 7.0)
    codec.decode_slices(wires[0], packed, decoded, templates if made[0][0].packets is not None else None)
    ref = torch.cat([codec.decompress(made[0][1][first + m]).reshape(-1) for m in range(len(block))])
    assert torch.equal(_bits(decoded), _bits(ref))


@pytest.mark.parametrize("spec", ["scaled_sign", "scaled_sign:scale=rms", "sign", "2bit:threshold=0.4"])
def test_the_fused_overrides_equal_the_default_loop(spec):
    """The overrides against Compressor's own (looping) methods on the same codec."""
    codec = build(spec)
    x = _vector(sum(SIZES), torch.Generator().manual_seed(5))
    bounds = _layout(4)[1] + _layout(4)[3] + _layout(4)[0]
    seeds = list(range(len(bounds)))
    r1, r2 = torch.zeros_like(x), torch.zeros_like(x)
    fused = codec.compress_slices(x, bounds, seeds, r1)
    loop = Compressor.compress_slices(codec, x, bounds, seeds, r2)
    assert fused.packets is None and loop.packets is not None
    assert torch.equal(fused.wire, loop.wire) and fused.nbytes == loop.nbytes
    assert torch.equal(_bits(r1), _bits(r2))
    o1, o2 = torch.zeros_like(x), torch.zeros_like(x)
    codec.decode_slices(fused.wire, bounds, o1, None)
    Compressor.decode_slices(codec, loop.wire, bounds, o2, loop.packets)
    assert torch.equal(_bits(o1), _bits(o2))


# -- the whole exchange against the per-slice box ------------------------------------------
STEPS = 3
SHAPES = ((1,), (5,), (13, 1), (6, 5), (1027,), (3, 3))


def _inputs(rank: int, step: int) -> list[torch.Tensor]:
    """One float64 tensor among float32 ones: the exchange's buckets hold one dtype each."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return [_vector(int(np.prod(s)), gen).view(s).to(torch.float64 if k == 3 else torch.float32)
            for k, s in enumerate(SHAPES)]


def _buckets(bucket_bytes: int) -> list[list[int]]:
    """The plan's buckets, held out: positions (= keys) in launch order (descending key), cut
    greedily at ``bucket_bytes`` of the tensors' own bytes, a new bucket at a change of dtype."""
    dtypes = [t.dtype for t in _inputs(0, 1)]
    buckets, filled = [], 0
    for k in reversed(range(len(SHAPES))):
        nbytes = int(np.prod(SHAPES[k])) * dtypes[k].itemsize
        if not buckets or (buckets[-1] and (filled + nbytes > bucket_bytes or dtypes[buckets[-1][0]] != dtypes[k])):
            buckets.append([])
            filled = 0
        buckets[-1].append(k)
        filled += nbytes
    return buckets


def _box(codec, n: int, bucket_bytes: int, drop=None):
    """The spec's box, one codec call per (bucket, slice): per step, (aggregate, residual of
    each worker, server errors keyed by the bucket's first tensor); ``drop``: the (bucket
    key, slice) whose server error is lost before the last step."""
    servers, steps = {}, []
    for step in range(1, STEPS + 1):
        if step == STEPS and drop is not None:
            servers.pop(drop)
        inputs = [_inputs(i, step) for i in range(n)]
        aggregates, residuals = [None] * len(SHAPES), [[None] * len(SHAPES) for _ in range(n)]
        for members in _buckets(bucket_bytes):
            key, sizes = members[0], [int(np.prod(SHAPES[k])) for k in members]
            flats = [torch.cat([inputs[i][k].reshape(-1) for k in members]) for i in range(n)]
            bounds = tp.slice_bounds(flats[0].numel(), n)
            packets = {}
            for i in range(n):
                r = torch.empty_like(flats[i])
                base = seeds.mix(0, step, key) if codec.shared_randomness else seeds.mix(0, step, key, i + 1)
                for j, (a, b) in enumerate(bounds):
                    if b > a:
                        packets[i, j] = codec.compress_residual(flats[i][a:b], twophase.phase1_seed(base, j), r[a:b])
                for k, piece in zip(members, torch.split(r, sizes)):
                    residuals[i][k] = piece.view(SHAPES[k])
            out = torch.empty_like(flats[0])
            for j, (a, b) in enumerate(bounds):
                if a == b:
                    continue
                mine = packets[j, j]   # worker j decodes with its own packet's layout
                s = codec.aggregate([mine.from_raw(torch.cat(packets[i, j].raw())) for i in range(n)]).reshape(-1)
                if (key, j) in servers:
                    s = s + servers[key, j]
                e = torch.empty_like(s)
                c = codec.compress_residual(s, twophase.phase2_seed(0, step, key, j), e)
                servers[key, j] = e
                codec.decompress(mine.from_raw(torch.cat(c.raw())), out=out[a:b])
            for k, piece in zip(members, torch.split(out, sizes)):
                aggregates[k] = piece.view(SHAPES[k])
        steps.append((aggregates, residuals, {f"{k}:{j}": e.clone() for (k, j), e in servers.items()}))
    return steps


def _exchange(comm, spec, bucket_bytes, drop=None):
    psync = PSync(comm, spec, transport="twophase", bucket_bytes=bucket_bytes)
    steps = []
    for step in range(1, STEPS + 1):
        if step == STEPS and drop is not None:
            psync.server_errors.errors.pop(drop, None)
        r = psync(_inputs(comm.rank, step), step)
        steps.append(([a.clone() for a in r.aggregate], [x.clone() for x in r.residual],
                      psync.server_errors.state_dict()))
    return steps


def _compare(got, want, n):
    for rank in range(n):
        for (agg, res, server), (w_agg, w_res, w_server) in zip(got[rank], want):
            assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(agg, w_agg))
            assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(res, w_res[rank]))
            mine = {name: e for name, e in w_server.items() if int(name.split(":")[1]) == rank}
            assert server.keys() == mine.keys()
            assert all(torch.equal(_bits(server[name]), _bits(mine[name])) for name in mine)


@pytest.mark.parametrize("spec", CODECS)
@pytest.mark.parametrize("n", [1, 3, 4])
def test_the_exchange_equals_the_per_slice_box_bit_for_bit(spec, n):
    bucket_bytes = 40 if spec.startswith("2bit") else 4 << 20   # five buckets; three (a dtype apiece)
    _compare(simulate(n, lambda comm: _exchange(comm, spec, bucket_bytes)), _box(build(spec), n, bucket_bytes), n)


def test_the_held_out_buckets_are_the_plans():
    assert _buckets(40) == [[5], [4], [3], [2], [1, 0]] and _buckets(4 << 20) == [[5, 4], [3], [2, 1, 0]]
    for bucket_bytes in (40, 4 << 20):
        order, plan = PSync(make_group(3)[0], "1bit", transport="twophase",
                            bucket_bytes=bucket_bytes).exchange_plan(_inputs(0, 1))
        assert [[order[i] for i in b.tensors] for b in plan.buckets] == _buckets(bucket_bytes)


@pytest.mark.parametrize("spec", ["scaled_sign:scale=rms", "2bit:threshold=0.4"])
def test_a_missing_server_error_is_not_added(spec):
    """Some slices of a bucket with a server error, one without (a lost entry): each as the box."""
    _compare(simulate(3, lambda comm: _exchange(comm, spec, 4 << 20, drop=(5, 1))), _box(build(spec), 3, 4 << 20, (5, 1)), 3)


@pytest.mark.parametrize("spec", ["scaled_sign", "scaled_sign:scale=rms"])
def test_per_slice_scales_over_many_lengths(spec):
    """The batched scales (rms: one row-wise norm per run of equal slices; l1: the defined
    order) equal each slice's own, over many lengths, runs and an ℓ1 fold (> 65536 entries)."""
    codec = build(spec)
    gen = torch.Generator().manual_seed(9)
    lengths = list(range(1, 80)) + [255, 1024, 1025, 4099, 70001]
    x = torch.randn(sum(lengths) * 2, generator=gen) * torch.rand(1, generator=gen)
    bounds, a = [], 0
    for d in lengths:
        bounds += [(a + lo, a + hi) for lo, hi in tp.slice_bounds(d, 3) if hi > lo]
        a += d
    bounds = bounds[1::2] + bounds[::2] + [(a, a + 5), (a + 5, a + 10), (a + 10, a + 15)]   # any order; a run
    got = codec.compress_slices(x, bounds, [0] * len(bounds))
    want = torch.cat([torch.cat(codec.compress(x[lo:hi]).raw()) for lo, hi in bounds])
    assert torch.equal(got.wire, want)
