"""benchmarks/uncompressed_mean.py: its table (bad settings: tests/test_passes.py)."""
from benchmarks import uncompressed_mean


def test_it_prints_every_way_per_size(capsys):
    uncompressed_mean.main(["--sizes", "1000", "3000", "--repeat", "2"])
    out = capsys.readouterr().out
    assert "| 1,000 |" in out and "| 3,000 |" in out and "fused (kernels.sums) ms" in out
    assert "div_ alone (unchecked) ms" in out and "copy into a reused buffer ms" in out

