"""DGC: the ``dgc`` codec's sampled-threshold top-k and the DGC method's box (spec, "Methods: DGC")."""
import math

import pytest
import torch

import gradzip
from gradzip.compressors import build
from gradzip.compressors.dgc import sampled_threshold_select, selected_indices
from gradzip.errors import GradzipError
from gradzip.exchange import PSync
from gradzip.optim import DGC

import cases


def test_registered_after_randblock():
    assert gradzip.compressors.names()[-5:-2] == ["randblock", "dgc", "powersgd"]
    assert build("dgc:ratio=0.01,sample_ratio=0.05").spec == "dgc:ratio=0.01,sample_ratio=0.05"


@pytest.mark.parametrize("dist", ["normal", "heavy", "sparse"])
@pytest.mark.parametrize("numel,ratio", [(100_000, 0.001), (300_000, 0.01), (50_000, 0.05), (2000, 0.01)])
def test_selection_lands_in_band_and_keeps_the_largest(dist, numel, ratio):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g)
    if dist == "heavy":
        x = x ** 3
    elif dist == "sparse":
        x = x * (torch.rand(numel, generator=g) < 0.3)
    k = max(1, math.ceil(ratio * numel))
    stats = {}
    idx = sampled_threshold_select(x, k, 0.01, seed=3, stats=stats)
    assert 0.8 * k <= idx.numel() <= 1.3 * k
    assert idx.unique().numel() == idx.numel()
    chosen = torch.zeros(numel, dtype=torch.bool)
    chosen[idx] = True
    # a threshold selection: nothing left out is larger than anything taken
    assert x[~chosen].abs().max() <= x[chosen].abs().min()
    if numel >= 50_000 and dist != "sparse":
        assert not stats["exact"]   # the sampled path, not the fallback

    codec = build(f"dgc:ratio={ratio}")
    packet = codec.compress(x.view(-1, 10), seed=3)
    index = cases.sparse_index_dtype(numel)
    assert packet.wire["indices"].dtype == index
    assert packet.nbytes == (4 + index.itemsize) * k == codec.wire_nbytes((numel // 10, 10))
    sel = selected_indices(packet)
    assert 0.8 * k <= sel.numel() <= k
    dense = codec.decompress(packet).view(-1)
    assert torch.equal(dense[sel], x[sel]) and int((dense != 0).sum()) <= sel.numel()


def test_all_equal_magnitudes_fall_back_to_exact_topk():
    x = torch.ones(10_000)
    idx = sampled_threshold_select(x, 10, 0.01)
    assert idx.numel() == 10


def test_codec_goes_through_allgather_and_averages():
    def fn(comm):
        g = torch.Generator().manual_seed(comm.rank)
        t = torch.randn(200, 50, generator=g)
        psync = PSync(comm, "dgc:ratio=0.01")
        assert psync.routes([t]) == ["allgather"]
        res = psync([t], step=1)
        return t, res.aggregate[0], res.residual[0]
    outs = gradzip.simulate(3, fn)
    sent = sum(t - r for t, _, r in outs) / 3
    for _, agg, _ in outs:
        torch.testing.assert_close(agg, sent, rtol=1e-6, atol=1e-7)


def test_bad_options():
    with pytest.raises(GradzipError, match=r"ratio must be in \(0, 1\]"):
        build("dgc:ratio=0")
    with pytest.raises(GradzipError, match="sample_ratio"):
        build("dgc:sample_ratio=2")
    p = [torch.nn.Parameter(torch.zeros(3, 3))]
    for kwargs, msg in [(dict(ratio=1.5), "ratio must be in"), (dict(warmup_steps=-1), "warmup_steps"),
                        (dict(clip_norm=-1.0), "clip_norm"), (dict(nesterov=True, momentum=0.9), "nesterov"),
                        (dict(lr_warmup_steps=1.5), "lr_warmup_steps")]:
        with pytest.raises(GradzipError, match=msg):
            DGC(p, 0.1, **kwargs)


def test_density_one_equals_momentum_ssgd():
    opts = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
    ssgd = cases.simulate_method(3, "ssgd", opts, steps=8)
    cases.assert_same_runs(cases.simulate_method(3, "dgc", dict(opts, ratio=1.0), steps=8), ssgd, atol=1e-7)
    # and the box itself at density 1 would not be (momentum lost): the limit is not trivial
    low = cases.simulate_method(3, "dgc", dict(opts, ratio=0.99), steps=8)
    assert max((a - b).abs().max().item() for a, b in zip(low[0], ssgd[0])) > 1e-3


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.Tanh(), torch.nn.Linear(60, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 40, generator=g), torch.randn(8, 3, generator=g)


def test_box_momentum_correction_and_factor_masking():
    """Step by step on 2 workers: u, v, the factor masking and the update follow the box."""
    lr, m, wd = 0.05, 0.9, 0.01

    def fn(comm):
        model = _model()
        opt = DGC(model.parameters(), lr, comm=comm, momentum=m, weight_decay=wd, ratio=0.05)
        log = []
        for t in range(1, 5):
            x, y = _batch(t, comm.rank)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            before = {p: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in model.parameters()}
            grads = {p: p.grad.clone() for p in model.parameters()}
            opt.step()
            log.append([(before[p], grads[p], p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
                        for p in model.parameters()])
        return log, opt.metrics()

    outs = gradzip.simulate(2, fn)
    for t in range(4):
        for i in (0, 2):   # the weight matrices (sparsified)
            sent = []
            for log, _ in outs:
                (x0, st0), g, x1, st1 = log[t][i]
                u0 = st0.get("u", torch.zeros_like(g))
                v0 = st0.get("v", torch.zeros_like(g))
                u1 = m * u0 + g
                v1 = v0 + u1
                sel = (st1["v"] == 0) & (v1 != 0)
                k = math.ceil(0.05 * g.numel())
                assert 0.8 * k <= int(sel.sum()) <= k
                # factor masking zeroes exactly the sent coordinates, in u and in v
                assert torch.equal(st1["u"], torch.where(sel, torch.zeros_like(u1), u1))
                assert torch.equal(st1["v"], torch.where(sel, torch.zeros_like(v1), v1))
                # what was sent: the top of |v1|
                assert v1[~sel].abs().max() <= v1[sel].abs().min()
                sent.append(torch.where(sel, v1, torch.zeros_like(v1)))
            G = (sent[0] + sent[1]) / 2
            for log, _ in outs:
                (x0, _), _, x1, _ = log[t][i]
                torch.testing.assert_close(x1, x0 - lr * (G + wd * x0), rtol=1e-6, atol=1e-7)
        for log0, log1 in zip(outs[0][0][t], outs[1][0][t]):   # replicas identical
            assert torch.equal(log0[2], log1[2])
    metrics = outs[0][1]
    assert metrics["dgc_target_density"] == 0.05
    assert 0.8 <= metrics["dgc_density"] / 0.05 <= 1.3


def test_vectors_go_dense_with_momentum_after_the_reduction():
    lr, m = 0.1, 0.9

    def fn(comm):
        model = _model()
        opt = DGC(model.parameters(), lr, comm=comm, momentum=m, ratio=0.01)
        biases = []
        for t in range(1, 4):
            x, y = _batch(t, comm.rank)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            biases.append([model[0].bias.grad.clone(), model[0].bias.detach().clone()])
            opt.step()
        return biases, model[0].bias.detach().clone()

    outs = gradzip.simulate(2, fn)
    x = outs[0][0][0][1]
    buf = None
    for t in range(3):
        g = (outs[0][0][t][0] + outs[1][0][t][0]) / 2
        buf = g if buf is None else m * buf + g
        x = x - lr * buf
    torch.testing.assert_close(outs[0][1], x, rtol=1e-6, atol=1e-7)


def test_warmup_schedules():
    p = [torch.nn.Parameter(torch.zeros(2, 2))]
    opt = DGC(p, 0.1, warmup_steps=8, lr_warmup_steps=4)
    assert [opt.density(t) for t in range(1, 11)] == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625,
                                                     0.00390625, 0.00390625, 0.001, 0.001]
    assert [opt.lr_scale(t) for t in (1, 2, 4, 9)] == [0.25, 0.5, 1.0, 1.0]
    assert DGC(p, 0.1, ratio=0.1, warmup_steps=4).density(4) == 0.1   # never below the target
    assert DGC(p, 0.1).density(1) == 0.001


def test_local_clipping_scaled_by_inverse_sqrt_n():
    """At density 1 (dense path) with momentum 0: x ← x − η·mean_j clip(g_j, c/√n)."""
    lr, c, n = 0.1, 0.05, 4

    def fn(comm):
        model = _model()
        x0 = [p.detach().clone() for p in model.parameters()]
        opt = DGC(model.parameters(), lr, comm=comm, ratio=1.0, clip_norm=c)
        x, y = _batch(1, comm.rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        return x0, grads, [p.detach().clone() for p in model.parameters()]

    outs = gradzip.simulate(n, fn)
    clipped = []
    for _, grads, _ in outs:
        norm = torch.linalg.vector_norm(torch.cat([g.view(-1) for g in grads]))
        assert norm > c / math.sqrt(n)    # the clipping is active
        clipped.append([g * (c / math.sqrt(n)) / (norm + 1e-6) for g in grads])
    for i, x0 in enumerate(outs[0][0]):
        mean = sum(cl[i] for cl in clipped) / n
        torch.testing.assert_close(outs[0][2][i], x0 - lr * mean, rtol=1e-5, atol=1e-7)


def test_state_dict_resume_is_exact_and_ratio_is_large():
    def run(comm, split):
        model = _model()
        opt = DGC(model.parameters(), 0.05, comm=comm, momentum=0.9, ratio=0.01, warmup_steps=4)
        for t in range(1, 9):
            if split == t:
                state = opt.state_dict()
                model2 = _model(1)
                model2.load_state_dict(model.state_dict())
                model = model2
                opt = DGC(model.parameters(), 0.05, comm=comm, momentum=0.9, ratio=0.01, warmup_steps=4)
                opt.load_state_dict(state)
            x, y = _batch(t, comm.rank)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()], opt.metrics(), opt.compression_ratio

    straight = gradzip.simulate(2, lambda c: run(c, None))
    resumed = gradzip.simulate(2, lambda c: run(c, 5))
    for a, b in zip(straight[0][0], resumed[0][0]):
        assert torch.equal(a, b)
    assert straight[0][1]["dgc_density_mean"] == resumed[0][1]["dgc_density_mean"]
    assert straight[0][2] > 5   # 2.4k weights at ≤25% density + dense biases
