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


# -- issue 14: `none` sends one copy of its input; opt-in reuse of the aggregates' memory ----
def test_none_summand_is_the_wire_and_the_input_is_never_written():
    """``none``'s summand is its wire (no copy); PSync copies it once into its own bucket
    buffer, so the in-place allreduce never writes into the caller's tensor."""
    codec = gradzip.compressors.build("none")
    x = torch.randn(7)
    packet = codec.compress(x)
    assert codec.summand(packet, 2).data_ptr() == x.data_ptr()

    def worker(comm):
        inputs = grads(comm.rank, 0)
        before = [t.clone() for t in inputs]
        result = PSync(comm, "none", bucket_bytes=4096).start(inputs, 0).wait()
        assert all(torch.equal(a, b) for a, b in zip(inputs, before))
        return [a.clone() for a in result.aggregate]

    out = gradzip.simulate(2, worker)
    want = [(a + b) / 2 for a, b in zip(grads(0, 0), grads(1, 0))]
    for rank_out in out:
        assert all(torch.equal(a, w) for a, w in zip(rank_out, want))


@pytest.mark.parametrize("spec", ["none", "fp16", "2bit"])
def test_reuse_aggregates_changes_no_result_and_reuses_the_buckets(spec):
    """``reuse_aggregates=True`` (S-SGD: it applies each aggregate at once): the same bits as
    a fresh PSync every step, and every allreduce bucket of step 2 is sent from a step 1
    buffer (no allocation), the one-tensor ``none`` bucket included."""

    def worker(comm):
        psync = PSync(comm, spec, seed=3, bucket_bytes=4096, check_finite=True)
        psync.reuse_aggregates = True
        out, buffers = [], []
        for step in range(STEPS):
            inputs = grads(comm.rank, step)
            before = [t.clone() for t in inputs]
            pending = psync.start(inputs, step, residual=False)
            result = pending.wait()
            assert all(torch.equal(a, b) for a, b in zip(inputs, before))
            out.append(([a.clone() for a in result.aggregate], None))
            buffers.append({b.buffer.data_ptr() for b in pending.buckets
                            if b.kind == "allreduce" and b.buffer is not None})
        if spec == "none":   # every bucket, the one-tensor one of 3000 elements too, is PSync's copy
            assert len(buffers[0]) == len(pending.buckets) == 3
        assert buffers[1] == buffers[0] == buffers[2]
        return out

    def fresh(comm):
        return [([a.clone() for a in PSync(comm, spec, seed=3, bucket_bytes=4096, check_finite=True)
                  .start(grads(comm.rank, step), step, residual=False).wait().aggregate], None)
                for step in range(STEPS)]

    assert_same(gradzip.simulate(2, worker), gradzip.simulate(2, fresh))


@pytest.mark.parametrize("method", ["ssgd", "efsgd"])
@pytest.mark.parametrize("overlap", [True, False])
def test_ssgd_reuses_its_bucket_buffers_and_leaves_the_gradients_alone(overlap, method):
    """S-SGD and EF-SGD opt in (they apply every aggregate at once): from step 2 on, their
    ``none`` exchange sends from the buffers of step 1 (no allocation), with the same
    parameters as a PSync that reuses nothing, and ``p.grad`` keeps this worker's own gradient."""
    import cases

    def worker(comm, reuse):
        model = cases.tiny_model()
        opt = gradzip.optim.METHODS[method](model.parameters(), lr=0.1, comm=comm, overlap_backward=overlap,
                                            bucket_bytes=64, compressor="none")
        if reuse is not None:
            opt.psync.reuse_aggregates = reuse
        buffers = []
        for t in range(1, 4):
            x, y = cases.regression_batch(t, comm.rank, comm.world_size)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            grad = [p.grad.clone() for p in model.parameters()]
            opt.step()
            assert all(torch.equal(g, p.grad) for g, p in zip(grad, model.parameters()))
            buffers.append(sorted(id(b) for spare in opt.psync.memory._buffers.values() for b in spare))
        if reuse is None:
            assert buffers[0] and buffers[0] == buffers[1] == buffers[2]
        return [p.detach().clone() for p in model.parameters()]

    reused = gradzip.simulate(2, lambda comm: worker(comm, None))   # S-SGD's default
    plain = gradzip.simulate(2, lambda comm: worker(comm, False))
    cases.assert_bitwise_equal(reused, plain)


