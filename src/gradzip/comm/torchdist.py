"""A ``torch.distributed`` process group: gloo for CPU tensors, NCCL for CUDA tensors.

Launch with ``torchrun`` (or ``gradzip train --workers N``, which spawns local processes)
and initialise with :func:`init_from_env`; ``TorchGroup()`` then wraps the default group
(or any process group you pass). Collectives use ``async_op=True`` under the hood.

**Lost peers.** Every collective waits at most the group's timeout (``timeout_s`` of
:func:`init_from_env`; groups made by :meth:`TorchGroup.new_group` inherit it). When one
fails (gloo reports a closed connection as soon as a peer process dies, or a timeout when
a peer is alive but stuck), :class:`~gradzip.comm.PeerFailure` is raised naming the lost
rank(s), as found by :mod:`gradzip.comm.liveness`.
"""
from __future__ import annotations

import datetime
import os
import re

import torch
import torch.distributed as dist

from ..errors import GradzipError, first_line
from .base import DEFAULT_TIMEOUT_S, TIMEOUT_HINT, Group, PeerFailure, Work, check_timeout
from .liveness import Heartbeat, Verdict, announce_start, attempt_prefix, sequence, startup_verdict

# all_gather_single is the newer name of all_gather_into_tensor (same signature).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# gloo / c10d errors that mean "the other side went away or did not answer in time"
_COMM_ERROR = re.compile(r"timed? ?out|timeout|connection|closed|reset by peer|broken pipe|socket|"
                         r"unreachable|no route|peer|abort", re.I)


# backend errors that mean "this backend has no such operation (for this device or dtype)"
_LACKS = re.compile(r"no backend type associated with device type|does not support|not supported|"
                    r"unsupported|not implemented|cannot use reduceop|invalid scalar type", re.I)


def choose_backend(cuda: bool, nccl: bool, local_world_size: int, device_count: int) -> str:
    """The ``init_process_group`` backend: gloo for CPU tensors, plus NCCL for CUDA tensors
    where CUDA and NCCL are present and every rank on this node has a GPU of its own (NCCL
    cannot put two ranks on one GPU); otherwise gloo for CUDA tensors as well."""
    if cuda and nccl and 1 <= local_world_size <= device_count:
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def lacks_operation(kind: str, exc: BaseException, backend: str | None = None) -> GradzipError | None:
    """A one-line :class:`GradzipError` where ``exc`` says the backend has no ``kind`` for
    these tensors (None for any other error)."""
    if not _LACKS.search(str(exc)):
        return None
    named, said = _gloo_says(exc)
    backend = backend or named
    return GradzipError(f"{backend} cannot run {kind} on these tensors ({said}); train on tensors it supports "
                        "(--device cpu: gloo; CUDA tensors: NCCL where each rank has its own GPU, else gloo)")


