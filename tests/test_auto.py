"""auto:<codec> (docs/algorithms.md §Auto codec choice): the rule by hand; the decision agreed
from every worker's measurements (rank 0's) and recorded; a resume that executes the saved
decision without probing; the two extreme links against the fixed runs, bit for bit; no error
lost when a unit switches under EF-SGD; the one-line errors; the DDP hook; threads and gloo."""
import collections
import logging
import math
import time

import pytest
import torch

import cases_auto
import gradzip
import gradzip.ddp
from gradzip import simulate
from gradzip.exchange import calibration, planner
from gradzip.comm import make_group
from gradzip.compressors import Auto, build
from gradzip.errors import GradzipError
from gradzip.exchange import Link, PSync, plan
from gradzip.comm.launch import run_processes
from gradzip.exchange.planner import CodecCost

SHAPES = [(64, 32), (64,), (8, 64), (8,), (8, 8), (8,), (2, 8), (2,)]   # cases_auto.model()'s parameters
LAUNCH = SHAPES[::-1]   # the plan's order: descending key


# -- the rule by hand ------------------------------------------------------------------------
def test_the_rule_by_hand():
    """n = 2, 100 Mbit/s (12.5 MB/s), 20 us, 1bit at 300 us + 2 ns/element, none at 1 us + 0.1
    ns/element. Units at 1024 B, in launch order: the five small tensors, the 8x64 weight, the
    64-bias, the 64x32 weight. The 64x32 weight: 1bit allgathers 2048/8 + 8·32 = 512 B: 20 +
    512/12.5 = 60.96 us on the link plus 304.096 us of coding (365.1 us) against the fp32
    allreduce of 8192 B: 2·20 + 8192/12.5 = 695.36 us plus 1.2 us: 1bit. The 8x64 weight: 1bit
    300 + 1.024 + 20 + (64 + 8·64)/12.5 = 367.1 us against 1.05 + 40 + 2048/12.5 = 204.9 us:
    none; the bias and the small tensors: none (1bit's 300 us a call). A free link: none
    everywhere; a link no byte crosses: 1bit everywhere."""
    costs = {"1bit": CodecCost(300e-6, 2e-9), "none": CodecCost(1e-6, 1e-10)}
    p = plan(LAUNCH, "auto:1bit", 2, bucket_bytes=cases_auto.BUCKET_BYTES, link="100mbit", codec_costs=costs)
    assert [[LAUNCH[i] for i in b.tensors] for b in p.buckets] == [[(2,), (2, 8), (8,), (8, 8), (8,)], [(8, 64)],
                                                                   [(64,)], [(64, 32)]]
    assert p.choices == ("none", "none", "none", "1bit")
    assert [b.route for b in p.buckets] == ["allreduce", "allreduce", "allreduce", "allgather"]
    assert [c.spec for c in p.codecs] == ["none"] * 7 + ["1bit"]
    assert p.buckets[3].seconds == pytest.approx(20e-6 + 512 / 12.5e6)
    assert p.buckets[1].seconds == pytest.approx(40e-6 + 2048 / 12.5e6)
    assert 304.096e-6 + p.buckets[3].seconds < 1.2192e-6 + 40e-6 + 8192 / 12.5e6
    assert plan(LAUNCH, "auto:1bit", 2, bucket_bytes=1024, link=cases_auto.FAST, codec_costs=costs).choices == ("none",) * 4
    assert plan(LAUNCH, "auto:1bit", 2, bucket_bytes=1024, link=cases_auto.SLOW, codec_costs=costs).choices == ("1bit",) * 4
    # a decision given is executed as it is; one of another length or codec is refused
    given = plan(LAUNCH, "auto:1bit", 2, bucket_bytes=1024, choices=["1bit", "none", "none", "none"])
    assert given.choices == ("1bit", "none", "none", "none") and given.buckets[-1].route == "allreduce"
    for bad, match in ((["1bit"], "fewer than this exchange's units"), (["1bit"] * 5, "5 choices for 4 units"),
                       (["2bit"] * 4, "chooses between 1bit and none")):
        with pytest.raises(GradzipError, match=match):
            plan(LAUNCH, "auto:1bit", 2, bucket_bytes=1024, choices=bad)


def test_units_decided_apart_travel_together_up_to_bucket_bytes(monkeypatch):
    """auto decides per unit of AUTO_UNIT_BYTES (bucket_bytes where smaller), then consecutive
    units that took the same codec are one bucket while they fit bucket_bytes: the rule's
    choices of test_the_rule_by_hand, in two buckets instead of four."""
    monkeypatch.setattr(planner, "AUTO_UNIT_BYTES", 1024)
    costs = {"1bit": CodecCost(300e-6, 2e-9), "none": CodecCost(1e-6, 1e-10)}
    p = plan(LAUNCH, "auto:1bit", 2, bucket_bytes=1 << 20, link="100mbit", codec_costs=costs)
    assert p.choices == ("none", "none", "none", "1bit")
    assert [[LAUNCH[i] for i in b.tensors] for b in p.buckets] == [LAUNCH[:7], [(64, 32)]]
    assert [b.route for b in p.buckets] == ["allreduce", "allgather"]
    given = plan(LAUNCH, "auto:1bit", 2, bucket_bytes=1 << 20, choices=["none", "1bit", "none", "none"])
    assert [[LAUNCH[i] for i in b.tensors] for b in given.buckets] == [LAUNCH[:5], [(8, 64)], LAUNCH[6:]]
    assert [c.spec for c in given.codecs] == ["none"] * 5 + ["1bit"] + ["none"] * 2
    # joined only while they fit (392 + 2048 B, 2048 + 256 B, 256 + 8192 B: each > 2048)
    apart = plan(LAUNCH, "auto:1bit", 2, bucket_bytes=2048, choices=["none"] * 4)
    assert [[LAUNCH[i] for i in b.tensors] for b in apart.buckets] == [LAUNCH[:5], [(8, 64)], [(64,)], [(64, 32)]]


