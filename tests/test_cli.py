import json
import subprocess
import sys
from pathlib import Path

import pytest

from gradzip.cli import build_parser, main
from gradzip.cli.runs import _configs
from gradzip.train.config import parse_algos
from gradzip.errors import GradzipError

from conftest import SHARED_DATA


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "gradzip.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("args, message", [
    (["train", "--epochs", "0"], "--epochs: expected an integer >= 1"),
    (["train", "--lr", "-1"], "--lr: expected a number >= 0"),
    (["train", "--workers", "0"], "--workers: expected an integer >= 1"),
    (["train", "--algo", "nope"], "invalid choice"),
    (["train", "--bogus"], "unrecognized arguments"),
    (["train", "--compressor", "topk:ratio=2"], "ratio"),
    (["train", "--compressor", "zip"], "valid names"),
    (["train", "--algo", "bitsgd", "--compressor", "topk"], "takes no option compressor"),
    (["train", "--dataset", "imagenet"], "imagenet"),
    (["train", "--dataset", "mnist", "--data-dir", "/nonexistent/dir"], "/nonexistent/dir"),
    (["compare", "--algos", "ssgd,foo"], "unknown method 'foo'"),
    (["compare", "--algos", "ssgd,efsgd", "--threshold", "0.1"], "no method in --algos takes --threshold"),
    (["train", "--algo", "bitsgd", "--threshold", "-1"], "threshold must be > 0"),
    (["train", "--checkpoint-every", "10"], "--checkpoint-every needs a directory"),
    (["train", "--resume", "a", "--checkpoint-dir", "b"], "give --checkpoint-dir the same directory"),
    (["train", "--resume", "a", "--keep-checkpoints", "1"], "--keep-checkpoints: expected an integer >= 2"),
    (["train", "--checkpoint-dir", "a", "--start-over-if-damaged"], "--start-over-if-damaged says what --resume"),
    (["train", "--nonfinite", "ignore"], "invalid choice"),
    (["train", "--timeout", "0"], "--timeout: expected seconds > 0"),
    (["train", "--out", "/proc/version/x"], "--out /proc/version/x: cannot create"),
    (["train", "--lr", "1e30", "--epochs", "1", "--quiet", "--backend", "threads", "--workers", "2"],
     "non-finite gradient (NaN or Inf) on rank"),
])
def test_bad_input_is_one_line_and_nonzero(args, message, capsys):
    with pytest.raises(SystemExit) as exc_info:
        code = main(args)
        raise SystemExit(code)
    assert exc_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert message in err
    assert "Traceback" not in err


def test_parse_algos_keeps_codec_parameters_together():
    assert parse_algos("ssgd,efsgd@randomk:ratio=0.1,unbiased=true,bitsgd") == [
        ("ssgd", None), ("efsgd", "randomk:ratio=0.1,unbiased=true"), ("bitsgd", None)]
    with pytest.raises(GradzipError):
        parse_algos(" , ")


def test_train_threads_writes_outputs(tmp_path):
    code = main(["train", "--algo", "efsgd", "--compressor", "topk:ratio=0.1", "--workers", "2",
                 "--backend", "threads", "--epochs", "2", "--quiet", "--out", str(tmp_path)])
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ["algo", "workers", "final_test_accuracy", "bytes_sent_per_worker", "steps", "wall_time_s",
                "time_compute_s", "time_compress_s", "time_communicate_s"]:
        assert key in summary
    assert summary["workers"] == 2 and summary["bytes_sent_per_worker"] > 0
    # top-10%, 4-byte values and uint8 / uint16 indices: R between 4/(6*0.1) and 4/(5*0.1)
    assert 6.6 < summary["compression_ratio"] < 8
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
    assert (tmp_path / "accuracy.png").stat().st_size > 1000


@pytest.mark.slow
def test_train_digits_two_processes_reaches_90_percent(tmp_path):
    proc = run_cli("train", "--algo", "ssgd", "--workers", "2", "--epochs", "10", "--quiet",
                   "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["workers"] == 2
    assert summary["final_test_accuracy"] > 0.90
    assert "ssgd" in proc.stdout and "test acc" in proc.stdout


@pytest.mark.slow
def test_same_entry_point_under_torchrun(tmp_path):
    import shutil

    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "gradzip.cli", "train",
                           "--algo", "bitsgd", "--epochs", "1", "--quiet", "--no-plot", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["algo"] == "bitsgd"


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED_DATA / "mnist-5k").is_dir(), reason="../shared/data/mnist-5k not present")
def test_train_on_real_mnist_files(tmp_path):
    code = main(["train", "--dataset", "mnist", "--data-dir", str(SHARED_DATA / "mnist-5k"), "--model", "lenet",
                 "--workers", "2", "--backend", "threads", "--epochs", "1", "--quiet", "--out", str(tmp_path)])
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dataset"] == "mnist" and summary["final_test_accuracy"] > 0.5


