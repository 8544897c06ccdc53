"""LocalSGD, QSparse-local-SGD, CSEA, CSER, CSER-PL (issue 5; spec "Methods")."""
import math

import pytest
import torch

import gradzip
from gradzip.errors import GradzipError
from gradzip.comm.launch import run_processes
from gradzip.optim import CSEA, CSER, CSERPL, LocalSGD, METHODS, QSparseLocalSGD
from gradzip.optim.core.ratios import codec_for_ratio, derive_cser, derive_periodic

import cases

TIGHT = dict(rtol=1e-6, atol=1e-6)   # "==" of the spec: float32 reassociation only
MOMENTUM = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)


def run(n, method, options, steps=6):
    return cases.simulate_method(n, method, options, steps)


def assert_same(outs_a, outs_b, **tol):
    cases.assert_same_runs(outs_a, outs_b, **(tol or TIGHT))


# -- special cases ------------------------------------------------------------------------
@pytest.mark.parametrize("opts", [dict(lr=0.1), MOMENTUM])
def test_csea_with_one_worker_is_plain_sgd(opts):
    assert_same(run(1, "csea", dict(opts, compressor="topk:ratio=0.2")), run(1, "ssgd", opts))


def test_csea_one_worker_keeps_an_error_yet_its_model_is_sgd():
    """Not vacuous: the codec did drop something (e != 0), the model still moved as SGD."""
    model = cases.tiny_model()
    opt = CSEA(model.parameters(), lr=0.1, compressor="topk:ratio=0.2")
    x, y = cases.regression_batch(1, 0, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert all((opt.state[p]["error"] != 0).any() for p in model.parameters() if p.numel() > 4)


@pytest.mark.parametrize("opts", [dict(lr=0.1), MOMENTUM])
def test_csea_with_identity_codec_is_ssgd(opts):
    assert_same(run(3, "csea", dict(opts, compressor="none")), run(3, "ssgd", opts))


@pytest.mark.parametrize("c1", ["topk:ratio=0.3", "randblock:ratio=0.3", "randblock:in=3,layer=2"])
def test_cser_without_gradient_exchange_is_cserpl(c1):
    a = run(3, "cser", dict(MOMENTUM, c1=c1, c2=None, H=3), steps=7)
    b = run(3, "cserpl", dict(MOMENTUM, c1=c1, H=3), steps=7)
    assert_same(a, b, rtol=0, atol=0)  # the same code path: bitwise


@pytest.mark.parametrize("c1", ["topk:ratio=0.3", "randblock:in=3,layer=2"])
def test_cser_without_gradient_exchange_and_H1_is_csea(c1):
    a = run(3, "cser", dict(MOMENTUM, c1=c1, c2="zero", H=1))
    b = run(3, "csea", dict(MOMENTUM, compressor=c1))
    assert_same(a, b)
    assert not torch.allclose(a[0][0], a[1][0])  # the workers' models do differ (e_i)


@pytest.mark.parametrize("opts", [dict(lr=0.1), MOMENTUM])
def test_qsparse_with_H1_and_identity_codec_is_ssgd(opts):
    assert_same(run(3, "qsparse", dict(opts, compressor="none", H=1)), run(3, "ssgd", opts))


@pytest.mark.parametrize("opts", [dict(lr=0.1), MOMENTUM])
def test_localsgd_with_H1_is_ssgd(opts):
    assert_same(run(3, "localsgd", dict(opts, H=1)), run(3, "ssgd", opts))


def test_localsgd_models_differ_between_and_agree_at_synchronisations():
    outs = gradzip.simulate(3, lambda c: [cases.train_method(c, "localsgd", dict(lr=0.1, H=3), steps=s)
                                          for s in (5, 6)])
    at5, at6 = [o[0] for o in outs], [o[1] for o in outs]
    assert not torch.allclose(at5[0][0], at5[1][0])
    for other in at6[1:]:
        for a, b in zip(at6[0], other):
            assert torch.equal(a, b)


# -- the invariant on real processes ---------------------------------------------------------
INVARIANT_RUNS = [
    ("csea", dict(MOMENTUM, compressor="topk:ratio=0.3")),
    ("cser", dict(MOMENTUM, c1="topk:ratio=0.3", c2="randblock:ratio=0.2", H=3)),
    ("cser", dict(lr=0.1, c1="none", c2="topk:ratio=0.25", H=3)),
]


@pytest.mark.slow
def test_invariant_x_minus_e_agrees_on_three_gloo_processes():
    procs = run_processes(3, cases.cser_family_runs, INVARIANT_RUNS)
    for i, (method, opts) in enumerate(INVARIANT_RUNS):
        runs = [p[i] for p in procs]
        for t in range(len(runs[0]["shifted"])):
            for other in runs[1:]:
                for a, b in zip(runs[0]["shifted"][t], other["shifted"][t]):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        # the models themselves differ between resets ...
        assert not torch.allclose(runs[0]["models"][0][0], runs[1]["models"][0][0])
        if opts.get("c1") == "none":  # ... and agree right after a reset with C1 = identity
            for t in (3, 6, 9):
                for other in runs[1:]:
                    for a, b in zip(runs[0]["models"][t - 1], other["models"][t - 1]):
                        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# -- hand-written references: n workers on a quadratic, top-k ---------------------------------
SHAPES = [(10,), (3, 4)]


def quadratic(n, seed=0):
    """Worker i's f_i(x) = ½‖A_i x − b_i‖² per tensor; returns (A, b) lists and x0."""
    g = torch.Generator().manual_seed(seed)
    A = [[torch.randn(math.prod(s), math.prod(s), generator=g) / math.prod(s) ** 0.5 for s in SHAPES]
         for _ in range(n)]
    b = [[torch.randn(math.prod(s), generator=g) for s in SHAPES] for _ in range(n)]
    x0 = [torch.randn(s, generator=g) for s in SHAPES]
    return A, b, x0


def grad(A, b, x):
    return (A.T @ (A @ x.reshape(-1) - b)).reshape(x.shape)


def topk(v, ratio):
    flat = v.reshape(-1)
    k = max(1, math.ceil(ratio * flat.numel()))
    out = torch.zeros_like(flat)
    idx = torch.topk(flat.abs(), k).indices
    out[idx] = flat[idx]
    return out.reshape(v.shape)


class Direction:
    """torch.optim.SGD's local rule: d = g + wd·x; b = m·b + d; d = b (or d + m·b)."""

    def __init__(self, m, nesterov, wd):
        self.m, self.nesterov, self.wd, self.buf = m, nesterov, wd, None

    def __call__(self, g, x):
        d = g + self.wd * x
        if self.m == 0:
            return d
        self.buf = d.clone() if self.buf is None else self.m * self.buf + d
        return d + self.m * self.buf if self.nesterov else self.buf.clone()


def reference(method, n, steps, lr, ratio, H, m, nesterov, wd):
    """The spec's boxes, written out per worker with plain tensors."""
    A, b, x0 = quadratic(n)
    T = len(SHAPES)
    x = [[t.clone() for t in x0] for _ in range(n)]
    e = [[torch.zeros(s) for s in SHAPES] for _ in range(n)]
    hat = [t.clone() for t in x0]
    dirs = [[Direction(m, nesterov, wd) for _ in SHAPES] for _ in range(n)]
    C = lambda v: topk(v, ratio)
    for t in range(1, steps + 1):
        d = [[dirs[i][k](grad(A[i][k], b[i][k], x[i][k]), x[i][k]) for k in range(T)] for i in range(n)]
        for k in range(T):
            if method == "localsgd":
                for i in range(n):
                    x[i][k] = x[i][k] - lr * d[i][k]
                if t % H == 0:
                    mean = sum(x[i][k] for i in range(n)) / n
                    for i in range(n):
                        x[i][k] = mean.clone()
            elif method == "qsparse":
                for i in range(n):
                    x[i][k] = x[i][k] - lr * d[i][k]
                if t % H == 0:
                    p = [e[i][k] + x[i][k] - hat[k] for i in range(n)]
                    pc = [C(v) for v in p]
                    hat[k] = hat[k] + sum(pc) / n
                    for i in range(n):
                        e[i][k] = p[i] - pc[i]
                        x[i][k] = hat[k].clone()
            elif method == "csea":
                p = [e[i][k] - lr * d[i][k] for i in range(n)]
                pc = [C(v) for v in p]
                mean = sum(pc) / n
                for i in range(n):
                    e_new = p[i] - pc[i]
                    x[i][k] = x[i][k] - e[i][k] + (mean + e_new)
                    e[i][k] = e_new
            elif method in ("cser", "cserpl"):
                if method == "cser":
                    gc = [C(v) for v in d_col(d, k)]
                    mean = sum(gc) / n
                    for i in range(n):
                        r = d[i][k] - gc[i]
                        x[i][k] = x[i][k] - lr * (mean + r)
                        e[i][k] = e[i][k] - lr * r
                else:
                    for i in range(n):
                        x[i][k] = x[i][k] - lr * d[i][k]
                        e[i][k] = e[i][k] - lr * d[i][k]
                if t % H == 0:
                    ec = [C(e[i][k]) for i in range(n)]
                    mean = sum(ec) / n
                    for i in range(n):
                        e_new = e[i][k] - ec[i]
                        x[i][k] = x[i][k] - e[i][k] + (mean + e_new)
                        e[i][k] = e_new
    return x


def d_col(d, k):
    return [row[k] for row in d]


def gradzip_run(comm, method, steps, lr, ratio, H, m, nesterov, wd):
    A, b, x0 = quadratic(comm.world_size)
    params = [torch.nn.Parameter(t.clone()) for t in x0]
    codec = f"topk:ratio={ratio}"
    opts = {"localsgd": dict(H=H), "qsparse": dict(compressor=codec, H=H), "csea": dict(compressor=codec),
            "cser": dict(c1=codec, c2=codec, H=H), "cserpl": dict(c1=codec, H=H)}[method]
    opt = METHODS[method](params, lr=lr, comm=comm, momentum=m, nesterov=nesterov, weight_decay=wd, **opts)
    i = comm.rank
    for _ in range(steps):
        for k, p in enumerate(params):
            p.grad = grad(A[i][k], b[i][k], p.detach())
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("method", ["localsgd", "qsparse", "csea", "cser", "cserpl"])
@pytest.mark.parametrize("n, hyper", [(2, dict(m=0.0, nesterov=False, wd=0.0)),
                                      (4, dict(m=0.9, nesterov=False, wd=0.01)),
                                      (3, dict(m=0.9, nesterov=True, wd=0.0))])
def test_matches_hand_written_reference_on_a_quadratic(method, n, hyper):
    setting = dict(steps=12, lr=0.05, ratio=0.25, H=3, **hyper)
    expected = reference(method, n, **setting)
    outs = gradzip.simulate(n, lambda c: gradzip_run(c, method, **setting))
    for i in range(n):
        for got, want in zip(outs[i], expected[i]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if method != "localsgd":  # the workers did not all end equal: the test sees per-worker state
        assert any(not torch.allclose(outs[0][0], outs[i][0]) for i in range(1, n)) or method == "qsparse"


# -- accounting ---------------------------------------------------------------------------------
def _bytes(codec_ratio, shapes):
    """Real per-tensor payload of randblock:ratio=ρ (k = max(1, ceil(ρd)), 4 bytes each)."""
    return sum(4 * max(1, math.ceil(codec_ratio * math.prod(s))) for s in shapes)


ACCOUNTING_SHAPES = [(40, 30), (30,), (7, 5), (5,)]


def _measured_rc(comm, method, options, steps):
    params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
              for i, s in enumerate(ACCOUNTING_SHAPES)]
    opt = METHODS[method](params, lr=0.01, comm=comm, **options)
    for _ in range(steps):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    return opt.compression_ratio


@pytest.mark.parametrize("method, options, formula", [
    ("cser", dict(c1="randblock:ratio=0.1", c2="randblock:ratio=0.02", H=4),
     lambda dense, b1, b2, H: 1 / (b2 / dense + b1 / (H * dense))),
    ("cserpl", dict(c1="randblock:ratio=0.1", H=4), lambda dense, b1, b2, H: H * dense / b1),
    ("qsparse", dict(compressor="randblock:ratio=0.1", H=4), lambda dense, b1, b2, H: H * dense / b1),
    ("csea", dict(compressor="randblock:ratio=0.05"), lambda dense, b1, b2, H: dense / b1),
    ("localsgd", dict(H=4), lambda dense, b1, b2, H: H),
])
def test_measured_compression_ratio_matches_the_spec_formula(method, options, formula):
    dense = sum(4 * math.prod(s) for s in ACCOUNTING_SHAPES)
    r1 = float(options.get("c1", options.get("compressor", "x:ratio=1")).split("=")[1]) if method != "localsgd" else 1
    r2 = float(options["c2"].split("=")[1]) if "c2" in options else 1
    expected = formula(dense, _bytes(r1, ACCOUNTING_SHAPES), _bytes(r2, ACCOUNTING_SHAPES), options.get("H", 1))
    measured = gradzip.simulate(2, lambda c: _measured_rc(c, method, options, steps=8))[0]
    assert measured == pytest.approx(expected, rel=0.10)
    assert measured == pytest.approx(expected, rel=1e-9)  # deterministic here: exactly


@pytest.mark.parametrize("method, rc", [("cser", 16), ("cser", 256), ("cserpl", 64), ("qsparse", 16), ("csea", 32)])
def test_rc_reaches_the_target_ratio(method, rc):
    """Tensors whose dim 0 the derived ``randblock:in=R`` blocks divide: bytes are exact."""
    shapes = [(512, 3), (1024,)]

    def go(comm):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        opt = METHODS[method](params, lr=0.01, comm=comm, rc=rc)
        for _ in range(2 * getattr(opt, "H", 1)):
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
        return opt.compression_ratio

    assert gradzip.simulate(2, go)[0] == pytest.approx(rc, rel=0.10)


def test_rc_derivation_follows_the_papers_grid():
    assert derive_cser("CSER", 256.0, None) == ("randblock:in=16", "randblock:in=512", 32)
    assert derive_cser("CSER", 32.0, None) == ("randblock:in=4", "randblock:in=64", 16)
    assert derive_cser("CSER", 1024.0, None) == ("randblock:in=8", "randblock:in=2048", 256)
    assert derive_cser("CSER", 1024.0, 64) == ("randblock:in=32", "randblock:in=2048", 64)
    assert derive_periodic("QSparse", 256.0, None) == ("randblock:in=16", 16)
    assert codec_for_ratio(1) == "none"
    opt = CSER(cases.tiny_model().parameters(), lr=0.1, rc=256)
    assert opt.H == 32 and opt.psync1.compressor.in_ == 16 and opt.psync2.compressor.in_ == 512


def test_in_blocks_send_one_over_R_of_a_small_tensor_in_expectation():
    """The documented choice: randblock:in=R reaches 1/R even on tensors smaller than R."""
    codec = gradzip.compressors.build(codec_for_ratio(1024))
    sent = sum(codec.compress(torch.ones(6, 5), seed).nbytes for seed in range(20000))
    assert sent / 20000 == pytest.approx(4 * 30 / 1024, rel=0.15)


# -- state and options ----------------------------------------------------------------------------
@pytest.mark.parametrize("method, options, keys", [
    ("localsgd", dict(lr=0.1, H=3, momentum=0.9), ["momentum_buffer"]),
    ("qsparse", dict(lr=0.1, compressor="randblock:ratio=0.3", H=3, momentum=0.9), ["synced", "error"]),
    ("csea", dict(lr=0.1, compressor="randblock:in=2,out=2", momentum=0.9), ["error"]),
    ("cser", dict(lr=0.1, c1="topk:ratio=0.3", c2="randblock:ratio=0.3", H=3, momentum=0.9), ["error"]),
    ("cserpl", dict(lr=0.1, rc=8, momentum=0.9, nesterov=True), ["error"]),
])
def test_state_dict_resume_is_exact(method, options, keys):
    straight = gradzip.simulate(2, lambda c: cases.train_with_resume(c, method, options, 8, split=None))
    resumed = gradzip.simulate(2, lambda c: cases.train_with_resume(c, method, options, 8, split=5))
    for (pa, sa), (pb, sb) in zip(straight, resumed):
        for a, b in zip(pa, pb):
            assert torch.equal(a, b)
        assert sb["gradzip"]["steps"] == 8
        for key in keys:
            assert all(key in s for s in sa["state"].values())
    assert METHODS[method].replicas_differ


def test_lr_scheduler_drives_cser():
    model = cases.tiny_model()
    opt = CSER(model.parameters(), lr=1.0, c1="topk:ratio=0.5", c2="topk:ratio=0.5", H=3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.0)
    x, y = cases.regression_batch(1, 0, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    sched.step()  # lr is now 0: step 2 (no reset) moves neither the model nor the error
    before = [(p.detach().clone(), opt.state[p]["error"].clone()) for p in model.parameters()]
    assert any((e != 0).any() for _, e in before)
    opt.step()
    for (x0, e0), p in zip(before, model.parameters()):
        assert torch.equal(p.detach(), x0) and torch.equal(opt.state[p]["error"], e0)


@pytest.mark.parametrize("make, message", [
    (lambda ps: LocalSGD(ps, lr=0.1, H=0), "H .* must be an integer >= 1"),
    (lambda ps: QSparseLocalSGD(ps, lr=0.1, H=0), "H .* must be an integer >= 1"),
    (lambda ps: CSER(ps, lr=0.1, H=0), "H .* must be an integer >= 1"),
    (lambda ps: CSERPL(ps, lr=0.1, H=2.5), "H .* must be an integer >= 1"),
    (lambda ps: CSEA(ps, lr=0.1, compressor="randblock:ratio=1.5"), r"ratio must be in \(0, 1\]"),
    (lambda ps: CSER(ps, lr=0.1, c1="topk:ratio=0", c2="none", H=2), r"ratio must be in \(0, 1\]"),
    (lambda ps: QSparseLocalSGD(ps, lr=0.1, compressor="topk:ratio=-0.1"), r"ratio must be in \(0, 1\]"),
    (lambda ps: CSER(ps, lr=0.1, rc=-4), "rc .* must be a number >= 1"),
    (lambda ps: CSEA(ps, lr=0.1, rc=0.5), "rc .* must be a number >= 1"),
    (lambda ps: CSER(ps, lr=0.1, rc=16, c1="topk:ratio=0.1"), "either rc .* or explicit codecs"),
    (lambda ps: QSparseLocalSGD(ps, lr=0.1, rc=16, compressor="none"), "either rc"),
    (lambda ps: CSER(ps, lr=0.1, rc=4, H=16), r"H must be <= 2·rc"),
    (lambda ps: CSERPL(ps, lr=0.1, rc=4, H=8), "H must be <= rc"),
])
def test_bad_options_raise_a_clear_error(make, message):
    with pytest.raises(GradzipError, match=message):
        make(cases.tiny_model().parameters())


def test_cli_flags_come_from_the_signatures():
    from gradzip.optim import method_options
    assert method_options(CSER) == {"c1": str, "c2": str, "H": int, "rc": float}
    assert method_options(CSERPL) == {"c1": str, "H": int, "rc": float}
    assert method_options(QSparseLocalSGD) == {"compressor": str, "H": int, "rc": float}
    assert method_options(CSEA) == {"compressor": str, "rc": float}
    assert method_options(LocalSGD) == {"H": int}
