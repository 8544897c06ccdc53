"""The main job's projection (gradzip.bench.projection): a run's measured times and bytes fed
to the timeline model at other link rates and worker counts; its table columns and flags."""
import json

import pytest

from gradzip.bench.costs import allreduce_time
from gradzip.cli import main
from gradzip.bench import projection
from gradzip.cli import report

SHAPES = [[64, 32], [32], [10, 32], [10]]       # 2,698 parameters
PARAMS = 64 * 32 + 32 + 10 * 32 + 10


def _run(method, options, bytes_per_step, compute=0.010, compress=0.0, update=0.001, workers=4, epochs=3,
         steps_per_epoch=10, first_compress=None, accuracy=0.8):
    """A run's summary and history as the loop writes them (phase times are epoch totals; the
    first epoch is the warm-up, left out of ``steady_step_s``)."""
    history = [{"epoch": e, "step": e * steps_per_epoch, "time_compute_s": compute * steps_per_epoch,
                "time_compress_s": (first_compress if e == 1 and first_compress else compress) * steps_per_epoch,
                "time_update_s": update * steps_per_epoch, "test_accuracy": 0.5 + 0.1 * e,
                "bytes_sent_per_worker": bytes_per_step * steps_per_epoch * e} for e in range(1, epochs + 1)]
    steps = epochs * steps_per_epoch
    summary = {"algo": method, "method": method, "options": options, "workers": workers, "steps": steps,
               "epochs": epochs, "final_test_accuracy": accuracy,
               "batch_size_per_worker": 8, "training_samples": steps_per_epoch * workers * 8,
               "parameter_shapes": SHAPES, "bytes_sent_per_worker": bytes_per_step * steps,
               **{f"time_{k}_s": sum(h[f"time_{k}_s"] for h in history) for k in ("compute", "compress", "update")},
               "steady_step_s": {"compute": compute, "compress": compress, "update": update},
               "steady_steps": steps - steps_per_epoch, "warmup_steps": steps_per_epoch}
    return {"summary": summary, "history": history}


def _projected(runs, *args):
    """The runs' projections (``project_runs``), each run's rows."""
    return [added["projections"] for added in projection.project_runs(runs, *args)]


def test_ssgd_projection_is_the_timeline_of_its_measured_times_and_the_ring_allreduce():
    wire = 2 * 3 / 4 * PARAMS * 4                       # what S-SGD sends per step at 4 workers
    run = _run("ssgd", {}, wire, compute=0.010, update=0.001)
    (rows,) = _projected([run], [1e8, 1e9], [4, 16])
    assert [(r["workers"], r["bandwidth_bps"]) for r in rows] == [(4, 1e8), (4, 1e9), (16, 1e8), (16, 1e9)]
    for r in rows:
        comm = allreduce_time(PARAMS * 4, r["workers"], r["bandwidth_bps"] / 8, projection.ALPHA_S)
        assert r["communicate_s"] == pytest.approx(comm, rel=1e-6)
        assert r["iteration_s"] == pytest.approx(0.010 + comm + 0.001, rel=1e-6)
        assert r["steps_per_epoch"] == 10 * 4 // r["workers"]          # same per-worker batch, more workers
        assert r["epoch_s"] == pytest.approx(r["steps_per_epoch"] * r["iteration_s"])
        assert r["speedup"] == pytest.approx(1.0)


def test_the_first_epochs_codec_warm_up_is_left_out():
    run = _run("ssgd", {}, 2 * 3 / 4 * PARAMS * 4, compress=0.002, first_compress=1.0)
    (rows,) = _projected([run], [1e9])
    assert rows[0]["compress_s"] == pytest.approx(0.002)


