"""gradzip.allocator: the malloc settings the launchers give their workers."""
from __future__ import annotations

import os

import pytest

from gradzip import allocator
from gradzip.errors import GradzipError
from gradzip.comm.launch import run_processes


def test_worker_env_adds_the_settings_and_keeps_the_rest():
    env = allocator.worker_env({"PATH": "/bin"})
    assert env["PATH"] == "/bin"
    assert {k: env[k] for k in allocator.MALLOC_ENV} == allocator.MALLOC_ENV


@pytest.mark.parametrize("given", [{"MALLOC_MMAP_THRESHOLD_": "4096"}, {"MALLOC_TRIM_THRESHOLD_": "1"},
                                   {"GRADZIP_MALLOC": "system"}, {"GRADZIP_MALLOC": "SYSTEM"}])
def test_a_users_own_setting_or_the_opt_out_leaves_the_environment_as_it_is(given):
    assert allocator.worker_env(given) == given


def test_gradzip_malloc_gradzip_is_the_default_and_a_typo_is_refused_naming_the_choices():
    assert allocator.worker_env({"GRADZIP_MALLOC": "gradzip"})["MALLOC_MMAP_THRESHOLD_"] == \
        allocator.MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
    with pytest.raises(GradzipError, match=r"GRADZIP_MALLOC='sytem' is not a choice; set it to system"):
        allocator.worker_env({"GRADZIP_MALLOC": "sytem"})


def test_worker_env_does_not_touch_this_process():
    before = dict(os.environ)
    allocator.worker_env()
    assert dict(os.environ) == before


def _seen(comm):
    return {k: os.environ.get(k) for k in allocator.MALLOC_ENV}


@pytest.mark.slow
def test_run_processes_workers_start_with_the_settings_and_the_parent_keeps_its_own(monkeypatch):
    for k in allocator.MALLOC_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("GRADZIP_MALLOC", raising=False)
    before = dict(os.environ)
    assert run_processes(2, _seen) == [allocator.MALLOC_ENV] * 2
    assert dict(os.environ) == before
