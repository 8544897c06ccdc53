"""Worker functions for the DDP hook tests (importable by spawned gloo processes)."""
from __future__ import annotations

import io
import pickle

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    """Conv (4-d), same-shape linears (batching), biases (dense), several DDP buckets."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.fc1 = nn.Linear(128, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 32)
        self.out = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.relu(self.fc3(F.relu(self.fc2(x))))
        return self.out(x)


def batch(rank: int, step: int, size: int = 16):
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + 1)
    return torch.randn(size, 1, 8, 8, generator=g), torch.randint(0, 10, (size,), generator=g)


def make_ddp(bucket_cap_mb: float = 0.005):
    torch.manual_seed(0)
    net = Net()
    return net, DDP(net, bucket_cap_mb=bucket_cap_mb)


def train(comm, ddp, opt, steps, first=0, accumulate=1):
    for step in range(first, first + steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = batch(comm.rank, step * accumulate + micro)
            if micro + 1 < accumulate:
                with ddp.no_sync():
                    F.cross_entropy(ddp(x), y).backward()
            else:
                F.cross_entropy(ddp(x), y).backward()
        opt.step()


def params(net):
    return [p.detach().clone() for p in net.parameters()]


def serialized(hook):
    """PyTorch's hook, each bucket finished before the next starts. Unwrapped, its chained
    allreduces are issued from future callbacks, in an order that can differ between
    ranks, and gloo aborts ("Received data size doesn't match expected size"); waiting
    here changes no number, only the timing."""
    def run(state, bucket):
        fut = hook(state, bucket)
        fut.wait()
        return fut
    return run


def powersgd_vs_torch_many(comm, configs):
    """:func:`powersgd_vs_torch` for each ``(args, kwargs)`` in ``configs`` (one spawn)."""
    return [powersgd_vs_torch(comm, *args, **kwargs) for args, kwargs in configs]


def powersgd_vs_torch(comm, rank, steps=20, batch_same_shape=False, start=2, overlap=True, seed=0, torch_seed=None):
    """The same model, data, bucket layout and options under PyTorch's powerSGD_hook and
    gradzip's powersgd_hook; parameters after ``steps`` steps of momentum SGD."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    import gradzip.integrations.ddp

    out = {}
    for impl in ("torch", "gradzip"):
        net, ddp = make_ddp()
        if impl == "torch":
            state = torch_psgd.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=start,
                                             min_compression_rate=2,
                                             random_seed=seed if torch_seed is None else torch_seed,
                                             batch_tensors_with_same_shape=batch_same_shape)
            ddp.register_comm_hook(state, serialized(torch_psgd.powerSGD_hook))
        else:
            state = gradzip.integrations.ddp.PowerSGDState(rank=rank, start_iter=start, min_compression_rate=2, random_seed=seed,
                                              batch_tensors_with_same_shape=batch_same_shape, model=ddp,
                                              overlap=overlap)
            ddp.register_comm_hook(state, gradzip.integrations.ddp.powersgd_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        train(comm, ddp, opt, steps)
        out[impl] = params(net)
    return out


def none_vs_default(comm, steps=8, accumulate=1):
    import gradzip.integrations.ddp

    out = {}
    for impl in ("default", "none"):
        net, ddp = make_ddp()
        if impl == "none":
            ddp.register_comm_hook(gradzip.integrations.ddp.hook("none", model=ddp), gradzip.integrations.ddp.codec_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        train(comm, ddp, opt, steps, accumulate=accumulate)
        out[impl] = params(net)
    return out


def _new_state(kind, ddp, model_keys=True):
    import gradzip.integrations.ddp

    model = ddp if model_keys else None
    if kind == "powersgd":
        return gradzip.integrations.ddp.PowerSGDState(rank=2, start_iter=1, model=model), gradzip.integrations.ddp.powersgd_hook
    return gradzip.integrations.ddp.hook(kind, error_feedback=True, model=model), gradzip.integrations.ddp.codec_hook


def checkpoint_resume(comm, kind, steps=6, model_keys=True, via="state_dict", weights_only=False):
    """Train ``2·steps`` steps straight; and ``steps`` steps, checkpoint (model, optimizer,
    hook state), a NEW DDP instance restored from it, ``steps`` more. Both parameter lists.
    ``weights_only=True``: the checkpoint loads with ``torch.load``'s defaults (safe loading)."""
    import gradzip.integrations.ddp

    net, ddp = make_ddp()
    state, fn = _new_state(kind, ddp, model_keys)
    ddp.register_comm_hook(state, fn)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    train(comm, ddp, opt, steps)
    blob = io.BytesIO()
    hook_state = pickle.dumps(state) if via == "pickle" else state.state_dict()
    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "hook": hook_state}, blob)
    train(comm, ddp, opt, steps, first=steps)
    straight = params(net)
    residual_keys = sorted((state.errors if kind == "powersgd" else state.residuals).keys())

    blob.seek(0)
    ckpt = torch.load(blob) if weights_only else torch.load(blob, weights_only=False)
    torch.manual_seed(123)           # a different initialisation, overwritten by the checkpoint
    net2 = Net()
    net2.load_state_dict(ckpt["model"])
    ddp2 = DDP(net2, bucket_cap_mb=0.005)
    if via == "pickle":
        state2 = pickle.loads(ckpt["hook"])
        if model_keys:
            state2.bind(ddp2)
        fn2 = gradzip.integrations.ddp.powersgd_hook if kind == "powersgd" else gradzip.integrations.ddp.codec_hook
    else:
        state2, fn2 = _new_state(kind, ddp2, model_keys)
        state2.load_state_dict(ckpt["hook"])
    ddp2.register_comm_hook(state2, fn2)
    opt2 = torch.optim.SGD(ddp2.parameters(), lr=0.05, momentum=0.9)
    opt2.load_state_dict(ckpt["opt"])
    train(comm, ddp2, opt2, steps, first=steps)
    # control: the same restore without the hook state (fresh residuals) must differ
    torch.manual_seed(123)
    net3 = Net()
    net3.load_state_dict(ckpt["model"])
    ddp3 = DDP(net3, bucket_cap_mb=0.005)
    state3, fn3 = _new_state(kind, ddp3, model_keys)
    state3.iter = steps   # same phase and seeds: only the residuals / errors and Q are lost
    ddp3.register_comm_hook(state3, fn3)
    opt3 = torch.optim.SGD(ddp3.parameters(), lr=0.05, momentum=0.9)
    opt3.load_state_dict(ckpt["opt"])
    train(comm, ddp3, opt3, steps, first=steps)
    return {"straight": straight, "resumed": params(net2), "fresh": params(net3), "keys": residual_keys,
            "bytes": state.bytes_sent}