@pytest.mark.parametrize("overlap", [True, False])
def test_efsgd_writes_its_error_into_the_last_exchange_input(overlap):
    """EF-SGD's residual (its new error) is written into the memory of the previous step's
    exchange input (``p = e + η d``, its own temporary; PSync.residual_spares), with the
    same bits as without; an error returned by ``state_dict()`` is never written again."""
    import cases

    def train(comm, reuse):
        model = cases.tiny_model()
        opt = gradzip.optim.EFSGD(model.parameters(), lr=0.1, momentum=0.9, comm=comm,
                                  compressor="topk:ratio=0.3", overlap_backward=overlap)
        inputs, held = [], []
        start = opt.psync.start

        def spy(tensors, step, **kw):
            inputs.append(list(tensors))   # held: no later tensor can take their addresses
            return start(tensors, step, **kw)
        opt.psync.start = spy
        for t in range(1, 5):
            if not reuse:
                getattr(opt.psync, "residual_spares", {}).clear()
            earlier = len(inputs)
            x, y = cases.regression_batch(t, comm.rank, comm.world_size)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            errors = [opt.state[p]["error"] for p in model.parameters()]
            held.append((errors, [e.clone() for e in errors]))
            if reuse and t > 1:   # this step's errors live in earlier steps' inputs
                assert {e.data_ptr() for e in errors} <= {i.data_ptr() for x in inputs[:earlier] for i in x}
        for errors, values in held:
            assert all(torch.equal(e, v) for e, v in zip(errors, values))
        return [p.detach().clone() for p in model.parameters()], [v for _, v in held]

    cases.assert_bitwise_equal(gradzip.simulate(2, lambda c: train(c, True)),
                               gradzip.simulate(2, lambda c: train(c, False)))


@pytest.mark.parametrize("spec", ["none", "topk:ratio=0.1"])
def test_omit_zero_residuals_returns_none_only_for_a_lossless_codec(spec):
    """``PSync.omit_zero_residuals``: a lossless codec's residual (``v − v``, zeros) comes back
    as None, a lossy codec's as it would without the option; the aggregates are the same bits."""

    def worker(comm, omit):
        psync = PSync(comm, spec, seed=3, bucket_bytes=4096, check_finite=True)
        psync.omit_zero_residuals = omit
        result = psync(grads(comm.rank, 0), 0)
        return result.aggregate, result.residual

    with_option = gradzip.simulate(2, lambda comm: worker(comm, True))
    without = gradzip.simulate(2, lambda comm: worker(comm, False))
    for (agg, res), (agg0, res0) in zip(with_option, without):
        assert all(torch.equal(a, b) for a, b in zip(agg, agg0))
        if spec == "none":
            assert res == [None] * len(SHAPES) and all(bool((r == 0).all()) for r in res0)
        else:
            assert all(torch.equal(a, b) for a, b in zip(res, res0))


@pytest.mark.parametrize("overlap", [True, False])
def test_efsgd_uncompressed_keeps_no_error_and_sends_the_gradient_itself(overlap):
    """EF-SGD with ``none`` (no momentum, no weight decay): no error is kept (a lossless unit
    owes nothing), no input ``p = η g`` is formed (the gradient itself is sent, ``η`` applied
    to the mean: no input memory, none to reuse), and the bits equal S-SGD's; the same run
    keeping its zero errors (the option off: ``p = 0 + η g`` sent) equals it to rounding."""
    import cases

    def train(comm, method):
        model = cases.tiny_model()
        if method == "ssgd":
            opt = gradzip.optim.SSGD(model.parameters(), lr=0.1, comm=comm, overlap_backward=overlap)
        else:
            opt = gradzip.optim.EFSGD(model.parameters(), lr=0.1, comm=comm, compressor="none",
                                      overlap_backward=overlap)
            opt.psync.omit_zero_residuals = method == "efsgd"
        for t in range(1, 5):
            x, y = cases.regression_batch(t, comm.rank, comm.world_size)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if method == "efsgd":
                assert all("error" not in opt.state[p] for p in model.parameters())
                assert not opt.psync.residual_spares and not opt._inputs
            elif method == "efsgd-zeros":
                assert all(bool((opt.state[p]["error"] == 0).all()) for p in model.parameters())
        return [p.detach().clone() for p in model.parameters()]

    new, zeros, ssgd = (gradzip.simulate(2, lambda c, m=m: train(c, m)) for m in ("efsgd", "efsgd-zeros", "ssgd"))
    cases.assert_bitwise_equal(new, ssgd)
    for a, b in zip(new[0], zeros[0]):
        torch.testing.assert_close(a, b)