def test_hierarchical_plans_decide_per_level():
    """hierarchy k = 2 of 4: each local rank's shard plan across the 2 nodes decides its own
    units on its half of the uplink; the decision lists them in turn."""
    costs = {"1bit": CodecCost(300e-6, 2e-9), "none": CodecCost(1e-6, 1e-10)}
    p = plan(LAUNCH, "auto:1bit", 4, hierarchy=2, bucket_bytes=cases_auto.BUCKET_BYTES, link="100mbit",
             codec_costs=costs)
    inner = [q.choices for b in p.buckets for q in b.inner]
    assert p.choices == sum(inner, ()) and inner[-1] == inner[-2] == ("1bit",) and "none" in p.choices
    again = plan(LAUNCH, "auto:1bit", 4, hierarchy=2, bucket_bytes=cases_auto.BUCKET_BYTES, choices=p.choices)
    assert again.choices == p.choices


def test_the_link_fit_and_the_codec_fit_by_hand():
    """fit_link: seconds made by the ring formulas on 1 Gbit/s, 50 us come back; fit_line: a
    line through three points, clipped at zero."""
    true = Link(1.25e8, 50e-6)
    seconds = [planner.collective_time(kind, s, 4, true) for kind in ("allreduce", "allgather")
               for s in calibration.LINK_PROBE_BYTES]
    fitted = calibration.fit_link(seconds, 4)
    assert fitted.bytes_per_s == pytest.approx(1.25e8) and fitted.latency_s == pytest.approx(50e-6)
    flat = calibration.fit_link([6e-4, 6e-4, 3e-4, 3e-4], 4)   # no time grows with the size: latency only
    assert flat.bytes_per_s > 1e15 and flat.latency_s == pytest.approx(1e-4)
    assert calibration.fit_link([1e-3] * 4, 1) == Link(math.inf, 0.0)
    fitted = calibration.fit_line([(x, 1e-5 + 1e-9 * x) for x in (64, 1000, 5000)])
    assert (fitted.fixed_s, fitted.per_element_s) == pytest.approx((1e-5, 1e-9))
    assert calibration.fit_line([(64, 3e-5), (1000, 1e-5)]).per_element_s == 0.0


def test_a_small_probe_finds_the_per_call_cost_through_noise(monkeypatch):
    """A codec whose first five calls on each shape come 2 ms late (a loaded host preempting
    the worker): best of 3 would price every call at 2 ms; a small probe is timed
    SMALL_REPEATS times, so the per-call cost comes out as the undisturbed call's."""
    codec = build("none")
    calls = collections.Counter()
    plain = type(codec).compress_residual

    def late(self, x, seed, residual, **kwargs):
        calls[tuple(x.shape)] += 1
        if calls[tuple(x.shape)] <= 5:
            time.sleep(2e-3)
        return plain(self, x, seed, residual, **kwargs)

    monkeypatch.setattr(type(codec), "compress_residual", late)
    cost = calibration.measure_codec(codec, [(10,), (8, 8)], 2)
    assert all(count > 5 for count in calls.values()) and cost.fixed_s < 1e-3


# -- agreement, record, resume ------------------------------------------------------------------
def test_decisions_agree_although_workers_measured_differently(monkeypatch):
    """Every worker's codec probe says something else (the k-th call of the run: k ms a call);
    every worker executes rank 0's decision from the largest of them, which differs from what
    the cheapest worker alone would have chosen."""
    seen = []

    def measured(codec, shapes, n, dtype=torch.float32, device="cpu", seed=0):
        cost = CodecCost(1e-6 if codec.name == "none" else 1e-4 * (1 + 9 * len(seen)), 0.0)
        seen.append((codec.spec, cost))
        return cost

    monkeypatch.setattr(calibration, "measure_codec", measured)
    options = {"lr": 0.1, "compressor": "auto:1bit", "link": "100mbit"}
    results = simulate(3, lambda comm: cases_auto.train(comm, "efsgd", options, steps=2))
    decisions = [r[2] for r in results]
    assert decisions[0]["exchange 0 auto"].startswith("step 1: ") and all(d == decisions[0] for d in decisions)
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0][0], r[0]))
    worst = max(c.fixed_s for spec, c in seen if spec == "1bit")
    rule = plan(LAUNCH, "auto:1bit", 3, bucket_bytes=cases_auto.BUCKET_BYTES, link="100mbit",
                codec_costs={"1bit": CodecCost(worst, 0.0), "none": CodecCost(1e-6, 0.0)}).choices
    cheapest = plan(LAUNCH, "auto:1bit", 3, bucket_bytes=cases_auto.BUCKET_BYTES, link="100mbit",
                    codec_costs={"1bit": CodecCost(1e-4, 0.0), "none": CodecCost(1e-6, 0.0)}).choices
    assert f"({','.join(rule)})" in decisions[0]["exchange 0 auto"] and rule != cheapest


@pytest.mark.slow
def test_decisions_agree_and_resume_bit_exactly_on_gloo():
    """Real probes (codec and link) on 2 gloo processes: one decision on both, identical
    replicas; a resumed optimizer executes the saved decision without probing and repeats the
    uninterrupted run bit for bit. Saved after step 14, after the verdict of any trial (the
    decision at step 1, a retried trial's exchanges at steps 1-12): on a loaded host the link
    probe's latency goes up and the rule may compress a unit, and inside a trial the resumed
    run times the rest itself (docs/algorithms.md §Auto codec choice, "Trial"), so its
    describe() line would carry other times (one CI run: "18.0 ms against 3.3 ms")."""
    results = run_processes(2, cases_auto.resume_without_probing, "efsgd", {"lr": 0.1, "compressor": "auto:1bit"},
                            calibration.RETRIED_EXCHANGES + 2)
    (straight0, resumed0), (straight1, _) = results
    assert straight0[2] == straight1[2] and "(measured)" in straight0[2]["exchange 0 auto"]
    assert all(torch.equal(a, b) for a, b in zip(straight0[0], straight1[0]))
    assert all(torch.equal(a, b) for a, b in zip(straight0[0], resumed0[0])) and resumed0[2] == straight0[2]
    saved = straight0[1]["gradzip"]["exchange_states"][0]["auto"]
    assert len(saved) == 1 and saved[0]["step"] == 1 and len(saved[0]["choices"]) == 4


