"""DiLoCo and streaming DiLoCo (gradzip.optim.diloco) against the spec's boxes
(docs/diloco.md, §Streaming DiLoCo): the S-SGD limit, a hand-written
reference of the box (with a codec, with fragments, delay and mixing), the streaming
properties the spec lists, exact resume with an exchange in flight, option errors, the CLI."""
from __future__ import annotations

import json

import pytest
import torch

import cases
import gradzip
from gradzip import cli
from gradzip.compressors import build
from gradzip.errors import GradzipError
from gradzip.seeds import exchange_seed, mix
from gradzip.optim import SSGD, DiLoCo, DiLoCoMethod, LocalSGD


def loss_of(model, t, rank, n):
    x, y = cases.regression_batch(t, rank, n)
    return torch.nn.functional.mse_loss(model(x), y)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def sgd_momentum(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True)


def run_diloco(comm, steps, inner=adamw, *, record=None, **options):
    """``steps`` steps of DiLoCo on the tiny regression task; final parameters. ``record``:
    a list that gets ``(params, globals)`` after every step."""
    model = cases.tiny_model()
    opt = DiLoCo(inner(list(model.parameters())), comm=comm, **options)
    for t in range(1, steps + 1):
        opt.zero_grad()
        loss_of(model, t, comm.rank, comm.world_size).backward()
        opt.step()
        if record is not None:
            record.append(([p.detach().clone() for p in model.parameters()],
                           [opt.state[p]["global"].clone() for p in model.parameters()]))
    return [p.detach().clone() for p in model.parameters()]


def reference(n, steps, inner=adamw, *, H, outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True,
              compressor="none", fragments=1, delay=0, alpha=0.0):
    """The spec's streaming box written out for ``n`` workers in one thread: per worker an
    inner optimizer; per fragment θ̂, an outer SGD (torch semantics) and, for a biased
    codec, the error memory; the aggregate is the mean of the decoded packets."""
    models = [cases.tiny_model() for _ in range(n)]
    params = [list(m.parameters()) for m in models]
    inners = [inner(ps) for ps in params]
    K = len(params[0])
    frag = [list(range(f, K, fragments)) for f in range(fragments)]
    theta = [p.detach().clone() for p in params[0]]
    buf = [None] * K
    codec = build(compressor)
    feedback = not codec.unbiased and codec.name != "none"
    err = [[torch.zeros_like(p) for p in params[0]] for _ in range(n)]
    h, inflight = H // fragments, None
    for t in range(1, steps + 1):
        for i in range(n):
            inners[i].zero_grad()
            loss_of(models[i], t, i, n).backward()
            inners[i].step()
        with torch.no_grad():
            for f in range(fragments):
                if t % H == ((f + 1) * h - delay) % H:          # start: Δ_i = θ̂ − x_i (+ e_i)
                    inflight = {}
                    for k in frag[f]:
                        v = [theta[k] - params[i][k] + err[i][k] for i in range(n)]
                        seed = mix(exchange_seed(0), t, k)   # shared randomness: step t, tensor key k
                        c = [codec.decompress(codec.compress(v[i], seed)) for i in range(n)]
                        if feedback:
                            for i in range(n):
                                err[i][k] = v[i] - c[i]
                        inflight[k] = sum(c) / n
                if t % H == ((f + 1) * h) % H:                  # sync: outer SGD, then mix
                    for k in frag[f]:
                        d = inflight[k]
                        if outer_momentum:
                            buf[k] = d.clone() if buf[k] is None else buf[k] * outer_momentum + d
                            d = d + outer_momentum * buf[k] if outer_nesterov else buf[k]
                        theta[k] = theta[k] - outer_lr * d
                        for i in range(n):
                            params[i][k].copy_((1 - alpha) * theta[k] + alpha * params[i][k])
    return [[p.detach().clone() for p in ps] for ps in params]


def assert_close(actual, expected, what):
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def test_h1_outer_sgd_lr1_no_momentum_inner_sgd_is_ssgd():
    def both(comm):
        diloco = run_diloco(comm, 6, lambda ps: torch.optim.SGD(ps, lr=0.05), H=1, outer_lr=1.0,
                            outer_momentum=0.0, outer_nesterov=False)
        return diloco, cases.trained_parameters(comm, lambda m: SSGD(m.parameters(), lr=0.05, comm=comm), 6)

    for diloco, ssgd in gradzip.simulate(3, both):
        assert_close(diloco, ssgd, "DiLoCo(H=1, outer SGD(1, 0)) vs S-SGD")


def test_outer_sgd_lr1_no_momentum_is_local_sgd_for_any_h():
    def both(comm):
        diloco = run_diloco(comm, 9, lambda ps: torch.optim.SGD(ps, lr=0.05), H=4, outer_lr=1.0,
                            outer_momentum=0.0, outer_nesterov=False)
        return diloco, cases.trained_parameters(comm, lambda m: LocalSGD(m.parameters(), lr=0.05, comm=comm, H=4), 9)

    for diloco, local in gradzip.simulate(2, both):
        assert_close(diloco, local, "DiLoCo(H=4, outer SGD(1, 0)) vs local SGD")


