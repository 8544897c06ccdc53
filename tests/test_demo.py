"""DeMo (gradzip.optim.demo) and its codec ``dct`` against docs/algorithms.md §DeMo and
§codec: dct: the chunked DCT against scipy's, the per-chunk top-k and the senders' mean by
hand, a hand-written reference of the box, exact resume, option errors and the CLI."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy import fft

import cases
import gradzip
from gradzip import cli
from gradzip.compressors import build
from gradzip.compressors.dct import chunk_size
from gradzip.errors import GradzipError
from gradzip.optim import DeMo


# -- the codec ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n, target, want", [(65, 64, 13), (100, 64, 50), (192, 64, 64), (7, 64, 7), (64, 64, 64),
                                             (97, 8, 1)])
def test_chunk_is_the_largest_divisor_at_most_the_target(n, target, want):
    assert chunk_size(n, target) == want


def _by_hand(x: np.ndarray, c1: int, c2: int, k: int):
    """Per chunk (row-major grid) the orthonormal 2-D DCT (scipy) and its k largest
    coefficients (ties to the smaller index), ascending."""
    rows, cols = x.shape
    out = []
    for i in range(rows // c1):
        for j in range(cols // c2):
            y = fft.dctn(x[i * c1:(i + 1) * c1, j * c2:(j + 1) * c2].astype(np.float64), norm="ortho").reshape(-1)
            order = sorted(range(y.size), key=lambda u: (-abs(y[u]), u))[:k]
            out.append((sorted(order), y))
    return out


def test_dct_keeps_each_chunks_largest_coefficients_and_decodes_by_the_inverse():
    c = build("dct:chunk=4,topk=3")
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))   # chunks 4 x 3 (6's divisor <= 4)
    p = c.compress(x)
    hand = _by_hand(x.numpy(), 4, 3, 3)
    idx = p.wire["indices"].view(4, 3).tolist()
    values = p.wire["values"].view(4, 3)
    assert p.wire["indices"].dtype == torch.uint8 and p.nbytes == 4 * 3 * (4 + 1)
    dense = np.zeros((8, 6))
    for chunk, ((order, y), got) in enumerate(zip(hand, idx)):
        assert got == order
        np.testing.assert_allclose(values[chunk].numpy(), y[order], rtol=1e-5, atol=1e-6)
        kept = np.zeros(12)
        kept[order] = y[order]
        i, j = divmod(chunk, 2)
        dense[i * 4:(i + 1) * 4, j * 3:(j + 1) * 3] = fft.idctn(kept.reshape(4, 3), norm="ortho")
    np.testing.assert_allclose(c.decompress(p).numpy(), dense, rtol=1e-5, atol=1e-6)
    every = build("dct:chunk=4,topk=12")   # every coefficient kept: the identity, to float32
    torch.testing.assert_close(every.decompress(every.compress(x)), x, rtol=1e-5, atol=1e-5)


def test_dct_views_vectors_as_one_row_and_higher_tensors_as_matrices():
    c = build("dct:chunk=4,topk=2")
    v = torch.randn(12, generator=torch.Generator().manual_seed(1))
    assert c.compress(v).wire["values"].numel() == 3 * 2       # 1 x 12: three chunks of 4
    t = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(c.decompress(c.compress(t)), c.decompress(c.compress(t.reshape(4, 6))).view(4, 2, 3))


def test_dct_aggregate_is_the_mean_over_the_workers_that_sent_a_coefficient():
    c = build("dct:chunk=4,topk=1")
    a, b = torch.full((4,), 2.0), torch.full((4,), 1.0)   # only the DC coefficient: 4 and 2
    pa, pb = c.compress(a), c.compress(b)
    assert pa.wire["indices"].tolist() == pb.wire["indices"].tolist() == [0]
    torch.testing.assert_close(c.aggregate([pa, pb]), torch.full((4,), 1.5))   # DC 3 -> 3/2 per entry
    one = torch.tensor([1.0, -1.0, -1.0, 1.0])   # only the coefficient u = 2: a different index
    pc = c.compress(one)
    assert pc.wire["indices"].tolist() == [2]
    mean = c.aggregate([pa, pc])   # two coefficients, each sent by one worker: each arrives whole
    torch.testing.assert_close(mean, c.decompress(pa) + c.decompress(pc))


@pytest.mark.parametrize("spec, needle", [("dct:chunk=0", "chunk must be"), ("dct:topk=0", "topk must be"),
                                          ("dct:chunk=2000", "chunk must be")])
def test_dct_bad_parameters(spec, needle):
    with pytest.raises(GradzipError, match=needle):
        build(spec)


# -- the method ----------------------------------------------------------------------------------
def loss_of(model, t, rank, n):
    x, y = cases.regression_batch(t, rank, n)
    return torch.nn.functional.mse_loss(model(x), y)


def run(comm, steps, lr=0.01, **options):
    model = cases.tiny_model()
    opt = DeMo(model.parameters(), lr, comm=comm, **options)
    for t in range(1, steps + 1):
        opt.zero_grad()
        loss_of(model, t, comm.rank, comm.world_size).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def reference(n, steps, lr=0.01, compressor="dct:chunk=64,topk=32", compression_decay=0.999, weight_decay=0.0):
    """The box for ``n`` workers in one thread (the codec's own compress / decompress /
    aggregate, tested above): δ_i ← β δ_i + η g_i; q_i = C(δ_i); δ_i ← δ_i − q_i;
    x ← x(1 − ηλ) − η sign(agg_j C(δ_j))."""
    codec = build(compressor)
    models = [cases.tiny_model() for _ in range(n)]
    params = [list(m.parameters()) for m in models]
    delta = [[torch.zeros_like(p) for p in params[0]] for _ in range(n)]
    for t in range(1, steps + 1):
        for i in range(n):
            for p in params[i]:
                p.grad = None
            loss_of(models[i], t, i, n).backward()
        with torch.no_grad():
            for k in range(len(params[0])):
                packets = []
                for i in range(n):
                    delta[i][k].mul_(compression_decay).add_(params[i][k].grad, alpha=lr)
                    packets.append(codec.compress(delta[i][k]))
                    delta[i][k] = delta[i][k] - codec.decompress(packets[-1])
                q = codec.aggregate(packets)
                for i in range(n):
                    if weight_decay:
                        params[i][k].mul_(1.0 - lr * weight_decay)
                    params[i][k].add_(torch.sign(q), alpha=-lr)
    return [[p.detach().clone() for p in ps] for ps in params]


BOXES = {"defaults": {}, "small-chunks-decay": dict(compressor="dct:chunk=2,topk=1", compression_decay=0.9,
                                                      weight_decay=0.1),
         "topk-codec": dict(compressor="topk:ratio=0.3")}


@pytest.mark.parametrize("name", sorted(BOXES))
def test_matches_a_hand_written_reference_of_the_box(name):
    options = BOXES[name]
    got = gradzip.simulate(3, lambda comm: run(comm, 7, **options))
    want = reference(3, 7, **options)
    for rank in range(3):
        for a, e in zip(got[rank], want[rank]):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} rank {rank}: {m}")
    assert all(torch.equal(a, b) for a, b in zip(got[0], got[2]))   # one sign step everywhere


def test_resume_is_bit_identical():
    def resumable(comm, steps, saved=None):
        return cases.train_resumable(
            comm, lambda m: DeMo(m.parameters(), 0.01, comm=comm, compressor="dct:chunk=2,topk=1"), steps, saved)

    def worker(comm):
        return resumable(comm, 8), resumable(comm, 8, saved=resumable(comm, 3))

    for whole, resumed in gradzip.simulate(2, worker):
        cases.assert_bitwise_equal(whole, resumed, "resumed DeMo")


@pytest.mark.parametrize("options, needle", [(dict(momentum=0.9), "compression_decay"),
                                             (dict(compression_decay=1.0), "compression_decay"),
                                             (dict(transport="twophase"), "twophase"),
                                             (dict(compressor="dct:topk=0"), "topk must be")])
def test_bad_options_are_one_line_errors(options, needle):
    with pytest.raises(GradzipError, match=needle):
        DeMo(cases.tiny_model().parameters(), 0.01, **options)


def test_cli_trains_demo(tmp_path, capsys):
    code = cli.main(["train", "--algo", "demo", "--compressor", "dct:chunk=8,topk=8", "--lr", "0.003",
                     "--workers", "2", "--backend", "threads", "--epochs", "2", "--quiet", "--no-plot",
                     "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    run_ = json.loads((tmp_path / "summary.json").read_text())
    assert run_["method"] == "demo" and run_["final_test_accuracy"] > 0.3   # chance: 0.1
    dense = 4 * run_["parameters"] * run_["steps"]
    assert 0 < run_["bytes_sent_per_worker"] < dense / 4
