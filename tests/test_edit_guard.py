"""benchmarks/edit_guard.py: its table, and bad settings refused in one line."""
import pytest

from benchmarks import edit_guard


def test_it_prints_every_way_per_size(capsys):
    edit_guard.main(["--sizes", "1000", "5000", "--repeat", "2"])
    out = capsys.readouterr().out
    assert "| 1,000 |" in out and "| 5,000 |" in out and "digest (kernels.digest) ms" in out
    assert "torch fingerprint (2 passes) ms" in out and "copy + digest (copy_parts) ms" in out


@pytest.mark.parametrize("argv", [["--repeat", "0"], ["--sizes", "1000", "0"]])
def test_bad_settings_are_refused_in_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        edit_guard.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and "must be >= 1" in err[-1]