def test_a_run_resumed_from_its_checkpoint_keeps_the_decision(tmp_path, monkeypatch):
    """The training loop (gradzip train): EF-SGD auto:1bit on digits, 2 threads, checkpoints
    every 8 steps; a run interrupted after step 27 and resumed from its checkpoint of step 24
    probes nothing after the resume, records the same decision in its summary and ends with
    the uninterrupted run's history bit for bit."""
    import cases
    from gradzip.train.config import RunConfig
    from gradzip.train.loop import run_worker

    resumed_flag = {"on": False}

    def costs(*args, **kwargs):
        assert not resumed_flag["on"], "a resumed run probed instead of executing its saved decision"
        return cases_auto.fixed_costs(*args, **kwargs)

    monkeypatch.setattr(calibration, "measure_codec", costs)
    base = RunConfig(algo="efsgd", options={"compressor": "auto:1bit"}, link="100mbit", epochs=2, progress=False,
                     checkpoint_every=8, lr=0.05)
    whole = gradzip.simulate(2, lambda c: run_worker(c, RunConfig(**{**vars(base), "checkpoint_dir": f"{tmp_path}/w"})))
    cut = RunConfig(**{**vars(base), "checkpoint_dir": f"{tmp_path}/cut", "resume": True})
    with pytest.raises(cases.Interrupted):
        gradzip.simulate(2, lambda c: run_worker(c, cut, after_step=cases.interrupt_after(cases.INTERRUPT_AFTER)))
    resumed_flag["on"] = True
    resumed = gradzip.simulate(2, lambda c: run_worker(c, cut))
    assert resumed[0]["summary"]["resumed_from_step"] == 24
    decided = whole[0]["summary"]["auto"]["exchange 0"]
    assert decided.startswith("step 1: ") and resumed[0]["summary"]["auto"]["exchange 0"] == decided
    cases.assert_bitwise_equal(whole[0]["history"], resumed[0]["history"], "history")


@pytest.mark.parametrize("overlap", [True, False])
def test_resume_executes_the_saved_decision_on_threads(monkeypatch, overlap):
    """The fixed costs give a mixed decision; a resume keeps it bit for bit (no probe); the
    hooked backward and the one-call step agree."""
    monkeypatch.setattr(calibration, "measure_codec", cases_auto.fixed_costs)
    options = {"lr": 0.1, "compressor": "auto:1bit", "link": "100mbit", "overlap_backward": overlap}
    results = simulate(2, lambda comm: cases_auto.resume_without_probing(comm, "efsgd", options))
    for straight, resumed in results:
        assert all(torch.equal(a, b) for a, b in zip(straight[0], resumed[0]))
        assert resumed[2] == straight[2] and "(none,none,none,1bit)" in straight[2]["exchange 0 auto"]
    other = simulate(2, lambda comm: cases_auto.train(comm, "efsgd", {**options, "overlap_backward": not overlap},
                                                      steps=6))
    assert all(torch.equal(a, b) for a, b in zip(results[0][0][0], other[0][0]))


# -- the trial: the rule's choices against nothing compressed, timed in real steps ----------------
def _trial_steps(comm, times_by_rank, start=3, every=1, exchanges=calibration.TRIAL_EXCHANGES, saved_at=None):
    """advance() through a whole trial of ``exchanges`` on ``comm`` (an exchange every ``every``
    steps, each step's advance called twice, as two buckets of a step do; at step
    ``saved_at`` the decision goes through its checkpoint state, as a resume there): the
    choices executed at each exchange, the decision after the verdict, and the describe()
    lines on the way."""
    decision = calibration.on_trial(calibration.Decision(("1bit", "none"), Link(1e7, 0.0), {}, start, True))
    executed, lines = [], []
    for step in range(start, start + every * exchanges + 1, every):
        if step == saved_at:
            decision = calibration.Decision.from_state(decision.state())
        for _ in range(2):
            decision = calibration.advance(comm, decision, step, lambda s: times_by_rank[comm.rank].get(s))
        executed.append(decision.choices)
        lines.append(decision.describe())
    return executed, decision, lines


@pytest.mark.parametrize("rule_s, none_s, kept", [((0.10, 0.02), (0.07, 0.08), True),
                                                  ((0.10, 0.09), (0.06, 0.12), False),
                                                  ((0.5, 0.75), (0.25, 0.5), False)])
