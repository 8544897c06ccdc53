"""CD-SGD's overlap ratio per step (gradzip bench net's overlap_bound_s, benchmarks/cdsgd_speed):
a periodic exchange that outlasts its step's compute is counted in the step it delays."""
import pytest

from benchmarks import cdsgd_speed
from gradzip.bench import emulated


def _row(compute, exchange, iteration):
    return {"iteration": iteration, "compute": compute, "compress": 0.0, "communicate": max(0.0, iteration - compute),
            "update": 0.0, "loop": 0.0, "hidden_compress": 0.25 * exchange, "hidden_communicate": 0.75 * exchange,
            "hidden_other": 0.0}


def _ranks():
    # k = 5: four 2-bit exchanges of 0.1 s beside 0.2 s of compute, one full-precision 0.4 s
    steps = [_row(0.2, 0.1, 0.2)] * 4 + [_row(0.2, 0.4, 0.4)]
    summary = {"algo": "cdsgd", "method": "cdsgd", "options": {}, "model": "m", "parameters": 1, "steps": 5,
               "bytes_sent_per_worker": 5.0}
    return [{"runs": [{"steps": steps, "summary": summary}]} for _ in range(2)]


def test_the_bound_is_the_mean_of_the_per_step_max():
    (run,) = emulated.merge(_ranks(), 2, 3e8, 0.0, 0)["runs"]
    assert run["iteration_s"] == pytest.approx(0.24)
    assert run["overlap_bound_s"] == pytest.approx((4 * 0.2 + 0.4) / 5)       # 0.24: overlap is perfect
    means = max(run["compute_s"], run["hidden_compress_s"] + run["hidden_communicate_s"])
    assert run["iteration_s"] / means == pytest.approx(1.2)                      # what the old column says


def test_the_table_shows_both_ratios():
    record = emulated.merge(_ranks(), 2, 3e8, 0.0, 0)
    (line,) = [x for x in cdsgd_speed.tables({"records": [record]}).splitlines() if "CD-SGD" in x]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[8:10] == ["1.20", "1.00"]
