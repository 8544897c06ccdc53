"""The timeline model of an exchange that starts during backward (gradzip.bench.timeline):
hand-computed cases of backward_timeline, and its use by predict() for the methods with
overlap_backward on."""
import pytest

from gradzip.bench import timeline
from gradzip.bench.profiling import profile_method
from gradzip.bench.timeline import Bucket, backward_timeline
from gradzip.bench import projection


def test_one_bucket_is_the_sequential_sum():
    # forward 1, backward 2, encode 0.5, link 3, decode 0.25, update 0.125: nothing overlaps
    t = backward_timeline(1.0, 2.0, [Bucket(1.0, 0.5, 3.0, 0.25)], 0.125)
    assert t.period == pytest.approx(1 + 2 + 0.5 + 3 + 0.25 + 0.125)
    seq = timeline.timeline(3.0, 0.75, 3.0, 0.125, overlaps=False)
    assert t.period == pytest.approx(seq.period)


def test_many_equal_buckets_on_a_fast_link_hide_all_but_the_last():
    # 10 buckets of backward 0.1 each, link 0.05 each (< backward per bucket): every
    # collective ends before the next bucket is ready; only the last one's 0.05 shows
    buckets = [Bucket(0.1, 0.0, 0.05) for _ in range(10)]
    t = backward_timeline(0.5, 1.0, buckets, 0.2)
    assert t.period == pytest.approx(0.5 + 1.0 + 0.05 + 0.2)
    links = [s for s in t.spans if s[1] == "link"]
    assert [s[2] for s in links] == pytest.approx([0.5 + 0.1 * (i + 1) for i in range(10)])


def test_a_slow_link_serialises_the_buckets():
    # 4 buckets of backward 0.25, link 1.0 each: the link starts at the first bucket's
    # readiness (forward 1 + 0.25) and then runs back to back: 1.25 + 4 = 5.25, + update 0.5
    t = backward_timeline(1.0, 1.0, [Bucket(0.25, 0.0, 1.0) for _ in range(4)], 0.5)
    assert t.period == pytest.approx(5.75)
    # the sum model would say 1 + 1 + 4 + 0.5 = 6.5; the overlap saves the 0.75 of backward
    assert timeline.timeline(2.0, 0.0, 4.0, 0.5, overlaps=False).period - t.period == pytest.approx(0.75)


def test_encoding_runs_on_the_training_thread_and_decoding_after_each_collective():
    # two buckets: backward 1 each, encode 0.5 each (delays backward), link 0.1, decode 0.2
    t = backward_timeline(0.0, 2.0, [Bucket(0.5, 0.5, 0.1, 0.2), Bucket(0.5, 0.5, 0.1, 0.2)], 0.0, tail=0.3)
    # main: bw 0-1, enc 1-1.5, bw 1.5-2.5, enc 2.5-3; link 1.5-1.6, 3-3.1; decode the first
    # at once 3-3.2, the second (done at 3.1) 3.2-3.4; tail 3.4-3.7
    assert t.period == pytest.approx(3.7)
    decodes = [s[2:] for s in t.spans if s[0] == "decode"]
    assert decodes == [pytest.approx((3.0, 3.2)), pytest.approx((3.2, 3.4))]


def test_backward_outside_the_buckets_still_counts():
    assert backward_timeline(1.0, 2.0, [], 0.5).period == pytest.approx(3.5)
    assert backward_timeline(0.0, 2.0, [Bucket(0.5, 0.0, 0.0)], 0.0).period == pytest.approx(2.0)


SHAPES = [(64, 32), (64,), (32, 16), (16,)]


def test_profile_notes_the_buckets_of_an_overlapping_method():
    # bucket_bytes of one small tensor: several buckets, in reverse parameter order
    prof = profile_method("ssgd", {"bucket_bytes": 4096}, SHAPES, 4, steps=1, warmup=0)
    assert prof.overlaps_backward and not prof.overlaps
    (part,) = prof.bucket_costs(1e9 / 8, 1e-5)
    assert [n for n, _ in part["buckets"]] == [16 + 32 * 16 + 64, 64 * 32]
    assert all(s > 0 for _, s in part["buckets"])
    off = profile_method("ssgd", {"overlap_backward": False}, SHAPES, 4, steps=1, warmup=0)
    assert not off.overlaps_backward and off.bucket_costs(1e9 / 8, 1e-5)[0]["buckets"] == []