BOXES = {
    "diloco-adamw-nesterov": (adamw, dict(H=4)),
    "diloco-topk-error-feedback": (sgd_momentum, dict(H=3, compressor="topk:ratio=0.3")),
    "diloco-randomk-unbiased": (adamw, dict(H=2, compressor="randomk:ratio=0.5,unbiased=true", outer_momentum=0.5,
                                            outer_nesterov=False)),
    "streaming-P2-delay1-alpha": (adamw, dict(H=4, fragments=2, delay=1, alpha=0.25, compressor="topk:ratio=0.3")),
    "streaming-P3-delay0": (sgd_momentum, dict(H=6, fragments=3, outer_lr=0.5)),
    "streaming-P4-delay0-lr1": (adamw, dict(H=4, fragments=4, outer_lr=1.0, outer_momentum=0.0,
                                            outer_nesterov=False)),
}


@pytest.mark.parametrize("name", sorted(BOXES))
def test_matches_a_hand_written_reference_of_the_box(name):
    inner, options = BOXES[name]
    steps = 13   # not a multiple of H: ends mid-period (and, streaming, mid-flight)
    got = gradzip.simulate(2, lambda comm: run_diloco(comm, steps, inner, **options))
    want = reference(2, steps, inner, **options)
    for rank in range(2):
        assert_close(got[rank], want[rank], f"{name} rank {rank}")