def test_evaluation_on_the_average_of_differing_replicas_leaves_training_untouched():
    import torch

    import gradzip
    from gradzip.optim import SSGD
    from gradzip.train.evaluation import evaluation_model

    def fn(comm):
        model = torch.nn.Linear(3, 2)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(comm.rank))  # replicas differ: 0, 1, 2
        opt = SSGD(model.parameters(), lr=0.1, comm=comm)
        sent = comm.bytes_sent
        local = evaluation_model(model, opt, comm, "local")
        avg = evaluation_model(model, opt, comm, "average")
        auto = evaluation_model(model, opt, comm, "auto")  # SSGD replicas agree: no averaging
        return (local is model, [p.clone() for p in avg.parameters()], auto is model,
                [p.clone() for p in model.parameters()], comm.bytes_sent > sent, opt.bytes_sent)

    for rank, (is_local, avg, is_auto, own, communicated, opt_bytes) in enumerate(gradzip.simulate(3, fn)):
        assert is_local and is_auto and communicated and opt_bytes == 0
        assert all(torch.all(p == 1.0) for p in avg)              # mean of 0, 1, 2
        assert all(torch.all(p == float(rank)) for p in own)      # training state untouched


def test_trace_has_one_track_per_worker_and_a_span_per_phase(tmp_path):
    trace_file = tmp_path / "t.json"
    code = main(["train", "--algo", "efsgd", "--workers", "2", "--backend", "threads", "--epochs", "1",
                 "--quiet", "--no-plot", "--trace", str(trace_file), "--out", str(tmp_path)])
    assert code == 0
    events = json.loads(trace_file.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    steps = json.loads((tmp_path / "summary.json").read_text())["steps"]
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        for phase in ("compute", "compress", "communicate", "decode", "step"):
            assert sum(e["name"] == phase for e in mine) == steps, (rank, phase)
        computes = sorted((e["ts"], e["ts"] + e["dur"]) for e in mine if e["name"] == "compute")
        assert all(a[1] <= b[0] for a, b in zip(computes, computes[1:]))  # no overlap without overlap
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"worker 0", "worker 1"}


def test_checkpoint_resume_and_skip_through_the_cli(tmp_path, capsys):
    common = ["train", "--algo", "cdsgd", "--quiet", "--no-plot", "--backend", "threads", "--workers", "2",
              "--checkpoint-every", "10", "--nonfinite", "skip"]
    assert main([*common, "--epochs", "1", "--resume", str(tmp_path / "ck"), "--out", str(tmp_path / "a")]) == 0
    assert main([*common, "--epochs", "2", "--resume", str(tmp_path / "ck"), "--out", str(tmp_path / "b")]) == 0
    first = json.loads((tmp_path / "a" / "summary.json").read_text())
    second = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert first["resumed_from_step"] is None and second["resumed_from_step"] == first["steps"] == 22
    assert second["steps"] == 44 and second["skipped_steps"] == 0
    assert second["bytes_sent_per_worker"] > first["bytes_sent_per_worker"]  # counters carried on
    records = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]  # the first epoch's record came with the checkpoint


def test_table_shows_skips_and_resumes_only_when_there_are_some():
    from gradzip.cli import report

    plain = {"algo": "ssgd", "skipped_steps": 0, "resumed_from_step": None}
    assert "skipped" not in report.table([plain]) and "resumed" not in report.table([plain])
    text = report.table([plain, {"algo": "efsgd", "skipped_steps": 3, "resumed_from_step": 20}])
    assert "skipped" in text and "resumed at" in text and text.splitlines()[3].split()[-2:] == ["3", "20"]


def test_the_tables_time_columns_are_what_its_legend_says():
    """Issue 36, item 11: no "comm s" column (on the training thread it was "wait s" itself,
    and the network time behind backward or a step is not measured); the legend under the
    table says what "wait s" holds, a background exchange's codec work included."""
    from gradzip.cli import report

    text = report.table([{"algo": "cdsgd", "time_communicate_s": 0.06, "time_wait_s": 0.17}])
    header = text.splitlines()[0].split("  ")
    assert "comm s" not in [h.strip() for h in header] and "wait s" in [h.strip() for h in header]
    assert "0.06" not in text.splitlines()[2] and "0.17" in text.splitlines()[2]
    assert "wait s: time the training thread was blocked on the exchange" in text
    assert "as OD-SGD and CD-SGD, on that exchange, codec work included" in text


