"""gradzip.optim.Compressed: any torch optimizer with any codec (docs/algorithms.md
§Large-batch training, "Compressed(inner)")."""
import pytest
import torch

import gradzip
from gradzip.errors import GradzipError
from gradzip.optim import Compressed

import cases

F = torch.nn.functional


def train_compressed(comm, make_inner, steps=5, state_at=None, **options):
    """``steps`` steps of Compressed(make_inner(params)) on the regression task; the final
    parameters, the per-step (mean gradient of this worker, aggregate) pairs, the wrapper."""
    model = cases.tiny_model()
    opt = Compressed(make_inner(model.parameters()), comm=comm, **options)
    trail = []
    for t in range(1, steps + 1):
        x, y = cases.regression_batch(t, comm.rank, comm.world_size)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        trail.append((grads, [p.grad.clone() for p in model.parameters()]))
    return [p.detach().clone() for p in model.parameters()], trail, opt


def reference(make_inner, steps, n):
    """The inner optimizer alone, one process, on the concatenated batch of all n workers."""
    model = cases.tiny_model()
    opt = make_inner(model.parameters())
    for t in range(1, steps + 1):
        x = torch.cat([cases.regression_batch(t, r, n)[0] for r in range(n)])
        y = torch.cat([cases.regression_batch(t, r, n)[1] for r in range(n)])
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


ADAMW = lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("overlap", [True, False])
def test_compressed_none_equals_single_process_adamw_on_the_concatenated_batch(n, overlap):
    outs = gradzip.simulate(n, lambda c: train_compressed(c, ADAMW, steps=6, overlap_backward=overlap)[0])
    for params in outs:
        for p, e in zip(params, reference(ADAMW, 6, n)):
            torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-5)
    for params in outs[1:]:   # replicas stay bitwise identical
        assert all(torch.equal(a, b) for a, b in zip(outs[0], params))


def test_topk_with_error_feedback_conserves_every_gradient():
    """mean_j e_j(T) + Σ_t a_t = Σ_t mean_j g_j(t): nothing compression drops is lost."""
    n, steps = 3, 5
    outs = gradzip.simulate(n, lambda c: train_compressed(
        c, lambda ps: torch.optim.SGD(ps, lr=0.05), steps=steps, compressor="topk:ratio=0.3"))
    opts = [o[2] for o in outs]
    assert all(o.error_feedback for o in opts)
    params = list(opts[0].inner.param_groups[0]["params"])
    for i in range(len(params)):
        sent = sum(outs[0][1][t][1][i] for t in range(steps))
        owed = sum(o.state[list(o.inner.param_groups[0]["params"])[i]]["error"] for o in opts) / n
        grads = sum(outs[r][1][t][0][i] for r in range(n) for t in range(steps)) / n
        torch.testing.assert_close(sent + owed, grads, rtol=1e-5, atol=1e-6)
        assert owed.abs().sum() > 0   # the codec did drop something


def test_unbiased_codec_has_no_error_feedback_and_refuses_it():
    model = cases.tiny_model()
    assert not Compressed(torch.optim.SGD(model.parameters(), lr=0.1), compressor="qsgd").error_feedback
    with pytest.raises(GradzipError, match="unbiased"):
        Compressed(torch.optim.SGD(model.parameters(), lr=0.1), compressor="qsgd", error_feedback=True)
    with pytest.raises(GradzipError, match="inner must be a torch.optim.Optimizer"):
        Compressed(gradzip.optim.SSGD(model.parameters(), lr=0.1))


def test_resume_is_exact_and_schedulers_act_on_the_inner_groups():
    def run(comm, cut):
        model = cases.tiny_model()
        make = lambda: Compressed(ADAMW(model.parameters()), comm=comm, compressor="topk:ratio=0.3")
        opt = make()
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        for t in range(1, 7):
            if t == cut:   # a new wrapper and inner optimizer from the saved state
                saved, sched_state = opt.state_dict(), sched.state_dict()
                opt = make()
                opt.load_state_dict(saved)
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
                sched.load_state_dict(sched_state)
            x, y = cases.regression_batch(t, comm.rank, comm.world_size)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
        assert opt.param_groups is opt.inner.param_groups and opt.inner.param_groups[0]["lr"] == 0.01 / 8
        return [p.detach().clone() for p in model.parameters()]

    whole = gradzip.simulate(2, lambda c: run(c, None))
    resumed = gradzip.simulate(2, lambda c: run(c, 4))
    for a, b in zip(whole, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_load_refuses_a_state_without_the_inner_optimizer():
    opt = Compressed(ADAMW(cases.tiny_model().parameters()))
    with pytest.raises(GradzipError, match="'inner'"):
        opt.load_state_dict({k: v for k, v in opt.state_dict().items() if k != "inner"})


def test_a_group_added_later_joins_the_inner_optimizer_and_the_exchange():
    def run(comm):
        extra = torch.nn.Parameter(torch.ones(3))
        opt = Compressed(torch.optim.SGD(cases.tiny_model().parameters(), lr=0.1), comm=comm)
        opt.add_param_group({"params": [extra], "lr": 0.5})
        assert opt.param_groups is opt.inner.param_groups and opt.param_groups[-1]["params"] == [extra]
        (extra * (comm.rank + 1)).sum().backward()   # gradient 1 on rank 0, 2 on rank 1: mean 1.5
        opt.step()
        return extra.detach().clone()
    for out in gradzip.simulate(2, run):
        torch.testing.assert_close(out, torch.full((3,), 1 - 0.5 * 1.5))
