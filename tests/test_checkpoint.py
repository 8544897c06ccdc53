"""gradzip.train.checkpoint and resuming in the training loop (issue 7, part 1): every
method, interrupted and resumed, ends with the bits of a run never interrupted."""
from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

import cases
from checkpoint_diff import differences
import gradzip
from gradzip.errors import GradzipError
from gradzip.comm.launch import run_processes
from gradzip.train import checkpoint
from gradzip.train.config import RunConfig
from gradzip.train.loop import run_worker


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
            # the newest two steps are kept (--keep-checkpoints' default)
            assert checkpoint.steps_held(f"{root}/{method}-resumed", rank, world_size) == [40, 44]


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


def test_a_damaged_file_names_itself(tmp_path):
    path = checkpoint.save(tmp_path, 8, 0, 1, {"x": torch.arange(3)})
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(GradzipError, match=f"checkpoint file {path} does not match its SHA-256 checksum"):
        checkpoint.load(tmp_path, 8, 0, 1)


def _with_checksum(path):
    checkpoint.checksum_file(path).write_text(f"{checkpoint.sha256(path)}  {path.name}\n")


def test_a_checkpoint_does_not_run_code_when_loaded(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    path = checkpoint.rank_file(tmp_path, 8, 0, 1)
    path.parent.mkdir(parents=True)
    path.write_bytes(pickle.dumps(Evil(), protocol=2))
    _with_checksum(path)   # so that torch.load is reached
    with pytest.raises(GradzipError, match="matches its checksum but does not load .*UnpicklingError"):
        checkpoint.load(tmp_path, 8, 0, 1)


def test_resume_refuses_other_settings_naming_the_field(tmp_path):
    cfg = RunConfig(epochs=1, progress=False, checkpoint_dir=str(tmp_path), checkpoint_every=10)
    gradzip.simulate(1, lambda c: run_worker(c, cfg))
    # issue 35, item 14: the setting changed is named, not a value that follows from it
    # (a parameter's values for --seed, a transport plan for --model)
    for changed, message in ((dict(lr=0.2), "written with lr=0.1, this run has lr=0.2;"),
                             (dict(seed=7), "written with seed=0, this run has seed=7;"),
                             (dict(model="logreg"), "written with model='mlp', this run has model='logreg';"),
                             (dict(seed=7, lr=0.2), "written with lr=0.1, this run has lr=0.2 (and 1 more field);")):
        other = RunConfig(**{**vars(cfg), **changed, "resume": True})
        with pytest.raises(GradzipError, match=re.escape(message)):
            gradzip.simulate(1, lambda c: run_worker(c, other))
    fresh = RunConfig(**{**vars(cfg)})
    with pytest.raises(GradzipError, match="already holds a checkpoint .* --resume"):
        gradzip.simulate(1, lambda c: run_worker(c, fresh))
    # more epochs is fine: the run goes on from where it ended
    longer = RunConfig(**{**vars(cfg), "epochs": 2, "resume": True})
    out = gradzip.simulate(1, lambda c: run_worker(c, longer))[0]
    assert out["summary"]["resumed_from_step"] == 44 and len(out["history"]) == 2


def test_a_resume_on_another_thread_count_says_so(tmp_path, capsys):
    # issue 35, item 15: the backend and torch's thread count are recorded; a resume on
    # others goes on (a machine may change) but says that the numbers may differ
    cfg = RunConfig(epochs=1, progress=False, checkpoint_dir=str(tmp_path), resume=True)
    gradzip.simulate(1, lambda c: run_worker(c, cfg))
    assert checkpoint.load(tmp_path, 44, 0, 1)["environment"] == {"backend": "threads",
                                                                   "threads": torch.get_num_threads()}
    threads = torch.get_num_threads()

    def resume(epochs, with_threads):
        capsys.readouterr()
        torch.set_num_threads(with_threads)
        try:
            out = gradzip.simulate(1, lambda c: run_worker(c, RunConfig(**{**vars(cfg), "epochs": epochs})))
        finally:
            torch.set_num_threads(threads)
        return out[0]["summary"]["resumed_from_step"], _lines(capsys)
    resumed, err = resume(2, threads + 1)
    assert resumed == 44 and len(err) == 1, err
    assert (f"written by workers on threads with {threads} torch thread(s) each, this run's are on threads with "
            f"{threads + 1}") in err[0] and f"OMP_NUM_THREADS={threads}" in err[0], err
    assert resume(3, threads + 1) == (88, [])   # as it was written: nothing to say


def test_resume_from_an_empty_directory_starts_from_scratch(tmp_path):
    cfg = RunConfig(epochs=1, progress=False, checkpoint_dir=str(tmp_path / "new"), resume=True)
    out = gradzip.simulate(2, lambda c: run_worker(c, cfg))[0]
    assert out["summary"]["resumed_from_step"] is None
    assert checkpoint.steps_held(tmp_path / "new", 1, 2) == [22]  # default: every epoch


def test_prune_keeps_the_newest_steps_and_removes_what_a_killed_write_left(tmp_path):
    checkpoint.save(tmp_path, 8, 0, 1, {})
    orphan = checkpoint.rank_file(tmp_path, 16, 0, 1).with_name(".rank-0-of-1.pt.tmp-4242")
    orphan.parent.mkdir()
    orphan.write_bytes(b"half")
    assert checkpoint.steps_held(tmp_path, 0, 1) == [8]  # never taken for a checkpoint
    checkpoint.save(tmp_path, 24, 0, 1, {})
    checkpoint.prune(tmp_path, 0, 1, keep=2)
    assert not orphan.exists() and checkpoint.steps_held(tmp_path, 0, 1) == [8, 24]
    checkpoint.save(tmp_path, 32, 0, 1, {})
    checkpoint.prune(tmp_path, 0, 1, keep=2)
    assert checkpoint.steps_held(tmp_path, 0, 1) == [24, 32] and not checkpoint.rank_file(tmp_path, 8, 0, 1).parent.exists()
    with pytest.raises(GradzipError, match="--keep-checkpoints must be an integer >= 2"):
        checkpoint.prune(tmp_path, 0, 1, keep=1)


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


# -- integrity, interrupted saves, full disks (issue 12: items 2, 10, 11, 12, 15, 16) ------
def _flip_tensor_bytes(path):
    """Flip two bytes in the middle of the largest tensor's data inside a torch.save file
    (a zip archive: the data of each tensor is one stored member)."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    raw[at] ^= 0xFF
    raw[at + 1] ^= 0x0F
    path.write_bytes(bytes(raw))


def _agree(root, notes=None, start_over=False):
    """Every rank's outcome of the resume agreement: the step, or the GradzipError's text."""
    def fn(c):
        try:
            return checkpoint.newest_common(c, root, notes.append if notes is not None and c.rank == 0 else None,
                                            start_over)
        except GradzipError as exc:
            return f"refused: {exc}"
    return gradzip.simulate(2, fn)


def _tree(root):
    """Every file under ``root`` with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_damaged_file_on_one_rank_is_moved_aside_and_the_newest_sound_step_taken(tmp_path):
    for step in (8, 16):
        for rank in (0, 1):
            checkpoint.save(tmp_path, step, rank, 2, {"w": torch.arange(1000.0) + step})
    damaged = checkpoint.rank_file(tmp_path, 16, 1, 2)
    _flip_tensor_bytes(damaged)
    content = damaged.read_bytes()
    notes = []
    assert _agree(tmp_path, notes) == [8, 8]
    assert len(notes) == 1 and "\n" not in notes[0]
    assert f"{damaged} does not match its SHA-256 checksum" in notes[0] and "resuming from step 8" in notes[0]
    aside = list(damaged.parent.glob("rank-1-of-2.pt.rejected-*"))   # kept, renamed, and named in the note
    assert len(aside) == 1 and aside[0].read_bytes() == content and f"moved aside to {aside[0].name}" in notes[0]
    assert list(damaged.parent.glob("rank-1-of-2.sha256.rejected-*")) and not damaged.exists()


def test_no_sound_step_is_refused_naming_the_file_and_nothing_changes_unless_asked(tmp_path):
    for step in (8, 16):
        for rank in (0, 1):
            checkpoint.save(tmp_path, step, rank, 2, {"w": torch.arange(1000.0) + step})
    _flip_tensor_bytes(checkpoint.rank_file(tmp_path, 16, 1, 2))
    _flip_tensor_bytes(checkpoint.rank_file(tmp_path, 8, 0, 2))
    before = _tree(tmp_path)
    out = _agree(tmp_path)
    assert out[0] == out[1] and out[0].startswith("refused: ") and "\n" not in out[0], out
    assert f"{checkpoint.rank_file(tmp_path, 16, 1, 2)} does not match its SHA-256 checksum" in out[0]
    assert "(and 1 more file(s) of 2 step(s) fail too)" in out[0] and "--start-over-if-damaged" in out[0]
    assert _tree(tmp_path) == before   # nothing moved, nothing deleted
    # a rank's files missing altogether: refused the same way
    for step in (8, 16):
        checkpoint.rank_file(tmp_path, step, 1, 2).unlink()
    out = _agree(tmp_path)
    assert "the ranks hold no step in common (rank 0: 8, 16; rank 1: none)" in out[0] and out[0] == out[1], out
    # asked to start over: from scratch, the damaged file kept under another name
    for step in (8, 16):
        checkpoint.save(tmp_path, step, 1, 2, {"w": torch.arange(1000.0) + step})
    _flip_tensor_bytes(checkpoint.rank_file(tmp_path, 16, 1, 2))
    notes = []
    assert _agree(tmp_path, notes, start_over=True) == [None, None]
    assert len(notes) == 1 and "starting from scratch (--start-over-if-damaged)" in notes[0], notes
    assert len(list(tmp_path.glob("step-*/*.rejected-*"))) == 4   # two files and their checksums


def _models(root, step, world_size=2):
    return [checkpoint.load(root, step, r, world_size)["model"] for r in range(world_size)]


def _lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_one_damaged_rank_file_resumes_from_the_step_before_it(tmp_path, capsys):
    # issue 35, item 2: --checkpoint-every 7 over 2 epochs, rank 1's checksum of the last step
    # removed, then resumed for 4 epochs: from step 42, with the bits of a run never interrupted
    ck, whole = tmp_path / "ck", tmp_path / "whole"
    cfg = RunConfig(algo="efsgd", epochs=2, progress=False, checkpoint_dir=str(ck), checkpoint_every=7, resume=True)
    gradzip.simulate(2, lambda c: run_worker(c, cfg))
    assert checkpoint.steps_held(ck, 0, 2) == checkpoint.steps_held(ck, 1, 2) == [42, 44]
    checkpoint.checksum_file(checkpoint.rank_file(ck, 44, 1, 2)).unlink()
    capsys.readouterr()
    longer = RunConfig(**{**vars(cfg), "epochs": 4})
    out = gradzip.simulate(2, lambda c: run_worker(c, longer))
    err = _lines(capsys)
    assert out[0]["summary"]["resumed_from_step"] == 42
    assert len(err) == 1 and "step-000000044/rank-1-of-2.pt has no checksum file" in err[0], err
    assert "moved aside to rank-1-of-2.pt.rejected-" in err[0] and "resuming from step 42" in err[0], err
    assert len(list(ck.glob("step-000000044/rank-1-of-2.pt.rejected-*"))) == 1
    gradzip.simulate(2, lambda c: run_worker(c, RunConfig(**{**vars(longer), "checkpoint_dir": str(whole),
                                                                 "resume": False})))
    for rank in (0, 1):   # threads share the global generators: their states are left out
        resumed, uninterrupted = (checkpoint.load(d, 88, rank, 2) for d in (ck, whole))
        resumed.pop("rng"), uninterrupted.pop("rng")
        cases.assert_bitwise_equal(resumed, uninterrupted, f"rank {rank}")


def test_swapped_rank_files_are_not_taken(tmp_path, capsys):
    # issue 35, item 3: rank files swapped (checksums regenerated) hold the other rank's state
    ck = tmp_path / "ck"
    cfg = RunConfig(algo="efsgd", epochs=1, progress=False, checkpoint_dir=str(ck), checkpoint_every=10, resume=True)
    gradzip.simulate(2, lambda c: run_worker(c, cfg))
    zero, one = (checkpoint.rank_file(ck, 22, r, 2) for r in (0, 1))
    swap = zero.with_name("swap")
    zero.rename(swap), one.rename(zero), swap.rename(one)
    _with_checksum(zero), _with_checksum(one)
    capsys.readouterr()
    out = gradzip.simulate(2, lambda c: run_worker(c, RunConfig(**{**vars(cfg), "epochs": 2})))
    err = _lines(capsys)
    assert out[0]["summary"]["resumed_from_step"] == 20, err
    assert len(err) == 1 and f"{zero} holds the state of rank 1 of 2 workers at step 22, not its own" in err[0], err
    assert "(and 1 more file(s) moved aside likewise)" in err[0] and "resuming from step 20" in err[0]
    final = _models(ck, 44)
    cases.assert_bitwise_equal(final[0], final[1], "replicas")


def test_files_of_another_run_are_not_taken(tmp_path):
    for rank in (0, 1):
        checkpoint.save(tmp_path, 8, rank, 2, {}, run=5)
    checkpoint.save(tmp_path, 16, 0, 2, {}, run=5)
    checkpoint.save(tmp_path, 16, 1, 2, {}, run=6)   # copied in from another run
    notes = []
    assert _agree(tmp_path, notes) == [8, 8]
    assert "step-000000016/rank-1-of-2.pt belongs to another run than the other ranks' files" in notes[0], notes


def test_an_empty_file_with_a_matching_checksum_is_named(tmp_path):
    # issue 35, item 10: an empty file whose checksum matches raised IndexError while the
    # error was being written
    for step in (8, 16):
        for rank in (0, 1):
            checkpoint.save(tmp_path, step, rank, 2, {"w": torch.zeros(3)})
    empty = checkpoint.rank_file(tmp_path, 16, 1, 2)
    empty.write_bytes(b"")
    _with_checksum(empty)
    with pytest.raises(GradzipError, match=f"{empty} matches its checksum but does not load .*EOFError"):
        checkpoint.load(tmp_path, 16, 1, 2)
    notes = []
    assert _agree(tmp_path, notes) == [8, 8]
    assert f"{empty} matches its checksum but does not load" in notes[0], notes


def test_a_kill_during_the_first_checkpoint_resumes_from_scratch_and_cleans_up(tmp_path, capsys):
    # rank 0 wrote step 10, rank 1 was killed while writing it: only its temporary file is there
    ck = tmp_path / "ck"
    checkpoint.save(ck, 10, 0, 2, {"x": torch.arange(3)})
    orphan = checkpoint.rank_file(ck, 10, 1, 2).with_name(".rank-1-of-2.pt.tmp-4242")
    orphan.write_bytes(b"half")
    cfg = RunConfig(epochs=1, progress=False, checkpoint_dir=str(ck), checkpoint_every=10, resume=True)
    out = gradzip.simulate(2, lambda c: run_worker(c, cfg))
    assert out[0]["summary"]["resumed_from_step"] is None and out[0]["summary"]["steps"] == 22
    assert not orphan.exists()
    assert checkpoint.steps_held(ck, 0, 2) == checkpoint.steps_held(ck, 1, 2) == [20, 22]
    assert "holds no step that every rank has" in capsys.readouterr().err


def test_pruning_survives_a_step_directory_another_rank_removes_meanwhile(tmp_path, monkeypatch):
    # issue 35, item 9: rank 0 alone held step 5; its prune removed step-000000005 while
    # rank 1 was listing the step directories (a raw FileNotFoundError mid-training)
    for rank, steps in ((0, (5, 10, 15)), (1, (10, 15))):
        for step in steps:
            checkpoint.save(tmp_path, step, rank, 2, {})
    victim = checkpoint.rank_file(tmp_path, 5, 0, 2).parent
    real_scandir = os.scandir

    def scandir(path=".", *args):
        if not isinstance(path, int) and os.fspath(path) == str(victim) and victim.exists():
            shutil.rmtree(victim)   # rank 0's prune, just before rank 1 looks inside
        return real_scandir(path, *args)
    monkeypatch.setattr(os, "scandir", scandir)
    checkpoint.prune(tmp_path, 1, 2, keep=2)
    monkeypatch.undo()
    assert checkpoint.steps_held(tmp_path, 1, 2) == [10, 15] and not victim.exists()


@pytest.mark.parametrize("failure", [
    RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                 "data/3: file write failed"),
    OSError(28, "No space left on device"),
])
def test_a_full_disk_is_one_line_naming_the_directory_and_leaves_no_temporaries(tmp_path, monkeypatch, failure):
    checkpoint.save(tmp_path, 8, 0, 1, {"x": torch.arange(3)})

    def full(obj, f, *a, **k):
        f.write(b"x" * 1000)
        raise failure
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(GradzipError) as info:
        checkpoint.save(tmp_path, 16, 0, 1, {"x": torch.zeros(250_000)})
    monkeypatch.undo()
    message = str(info.value)
    assert "\n" not in message and f"in {tmp_path} (" in message and "needs about 1.0 MB" in message, message
    assert "MB free there" in message and "previous checkpoint is kept" in message
    assert not list(tmp_path.glob("step-*/.*"))  # no temporaries
    assert checkpoint.steps_held(tmp_path, 0, 1) == [8]
    assert torch.equal(checkpoint.load(tmp_path, 8, 0, 1)["x"], torch.arange(3))