def test_the_trial_by_hand(rule_s, none_s, kept):
    """Steps 3-5 execute the rule's choices, 6-8 nothing compressed, the first of each block
    untimed (steps 3 and 6: the switch's own costs, a plan's first execution, the error a
    first step has or folds; their 1 ms would decide every case if it counted), the verdict
    at step 9: per step the slowest worker's seconds (rank 1 adds 10 ms to step 5 and to step
    7), per candidate the best step; the rule's choices kept iff none's is at least 10%
    longer. Every worker reaches the same verdict; the per-worker times are not kept after
    it. (No retry: none's best is 25% shorter than the rule's, or the rule's at most half
    none's: :func:`calibration.decisive`.)"""
    times = [{3: 0.001, 4: rule_s[0], 5: rule_s[1], 6: 0.001, 7: none_s[0], 8: none_s[1]},
             {3: 0.001, 4: rule_s[0], 5: rule_s[1] + 0.01, 6: 0.001, 7: none_s[0] + 0.01, 8: none_s[1]}]
    results = simulate(2, lambda comm: _trial_steps(comm, times))
    slowest = [max(times[0][s], times[1][s]) for s in (4, 5, 7, 8)]
    for executed, decision, _ in results:
        assert executed[:6] == [("1bit", "none")] * 3 + [("none", "none")] * 3
        assert decision.verdict == (min(slowest[:2]), min(slowest[2:])) and not decision.on_trial
        assert decision.choices == (("1bit", "none") if kept else ("none", "none")) and decision.timed == ()
        assert decision.describe() == results[0][1].describe()
        assert ("kept from step 9" if kept else "none taken from step 9") in decision.describe()
    assert calibration.Decision.from_state(results[0][1].state()) == results[0][1]


@pytest.mark.parametrize("saved_at", [None, 11])
@pytest.mark.parametrize("later_rule_s, kept", [(0.07, True), (0.085, False), (0.12, False)])
def test_a_close_trial_is_retried_once(later_rule_s, kept, saved_at):
    """The first verdict's two best periods within 25% (rule 100 ms, none 90 ms): not final.
    Two more blocks, the rule's at steps 9-11 and nothing compressed at 12-14 (the same order
    as the first, each block's first untimed), and the verdict at step 15 from the best of 4
    periods each: the rule's choices kept where a later period of theirs is the fastest by
    10% (70 ms), else none (85 ms: faster, not by 10%; 120 ms). Every worker agrees on the
    retry (decided from the gathered times); a checkpoint inside the retry (step 11) resumes
    it; the describe() line says it was retried."""
    times = [{3: 0.001, 4: 0.10, 5: 0.11, 6: 0.001, 7: 0.09, 8: 0.095,
              9: 0.001, 10: 0.13, 11: later_rule_s, 12: 0.001, 13: 0.10, 14: 0.092}] * 2
    results = simulate(2, lambda comm: _trial_steps(comm, times, exchanges=calibration.RETRIED_EXCHANGES,
                                                    saved_at=saved_at))
    for executed, decision, lines in results:
        assert executed[:12] == ([("1bit", "none")] * 3 + [("none", "none")] * 3) * 2
        assert "under way (6 of 6 exchanges)" in lines[5] and "under way (7 of 12 exchanges)" in lines[6]
        assert decision.retried and decision.verdict == (min(0.10, later_rule_s), 0.09) and not decision.on_trial
        assert decision.choices == (("1bit", "none") if kept else ("none", "none"))
        assert "a period (best of 4 each: 2 did not decide), " in decision.describe()
        assert ("kept from step 15" if kept else "none taken from step 15") in decision.describe()
        assert decision.describe() == results[0][1].describe()
    assert calibration.Decision.from_state(results[0][1].state()) == results[0][1]


@pytest.mark.parametrize("rule_s, none_s, retried", [(0.125, 0.10, False), (0.1249, 0.10, True),
                                                     (0.10, 0.20, False), (0.10, 0.1999, True), (0.10, 0.125, True),
                                                     (math.inf, 0.1, False), (0.1, math.inf, False)])
def test_which_first_verdicts_are_final(rule_s, none_s, retried):
    """None's at 25% faster, or the rule's at twice as fast, decides; anything between is
    retried (a missing time, +inf, decides against its candidate)."""
    assert calibration.decisive(rule_s, none_s) is not retried


@pytest.mark.parametrize("rule_s, none_s, kept", [(0.10, 0.1101, True), (0.10, 0.1099, False), (0.10, 0.10, False),
                                                  (math.inf, 0.1, False), (0.1, math.inf, True),
                                                  (math.inf, math.inf, False)])
def test_a_verdict_keeps_the_rule_only_on_a_win_of_10_percent(rule_s, none_s, kept):
    """None's best period at least 1.1 times the rule's keeps the rule's choices; a closer
    win, a tie or a missing rule time (+inf) takes none."""
    assert calibration.keeps(rule_s, none_s) is kept


@pytest.mark.parametrize("later_none_s, kept", [(0.15, False), (0.25, True)])
def test_a_win_of_the_rule_that_does_not_halve_the_period_is_retried(later_none_s, kept):
    """The first blocks: the rule 194.5 ms, none 256.5 (a burst over none's block, as in a
    loopback run of resnet18 where DDP's step was 147.6 ms): the rule 1.32x faster, not 2x, so
    the trial is retried; none's later block at 150 ms takes none, at 250 ms (the rule really
    faster) keeps the rule."""
    times = [{3: 0.001, 4: 0.1945, 5: 0.20, 6: 0.001, 7: 0.2565, 8: 0.26, 9: 0.001, 10: 0.195, 11: 0.21,
              12: 0.001, 13: later_none_s, 14: later_none_s + 0.002}] * 2
    results = simulate(2, lambda comm: _trial_steps(comm, times, exchanges=calibration.RETRIED_EXCHANGES))
    for executed, decision, _ in results:
        assert decision.retried and decision.verdict == (0.1945, min(0.2565, later_none_s))
        assert decision.choices == (("1bit", "none") if kept else ("none", "none"))
        assert ("kept from step 15" if kept else "none taken from step 15") in decision.describe()


def test_the_trial_of_a_method_that_exchanges_every_h_steps_counts_exchanges():
    """Exchanges at steps 3, 8, 13, 18, 23, 28 (H = 5): the rule at the first three, none at
    the next three (the first of each untimed), the verdict at step 33 from the four timed
    periods."""
    times = [{3: 0.01, 8: 0.5, 13: 0.5, 18: 0.01, 23: 0.25, 28: 0.25}] * 2
    executed, decision, _ = simulate(2, lambda comm: _trial_steps(comm, times, every=5))[0]
    assert executed[:6] == [("1bit", "none")] * 3 + [("none", "none")] * 3
    assert decision.verdict == (0.5, 0.25) and decision.choices == ("none", "none")
    assert decision.trial_steps == (3, 8, 13, 18, 23, 28, 33) and "none taken from step 33" in decision.describe()


