"""PowerSGD: the method against the spec's equations (per tensor), and the one-round codec.
(The DDP hook is checked against PyTorch's own hook in test_ddp.py.)"""

import pytest
import torch

import gradzip
from gradzip.comm import allreduce_wire_bytes
from gradzip.compressors import build
from gradzip.compressors.powersgd import random_q, should_compress
from gradzip.errors import GradzipError
from gradzip.exchange import PSync, mix_seed
from gradzip.optim import PowerSGD

import cases


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.conv = torch.nn.Parameter(torch.randn(6, 2, 3, 3, generator=g) * 0.3)   # 6 x 18
        self.w1 = torch.nn.Parameter(torch.randn(20, 12, generator=g) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(20, 12, generator=g) * 0.3)           # same shape: batched
        self.small = torch.nn.Parameter(torch.randn(3, 3, generator=g) * 0.3)          # not worth compressing
        self.bias = torch.nn.Parameter(torch.randn(20, generator=g) * 0.3)

    def loss(self, x):
        h = torch.nn.functional.conv2d(x, self.conv).flatten(1).view(-1, 12, 8).sum(-1)  # (b, 12)
        h = torch.tanh(h @ self.w1.T + self.bias) + torch.tanh(h @ self.w2.T)
        return (h[:, :3] @ self.small).pow(2).mean()


def _x(step, rank):
    return torch.randn(5, 2, 6, 6, generator=torch.Generator().manual_seed(31 * step + rank))


def _gram_schmidt(p):
    p = p.clone()
    for i in range(p.shape[1]):
        p[:, i] /= p[:, i].norm()
        for j in range(i + 1, p.shape[1]):
            p[:, j] -= (p[:, i] @ p[:, j]) * p[:, i]
    return p


def reference(n, steps, lr, momentum, wd, rank, start_iter, error_feedback=True, warm_start=True):
    """The spec's box, written out per tensor in float64 from the workers' gradients."""
    nets = [Net() for _ in range(n)]
    names = [k for k, _ in nets[0].named_parameters()]
    err = [{} for _ in range(n)]
    qs, buf = {}, {}
    for t in range(1, steps + 1):
        grads = []
        for r, net in enumerate(nets):
            net.zero_grad()
            net.loss(_x(t, r)).backward()
            grads.append({k: p.grad.double() for k, p in net.named_parameters()})
        for key_i, name in enumerate(names):
            p0 = dict(nets[0].named_parameters())[name]
            if t > start_iter and should_compress(p0.shape, rank, 2.0):
                rows = p0.shape[0]
                cols = p0.numel() // rows
                r_ = min(rank, rows, cols)
                ms = [grads[r][name].reshape(rows, cols) + err[r].get(name, 0) for r in range(n)]
                q = qs.get(name) if warm_start else None
                if q is None:
                    seed = mix_seed(0, key_i) if warm_start else mix_seed(0, t, key_i)
                    q = random_q(cols, r_, seed).double()
                p_hat = _gram_schmidt(sum(m @ q for m in ms) / n)
                q = sum(m.T @ p_hat for m in ms) / n
                approx = p_hat @ q.T
                qs[name] = q
                for r in range(n):
                    if error_feedback:
                        err[r][name] = ms[r] - approx
                agg = approx.reshape(p0.shape)
            else:
                agg = sum(grads[r][name] for r in range(n)) / n
            d = agg + wd * p0.detach().double()
            buf[name] = d if name not in buf else momentum * buf[name] + d
            with torch.no_grad():
                for net in nets:
                    dict(net.named_parameters())[name].sub_((lr * buf[name]).float())
    return [p.detach() for p in nets[0].parameters()], err


def run_method(comm, steps, **options):
    net = Net()
    opt = PowerSGD(net.parameters(), comm=comm, **options)
    for t in range(1, steps + 1):
        opt.zero_grad()
        net.loss(_x(t, comm.rank)).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()], opt, {k: dict(v) for k, v in opt.state.items()}


@pytest.mark.parametrize("rank,options", [(1, {}), (2, dict(momentum=0.9, weight_decay=0.01)),
                                          (3, dict(momentum=0.9)), (2, dict(warm_start=False)),
                                          (1, dict(use_error_feedback=False, start_iter=0))])