@pytest.mark.slow
def test_the_command_leaves_without_finalisation_with_its_output_and_exit_code(tmp_path):
    """``gradzip`` (:func:`gradzip.cli.run`) skips the interpreter's finalisation (seconds
    with torch loaded; issue 36, item 9): no atexit hook runs, yet stdout, stderr and the
    exit code are the command's."""
    mark = tmp_path / "finalised"
    code = (f"import atexit, pathlib; atexit.register(lambda: pathlib.Path({str(mark)!r}).write_text('x')); "
            "from gradzip.cli import run; run()")
    for args, rc, stream, text in [(["--help"], 0, "stdout", "usage: gradzip"),
                                   (["train", "--epochs", "0"], 2, "stderr", "--epochs: expected an integer >= 1")]:
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600)
        assert done.returncode == rc and text in getattr(done, stream), done
    assert not mark.exists()


# -- issue 36, item 5: every method through the CLI with the default projection; the results
# are written before anything derived from them -------------------------------------------------
TINY = ["--workers", "2", "--backend", "threads", "--epochs", "1", "--batch-size", "16", "--quiet", "--no-plot",
        "--dataset", "synthetic:n=128,test=32,shape=16,classes=4"]


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(__import__("gradzip").optim.METHODS))
def test_every_algo_trains_and_is_projected_or_skipped_with_a_note(algo, tmp_path, capsys):
    assert main(["train", "--algo", algo, *TINY, "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    out = capsys.readouterr().out
    if summary.get("projection_skipped"):
        assert f"{algo}: not projected: " in out and "projections" not in summary
    else:
        assert len(summary["projections"]) == 3 and "proj. s/epoch 1 Gbit/s x2" in out


@pytest.mark.slow
def test_asgd_with_worker_processes_and_the_default_projection_writes_everything(tmp_path):
    """The reported crash: ``gradzip train --algo asgd`` on worker processes with the default
    --bandwidth trained, then died in the projection with only config.toml written."""
    done = run_cli("train", "--algo", "asgd", "--workers", "2", "--epochs", "1", "--quiet", "--no-plot",
                   "--out", str(tmp_path))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "asgd: not projected: ASGD exchanges point to point" in done.stdout
    assert {p.name for p in tmp_path.iterdir()} == {"config.toml", "metrics.jsonl", "summary.json"}
    assert "projection_skipped" in json.loads((tmp_path / "summary.json").read_text())


@pytest.mark.slow
def test_a_run_with_progress_bars_leaves_no_semaphore_behind(tmp_path):
    """Worker processes draw the progress bar (rank 0) and leave with ``os._exit``: tqdm's
    default lock is a multiprocessing semaphore that nothing then unlinks, and the resource
    tracker warned "1 leaked semaphore objects" at the end of every ``gradzip compare``. The
    bar takes a thread lock instead."""
    done = run_cli("train", "--algo", "ssgd", "--workers", "2", "--epochs", "1", "--no-plot",
                   "--bandwidth", "none", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "ssgd (2 workers)" in done.stderr   # the bar was drawn
    assert "leaked semaphore" not in done.stderr, done.stderr


def test_the_results_are_written_before_a_projection_that_fails(tmp_path, monkeypatch, capsys):
    from gradzip.bench import projection

    def broken(*args):
        raise RuntimeError("a bug in the projection")
    monkeypatch.setattr(projection, "project_runs", broken)
    with pytest.raises(RuntimeError, match="a bug in the projection"):
        main(["train", "--algo", "ssgd", *TINY, "--out", str(tmp_path / "a")])
    assert (tmp_path / "a" / "summary.json").is_file() and (tmp_path / "a" / "metrics.jsonl").is_file()

    def refused(*args):
        raise GradzipError("the summary lacks parameter_shapes")
    monkeypatch.setattr(projection, "project_runs", refused)
    capsys.readouterr()
    assert main(["train", "--algo", "ssgd", *TINY, "--out", str(tmp_path / "b")]) == 0
    captured = capsys.readouterr()
    assert "gradzip: note: no projection: the summary lacks parameter_shapes" in captured.err
    assert "test acc" in captured.out and (tmp_path / "b" / "summary.json").is_file()


# -- issue 12, items 15 and 16: one line each, outputs validated before training ----------
LONG = "x" * 300


@pytest.mark.parametrize("args, message", [
    (["train", "--seed", str(10 ** 26)], "--seed: expected an integer in [0, 2**32)"),
    (["train", "--seed", "-1"], "--seed: expected an integer in [0, 2**32)"),
    (["train", "--out", f"/tmp/{LONG}"], "--out /tmp/xxx"),
    (["train", "--checkpoint-dir", f"/tmp/{LONG}"], "checkpoint directory /tmp/xxx"),
    (["train", "--resume", f"/tmp/{LONG}"], "checkpoint directory /tmp/xxx"),
    (["train", "--trace", f"/tmp/{LONG}.json"], "--trace /tmp/xxx"),
    (["train", "--dataset", "mnist", "--data-dir", f"/tmp/{LONG}"], "/tmp/xxx"),
    (["train", "--trace", "/proc/version/t.json"], "--trace /proc/version/t.json: cannot write"),
])
def test_bad_paths_and_seeds_are_one_line_before_training(args, message, capsys):
    try:
        code = main(args)
    except SystemExit as exc:  # argparse
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err


def test_trace_on_a_directory_fails_before_training(tmp_path, capsys):
    assert main(["train", "--epochs", "50", "--quiet", "--trace", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--trace {tmp_path}: cannot write" in err, err


def test_a_trace_that_cannot_be_written_loses_neither_the_table_nor_out(tmp_path, monkeypatch, capsys):
    from gradzip import trace

    def full(path, events):
        raise OSError(28, "No space left on device", str(path))
    monkeypatch.setattr(trace, "write", full)
    code = main(["train", "--epochs", "1", "--quiet", "--no-plot", "--backend", "threads", "--workers", "2",
                 "--trace", str(tmp_path / "t.json"), "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code == 1 and "test acc" in captured.out and (tmp_path / "out" / "summary.json").is_file()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "No space left on device" in err and "t.json" in err, err


@pytest.mark.parametrize("make, message", [
    (lambda d: (d / "step-000000022").mkdir(parents=True) or d / "step-000000022",
     "is one step of a checkpoint directory; give its parent"),
    (lambda d: (d.mkdir(), (d / "model.pt").write_bytes(b"x"))[0] or d,
     "holds files that are not gradzip checkpoints (model.pt)"),
])
def test_resume_at_a_step_directory_or_a_foreign_directory_is_refused(tmp_path, make, message, capsys):
    target = make(tmp_path / "ck")
    assert main(["train", "--epochs", "1", "--quiet", "--resume", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("argv, expected", [
    (["train", "--algo", "ssgd"], [0.1]),
    (["train", "--algo", "onebitadam"], [1e-3]),
    (["train", "--algo", "adamw"], [1e-3]),
    (["train", "--algo", "lamb"], [0.01]),
    (["train", "--algo", "lars"], [3.0]),
    (["train", "--algo", "diloco"], [1e-3]),
    (["train", "--algo", "diloco", "--inner", "sgd"], [0.1]),
    (["train", "--algo", "onebitadam", "--lr", "0.05"], [0.05]),
    (["compare", "--algos", "ssgd,zerooneadam,onebitlamb"], [0.1, 1e-3, 1e-3]),
    (["compare", "--algos", "ssgd,zerooneadam", "--lr", "0.2"], [0.2, 0.2]),
])
def test_lr_defaults_to_the_methods_own(argv, expected):
    """Without --lr each method takes its own default (momentum SGD's 0.1 diverged 1-bit /
    0/1 Adam and AdamW on digits); a given --lr applies to every method."""
    assert [cfg.lr for cfg in _configs(build_parser().parse_args(argv))] == expected


def _disk_fills_while_writing(monkeypatch, names):
    """Writes to files whose name contains one of ``names`` fail half-way with ENOSPC, as
    on a full disk (the first half reaches the file)."""
    import builtins
    import errno
    import io

    real_open = io.open

    def open_(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if "w" in mode and any(n in Path(str(file)).name for n in names):
            write = f.write

            def half(data):
                write(data[:len(data) // 2])
                f.flush()
                raise OSError(errno.ENOSPC, "No space left on device", str(file))
            f.write = half
        return f
    monkeypatch.setattr(io, "open", open_)
    monkeypatch.setattr(builtins, "open", open_)


def _outputs(root, steps):
    """A run's outputs (summary.json, metrics.jsonl), a trace and a settings file in ``root``."""
    from gradzip import trace
    from gradzip.train import config_file
    from gradzip.cli import report

    report.write(root, [{"summary": {"algo": "ssgd", "steps": steps},
                         "history": [{"epoch": e, "train_loss": 1 / e} for e in range(1, steps + 1)]}], plot=False)
    trace.write(root / "t.json", [[{"name": "x", "ph": "X", "ts": 1.0, "dur": float(steps), "pid": 0, "tid": 0}]])
    config_file.write(root / "config.toml", {"command": "train", "epochs": steps})


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json", "t.json", "config.toml"])
def test_an_output_that_cannot_be_written_keeps_the_previous_file_whole(tmp_path, monkeypatch, name):
    _outputs(tmp_path, 2)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    _disk_fills_while_writing(monkeypatch, (name,))
    with pytest.raises((OSError, GradzipError), match=f"{name}.*No space left|No space left.*{name}") as info:
        _outputs(tmp_path, 5)
    if isinstance(info.value, OSError):
        assert info.value.filename == str(tmp_path / name)   # the file, not its temporary
    monkeypatch.undo()
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after[name] == before[name] and set(after) == set(before)   # whole, and no temporary left
