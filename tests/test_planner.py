"""The exchange planner (gradzip.exchange.planner, gradzip.exchange.plan): routes, buckets and bytes
by hand from the spec's rules; PSync executes exactly the plan (its collectives, in order,
and the bytes its group counts) for random shapes, codecs, transports and n; the plan's
links and its errors."""
import math
import random

import pytest
import torch

import gradzip
from gradzip.exchange import planner
from gradzip.bench.profiling import RecordingGroup
from gradzip.compressors import build
from gradzip.errors import GradzipError
from gradzip.exchange import Link, PSync, plan


# -- routes by hand -------------------------------------------------------------------------
def test_exact_route_picks_the_fewer_ring_bytes():
    """2bit, d = 1000 (packet 250 B): n=4 allreduce 2·3/4·1000 = 1500 > allgather 3·250 = 750;
    n=8: 1750 = 1750, a tie goes to allreduce; n=200: int16 codes, 2·199/200·2000 = 3980 <
    199·250. topk 1%: 10 entries of 4 B value + 2 B index (uint16 for 1000 entries)."""
    c = build("2bit")
    assert planner.exact_route(c, (1000,), 4) == ("allgather", torch.uint8, 250)
    assert planner.exact_route(c, (1000,), 8) == ("allreduce", torch.int8, 1000)
    assert planner.exact_route(c, (1000,), 200) == ("allreduce", torch.int16, 2000)
    assert planner.exact_route(build("topk:ratio=0.01"), (1000,), 4) == ("allgather", torch.uint8, 60)
    assert planner.exact_route(build("none"), (1000,), 4, torch.bfloat16) == ("allreduce", torch.bfloat16, 2000)
    assert planner.exact_route(build("none"), (1000,), 4, pinned="allgather") == ("allgather", torch.uint8, 4000)


def test_summands_are_the_narrowest_exact_width():
    for spec in ("2bit", "sign"):
        sizes = planner.Sizer(build(spec))
        assert [sizes.summand((1000,), n) for n in (2, 127, 128, 32767)] == [1000, 1000, 2000, 2000]
        assert sizes.summand((1000,), 32768) is None
    assert planner.Sizer(build("topk:ratio=0.01")).summand((1000,), 4) is None


def test_two_phase_bucket_bytes_by_hand():
    """One bucket, slices of its concatenated elements. 2bit d = 1000, n = 4: 4 slices of
    250 -> 63 B; a worker sends 3·63 in each phase. 'none' d = 10 + 4 = 14 in one bucket:
    slices 4,4,3,3 -> 16,16,12,12 B: worker 0 sends 16+12+12 = 40 then 3·16 = 48; worker 3
    16+16+12 = 44 then 3·12 = 36; the mean is 2·3/4 of the 56 B of packets."""
    p = plan([(1000,)], "2bit", 4, transport="twophase")
    assert [b.route for b in p.buckets] == ["twophase"] and p.buckets[0].slices == (63, 63, 63, 63)
    assert [p.bytes_for(r) for r in range(4)] == [378] * 4
    q = plan([(10,), (4,)], "none", 4, transport="twophase")
    assert len(q.buckets) == 1 and q.buckets[0].slices == (16, 16, 12, 12)
    assert [q.bytes_for(r) for r in range(4)] == [88, 88, 80, 80]
    assert q.bytes_per_worker == pytest.approx(2 * 3 / 4 * 56) == sum(q.bytes_for(r) for r in range(4)) / 4
    assert plan([(1000,)], "2bit", 1, transport="twophase").bytes_for(0) == 0