def test_a_periodic_method_reaches_its_verdict_on_real_periods(monkeypatch):
    """QSparse (H = 2) with a measured link on threads, real clocks: the trial's verdict comes
    at its seventh exchange (its thirteenth where the first two blocks were close and it was
    retried), from periods of 2 steps each, finite on both workers and the same."""
    monkeypatch.setattr(calibration, "measure_codec", cases_auto.fixed_costs)
    monkeypatch.setattr(calibration, "measure_link", cases_auto.measured_link)
    options = {"lr": 0.1, "compressor": "auto:1bit", "H": 2}
    steps = 2 * (calibration.RETRIED_EXCHANGES + 1) + 1
    results = simulate(2, lambda comm: cases_auto.train(comm, "qsparse", options, steps=steps))
    decided = [r[2]["exchange 0 auto"] for r in results]
    assert decided[0] == decided[1] and " ms a period" in decided[0] and "inf ms" not in decided[0], decided[0]
    assert "under way" not in decided[0]


def test_no_trial_where_the_link_is_declared_or_nothing_is_compressed():
    """A declared link is the user's word (the extreme links' runs stay the fixed runs bit for
    bit); a rule that compresses nothing has nothing to try."""
    declared = calibration.Decision(("1bit",), Link(1e7, 0.0), {}, 1, False)
    uncompressed = calibration.Decision(("none", "none"), Link(1e7, 0.0), {}, 1, True)
    assert calibration.on_trial(declared) is declared and calibration.on_trial(uncompressed) is uncompressed
    assert calibration.on_trial(calibration.Decision(("1bit",), Link(1e7, 0.0), {}, 1, True)).on_trial


@pytest.mark.parametrize("split", [2, 7])
@pytest.mark.parametrize("rule_wins", [True, False])
def test_the_trial_in_a_run_and_its_resume(monkeypatch, rule_wins, split):
    """EF-SGD auto:1bit with a measured link (stand-in probes: a mixed rule): steps 1-3 with
    the rule's choices, 4-6 nothing compressed (steps 1 and 4 untimed, so their times decide
    nothing), then the verdict at step 7 from the steps' times, the same on both workers and
    in describe(). A run resumed from the state saved after step 2 (inside the trial: the
    times measured so far travel with it) or after step 7 (after the verdict) repeats the
    uninterrupted run bit for bit."""
    monkeypatch.setattr(calibration, "measure_codec", cases_auto.fixed_costs)
    monkeypatch.setattr(calibration, "measure_link", cases_auto.measured_link)
    fast, slow = 0.1, 0.2
    times = ({1: slow, 2: fast, 3: fast, 4: 0.01, 5: slow, 6: slow} if rule_wins
             else {1: 0.01, 2: slow, 3: slow, 4: slow, 5: fast, 6: fast})
    monkeypatch.setattr(PSync, "_step_seconds", cases_auto.step_seconds(times))
    options = {"lr": 0.1, "compressor": "auto:1bit"}
    results = simulate(2, lambda comm: cases_auto.resume_without_probing(comm, "efsgd", options, split=split,
                                                                          steps=9 - split))
    (straight0, resumed0), (straight1, resumed1) = results
    decided = straight0[2]["exchange 0 auto"]
    assert decided == straight1[2]["exchange 0 auto"] == resumed0[2]["exchange 0 auto"]
    assert "trial of (none,none,none,1bit) against none: 100.0 ms against 200.0 ms a period, kept from step 7" in decided or not rule_wins
    assert "none taken from step 7" in decided or rule_wins
    assert ("(none,none,none,1bit)" if rule_wins else "(none,none,none,none)") in decided.split(";")[0]
    for straight, resumed in ((straight0, resumed0), (straight1, resumed1)):
        assert all(torch.equal(a, b) for a, b in zip(straight[0], resumed[0]))
    assert all(torch.equal(a, b) for a, b in zip(straight0[0], straight1[0]))


# -- the extreme links: the codec's run, the uncompressed run ----------------------------------
METHODS = {
    "ssgd": ("ssgd", {"lr": 0.1, "momentum": 0.9}),
    "efsgd": ("efsgd", {"lr": 0.1}),
    "efsgd-in-step": ("efsgd", {"lr": 0.1, "overlap_backward": False, "weight_decay": 0.01}),
    "csea": ("csea", {"lr": 0.1}),
    "qsparse": ("qsparse", {"lr": 0.1, "H": 2}),
    "cser-c2": ("cser", {"lr": 0.1, "H": 2, "c1": "topk:ratio=0.5"}),
    "onebitadam": ("onebitadam", {"lr": 0.01, "freeze_step": 1}),
}
CODEC_OPTION = {"cser-c2": "c2"}


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("codec", ["1bit", "topk:ratio=0.1"])
def test_extreme_links_give_the_fixed_runs_bit_for_bit(name, codec):
    """A link no byte crosses: auto:C is C's run (every unit's C packets are smaller); a free
    link: auto:C is the uncompressed run. Threads, 2 workers, both links declared."""
    method, options = METHODS[name]
    key = CODEC_OPTION.get(name, "compressor")

    def run(c, link):
        return simulate(2, lambda comm: cases_auto.train(comm, method, {**options, key: c, "link": link}))

    for link, fixed, expected in ((cases_auto.SLOW, codec, codec), (cases_auto.FAST, "none", "none")):
        auto, alone = run(f"auto:{codec}", link), run(fixed, link)
        for (pa, _, decided), (pb, _, _) in zip(auto, alone):
            assert all(torch.equal(a, b) for a, b in zip(pa, pb)), (name, link)
            text = next(iter(decided.values()))
            assert f"{expected} x" in text and ("none x" in text) == (expected == "none"), text


