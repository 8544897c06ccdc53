"""Worker functions for the gradzip.integrations.fsdp tests (importable by spawned gloo processes): tiny
FSDP2 models, a few steps, and hand-written references of docs/algorithms.md §Sharded
exchange."""
from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import gradzip.integrations.fsdp
from gradzip import seeds
from gradzip.compressors import build
from gradzip.errors import GradzipError
from gradzip.integrations.fsdp_collectives import shard_error_codec

SEED = 3


class Net(nn.Module):
    """Three linears of odd sizes (FSDP pads their dim-0 chunks)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 9), nn.Linear(9, 7), nn.Linear(7, 5)])

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


def build_model(mesh, mp_policy=None, **kwargs):
    torch.manual_seed(0)
    net = Net()
    policy = mp_policy or MixedPrecisionPolicy()
    for layer in net.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, **kwargs)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    return net


def batch(rank: int, step: int, size: int = 8):
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + 1)
    return torch.randn(size, 6, generator=g), torch.randint(0, 5, (size,), generator=g)


def train(model, opt, rank, steps, first=0, after=None):
    for step in range(first, first + steps):
        opt.zero_grad()
        x, y = batch(rank, step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if after is not None:
            after(step)


def full(model):
    """Every parameter, unsharded (collective)."""
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def local(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


def max_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def fsdp_modules(model):
    return [m for m in model.modules() if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_groups]


class Spy:
    """Wraps a module's reduce-scatter (or all-gather): records every call's input and output."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, *args, **kwargs):
        before = input_tensor.detach().clone()
        out = self.inner(output_tensor, input_tensor, group, *args, **kwargs)
        self.calls.append((before, output_tensor.detach().clone(), group.size()))
        return out


def spy(model, kind: str) -> list[Spy]:
    """A :class:`Spy` around every module's ``"reduce_scatter"`` or ``"all_gather"``."""
    spies = []
    for m in fsdp_modules(model):
        wrapped = Spy(getattr(m._get_fsdp_state()._fsdp_param_groups[0], f"_{kind}_comm"))
        getattr(m, f"set_custom_{kind}")(wrapped)
        spies.append(wrapped)
    return spies


def spy_reduce_scatters(model):
    return spy(model, "reduce_scatter")


def spy_all_gathers(model):
    return spy(model, "all_gather")


def one_line(fn) -> str:
    """The message of the GradzipError ``fn()`` raises ("" if it raises none)."""
    try:
        fn()
    except GradzipError as exc:
        return str(exc)
    return ""


