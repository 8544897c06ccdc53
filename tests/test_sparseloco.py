"""SparseLoCo (gradzip.optim.sparseloco) against docs/algorithms.md §SparseLoCo: a
hand-written reference of the box (top-k + 2-bit values, decayed error feedback, outer SGD
without momentum), the local-SGD limit, exact resume, option errors, the registry form and
the CLI; and the box's codec ``topk2bit`` by hand."""
from __future__ import annotations

import json

import pytest
import torch

import cases
import gradzip
from gradzip import cli
from gradzip.compressors import build
from gradzip.errors import GradzipError
from gradzip.optim import SSGD, LocalSGD, SparseLoCo, SparseLoCoMethod


def loss_of(model, t, rank, n):
    x, y = cases.regression_batch(t, rank, n)
    return torch.nn.functional.mse_loss(model(x), y)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def run(comm, steps, inner=adamw, **options):
    model = cases.tiny_model()
    opt = SparseLoCo(inner(list(model.parameters())), comm=comm, **options)
    for t in range(1, steps + 1):
        opt.zero_grad()
        loss_of(model, t, comm.rank, comm.world_size).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def two_bit(v, ratio):
    """The box's C = Q ∘ TopK written out (docs/algorithms.md §codec: topk2bit)."""
    flat = v.reshape(-1)
    k = max(1, -(-int(ratio * 10**9) * flat.numel() // 10**9))   # ceil(ρd) without float surprises
    k = min(k, flat.numel())
    order = sorted(range(flat.numel()), key=lambda j: (-abs(flat[j].item()), j))[:k]
    w = flat[order]
    tau, top = w.abs().min(), w.abs().max()
    r = top - tau
    lo, hi, mid = tau + 0.25 * r, tau + 0.75 * r, tau + 0.5 * r
    out = torch.zeros_like(flat)
    for j, x in zip(order, w):
        out[j] = (hi if x.abs() >= mid else lo) * (-1 if x < 0 else 1)
    return out.view(v.shape)


def reference(n, steps, inner=adamw, *, H, ratio=0.02, quantizer="2bit", outer_lr=1.0, error_decay=0.95):
    """The box for ``n`` workers in one thread: per worker an inner optimizer and error
    memory; θ̂ shared; every H steps v_i = β e_i + (θ̂ − x_i), s_i = C(v_i), e_i = v_i − s_i,
    θ̂ ← θ̂ − α mean_i s_i, x_i ← θ̂."""
    models = [cases.tiny_model() for _ in range(n)]
    params = [list(m.parameters()) for m in models]
    inners = [inner(ps) for ps in params]
    theta = [p.detach().clone() for p in params[0]]
    err = [[torch.zeros_like(p) for p in params[0]] for _ in range(n)]
    codec = (lambda v: two_bit(v, ratio)) if quantizer == "2bit" else (
        lambda v: build(f"topk:ratio={ratio}").decompress(build(f"topk:ratio={ratio}").compress(v)))
    for t in range(1, steps + 1):
        for i in range(n):
            inners[i].zero_grad()
            loss_of(models[i], t, i, n).backward()
            inners[i].step()
        if t % H:
            continue
        with torch.no_grad():
            for k in range(len(theta)):
                sent = []
                for i in range(n):
                    v = error_decay * err[i][k] + (theta[k] - params[i][k])
                    s = codec(v)
                    err[i][k] = v - s
                    sent.append(s)
                theta[k] = theta[k] - outer_lr * (sum(sent) / n)
                for i in range(n):
                    params[i][k].copy_(theta[k])
    return [[p.detach().clone() for p in ps] for ps in params]


BOXES = {
    "2bit-defaults": (adamw, dict(H=3, ratio=0.3)),
    "2bit-sgd-alpha-beta": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), dict(H=2, ratio=0.5, outer_lr=0.7,
                                                                                     error_decay=0.5)),
    "topk-no-quantizer": (adamw, dict(H=4, ratio=0.3, quantizer="none", error_decay=1.0)),
}


@pytest.mark.parametrize("name", sorted(BOXES))
def test_matches_a_hand_written_reference_of_the_box(name):
    inner, options = BOXES[name]
    ratio = options.pop("ratio")
    steps = 11   # ends mid-period
    got = gradzip.simulate(2, lambda comm: run(comm, steps, inner, compressor=f"topk:ratio={ratio}", **options))
    want = reference(2, steps, inner, ratio=ratio, **options)
    for rank in range(2):
        for a, e in zip(got[rank], want[rank]):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} rank {rank}: {m}")


