"""gradzip.guards.consistency (issue 7, part 2): workers with different settings stop together
with one message naming the field that differs — never a hang or a silent divergence."""
from __future__ import annotations

import pytest

import cases
import gradzip
from gradzip.guards.consistency import InconsistentWorkers, describe_difference, verify
from gradzip.comm.launch import run_processes
from gradzip.train.config import RunConfig
from gradzip.train.loop import run_worker


def test_equal_settings_pass_with_one_small_collective():
    def run(comm):
        verify(comm, {"method": "efsgd", "H": 4})
        return comm.bytes_sent
    assert gradzip.simulate(3, run) == [2 * 8] * 3  # allgather of one int64: (n-1) * 8 bytes


@pytest.mark.parametrize("field, expected", [
    ("lr", r"'param_groups\[0\]\.lr' differs — rank[s]? 0(,2)?: 0\.1; rank 1: 0\.2"),
    ("compressor", r"'exchange 0 codec' differs — ranks 0,2: topk:ratio=0\.3; rank 1: topk:ratio=0\.5"),
    ("shape", r"'parameter shapes' differs .*rank 1: \[\(7, 4\), \(7,\), \(2, 7\), \(2,\)\]"),
])
def test_optimizers_with_different_settings_stop_on_every_rank(field, expected):
    errors = []

    def run(comm):
        try:
            return cases.different_settings(comm, field)
        except InconsistentWorkers as exc:
            errors.append(str(exc))
            raise
    with pytest.raises(InconsistentWorkers, match=expected):
        gradzip.simulate(3, run)
    assert len(errors) == 3 and len(set(errors)) == 1  # the same message on every worker


@pytest.mark.slow
def test_on_gloo_processes():
    with pytest.raises(InconsistentWorkers, match=r"'param_groups\[0\]\.lr' differs — rank 0: 0\.1; rank 1: 0\.2"):
        run_processes(2, cases.different_settings, "lr")


def test_run_settings_are_compared_before_training():
    def run(comm):
        cfg = RunConfig(epochs=1, progress=False, batch_size=32 if comm.rank == 0 else 16)
        return run_worker(comm, cfg)
    with pytest.raises(InconsistentWorkers, match="'batch_size' differs — rank 0: 32; rank 1: 16"):
        gradzip.simulate(2, run)


def test_message_counts_further_differences_and_missing_fields():
    text = describe_difference([{"a": "1", "b": "x"}, {"a": "2", "c": "y"}])
    assert "'a' differs (and 2 more fields) — rank 0: 1; rank 1: 2" in text
    text = describe_difference([{"a": "1"}, {"a": "1", "b": "2"}])
    assert "'b' differs — rank 0: <not set>; rank 1: 2" in text


def test_a_world_of_one_needs_no_collective():
    comm = gradzip.comm.make_group(1)[0]
    verify(comm, {"x": 1})
    assert comm.bytes_sent == 0
