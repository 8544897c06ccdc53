"""PSync reuses its packets and bucket buffers across steps (gradzip.exchange, "Memory
across steps") without changing a bit of what it returns, and without touching what an
earlier step returned or what an exchange still in flight holds."""
from __future__ import annotations

import pytest
import torch

import gradzip
from gradzip.exchange import PSync

SPECS = ["2bit", "sign", "scaled_sign", "fp16", "bf16", "none", "topk:ratio=0.1", "qsgd"]
#: small tensors share buckets, the large one is a bucket of its own (bucket_bytes below)
SHAPES = [(3, 5), (7,), (1,), (2, 2, 3), (3000,), (11,)]
STEPS = 3


def grads(rank: int, step: int, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [(torch.randn(s, generator=gen) * 0.02).to(dtype) for s in SHAPES]


def snapshot(result) -> tuple:
    return ([a.clone() for a in result.aggregate],
            None if result.residual is None else [r.clone() for r in result.residual])


def run(spec: str, n: int, *, persistent: bool, dtype=torch.float32, overlap: bool = False):
    """Every worker's per-step (aggregate, residual): one PSync for all steps (reusing), or a
    fresh PSync each step (nothing to reuse: the reference)."""

    def worker(comm):
        keep = PSync(comm, spec, seed=3, bucket_bytes=4096, check_finite=True)
        out, held = [], []
        pending = None
        for step in range(STEPS):
            psync = keep if persistent else PSync(comm, spec, seed=3, bucket_bytes=4096, check_finite=True)
            nxt = psync.start(grads(comm.rank, step, dtype), step, residual=step % 2 == 0)
            if overlap:  # the next exchange starts before the previous one is waited
                if pending is not None:
                    result = pending.wait()
                    out.append(snapshot(result))
                    held.append((result, snapshot(result)))
                pending = nxt
            else:
                result = nxt.wait()
                out.append(snapshot(result))
                held.append((result, snapshot(result)))
        if overlap:
            result = pending.wait()
            out.append(snapshot(result))
            held.append((result, snapshot(result)))
        # what earlier steps returned is still intact after the later steps reused buffers
        for result, (aggs, res) in held:
            assert all(torch.equal(a, b) for a, b in zip(result.aggregate, aggs))
            if res is not None:
                assert all(torch.equal(a, b) for a, b in zip(result.residual, res))
        return out

    return gradzip.simulate(n, worker)


def assert_same(a, b):
    for rank_a, rank_b in zip(a, b):
        for (aggs_a, res_a), (aggs_b, res_b) in zip(rank_a, rank_b):
            for x, y in zip(aggs_a, aggs_b):
                assert x.dtype == y.dtype and torch.equal(x, y)
            assert (res_a is None) == (res_b is None)
            if res_a is not None:
                for x, y in zip(res_a, res_b):
                    assert torch.equal(x, y)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [2, 9])
def test_reusing_buffers_changes_no_result(spec, n):
    assert_same(run(spec, n, persistent=True), run(spec, n, persistent=False))


@pytest.mark.parametrize("spec", ["fp16", "bf16", "2bit"])
def test_reuse_with_16_bit_tensors(spec):
    """fp16 on fp16 tensors: from_sum returns the summed bucket itself (not reused then)."""
    assert_same(run(spec, 3, persistent=True, dtype=torch.float16),
                run(spec, 3, persistent=False, dtype=torch.float16))


@pytest.mark.parametrize("spec", ["2bit", "fp16", "scaled_sign"])
def test_two_exchanges_in_flight(spec):
    """An exchange started before the previous one is waited (CD-SGD's overlap) allocates
    its own buffers: the same results as one at a time."""
    assert_same(run(spec, 2, persistent=True, overlap=True), run(spec, 2, persistent=False))


@pytest.mark.parametrize("spec", ["2bit", "sign", "fp16"])
def test_packets_and_bucket_buffers_are_reused(spec):
    """The second step's packets write into the first step's wire tensors, and a
    multi-tensor bucket is refilled into the same flat buffer."""

    def worker(comm):
        psync = PSync(comm, spec, seed=3, bucket_bytes=4096)
        first = psync.start(grads(comm.rank, 0), 0)
        first.wait()
        ptrs = [[w.data_ptr() for w in p.wire.values()] for p in first.packets]
        bufs = [b.buffer.data_ptr() for b in first.buckets if b.buffer is not None]
        second = psync.start(grads(comm.rank, 1), 1)
        second.wait()
        assert [[w.data_ptr() for w in p.wire.values()] for p in second.packets] == ptrs
        assert bufs and [b.buffer.data_ptr() for b in second.buckets if b.buffer is not None] == bufs
        return True

    assert all(gradzip.simulate(2, worker))
