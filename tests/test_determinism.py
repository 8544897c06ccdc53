"""Determinism (issue 7, part 6): the same seed and world size give the same bits, run
after run, on threads and on gloo processes (docs/reliability.md says where it cannot
hold)."""
from __future__ import annotations

import pytest

import cases
import gradzip
from gradzip.comm.launch import run_processes
from gradzip.train import checkpoint

METHODS = ("efsgd", "cdsgd", "powersgd", "dgc", "cser")


def _assert_same_runs(root, first, second, world_size):
    cases.assert_bitwise_equal(first, second, "histories")
    for method in METHODS:
        for rank in range(world_size):
            steps = 1437 // world_size // 32  # one epoch of digits
            a = checkpoint.load(f"{root}/a-{method}", steps, rank, world_size)
            b = checkpoint.load(f"{root}/b-{method}", steps, rank, world_size)
            cases.assert_bitwise_equal(a["model"], b["model"], f"{method} rank {rank}")
            cases.assert_bitwise_equal(a["optimizer"], b["optimizer"],
                                       f"{method} rank {rank}")


def test_threads_repeat_bit_for_bit(tmp_path):
    runs = [gradzip.simulate(2, lambda c, tag=tag: cases.repeat_runs(c, str(tmp_path), tag))[0] for tag in "ab"]
    _assert_same_runs(tmp_path, *runs, world_size=2)


@pytest.mark.slow
def test_gloo_processes_repeat_bit_for_bit(tmp_path):
    # 3 workers: gloo's ring sums in its own order, which differs from rank order (threads)
    # in the last bit, but is the same order in every run
    runs = [run_processes(3, cases.repeat_runs, str(tmp_path), tag)[0] for tag in "ab"]
    _assert_same_runs(tmp_path, *runs, world_size=3)


def test_threads_and_gloo_agree_bitwise_with_two_workers():
    # one addition per element: a + b == b + a, so the backends cannot differ (docs/reliability.md)
    options = dict(cases.SHORT_RUNS["powersgd"], lr=0.1)
    on_threads = gradzip.simulate(2, lambda c: cases.train_method(c, "powersgd", options, steps=6))
    on_gloo = run_processes(2, cases.train_method, "powersgd", options, 6)
    cases.assert_bitwise_equal(on_threads, on_gloo, "parameters")
