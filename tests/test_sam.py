"""SAM (docs/algorithms.md §Large-batch training, "SAM") against a hand-written reference
of the box: ascent on each worker's own gradient, descent gradient through the exchange."""
import pytest
import torch

import gradzip
from gradzip.errors import GradzipError
from gradzip.optim import SAM

import cases

F = torch.nn.functional


def grads_at(params, t, r, n):
    """∇f(params; z_r) of worker r's shard at step t (a fresh model holding ``params``)."""
    model = cases.tiny_model().double()
    with torch.no_grad():
        for p, v in zip(model.parameters(), params):
            p.copy_(v)
    x, y = cases.regression_batch(t, r, n)
    F.mse_loss(model(x.double()), y.double()).backward()
    return [p.grad for p in model.parameters()]


def reference(steps, n, rho, lr, adaptive=False, momentum=0.0):
    """SAM with S-SGD (momentum on the mean after the exchange is not S-SGD's rule: plain SGD here)."""
    w = [p.detach().double() for p in cases.tiny_model().parameters()]
    for t in range(1, steps + 1):
        descent = [torch.zeros_like(v) for v in w]
        for r in range(n):
            g = grads_at(w, t, r, n)
            if adaptive:
                norm = torch.sqrt(sum(((v * x) ** 2).sum() for v, x in zip(w, g)))
                eps = [rho * v * v * x / norm for v, x in zip(w, g)]
            else:
                norm = torch.sqrt(sum((x ** 2).sum() for x in g))
                eps = [rho * x / norm for x in g]
            gt = grads_at([v + e for v, e in zip(w, eps)], t, r, n)
            descent = [d + x / n for d, x in zip(descent, gt)]
        w = [v - lr * d for v, d in zip(w, descent)]
    return w


def train_sam(comm, method, steps, rho, adaptive=False, **options):
    model = cases.tiny_model()
    opt = SAM(gradzip.optim.METHODS[method](model.parameters(), comm=comm, **options), rho=rho, adaptive=adaptive)
    for t in range(1, steps + 1):
        x, y = cases.regression_batch(t, comm.rank, comm.world_size)

        def closure():
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss
        opt.step(closure)
    return [p.detach().clone() for p in model.parameters()], opt.inner.bytes_sent


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("adaptive", [False, True])
def test_sam_with_ssgd_follows_the_box(n, adaptive):
    outs = gradzip.simulate(n, lambda c: train_sam(c, "ssgd", 5, rho=0.1, adaptive=adaptive, lr=0.1))
    expected = reference(5, n, rho=0.1, lr=0.1, adaptive=adaptive)
    for params, _ in outs:
        for p, e in zip(params, expected):
            torch.testing.assert_close(p.double(), e, rtol=1e-5, atol=1e-6)


def test_sam_adds_no_communication_and_works_with_a_codec():
    """Same bytes as the method alone (one exchange per step); with EF-SGD's top-k the
    replicas stay identical."""
    plain = gradzip.simulate(2, lambda c: cases.train_method(c, "efsgd", dict(lr=0.1, compressor="topk:ratio=0.3")))
    outs = gradzip.simulate(2, lambda c: train_sam(c, "efsgd", 5, rho=0.05, lr=0.1, compressor="topk:ratio=0.3"))
    assert outs[0][1] > 0 and outs[0][1] == outs[1][1]
    assert all(torch.equal(a, b) for a, b in zip(outs[0][0], outs[1][0]))
    assert not all(torch.equal(a, b) for a, b in zip(outs[0][0], plain[0]))   # SAM did change the step

    def bytes_alone(comm):
        model = cases.tiny_model()
        opt = gradzip.optim.EFSGD(model.parameters(), lr=0.1, comm=comm, compressor="topk:ratio=0.3")
        for t in range(1, 6):
            x, y = cases.regression_batch(t, comm.rank, comm.world_size)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        return opt.bytes_sent
    assert gradzip.simulate(2, bytes_alone)[0] == outs[0][1]


def test_sam_with_a_torch_optimizer_and_resume():
    def run(cut):
        model = cases.tiny_model()
        make = lambda: SAM(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), rho=0.1)
        opt = make()
        for t in range(1, 6):
            if t == cut:
                saved = opt.state_dict()
                opt = make()
                opt.load_state_dict(saved)
            x, y = cases.regression_batch(t, 0, 1)
            opt.step(lambda: F.mse_loss(model(x), y).backward())
        return [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(run(None), run(3)))


def test_sam_needs_a_closure_and_a_sane_rho():
    model = cases.tiny_model()
    opt = SAM(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(GradzipError, match="closure"):
        opt.step()
    with pytest.raises(GradzipError, match="rho"):
        SAM(torch.optim.SGD(model.parameters(), lr=0.1), rho=-1.0)