def test_predict_credits_the_exchange_during_backward():
    on = profile_method("ssgd", {"bucket_bytes": 4096}, SHAPES, 4, steps=1, warmup=0)
    off = profile_method("ssgd", {"overlap_backward": False}, SHAPES, 4, steps=1, warmup=0)
    slow = 1e6 / 8   # 1 Mbit/s: the network dominates
    p_on, p_off = timeline.predict(on, 0.3, slow, 1e-5), timeline.predict(off, 0.3, slow, 1e-5)
    assert p_on["communicate"] == pytest.approx(p_off["communicate"], rel=1e-3)   # buckets: extra latency only
    # sequential: compute + compress + comm + update; with the buckets, the first bucket's
    # collective hides behind the rest of backward (its share: 2/3 of 0.3 s x 2048/2640)
    assert p_off["iteration"] == pytest.approx(0.3 + p_off["compress"] + p_off["communicate"] + p_off["update"])
    hidden = p_off["iteration"] - p_on["iteration"]
    assert 0 < hidden <= 0.2 * 2048 / 2640 + 1e-6
    # a fast link: everything hidden but the last (small) bucket's collective
    fast = timeline.predict(on, 0.3, 1e12, 1e-3)
    (part,) = on.bucket_costs(1e12, 1e-3)
    last = part["buckets"][-1][1]
    # (the first bucket's decoding also runs while the last one's collective is in flight)
    local = 0.3 + fast["compress"] + part["other_s"] + fast["update"]
    assert local - 1e-9 <= fast["iteration"] <= local + last + 1e-9
    assert last < fast["communicate"]


def test_the_main_jobs_projection_credits_the_exchange_during_backward():
    # a run's summary and history as the loop writes them (phase times: epoch totals)
    shapes, steps = [list(s) for s in SHAPES], 10
    history = [{"epoch": e, "step": e * steps, "time_compute_s": 0.01 * steps, "time_compress_s": 0.0,
                "time_update_s": 0.001 * steps, "bytes_sent_per_worker": 0.0} for e in (1, 2)]
    def run(options):
        summary = {"algo": "ssgd", "method": "ssgd", "options": options, "workers": 4, "steps": 2 * steps,
                   "batch_size_per_worker": 8, "training_samples": steps * 4 * 8, "parameter_shapes": shapes,
                   "bytes_sent_per_worker": 0.0, "time_compute_s": 0.2, "time_compress_s": 0.0, "time_update_s": 0.02}
        return {"summary": summary, "history": history}
    on, off = [r["projections"] for r in
               projection.project_runs([run({"bucket_bytes": 4096}), run({"overlap_backward": False})], [1e6])]
    assert off[0]["iteration_s"] == pytest.approx(0.01 + off[0]["communicate_s"] + 0.001)
    # the first bucket (2048 of 2640 elements) communicates behind the rest of backward
    assert 0 < off[0]["iteration_s"] - on[0]["iteration_s"] <= 0.01 * 2 / 3 * 2048 / 2640 + 1e-9


def test_validation_models_a_measured_ssgd_step_with_its_buckets():
    # a bench net record of S-SGD on 2 workers at 1 Mbit/s (measured phases given), the
    # buckets as the profile records them: the backward model, not the sequential sum
    run = {"algo": "ssgd", "method": "ssgd", "options": {"bucket_bytes": 4096}, "iteration_s": 1.0,
           "critical_local_s": 0.3, "compute_s": 0.28, "compress_s": 0.005, "update_s": 0.01, "loop_s": 0.005,
           "communicate_s": 0.5, "bytes_per_step": 0.0}
    measured = {"settings": {"model": "mlp:hidden=64x32", "shape": "16"},
                "records": [{"workers": 2, "bandwidth_bps": 1e6, "latency_s": 0.0, "runs": [run]}]}
    (row,) = timeline.validate(measured, 1e-4, host_Bps=1e12)
    assert row["predicted_s"] < row["local_s"] + row["communicate_model_s"]
    assert row["predicted_s"] >= 0.02 + row["communicate_model_s"]   # step()'s work and the link at least


def test_cdsgd_full_precision_step_is_priced_in_its_own_step():
    # k = 5 over 5 profiled steps: four 2-bit exchanges and one full-precision one; on a
    # slow link the full one outlasts the compute, the 2-bit ones do not
    prof = profile_method("cdsgd", {"k": 5}, SHAPES, 4, steps=5, warmup=0)
    bw, compute = 1e6 / 8, 0.05
    steps = prof.comm_times(bw, 1e-5)
    assert max(steps) > 4 * min(steps) and min(steps) < compute < max(steps)
    p = timeline.predict(prof, compute, bw, 1e-5)
    per_step = sum(max(compute, p["compress"] + c) + p["update"] for c in steps) / 5
    assert p["iteration"] == pytest.approx(per_step)
    assert p["iteration"] > max(compute, p["compress"] + p["communicate"]) + p["update"] + 1e-3
