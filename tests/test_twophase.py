"""The two-phase compressed allreduce (gradzip.exchange.twophase, PSync transport="twophase"):
against a numpy reference of the spec's rule (slices of each bucket of the plan), identity
= allreduce, conservation, bytes = the formula, resume with server errors, the auto rule,
all_to_all and the int16 2bit summand."""
import copy
import math

import numpy as np
import pytest
import torch

import gradzip
from gradzip import kernels
from gradzip.exchange import planner as tp
from gradzip.bench.profiling import RecordingGroup
from gradzip.comm import make_group, simulate
from gradzip.compressors import build
from gradzip.errors import GradzipError
from gradzip.exchange import PSync
from gradzip.comm.launch import run_processes

SIZES = (1, 5, 13, 30)   # odd sizes; some below the worker count (empty slices)
T = 0.4                  # 2bit threshold


# -- a straightforward numpy reference of the rule ---------------------------------------
def np_compress(codec, x):
    """dec(C(x)) for a 1-D float32 slice."""
    x = x.astype(np.float32)
    if codec == "2bit":
        return (np.float32(T) * np.sign(x) * (np.abs(x) >= np.float32(T))).astype(np.float32)
    if codec == "sign":
        return np.where(x >= 0, 1, -1).astype(np.float32)
    if codec == "1bit":
        pos, neg = x[x >= 0], x[x < 0]
        mp = np.float32(pos.sum(dtype=np.float32) / np.float32(len(pos))) if len(pos) else np.float32(0)
        mn = np.float32(neg.sum(dtype=np.float32) / np.float32(len(neg))) if len(neg) else np.float32(0)
        return np.where(x >= 0, mp, mn).astype(np.float32)
    if codec == "topk":
        k = max(1, math.ceil(0.3 * len(x)))
        keep = np.argsort(-np.abs(x), kind="stable")[:k]
        out = np.zeros_like(x)
        out[keep] = x[keep]
        return out
    raise AssertionError(codec)


def np_aggregate(codec, decoded):
    if codec == "sign":
        return np.sign(np.sum(decoded, axis=0)).astype(np.float32)
    total = decoded[0].copy()
    for d in decoded[1:]:
        total += d
    return (total / np.float32(len(decoded))).astype(np.float32)


def np_buckets(sizes, bucket_bytes):
    """The plan's buckets, held out: tensor positions in launch order (descending key; the
    keys are the positions here), cut greedily at ``bucket_bytes`` of float32 elements."""
    buckets, filled = [], 0
    for k in reversed(range(len(sizes))):
        if not buckets or (buckets[-1] and filled + 4 * sizes[k] > bucket_bytes):
            buckets.append([])
            filled = 0
        buckets[-1].append(k)
        filled += 4 * sizes[k]
    return buckets


def np_two_phase(codec, inputs, server):
    """One two-phase exchange of one bucket: inputs[i] (its tensors flattened and
    concatenated) per worker; server: slice j -> E_j (updated in place). Returns
    (aggregate, residuals)."""
    n, d = len(inputs), len(inputs[0])
    bounds = tp.slice_bounds(d, n)
    assert [b - a for a, b in bounds] == [len(s) for s in np.array_split(np.arange(d), n)]
    residuals = []
    dec = [[np_compress(codec, v[a:b]) if b > a else None for a, b in bounds] for v in inputs]
    for v, row in zip(inputs, dec):
        residuals.append(v - np.concatenate([r for r in row if r is not None] or [np.zeros(0, np.float32)]))
    out = np.zeros(d, np.float32)
    for j, (a, b) in enumerate(bounds):
        if a == b:
            continue
        s = np_aggregate(codec, [dec[i][j] for i in range(n)]) + server.get(j, np.float32(0))
        c = np_compress(codec, s)
        server[j] = s - c
        out[a:b] = c
    return out, residuals


def _inputs(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(d, generator=g) for d in SIZES]


def _run_psync(comm, codec, steps=3, bucket_bytes=4 << 20):
    psync = PSync(comm, codec, transport="twophase", bucket_bytes=bucket_bytes)
    outs = []
    for step in range(1, steps + 1):
        r = psync(_inputs(comm.rank, step), step)
        outs.append(([a.clone() for a in r.aggregate], [x.clone() for x in r.residual]))
    return outs