def test_a_short_runs_steady_times_leave_its_warm_up_out(monkeypatch):
    """A one-epoch run whose first step carries a one-time cost (here: a 1 s sleep in the
    first training forward pass of each worker; the set-up's model/dataset check is an eval
    mode forward before the steps): the loop's ``steady_step_s`` is measured over the
    second half of the epoch and leaves it out; the projection rests on it and says so."""
    import time

    from gradzip.comm import simulate
    from gradzip.train import models
    from gradzip.train.config import RunConfig
    from gradzip.train.loop import run_worker

    build = models.build

    def slow_first_forward(*args, **kwargs):
        model, first = build(*args, **kwargs), []

        def hook(module, inputs):
            if module.training and not first:
                first.append(time.sleep(1.0))
        model.register_forward_pre_hook(hook)
        return model
    monkeypatch.setattr(models, "build", slow_first_forward)
    cfg = RunConfig(algo="ssgd", options={}, label="ssgd", lr=0.1, epochs=1, progress=False)
    runs = simulate(2, lambda comm: [run_worker(comm, cfg)])[0]
    s = runs[0]["summary"]
    assert (s["steps"], s["warmup_steps"], s["steady_steps"]) == (22, 11, 11)   # 1437 samples, 2 x 32 per step
    assert s["time_compute_s"] >= 1.0 > s["steady_step_s"]["compute"] * s["steady_steps"]
    (rows,) = _projected(runs, [1e9])
    assert rows[0]["compute_s"] == s["steady_step_s"]["compute"] and rows[0]["measured_steps"] == 11


def test_fewer_bytes_win_on_a_slow_link_and_lose_to_codec_time_on_a_fast_one():
    """The speed-up is over the S-SGD run; a codec sending 1/32 of the bytes with 2 ms of
    codec work per step is faster at 10 Mbit/s and slower at 10 Gbit/s."""
    base = _run("ssgd", {}, 2 * 3 / 4 * PARAMS * 4)
    sign = _run("efsgd", {"compressor": "1bit"}, 2 * 3 / 4 * PARAMS * 4 / 32, compress=0.002)
    _, rows = _projected([base, sign], [1e7, 1e10])
    slow, fast = rows
    assert slow["speedup"] > 1 > fast["speedup"]
    # the communication is scaled to the bytes the run measured
    assert slow["communicate_s"] < allreduce_time(PARAMS * 4, 4, 1e7 / 8) / 10


def test_without_an_ssgd_run_the_basis_is_ssgd_modelled_from_the_run():
    (rows,) = _projected([_run("efsgd", {"compressor": "topk:ratio=0.1"}, 1000.0)], [1e8])
    assert rows[0]["speedup_over"].startswith("S-SGD modelled") and rows[0]["speedup"] > 0


def test_the_table_labels_projections_as_projections():
    runs = [_run("ssgd", {}, 2 * 3 / 4 * PARAMS * 4)]
    for run, rows in zip(runs, _projected(runs, [1e9], [4, 8])):
        run["summary"]["projections"] = rows
    text = report.table([r["summary"] for r in runs])
    header = text.splitlines()[0]
    assert "proj. s/epoch 1 Gbit/s x4" in header and "proj. s/epoch 1 Gbit/s x8" in header
    assert "PROJECTED, not measured" in text
    assert "(1.00x)" in text.splitlines()[2]


def _table(runs, *args):
    for run, added in zip(runs, projection.project_runs(runs, *args)):
        run["summary"].update(added)
    return report.table([r["summary"] for r in runs])


def test_the_projection_says_on_how_many_steps_it_rests_and_warns_of_a_short_run():
    long_run = _table([_run("ssgd", {}, 2 * 3 / 4 * PARAMS * 4, epochs=7, steps_per_epoch=10)], [1e9])
    assert "rests on 60 measured steps per run, after each worker's first 10" in long_run
    assert "CAVEAT" not in long_run
    short = _table([_run("ssgd", {}, 2 * 3 / 4 * PARAMS * 4, epochs=2, steps_per_epoch=10)], [1e9])
    assert "rests on 10 measured steps" in short and "CAVEAT: a run this short cannot measure steady state" in short


