"""LARS and LAMB (docs/algorithms.md §Large-batch training) against hand-written references
of the spec's boxes (float64, plain torch), alone and as ``--algo lars/lamb`` on 3 workers."""
import pytest
import torch

import gradzip
from gradzip.errors import GradzipError
from gradzip.optim import LAMB, LARS

import cases

F = torch.nn.functional


def mean_gradients(t, n):
    """The gradient of the mean loss over all n workers' shards at the reference's weights."""
    x = torch.cat([cases.regression_batch(t, r, n)[0] for r in range(n)]).double()
    y = torch.cat([cases.regression_batch(t, r, n)[1] for r in range(n)]).double()
    return x, y


def reference(box, steps, n, **hp):
    """The box, written out per tensor in float64, on the concatenated batch."""
    model = cases.tiny_model().double()
    state = [dict() for _ in model.parameters()]
    for t in range(1, steps + 1):
        x, y = mean_gradients(t, n)
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p, s in zip(model.parameters(), state):
                box(p, p.grad, s, t, **hp)
    return [p.detach() for p in model.parameters()]


def lars_box(w, g, s, t, lr, momentum, weight_decay, tau=0.001, eps=1e-8):
    lam = 0.0 if w.dim() == 1 else weight_decay
    u = g + lam * w
    wn, gn = w.norm().item(), g.norm().item()
    q = tau * wn / (gn + lam * wn + eps) if wn > 0 and gn > 0 and w.dim() > 1 else 1.0
    s["b"] = q * u if "b" not in s else momentum * s["b"] + q * u
    w -= lr * s["b"]


def lamb_box(w, g, s, t, lr, weight_decay, b1=0.9, b2=0.999, eps=1e-6):
    lam = 0.0 if w.dim() == 1 else weight_decay
    s["m"] = b1 * s.get("m", 0) + (1 - b1) * g
    s["v"] = b2 * s.get("v", 0) + (1 - b2) * g * g
    r = (s["m"] / (1 - b1 ** t)) / ((s["v"] / (1 - b2 ** t)).sqrt() + eps) + lam * w
    wn, rn = w.norm().item(), r.norm().item()
    q = wn / rn if wn > 0 and rn > 0 and w.dim() > 1 else 1.0
    w -= lr * q * r


CASES = [("lars", lars_box, dict(lr=2.0, momentum=0.9, weight_decay=0.01)),
         ("lamb", lamb_box, dict(lr=0.02, weight_decay=0.01))]


@pytest.mark.parametrize("algo, box, hp", CASES, ids=["lars", "lamb"])
@pytest.mark.parametrize("n", [1, 3])
def test_method_follows_the_box_on_the_mean_gradient(algo, box, hp, n):
    outs = gradzip.simulate(n, lambda c: cases.train_method(c, algo, hp, steps=6))
    expected = reference(box, 6, n, **hp)
    for params in outs:
        for p, e in zip(params, expected):
            torch.testing.assert_close(p.double(), e, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for params in outs[1:] for a, b in zip(outs[0], params))


@pytest.mark.parametrize("cls, box, hp", [(LARS, lars_box, dict(lr=2.0, momentum=0.9, weight_decay=0.01)),
                                          (LAMB, lamb_box, dict(lr=0.02, weight_decay=0.01))], ids=["lars", "lamb"])
def test_alone_as_a_torch_optimizer(cls, box, hp):
    model = cases.tiny_model()
    opt = cls(model.parameters(), **hp)
    for t in range(1, 5):
        x, y = cases.regression_batch(t, 0, 1)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    for p, e in zip(model.parameters(), reference(box, 4, 1, **hp)):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-6)


def test_exclude_1d_false_scales_biases_too():
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    w.grad = torch.tensor([1.0, 0.0])
    LARS([w], lr=1.0, momentum=0.0, trust_coefficient=0.1, eps=0.0, exclude_1d=False).step()
    torch.testing.assert_close(w.detach(), torch.tensor([3.0 - 0.5, 4.0]))   # q = 0.1·5/1


@pytest.mark.parametrize("algo", ["lars", "lamb", "adamw"])
def test_resume_is_exact(algo):
    def run(comm, cut):
        model = cases.tiny_model()
        make = lambda: gradzip.optim.METHODS[algo](model.parameters(), lr=0.05, comm=comm, weight_decay=0.01,
                                                   compressor="topk:ratio=0.5")
        opt = make()
        for t in range(1, 6):
            if t == cut:
                saved = opt.state_dict()
                opt = make()
                opt.load_state_dict(saved)
            x, y = cases.regression_batch(t, comm.rank, comm.world_size)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    whole, resumed = (gradzip.simulate(2, lambda c: run(c, cut)) for cut in (None, 3))
    assert all(torch.equal(x, y) for a, b in zip(whole, resumed) for x, y in zip(a, b))


@pytest.mark.parametrize("make, match", [
    (lambda ps: LARS(ps, lr=0.1, trust_coefficient=0.0), "trust_coefficient"),
    (lambda ps: LARS(ps, lr=0.1, momentum=1.0), "momentum"),
    (lambda ps: LAMB(ps, lr=0.1, betas=(0.9, 1.0)), "betas"),
    (lambda ps: LAMB(ps, lr=float("nan")), "lr"),
    (lambda ps: gradzip.optim.METHODS["lamb"](ps, lr=0.1, momentum=0.9), "momentum"),
])
def test_bad_options_raise_gradzip_error(make, match):
    with pytest.raises(GradzipError, match=match):
        make(cases.tiny_model().parameters())
