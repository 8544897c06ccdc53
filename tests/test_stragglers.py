"""Stragglers (gradzip.train.stragglers; docs/stragglers.md): the E[max] formulas,
the seeded delays against them, the training loop's injection and record, the timeline
model's projection, and the errors of a bad --straggler."""
from __future__ import annotations

import math
import statistics

import pytest

import gradzip
from gradzip import cli
from gradzip.train import stragglers
from gradzip.bench import profiling, tables, timeline
from gradzip.bench.cli import net_bench
from gradzip.errors import GradzipError
from gradzip.train.config import RunConfig
from gradzip.train.loop import run_worker


def test_expected_max_of_standard_normals_has_the_spec_values():
    assert stragglers.expected_max_normal(1) == 0.0
    assert stragglers.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-6)
    for K, e in ((4, 1.0294), (8, 1.4236), (16, 1.7660)):
        assert stragglers.expected_max_normal(K) == pytest.approx(e, abs=1e-4)
    assert stragglers.harmonic(1) == 1.0 and stragglers.harmonic(4) == pytest.approx(25 / 12)
    assert stragglers.harmonic(256) == pytest.approx(math.log(256) + stragglers.EULER_GAMMA, abs=2e-3)


def test_clipped_normal_expectation():
    # far from 0 the clipping does nothing: the formula mean + std·e_K
    assert stragglers.expected_max_clipped_normal(8, 10.0, 1.0) == pytest.approx(10 + stragglers.expected_max_normal(8))
    # mean 0, K = 1: E[max(0, X)] = std / sqrt(2π)
    assert stragglers.expected_max_clipped_normal(1, 0.0, 2.0) == pytest.approx(2 / math.sqrt(2 * math.pi), rel=1e-6)
    below = stragglers.parse("normal:mean=0.01,std=0.01")   # mean < 3 std: the clipped law, numerically
    assert below.expected_wait(4) > 0.01 + 0.01 * stragglers.expected_max_normal(4)


@pytest.mark.parametrize("spec", ["exp:mean=0.02", "normal:mean=0.05,std=0.01", "normal:mean=0.01,std=0.01"])
@pytest.mark.parametrize("K", [2, 4, 8])
def test_emulated_mean_synchronous_wait_matches_the_formula_within_10_percent(spec, K):
    """The delays the loop injects (seeded by seed, rank, step), K workers over 2000
    steps: the mean of the slowest worker's delay is E[max of K]."""
    s = stragglers.parse(spec)
    waits = [max(s.delay(7, rank, step) for rank in range(K)) for step in range(1, 2001)]
    assert statistics.mean(waits) == pytest.approx(s.expected_wait(K), rel=0.10)


def test_delays_are_seeded_by_seed_rank_and_step():
    s = stragglers.parse("exp:mean=1")
    assert s.delay(0, 1, 5) == s.delay(0, 1, 5)
    assert len({s.delay(0, r, t) for r in range(3) for t in range(1, 4)} | {s.delay(1, 0, 1)}) == 10
    slow = stragglers.parse("slow:rank=1,factor=3")
    assert slow.delay(0, 1, 9, compute_s=0.5) == 1.0 and slow.delay(0, 0, 9, compute_s=0.5) == 0.0
    assert slow.expected_wait(4, compute_s=0.5) == 1.0 and slow.expected_wait(1, compute_s=0.5) == 0.0


@pytest.mark.parametrize("spec, names", [
    ("gamma:mean=1", "unknown --straggler kind"), ("exp", "needs mean="), ("exp:mean=-1", "mean must be"),
    ("exp:mean=x", "must be a number"), ("normal:mean=1", "needs std="), ("exp:std=1", "takes mean="),
    ("slow:rank=1,factor=0.5", "factor must be >= 1"), ("slow:rank=1.5,factor=2", "rank must be an integer"),
    ("exp:mean=inf", "finite"),
])
def test_bad_specs_are_one_line_errors(spec, names):
    with pytest.raises(GradzipError, match=names) as exc:
        stragglers.parse(spec)
    assert "\n" not in str(exc.value)
    assert stragglers.parse("none") is None and stragglers.parse(None) is None


def test_the_loop_sleeps_the_seeded_delays_records_them_and_counts_them_as_compute():
    cfg = RunConfig(algo="ssgd", epochs=1, batch_size=128, progress=False, seed=3, straggler="exp:mean=0.004")
    out = gradzip.simulate(2, lambda comm: run_worker(comm, cfg))
    summary = out[0]["summary"]
    s = stragglers.parse(cfg.straggler)
    steps = summary["steps"]
    expected = [math.fsum(s.delay(3, rank, t) for t in range(1, steps + 1)) for rank in range(2)]
    assert summary["straggler"] == "exp:mean=0.004"
    assert summary["straggler_delay_s"] == pytest.approx(expected, rel=1e-12)
    for rank in range(2):   # slept inside the compute phase
        assert summary["time_per_worker_s"]["compute"][rank] >= expected[rank]


def test_the_projection_adds_the_expected_wait_and_shows_it():
    shapes = [(32, 16), (16,)]
    s = stragglers.parse("normal:mean=0.02,std=0.005")
    plain = timeline.project([("ssgd", None)], [2, 8], [1e10], 0.1, 1e-5, shapes=shapes, steps=1)
    slow = timeline.project([("ssgd", None)], [2, 8], [1e10], 0.1, 1e-5, shapes=shapes, steps=1, straggler=s)
    for a, b in zip(plain, slow):
        wait = 0.02 + 0.005 * stragglers.expected_max_normal(a["workers"])
        assert b["straggler_wait_s"] == pytest.approx(wait)
        assert b["iteration_s"] - b["compress_s"] - b["communicate_s"] - b["update_s"] == pytest.approx(0.1 + wait)
    assert "E[max δ] ms" in tables.projection_table(slow) and "E[max δ]" not in tables.projection_table(plain)
    prof = profiling.profile_method("ssgd", {}, shapes, 4, steps=1)
    assert timeline.predict(prof, 0.1, 1e9, 0.0, straggler_wait=0.05)["iteration"] == pytest.approx(
        timeline.predict(prof, 0.1, 1e9, 0.0)["iteration"] + 0.05)


@pytest.mark.parametrize("args, message", [
    (["--straggler", "gamma:mean=1"], "unknown --straggler kind"),
    (["--straggler", "slow:rank=2,factor=2", "--workers", "2"], "rank 2 is not a worker"),
])
def test_cli_refuses_a_bad_straggler_in_one_line(args, message, capsys):
    assert cli.main(["train", "--backend", "threads", "--epochs", "1", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_bench_net_passes_the_straggler_to_every_run_and_bench_model_checks_it(capsys):
    args = cli.build_parser().parse_args(["bench", "net", "--workers", "2", "--straggler", "exp:mean=0.01"])
    bench = net_bench(args)
    assert [c["straggler"] for c in bench.configs(2)] == ["exp:mean=0.01"] * len(bench.algos)
    assert cli.main(["bench", "model", "--straggler", "exp:mean", "--no-projection", "--out", "/nonexistent/x"]) == 2
    assert "mean needs a value" in capsys.readouterr().err
