"""Worker functions of the backward-overlap tests (tests/test_overlap.py, optim/overlap.py):
importable, so spawned gloo processes can run them."""
from __future__ import annotations

import copy

import torch

import cases

#: Every method whose exchange starts during backward, with options that exercise momentum,
#: weight decay, residuals and several codecs.
OVERLAPPED = {
    "ssgd": ("ssgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "ssgd-nesterov": ("ssgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    "ssgd-qsgd": ("ssgd", {"lr": 0.1, "compressor": "qsgd", "momentum": 0.5}),
    "ssgd-sign": ("ssgd", {"lr": 0.01, "compressor": "sign"}),
    "ssgd-fp16": ("ssgd", {"lr": 0.1, "compressor": "fp16"}),
    "efsgd-topk": ("efsgd", {"lr": 0.1, "compressor": "topk:ratio=0.3", "momentum": 0.5}),
    "efsgd-1bit": ("efsgd", {"lr": 0.1, "compressor": "1bit", "weight_decay": 0.01}),
    "efsgd-randomk": ("efsgd", {"lr": 0.1, "compressor": "randomk:ratio=0.4"}),
    "bitsgd": ("bitsgd", {"lr": 0.1, "threshold": 0.05, "momentum": 0.9, "nesterov": True}),
    "csea": ("csea", {"lr": 0.1, "compressor": "topk:ratio=0.3", "momentum": 0.9}),
    "csea-randblock": ("csea", {"lr": 0.1, "compressor": "randblock:ratio=0.3"}),
    "dgc": ("dgc", {"lr": 0.1, "ratio": 0.3, "warmup_steps": 2, "lr_warmup_steps": 3, "momentum": 0.9,
                    "weight_decay": 0.01}),
    "dgc-dense": ("dgc", {"lr": 0.1, "ratio": 1.0, "momentum": 0.5}),
    "cser": ("cser", {"lr": 0.1, "H": 2, "c1": "topk:ratio=0.3", "c2": "topk:ratio=0.5", "momentum": 0.5}),
    "cser-randblock": ("cser", {"lr": 0.1, "H": 3, "c1": "randblock:ratio=0.3", "c2": "randblock:ratio=0.5"}),
    "lars-topk": ("lars", {"lr": 1.0, "momentum": 0.9, "weight_decay": 0.01, "compressor": "topk:ratio=0.3"}),
    "adamw": ("adamw", {"lr": 0.01, "weight_decay": 0.01}),
}

#: Small buckets, so that the tiny model's four tensors make several (and one larger than a
#: bucket): buckets [[bias 2, weight 2, bias 1], [weight 1]] in reverse order.
BUCKET_BYTES = 100


#: Gradient edits between backward and ``step()`` that no version counter sees (issue 35,
#: item 1): through ``.data``, new memory under the same tensor, a numpy view.
EDITS = {
    "data_mul": lambda ps: [p.grad.data.mul_(0.5) for p in ps],
    "data_clamp": lambda ps: [p.grad.data.clamp_(-0.01, 0.01) for p in ps],
    "data_zero": lambda ps: ps[0].grad.data.zero_(),
    "data_neg": lambda ps: [p.grad.data.neg_() for p in ps],
    "data_assign": lambda ps: [setattr(p.grad, "data", p.grad.data * 2) for p in ps],
    "numpy": lambda ps: ps[-1].grad.numpy().__imul__(3),
}


def make_opt(model, comm, name: str, overlap: bool, **extra):
    import gradzip

    method, options = OVERLAPPED[name]
    return gradzip.optim.METHODS[method](model.parameters(), comm=comm, bucket_bytes=BUCKET_BYTES,
                                         overlap_backward=overlap, **{**options, **extra})


def model_and_opt(comm, name: str, overlap: bool, **extra):
    model = cases.tiny_model()
    return model, make_opt(model, comm, name, overlap, **extra)


def loss_of(model, t: int, comm, part: int = 0):
    x, y = cases.regression_batch(t, comm.rank, comm.world_size)
    if part:  # a micro-batch: half of this worker's batch
        x, y = (x[:3], y[:3]) if part == 1 else (x[3:], y[3:])
    return torch.nn.functional.mse_loss(model(x), y)


def train(comm, name: str, how: str = "hooked", steps: int = 5, **extra):
    """``steps`` steps of method ``name`` (OVERLAPPED); ``how``:

    * ``"hooked"`` / ``"off"``: loss.backward(), with ``overlap_backward`` on / off;
    * ``"by_hand"``: overlap on, but gradients computed with ``torch.autograd.grad`` and
      set by hand (no hook fires: step() feeds and launches every bucket);
    * ``"none_grads"`` / ``"zero_grads"``: ``zero_grad(set_to_none=True / False)``, hooked;
    * ``"closure"``: step(closure), hooked;
    * ``"accumulate"`` / ``"accumulate_off"``: two micro-batches per step, the first inside
      ``opt.accumulate()`` (hooked) / plain (off);
    * ``"scheduler"`` / ``"scheduler_off"``: a StepLR stepped after every step;
    * ``"clip"`` / ``"clip_off"``: clip_grad_norm_ between backward and step();
    * ``"create_graph"`` / ``"create_graph_off"``: ``backward(create_graph=True)`` (the hooks
      run in grad mode, gradients with a graph);
    * a key of :data:`EDITS` (``+ "_off"``): that edit between backward and step().

    Returns (final parameters, final state_dict)."""
    off = how.endswith("off")
    model, opt = model_and_opt(comm, name, overlap=not off, **extra)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if how.startswith("scheduler") else None
    for t in range(1, steps + 1):
        if how == "by_hand":
            grads = torch.autograd.grad(loss_of(model, t, comm), list(model.parameters()))
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            opt.step()
        elif how == "closure":
            def closure():
                opt.zero_grad()
                loss = loss_of(model, t, comm)
                loss.backward()
                return loss
            opt.step(closure)
        elif how.startswith("accumulate"):
            opt.zero_grad()
            if off:
                loss_of(model, t, comm, part=1).backward()
            else:
                with opt.accumulate():
                    loss_of(model, t, comm, part=1).backward()
            loss_of(model, t, comm, part=2).backward()
            opt.step()
        else:
            opt.zero_grad(set_to_none=how != "zero_grads")
            loss_of(model, t, comm).backward(create_graph=how.startswith("create_graph"))
            if how.startswith("clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            elif how.removesuffix("_off") in EDITS:
                EDITS[how.removesuffix("_off")](list(model.parameters()))
            opt.step()
        if sched is not None:
            sched.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def every_variant(comm, names=tuple(OVERLAPPED), hows=("hooked", "off", "by_hand")):
    """{name: {how: train(...)}}."""
    return {name: {how: train(comm, name, how) for how in hows} for name in names}


def resumed(comm, name: str, split: int = 3, steps: int = 5):
    """train(hooked), with model and optimizer saved before step ``split`` and training
    continued in fresh ones loaded from that state."""
    model, opt = model_and_opt(comm, name, overlap=True)
    for t in range(1, steps + 1):
        if t == split:
            saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
            model = cases.tiny_model()
            model.load_state_dict(saved_model)
            opt = make_opt(model, comm, name, overlap=True)
            opt.load_state_dict(saved_opt)
        opt.zero_grad()
        loss_of(model, t, comm).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def bad_in_backward(comm, name: str, nonfinite: str, drop: bool = False, bad_step: int = 3, bad_rank: int = 1,
                    steps: int = 5):
    """A NaN that the hooks see (the loss of rank ``bad_rank`` at ``bad_step`` is multiplied
    by NaN, so every gradient is NaN in backward); ``drop``: that step left out instead.
    (parameters, state_dict, skipped steps)."""
    model, opt = model_and_opt(comm, name, overlap=True, nonfinite=nonfinite)
    for t in range(1, steps + 1):
        if drop and t == bad_step:
            continue
        opt.zero_grad()
        loss = loss_of(model, t, comm)
        if t == bad_step and comm.rank == bad_rank:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict(), opt.skipped_steps


def twice_without_context(comm):
    """Two backward passes before step() without ``accumulate()``: refused."""
    model, opt = model_and_opt(comm, "efsgd-topk", overlap=True)
    loss_of(model, 1, comm).backward()
    loss_of(model, 1, comm).backward()
    opt.step()


def different_lr(comm):
    """Rank 1 has another lr: the settings check runs in the first hook, before any
    hook-launched collective, and stops every worker."""
    import gradzip

    model = cases.tiny_model()
    opt = gradzip.optim.SSGD(model.parameters(), comm=comm, lr=0.1 if comm.rank == 0 else 0.2,
                             bucket_bytes=BUCKET_BYTES)
    loss_of(model, 1, comm).backward()
    opt.step()


#: Methods whose exchange reads large gradients as they are (S-SGD, EF-SGD sending a unit
#: uncompressed: the bucket's copy digests them) and one that sends a copy (top-k).
LARGE = {"ssgd": ("ssgd", {"lr": 0.1}), "efsgd-none": ("efsgd", {"lr": 0.1, "compressor": "none"}),
         "efsgd-topk": ("efsgd", {"lr": 0.1, "compressor": "topk:ratio=0.3"})}


class _Large(torch.nn.Module):
    def __init__(self, unused: bool):
        super().__init__()
        self.first, self.second = torch.nn.Linear(12, 400), torch.nn.Linear(400, 20)
        self.spare = torch.nn.Linear(20, 300) if unused else None   # never called: no gradient
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def large_model(unused: bool) -> torch.nn.Module:
    """Two layers whose weights are larger than a snapshot copies (kernels.digest.SMALL), the
    same on every worker; ``unused``: a last layer without a gradient, so the first bucket
    (the last parameters) waits for ``step()`` and every other bucket with it."""
    return _Large(unused)


def train_large(comm, name: str, edit: str | None, overlap: bool, unused: bool = False, steps: int = 3):
    """``steps`` steps of :data:`LARGE` ``name`` on :func:`large_model`, with the ``EDITS``
    edit (or none) between backward and ``step()``. Returns (parameters, state_dict)."""
    method, options = LARGE[name]
    import gradzip

    model = large_model(unused)
    opt = gradzip.optim.METHODS[method](model.parameters(), comm=comm, overlap_backward=overlap,
                                        bucket_bytes=8000, **options)
    gen = torch.Generator().manual_seed(comm.rank)
    for _ in range(steps):
        x, y = torch.randn(16, 12, generator=gen), torch.randn(16, 20, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if edit is not None:
            EDITS[edit]([p for p in model.parameters() if p.grad is not None])
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()