def test_one_line_per_link_rate_names_the_fastest_method_with_its_accuracy_cost():
    """From the same projection as the columns: fewer bytes win at 10 Mbit/s, S-SGD at
    10 Gbit/s; the accuracy cost is against the S-SGD run; a run that diverged is never named."""
    base = _run("ssgd", {}, 2 * 3 / 4 * PARAMS * 4, accuracy=0.9)
    sign = _run("efsgd", {"compressor": "1bit"}, 2 * 3 / 4 * PARAMS * 4 / 32, compress=0.002, accuracy=0.88)
    sign["summary"]["algo"] = "efsgd@1bit"
    broken = _run("bitsgd", {}, 2 * 3 / 4 * PARAMS * 4 / 64, accuracy=0.1)
    broken["summary"]["diverged"] = True
    lines = [line for line in _table([base, sign, broken], [1e7, 1e10]).splitlines() if line.startswith("fastest")]
    slow_epoch = sign["summary"]["projections"][0]["epoch_s"]
    assert lines == [
        f"fastest at 10 Mbit/s x4: efsgd@1bit, {3 * slow_epoch:.3g} s projected for its 3 epochs, "
        f"{sign['summary']['projections'][0]['speedup']:.2f}x S-SGD; test acc 0.8800, -0.0200 against ssgd's 0.9000 "
        "(caveat: too short a run to measure steady state)",
        f"fastest at 10 Gbit/s x4: ssgd, {3 * base['summary']['projections'][1]['epoch_s']:.3g} s projected for its "
        "3 epochs, 1.00x S-SGD; test acc 0.9000, +0.0000 against ssgd's 0.9000 "
        "(caveat: too short a run to measure steady state)"]


def test_an_auto_run_says_per_link_rate_which_buckets_it_compresses():
    """auto:<codec> is profiled with each projected rate as its declared link (docs/algorithms.md
    §Auto codec choice): at 1 Mbit/s its two units (the 64x32 weight alone at 4 KiB buckets, the
    small tensors together) take 1bit, whose fp32 allreduce would cost milliseconds; at 1 Tbit/s
    neither (the codec's own time outweighs the microseconds it saves). Each projected cell says
    how many units auto compresses there, and the legend says what that is. The codec seconds
    are that decision's (the profile's) where the summary does not say on which link the run
    decided (``auto_link``, written since; see the next test)."""
    base = _run("ssgd", {}, 2 * 3 / 4 * PARAMS * 4)
    auto = _run("efsgd", {"compressor": "auto:1bit", "bucket_bytes": 4096}, 1000.0, compress=0.05)
    auto["summary"]["algo"] = "efsgd@auto:1bit"
    text = _table([base, auto], [1e6, 1e12])
    slow, fast = auto["summary"]["projections"]
    assert slow["auto"] == ["1bit", "1bit"] and fast["auto"] == ["none", "none"]
    assert "auto" not in base["summary"]["projections"][0]
    row = next(line for line in text.splitlines() if line.startswith("efsgd@auto:1bit"))
    assert "auto 2/2" in row and "auto 0/2" in row
    assert "auto k/m: the units auto:<codec> compresses on that link, of m" in text
    assert slow["speedup"] > 1 > fast["speedup"]
    assert fast["compress_s"] < 0.01 and slow["compress_s"] < 0.01


def test_auto_and_its_fixed_codec_are_projected_from_the_same_measured_codec_speed():
    """An auto:1bit run that executed 1bit on both units (its summary's ``auto_link``: 1 Mbit/s)
    and measured 50 ms of codec work a step: projected at that rate, where auto decides as
    it ran, its codec seconds are the run's 50 ms, as EF-SGD 1bit's own run's are (not the
    profile's uncontended time, which made auto look faster than the same codec); at a rate
    where auto sends nothing compressed, the run's 50 ms scaled by the profile's ratio."""
    alpha = projection.ALPHA_S
    auto = _run("efsgd", {"compressor": "auto:1bit", "bucket_bytes": 4096}, 1000.0, compress=0.05)
    auto["summary"]["auto_link"] = {"exchange 0": [1e6 / 8, alpha]}
    fixed = _run("efsgd", {"compressor": "1bit", "bucket_bytes": 4096}, 1000.0, compress=0.05)
    (slow, fast), (fixed_slow, _) = _projected([auto, fixed], [1e6, 1e12])
    assert slow["auto"] == ["1bit", "1bit"] and fast["auto"] == ["none", "none"]
    assert slow["compress_s"] == pytest.approx(0.05) and fixed_slow["compress_s"] == pytest.approx(0.05)
    assert 0 < fast["compress_s"] < 0.05
    # a run whose trial sent nothing compressed (its executed choices, whatever the rule on its
    # link said): its 50 ms are none's coding, so where auto compresses it is projected above them
    auto["summary"]["auto_choices"] = ["none", "none"]
    (slow_none, fast_none), = _projected([auto], [1e6, 1e12])
    assert fast_none["compress_s"] == pytest.approx(0.05) and slow_none["compress_s"] > 0.05