def test_streaming_fragment_is_the_mean_at_its_syncs_and_untouched_otherwise():
    """Outer SGD(1, 0), α = 0: at fragment p's sync steps its tensors equal the workers'
    mean (of the models after the inner step); at other steps they are the inner step's
    result (plain SGD: x − η g, bit for bit)."""
    H, P, lr = 4, 2, 0.05

    def worker(comm):
        model = cases.tiny_model()
        opt = DiLoCo(torch.optim.SGD(model.parameters(), lr=lr), comm=comm, H=H, fragments=P, outer_lr=1.0,
                     outer_momentum=0.0, outer_nesterov=False)
        rows = []
        for t in range(1, 9):
            opt.zero_grad()
            loss_of(model, t, comm.rank, comm.world_size).backward()
            inner_result = [p.detach().add(p.grad, alpha=-lr) for p in model.parameters()]  # SGD's own op
            opt.step()
            rows.append((inner_result, [p.detach().clone() for p in model.parameters()]))
        return rows

    out = gradzip.simulate(2, worker)
    for t in range(1, 9):
        for k in range(4):                    # tensor k in fragment k mod 2, synced at t ≡ 2(k mod 2 + 1) mod 4
            syncs = t % H == ((k % P + 1) * (H // P)) % H
            for rank in range(2):
                inner_result, after = out[rank][t - 1][0][k], out[rank][t - 1][1][k]
                if syncs:
                    mean = (out[0][t - 1][0][k] + out[1][t - 1][0][k]) / 2
                    torch.testing.assert_close(after, mean, rtol=1e-6, atol=1e-7)
                else:
                    assert torch.equal(after, inner_result), (t, k, rank)


def test_alpha_one_leaves_the_local_model_while_the_global_copy_advances():
    plain = gradzip.simulate(2, lambda comm: run_diloco(
        comm, 6, lambda ps: torch.optim.SGD(ps, lr=0.05), H=1, outer_lr=0.0, outer_momentum=0.0,
        outer_nesterov=False, alpha=1.0))   # lr 0: θ̂ stays; α = 1: x untouched = pure local SGD
    local = gradzip.simulate(2, lambda comm: [p.detach().clone() for p in _pure_local(comm, 6)])
    for a, b in zip(plain, local):
        assert all(torch.equal(x, y) for x, y in zip(a, b))

    def with_record(comm):
        rec = [] if comm.rank == 0 else None
        final = run_diloco(comm, 4, lambda ps: torch.optim.SGD(ps, lr=0.05), H=4, fragments=2, alpha=1.0,
                           record=rec)
        return final, rec

    (final0, rec), (final1, _) = gradzip.simulate(2, with_record)
    pure = gradzip.simulate(2, lambda comm: [p.detach().clone() for p in _pure_local(comm, 4)])
    assert all(torch.equal(x, y) for x, y in zip(final0, pure[0]))
    initial = [p.detach() for p in cases.tiny_model().parameters()]
    # fragment 0 (tensors 0, 2) syncs at step 2, fragment 1 (tensors 1, 3) at step 4
    assert all(torch.equal(rec[0][1][k], initial[k]) for k in range(4))              # step 1: none yet
    assert not any(torch.equal(rec[1][1][k], initial[k]) for k in (0, 2))            # step 2: θ̂_0 moved
    assert all(torch.equal(rec[1][1][k], initial[k]) for k in (1, 3))                # θ̂_1 not yet
    assert not any(torch.equal(rec[3][1][k], initial[k]) for k in (1, 3))            # step 4: θ̂_1 moved


def _pure_local(comm, steps):
    model = cases.tiny_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    for t in range(1, steps + 1):
        inner.zero_grad()
        loss_of(model, t, comm.rank, comm.world_size).backward()
        inner.step()
    return list(model.parameters())


def test_explicit_fragment_lists_equal_the_strided_default():
    def worker(comm):
        strided = run_diloco(comm, 7, H=4, fragments=2, delay=1)
        model = cases.tiny_model()
        ps = list(model.parameters())
        opt = DiLoCo(adamw(ps), comm=comm, H=4, fragments=[[ps[2], ps[0]], [ps[1], ps[3]]], delay=1)
        for t in range(1, 8):
            opt.zero_grad()
            loss_of(model, t, comm.rank, comm.world_size).backward()
            opt.step()
        return strided, [p.detach().clone() for p in ps]

    for strided, explicit in gradzip.simulate(2, worker):
        assert all(torch.equal(a, b) for a, b in zip(strided, explicit))


def _resumable(comm, steps, saved=None, options=None):
    return cases.train_resumable(comm, lambda m: DiLoCo(adamw(list(m.parameters())), comm=comm, **options), steps, saved)


@pytest.mark.parametrize("options", [dict(H=4, fragments=2, delay=1, alpha=0.5, compressor="topk:ratio=0.3"),
                                     dict(H=3, compressor="topk:ratio=0.3")], ids=["streaming", "diloco"])
def test_resume_mid_period_and_mid_flight_is_bit_identical(options):
    """Saved after step 5 (streaming: fragment 0's exchange started at step 5 is in
    flight; its aggregate travels in the state), loaded into new objects, 5 more steps:
    the same bits as 10 steps in one go (parameters, outer and inner state)."""
    def worker(comm):
        whole = _resumable(comm, 10, options=options)
        half = _resumable(comm, 5, options=options)
        if options.get("delay"):
            assert "inflight" in half["opt"]["gradzip"]
        resumed = _resumable(comm, 10, saved=half, options=options)
        return whole, resumed

    for whole, resumed in gradzip.simulate(2, worker):
        cases.assert_bitwise_equal(whole, resumed, "resumed DiLoCo")


@pytest.mark.parametrize("options, names", [
    (dict(H=6, fragments=4), "multiple of fragments"), (dict(H=4, fragments=2, delay=2), "delay"),
    (dict(H=4, alpha=1.5), "alpha"), (dict(H=0), "H"), (dict(H=4, outer_momentum=0.0), "outer_nesterov"),
    (dict(H=4, outer_lr=float("nan")), "outer_lr"), (dict(H=4, fragments=9), "fragments"),
    (dict(H=4, fragments=[[0]]), "fragments"), (dict(H=4, compressor="zip"), "zip"),
])
def test_bad_options_raise_one_line_gradzip_errors_naming_them(options, names):
    model = cases.tiny_model()
    with pytest.raises(GradzipError, match=names):
        DiLoCo(adamw(list(model.parameters())), **options)


def test_inner_must_be_a_torch_optimizer_and_not_a_gradzip_method():
    ps = list(cases.tiny_model().parameters())
    with pytest.raises(GradzipError, match="inner must be a torch.optim.Optimizer"):
        DiLoCo(ps, H=4)
    with pytest.raises(GradzipError, match="not a gradzip method"):
        DiLoCo(SSGD(ps, lr=0.1), H=4)
    with pytest.raises(GradzipError, match="AdamW's moments"):
        DiLoCoMethod(ps, lr=0.1, momentum=0.9)


def test_registry_form_builds_the_inner_optimizer():
    ps = list(cases.tiny_model().parameters())
    opt = gradzip.optim.METHODS["diloco"](ps, lr=0.1, weight_decay=0.01, inner_lr=0.003, H=4)
    assert isinstance(opt.inner, torch.optim.AdamW)
    assert opt.inner.param_groups[0]["lr"] == 0.003 and opt.inner.param_groups[0]["weight_decay"] == 0.01
    assert opt.param_groups[0]["lr"] == 0.7 and opt.param_groups[0]["nesterov"]
    sgd = DiLoCoMethod(ps, lr=0.1, inner="sgd", momentum=0.9, H=4)
    assert isinstance(sgd.inner, torch.optim.SGD) and sgd.inner.param_groups[0]["momentum"] == 0.9


def test_cli_trains_diloco(tmp_path, capsys):
    code = cli.main(["train", "--algo", "diloco", "--inner", "sgd", "--inner-lr", "0.1", "--H", "4",
                             "--outer-lr", "1.0", "--outer-momentum", "0", "--outer-nesterov", "false",
                             "--fragments", "2", "--delay", "1", "--workers", "2", "--backend", "threads",
                             "--epochs", "1", "--quiet", "--no-plot", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "summary.json").read_text())
    run = summary["runs"][0] if "runs" in summary else summary
    assert run["method"] == "diloco" and run["H"] == 4 and run["final_test_accuracy"] > 0.3  # chance: 0.1
