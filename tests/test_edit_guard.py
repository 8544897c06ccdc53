"""benchmarks/edit_guard.py: its table (bad settings: tests/test_passes.py)."""
from benchmarks import edit_guard


def test_it_prints_every_way_per_size(capsys):
    edit_guard.main(["--sizes", "1000", "5000", "--repeat", "2"])
    out = capsys.readouterr().out
    assert "| 1,000 |" in out and "| 5,000 |" in out and "digest (kernels.digest) ms" in out
    assert "torch fingerprint (2 passes) ms" in out and "copy + digest (copy_parts) ms" in out

