"""PyTorch's own data parallelism as rows of ``gradzip bench net``: the peers users run today.

In ``--algos`` the name ``ddp`` is ``torch.nn.parallel.DistributedDataParallel`` with
``torch.optim.SGD``; its "codec" is a PyTorch communication hook, unmodified:

* ``ddp``: DDP's own bucketed fp32 allreduce;
* ``ddp@fp16``: ``default_hooks.fp16_compress_hook``;
* ``ddp@powersgd:rank=R`` (options ``rank`` 1, ``start`` 2, ``buckets`` ``one``):
  ``powerSGD_hook`` with ``PowerSGDState(matrix_approximation_rank=R,
  start_powerSGD_iter=start)`` (error feedback and warm start on, torch's defaults).
  ``buckets=one`` puts every gradient in one DDP bucket: the unmodified hook issues its
  P and Q allreduces from future callbacks and, with several buckets, aborts on gloo
  (the callbacks of different buckets reach gloo in a different order on different
  ranks; see :mod:`gradzip.integrations.ddp`). ``buckets=each`` keeps DDP's buckets and waits for
  each bucket's future inside the hook (the same numbers, no overlap between buckets).

A peer trains the same model, data shard, batch and learning rate as a gradzip row
(:func:`run_peer` mirrors the harness's step: ``zero_grad``, forward, cross-entropy,
backward, ``step()``) and returns what :func:`gradzip.train.loop.run_worker` returns for
the table: a summary and trace spans. DDP overlaps its allreduces with the backward pass,
so the spans are: *compute* = forward + backward up to the moment the last gradient is
accumulated (the hooks' own codec work on the training thread included); *communicate* =
from then to the end of ``backward()`` (the exchange not hidden behind backward: DDP
waits for every bucket there); *update* = ``optimizer.step()``. Bytes are the ring
allreduce bytes of what each hook puts on the wire (fp32 buckets, fp16 buckets, or
PowerSGD's uncompressed tensors + P + Q as its own statistics count them), as
:func:`gradzip.comm.base.allreduce_wire_bytes` counts gradzip's.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel

from ..comm import Group, allreduce_wire_bytes
from ..errors import GradzipError
from ..trace import Tracer
from ..train import datasets, models

#: The method name of PyTorch's DDP in ``--algos``.
PEER = "ddp"
HOOKS = ("fp16", "powersgd")
_POWERSGD_DEFAULTS = {"rank": "1", "start": "2", "buckets": "one"}
_ONE_BUCKET_MB = 1 << 20   # bucket_cap_mb large enough for any model: one bucket


def is_peer(algo: str) -> bool:
    """Whether ``algo`` (an ``--algos`` method name) is PyTorch's DDP."""
    return algo == PEER


def parse_hook(codec: str | None) -> dict[str, Any]:
    """``None`` / ``"fp16"`` / ``"powersgd:rank=2,buckets=each"`` -> the peer's settings
    ``{"hook": none|fp16|powersgd, "rank": int, "start": int, "buckets": one|each}``."""
    if codec is None or not codec.strip():
        return {"hook": "none"}
    name, _, rest = codec.strip().partition(":")
    name = name.strip().lower()
    if name not in HOOKS:
        raise GradzipError(f"ddp@{codec}: PyTorch DDP takes the hooks {', '.join(HOOKS)} "
                           "(ddp, ddp@fp16, ddp@powersgd:rank=2)")
    options = dict(_POWERSGD_DEFAULTS) if name == "powersgd" else {}
    for item in (s for s in rest.split(",") if s.strip()):
        key, eq, value = (t.strip() for t in item.partition("="))
        if not eq or key not in options:
            raise GradzipError(f"ddp@{codec}: bad option {item!r}; ddp@{name} takes "
                               f"{', '.join(f'{k}=' for k in options) or 'no options'}")
        options[key] = value
    if name == "fp16":
        return {"hook": "fp16"}
    try:
        rank, start = int(options["rank"]), int(options["start"])
    except ValueError:
        rank = start = 0
    if rank < 1 or start < 2 or options["buckets"] not in ("one", "each"):
        raise GradzipError(f"ddp@{codec}: give rank >= 1, start >= 2 (torch's minimum with error feedback) "
                           "and buckets=one or buckets=each")
    return {"hook": "powersgd", "rank": rank, "start": start, "buckets": options["buckets"]}