def test_a_real_full_disk(tmp_path):
    import subprocess

    disk = tmp_path / "tiny"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        checkpoint.save(disk, 8, 0, 1, {"x": torch.arange(3)})
        with pytest.raises(GradzipError, match=f"cannot write checkpoint .*in {disk} "):
            checkpoint.save(disk, 16, 0, 1, {"x": torch.zeros(1_000_000)})
        assert not list(disk.glob("step-*/.*")) and checkpoint.steps_held(disk, 0, 1) == [8]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def _per_rank(cfgs):
    def fn(comm):
        try:
            run_worker(comm, cfgs[comm.rank])
        except GradzipError as exc:
            return str(exc)
        return "ran"
    return fn


@pytest.mark.parametrize("field, rank1", [("checkpoint_dir given", {"checkpoint_dir": None, "checkpoint_every": 0}),
                                          ("checkpoint_every", {"checkpoint_every": 7})])
def test_settings_that_change_the_collectives_are_compared_across_ranks(tmp_path, field, rank1):
    cfg = RunConfig(epochs=1, progress=False, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=10)
    cfgs = [cfg, RunConfig(**{**vars(cfg), **rank1})]
    out = gradzip.simulate(2, _per_rank(cfgs), timeout_s=20)
    for message in out:
        assert "workers run with different run settings" in message and repr(field) in message, message


