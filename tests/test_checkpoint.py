"""gradzip.train.checkpoint and resuming in the training loop (issue 7, part 1): every
method, interrupted and resumed, ends with the bits of a run never interrupted."""
from __future__ import annotations

import os

import pytest
import torch

import cases
from checkpoint_diff import differences
import gradzip
from gradzip.errors import GradzipError
from gradzip.launch import run_processes
from gradzip.train import checkpoint
from gradzip.train.loop import RunConfig, run_worker


def _check_resumed(root, out, world_size=2, shared_generators=False):
    for method, runs in out.items():
        assert runs["resumed_from"] == 24, method  # the checkpoint before the interruption
        assert runs["steps"][0] == runs["steps"][1], method
        cases.assert_bitwise_equal(runs["whole"], runs["resumed"],
                                   f"{method} history")
        for rank in range(world_size):
            whole = checkpoint.load(f"{root}/{method}-whole", 44, rank, world_size)
            resumed = checkpoint.load(f"{root}/{method}-resumed", 44, rank, world_size)
            if shared_generators:  # threads share torch's and Python's global generators
                whole.pop("rng"), resumed.pop("rng")
            cases.assert_bitwise_equal(whole, resumed,
                                       f"{method} rank {rank}")
            # only the final checkpoint is kept
            assert checkpoint.steps_held(f"{root}/{method}-resumed", rank, world_size) == [44]


@pytest.mark.slow
def test_every_method_resumes_bit_identically_on_gloo(tmp_path):
    out = run_processes(2, cases.resume_runs, str(tmp_path))[0]
    assert set(out) == set(gradzip.optim.METHODS)
    _check_resumed(tmp_path, out)


@pytest.mark.slow
def test_resume_on_threads(tmp_path):
    out = gradzip.simulate(2, lambda c: cases.resume_runs(c, str(tmp_path), ("efsgd", "cdsgd", "powersgd")))[0]
    _check_resumed(tmp_path, out, shared_generators=True)


def test_save_is_atomic_a_crash_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 8, 0, 1, {"x": torch.arange(3)})

    def crash(obj, f, *a, **k):
        f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(GradzipError, match="cannot write checkpoint .*No space left"):
        checkpoint.save(tmp_path, 16, 0, 1, {"x": torch.arange(4)})
    monkeypatch.undo()
    assert checkpoint.steps_held(tmp_path, 0, 1) == [8]
    assert torch.equal(checkpoint.load(tmp_path, 8, 0, 1)["x"], torch.arange(3))
    comm = gradzip.comm.make_group(1)[0]
    assert checkpoint.newest_common(comm, tmp_path) == 8


def test_ranks_agree_on_the_newest_step_all_of_them_hold(tmp_path):
    for rank in (0, 1):
        checkpoint.save(tmp_path, 8, rank, 2, {})
    checkpoint.save(tmp_path, 16, 0, 2, {})  # rank 1 died before writing step 16
    assert gradzip.simulate(2, lambda c: checkpoint.newest_common(c, tmp_path)) == [8, 8]


def test_resume_with_another_world_size_is_refused(tmp_path):
    for rank in (0, 1):
        checkpoint.save(tmp_path, 8, rank, 2, {})
    with pytest.raises(GradzipError, match="checkpoints of 2 workers, not 3"):
        gradzip.simulate(3, lambda c: checkpoint.newest_common(c, tmp_path))


def test_a_damaged_file_names_itself_and_the_way_out(tmp_path):
    path = checkpoint.save(tmp_path, 8, 0, 1, {"x": torch.arange(3)})
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(GradzipError, match=f"{path}.*cannot be read.*delete the directory"):
        checkpoint.load(tmp_path, 8, 0, 1)


def test_a_checkpoint_does_not_run_code_when_loaded(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    path = checkpoint.rank_file(tmp_path, 8, 0, 1)
    path.parent.mkdir(parents=True)
    path.write_bytes(pickle.dumps(Evil(), protocol=2))
    with pytest.raises(GradzipError, match="cannot be read"):
        checkpoint.load(tmp_path, 8, 0, 1)


def test_resume_refuses_other_settings_naming_the_field(tmp_path):
    cfg = RunConfig(epochs=1, progress=False, checkpoint_dir=str(tmp_path), checkpoint_every=10)
    gradzip.simulate(1, lambda c: run_worker(c, cfg))
    changed = RunConfig(**{**vars(cfg), "lr": 0.2, "resume": True})
    with pytest.raises(GradzipError, match="written with lr=0.1, this run has lr=0.2"):
        gradzip.simulate(1, lambda c: run_worker(c, changed))
    fresh = RunConfig(**{**vars(cfg)})
    with pytest.raises(GradzipError, match="already holds a checkpoint .* --resume"):
        gradzip.simulate(1, lambda c: run_worker(c, fresh))
    # more epochs is fine: the run goes on from where it ended
    longer = RunConfig(**{**vars(cfg), "epochs": 2, "resume": True})
    out = gradzip.simulate(1, lambda c: run_worker(c, longer))[0]
    assert out["summary"]["resumed_from_step"] == 44 and len(out["history"]) == 2


def test_resume_from_an_empty_directory_starts_from_scratch(tmp_path):
    cfg = RunConfig(epochs=1, progress=False, checkpoint_dir=str(tmp_path / "new"), resume=True)
    out = gradzip.simulate(2, lambda c: run_worker(c, cfg))[0]
    assert out["summary"]["resumed_from_step"] is None
    assert checkpoint.steps_held(tmp_path / "new", 1, 2) == [22]  # default: every epoch


def test_prune_removes_what_a_killed_write_left(tmp_path):
    checkpoint.save(tmp_path, 8, 0, 1, {})
    orphan = checkpoint.rank_file(tmp_path, 16, 0, 1).with_name(".rank-0-of-1.pt.tmp-4242")
    orphan.parent.mkdir()
    orphan.write_bytes(b"half")
    assert checkpoint.steps_held(tmp_path, 0, 1) == [8]  # never taken for a checkpoint
    checkpoint.save(tmp_path, 24, 0, 1, {})
    checkpoint.prune(tmp_path, 0, 1, keep_from=24)
    assert not orphan.exists() and checkpoint.steps_held(tmp_path, 0, 1) == [24]


def test_differences_name_the_paths_and_leave_clocks_out():
    a = {"model": {"w": torch.tensor([1.0, float("nan")])}, "loop": {"wall_time_s": 1.0, "done": 3},
         "timings": {"x": 1}, "history": [{"time_compute_s": 0.5, "loss": 0.25}]}
    b = {"model": {"w": torch.tensor([1.0, float("nan")])}, "loop": {"wall_time_s": 9.0, "done": 3},
         "timings": {"x": 2}, "history": [{"time_compute_s": 0.7, "loss": 0.25}]}
    assert differences(a, b) == []
    b["model"]["w"] = torch.tensor([1.0 + 2 ** -23, float("nan")])  # one ulp
    b["history"][0]["loss"] = 0.5
    b["extra"] = 1
    assert differences(a, b) == ["checkpoint.model.w", "checkpoint.history[0].loss", "checkpoint.extra"]
    assert differences(torch.zeros(2), torch.zeros(2, dtype=torch.float64)) == ["checkpoint"]