def _check_against_reference(results, codec, n, steps=3, bucket_bytes=4 << 20):
    buckets = np_buckets(SIZES, bucket_bytes)
    servers = [{} for _ in buckets]
    for step in range(1, steps + 1):
        per_worker = [[t.numpy() for t in _inputs(r, step)] for r in range(n)]
        for members, server in zip(buckets, servers):
            agg, res = np_two_phase(codec, [np.concatenate([per_worker[r][k] for k in members]) for r in range(n)],
                                    server)
            at = 0
            for k in members:
                for r in range(n):
                    got_agg, got_res = results[r][step - 1][0][k], results[r][step - 1][1][k]
                    np.testing.assert_allclose(got_agg.numpy(), agg[at:at + SIZES[k]], rtol=1e-5, atol=1e-6)
                    np.testing.assert_allclose(got_res.numpy(), res[r][at:at + SIZES[k]], rtol=1e-5, atol=1e-6)
                at += SIZES[k]


CODECS = {"2bit": f"2bit:threshold={T}", "1bit": "1bit", "sign": "sign", "topk": "topk:ratio=0.3"}


@pytest.mark.parametrize("bucket_bytes", [4 << 20, 80])   # one bucket; [30], [13, 5, 1]
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("codec", list(CODECS))
def test_two_phase_matches_the_numpy_reference_on_threads(codec, n, bucket_bytes):
    results = simulate(n, lambda comm: _run_psync(comm, CODECS[codec], bucket_bytes=bucket_bytes))
    _check_against_reference(results, codec, n, bucket_bytes=bucket_bytes)


def test_the_reference_buckets_are_the_plans():
    assert np_buckets(SIZES, 80) == [[3], [2, 1, 0]] and np_buckets(SIZES, 4 << 20) == [[3, 2, 1, 0]]
    for bucket_bytes in (80, 4 << 20, 1):
        order, plan = PSync(make_group(2)[0], "1bit", transport="twophase",
                            bucket_bytes=bucket_bytes).exchange_plan([torch.zeros(d) for d in SIZES])
        assert [[order[i] for i in b.tensors] for b in plan.buckets] == np_buckets(SIZES, bucket_bytes)


def gloo_two_phase(comm):
    return {codec: _run_psync(comm, spec) for codec, spec in CODECS.items()}


@pytest.mark.slow
def test_two_phase_matches_the_numpy_reference_on_gloo():
    n = 3
    results = run_processes(n, gloo_two_phase)
    for codec in CODECS:
        _check_against_reference([r[codec] for r in results], codec, n)


# -- identity: equals allreduce; conservation --------------------------------------------
def test_identity_two_phase_equals_allreduce_bitwise_and_conserves():
    def run(comm):
        ts = _inputs(comm.rank, 1)
        a = PSync(comm, "none", transport="twophase")(ts, 1)
        b = PSync(comm, "none", transport="allreduce")(ts, 1)
        return a, b, ts

    for a, b, ts in simulate(4, run):
        for x, y, r, v in zip(a.aggregate, b.aggregate, a.residual, ts):
            assert torch.equal(x, y)
            assert torch.equal(r, torch.zeros_like(v))


def test_conservation_worker_and_server_errors():
    """For every worker: sent + worker error = input; for every slice of the bucket: what
    comes back + the server error = the averaged decoded slice (codec 1bit, 3 workers; one
    bucket, launch order 3, 2, 1, 0, its key 3)."""
    n, codec = 3, build("1bit")
    order = [3, 2, 1, 0]

    def run(comm):
        psync = PSync(comm, codec, transport="twophase")
        ts = _inputs(comm.rank, 1)
        r = psync(ts, 1)
        return torch.cat([ts[k] for k in order]), r, dict(psync.server_errors.errors)

    out = simulate(n, run)
    bounds = tp.slice_bounds(sum(SIZES), n)
    for rank, (v, r, _) in enumerate(out):
        sent = torch.cat([codec.decompress(codec.compress(v[a:b])) for a, b in bounds if b > a])
        torch.testing.assert_close(sent + torch.cat([r.residual[k] for k in order]), v, rtol=0, atol=1e-6)
    back = torch.cat([out[0][1].aggregate[k] for k in order])
    for j, (a, b) in enumerate(bounds):
        mean = sum(codec.decompress(codec.compress(out[i][0][a:b])) for i in range(n)) / n
        torch.testing.assert_close(back[a:b] + out[j][2][(3, j)], mean, rtol=0, atol=1e-6)