def test_buckets_cut_at_the_tensors_own_bytes_in_launch_order():
    """Greedy by the tensors' bytes (as DDP's bucket_cap_mb), a larger tensor alone, a dtype
    change starts a bucket; per (route, carried dtype) inside one; sorted by first tensor."""
    shapes = [(100,), (100,), (300,), (50,), (50,)]
    p = plan(shapes, "none", 2, bucket_bytes=800)
    assert [b.tensors for b in p.buckets] == [(0, 1), (2,), (3, 4)]
    assert all(b.route == "allreduce" and b.nbytes == sum(4 * math.prod(shapes[i]) for i in b.tensors)
               for b in p.buckets)
    mixed = plan(shapes, "none", 2, bucket_bytes=10_000,
                 dtypes=[torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32])
    assert [b.tensors for b in mixed.buckets] == [(0, 1), (2, 3), (4,)]
    per_tensor = plan([(4, 4), (4,)], [build("topk:ratio=0.5"), build("fp16")], 2)
    assert [(b.tensors, b.route, b.dtype) for b in per_tensor.buckets] == [((0,), "allgather", torch.uint8),
                                                                           ((1,), "allreduce", torch.float16)]
    assert per_tensor.routes() == ["allgather", "allreduce"]


def test_auto_is_one_rule_on_the_declared_link():
    """2bit, 4·10^6 entries, 8 or 64 workers: two-phase moves a quarter of the int8
    allreduce's bytes in as many messages (auto takes it: at 64 workers 4.1 against 8.8 ms on
    10 Gbit/s, 20 us); 10^6 entries at 64 workers: latency dominates, 2.9 > 4.1/2 ms (exact);
    2 workers: the same bytes as the allgather in more messages (exact); 'none' never (its
    allreduce is already flat); twophase=False keeps to the exact routes."""
    big = [(4000, 1000)]
    assert plan(big, "2bit", 8).routes() == plan(big, "2bit", 64).routes() == ["twophase"]
    assert plan([(1000, 1000)], "2bit", 64).routes() == ["allreduce"]
    assert plan(big, "2bit", 2).routes() == ["allgather"]
    assert plan(big, "none", 64).routes() == ["allreduce"]
    assert plan(big, "2bit", 64, twophase=False).routes() == ["allreduce"]
    assert plan([(64,)], "2bit", 64, link=Link(1e12, 1.0)).routes() == ["allreduce"]
    assert plan(big, "2bit", 64, link="100mbit").link == Link(12.5e6, planner.DEFAULT_LINK.latency_s)
    assert plan(big, "2bit", 64).link == planner.DEFAULT_LINK


def test_hierarchical_buckets_hold_the_plans_of_their_shards():
    """k = 4 of 8 workers: one bucket, reduce-scatter 3/4 of 4·250 B rows and allgather 3·250·4 B
    inside the node, per local rank the plan of its 250-element shard among 2 nodes."""
    p = plan([(1000,)], "none", 8, hierarchy=4)
    (b,) = p.buckets
    assert b.route == "hierarchical" and b.intra_bytes == 3000 + 3000 and len(b.inner) == 4
    assert all(q.world_size == 2 and q.shapes == ((250,),) for q in b.inner)
    assert p.bytes_for(5) == 6000 + 1000
    assert plan([(1000,)], "none", 8, hierarchy=1).buckets[0].inner[0].shapes == ((1000,),)


def test_lossless_says_which_tensors_travel_with_none():
    """``Plan.lossless``: per tensor in the plan's order; auto:<codec>'s choices decide it per
    unit; a hierarchical bucket is lossless when every local rank's inner plan is."""
    shapes = [(4000,), (30,), (2000,)]
    assert plan(shapes, "none", 4).lossless() == [True] * 3
    assert plan(shapes, "1bit", 4).lossless() == [False] * 3
    mixed = plan(shapes, "auto:1bit", 4, bucket_bytes=8000, choices=("1bit", "none", "none"))
    want = [mixed.codecs[t].spec == "none" for t in range(3)]
    assert mixed.lossless() == want and sorted(want) == [False, True, True]
    assert plan(shapes, "none", 8, hierarchy=4).lossless() == [True] * 3
    units = len(plan(shapes, "auto:1bit", 8, hierarchy=4).choices)
    assert plan(shapes, "auto:1bit", 8, hierarchy=4, choices=("none",) * units).lossless() == [True] * 3
    assert plan(shapes, "auto:1bit", 8, hierarchy=4, choices=("1bit",) * units).lossless() == [False] * 3


