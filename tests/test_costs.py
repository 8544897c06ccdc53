"""The timeline model's PSync transport costs (gradzip.bench.costs; issue 15, item 5):
bytes per transport against values computed by hand from the spec's boxes."""
import pytest

from gradzip.bench import costs, profiling, timeline
from gradzip.compressors import build
from gradzip.errors import GradzipError

B, ALPHA = 1e6, 1e-4   # 1 MB/s links, 100 us per message: round numbers


def test_slices_are_tensor_splits():
    assert costs.slice_sizes(10, 4) == [3, 3, 2, 2]
    assert costs.slice_sizes(2, 4) == [1, 1, 0, 0]
    assert costs.slice_sizes(8, 1) == [8]


def test_transport_times_by_hand():
    """Seconds: all-to-all (n-1)·alpha + bytes/B, ring allgather (n-1)·alpha + bytes/B,
    ring allreduce 2(n-1)·alpha + 2(n-1)/n·S/B. 2bit d = 1000, n = 4: two-phase slices of
    250 -> 63-byte packets, 3·63 = 189 each phase (the mean over workers: 378)."""
    c = build("2bit")
    two = costs.exchange_cost("twophase", c, [(1000,)], 4, B, ALPHA)
    assert two.transport == "twophase" and two.wire_bytes == 378
    assert two.seconds == pytest.approx(3 * ALPHA + 189 / B + 3 * ALPHA + 189 / B)
    exact = costs.exchange_cost("exact", c, [(1000,)], 4, B, ALPHA)
    assert exact.transport == "allgather" and exact.wire_bytes == 750
    assert exact.seconds == pytest.approx(3 * ALPHA + 750 / B)
    none = costs.exchange_cost("exact", build("none"), [(1000,)], 4, B, ALPHA)
    assert none.transport == "allreduce" and none.wire_bytes == 6000
    assert none.seconds == pytest.approx(6 * ALPHA + 6000 / B)
    assert costs.allreduce_time(6000 * 4 // 6, 4, B, ALPHA) == pytest.approx(none.seconds)


def test_auto_takes_twophase_only_at_half_the_exact_cost():
    """2bit, d = 10^6, n = 64: exact = allreduce of int8 (2·63/64·10^6 B), two-phase
    ≈ 2·63/64·250000 B: a quarter, so auto takes it; at n = 2 two-phase moves the same
    bytes as the allgather in more messages: auto stays exact."""
    c = build("2bit")
    big = costs.exchange_cost("auto", c, [(1_000_000,)], 64, B, ALPHA)
    assert big.transport == "twophase"
    assert big.seconds == costs.exchange_cost("twophase", c, [(1_000_000,)], 64, B, ALPHA).seconds
    small = costs.exchange_cost("auto", c, [(1_000_000,)], 2, B, ALPHA)
    assert small.transport == "allgather"
    with pytest.raises(GradzipError, match="unknown transport"):
        costs.exchange_cost("carrier-pigeon", c, [(4,)], 2, B, ALPHA)


def test_hierarchical_cost_by_hand():
    """n = 8, k = 4 (2 nodes), fp32 'none', d = 1000, intra links 10x faster: inside a node
    reduce-scatter 3/4·4000 B and allgather 3/4·4000 B at 10 MB/s with 3·alpha_in each;
    across nodes an allreduce of the 250-element shard among 2 workers (2·1/2·1000 B) at
    B/4 (the node's 4 workers share its uplink). k = 1 is the flat exchange; one node
    sends nothing across."""
    c = build("none")
    h = costs.hierarchical_cost("exact", c, [(1000,)], 8, 4, B, ALPHA, 10 * B, 1e-6)
    assert h.wire_bytes == 1000 and h.intra_bytes == 6000
    assert h.seconds == pytest.approx(2 * ALPHA + 1000 / (B / 4) + 6e-6 + 6000 / (10 * B))
    flat = costs.exchange_cost("auto", c, [(1000,)], 8, B, ALPHA)
    assert costs.hierarchical_cost("auto", c, [(1000,)], 8, 1, B, ALPHA, 10 * B) == flat
    one = costs.hierarchical_cost("auto", c, [(1000,)], 4, 4, B, ALPHA, 10 * B)
    assert one.wire_bytes == 0
    with pytest.raises(GradzipError, match="do not divide"):
        costs.hierarchical_cost("auto", c, [(1000,)], 6, 4, B, ALPHA, 10 * B)


def test_profile_prices_the_recorded_exchanges_per_transport():
    """The profile notes EF-SGD's PSync exchange (codec, shapes, its collectives); priced
    as 'exact' it costs what the recorded collectives cost, as 'twophase' what its
    two-phase plan costs; predict() reports the transport used and scales the codec time."""
    shapes = [(64, 32), (32,)]
    prof = profiling.profile_method("efsgd", {"compressor": "topk:ratio=0.1"}, shapes, 4, steps=1)
    assert [(e.codec, sorted(e.shapes)) for e in prof.exchanges[0]] == [("topk:ratio=0.1", sorted(shapes))]
    exact = prof.comm_cost(B, ALPHA, "exact")
    assert exact["seconds"] == pytest.approx(prof.comm_time(B, ALPHA))
    assert exact["wire_bytes"] == prof.wire_bytes_per_step and exact["transports"] == ["allgather"]
    two = prof.comm_cost(B, ALPHA, "twophase")
    expected = costs.exchange_cost("twophase", build("topk:ratio=0.1"), shapes, 4, B, ALPHA)
    assert two["seconds"] == pytest.approx(expected.seconds) and two["wire_bytes"] == expected.wire_bytes
    p = timeline.predict(prof, 0.1, B, ALPHA, transport="twophase")
    assert p["uses"] == ["twophase"] and p["communicate"] == pytest.approx(expected.seconds)
    encode = prof.compress_s - prof.decode_s
    assert p["compress"] == pytest.approx(max(encode * 1.25 + 2 * prof.decode_one_s, encode + prof.decode_one_s))
    assert prof.decode_one_s == pytest.approx(prof.decode_s / 4)   # the allgather decoded 4 packets
    # exact over an allgather: n packets decoded, as profiled; over an allreduce: one
    assert prof.codec_time(["allgather"]) == pytest.approx(prof.compress_s)
    assert prof.codec_time(["allreduce"]) == pytest.approx(encode + prof.decode_one_s)
    assert prof.codec_time(["recorded"], hierarchy=2) == pytest.approx(prof.compress_s / 2)


def test_projection_reports_the_transport_each_method_uses():
    rows = timeline.project([("ssgd", None), ("efsgd", "topk:ratio=0.1")], [4], [8e6], 0.01, ALPHA,
                            shapes=[(64, 32), (32,)], steps=1, transports=(None, "twophase"))
    got = {(r["algo"], r["transport"]): r["uses"] for r in rows}
    assert got == {("ssgd", "recorded"): "recorded", ("ssgd", "twophase"): "twophase",
                   ("efsgd@topk:ratio=0.1", "recorded"): "recorded",
                   ("efsgd@topk:ratio=0.1", "twophase"): "twophase"}
    for r in rows:
        base = next(x for x in rows if x["algo"] == "ssgd" and x["transport"] == r["transport"])
        assert r["speedup"] == pytest.approx(base["iteration_s"] / r["iteration_s"])


def test_projection_bucket_bytes_reach_the_methods():
    """``bucket_bytes`` is every projected method's: S-SGD's two 8 KB gradients in one 1 MB
    bucket are one exchange, in 4 KB buckets two, each paying its ring's 2(n-1) latencies."""
    def ssgd(bucket_bytes):
        row, = timeline.project([("ssgd", None)], [4], [8e6], 0.01, ALPHA, shapes=[(2048,), (2048,)], steps=1,
                                bucket_bytes=bucket_bytes)
        return row
    one, two = ssgd(1 << 20), ssgd(4096)
    assert one["wire_bytes_per_step"] == two["wire_bytes_per_step"]
    assert two["communicate_s"] - one["communicate_s"] == pytest.approx(2 * 3 * ALPHA)


def test_comm_cost_of_a_twophase_profile_counts_its_second_round_once():
    """A method profiled with transport="twophase" issues its second all-to-all while the
    exchange finishes, after PSync.start: those calls are the exchange's own, so pricing the
    exchange for two-phase again must not also add them as other collectives (it did:
    1.5x the bytes)."""
    from gradzip.bench import profiling
    shapes = [(256, 128), (256,), (10, 256)]
    prof = profiling.profile_method("bitsgd", {"transport": "twophase"}, shapes, 4, steps=1, warmup=0)
    assert {kind for step in prof.calls for kind, _ in step} == {"all_to_all"}
    cost = prof.comm_cost(1.25e7, 1e-4, "twophase")
    assert cost["wire_bytes"] == pytest.approx(prof.wire_bytes_per_step, rel=0.02)
    assert cost["seconds"] == pytest.approx(prof.comm_time(1.25e7, 1e-4), rel=0.05)