# -- bytes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["allreduce", "allgather", "twophase", "auto"])
@pytest.mark.parametrize("codec", ["2bit", "1bit", "topk:ratio=0.3"])
def test_measured_bytes_equal_the_formula(codec, transport):
    n = 5
    c = build(codec)
    if transport == "allreduce" and c.sum_dtype(n) is None:
        with pytest.raises(GradzipError, match="transport='allreduce'"):
            PSync(make_group(n)[0], c, transport=transport)
        return

    def run(comm):
        psync = PSync(comm, c, transport=transport, bucket_bytes=1)
        ts = _inputs(comm.rank, 1)
        return psync(ts, 1).bytes_sent, comm.bytes_sent, psync.routes(ts), psync.exchange_plan(ts)[1]

    packet = lambda m: c.compress(torch.zeros(m)).nbytes if m else 0   # an empty slice is not sent
    for rank, (sent, counted, routes, plan) in enumerate(simulate(n, run)):
        expected = 0
        for d, kind in zip(SIZES, routes):   # one tensor a bucket (bucket_bytes=1)
            if kind == "twophase":
                slices = [packet(b - a) for a, b in tp.slice_bounds(d, n)]
                expected += sum(s for j, s in enumerate(slices) if j != rank) + (n - 1) * slices[rank]
            elif kind == "allreduce":
                expected += 2 * (n - 1) * d * 1 // n     # int8 codes
            else:
                expected += (n - 1) * packet(d)
        assert sent == counted == expected == plan.bytes_for(rank)
        if transport != "auto":
            assert set(routes) == {transport}


def test_bytes_per_worker_stay_flat_in_n():
    """2bit, one tensor of 10^5: two-phase bytes at 256 workers within 1.15x of 8 (dry)."""
    def sent(n):
        comm = RecordingGroup(n)
        PSync(comm, "2bit", transport="twophase")([torch.randn(100_000)], 1)
        return comm.bytes_sent

    assert sent(256) <= 1.15 * sent(8)