class TorchGroup(Group):
    """This process's handle on a ``torch.distributed`` group (the default one if None).

    ``timeout_s`` is the group's collective timeout (read from the process group);
    collectives that fail because a peer is lost raise :class:`PeerFailure`."""

    def __init__(self, group: "dist.ProcessGroup | None" = None):
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise GradzipError(
                "torch.distributed is not initialised; launch with torchrun (or gradzip train "
                "--workers N) and call gradzip.comm.init_from_env(), or use gradzip.simulate"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        pg = group if group is not None else dist.group.WORLD
        self.timeout_s = _pg_timeout(pg)
        self.name = str(pg.group_name)
        self._is_default = group is None or group is dist.group.WORLD
        self._global_ranks = dist.get_process_group_ranks(pg)
        self._heartbeat = Heartbeat.ensure()
        self._seq = sequence(self.name)

    def new_group(self) -> "TorchGroup":
        # torch's new_group does not inherit the default group's timeout (it defaults to 30 min)
        return TorchGroup(dist.new_group(ranks=list(self._global_ranks),
                                         timeout=datetime.timedelta(seconds=self.timeout_s)))

    def _allreduce(self, tensor, nbytes):
        return self._issue("allreduce", lambda: dist.all_reduce(tensor, group=self.group, async_op=True),
                           lambda: tensor, nbytes)

    def _allgather(self, tensor, nbytes):
        flat = tensor.contiguous().reshape(-1)
        out = flat.new_empty(self.world_size * flat.numel())
        return self._issue("allgather", lambda: _all_gather_flat(out, flat, group=self.group, async_op=True),
                           lambda: out.view(self.world_size, *tensor.shape), nbytes)

    def _broadcast(self, tensor, src, nbytes):
        root = _global_rank(self.group, src)
        return self._issue(f"broadcast(src={src})",
                           lambda: dist.broadcast(tensor, src=root, group=self.group, async_op=True),
                           lambda: tensor, nbytes)

    def _all_to_all(self, tensors, recv_sizes, nbytes):
        flat = torch.cat(tensors)
        out = flat.new_empty(sum(recv_sizes))
        return self._issue("all_to_all", lambda: dist.all_to_all_single(
            out, flat, output_split_sizes=list(recv_sizes), input_split_sizes=[t.numel() for t in tensors],
            group=self.group, async_op=True), lambda: list(out.split(list(recv_sizes))), nbytes)

    def _reduce_scatter(self, tensor, nbytes):
        if _gloo_carries(self.group, tensor.device):
            # gloo's reduce-scatter is an allreduce: it sent 2(n-1)/n of the tensor (interface
            # counters), twice a ring's. Row j goes to worker j instead, (n-1)/n, and each
            # worker sums its rows in rank order, as the in-process group sums them.
            rows = tensor.reshape(self.world_size, -1)
            got = torch.empty_like(rows)

            def total():
                out = got[0].clone()
                for row in got[1:]:
                    out.add_(row)
                return out.view(tensor.shape[1:])

            return self._issue("reduce_scatter", lambda: dist.all_to_all_single(got, rows, group=self.group,
                                                                                async_op=True), total, nbytes)
        out = tensor.new_empty(tensor.shape[1:])
        return self._issue("reduce_scatter",
                           lambda: _reduce_scatter_flat(out.view(-1), tensor.view(-1), group=self.group, async_op=True),
                           lambda: out, nbytes)

    def _split(self, parts):
        # every process creates every part's group, in the same order (torch.distributed's rule)
        mine = None
        for part in parts:
            pg = dist.new_group(ranks=[self._global_ranks[r] for r in part],
                                timeout=datetime.timedelta(seconds=self.timeout_s))
            if self.rank in part:
                mine = TorchGroup(pg)
        return mine

    # -- failures ------------------------------------------------------------------------
    def _issue(self, kind: str, launch, result, nbytes: int) -> Work:
        seq = self._seq.next(kind)
        try:
            handle = launch()
        except RuntimeError as exc:
            self._raise_translated(kind, seq, exc)
            raise

        def wait():
            try:
                handle.wait()
            except RuntimeError as exc:
                self._raise_translated(kind, seq, exc)
                raise
            return result()

        def chain(fn):   # fn(result) once the collective is done, on the backend's thread
            return handle.get_future().then(lambda done: (done.value(), fn(result()))[1])

        return Work(wait, nbytes, chain if hasattr(handle, "get_future") else None)

    def _raise_translated(self, kind: str, seq: int, exc: RuntimeError) -> None:
        """Raise :meth:`_translate`'s :class:`PeerFailure` from ``exc``; return when there is
        none (the caller then re-raises ``exc`` as it is). An operation the backend lacks is
        a :class:`GradzipError` naming it (:func:`lacks_operation`)."""
        try:
            backend = str(dist.get_backend(self.group))
        except (RuntimeError, ValueError):
            backend = None
        lacking = lacks_operation(kind, exc, backend)
        if lacking is not None:
            raise lacking from exc
        failure = self._translate(kind, seq, exc)
        if failure is not None:
            raise failure from exc

    def _translate(self, kind: str, seq: int, exc: RuntimeError) -> PeerFailure | None:
        """The :class:`PeerFailure` for a failed collective; None if ``exc`` is not a
        communication failure (a bad argument, say), which is then raised as it is."""
        if isinstance(exc, PeerFailure) or not (
                isinstance(exc, getattr(dist, "DistNetworkError", ())) or _COMM_ERROR.search(str(exc))):
            return None
        me = dist.get_rank() if dist.is_initialized() else self.rank
        what = f"{kind} #{seq}"
        where = what if self._is_default else f"{what} (process group {self.name})"
        peers = [r for r in self._global_ranks if r != me]
        hb = self._heartbeat
        if hb is not None and hb is Heartbeat.current:
            verdict = hb.diagnose(peers, self.name, seq)
        else:
            verdict = Verdict("a peer was lost or is stuck (no heartbeat store to tell which)", ())
        backend, said = _gloo_says(exc)
        message = (f"rank {me}: {verdict.text} during {where}; {backend}: {said} "
                   f"(timeout {self.timeout_s:g} s; {TIMEOUT_HINT})")
        if hb is not None:
            hb.announce("failed", message, verdict.lost)
        return PeerFailure(message, rank=me, lost=verdict.lost, collective=what)


def _gloo_carries(group, device: torch.device) -> bool:
    """Whether gloo moves ``device``'s tensors in ``group`` (backend ``gloo``, or
    ``cpu:gloo,cuda:nccl`` for a CPU tensor)."""
    backend = str(dist.get_backend(group))
    if ":" not in backend:
        return backend == "gloo"
    return dict(part.split(":", 1) for part in backend.split(",")).get(device.type) == "gloo"


def _global_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _pg_timeout(pg) -> float:
    """The collective timeout of process group ``pg``, in seconds."""
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 - private API, or no backend for that device
            pass
    return _init_timeout_s if _init_timeout_s is not None else 1800.0  # torch's default


def _gloo_says(exc: BaseException) -> tuple[str, str]:
    """(backend name, the first sentence of its error without source paths and advice)."""
    text = str(exc).strip()
    backend = "gloo" if "gloo" in text.lower() else "nccl" if "nccl" in text.lower() else "torch.distributed"
    text = first_line(exc, limit=1000)
    text = re.sub(r"^\[[^\]]*:\d+\]\s*", "", text)
    text = text.split(" This is typically caused")[0].split(", keys: ")[0].strip()
    return backend, text[:300]


_init_timeout_s: float | None = None


def init_from_env(timeout_s: float = DEFAULT_TIMEOUT_S) -> TorchGroup:
    """Initialise the default group from torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT): gloo for CPU tensors, plus NCCL for CUDA tensors when CUDA
    and NCCL are available and each local rank has a GPU of its own (:func:`choose_backend`). Returns the group's handle; a no-op if already initialised.

    ``timeout_s`` bounds every collective (and groups made by ``new_group()``): a peer
    that died or is stuck makes this process raise :class:`PeerFailure` naming it within
    about ``timeout_s`` (at once for a peer whose process died). So does a peer that does
    not join the group (the rendezvous) within ``timeout_s``: the :class:`PeerFailure` names
    it and what it was doing (:func:`gradzip.comm.liveness.startup_verdict`)."""
    global _init_timeout_s
    timeout_s = check_timeout(timeout_s)
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise GradzipError(
                f"cannot join a process group: environment variable(s) {', '.join(missing)} not set; "
                "launch with torchrun or gradzip train --workers N"
            )
        cuda = torch.cuda.is_available()
        count = torch.cuda.device_count() if cuda else 0
        backend = choose_backend(cuda, dist.is_nccl_available(), int(os.environ.get("LOCAL_WORLD_SIZE", 1)), count)
        if cuda:  # rank r on cuda:LOCAL_RANK % device_count (gradzip.train.device)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % count)
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = None
        try:
            store = _rendezvous_store(rank, world_size, timeout_s)
            announce_start(store, rank)
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), rank=rank,
                                    world_size=world_size, store=dist.PrefixStore(attempt_prefix(), store))
        except RuntimeError as exc:
            failure = _startup_failure(exc, store, rank, world_size, timeout_s)
            if failure is not None:
                raise failure from exc
            raise
        _init_timeout_s = timeout_s
    return TorchGroup()


