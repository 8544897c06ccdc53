"""gradzip.PerTensor (compressors.policy): a codec per tensor by name and size, through
PSync in every method and in the DDP hook; the hook's dense warm-up (start_iter)."""
from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
import gradzip.integrations.ddp
from gradzip import GradzipError, PerTensor
from gradzip.optim import CSER, EFSGD


def _net() -> torch.nn.Module:
    net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    with torch.no_grad():
        for i, p in enumerate(net.parameters()):
            p.copy_(torch.linspace(-1, 1, p.numel()).reshape(p.shape) * (i + 1))
    return net


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def test_the_choice_rules_then_size_then_default_and_bad_input_is_named():
    policy = PerTensor("topk:ratio=0.1", {"emb.*": "qsgd", "*.bias": "fp16"}, min_numel=100, skip_1d=True)
    big, small, vec = torch.zeros(20, 20), torch.zeros(5, 5), torch.zeros(400)
    assert policy.resolve("emb.weight", big).name == "qsgd"        # rule first
    assert policy.resolve("fc.bias", vec).name == "fp16"           # a rule beats skip_1d
    assert policy.resolve("fc.weight", small).name == "none"       # below min_numel
    assert policy.resolve("norm.weight", vec).name == "none"       # 1-D
    assert policy.resolve("fc.weight", big).spec == "topk:ratio=0.1"
    assert policy.plan([("fc.weight", big), ("fc.bias", vec)]) == {"fc.weight": "topk:ratio=0.1", "fc.bias": "fp16"}
    assert not policy.unbiased and PerTensor("qsgd", skip_1d=True).unbiased
    assert gradzip.compressors.build(policy) is policy              # goes wherever a codec goes
    with pytest.raises(GradzipError, match="named_parameters"):
        policy.resolve(None, big)
    with pytest.raises(GradzipError, match="not a codec itself|is not one itself"):
        policy.compress(big)
    with pytest.raises(GradzipError, match="rule #0"):
        PerTensor("none", ["*.bias"])
    with pytest.raises(GradzipError, match="unknown compressor"):
        PerTensor("nope")


def test_a_method_with_a_policy_equals_its_codecs_applied_tensor_by_tensor():
    """EF-SGD under PerTensor(topk, skip_1d) gives bit for bit the weights of EF-SGD(topk) over
    the weights and the biases of EF-SGD(none) over the biases; named rules reach CSER's two
    exchanges; the policy sends fewer bytes than dense and more than top-k everywhere."""
    def fn(comm):
        nets = [_net() for _ in range(4)]
        policy = PerTensor("topk:ratio=0.25", skip_1d=True)
        opts = [EFSGD(nets[0].named_parameters(), lr=0.1, momentum=0.9, comm=comm, compressor=policy),
                EFSGD([p for p in nets[1].parameters() if p.dim() > 1], lr=0.1, momentum=0.9, comm=comm,
                      compressor="topk:ratio=0.25"),
                EFSGD([p for p in nets[1].parameters() if p.dim() == 1], lr=0.1, momentum=0.9, comm=comm,
                      compressor="none"),
                EFSGD(nets[2].parameters(), lr=0.1, momentum=0.9, comm=comm, compressor="topk:ratio=0.25"),
                EFSGD(nets[3].parameters(), lr=0.1, momentum=0.9, comm=comm, compressor="none")]
        for step in range(3):
            x, y = _batch(comm.rank, step)
            for net in nets:
                torch.nn.functional.cross_entropy(net(x), y).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        cser = CSER(_net().named_parameters(), lr=0.1, comm=comm, H=2,
                    c1=PerTensor("randblock:ratio=0.5", {"*.bias": "none"}),
                    c2=PerTensor("topk:ratio=0.5", {"*.bias": "none"}))
        codecs = sorted({c.spec for ps in (cser.psync1, cser.psync2)
                         for c in (ps.codec_for(k, p) for k, p in enumerate(cser._all_params()))})
        return ([p.clone() for p in nets[0].parameters()], [p.clone() for p in nets[1].parameters()],
                [o.bytes_sent for o in opts], codecs)

    for policy_params, split_params, sent, codecs in gradzip.simulate(2, fn):
        assert all(torch.equal(a, b) for a, b in zip(policy_params, split_params))
        assert sent[3] < sent[0] < sent[4]
        assert codecs == ["none", "randblock:ratio=0.5", "topk:ratio=0.5"]


def test_the_hook_takes_a_policy_by_parameter_name_and_a_dense_warm_up(world_of_one):
    """One worker: the aggregate is the codec's own output. Steps 1-2 (start_iter=2) leave
    every gradient exact; from step 3 the weights are top-k'd (with error feedback) and the
    biases, named by the rule, stay exact; the state round-trips."""
    net = _net()
    ddp = DDP(net)
    state = gradzip.integrations.ddp.hook(PerTensor("topk:ratio=0.25", {"*.bias": "none"}), model=ddp, start_iter=2)
    ddp.register_comm_hook(state, gradzip.integrations.ddp.codec_hook)
    exact = []
    for step in range(4):
        x, y = _batch(0, step)
        raw = torch.autograd.grad(torch.nn.functional.cross_entropy(net(x), y), list(net.parameters()))
        ddp.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        exact.append([torch.equal(p.grad, g) for p, g in zip(net.parameters(), raw)])
    assert exact[0] == exact[1] == [True] * 4                      # dense warm-up
    assert exact[2] == exact[3] == [False, True, False, True]       # weights compressed, biases not
    assert sorted(state.residuals) == [0, 1, 2, 3] and state.iter == 4
    saved = state.state_dict()
    assert saved["start_iter"] == 2 and saved["codec"].startswith("per_tensor(")
    fresh = gradzip.integrations.ddp.hook(PerTensor("topk:ratio=0.25", {"*.bias": "none"}), model=ddp)
    fresh.load_state_dict(saved)
    assert fresh.start_iter == 2 and fresh.iter == 4
    with pytest.raises(GradzipError, match="PerTensor policy"):
        gradzip.integrations.ddp.hook("topk:ratio=0.25", model=ddp).load_state_dict(saved)
    with pytest.raises(GradzipError, match="start_iter"):
        gradzip.integrations.ddp.hook("topk:ratio=0.25", start_iter=-1)