def test_ratio_one_without_quantizer_and_alpha_one_is_local_sgd():
    def both(comm):
        sparse = run(comm, 9, lambda ps: torch.optim.SGD(ps, lr=0.05), H=4, compressor="topk:ratio=1",
                     quantizer="none")
        return sparse, cases.trained_parameters(comm, lambda m: LocalSGD(m.parameters(), lr=0.05, comm=comm, H=4), 9)

    for sparse, local in gradzip.simulate(2, both):
        for a, b in zip(sparse, local):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_error_memory_is_what_the_codec_left_and_the_replicas_agree_after_a_sync():
    def worker(comm):
        model = cases.tiny_model()
        opt = SparseLoCo(adamw(list(model.parameters())), comm=comm, H=2, compressor="topk:ratio=0.25")
        for t in range(1, 3):
            opt.zero_grad()
            loss_of(model, t, comm.rank, comm.world_size).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()], [opt.state[p]["residual"] for p in model.parameters()]

    (p0, e0), (p1, e1) = gradzip.simulate(2, worker)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))         # x_i ← θ̂ on every worker
    assert any(not torch.equal(a, b) for a, b in zip(e0, e1))     # e_i is each worker's own
    for e in e0:   # top-k leaves at least d − k entries behind whole (the sent k keep their quantisation error)
        assert int((e != 0).sum()) >= e.numel() - -(-e.numel() // 4)


def _resumable(comm, steps, saved=None):
    return cases.train_resumable(
        comm, lambda m: SparseLoCo(adamw(list(m.parameters())), comm=comm, H=3, compressor="topk:ratio=0.3"), steps, saved)


def test_resume_mid_period_is_bit_identical():
    def worker(comm):
        whole = _resumable(comm, 10)
        half = _resumable(comm, 5)
        return whole, _resumable(comm, 10, saved=half)

    for whole, resumed in gradzip.simulate(2, worker):
        cases.assert_bitwise_equal(whole, resumed, "resumed SparseLoCo")


@pytest.mark.parametrize("options, names", [
    (dict(H=4, error_decay=1.5), "error_decay"), (dict(H=4, quantizer="3bit"), "quantizer must be one of 2bit, none"),
    (dict(H=4, compressor="randomk:ratio=0.1"), "compressor must be a topk spec"), (dict(H=0), "H"),
    (dict(H=4, outer_lr=-1.0), "outer_lr"), (dict(H=4, fragments=2), "fragments"),
])
def test_bad_options_raise_one_line_gradzip_errors_naming_them(options, names):
    model = cases.tiny_model()
    with pytest.raises(GradzipError, match=names):
        SparseLoCo(adamw(list(model.parameters())), **options)


def test_registry_form_and_what_it_describes():
    ps = list(cases.tiny_model().parameters())
    opt = gradzip.optim.METHODS["sparseloco"](ps, lr=0.1, inner_lr=0.003, H=4, error_decay=0.9)
    assert isinstance(opt.inner, torch.optim.AdamW) and opt.inner.param_groups[0]["lr"] == 0.003
    group = opt.param_groups[0]
    assert group["lr"] == 1.0 and group["momentum"] == 0.0 and not group["nesterov"]
    described = opt.describe()
    assert described["exchange 0 codec"] == "topk2bit:ratio=0.02" and described["error_decay"] == 0.9
    assert SparseLoCoMethod(ps, lr=0.1, quantizer="none").describe()["exchange 0 codec"] == "topk:ratio=0.02"
    with pytest.raises(GradzipError, match="not a gradzip method"):
        SparseLoCo(SSGD(ps, lr=0.1), H=4)


def test_cli_trains_sparseloco(tmp_path, capsys):
    code = cli.main(["train", "--algo", "sparseloco", "--inner", "sgd", "--inner-lr", "0.1", "--H", "4",
                     "--compressor", "topk:ratio=0.1", "--error-decay", "0.9", "--workers", "2", "--backend",
                     "threads", "--epochs", "2", "--quiet", "--no-plot", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    run = json.loads((tmp_path / "summary.json").read_text())
    assert run["method"] == "sparseloco" and run["H"] == 4 and run["final_test_accuracy"] > 0.3  # chance: 0.1
    syncs = run["steps"] // 4
    assert 0 < run["bytes_sent_per_worker"] < syncs * run["parameters"] * 4 / 10   # < a tenth of float32 pseudo-gradients


# -- the codec ---------------------------------------------------------------------------------
def test_topk2bit_sends_signs_and_one_magnitude_bit_of_the_top_k():
    c = build("topk2bit:ratio=0.5")
    v = torch.tensor([0.1, -4.0, 3.0, -0.2, 1.0, 2.0, 0.0, -1.5])
    p = c.compress(v)
    # top 4: -4 (idx 1), 3 (2), 2 (5), -1.5 (7); τ = 1.5, M = 4, lo = 2.125, hi = 3.375, mid = 2.75
    assert p.wire["indices"].tolist() == [1, 2, 5, 7] and p.wire["indices"].dtype == torch.uint8
    assert p.wire["bounds"].tolist() == [1.5, 4.0]
    assert p.wire["codes"].tolist() == [0b11_01_00_10]      # codes 3 (−hi), 1 (+hi), 0 (+lo), 2 (−lo)
    assert c.decompress(p).tolist() == [0, -3.375, 3.375, 0, 0, 2.125, 0, -2.125]
    assert p.nbytes == 4 + 1 + 8
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    q = c.compress(x)
    kept = c.decompress(q) != 0
    r = q.wire["bounds"][1] - q.wire["bounds"][0]
    assert int(kept.sum()) == 2500 and bool(((c.decompress(q) - x)[kept].abs() <= r / 4 + 1e-6).all())
    assert q.nbytes == 2500 * 2 + 625 + 8
