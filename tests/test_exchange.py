import threading

import pytest
import torch

import gradzip
from gradzip.exchange.planner import exact_route
from gradzip.compressors import PerTensor, build
from gradzip.compressors.identity import NoCompression
from gradzip.exchange import PSync, mix_seed
from gradzip.comm.launch import run_processes

import cases


def direct_aggregate(spec, n, step=3, seed=11):
    """The aggregate computed directly from every worker's packets (no communication)."""
    codec = build(spec)
    out = []
    for key, shape in enumerate(cases.SHAPES):
        packets = []
        for rank in range(n):
            s = mix_seed(seed, step, key) if codec.shared_randomness else mix_seed(seed, step, key, rank + 1)
            packets.append(codec.compress(cases.worker_tensors(rank)[key], s))
        out.append(codec.aggregate(packets))
    return out


def check_exchange(results, n):
    for spec in cases.EXCHANGE_CODECS:
        expected = direct_aggregate(spec, n)
        codec = build(spec)
        # fp16 sums in fp16 (each v/n rounded, then the sum): agree to fp16 precision
        tol = dict(rtol=2e-3, atol=2e-3) if spec == "fp16" else dict(rtol=1e-5, atol=1e-6)
        for rank, per_codec in enumerate(results):
            aggregate, residual, _ = per_codec[spec]
            for key, (agg, exp) in enumerate(zip(aggregate, expected)):
                assert agg.shape == exp.shape, spec
                torch.testing.assert_close(agg, exp, **tol, msg=f"{spec} rank {rank} tensor {key}")
            # v == C(v) + residual
            for key, (v, r) in enumerate(zip(cases.worker_tensors(rank), residual)):
                s = mix_seed(11, 3, key) if codec.shared_randomness else mix_seed(11, 3, key, rank + 1)
                decoded = codec.decompress(codec.compress(v, s))
                assert torch.equal(decoded + r, v) or torch.allclose(decoded + r, v, atol=1e-6), spec
                if spec.startswith(("topk", "randomk", "randblock", "none")):
                    assert torch.equal(decoded + r, v), spec  # exact for sparsifiers
        # every rank got bitwise the same aggregate
        for per_codec in results[1:]:
            for a, b in zip(per_codec[spec][0], results[0][spec][0]):
                assert torch.equal(a, b), spec


@pytest.mark.parametrize("n", [1, 2, 4])
def test_psync_on_threads_matches_direct_computation(n):
    check_exchange(gradzip.simulate(n, cases.exchange_all), n)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_psync_on_gloo_matches_direct_computation(n):
    check_exchange(run_processes(n, cases.exchange_all), n)


@pytest.mark.parametrize("n, expected", [(2, "allgather"), (4, "allgather"), (7, "allgather"),
                                         (8, "allreduce"), (16, "allreduce")])
def test_2bit_collective_choice_follows_wire_sizes(n, expected):
    d = 4000

    def fn(comm):
        psync = PSync(comm, "2bit:threshold=0.5")
        route = psync.routes([torch.randn(d)])[0]
        res = psync([torch.randn(d)], 1)
        return route, res.bytes_sent

    route, sent = gradzip.simulate(n, fn)[0]
    assert route == expected
    if expected == "allgather":
        assert sent == (n - 1) * d // 4
    else:
        assert sent == 2 * (n - 1) * d // n


def test_dense_codec_uses_allreduce_and_counts_ring_bytes():
    def fn(comm):
        res = PSync(comm, "none")([torch.ones(100), torch.ones(50)], 1)
        return res.bytes_sent, res.packet_bytes

    sent, packet = gradzip.simulate(4, fn)[0]
    assert packet == 600
    assert sent == 2 * 3 * 600 // 4  # one bucket, one ring allreduce


@pytest.mark.parametrize("spec", ["none", "topk:ratio=0.2", "2bit:threshold=0.3", "randomk:ratio=0.5", "sign"])
def test_bucketing_changes_no_result(spec):
    def fn(comm, bucket_bytes):
        return PSync(comm, spec, bucket_bytes=bucket_bytes)(cases.worker_tensors(comm.rank), 2).aggregate

    one_per_tensor = gradzip.simulate(3, lambda c: fn(c, 1))
    one_bucket = gradzip.simulate(3, lambda c: fn(c, 1 << 30))
    for a, b in zip(one_per_tensor, one_bucket):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


class _NoneOneByOne(NoCompression):
    """``none`` through PSync's per-member path (the reference of the one-pass path)."""

    sends_input = False


@pytest.mark.parametrize("residual, omit", [(False, False), (True, False), (True, True)])
def test_none_sent_as_it_is_in_one_pass_equals_the_per_member_path(residual, omit, monkeypatch):
    """PSync sends a run of ``none`` members on an allreduce in one pass
    (``Compressor.sends_input``): the same aggregates, residuals, packets, byte counts and
    edit-guard digests as compressing them one by one, in a bucket that mixes them with
    another codec's run (a PerTensor policy)."""
    tensors = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in
               enumerate([(70, 80), (5,), (3, 4), (6000,), (7,)])]

    def fn(comm, none):
        policy = PerTensor("fp16", {"t1": none, "t2": none, "t3": none, "t4": none})
        psync = PSync(comm, policy, bucket_bytes=1 << 30)
        psync.names = {k: f"t{k}" for k in range(len(tensors))}
        psync.omit_zero_residuals = omit
        mine = [t * (comm.rank + 1) for t in tensors]
        pending = psync.start(mine, 1, residual=residual, digest_inputs=True)
        result = pending.wait()
        return (result.aggregate, result.residual, result.bytes_sent, result.packet_bytes, pending.digests,
                [p.nbytes for p in pending.packets], pending.recyclable)

    passes = []
    one_pass = PSync._send_as_they_are
    monkeypatch.setattr(PSync, "_send_as_they_are", staticmethod(
        lambda codec, members, *rest: passes.append(len(members)) or one_pass(codec, members, *rest)))
    fast_runs = gradzip.simulate(2, lambda c: fn(c, NoCompression()))
    # one pass per worker over the four none members, unless a (zero) residual is asked for each
    assert passes == ([4, 4] if omit or not residual else [])
    for fast, slow in zip(fast_runs, gradzip.simulate(2, lambda c: fn(c, _NoneOneByOne()))):
        cases.assert_bitwise_equal(fast, slow, "none in one pass vs one by one")
        assert fast[4][3] is not None   # the large none member's digest, made in the bucket copy


