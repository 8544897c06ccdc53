"""The hierarchical exchange (gradzip.exchange.hierarchy; spec "Hierarchical exchange"; issue 15,
item 3) and the group operations it needs (Group.split, Group.reduce_scatter)."""
import pytest
import torch

import gradzip
from gradzip.compressors import build
from gradzip.errors import GradzipError
from gradzip.exchange import PSync
from gradzip.exchange.hierarchy import HierarchicalPSync, check_workers_per_node, shard_bounds
from gradzip.comm.launch import run_processes

SHAPES = [(7, 3), (5,), (2,)]   # 21 elements (shards 11/10), 5 (3/2), 2 (1/1)


def _inputs(rank, shapes=SHAPES):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(s, generator=g) for s in shapes]


# ----------------------------------------------------------------------------- group operations


def test_split_and_reduce_scatter_on_threads():
    def work(comm):
        nodes = comm.split([[0, 1], [2, 3]])
        equal = comm.split([[0, 2], [1, 3]])
        x = torch.arange(6.0).reshape(2, 3) + 10 * comm.rank
        summed = nodes.reduce_scatter(x)
        mean = nodes.reduce_scatter(x, mean=True)
        gathered = equal.allgather(torch.tensor([float(comm.rank)]))
        return (nodes.rank, nodes.world_size, equal.rank, summed, mean, gathered.reshape(-1).tolist(),
                nodes.bytes_sent)

    out = gradzip.simulate(4, work)
    assert [(o[0], o[1], o[2]) for o in out] == [(0, 2, 0), (1, 2, 0), (0, 2, 1), (1, 2, 1)]
    # node 0 = ranks 0, 1: rows summed; worker l gets row l
    assert torch.equal(out[0][3], torch.tensor([10.0, 12.0, 14.0]))
    assert torch.equal(out[1][3], torch.tensor([16.0, 18.0, 20.0]))
    # node 1 = ranks 2, 3; rank 3 (local rank 1) gets the mean of row 1: ([23, 24, 25] + [33, 34, 35]) / 2
    assert torch.equal(out[3][4], torch.tensor([28.0, 29.0, 30.0]))
    assert [o[5] for o in out] == [[0.0, 2.0], [1.0, 3.0], [0.0, 2.0], [1.0, 3.0]]
    assert out[0][6] == 2 * (1 * 24 // 2)   # two reduce-scatters of 24 bytes among 2: 12 each


def reduce_scatter_worker(comm):
    """reduce_scatter of a (3, 1001) float32 tensor (sum and mean) and the bytes counted."""
    x = torch.randn(comm.world_size, 1001, generator=torch.Generator().manual_seed(comm.rank)) * 10 ** comm.rank
    before = comm.bytes_sent
    return comm.reduce_scatter(x), comm.reduce_scatter(x, mean=True), comm.bytes_sent - before


def test_gloo_reduce_scatter_sums_in_rank_order_and_sends_ring_bytes():
    """On gloo (3 processes) the rows a worker receives are summed in rank order, as the
    in-process group sums them: the same bits where three terms of different magnitude make
    the order matter; each worker sends (n-1)/n of the tensor (its other rows, once)."""
    real = run_processes(3, reduce_scatter_worker)
    threads = gradzip.simulate(3, reduce_scatter_worker)
    for (s1, m1, b1), (s2, m2, b2) in zip(real, threads):
        assert torch.equal(s1, s2) and torch.equal(m1, m2)
        assert b1 == b2 == 2 * (2 * 1001 * 4)


def test_bad_splits_and_shapes_are_refused():
    def work(comm):
        with pytest.raises(GradzipError, match="covering the group"):
            comm.split([[0], [0, 1]])
        with pytest.raises(GradzipError, match="shape \\(world_size=2"):
            comm.reduce_scatter(torch.zeros(3))
        return True

    assert gradzip.simulate(2, work) == [True, True]


def test_workers_per_node_is_checked():
    assert check_workers_per_node(None, 8) == 1 and check_workers_per_node(4, 8) == 4
    with pytest.raises(GradzipError, match="dividing the 6 workers"):
        check_workers_per_node(4, 6)
    assert shard_bounds(5, 2) == [(0, 3), (3, 5)] and shard_bounds(1, 2) == [(0, 1), (1, 1)]


# ----------------------------------------------------------------------------- the exchange


@pytest.mark.parametrize("codec", ["topk:ratio=0.4", "2bit:threshold=0.5", "randomk:ratio=0.5"])
def test_one_worker_per_node_is_psync(codec):
    """k = 1: the same aggregate and residual bits as PSync itself (same seeds)."""
    def work(comm):
        flat = PSync(comm, codec, seed=3)(_inputs(comm.rank), step=2)
        hier = HierarchicalPSync(comm, codec, workers_per_node=1, seed=3)(_inputs(comm.rank), step=2)
        return flat, hier

    for flat, hier in gradzip.simulate(4, work):
        for a, b in zip(flat.aggregate + flat.residual, hier.aggregate + hier.residual):
            assert torch.equal(a, b)
        assert hier.bytes_sent == flat.bytes_sent


def test_one_node_is_exact():
    """k = n: nothing is compressed; the aggregate is the mean, the residual 0."""
    def work(comm):
        return HierarchicalPSync(comm, "2bit:threshold=10", workers_per_node=4)(_inputs(comm.rank), step=1)

    out = gradzip.simulate(4, work)
    for t, _ in enumerate(SHAPES):
        total = _inputs(0)[t].clone()
        for r in (1, 2, 3):
            total += _inputs(r)[t]
        for res in out:
            assert torch.allclose(res.aggregate[t], total / 4, rtol=0, atol=1e-6)
            assert torch.equal(res.residual[t], torch.zeros(SHAPES[t]))


def _reference(codec_spec, n, k):
    """The spec's box written out by hand for a deterministic codec: node means, shard l
    compressed per node, mean of the decoded over nodes, residual k·ρ on the own shard."""
    codec = build(codec_spec)
    v = [_inputs(r) for r in range(n)]
    aggregate, residual = [], [[] for _ in range(n)]
    for t, shape in enumerate(SHAPES):
        d = v[0][t].numel()
        nodes = [(v[m * k][t].reshape(-1) + v[m * k + 1][t].reshape(-1)) / 2 for m in range(n // k)]
        full = torch.empty(d)
        rho = {}
        for ell, (lo, hi) in enumerate(shard_bounds(d, k)):
            decoded = []
            for m, u in enumerate(nodes):
                dec = codec.decompress(codec.compress(u[lo:hi].clone()))
                decoded.append(dec)
                rho[(m, ell)] = u[lo:hi] - dec
            full[lo:hi] = (decoded[0] + decoded[1]) / 2
        aggregate.append(full.view(shape))
        for r in range(n):
            m, ell = divmod(r, k)
            mine = torch.zeros(d)
            lo, hi = shard_bounds(d, k)[ell]
            mine[lo:hi] = k * rho[(m, ell)]
            residual[r].append(mine.view(shape))
    return aggregate, residual


@pytest.mark.parametrize("codec", ["topk:ratio=0.4", "scaled_sign"])
def test_two_nodes_of_two_against_the_box_by_hand(codec):
    """n = 4, k = 2 on threads against :func:`_reference`; the mean over a node's workers
    of their residuals is the node's error ρ (the residual rule)."""
    def work(comm):
        return HierarchicalPSync(comm, codec, workers_per_node=2)(_inputs(comm.rank), step=1)

    out = gradzip.simulate(4, work)
    aggregate, residual = _reference(codec, 4, 2)
    for r, res in enumerate(out):
        for t in range(len(SHAPES)):
            assert torch.allclose(res.aggregate[t], aggregate[t], rtol=0, atol=1e-6), (r, t)
            assert torch.allclose(res.residual[t], residual[r][t], rtol=0, atol=1e-6), (r, t)
    # bytes: fp32 reduce-scatter + allgather inside the node (rows of 15 / 13 padded to 15:
    # 60 bytes each, half sent), plus the PSync among 2 nodes
    assert all(res.bytes_sent > 60 for res in out)


def test_a_tracer_set_on_the_exchange_reaches_its_exchange_across_nodes():
    # one assignment traces both levels: the node's collectives (scope "node") and the
    # inner PSync's compress / communicate / decode among the nodes
    from gradzip.trace import Tracer

    def work(comm):
        hp = HierarchicalPSync(comm, "topk:ratio=0.4", workers_per_node=2)
        hp.tracer = Tracer(comm.rank)
        hp(_inputs(comm.rank), step=1)
        return hp.inner.tracer is hp.tracer, [(e["name"], e.get("args", {}).get("scope")) for e in hp.tracer.events]

    for same, spans in gradzip.simulate(4, work):
        assert same
        assert ("communicate", "node") in spans and ("compress", None) in spans and ("communicate", None) in spans


def test_fp16_inside_the_node_and_timings_and_counters():
    def work(comm):
        hp = HierarchicalPSync(comm, "topk:ratio=0.4", workers_per_node=2, intra="fp16")
        res = hp(_inputs(comm.rank), step=1)
        return res, hp.bytes_sent, hp.timings.communicate_s, hp.counters()

    for res, sent, comm_s, counters in gradzip.simulate(4, work):
        assert sent == res.bytes_sent and comm_s >= 0 and counters["bytes_sent"] == sent
    aggregate, _ = _reference("topk:ratio=0.4", 4, 2)
    assert torch.allclose(res.aggregate[0], aggregate[0], atol=5e-3)
    with pytest.raises(GradzipError, match="fp32 or fp16"):
        gradzip.simulate(2, lambda c: HierarchicalPSync(c, "none", workers_per_node=1, intra="bf8"))


def hier_worker(comm, codec):
    out = []
    for k in (1, 2):   # two processes: across "nodes" (k = 1) and inside one node (k = 2)
        res = HierarchicalPSync(comm, codec, workers_per_node=k)(_inputs(comm.rank), step=1)
        out.append(([a.clone() for a in res.aggregate], [r.clone() for r in res.residual], res.bytes_sent))
    return out


def test_real_gloo_groups_give_the_threads_bits():
    """Two gloo processes (TorchGroup: new process groups, reduce_scatter_tensor) give
    the bits and bytes of the in-process group (sums of two terms: no order to differ).
    fp16 across: no compiled kernel to wait for in fresh processes."""
    codec = "fp16"
    real = run_processes(2, hier_worker, codec)
    threads = gradzip.simulate(2, lambda c: hier_worker(c, codec))
    for rank_real, rank_threads in zip(real, threads):
        for (a1, r1, b1), (a2, r2, b2) in zip(rank_real, rank_threads):
            assert b1 == b2 > 0
            for x, y in zip(a1 + r1, a2 + r2):
                assert torch.equal(x, y)


# ----------------------------------------------------------------------------- the methods' option


def _one_step(comm, method, **options):
    g = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    for p, grad in zip(params, _inputs(comm.rank)):
        p.grad = grad
    opt = method(params, lr=0.5, comm=comm, **options)
    opt.step()
    return [p.detach().clone() for p in params], opt


def test_methods_take_hierarchy_through_the_common_options():
    """EF-SGD with hierarchy=4 on 4 workers (one node) is S-SGD (exact mean, no error
    left); hierarchy=2 uses HierarchicalPSync and agrees with its aggregate; hierarchy=1
    is the flat exchange, bit for bit; a k that does not divide n is one error."""
    def work(comm):
        one_node, opt1 = _one_step(comm, gradzip.optim.EFSGD, compressor="topk:ratio=0.2", hierarchy=4)
        plain, _ = _one_step(comm, gradzip.optim.SSGD)
        flat, _ = _one_step(comm, gradzip.optim.EFSGD, compressor="topk:ratio=0.2")
        k1, _ = _one_step(comm, gradzip.optim.EFSGD, compressor="topk:ratio=0.2", hierarchy=1)
        two, opt2 = _one_step(comm, gradzip.optim.EFSGD, compressor="topk:ratio=0.2", hierarchy=2)
        return one_node, plain, flat, k1, two, type(opt2.psync).__name__, opt2.describe()["hierarchy"]

    for one_node, plain, flat, k1, two, kind, described in gradzip.simulate(4, work):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(one_node, plain))
        assert all(torch.equal(a, b) for a, b in zip(flat, k1))
        assert kind == "HierarchicalPSync" and described == 2
    g = torch.Generator().manual_seed(7)
    start = [torch.randn(s, generator=g) for s in SHAPES]
    aggregate, _ = _reference("topk:ratio=0.2", 4, 2)
    for p0, a, p in zip(start, aggregate, two):
        assert torch.allclose(p, p0 - 0.5 * a, atol=1e-6)
    with pytest.raises(GradzipError, match="EFSGD: hierarchy: .*dividing the 4 workers, got 3"):
        gradzip.simulate(4, lambda c: _one_step(c, gradzip.optim.EFSGD, hierarchy=3))


def test_cli_refuses_a_node_size_that_does_not_divide_the_workers(capsys):
    from gradzip.cli import main

    assert main(["train", "--algo", "ssgd", "--workers", "4", "--workers-per-node", "3", "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "dividing the 4 workers, got 3" in err, err


# ----------------------------------------------------------------------------- the emulator's nodes


def _emulator_available():
    from gradzip.bench import netns

    try:
        netns.check_available()
    except GradzipError:
        return False
    return True


@pytest.mark.skipif(not _emulator_available(), reason="network namespaces and tc need root (and ip / tc)")
def test_emulated_nodes_share_one_shaped_uplink():
    """4 workers, 2 per node: worker links unshaped into the node's bridge, one tbf-shaped
    uplink per node (both ends); workers of different nodes reach each other through it."""
    import subprocess
    import sys

    from gradzip.bench import netns

    def qdisc(ns, dev):
        return subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout

    with netns.Topology(4, 1e9, workers_per_node=2) as topo:
        names = [n for n in netns.list_namespaces() if n.startswith(topo.prefix)]
        assert sorted(names) == sorted([topo.switch, topo.node(0), topo.node(1)] + [topo.worker(r) for r in range(4)])
        for m in range(2):
            assert "rate 1Gbit" in qdisc(topo.node(m), "up0") and "rate 1Gbit" in qdisc(topo.switch, f"u{m}")
        for r in range(4):
            assert "tbf" not in qdisc(topo.worker(r), netns.IFNAME)
        server = subprocess.Popen(topo.exec_prefix(3) + [sys.executable, "-c", (
            "import socket; s = socket.create_server(('%s', 29600)); c, _ = s.accept(); c.sendall(b'node1')"
            % netns.address(3))], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        client = ("import socket, time\nfor _ in range(100):\n    try:\n        c = socket.create_connection(('%s', 29600), 2); break\n"
                  "    except OSError: time.sleep(0.1)\nprint(c.recv(5).decode())" % netns.address(3))
        got = subprocess.run(topo.exec_prefix(0) + [sys.executable, "-c", client], capture_output=True, text=True,
                             timeout=60)
        server.wait(timeout=60)
        assert got.stdout.strip() == "node1", got.stderr
    assert topo.leftovers() == []
    with pytest.raises(GradzipError, match="dividing the 4 workers"):
        netns.Topology(4, 1e9, workers_per_node=3)
