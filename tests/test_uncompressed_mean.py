"""benchmarks/uncompressed_mean.py: its table, and bad settings refused in one line."""
import pytest

from benchmarks import uncompressed_mean


def test_it_prints_every_way_per_size(capsys):
    uncompressed_mean.main(["--sizes", "1000", "3000", "--repeat", "2"])
    out = capsys.readouterr().out
    assert "| 1,000 |" in out and "| 3,000 |" in out and "fused (kernels.sums) ms" in out
    assert "div_ alone (unchecked) ms" in out and "copy into a reused buffer ms" in out


@pytest.mark.parametrize("argv", [["--repeat", "0"], ["--sizes", "1000", "0"]])
def test_bad_settings_are_refused_in_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        uncompressed_mean.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and "must be >= 1" in err[-1]