class _Counted:
    """A DDP communication hook that counts the ring bytes its collectives send."""

    def __init__(self, hook: dict[str, Any], world_size: int):
        self.kind, self.world_size, self.bytes_sent = hook["hook"], world_size, 0
        self.state = None
        if self.kind == "powersgd":
            self.state = torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=hook["rank"],
                                                      start_powerSGD_iter=hook["start"])
        self.wait_each = hook.get("buckets") == "each"

    def hook(self, bucket):
        buffer = bucket.buffer()
        if self.kind == "none":
            fut, payload = default_hooks.allreduce_hook(None, bucket), buffer.numel() * buffer.element_size()
        elif self.kind == "fp16":
            fut, payload = default_hooks.fp16_compress_hook(None, bucket), buffer.numel() * 2
        else:
            before = self.state.total_numel_after_compression
            fut = torch_powersgd.powerSGD_hook(self.state, bucket)
            sent = self.state.total_numel_after_compression - before   # 0 before start: vanilla allreduce
            payload = (sent or buffer.numel()) * buffer.element_size()
        self.bytes_sent += allreduce_wire_bytes(payload, self.world_size)
        if self.wait_each:
            fut.wait()
        return fut


def _counted_hook(counted: _Counted, bucket):
    """The DDP hook function (DDP wants a named function and a state)."""
    return counted.hook(bucket)


def label(hook: dict[str, Any]) -> str:
    """How the peer is reported: ``ddp``, ``ddp@fp16``, ``ddp@powersgd:rank=1,start=2,buckets=one``."""
    if hook["hook"] == "none":
        return PEER
    if hook["hook"] == "fp16":
        return f"{PEER}@fp16"
    return f"{PEER}@powersgd:rank={hook['rank']},start={hook['start']},buckets={hook['buckets']}"


def run_peer(comm: Group, cfg: dict[str, Any]) -> dict[str, Any]:
    """Train PyTorch DDP as ``cfg`` says (``hook``: :func:`parse_hook`'s dict; ``dataset``,
    ``model``, ``batch_size``, ``lr``, ``seed``, ``epochs`` as in
    :class:`~gradzip.train.config.RunConfig`) on the default process group, which ``comm``
    is a handle of; ``{"summary": ..., "trace": [...]}`` as the harness returns them."""
    if not dist.is_initialized():
        raise GradzipError("PyTorch DDP rows need torch.distributed initialised (run them under "
                           "`gradzip bench net` or torchrun)")
    hook = cfg["hook"]
    ds = datasets.load(cfg["dataset"])
    model = models.build(cfg["model"], ds.input_shape, ds.num_classes, seed=cfg["seed"])
    one_bucket = hook["hook"] == "powersgd" and hook["buckets"] == "one"
    ddp = DistributedDataParallel(model, bucket_cap_mb=_ONE_BUCKET_MB) if one_bucket else DistributedDataParallel(model)
    counted = _Counted(hook, comm.world_size)
    ddp.register_comm_hook(counted, _counted_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"])
    ready = [0.0]

    def accumulated(_p):
        ready[0] = time.perf_counter()

    handles = [p.register_post_accumulate_grad_hook(accumulated) for p in ddp.parameters() if p.requires_grad]
    tracer, batch, n = Tracer(comm.rank), cfg["batch_size"], comm.world_size
    steps_per_epoch = len(ds.train_x) // n // batch
    if steps_per_epoch < 1:
        raise GradzipError(f"{cfg['dataset']} has fewer than one batch of {batch} per worker for {n} workers; "
                           "lower --batch-size")
    comm.barrier()
    began, steps = time.perf_counter(), 0
    try:
        for epoch in range(1, cfg["epochs"] + 1):
            order = datasets.shard(len(ds.train_x), comm.rank, n, epoch, cfg["seed"])
            for b in range(steps_per_epoch):
                idx = order[b * batch:(b + 1) * batch]
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(ddp(ds.train_x[idx]), ds.train_y[idx]).backward()
                t1 = time.perf_counter()
                opt.step()
                t2 = time.perf_counter()
                steps += 1
                last = min(max(ready[0], t0), t1)
                tracer.add("compute", t0, last, step=steps)
                tracer.add("step", last, t2, cat="optimizer", step=steps)
                tracer.add("communicate", last, t1, step=steps)
    finally:
        for h in handles:
            h.remove()
    summary = {"algo": cfg.get("label") or label(hook), "method": PEER, "options": {"hook": label(hook)},
               "peer": True, "workers": n, "model": cfg["model"], "dataset": cfg["dataset"], "steps": steps,
               "bytes_sent_per_worker": counted.bytes_sent, "parameters": sum(p.numel() for p in model.parameters()),
               "wall_time_s": time.perf_counter() - began}
    return {"summary": summary, "trace": tracer.events}