@pytest.mark.slow
def test_extreme_links_on_gloo_and_the_hierarchy():
    """The same on 2 gloo processes (EF-SGD, one-call step), and on 4 threads as 2 nodes of 2."""
    for rank in run_processes(2, cases_auto.extremes, {"lr": 0.1, "overlap_backward": False}):
        for auto, fixed in rank:
            assert all(torch.equal(a, b) for a, b in zip(auto, fixed))
    for rank in simulate(4, lambda comm: cases_auto.extremes(comm, {"lr": 0.1, "hierarchy": 2})):
        for auto, fixed in rank:
            assert all(torch.equal(a, b) for a, b in zip(auto, fixed))


def test_a_nan_gradient_under_auto_is_found_by_the_exchange_where_every_unit_is_uncompressed():
    """auto:1bit decided all-uncompressed (an infinitely fast link): the hooks read no
    gradient (the aggregate check of ``none`` finds a NaN input, as for EF-SGD with ``none``)
    and every worker raises NonFiniteGradient naming rank 1; decided all-1bit (which does not
    carry a NaN into its aggregate), the hooks check every bucket's gradients first: rank 1
    raises in backward's step, its peer fails at the next collective."""
    fast = simulate(2, lambda comm: cases_auto.nan_at(comm, cases_auto.FAST))
    for kind, message, reads in fast:
        assert kind == "NonFiniteGradient" and "on rank 1" in message and "found in the aggregate" in message
        assert reads == 0
    (peer, _, peer_reads), (kind, message, reads) = simulate(2, lambda comm: cases_auto.nan_at(comm, cases_auto.SLOW))
    assert kind == "NonFiniteGradient" and "on rank 1" in message and "found in the aggregate" not in message
    assert peer == "PeerFailure" and reads > 0 and peer_reads > 0


# -- residual folding ------------------------------------------------------------------------
def test_a_switch_under_efsgd_loses_no_error(monkeypatch, caplog):
    """recalibrate_every=1 with a codec cost that alternates: the large weight's unit goes
    1bit, none, 1bit, none. Every step, every tensor: Σ_i e_i' + n·A = Σ_i (e_i + η g_i)
    (what was owed is either still owed or sent); after an uncompressed step the errors are
    0 (folded in and sent) and not kept (``PSync.omit_zero_residuals``); each switch is logged."""
    monkeypatch.setattr(calibration, "measure_codec", cases_auto.Alternating())
    n = 3
    with caplog.at_level(logging.WARNING, logger="gradzip.exchange.calibration"):
        results = simulate(n, lambda comm: cases_auto.ef_steps(comm))
    steps = len(results[0])
    choices = [results[0][t][4] for t in range(steps)]
    assert [c[-1] for c in choices] == ["1bit", "none", "1bit", "none"]
    assert all(r[t][4] == choices[t] for r in results for t in range(steps))
    for t in range(steps):
        for k in range(len(SHAPES)):
            owed = sum(r[t][0][k] + r[t][1][k] for r in results)
            kept = sum(r[t][2][k] for r in results) + n * results[0][t][3][k]
            assert torch.allclose(owed, kept, atol=1e-6), (t, k)
        if choices[t][-1] == "none":
            assert all(bool((r[t][2][0] == 0).all()) for r in results)   # the 64x32 weight's error: sent
            assert all(r[t][5][0] for r in results)                       # and no memory kept for it
        else:
            assert any(bool((r[t][2][0] != 0).any()) for r in results)
    switched = [rec.getMessage() for rec in caplog.records if "unit 3: " in rec.getMessage()]
    assert len(switched) == n * 3 and "unit 3: 1bit -> none" in switched[0]


# -- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("link, match", [
    ("fast", "link='fast': bad bandwidth 'fast'"),
    ("-1gbit", "bad bandwidth '-1gbit'"),
    ("inf", "needs a finite rate"),
    (3.5, "link must be None, a rate"),
])
def test_bad_links_are_one_line_errors(link, match):
    comm = make_group(1)[0]
    net = cases_auto.model()
    makers = [lambda: planner.as_link(link), lambda: PSync(comm, "auto:1bit", link=link),
              lambda: gradzip.optim.EFSGD(net.parameters(), lr=0.1, compressor="auto:1bit", link=link),
              lambda: gradzip.ddp.hook("auto:1bit", link=link)]
    for make in makers:
        with pytest.raises(GradzipError, match=match) as error:
            make()
        assert "\n" not in str(error.value)


def test_bad_link_objects_and_options_are_one_line_errors():
    for args in ((-1.0,), (0.0,), (float("nan"),), (1e9, -1e-6), (1e9, math.inf)):
        with pytest.raises(GradzipError, match="a link needs bytes_per_s > 0"):
            Link(*args)
    net = cases_auto.model()
    for bad in (0, -3, 1.5, "2"):
        with pytest.raises(GradzipError, match="recalibrate_every must be an integer >= 1"):
            gradzip.optim.SSGD(net.parameters(), lr=0.1, compressor="auto:1bit", recalibrate_every=bad)
    for spec, match in (("auto:none", "auto:none chooses between none and none"),
                        ("auto:zip", "auto:zip: unknown compressor 'zip'"),
                        ("auto:auto:1bit", "give it a codec")):
        with pytest.raises(GradzipError, match=match):
            build(spec)
    with pytest.raises(GradzipError, match="is a policy, not a codec"):
        gradzip.PerTensor(default="auto:1bit")
    with pytest.raises(GradzipError, match="not a codec itself"):
        build("auto:1bit").compress(torch.zeros(3))
    with pytest.raises(GradzipError, match="cannot be pushed to a parameter server"):
        gradzip.optim.ASGD(net.parameters(), lr=0.1, compressor="auto:1bit")


