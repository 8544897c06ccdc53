"""PyTorch's DDP (plain, fp16 hook, powerSGD hook) as rows of ``gradzip bench net``
(gradzip.bench.peers; issue 15, item 4)."""
import math

import pytest
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from gradzip.bench import emulated, peers, tables, timeline
from gradzip.bench.shapes import model_shapes
from gradzip.cli import main
from gradzip.comm import allreduce_wire_bytes
from gradzip.errors import GradzipError
from gradzip.comm.launch import run_processes

MODEL, SHAPE = "mlp:hidden=16", "8"
ALGOS = [("ssgd", None), ("ddp", None), ("ddp", "fp16"), ("ddp", "powersgd:rank=1"),
         ("ddp", "powersgd:rank=2,buckets=each")]


def rows_worker(comm, algos, warmup, steps):
    bench = emulated.NetBench(workers=[comm.world_size], bandwidths=[None], latencies=[0.0], algos=algos,
                              model=MODEL, shape=SHAPE, batch_size=4, steps=steps, warmup=warmup)
    return {"rank": comm.rank, "check": [], "runs": [emulated.run_row(comm, cfg, warmup)
                                                     for cfg in bench.configs(comm.world_size)]}


def _powersgd_elements(shapes, rank):
    """Elements torch's powerSGD_hook allreduces per compressed step (uncompressed + P + Q)."""
    total = 0
    for shape in shapes:
        rows, cols = shape[0], math.prod(shape[1:])
        r = min(rows, cols, rank)
        compress, before, after = torch_powersgd._should_compress(rows, cols, r, 2.0)
        total += after if compress else before
    return total


def test_ddp_peers_are_rows_of_bench_net_over_real_gloo():
    """Two gloo processes on loopback: every peer trains, its bytes are its hook's ring
    bytes (fp32 buckets, fp16 buckets, PowerSGD's uncompressed + P + Q after its two
    vanilla steps), the phases come out of the trace like a gradzip row's, and the merged
    record renders in the time table next to ssgd; the model's validation skips the peers."""
    warmup, steps = 1, 2
    ranks = run_processes(2, rows_worker, ALGOS, warmup, steps)
    record = emulated.merge(ranks, 2, None, 0.0, 0)
    runs = {r["algo"]: r for r in record["runs"]}
    shapes = model_shapes(MODEL, (8,))
    p = sum(math.prod(s) for s in shapes)
    total = warmup + steps
    assert [r["algo"] for r in record["runs"]] == [
        "ssgd", "ddp", "ddp@fp16", "ddp@powersgd:rank=1,start=2,buckets=one",
        "ddp@powersgd:rank=2,start=2,buckets=each"]
    assert runs["ddp"]["bytes_per_step"] == allreduce_wire_bytes(4 * p, 2)
    assert runs["ddp"]["bytes_per_step"] == runs["ssgd"]["bytes_per_step"]
    assert runs["ddp@fp16"]["bytes_per_step"] == allreduce_wire_bytes(2 * p, 2)
    for r in (1, 2):
        label = next(a for a in runs if a.startswith(f"ddp@powersgd:rank={r}"))
        expected = (2 * allreduce_wire_bytes(4 * p, 2)
                    + (total - 2) * allreduce_wire_bytes(4 * _powersgd_elements(shapes, r), 2)) / total
        assert runs[label]["bytes_per_step"] == expected
        assert runs[label]["bytes_per_step"] < runs["ddp"]["bytes_per_step"]
    for algo, run in runs.items():
        assert run["steps_measured"] == steps and run["steps_total"] == total, algo
        assert run["peer"] == algo.startswith("ddp"), algo
        assert run["compute_s"] > 0 and run["communicate_s"] >= 0 and run["iteration_s"] >= run["compute_s"], algo
    assert "`ddp@fp16`" in tables.time_table([record])
    measured = {"settings": {"model": MODEL, "shape": SHAPE}, "records": [dict(record, bandwidth_bps=1e9)]}
    assert [row["algo"] for row in timeline.validate(measured, 1e-4)] == ["ssgd"]


@pytest.mark.parametrize("codec, message", [
    ("bogus", "takes the hooks fp16, powersgd"),
    ("powersgd:rank=0", "rank >= 1"),
    ("powersgd:start=1", "start >= 2"),
    ("powersgd:buckets=two", "buckets=one or buckets=each"),
    ("powersgd:ranks=2", "bad option 'ranks=2'"),
    ("fp16:rank=2", "takes no options"),
])
def test_bad_hooks_are_refused(codec, message):
    with pytest.raises(GradzipError, match=message.replace("(", r"\(")):
        peers.parse_hook(codec)


def test_hooks_parse_with_defaults():
    assert peers.parse_hook(None) == {"hook": "none"}
    assert peers.parse_hook("FP16") == {"hook": "fp16"}
    assert peers.parse_hook("powersgd:rank=4,buckets=each") == {"hook": "powersgd", "rank": 4, "start": 2,
                                                               "buckets": "each"}


def test_bench_net_refuses_a_bad_hook_in_one_line_before_running(capsys):
    assert main(["bench", "net", "--algos", "ssgd,ddp@powersgd:rank=x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rank >= 1" in err, err