def every_codec(comm, steps=2):
    """Each registered codec through the generic hook (error feedback on): final params."""
    import gradzip.integrations.ddp
    from gradzip.compressors import names

    out = {}
    for name in names():
        net, ddp = make_ddp()
        state = gradzip.integrations.ddp.hook(name, model=ddp, single_round_powersgd=name == "powersgd")
        ddp.register_comm_hook(state, gradzip.integrations.ddp.codec_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        train(comm, ddp, opt, steps)
        out[name] = (params(net), state.bytes_sent, state.iter)
    return out


def _hooked_ddp(kind: str, nonfinite: str):
    """A DDP model with gradzip's hook for ``kind`` (``"powersgd"``: ``powersgd_hook`` at
    rank 1 from the first step; else ``codec_hook`` with that codec) under ``nonfinite``;
    returns ``(net, ddp, state, memory)``, ``memory()`` a copy of the hook's error state."""
    import gradzip.integrations.ddp

    net, ddp = make_ddp()
    if kind == "powersgd":
        state = gradzip.integrations.ddp.PowerSGDState(rank=1, start_iter=0, model=ddp, nonfinite=nonfinite)
        ddp.register_comm_hook(state, gradzip.integrations.ddp.powersgd_hook)
        return net, ddp, state, lambda: {**{("e", k): v.clone() for k, v in state.errors.items()},
                                         **{("q", k): v.clone() for k, v in state.qs.items()}}
    state = gradzip.integrations.ddp.hook(kind, model=ddp, nonfinite=nonfinite)
    ddp.register_comm_hook(state, gradzip.integrations.ddp.codec_hook)
    return net, ddp, state, lambda: {k: v.clone() for k, v in state.residuals.items()}


def overflow_keeps_state(comm):
    """An overflowed step (inf / NaN gradients, as GradScaler skips) leaves the hook state
    (``nonfinite="off"``, the GradScaler mode: the Inf passes through to the scaler)."""
    out = {}
    for kind in ("topk:ratio=0.1", "powersgd"):
        net, ddp, _, memory = _hooked_ddp(kind, "off")
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        train(comm, ddp, opt, 2)
        before = memory()
        x, y = batch(comm.rank, 99)
        opt.zero_grad()
        (F.cross_entropy(ddp(x), y) * float("inf")).backward()
        after = memory()
        out[kind] = (len(before) > 0 and before.keys() == after.keys()
                     and all(torch.equal(before[k], after[k]) for k in before))
    return out


def native_vs_psync(comm, steps=4):
    """The hook with ``none``: buckets sent as DDP sends them (the allreduce of the bucket's
    own buffer) against the same hook made to take its PSync path (copies into gradzip's
    buckets). Both parameter lists, and whether the native run built a PSync."""
    import gradzip.integrations.ddp
    from gradzip.integrations.ddp.codec import CodecState

    out = {}
    for path in ("native", "psync"):
        net, ddp = make_ddp()
        state = gradzip.integrations.ddp.hook("none", model=ddp)
        if path == "psync":
            state.sends_uncompressed = lambda *args: False   # the copying path
        ddp.register_comm_hook(state, gradzip.integrations.ddp.codec_hook)
        train(comm, ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), steps)
        out[path] = params(net)
        out[f"{path}_built_psync"] = state._psync is not None
        out[f"{path}_iter"] = state.iter
    assert CodecState.sends_uncompressed is not None
    return out