def test_the_auto_policy_reads_as_its_codec():
    a = build("auto:topk:ratio=0.01")
    assert isinstance(a, Auto) and a.spec == "auto:topk:ratio=0.01" and build(a.spec) == a
    assert not a.unbiased and a.sum_dtype(4) is None and build("auto:randomk:ratio=0.1").sum_dtype(4) is not None
    assert build("auto:qsgd").unbiased and a != build("auto:1bit")


# -- the DDP hook, the CLI ---------------------------------------------------------------------
@pytest.mark.slow
def test_the_ddp_hook_on_gloo():
    """auto:1bit in the DDP hook: a link no byte crosses gives the 1bit hook's run, a free one
    the none hook's; the decisions are in the hook's state_dict."""
    results = run_processes(2, cases_auto.ddp_runs)
    for rank in results:
        for auto, fixed in rank:
            assert all(torch.equal(a, b) for a, b in zip(auto, fixed))


@pytest.mark.slow
def test_the_ddp_hook_resumes_its_decisions_bit_exactly_on_gloo():
    """The hook's decisions (codec costs measured on 2 gloo processes) are one on both ranks,
    saved in its state_dict; a new hook state that loads them executes them without probing
    and repeats the uninterrupted run bit for bit. The link probe measures a 1 TB/s stand-in,
    where nothing compressed pays whatever the coding costs: this host's loopback, probed
    under load (0.3 ms latency in one CI run), may make the rule compress a unit, and then
    inside its trial each worker's decision holds its own step times (the test below tries
    the rule with stand-in times)."""
    (straight0, resumed0, made0, kept0), (straight1, resumed1, made1, _) = run_processes(
        2, cases_auto.ddp_resume, 3, 3, Link(1e12, 0.0))
    assert made0 == made1 and made0 and kept0 == made0
    assert all(torch.equal(a, b) for a, b in zip(straight0, straight1))
    assert all(torch.equal(a, b) for a, b in zip(straight0, resumed0))
    assert all(torch.equal(a, b) for a, b in zip(straight1, resumed1))


@pytest.mark.slow
def test_the_ddp_hooks_compressing_decision_resumes_bit_exactly_across_ddps_bucket_rebuild_on_gloo():
    """A fresh DDP runs its first step with its initial buckets and rebuilds them after it;
    the hook decides for the initial buckets at step 1 and the rebuilt ones execute that
    decision per tensor (docs/algorithms.md §Auto codec choice, "Resume"), so a resumed
    run, whose first step runs the initial buckets again, executes the decision the
    uninterrupted run executes. A 100 Mbit/s stand-in link makes the rule compress, stand-in
    step times keep it after the trial (verdict at step 7), the state is saved after step 8:
    the resumed run is the uninterrupted one's bit for bit on both ranks, 1bit included
    (before this, it executed the initial buckets' decision left inside its trial)."""
    times = {2: 0.01, 3: 0.01, 4: 0.01, 5: 0.1, 6: 0.1}   # step 4: none's untimed first
    (straight0, resumed0, made0, kept0), (straight1, resumed1, made1, _) = run_processes(
        2, cases_auto.ddp_resume, 8, 3, cases_auto.MEASURED, times)
    assert made0 == made1 and kept0 == made0
    covered = [k for entry in made0 for k in entry["keys"]]
    assert sorted(covered) == list(range(len(straight0))), made0   # one decision per tensor
    assert any("1bit" in entry["choices"] for entry in made0), made0
    assert all(entry["verdict"][0] == 0.01 and entry["trial_steps"] == [1, 2, 3, 4, 5, 6, 7]
               for entry in made0 if "proposed" in entry), made0
    assert all(torch.equal(a, b) for a, b in zip(straight0, straight1))
    assert all(torch.equal(a, b) for a, b in zip(straight0, resumed0))
    assert all(torch.equal(a, b) for a, b in zip(straight1, resumed1))


@pytest.mark.slow
def test_the_ddp_hook_recalibrates_the_decisions_its_rebuilt_buckets_execute_on_gloo():
    """recalibrate_every=2 in the DDP hook: DDP's rebuilt buckets execute the decisions made
    for its initial buckets at step 1, so those are what is decided again, at steps 3 and 5,
    once a step (several rebuilt buckets call for one decision): no decision of the rebuilt
    buckets' own, the same on both ranks."""
    (made0, probes0, n), (made1, probes1, _) = run_processes(2, cases_auto.ddp_recalibrated, 6, 2)
    assert made0 == made1 and probes0 == probes1
    assert sorted(k for entry in made0 for k in entry["keys"]) == list(range(n))   # one decision per tensor
    assert {entry["step"] for entry in made0} == {5}
    assert probes0 == 3 * 2 * len(made0)   # steps 1, 3, 5: the codec and none, per decision


