"""benchmarks/auto_codec.py (issue 33): the trial column reads what auto's describe() lines say."""
from __future__ import annotations

import pytest

from benchmarks import auto_codec
from gradzip.exchange import Link, calibration


def _decided(times_ms: tuple[float, float], kept: bool, retried: bool) -> str:
    proposed = ("1bit", "none")
    decision = calibration.Decision(proposed if kept else ("none", "none"), Link(1e7, 0.0), {}, 3, True, proposed,
                                    (), (times_ms[0] / 1e3, times_ms[1] / 1e3), (3, 4, 5, 6, 7, 8),
                                    calibration.RETRIED_EXCHANGES if retried else calibration.TRIAL_EXCHANGES)
    return decision.describe()


def test_the_trial_column_reads_each_verdict_retried_or_not():
    lines = {"a": _decided((120.0, 100.0), False, False), "b": _decided((90.5, 101.0), True, True),
             "c": _decided((90.5, 101.0), True, True)}
    assert auto_codec.trial_text(lines) == "none (120.0 vs 100.0 ms), kept (90.5 vs 101.0 ms, retried)"
    assert auto_codec.trial_text({}) == "-" and auto_codec.trial_text(None) == "-"


def test_a_row_pairs_auto_with_ddp_round_by_round():
    """auto / ddp of the medians, and the range of the ratios of the two in each round (the
    noise one pairing shows); the loopback target judged on the medians' ratio."""
    def row(variant, rounds, **more):
        return {"variant": variant, "median_s": sorted(rounds)[1], "rounds_s": rounds, **more}

    rows = [row("ddp", [0.10, 0.12, 0.09]), row("ddp-allreduce-hook", [0.1, 0.1, 0.1]), row("ssgd", [0.11] * 3)]
    for path in auto_codec.PATHS:
        for c in auto_codec.CODECS:
            rows += [row(f"{path}@{c}", [0.2, 0.2, 0.2]),
                     row(f"{path}@auto:{c}", [0.105, 0.108, 0.099], auto=["none"] * 4, auto_decisions={})]
    result = {"model": "mlp10m", "workers": 2, "network": "loopback", "bandwidth_bps": None, "rows": rows}
    verdict = auto_codec.verdicts(result)[0]
    assert verdict["by_round"] == pytest.approx((0.9, 1.1)) and verdict["auto_over_ddp"] == pytest.approx(1.05)
    line = auto_codec.table([result]).splitlines()[2]
    assert "| **1.05** | 0.90–1.10 | 1.00 | 1.10 |" in line and line.endswith("| met |")
    assert auto_codec.variants()[:3] == ["ddp", "ddp-allreduce-hook", "ssgd"]
    assert "ssgd" not in auto_codec.variants(1e9)