# ----------------------------------------------------------------------------- references
def piece_shapes(model, s):
    """Per FSDP module, (keys, shapes) of its parameters' pieces of a reduce-scatter row, from
    the parameters' own shapes: dim 0 in ⌈rows/s⌉ chunks, keys numbered across modules."""
    out, key = [], 0
    for m in fsdp_modules(model):
        shapes = [torch.Size([-(-p.shape[0] // s), *p.shape[1:]]) for p in m.parameters(recurse=False)]
        out.append((list(range(key, key + len(shapes))), shapes))
        key += len(shapes)
    return out


def split(flat, shapes):
    out, at = [], 0
    for shape in shapes:
        out.append(flat[at:at + shape.numel()].view(shape))
        at += shape.numel()
    return out


def reference_reduce_scatter(codec, inputs, errors, mode, keys, shapes, step, rank):
    """The box's compressed reduce-scatter by hand: every worker's ``v``; per parameter and
    owner one packet of the piece in its shape (``compress`` / ``decompress``); this worker's
    shard, and every worker's new error memory (dense)."""
    s = len(inputs)
    packets, new_errors, mine = [], [], None
    for i, (g, e) in enumerate(zip(inputs, errors)):
        v = g.float().reshape(-1) + (e if e is not None else 0)
        rows = v.view(s, -1)
        mine_i, dec = [], torch.empty_like(rows)
        for j in range(s):
            row = []
            for x, d, key in zip(split(rows[j], shapes), split(dec[j], shapes), keys):
                sigma = seeds.mix(SEED, step, key) if codec.shared_randomness else seeds.mix(SEED, step, key, i + 1)
                packet = codec.compress(x, seeds.mix(sigma, j))
                d.copy_(codec.decompress(packet))
                row.append(packet)
            mine_i.append(row)
        r = v - dec.view(-1)
        if mode == "shard":
            t = shard_error_codec(s)
            r = t.decompress(t.compress(r))
        new_errors.append(r if mode != "off" else None)
        packets.append(mine_i)
        if i == rank:
            mine = (v, dec.view(-1))
    shard = torch.cat([codec.aggregate([packets[i][rank][p] for i in range(s)]).reshape(-1)
                       for p in range(len(shapes))])
    return shard, new_errors, mine


def reference_run(spec, mode, comm, steps=3):
    """A compressed FSDP2 run against :func:`reference_reduce_scatter`: the largest
    difference of shard and residual identity over every module and step, and the bytes
    against the box's formula."""
    mesh = init_device_mesh("cpu", (comm.world_size,))
    model = build_model(mesh)
    handle = gradzip.integrations.fsdp.compress(model, compressor=spec, error_feedback=mode if mode != "off" else False,
                                   weights="int8", seed=SEED)
    spies, gathers = spy_reduce_scatters(model), spy_all_gathers(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    codec, weights = build(spec), build("int8")
    layout = piece_shapes(model, comm.world_size)
    errors = {m.key: [None] * comm.world_size for m in handle.modules}
    worst = {"shard": 0.0, "identity": 0.0}
    expected_bytes = 0
    for step in range(steps):
        train(model, opt, comm.rank, 1, first=step)
        for m, spy, (keys, shapes) in zip(handle.modules, spies, layout):
            g, out, s = spy.calls[step]
            inputs = list(comm.allgather(g.reshape(-1)))
            shard, errors[m.key], (v, dec) = reference_reduce_scatter(codec, inputs, errors[m.key], mode, keys,
                                                                     shapes, step + 1, comm.rank)
            worst["shard"] = max(worst["shard"], (shard - out.reshape(-1)).abs().max().item())
            if mode == "full":
                worst["identity"] = max(worst["identity"], (dec + m.error - v).abs().max().item())
            if mode != "off":
                worst["error"] = max(worst.get("error", 0.0), (handle_error(m, s) - errors[m.key][comm.rank])
                                     .abs().max().item())
            expected_bytes += (s - 1) * sum(codec.compress(torch.zeros(shape)).nbytes for shape in shapes)
    for spy in gathers:
        for inp, _, s in spy.calls:
            expected_bytes += (s - 1) * weights.compress(torch.zeros(inp.numel())).nbytes
    return {**worst, "bytes": handle.bytes_sent, "expected_bytes": expected_bytes,
            "memory": handle.error_memory_bytes, "gradient_numel": sum(spy.calls[0][0].numel() for spy in spies)}


def handle_error(m, s):
    error = m.error
    if isinstance(error, torch.Tensor):
        return error
    return shard_error_codec(s).decompress(error)


# ----------------------------------------------------------------------------- suites
def flat_suite(comm, workdir):
    """Everything on one 1-D mesh (run on 2 workers)."""
    out = {}
    for name, fn in [("none", none_vs_plain), ("mixed", mixed_precision), ("bad", bad_uses),
                     ("resume", lambda c: resume(c, workdir))]:
        out[name] = _guarded(fn, comm)
    for spec, mode in [("1bit", "full"), ("topk:ratio=0.3", "full"), ("1bit", "shard"), ("int8:block=4", "full"),
                       ("qsgd", "off")]:
        out[f"ref {spec} {mode}"] = _guarded(lambda c: reference_run(spec, mode, c), comm)
    return out


def _guarded(fn, comm):
    try:
        return fn(comm)
    except Exception:  # noqa: BLE001 - reported to the test process
        return {"failed": traceback.format_exc()}


def none_vs_plain(comm, steps=3):
    mesh = init_device_mesh("cpu", (comm.world_size,))
    results = {}
    runs = {"plain": None, "none": "none", "exact": None}
    for label, spec in runs.items():
        model = build_model(mesh)
        if label != "plain":
            gradzip.integrations.fsdp.compress(model, compressor=spec)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        train(model, opt, comm.rank, steps)
        results[label] = full(model)
    return {"none": max_diff(results["none"], results["plain"]),
            "exact_equal": all(torch.equal(a, b) for a, b in zip(results["exact"], results["plain"])),
            "moved": max_diff(results["plain"], full(build_model(mesh)))}


def mixed_precision(comm, steps=3):
    """bf16 compute, fp32 reduction: gradzip's codec input is what FSDP2 reduces."""
    mesh = init_device_mesh("cpu", (comm.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plain, zipped = build_model(mesh, policy), build_model(mesh, policy)
    plain_spies = spy_reduce_scatters(plain)
    gradzip.integrations.fsdp.compress(zipped, compressor="none", weights="bf16")
    zipped_spies, gathers = spy_reduce_scatters(zipped), spy_all_gathers(zipped)
    for model in (plain, zipped):
        train(model, torch.optim.SGD(model.parameters(), lr=0.1), comm.rank, steps)
    first = [(a.calls[0][0], b.calls[0][0]) for a, b in zip(plain_spies, zipped_spies)]
    return {"diff": max_diff(full(plain), full(zipped)),
            "input_dtypes": sorted({str(b.dtype) for _, b in first}),
            "first_inputs_equal": all(torch.equal(a, b) for a, b in first),
            "gather_dtypes": sorted({str(c[0].dtype) for spy in gathers for c in spy.calls})}


def bad_uses(comm):
    mesh = init_device_mesh("cpu", (comm.world_size,))
    out = {"not_fsdp": one_line(lambda: gradzip.integrations.fsdp.compress(Net(), compressor="1bit")),
           "weights_topk": one_line(lambda: gradzip.integrations.fsdp.compress(build_model(mesh), weights="topk:ratio=0.1")),
           "ef_unbiased": one_line(lambda: gradzip.integrations.fsdp.compress(build_model(mesh), compressor="qsgd",
                                                                 error_feedback=True)),
           "ef_unknown": one_line(lambda: gradzip.integrations.fsdp.compress(build_model(mesh), compressor="1bit",
                                                                error_feedback="half")),
           "replicas_3": one_line(lambda: gradzip.integrations.fsdp.compress(build_model(mesh), compressor="1bit", replicas=3)),
           "replicas_2": one_line(lambda: gradzip.integrations.fsdp.compress(build_model(mesh), compressor="1bit", replicas=2))}
    twice = build_model(mesh)
    gradzip.integrations.fsdp.compress(twice, compressor="1bit")
    out["twice"] = one_line(lambda: gradzip.integrations.fsdp.compress(twice, compressor="1bit"))
    out["groups"] = one_line(lambda: gradzip.integrations.fsdp.compress(_two_groups(mesh), compressor="1bit"))
    return out


def _two_groups(mesh):
    """A module whose parameters FSDP2 puts in two parameter groups (per-parameter meshes)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    from torch.distributed.device_mesh import DeviceMesh

    other = FSDPMeshInfo(DeviceMesh.from_group(dist.new_group(list(range(mesh.size()))), "cpu"), shard_mesh_dim=0)
    torch.manual_seed(0)
    net = Net()
    fully_shard(net, mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), other)
                if p.dim() == 1 else None)
    return net


def resume(comm, workdir, steps=2, hsdp=False):
    """Save after ``steps`` through DCP, run on; a fresh model, optimizer and handle loaded
    from the checkpoint must reach the same bits. Then the refusals. ``hsdp``: 2 nodes,
    two-phase across them (its server errors are state too)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = hsdp_meshes(comm)["shard"] if hsdp else init_device_mesh("cpu", (comm.world_size,))
    path = f"{workdir}/dcp-{comm.world_size}{'-hsdp' if hsdp else ''}"
    options = {"replicas": 2, "transport": "twophase"} if hsdp else {"weights": "int8"}

    def make(spec="1bit", mode="full" if hsdp else "shard"):
        model = build_model(mesh)
        handle = gradzip.integrations.fsdp.compress(model, compressor=spec, error_feedback=mode, seed=SEED, **options)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), handle

    class App:
        def __init__(self, model, opt):
            self.model, self.opt = model, opt

        def state_dict(self):
            m, o = get_state_dict(self.model, self.opt)
            return {"model": m, "optim": o}

        def load_state_dict(self, state):
            set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    model, opt, handle = make()
    train(model, opt, comm.rank, steps)
    dcp.save({"app": App(model, opt), "gradzip": handle}, checkpoint_id=path)
    train(model, opt, comm.rank, steps, first=steps)
    straight, straight_bytes = local(model), handle.bytes_sent
    model, opt, handle = make()
    dcp.load({"app": App(model, opt), "gradzip": handle}, checkpoint_id=path)
    train(model, opt, comm.rank, steps, first=steps)
    out = {"equal": all(torch.equal(a, b) for a, b in zip(local(model), straight)),
           "bytes": (handle.bytes_sent, straight_bytes),
           "server_errors": len(handle._exchange.psync.server_errors.errors) if hsdp else None}
    saved = handle.state_dict()   # as a larger world would have saved it (its keys include ours)
    saved["settings"]["world_size"] = 2 * comm.world_size
    out["world_size"] = one_line(lambda: handle.load_state_dict(saved))
    for label, spec, mode in [("codec", "topk:ratio=0.3", "full"), ("error_feedback", "1bit", False)]:
        model, opt, handle = make(spec, mode)
        out[label] = one_line(lambda: dcp.load({"app": App(model, opt), "gradzip": handle}, checkpoint_id=path))
    return out


def hsdp_suite(comm, workdir):
    """HSDP on 2 nodes of 2 (run on 4 workers)."""
    out = {}
    out["none"] = _guarded(hsdp_none_vs_plain, comm)
    out["codec"] = _guarded(hsdp_codec, comm)
    out["grow"] = _guarded(lambda c: load_grown(c, workdir), comm)
    out["resume"] = _guarded(lambda c: resume(c, workdir, hsdp=True), comm)
    return out


def load_grown(comm, workdir):
    """The 2-worker checkpoint of :func:`resume` on 4: DCP's planner stops at the missing
    ``rank2``/``rank3`` keys, unless partial loads are allowed, where gradzip refuses it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.api import CheckpointException

    mesh = init_device_mesh("cpu", (comm.world_size,))
    path = f"{workdir}/dcp-2"
    handle = gradzip.integrations.fsdp.compress(build_model(mesh), compressor="1bit", error_feedback="shard", weights="int8",
                                   seed=SEED)
    try:
        dcp.load({"gradzip": handle}, checkpoint_id=path)
        strict = ""
    except CheckpointException as exc:   # DCP's own, a BaseException
        strict = str(exc)
    partial = one_line(lambda: dcp.load({"gradzip": handle}, checkpoint_id=path,
                                        planner=DefaultLoadPlanner(allow_partial_load=True)))
    return {"strict": strict, "partial": partial}


def hsdp_meshes(comm):
    mesh = init_device_mesh("cpu", (2, comm.world_size // 2), mesh_dim_names=("replicate", "shard"))
    return mesh


def hsdp_none_vs_plain(comm, steps=3):
    mesh = hsdp_meshes(comm)
    plain = build_model(mesh)   # FSDP2's own HSDP
    zipped = build_model(mesh["shard"])
    gradzip.integrations.fsdp.compress(zipped, compressor="none", replicas=mesh)
    for model in (plain, zipped):
        train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm.rank, steps)
    native = one_line(lambda: gradzip.integrations.fsdp.compress(build_model(mesh), compressor="1bit", replicas=mesh))
    return {"diff": max_diff(full(plain), full(zipped)), "native": native}


def hsdp_codec(comm, steps=3):
    """1bit across nodes, replicas 2 given as an integer: replicas identical after every step,
    every shard the hand-written reference of the box, bytes the formula's."""
    from gradzip.exchange import plan

    mesh = hsdp_meshes(comm)
    model = build_model(mesh["shard"])
    handle = gradzip.integrations.fsdp.compress(model, compressor="1bit", replicas=2, seed=SEED)
    s = comm.world_size // 2
    cross = comm.split([[j + m * s for m in range(2)] for j in range(s)])   # the test's own, uncounted
    hooks = []
    for m in fsdp_modules(model):
        group = m._get_fsdp_state()._fsdp_param_groups[0]
        inner, calls = group._all_reduce_hook, []

        def hook(t, inner=inner, calls=calls):
            before = t.detach().clone()
            inner(t)
            calls.append((before, t.detach().clone()))
        m.set_all_reduce_hook(hook)
        hooks.append(calls)
    codec = build("1bit")
    errors = {m.key: [None, None] for m in handle.modules}
    out = {"identical": True, "shard": 0.0}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    layout = piece_shapes(model, s)

    def check(step):
        for shard in local(model):
            rows = cross.allgather(shard.reshape(-1))
            out["identical"] &= bool(torch.equal(rows[0], rows[1]))
        for m, calls, (keys, shapes) in zip(handle.modules, hooks, layout):
            u, after = calls[step]
            us = list(cross.allgather(u.reshape(-1)))
            replicas = [x + (e if e is not None else 0) for x, e in zip(us, errors[m.key])]
            errors[m.key] = [torch.empty_like(v) for v in replicas]
            aggregate = []
            for p, (key, shape) in enumerate(zip(keys, shapes)):   # each piece in its shape: PSync's rule
                pieces_ = [split(v, shapes)[p] for v in replicas]
                packets = [codec.compress(x, seeds.mix(SEED, step + 1, key, r + 1)) for r, x in enumerate(pieces_)]
                for r, (x, packet) in enumerate(zip(pieces_, packets)):
                    split(errors[m.key][r], shapes)[p].copy_(x - codec.decompress(packet))
                aggregate.append(codec.aggregate(packets).reshape(-1))
            out["shard"] = max(out["shard"], (torch.cat(aggregate) - after.reshape(-1)).abs().max().item())

    gathers = spy_all_gathers(model)
    train(model, opt, comm.rank, steps, after=check)
    expected = sum((s - 1) * inp.numel() * inp.element_size() for spy in gathers for inp, _, _ in spy.calls)
    for calls, (_, shapes) in zip(hooks, layout):
        d = calls[0][0].numel()   # the shard: D/s
        expected += steps * ((s - 1) * 4 * d + plan(shapes, codec, 2).bytes_for(comm.rank // s))
    out["bytes"], out["expected_bytes"] = handle.bytes_sent, expected
    return out