def test_a_method_the_profile_cannot_run_is_left_out_with_a_note():
    base, asgd = _run("ssgd", {}, 2 * 3 / 4 * PARAMS * 4), _run("asgd", {}, 2 * 3 / 4 * PARAMS * 4)
    text = _table([base, asgd], [1e9])
    assert "projections" not in asgd["summary"] and "point to point" in asgd["summary"]["projection_skipped"]
    assert text.splitlines()[3].split()[-1] == "-"                    # its projected cell
    assert "asgd: not projected: ASGD exchanges point to point" in text
    assert not any(line.startswith("fastest") and "asgd" in line for line in text.splitlines())


def test_compare_projects_writes_and_plots(tmp_path, capsys):
    code = main(["compare", "--algos", "ssgd,efsgd@topk:ratio=0.1", "--workers", "2", "--backend", "threads",
                 "--epochs", "2", "--quiet", "--bandwidth", "10mbit,10gbit", "--workers-at", "2,8",
                 "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "proj. s/epoch 10 Mbit/s x8" in out and "PROJECTED" in out
    summaries = json.loads((tmp_path / "summary.json").read_text())
    assert [len(s["projections"]) for s in summaries] == [4, 4]
    assert summaries[1]["projections"][0]["speedup"] > 1            # top-10% at 10 Mbit/s
    assert (tmp_path / "accuracy.png").stat().st_size > 1000


@pytest.mark.parametrize("args, message", [
    (["--bandwidth", "fast"], "bad bandwidth 'fast'"),
    (["--bandwidth", "unshaped"], "needs finite rates"),
    (["--workers-at", "0"], "--workers-at must be comma-separated integers >= 1"),
    (["--bandwidth", "none", "--workers-at", "8"], "--workers-at needs link rates"),
])
def test_bad_projection_flags_are_one_line_before_training(args, message, capsys):
    assert main(["train", "--epochs", "50", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_bandwidth_none_leaves_the_table_as_it_was(tmp_path, capsys):
    assert main(["train", "--workers", "2", "--backend", "threads", "--epochs", "1", "--quiet", "--no-plot",
                 "--bandwidth", "none", "--out", str(tmp_path)]) == 0
    assert "proj." not in capsys.readouterr().out
    assert "projections" not in json.loads((tmp_path / "summary.json").read_text())


def test_a_one_worker_run_is_projected_only_to_the_worker_counts_asked_for(tmp_path, capsys):
    args = ["train", "--epochs", "1", "--backend", "threads", "--quiet", "--no-plot", "--bandwidth", "1gbit"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert "proj." not in capsys.readouterr().out
    assert main([*args, "--workers-at", "8", "--out", str(tmp_path / "b")]) == 0
    assert "proj. s/epoch 1 Gbit/s x8" in capsys.readouterr().out


def test_the_emulated_workers_run_this_command_without_workers_projection_or_emulation(tmp_path):
    from gradzip import cli

    argv = ["compare", "--algos", "ssgd,bitsgd", "--workers", "4", "--epochs", "3", "--emulate",
            "--bandwidth", "1gbit", "--out", "o"]
    args = cli.parse_args(argv)
    table = cli.emulation_settings(cli.build_parser(), args, tmp_path / "e")
    assert {"workers", "backend", "emulate", "workers-at"}.isdisjoint(table)
    assert (table["bandwidth"], table["out"], table["algos"], table["epochs"]) == \
        ("none", str(tmp_path / "e"), "ssgd,bitsgd", 3)


@pytest.mark.parametrize("args, message", [
    (["--emulate"], "--emulate writes each rate's results into --out DIR"),
    (["--emulate", "--bandwidth", "none", "--out", "x"], "--emulate runs at the --bandwidth rates"),
    (["--emulate", "--workers-at", "8", "--out", "x"], "--emulate runs at --workers, not --workers-at"),
])
def test_emulate_needs_out_rates_and_no_workers_at(tmp_path, monkeypatch, args, message, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