def test_plan_errors_are_one_line():
    with pytest.raises(GradzipError, match="transport must be one of"):
        plan([(3,)], "none", 2, transport="ring")
    with pytest.raises(GradzipError, match="dividing the 6 workers"):
        plan([(3,)], "none", 6, hierarchy=4)
    with pytest.raises(GradzipError, match="link must be None, a rate"):
        plan([(3,)], "none", 2, link=3.5)
    with pytest.raises(GradzipError, match="bad bandwidth"):
        plan([(3,)], "none", 2, link="fast")
    with pytest.raises(GradzipError, match="one dtype per shape"):
        plan([(3,)], "none", 2, dtypes=[])


def test_select_renumbers_a_bucket_and_describe_prints_every_bucket():
    p = plan([(100,), (100,), (300,)], "none", 2, bucket_bytes=800)
    one = p.select([1])
    assert [b.tensors for b in one.buckets] == [(0,)] and one.shapes == ((300,),)
    assert p.layout() == "allreduce[0,1] allreduce[2]"
    lines = p.describe()
    assert len(lines) == 3 and lines[-1].startswith("2 buckets") and "10 Gbit/s" in lines[-1]


# -- PSync executes the plan ---------------------------------------------------------------
CODECS = ["none", "fp16", "2bit:threshold=0.1", "1bit", "sign", "scaled_sign", "qsgd", "terngrad",
          "topk:ratio=0.05", "randomk:ratio=0.1", "dgc:ratio=0.05"]


@pytest.mark.parametrize("seed", range(12))
def test_psync_executes_the_plan(seed):
    """Random shapes, codec, n, transport, bucket size and keys: the collectives PSync issues
    (a dry group seen from rank 0) are the plan's buckets in its order, each carrying the
    plan's bytes, and the bytes the group counts are the plan's."""
    rng = random.Random(seed)
    codec = build(rng.choice(CODECS))
    n = rng.choice([1, 2, 3, 5, 8, 64, 200])
    transports = ["auto", "allgather"] + (["allreduce"] if codec.sum_dtype(n) is not None else [])
    transports += [] if codec.shared_randomness else ["twophase"]
    transport = rng.choice(transports)
    shapes = [tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 9))]
    keys = rng.sample(range(100), len(shapes))
    comm = RecordingGroup(n)
    psync = PSync(comm, codec, transport=transport, bucket_bytes=rng.choice([1, 64, 4096, 1 << 22]))
    tensors = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    order, p = psync.exchange_plan(tensors, keys)
    assert order == sorted(range(len(shapes)), key=lambda i: -keys[i])
    assert p.shapes == tuple(shapes[i] for i in order)
    psync(tensors, 1, keys=keys)
    expected, second = [], []   # start(): every bucket's collective (two-phase: phase 1); wait(): phase 2
    for b in p.buckets:
        if b.route == "twophase":
            expected.append(("all_to_all", sum(s for j, s in enumerate(b.slices) if j != 0)))
            second.append(("all_to_all", (n - 1) * b.slices[0]))
        else:
            expected.append((b.route, b.nbytes))
    expected += second
    assert comm.calls == (expected if n > 1 else [])   # a world of one sends nothing
    assert comm.bytes_sent == p.bytes_for(0)


def test_hierarchical_psync_executes_the_plan_on_threads():
    """2 nodes of 2 (threads): every worker's counted bytes are the plan's for its rank."""
    shapes = [(30, 7), (13,), (200,)]

    def run(comm):
        psync = gradzip.exchange.hierarchy.HierarchicalPSync(comm, "1bit", workers_per_node=2, bucket_bytes=900)
        ts = [torch.randn(s) for s in shapes]
        sent = psync(ts, 1).bytes_sent
        return sent, psync.exchange_plan(ts)[1]

    for rank, (sent, p) in enumerate(gradzip.simulate(4, run)):
        assert [b.route for b in p.buckets] == ["hierarchical"] * 2
        assert sent == p.bytes_for(rank)
