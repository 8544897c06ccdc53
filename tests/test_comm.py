import os
import subprocess
import sys
import time

import pytest
import torch

import gradzip
from gradzip.comm import PeerFailure, liveness, allgather_wire_bytes, allreduce_wire_bytes, make_group
from gradzip.errors import GradzipError
from gradzip.comm.launch import WorkerError, run_processes

import cases


def test_ring_byte_formulas():
    assert allreduce_wire_bytes(1000, 1) == 0
    assert allreduce_wire_bytes(1000, 2) == 1000
    assert allreduce_wire_bytes(1000, 4) == 1500
    assert allgather_wire_bytes(1000, 4) == 3000


@pytest.mark.parametrize("n", [1, 2, 4])
def test_thread_collectives_match_direct_computation(n):
    results = gradzip.simulate(n, cases.collectives)
    for rank, out in enumerate(results):
        cases.check_collectives(out, rank, n)


def test_thread_collectives_are_asynchronous():
    def fn(comm):
        # launch three collectives before waiting for any of them
        works = [comm.allreduce(torch.full((3,), float(comm.rank + k)), async_op=True) for k in range(3)]
        gathered = comm.allgather(torch.tensor([comm.rank]), async_op=True)
        return [w.wait() for w in works], gathered.wait()

    outs = gradzip.simulate(3, fn)
    for sums, gathered in outs:
        assert [s[0].item() for s in sums] == [3.0, 6.0, 9.0]
        assert gathered.flatten().tolist() == [0, 1, 2]


def test_thread_results_are_bitwise_identical_on_every_rank():
    def fn(comm):
        g = torch.Generator().manual_seed(comm.rank)
        return comm.allreduce(torch.randn(1000, generator=g))

    outs = gradzip.simulate(4, fn)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_failing_worker_releases_its_peers_and_is_reraised():
    def fn(comm):
        if comm.rank == 1:
            raise KeyError("boom")
        comm.allreduce(torch.ones(2))  # would wait forever for rank 1

    with pytest.raises(KeyError, match="boom"):
        gradzip.simulate(3, fn)


def test_peer_that_never_arrives_times_out_naming_it():
    groups = make_group(2, timeout_s=0.2)
    work = groups[0].allreduce(torch.ones(1), async_op=True)
    with pytest.raises(PeerFailure, match=r"rank 0: peer rank 1 is stuck: it did not start allreduce #0") as info:
        work.wait()
    assert info.value.lost == (1,) and info.value.rank == 0
    assert "timeout 0.2 s; change it with --timeout or timeout_s=" in str(info.value)


def test_mismatched_collectives_are_an_error():
    def fn(comm):
        if comm.rank == 0:
            comm.allreduce(torch.ones(2))
        else:
            comm.allgather(torch.ones(2))

    with pytest.raises(GradzipError, match="same collectives in the same order"):
        gradzip.simulate(2, fn)


def test_invalid_world_size():
    with pytest.raises(GradzipError, match=">= 1"):
        gradzip.simulate(0, lambda c: None)
    with pytest.raises(GradzipError, match=">= 1"):
        run_processes(0, cases.collectives)


def test_world_of_one_sends_nothing():
    comm = gradzip.comm.default()
    assert comm.world_size == 1
    t = torch.arange(4.0)
    assert torch.equal(comm.allreduce(t.clone()), t)
    assert comm.allgather(t).shape == (1, 4)
    assert comm.bytes_sent == 0


@pytest.mark.slow
def test_gloo_collectives_match_direct_computation():
    n = 3
    results = run_processes(n, cases.collectives)
    for rank, out in enumerate(results):
        cases.check_collectives(out, rank, n)


def _check_chained(outs, n, early):
    mean = (n + 1) / 2
    for out in outs:
        assert out["value"] == 4 * mean and torch.equal(out["tensor"], torch.full((4,), mean))
        assert out["calls"] == 1 and out["ran_before_wait"] == early
        # gloo: the backend's thread, or the caller's where the sum was there before then()
        assert early or out["on_caller"]


def test_work_then_runs_inside_wait_on_threads():
    _check_chained(gradzip.simulate(3, lambda comm: cases.chained_allreduce(comm, False)), 3, early=False)


def test_work_then_runs_on_the_backends_thread_before_wait_on_gloo():
    """What the DDP hook's uncompressed buckets rely on: the mean is taken as the sum
    arrives (``Work.then``), not when the last bucket's hook waits."""
    _check_chained(run_processes(2, cases.chained_allreduce, True), 2, early=True)


@pytest.mark.slow
def test_gloo_worker_error_is_reraised_with_rank():
    with pytest.raises(WorkerError, match="worker rank 1 failed"):
        run_processes(2, cases.fail_on_rank, 1)


@pytest.mark.slow
def test_gloo_workers_leave_without_finalisation_once_their_output_is_flushed(tmp_path, capfd):
    """A worker ends right after its report (the interpreter's finalisation, which takes
    seconds with torch loaded, is skipped: no atexit hook runs), its output flushed."""
    assert run_processes(2, cases.leave_marks, str(tmp_path / "mark")) == [0, 1]
    assert list(tmp_path.iterdir()) == []
    out = capfd.readouterr().out
    assert "rank 0 was here" in out and "rank 1 was here" in out


def test_process_gone_counts_ended_and_zombie_processes():
    """``comm.liveness.process_gone``: this process is alive; a child that exited and was
    not reaped (a zombie) is gone, and so is it once reaped."""
    assert liveness.process_gone(os.getpid()) is False
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 120   # a hang guard, not a timing assertion
    while not liveness.process_gone(child.pid):
        assert time.monotonic() < deadline, "the child never became a zombie"
        time.sleep(0.05)
    child.wait()
    assert liveness.process_gone(child.pid) is True
