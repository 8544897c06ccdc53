"""benchmarks/passes.py: the micro-benchmarks' settings (refused in one line below 1), and
every script that uses it refuses the same way."""
import pytest

from benchmarks import edit_guard, passes, uncompressed_mean


@pytest.mark.parametrize("main", [edit_guard.main, uncompressed_mean.main], ids=["edit_guard", "uncompressed_mean"])
@pytest.mark.parametrize("argv", [["--repeat", "0"], ["--sizes", "1000", "0"]])
def test_bad_settings_are_refused_in_one_line(main, argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and "must be >= 1" in err[-1]


def test_medians_interleave_the_ways_and_run_before_each_timing():
    calls = []
    out = passes.medians({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3,
                         before=lambda: calls.append("-"))
    assert set(out) == {"a", "b"} and all(v >= 0 for v in out.values())
    assert calls == ["-", "a", "-", "b"] * 4   # one untimed call each, then 3 rounds
