"""benchmarks/step_vs_ddp.py (issue 14, item 3): the flags, the summary arithmetic, and a
tiny real run on 2 gloo processes returning one row per variant."""
from __future__ import annotations

import pytest

from benchmarks import step_vs_ddp
from gradzip.bench import netns
from gradzip.comm import allreduce_wire_bytes
from gradzip.errors import GradzipError
from gradzip.comm.launch import run_processes


def test_help_names_the_settings(capsys):
    with pytest.raises(SystemExit) as exc:
        step_vs_ddp.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--network" in out and "--write" in out and "ddp-fp16" in out


@pytest.mark.parametrize("argv, needle", [
    (["--variants", "ddp,adam"], "unknown variant(s) adam"),
    (["--variants", "ddp,ddp-unguarded@"], "unknown variant(s) ddp-unguarded@"),   # no codec given
    (["--workers", "1"], "--workers must be >= 2"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--network", "unshaped", "--variants", "ddp"], "'unshaped' is 'loopback' here"),
])
def test_bad_flags_are_one_line_errors(argv, needle, capsys):
    assert step_vs_ddp.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_summary_takes_the_slowest_worker_per_round_then_the_median():
    ranks = [{"parameters": 1000, "copy_s": 1e-3,
              "rounds": {"ddp": [1.0, 3.0, 2.0], "ssgd": [2.0, 2.0, 9.0]},
              "means": {"ddp": [1.0, 3.0, 2.0], "ssgd": [2.0, 2.0, 9.0]},
              "bytes_per_step": {"ddp": 0, "ssgd": 4000.0}},
             {"parameters": 1000, "copy_s": 3e-3,
              "rounds": {"ddp": [2.0, 1.0, 2.5], "ssgd": [3.0, 1.0, 1.0]},
              "means": {"ddp": [2.0, 1.0, 2.5], "ssgd": [3.0, 1.0, 5.0]},
              "bytes_per_step": {"ddp": 0, "ssgd": 4000.0}}]
    result = step_vs_ddp.summarize(ranks, 2, 1e9)
    ddp, ssgd = result["rows"]
    assert ddp["rounds_s"] == [2.0, 3.0, 2.5] and ddp["median_s"] == 2.5
    assert ssgd["rounds_s"] == [3.0, 2.0, 9.0] and ssgd["median_s"] == 3.0
    assert (ssgd["min_s"], ssgd["max_s"]) == (2.0, 9.0)
    assert ddp["ratio"] == 1.0 and ssgd["ratio"] == pytest.approx(3.0 / 2.5)
    assert ddp["bytes_per_step"] == allreduce_wire_bytes(4000, 2) and ssgd["bytes_per_step"] == 4000.0
    assert result["copy_s"] == pytest.approx(2e-3)
    assert result["link_s"] == pytest.approx(allreduce_wire_bytes(4000, 2) * 8 / 1e9)
    assert "| ssgd | 3000.0 | 2000.0 | 9000.0 | **1.20** |" in step_vs_ddp.table(result)


@pytest.mark.slow
def test_a_tiny_loopback_run_returns_a_row_per_variant():
    """Every named variant, and METHOD@CODEC ones: gradzip's DDP hook (``ddp@``) and auto:<codec>,
    whose rows say what auto chose per unit."""
    variants = list(step_vs_ddp.VARIANTS) + ["ddp@1bit", "ddp@auto:1bit", "efsgd@auto:1bit", "ddp-unguarded@none"]
    spec = {"model": "mlp10m:params=20000", "batch": 4, "threads": 1, "warmup": 1, "rounds": 1,
            "steps": 2, "variants": variants, "timeout_s": 120.0}
    ranks = run_processes(2, step_vs_ddp.measure, spec, timeout_s=120.0)
    result = step_vs_ddp.summarize(ranks, 2, None)
    assert [r["variant"] for r in result["rows"]] == variants
    assert all(r["median_s"] > 0 and r["mean_s"] > 0 for r in result["rows"])
    assert result["rows"][0]["ratio"] == 1.0 and result["link_s"] is None
    sent = {r["variant"]: r["bytes_per_step"] for r in result["rows"]}
    assert sent["ssgd"] == sent["ddp"] == sent["ddp-unguarded@none"] == allreduce_wire_bytes(4 * result["parameters"], 2)
    assert 0 < sent["efsgd-topk1%"] < sent["ssgd"] / 10
    assert 0 < sent["bitsgd"] < sent["ssgd"]
    assert 0 < sent["ddp@1bit"] < sent["ssgd"] / 10
    rows = {r["variant"]: r for r in result["rows"]}
    assert all(set(rows[v]["auto"]) <= {"1bit", "none"} and rows[v]["auto"] for v in ("ddp@auto:1bit", "efsgd@auto:1bit"))


def _can_emulate() -> bool:
    try:
        netns.check_available()
    except GradzipError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _can_emulate(), reason="network namespaces and tc need root (and the ip / tc programs)")
def test_a_tiny_shaped_run_returns_rows_and_leaves_no_namespace():
    spec = {"model": "mlp10m:params=20000", "batch": 4, "threads": 1, "warmup": 1, "rounds": 1,
            "steps": 1, "variants": ["ddp", "ssgd"], "timeout_s": 120.0}
    before = {n for n in netns.list_namespaces() if n.startswith(netns.PREFIX)}
    result = step_vs_ddp.summarize(step_vs_ddp.run_shaped(2, 1e9, spec), 2, 1e9)
    assert [r["variant"] for r in result["rows"]] == ["ddp", "ssgd"]
    assert result["link_s"] == pytest.approx(allreduce_wire_bytes(4 * result["parameters"], 2) * 8 / 1e9)
    assert {n for n in netns.list_namespaces() if n.startswith(netns.PREFIX)} <= before