def switch_folds_residual(comm):
    """auto:1bit in the hook: step 1 compresses every unit (a link no byte crosses), then
    the decision switches every unit to none (as a recalibration would). Step 2's bucket
    sends the kept residual with the gradient, as DDP sends it: the gradients after step 2
    are ``mean_i(g_i + e_i)`` bit for bit, and the residuals are dropped."""
    import dataclasses

    import torch.distributed as dist

    import gradzip.integrations.ddp
    from gradzip.exchange.planner import Link

    net, ddp = make_ddp()
    state = gradzip.integrations.ddp.hook("auto:1bit", model=ddp, link=Link(1e-9, 0.0))
    ddp.register_comm_hook(state, gradzip.integrations.ddp.codec_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    train(comm, ddp, opt, 2)   # DDP rebuilds its buckets after the first step: decided again at step 2
    kept = {k: v.clone() for k, v in state.residuals.items()}
    for key, d in list(state.decisions.items()):
        state.decisions[key] = dataclasses.replace(d, choices=("none",) * len(d.choices))
    state.psync.plan_version += 1
    x, y = batch(comm.rank, 2)
    opt.zero_grad()
    with ddp.no_sync():   # this rank's own gradient, nothing exchanged
        F.cross_entropy(ddp(x), y).backward()
    local = {state._key(p): p.grad.clone() for p in ddp.parameters()}
    opt.zero_grad()
    F.cross_entropy(ddp(x), y).backward()
    sent = torch.cat([(local[k] + kept[k]).reshape(-1) if k in kept else local[k].reshape(-1)
                      for k in sorted(local)])
    every = [torch.empty_like(sent) for _ in range(comm.world_size)]
    dist.all_gather(every, sent)
    expected = (every[0] + every[1]) / 2
    got = torch.cat([p.grad.reshape(-1) for k, p in sorted((state._key(p), p) for p in ddp.parameters())])
    return {"kept": len(kept), "equal": torch.equal(got, expected), "left": len(state.residuals)}


def ddp_suite(comm):
    """Everything test_ddp checks on real processes, in one spawn (CI time)."""
    return {
        "native": native_vs_psync(comm),
        "switch": switch_folds_residual(comm),
        "none": none_vs_default(comm, steps=6),
        "none_accumulate": none_vs_default(comm, steps=3, accumulate=2),
        "ckpt_topk_pickle": checkpoint_resume(comm, "topk:ratio=0.1", 4, True, "pickle"),
        "ckpt_powersgd_first_seen": checkpoint_resume(comm, "powersgd", 4, False, "state_dict"),
        "codecs": every_codec(comm),
        "overflow": overflow_keeps_state(comm),
    }


# --- issue 12 items 6-8 -------------------------------------------------------------------
def _error_text(fn):
    """``fn()``'s GradzipError message, or None when it returns."""
    from gradzip.errors import GradzipError

    try:
        fn()
    except GradzipError as e:   # raised inside a DDP hook, it reaches backward() as it is
        return str(e)
    return None


def qsgd_default_stays_finite(comm, steps=30):
    """The issue's scenario: ``qsgd`` with the hook's default error feedback, a lr that
    plain SGD trains with; the loss of every step (NaN there on the original hook)."""
    import gradzip.integrations.ddp

    net, ddp = make_ddp()
    state = gradzip.integrations.ddp.hook("qsgd:levels=1", model=ddp)
    ddp.register_comm_hook(state, gradzip.integrations.ddp.codec_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = batch(comm.rank, step)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "error_feedback": state.error_feedback}


def nonfinite_policies(comm):
    """An Inf in rank 1's gradient only, under each policy of both hooks: the error on
    each rank ("raise"), or the gradients and hook state after the step ("skip")."""
    out = {}
    for kind in ("topk:ratio=0.1", "powersgd", "none"):
        for policy in ("raise", "skip"):
            net, ddp, state, memory = _hooked_ddp(kind, policy)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
            train(comm, ddp, opt, 2)
            before = memory()
            x, y = batch(comm.rank, 50)
            opt.zero_grad()
            scale = float("inf") if comm.rank == 1 else 1.0

            def bad_step():
                (F.cross_entropy(ddp(x), y) * scale).backward()

            error = _error_text(bad_step)
            res = out.setdefault(kind, {})[policy] = {"error": error}
            if policy == "skip":
                after = memory()
                res.update(
                    grads_zero=all(p.grad is not None and not p.grad.any() for p in net.parameters()),
                    state_kept=(len(before) > 0 or kind == "none") and before.keys() == after.keys()
                    and all(torch.equal(before[k], after[k]) for k in before),
                    skipped=state.skipped_steps, iter=state.iter)
                train(comm, ddp, opt, 1, first=60)   # and training goes on
                res["finite_after"] = all(bool(torch.isfinite(p).all()) for p in net.parameters())
    return out


def ddp_double_sync(comm):
    """A gradzip optimizer over the parameters of a DDP module: refused without a no-op
    hook (plain DDP, or a communicating hook), accepted with ``noop_hook`` and then equal
    to the same optimizer without DDP."""
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

    import gradzip.integrations.ddp
    from gradzip.optim import SSGD

    def run(wrap, steps=3):
        torch.manual_seed(0)
        net = Net()
        model = net
        if wrap is not None:
            model = DDP(net, bucket_cap_mb=0.005)
            if wrap == "noop":
                model.register_comm_hook(None, noop_hook)
            elif wrap == "codec":
                model.register_comm_hook(gradzip.integrations.ddp.hook("none", model=model), gradzip.integrations.ddp.codec_hook)
        opt = SSGD(model.parameters(), lr=0.05, comm=comm, compressor="qsgd")

        def go():
            for step in range(steps):
                x, y = batch(comm.rank, step)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
        return _error_text(go), params(net)

    plain, noop, codec, alone = run("plain"), run("noop"), run("codec"), run(None)
    return {"plain": plain[0], "codec": codec[0], "noop": noop[0], "alone": alone[0],
            "noop_equals_alone": all(torch.equal(a, b) for a, b in zip(noop[1], alone[1]))}


def fixes_suite(comm):
    """The issue-12 DDP cases in one spawn."""
    return {
        "qsgd": qsgd_default_stays_finite(comm),
        "nonfinite": nonfinite_policies(comm),
        "double": ddp_double_sync(comm),
        "ckpt_powersgd_weights_only": checkpoint_resume(comm, "powersgd", 4, True, "state_dict", weights_only=True),
        "ckpt_topk_weights_only": checkpoint_resume(comm, "topk:ratio=0.1", 4, True, "state_dict", weights_only=True),
    }
