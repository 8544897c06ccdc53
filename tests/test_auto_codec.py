"""benchmarks/auto_codec.py (issue 33): the trial column reads what auto's describe() lines say."""
from __future__ import annotations

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