def test_a_set_of_tensors_executes_per_tensor_the_latest_decision_covering_it():
    """A set whose own decision (step 1) is older than decisions covering its tensors (step 2;
    e.g. a checkpoint whose DDP hook decided for its rebuilt buckets) sends each tensor with
    the codec of the latest: the numbers of the newer sets' own exchanges, bit for bit; a set
    with a tensor no decision covers gets its own decision; one whose tensors earlier
    decisions cover, none (it executes theirs)."""
    big, mid, small = (64, 32), (8, 64), (64,)   # keys 0, 2, 1; units of 1 KiB: one tensor each

    def key(*pairs):   # (shape, key) in launch order (descending key)
        return tuple((shape, torch.float32) for shape, _ in pairs), tuple(k for _, k in pairs)

    def decision(choices, step):
        return calibration.Decision(tuple(choices), Link(1e7, 0.0), {}, step, False)

    def worker(comm):
        psync = PSync(comm, "auto:1bit", bucket_bytes=cases_auto.BUCKET_BYTES, link="100mbit",
                      allow_twophase=False)   # as the DDP hook's: a superseded set travels on the exact routes
        everything = key((mid, 2), (small, 1), (big, 0))
        psync.decisions[everything] = decision(["none"] * 3, 1)
        psync.decisions[key((mid, 2))] = decision(["1bit"], 2)
        psync.decisions[key((small, 1), (big, 0))] = decision(["none", "1bit"], 2)
        g = torch.Generator().manual_seed(comm.rank)
        tensors = [torch.randn(big, generator=g), torch.randn(small, generator=g), torch.randn(mid, generator=g)]
        codecs = [c.spec for c in psync.exchange_plan(tensors, [0, 1, 2], 3)[1].codecs]
        whole = psync(tensors, 3, keys=[0, 1, 2])
        apart = [psync([tensors[2]], 3, keys=[2]), psync(tensors[:2], 3, keys=[0, 1])]
        made = len(psync.decisions)
        psync.exchange_plan([torch.zeros(small), torch.zeros(8)], [1, 5], 3)   # key 5: in no decision
        psync.exchange_plan([torch.zeros(big), torch.zeros(small)], [0, 1], 4)   # covered: nothing to decide
        return codecs, whole, apart, made, list(psync.decisions.values())

    for codecs, whole, apart, made, decisions in simulate(2, worker):
        assert codecs == ["1bit", "none", "1bit"] and made == 3   # launch order: keys 2, 1, 0
        assert len(decisions) == 4 and decisions[-1].step == 3
        pairs = [(whole.aggregate[2], apart[0].aggregate[0]), (whole.residual[2], apart[0].residual[0])]
        pairs += [(whole.aggregate[i], apart[1].aggregate[i]) for i in (0, 1)]
        pairs += [(whole.residual[i], apart[1].residual[i]) for i in (0, 1)]
        assert all(torch.equal(a, b) for a, b in pairs)
        assert not torch.equal(whole.residual[0], torch.zeros(big))   # 1bit's


def test_cli_train_with_auto_and_a_declared_link(tmp_path, capsys):
    import json

    from gradzip.cli import main

    out = tmp_path / "run"
    code = main(["train", "--algo", "efsgd", "--compressor", "auto:1bit", "--link", "1gbit", "--workers", "2",
                 "--backend", "threads", "--epochs", "1", "--model", "mlp:hidden=16", "--out", str(out), "--quiet",
                 "--no-plot", "--batch-size", "64"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["auto"]["exchange 0"].startswith("step 1: ") and "1 Gbit/s" in summary["auto"]["exchange 0"]
    assert summary["auto_link"] == {"exchange 0": [1e9 / 8, planner.DEFAULT_LINK.latency_s]}   # for the projection
    capsys.readouterr()
    for link, message in (("fast", "bad bandwidth 'fast'"), ("-1gbit", "bad bandwidth '-1gbit'")):
        with pytest.raises(SystemExit):
            main(["train", "--compressor", "auto:1bit", f"--link={link}"])
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_the_trials_first_period_does_not_count_the_probes(monkeypatch):
    """The decision's probes run at the first exchange of the trial; its period (the rule's
    first of two) is timed from after them, so a slow probe (here 0.4 s) does not leave the
    rule one usable period against nothing compressed's two."""
    monkeypatch.setattr(calibration, "measure_codec", cases_auto.fixed_costs)
    slow_link = cases_auto.measured_link

    def measure_link(*args, **kwargs):
        time.sleep(0.4)
        return slow_link(*args, **kwargs)

    monkeypatch.setattr(calibration, "measure_link", measure_link)
    seen = []

    def spy(comm, decision, step, seconds):
        seen.append(dict(decision.timed))
        return advance(comm, decision, step, seconds)

    advance = calibration.advance
    monkeypatch.setattr(calibration, "advance", spy)
    simulate(2, lambda comm: cases_auto.train(comm, "efsgd", {"lr": 0.1, "compressor": "auto:1bit"}, steps=6))
    first = [timed[1] for timed in seen if 1 in timed]
    assert first and all(t < 0.3 for t in first), first


def test_a_trial_period_leaves_out_every_decisions_probes_of_its_step(monkeypatch):
    """Two sets of tensors decided in one step (as the DDP hook decides per bucket), 0.3 s of
    work between their exchanges, each probe 0.5 s: the step's period is its
    work (about 0.3 s), not the time after the last decision (which left the work out and
    made the rule look faster than it is) nor with the probes in."""
    def slow(measure):
        def measured(*args, **kwargs):
            time.sleep(0.5)
            return measure(*args, **kwargs)
        return measured

    monkeypatch.setattr(calibration, "measure_codec", slow(cases_auto.fixed_costs))
    monkeypatch.setattr(calibration, "measure_link", slow(cases_auto.measured_link))

    def worker(comm):
        psync = PSync(comm, "auto:1bit", bucket_bytes=cases_auto.BUCKET_BYTES)
        g = torch.Generator().manual_seed(comm.rank)
        first, second = [torch.randn(64, 32, generator=g)], [torch.randn(8, 64, generator=g)]
        for step in range(3):
            psync.start(first, step, keys=[0]).wait()
            time.sleep(0.3)
            psync.start(second, step, keys=[1]).wait()
        assert {d.step for d in psync.decisions.values()} == {0} and len(psync.decisions) == 2
        return psync._step_seconds(0), psync._step_seconds(1)

    for decided, plain in simulate(2, worker):
        assert 0.3 <= decided < 0.75 and 0.3 <= plain < 0.75, (decided, plain)   # a probe: 0.5 s