def test_shared_random_coordinates_agree_across_workers():
    def fn(comm):
        res = PSync(comm, "randomk:ratio=0.25")([torch.randn(40) + 10], 5)
        return res.residual[0] == 0  # kept coordinates have zero residual

    masks = gradzip.simulate(3, fn)
    assert masks[0].sum() == 10
    for m in masks[1:]:
        assert torch.equal(m, masks[0])


def test_sign_majority_vote():
    votes = [torch.tensor([1.0, 1.0, -1.0]), torch.tensor([1.0, -1.0, -1.0]), torch.tensor([-1.0, -1.0, 2.0])]

    def fn(comm):
        return PSync(comm, "sign")([votes[comm.rank]], 1, residual=False).aggregate[0]

    for agg in gradzip.simulate(3, fn):
        assert agg.tolist() == [1.0, -1.0, -1.0]


def test_mix_seed_is_stable_and_sensitive():
    assert mix_seed(1, 2, 3) == mix_seed(1, 2, 3)
    assert len({mix_seed(1, 2, k) for k in range(100)}) == 100
    assert 0 <= mix_seed(2**70, -5) < 2**63


# -- issue 13: the route is sized without building the summand -----------------------------
@pytest.mark.parametrize("spec, n, builds", [("2bit", 2, 0), ("2bit", 8, 1), ("sign", 4, 0),
                                             ("sign", 16, 1), ("fp16", 2, 1)])
def test_exchange_builds_the_summand_only_when_allreduce_wins(spec, n, builds):
    """The plan sizes routes from the shapes (gradzip.exchange.planner.Sizer); an exchange then builds
    a summand only for a tensor routed to the allreduce."""
    codec = build(spec)
    calls = []
    summand = codec.summand
    object.__setattr__(codec, "summand", lambda packet, world: calls.append(packet) or summand(packet, world))
    t = torch.randn(1000)
    expected = ("allreduce", codec.sum_dtype(n)) if builds else ("allgather", torch.uint8)
    assert exact_route(codec, (1000,), n)[:2] == expected
    barrier = threading.Barrier(n)

    def fn(comm):
        psync = gradzip.PSync(comm, codec)
        route = psync.routes([t])[0]       # planned (and sized) before the count starts
        barrier.wait()
        if comm.rank == 0:
            del calls[:]
        barrier.wait()
        psync([t], 1, residual=False)
        return route

    assert gradzip.simulate(n, fn) == ["allreduce" if builds else "allgather"] * n
    assert len(calls) == n * builds


def test_count_wait_counts_blocked_time_as_communication_on_the_owner_thread_only():
    """A method's own collective behind its buckets (the overlap's control allgather) is
    time blocked on the network: communicate_s and, on the training thread, wait_s."""
    psync = PSync(gradzip.comm.default(), "none")   # a world of one
    psync.count_wait(1.0, 1.25)
    assert (psync.timings.communicate_s, psync.timings.wait_s) == (0.25, 0.25)
    worker = threading.Thread(target=psync.count_wait, args=(2.0, 2.5))
    worker.start()
    worker.join()
    assert (psync.timings.communicate_s, psync.timings.wait_s) == (0.75, 0.25)


@pytest.mark.parametrize("bad", [None, 1, 2])
def test_the_aggregate_check_reads_only_what_the_decode_did_not_check(bad, monkeypatch):
    """``none``'s aggregates are found finite in their division's own pass
    (``from_sums_checked``, gradzip.kernels.sums); PSync's check reads only the others
    (here fp16's), and still names the first non-finite aggregate by its position."""
    import gradzip.exchange.psync as psync_module
    from gradzip.guards.nonfinite import NonFiniteAggregate
    read = []

    def counting(tensors):
        read.append(len(tensors))
        return gradzip.guards.nonfinite.first_nonfinite(tensors)

    monkeypatch.setattr(psync_module, "first_nonfinite", counting)
    shapes = [(10,), (200,), (20,), (300,)]   # none, fp16, none, fp16 (min_numel)

    def worker(comm):
        psync = PSync(comm, gradzip.PerTensor("fp16", min_numel=100), check_finite=True)
        tensors = [torch.full(s, 1.0 + comm.rank) for s in shapes]
        if bad is not None and comm.rank == 1:
            tensors[bad][3] = float("nan")
        try:
            result = psync.start(tensors, 0).wait()
        except NonFiniteAggregate as error:
            return error.index
        return [float(a.mean()) for a in result.aggregate]

    results = gradzip.simulate(2, worker)
    if bad is None:
        assert results == [[1.5] * 4] * 2
        assert read == [2, 2]                    # the two fp16 aggregates, on each worker
    else:
        assert results == [bad, bad]