def test_resuming_past_the_end_of_the_run_is_refused(tmp_path):
    cfg = RunConfig(epochs=2, progress=False, checkpoint_dir=str(tmp_path))
    gradzip.simulate(1, lambda c: run_worker(c, cfg))
    shorter = RunConfig(**{**vars(cfg), "epochs": 1, "resume": True})
    with pytest.raises(GradzipError, match=r"at step 88 \(epoch 2\), past the end of this run \(1 epochs, 44 "
                                           r"steps\); resume with --epochs 2 or more"):
        gradzip.simulate(1, lambda c: run_worker(c, shorter))


def test_an_explicit_default_codec_resumes_a_run_that_used_the_default(tmp_path):
    from gradzip.optim.efsgd import DEFAULT_CODEC

    cfg = RunConfig(algo="efsgd", epochs=1, progress=False, checkpoint_dir=str(tmp_path))
    gradzip.simulate(1, lambda c: run_worker(c, cfg))
    explicit = RunConfig(**{**vars(cfg), "epochs": 2, "resume": True, "options": {"compressor": DEFAULT_CODEC}})
    out = gradzip.simulate(1, lambda c: run_worker(c, explicit))[0]
    assert out["summary"]["resumed_from_step"] == 44
    other = RunConfig(**{**vars(cfg), "epochs": 3, "resume": True, "options": {"compressor": "topk:ratio=0.5"}})
    with pytest.raises(GradzipError, match="written with exchange 0 codec="):
        gradzip.simulate(1, lambda c: run_worker(c, other))


def test_a_torch_file_that_is_not_a_gradzip_checkpoint_is_named(tmp_path):
    checkpoint.save(tmp_path, 8, 0, 1, {"weights": torch.arange(3)})
    cfg = RunConfig(epochs=1, progress=False, checkpoint_dir=str(tmp_path), resume=True)
    with pytest.raises(GradzipError, match=r"rank-0-of-1\.pt is not a gradzip checkpoint"):
        gradzip.simulate(1, lambda c: run_worker(c, cfg))


@pytest.mark.parametrize("name, message", [("step-000000022", "is one step of a checkpoint directory"),
                                           ("mine", "holds files that are not gradzip checkpoints")])
def test_a_directory_that_is_not_a_checkpoint_directory_is_refused(tmp_path, name, message):
    (tmp_path / name).mkdir()
    if name == "mine":
        (tmp_path / name / "notes.txt").write_text("x")
    cfg = RunConfig(epochs=1, progress=False, checkpoint_dir=str(tmp_path / name), resume=True)
    with pytest.raises(GradzipError, match=message):
        gradzip.simulate(1, lambda c: run_worker(c, cfg))