def _rendezvous_store(rank: int, world_size: int, timeout_s: float):
    """The c10d store the workers meet on. Under torchrun and ``run_processes``
    (``TORCHELASTIC_USE_AGENT_STORE``), a client of the launcher's store; else (plain env://)
    the store rank 0 hosts at MASTER_ADDR:MASTER_PORT, made as torch's env:// rendezvous
    makes it (without waiting for the others to connect: a peer that never comes is then
    named, see :func:`_startup_failure`). Its keys are used under :func:`attempt_prefix`:
    torchrun's agent keeps one store for all restart attempts (shared since torch 2.4), so
    without a per-attempt prefix gloo can read a dead worker's address left by the previous
    attempt and fail with "connectFullMesh ... Connection refused" (seen here in about half
    the restarts)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False,
                         multi_tenant=True)


def _startup_failure(exc: RuntimeError, store, rank: int, world_size: int, timeout_s: float) -> PeerFailure | None:
    """The :class:`PeerFailure` for a rendezvous that failed (``store``: None where the
    store itself could not be reached); None if ``exc`` is not a communication failure, or
    is rank 0's own failure to open the store it hosts."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if not (isinstance(exc, getattr(dist, "DistError", ())) or _COMM_ERROR.search(str(exc))) or (
            store is None and rank == 0 and not agent):
        return None
    verdict = startup_verdict(store, rank, world_size)
    backend, said = _gloo_says(exc)
    return PeerFailure(f"rank {rank}: the process group could not be formed at start-up: {verdict.text}; "
                       f"{backend}: {said} (timeout {timeout_s:g} s; {TIMEOUT_HINT})",
                       rank=rank, lost=verdict.lost, collective="rendezvous")