def test_method_follows_the_spec_box(rank, options):
    opts = dict(lr=0.05, rank=rank, start_iter=2)
    opts.update(options)
    outs = gradzip.simulate(2, lambda c: run_method(c, 7, **opts))
    expected, _ = reference(2, 7, opts["lr"], opts.get("momentum", 0.0), opts.get("weight_decay", 0.0), rank,
                            opts["start_iter"], opts.get("use_error_feedback", True), opts.get("warm_start", True))
    for got, want in zip(outs[0][0], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(outs[0][0], outs[1][0]):
        assert torch.equal(a, b)   # replicas identical


def test_error_feedback_invariant_and_state():
    """epfml's contract: M = M̂ + e, with M̂ the same on every worker."""
    def fn(comm):
        net = Net()
        opt = PowerSGD(net.parameters(), 0.0, comm=comm, rank=2, start_iter=0)   # lr 0: x fixed
        net.loss(_x(1, comm.rank)).backward()
        g = net.w1.grad.clone()
        x = net.w1.detach().clone()
        opt.step()
        return g, opt.state[net.w1], opt.state[net.bias], x, net.w1.detach().clone()
    outs = gradzip.simulate(2, fn)
    approx = [g - st["error"] for g, st, _, _, _ in outs]
    torch.testing.assert_close(approx[0], approx[1], rtol=1e-5, atol=1e-6)
    assert outs[0][1]["q"].shape == (12, 2)
    assert torch.equal(outs[0][1]["q"], outs[1][1]["q"])
    assert "error" not in outs[0][2]   # vectors go dense, no error
    assert torch.linalg.matrix_rank(approx[0]) == 2


def test_start_iter_steps_are_momentum_ssgd():
    opts = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
    ss = cases.simulate_method(3, "ssgd", opts)
    cases.assert_same_runs(cases.simulate_method(3, "powersgd", dict(opts, start_iter=5)), ss, atol=1e-7)
    on = cases.simulate_method(3, "powersgd", dict(opts, start_iter=4))
    assert max((a - b).abs().max().item() for a, b in zip(on[0], ss[0])) > 1e-4


def test_bytes_and_compression_ratio():
    steps = 3
    outs = gradzip.simulate(2, lambda c: run_method(c, steps, lr=0.05, rank=1, start_iter=0))
    opt = outs[0][1]
    # compressed: conv 6x18, w1 and w2 20x12 (rank 1: P rows, Q cols); dense: small 3x3, bias 20
    p_bytes, q_bytes, dense = 4 * (6 + 20 + 20), 4 * (18 + 12 + 12), 4 * (9 + 20)
    expected = steps * sum(allreduce_wire_bytes(b, 2) for b in (p_bytes, q_bytes, dense))
    assert opt.bytes_sent == expected
    total = 4 * sum(p.numel() for p in Net().parameters())
    assert opt.compression_ratio == pytest.approx(total / (p_bytes + q_bytes + dense))


def test_state_dict_resume_is_exact():
    def run(comm, split):
        net = Net()
        make = lambda: PowerSGD(net.parameters(), 0.05, comm=comm, rank=2, start_iter=1, momentum=0.9)
        opt = make()
        for t in range(1, 7):
            if t == split:
                state = opt.state_dict()
                opt = make()
                opt.load_state_dict(state)
            opt.zero_grad()
            net.loss(_x(t, comm.rank)).backward()
            opt.step()
        return [p.detach().clone() for p in net.parameters()]
    a = gradzip.simulate(2, lambda c: run(c, None))
    b = gradzip.simulate(2, lambda c: run(c, 4))
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)


def test_bad_options():
    p = [torch.nn.Parameter(torch.zeros(3, 3))]
    for kwargs, msg in [(dict(rank=0), "rank must be an integer >= 1"), (dict(start_iter=-1), "start_iter"),
                        (dict(min_compression_rate=-1), "min_compression_rate")]:
        with pytest.raises(GradzipError, match=msg):
            PowerSGD(p, 0.1, **kwargs)
    with pytest.raises(GradzipError, match="rank must be"):
        build("powersgd:rank=0")


def test_codec_one_round_projection():
    codec = build("powersgd:rank=2")
    g = torch.Generator().manual_seed(0)
    m = torch.randn(30, 4, 5, generator=g)
    packet = codec.compress(m, seed=9)
    assert packet.nbytes == 4 * 2 * 30 == codec.wire_nbytes(m.shape)
    decoded = codec.decompress(packet)
    q = packet.meta["q"]
    torch.testing.assert_close(q.T @ q, torch.eye(2), rtol=0, atol=1e-6)
    torch.testing.assert_close(decoded.view(30, 20), m.view(30, 20) @ q @ q.T)
    again = codec.decompress(codec.compress(decoded, seed=9))   # a projection: idempotent
    torch.testing.assert_close(again, decoded, rtol=1e-5, atol=1e-6)
    v = torch.randn(7)
    assert torch.equal(codec.decompress(codec.compress(v)), v)          # vectors dense
    assert not should_compress((4, 4), 2, 2.0)

    def fn(comm):   # linear with a shared Q: one allreduce gives C(mean M)
        t = torch.randn(30, 20, generator=torch.Generator().manual_seed(comm.rank))
        psync = PSync(comm, codec)
        assert psync.routes([t]) == ["allreduce"]
        return t, psync([t], step=4, keys=[1]).aggregate[0]
    outs = gradzip.simulate(3, fn)
    mean = sum(t for t, _ in outs) / 3
    seed = mix_seed(0, 4, 1)
    torch.testing.assert_close(outs[0][1], codec.decompress(codec.compress(mean, seed)), rtol=1e-5, atol=1e-6)