# -- state: resume bit-exact ---------------------------------------------------------------
def _linear():
    """The same Linear(7, 3) on every worker (a local generator: threads share torch's)."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(7, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def _train(comm, split, steps=4, drop=False):
    model = _linear()
    make = lambda m: gradzip.optim.EFSGD(m.parameters(), lr=0.1, comm=comm, compressor="1bit", transport="twophase")
    opt = make(model)
    for t in range(1, steps + 1):
        if t == split:
            saved_m, saved_o = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
            model = _linear()
            model.load_state_dict(saved_m)
            opt = make(model)
            if drop:
                saved_o["gradzip"]["exchange_states"] = []
            opt.load_state_dict(saved_o)
        g = torch.Generator().manual_seed(10 * t + comm.rank)
        x, y = torch.randn(4, 7, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def test_resume_with_server_errors_is_bit_exact():
    straight = simulate(3, lambda c: _train(c, None))
    resumed = simulate(3, lambda c: _train(c, 3))
    for (pa, sa), (pb, sb) in zip(straight, resumed):
        assert all(torch.equal(a, b) for a, b in zip(pa, pb))
        ea, eb = sa["gradzip"]["exchange_states"][0]["server_errors"], sb["gradzip"]["exchange_states"][0]["server_errors"]
        assert ea and ea.keys() == eb.keys() and all(torch.equal(ea[k], eb[k]) for k in ea)


def test_without_the_server_errors_the_resume_differs():
    """The test above can fail: a resume that drops the server errors changes the run."""
    straight = simulate(3, lambda c: _train(c, None))
    dropped = simulate(3, lambda c: _train(c, 3, drop=True))
    assert any(not torch.equal(a, b) for (pa, _), (pb, _) in zip(straight, dropped) for a, b in zip(pa, pb))


# -- auto, settings, options ---------------------------------------------------------------
def test_auto_is_exact_for_small_jobs_and_packet_summing_codecs():
    big = [(4000, 1000)]
    assert PSync(make_group(2)[0], "1bit").routes(big) == ["allgather"]
    assert PSync(make_group(8)[0], "1bit").routes(big) == ["twophase"]
    assert PSync(make_group(8)[0], "2bit").routes(big) == ["twophase"]
    for codec in ("none", "fp16", "randomk:ratio=0.01"):
        assert PSync(make_group(64)[0], codec).routes(big) == ["allreduce"]


def test_transport_is_a_common_option_checked_and_compared():
    with pytest.raises(GradzipError, match="transport must be one of"):
        gradzip.optim.EFSGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1, transport="ring")
    with pytest.raises(GradzipError, match="twophase"):
        gradzip.optim.DGC([torch.nn.Parameter(torch.zeros(3))], lr=0.1, transport="twophase")
    opt = gradzip.optim.BitSGD([torch.nn.Parameter(torch.zeros(4000, 1000))], lr=0.1, comm=make_group(8)[0])
    assert opt.describe()["exchange 0 transport"] == "auto: twophase"

    def run(comm):
        p = torch.nn.Parameter(torch.zeros(3))
        p.grad = torch.ones(3)
        opt = gradzip.optim.EFSGD([p], lr=0.1, comm=comm, compressor="1bit",
                                  transport="twophase" if comm.rank else "allgather")
        opt.step()
    with pytest.raises(gradzip.guards.consistency.InconsistentWorkers, match="transport"):
        simulate(2, run)


def test_cli_takes_transport():
    from gradzip.cli import build_parser
    from gradzip.cli.runs import _configs
    args = build_parser().parse_args(["train", "--algo", "efsgd", "--compressor", "1bit", "--transport", "twophase"])
    assert _configs(args)[0].transport == "twophase"


# -- comm: all_to_all ----------------------------------------------------------------------
def test_all_to_all_variable_sizes_and_bytes():
    def run(comm):
        r = comm.rank
        send = [torch.full((r + j + 1,), 10 * r + j, dtype=torch.uint8) for j in range(comm.world_size)]
        got = comm.all_to_all(send, [i + r + 1 for i in range(comm.world_size)])
        unsized = comm.all_to_all(send)
        return got, unsized, comm.bytes_sent

    n = 3
    for r, (got, unsized, sent) in enumerate(simulate(n, run)):
        for i in range(n):
            assert torch.equal(got[i], torch.full((i + r + 1,), 10 * i + r, dtype=torch.uint8))
            assert torch.equal(unsized[i], got[i])
        mine = sum(r + j + 1 for j in range(n) if j != r)
        assert sent == 2 * mine + 8 * (n - 1)


def rounds_exchange(comm):
    """One all-to-all of variable sizes (some 0) whole, then in 2, 5 and 40 rounds."""
    r = comm.rank
    send = [torch.arange(7 * r + 3 * j, dtype=torch.int64) for j in range(comm.world_size)]
    sizes = [7 * i + 3 * r for i in range(comm.world_size)]
    start = comm.bytes_sent
    whole = comm.all_to_all(send, sizes)
    once = comm.bytes_sent - start
    parts = {R: comm.all_to_all(send, sizes, rounds=R) for R in (2, 5, 40)}
    return whole, parts, once, comm.bytes_sent - start - once


def test_all_to_all_in_rounds_is_the_same_exchange():
    """rounds > 1: the same messages (variable and zero sizes, more rounds than entries), the
    same bytes counted, on threads and on gloo; a bad rounds value is a one-line error."""
    for whole, parts, once, sent in simulate(3, rounds_exchange) + run_processes(2, rounds_exchange):
        for got in parts.values():
            assert all(torch.equal(a, b) for a, b in zip(got, whole))
        assert once > 0 and sent == 3 * once      # each call counted the bytes of the whole exchange
    with pytest.raises(GradzipError, match="rounds must be an integer >= 1"):
        make_group(2)[0].all_to_all([torch.zeros(1)] * 2, [1, 1], rounds=0)


@pytest.mark.parametrize("hierarchy", [None, 2])
def test_round_bytes_changes_no_number_and_no_byte(hierarchy):
    """PSync's round_bytes (each two-phase all-to-all in rounds): bit for bit the same
    aggregates, residuals, server errors and bytes as whole messages, flat and hierarchical."""
    from gradzip.exchange.hierarchy import HierarchicalPSync

    def run(comm, round_bytes):
        kind = PSync if hierarchy is None else HierarchicalPSync
        extra = {} if hierarchy is None else {"workers_per_node": hierarchy}
        psync = kind(comm, "1bit", transport="twophase", round_bytes=round_bytes, **extra)
        outs = [psync([t * 100 for t in _inputs(comm.rank, step)] + [torch.randn(3000, generator=torch.Generator().manual_seed(step))], step)
                for step in (1, 2)]
        return ([[a.clone() for a in o.aggregate] + [x.clone() for x in o.residual] for o in outs],
                psync.server_errors.state_dict(), psync.bytes_sent)

    whole = simulate(4, lambda comm: run(comm, None))
    rounds = simulate(4, lambda comm: run(comm, 16))
    for (a, ea, ba), (b, eb, bb) in zip(whole, rounds):
        assert all(torch.equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))
        assert ea.keys() == eb.keys() and ba == bb
    with pytest.raises(GradzipError, match="round_bytes must be None"):
        PSync(make_group(2)[0], "1bit", round_bytes=0)


def test_round_bytes_is_a_common_option_compared_and_a_cli_flag():
    from gradzip.cli import build_parser
    from gradzip.cli.runs import _configs
    args = build_parser().parse_args(["train", "--algo", "efsgd", "--compressor", "1bit", "--round-bytes", "65536"])
    assert _configs(args)[0].round_bytes == 65536
    opt = gradzip.optim.EFSGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1, compressor="1bit", round_bytes=65536)
    assert opt.describe()["round_bytes"] == 65536 and opt.psync.round_bytes == 65536

    def run(comm):
        p = torch.nn.Parameter(torch.zeros(3))
        p.grad = torch.ones(3)
        opt = gradzip.optim.EFSGD([p], lr=0.1, comm=comm, compressor="1bit", transport="twophase",
                                  round_bytes=4096 if comm.rank else None)
        opt.step()
    with pytest.raises(gradzip.guards.consistency.InconsistentWorkers, match="round_bytes"):
        simulate(2, run)


# -- 2bit: int16 summand beyond 127 workers -------------------------------------------------
def test_2bit_sums_as_int16_from_128_workers_and_stays_on_allreduce():
    codec = build("2bit:threshold=0.5")
    assert codec.sum_dtype(127) == torch.int8 and codec.sum_dtype(128) == torch.int16
    assert codec.sum_dtype(32767) == torch.int16 and codec.sum_dtype(32768) is None
    packets = [codec.compress(torch.full((6,), 1.0)) for _ in range(200)]
    total = sum(codec.summand(p, 200).to(torch.int32) for p in packets).to(torch.int16)
    assert codec.summand(packets[0], 200).dtype == torch.int16
    assert torch.equal(codec.from_sum(total, packets[0], 200), codec.aggregate(packets))
    comm = RecordingGroup(200)
    PSync(comm, codec, allow_twophase=False)([torch.randn(1000)], 1)
    assert [k for k, _ in comm.calls] == ["allreduce"]


@pytest.mark.parametrize("mode", ["torch", "auto"])
def test_sign_sums_as_int16_from_128_workers_and_its_vote_is_the_allgather_vote(mode):
    """The majority vote of 200 workers from the int16 sum equals the vote decoded from the
    packets (ties: 0), on the torch and the fused path; the route stays allreduce."""
    with kernels.use(mode):
        _sign_int16_vote()


def _sign_int16_vote():
    codec = build("sign")
    assert codec.sum_dtype(128) == torch.int16 and codec.sum_dtype(32768) is None
    packets = [codec.compress(torch.randn(37, generator=torch.Generator().manual_seed(i)) + (i % 3 == 0))
               for i in range(200)]
    assert codec.summand(packets[0], 200).dtype == torch.int16
    total = sum(codec.summand(p, 200).to(torch.int32) for p in packets).to(torch.int16)
    assert torch.equal(codec.from_sum(total, packets[0], 200), codec.aggregate(packets))
    comm = RecordingGroup(200)
    PSync(comm, codec, allow_twophase=False)([torch.randn(1000)], 1)
    assert [k for k, _ in comm.calls] == ["allreduce"]


# -- the exchange during backward and CD-SGD's background exchange ---------------------------
@pytest.mark.parametrize("name", ["efsgd-1bit", "bitsgd", "ssgd-sign"])
def test_two_phase_during_backward_equals_two_phase_in_step(name):
    """Hooked (several buckets launched during backward) = overlap off (one PSync call),
    bit for bit: both execute the one plan (launch order, buckets) of the exchange."""
    import cases
    import cases_overlap

    def run(comm):
        return {how: cases_overlap.train(comm, name, how, steps=3, transport="twophase")
                for how in ("hooked", "off")}

    for out in simulate(3, run):
        (a, sa), (b, sb) = out["hooked"], out["off"]
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert sa["gradzip"]["exchange_states"] and sa["gradzip"]["exchange_states"][0]["server_errors"]
        cases.assert_bitwise_equal(sa["gradzip"]["exchange_states"], sb["gradzip"]["exchange_states"],
                                   "server errors, hooked vs in step")


def test_cdsgd_runs_two_phase_on_its_exchange_thread():
    def train_cd(comm, transport):
        model = _linear()
        opt = gradzip.optim.CDSGD(model.parameters(), lr=0.1, comm=comm, compressor="2bit:threshold=0.05",
                                  k=3, transport=transport)
        for t in range(1, 6):
            g = torch.Generator().manual_seed(10 * t + comm.rank)
            x, y = torch.randn(4, 7, generator=g), torch.randn(4, 3, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        opt.synchronize()
        out = [p.detach().clone() for p in model.parameters()], opt.bytes_sent
        getattr(opt, "close", lambda: None)()
        return out

    two = simulate(3, lambda c: train_cd(c, "twophase"))
    exact = simulate(3, lambda c: train_cd(c, "allgather"))
    assert all(t[1] < e[1] for t, e in zip(two, exact))   # 2(n-1)/n of a packet, not (n-1)
    assert any(not torch.equal(a, b) for a, b in zip(two[0][0], exact[0][0]))  # it changed the numbers


def test_an_overflowing_exchange_leaves_the_server_errors_as_they_were():
    """NonFiniteAggregate (check_finite) stops the exchange before its new server errors are
    kept: a skipped step must not leave Inf/NaN (or any change) in E."""
    from gradzip.guards.nonfinite import NonFiniteAggregate

    def run(comm):
        psync = PSync(comm, "1bit", transport="twophase", check_finite=True)
        psync([torch.randn(6)], 1)
        before = {k: v.clone() for k, v in psync.server_errors.errors.items()}
        with pytest.raises(NonFiniteAggregate):
            psync([torch.full((6,), 3e38)], 2)
        after = psync.server_errors.errors
        return before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

    assert all(simulate(2, run))


@pytest.mark.parametrize("codec", ["randomk:ratio=0.1", "randblock:ratio=0.1", "powersgd"])
def test_twophase_refuses_codecs_whose_choices_come_from_the_seed(codec):
    """randomk's indices (randblock's block, PowerSGD's start) come from the shared seed; the
    second compression of two-phase uses another seed, so its packets would be decoded at
    the first one's positions. They sum in compressed form anyway: pinning two-phase is a
    one-line error naming the fix; auto keeps the allreduce."""
    comm = make_group(2)[0]
    with pytest.raises(GradzipError, match="use transport='auto' or 'allreduce'"):
        PSync(comm, codec, transport="twophase")
    assert PSync(make_group(64)[0], codec).routes([torch.zeros(1 << 20)]) == ["allreduce"]


@pytest.mark.parametrize("codec", ["none", "2bit", "1bit", "topk:ratio=0.1"])
def test_sizer_sizes_half_precision_as_sent(codec):
    """The auto rule's sizes follow the tensor's dtype: a bfloat16 exchange's measured
    bytes equal ``wire_bytes`` with that dtype (``none``: 2 bytes an element, not float32's 4)."""
    n, c = 4, build(codec)
    sizer = tp.Sizer(c)
    packet = lambda m: c.compress(torch.zeros(m, dtype=torch.bfloat16)).nbytes
    assert sizer.packet((10,), torch.bfloat16) == packet(10)
    if codec == "none":
        assert (sizer.packet((10,), torch.bfloat16), sizer.packet((10,))) == (20, 40)

    def run(comm):
        psync = PSync(comm, c, transport="twophase")
        ts = [t.to(torch.bfloat16) for t in _inputs(comm.rank, 1)]
        return psync(ts, 1).bytes_sent

    slices = [packet(b - a) for a, b in tp.slice_bounds(sum(SIZES), n)]   # one bucket
    for rank, sent in enumerate(simulate(n, run)):
        assert sent == sum(s for j, s in enumerate(slices) if j != rank) + (n - 1) * slices[rank]
