"""The exchange starts during backward (issue 14, part 2; optim/overlap.py): gradient hooks
launch the PSync buckets in a fixed order; the numbers are those of the one-call path
(``overlap_backward=False``, the code before overlap) bit for bit."""
from __future__ import annotations

import gc

import pytest
import torch

import cases
import cases_overlap
import gradzip
from gradzip.guards.consistency import InconsistentWorkers
from gradzip.errors import GradzipError
from gradzip.comm.launch import run_processes
from gradzip.guards.nonfinite import NonFiniteGradient

NAMES = sorted(cases_overlap.OVERLAPPED)


def _same(a, b, where):
    cases.assert_bitwise_equal(a, b, where)


def _same_but_bucketing(hooked, off, where):
    """Equal bit for bit, but for ``bytes_sent``: ring costs are rounded per collective, and
    the buckets differ from the one call's (payload bytes stay equal)."""
    _same((hooked[0], _without_wire(hooked[1])), (off[0], _without_wire(off[1])), where)


def _without_wire(state):
    extra = dict(state["gradzip"])
    extra["exchanges"] = [{k: v for k, v in x.items() if k != "bytes_sent"} for x in extra["exchanges"]]
    return {**state, "gradzip": extra}


# -- the hooks start the exchange ----------------------------------------------------------
def test_the_exchange_starts_during_backward_and_step_only_waits():
    def worker(comm):
        model, opt = cases_overlap.model_and_opt(comm, "efsgd-topk", overlap=True)
        before = opt.bytes_sent
        cases_overlap.loss_of(model, 1, comm).backward()
        during = opt.bytes_sent
        opt.step()
        return before, during, opt.bytes_sent
    for before, during, after in gradzip.simulate(2, worker):
        assert before == 0 and during > 0 and after == during  # every bucket went out in backward


def test_off_starts_nothing_in_backward():
    def worker(comm):
        model, opt = cases_overlap.model_and_opt(comm, "ssgd", overlap=False)
        cases_overlap.loss_of(model, 1, comm).backward()
        during = opt.bytes_sent
        opt.step()
        return during, opt.bytes_sent
    for during, after in gradzip.simulate(2, worker):
        assert during == 0 and after > 0


def test_which_methods_overlap_is_a_class_attribute():
    overlapped = {n for n, cls in gradzip.optim.METHODS.items() if cls.overlaps_backward}
    assert overlapped == {"ssgd", "efsgd", "bitsgd", "csea", "dgc", "cser", "lars", "lamb", "adamw"}
    comm = gradzip.comm.make_group(1)[0]
    for opt in (gradzip.optim.CSER(cases.tiny_model().parameters(), lr=0.1, comm=comm, c2=None),
                gradzip.optim.CSERPL(cases.tiny_model().parameters(), lr=0.1, comm=comm),
                gradzip.optim.DGC(cases.tiny_model().parameters(), lr=0.1, comm=comm, clip_norm=1.0)):
        assert not opt.overlap_backward and not opt._handles  # step() does everything


def test_buckets_are_reverse_order_and_bounded():
    model, opt = cases_overlap.model_and_opt(gradzip.comm.make_group(1)[0], "ssgd", overlap=True)
    cases_overlap.loss_of(model, 1, gradzip.comm.make_group(1)[0]).backward()
    w1, b1, w2, b2 = model.parameters()
    plan = opt._plan
    assert [[p.shape for p in b] for b in plan.buckets] == [[b2.shape, w2.shape, b1.shape], [w1.shape]]
    opt.step()


# -- bit for bit: hooked = set by hand (same buckets) = one call (off) ------------------------
@pytest.mark.parametrize("name", NAMES)
def test_hooked_by_hand_and_off_are_bitwise_equal_on_threads(name):
    for rank_out in gradzip.simulate(3, lambda c: cases_overlap.every_variant(c, names=(name,))):
        runs = rank_out[name]
        _same(runs["hooked"], runs["by_hand"], f"{name} hooked vs by hand")
        _same_but_bucketing(runs["hooked"], runs["off"], f"{name} hooked vs off")


@pytest.mark.parametrize("how", ["none_grads", "zero_grads", "closure", "scheduler", "clip", "create_graph"])
def test_loop_variants_equal_the_one_call_path(how):
    off = {"none_grads": "off", "zero_grads": "off", "closure": "off", "scheduler": "scheduler_off",
           "clip": "clip_off", "create_graph": "create_graph_off"}[how]
    for name in ("ssgd", "efsgd-topk", "bitsgd", "csea", "dgc", "cser"):
        for a, b in gradzip.simulate(2, lambda c: (cases_overlap.train(c, name, how),
                                                   cases_overlap.train(c, name, off))):
            if how == "clip":  # the exchange started from the unclipped gradient ran again: counted
                wire = [x["payload_bytes"] for x in a[1]["gradzip"]["exchanges"]]
                once = [x["payload_bytes"] for x in b[1]["gradzip"]["exchanges"]]
                if name in ("ssgd", "efsgd-topk", "bitsgd", "csea"):  # one exchange, all of it twice
                    assert wire == [2 * x for x in once]
                assert sum(wire) > sum(once)
                a, b = (a[0], _without_bytes(a[1])), (b[0], _without_bytes(b[1]))
            _same_but_bucketing(a, b, f"{name} {how}")


@pytest.mark.parametrize("edit", sorted(cases_overlap.EDITS))
def test_gradient_edits_no_version_counter_sees_equal_the_one_call_path(edit):
    """Issue 35 item 1: ``p.grad.data.mul_(c)``, ``.clamp_()``, ``.zero_()``, ``p.grad.data =
    ...`` or a numpy view's edit between backward and ``step()`` went unnoticed (the unedited
    gradient was sent); the fingerprint taken in the hook sees them: every worker exchanges
    again from the edited gradients, the bits of ``overlap_backward=False``."""
    for name in ("ssgd", "efsgd-topk", "bitsgd", "csea", "dgc", "cser"):
        for a, b in gradzip.simulate(2, lambda c: (cases_overlap.train(c, name, edit),
                                                   cases_overlap.train(c, name, edit + "_off"))):
            assert sum(x["payload_bytes"] for x in a[1]["gradzip"]["exchanges"]) > \
                sum(x["payload_bytes"] for x in b[1]["gradzip"]["exchanges"]), f"{name} {edit}: not exchanged again"
            _same_but_bucketing((a[0], _without_bytes(a[1])), (b[0], _without_bytes(b[1])), f"{name} {edit}")


@pytest.mark.parametrize("overlap", [True, False])
def test_a_gradient_zeroed_through_data_leaves_the_parameter_unchanged(overlap):
    """The issue's reproduction: S-SGD on one parameter, backward, ``p.grad.data.zero_()``."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = gradzip.optim.SSGD([p], lr=0.1, overlap_backward=overlap)
    (p * 2).sum().backward()
    p.grad.data.zero_()
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3))


def _without_bytes(state):
    return {**state, "gradzip": {**state["gradzip"], "exchanges": []}}


def test_gradient_accumulation_context_equals_plain_accumulation_without_hooks():
    for name in ("ssgd", "efsgd-topk", "bitsgd", "csea", "dgc", "cser"):
        for a, b in gradzip.simulate(2, lambda c: (cases_overlap.train(c, name, "accumulate"),
                                                   cases_overlap.train(c, name, "accumulate_off"))):
            _same(a, b, f"{name} accumulate")


def test_a_second_backward_without_the_context_is_refused():
    with pytest.raises(GradzipError, match=r"second gradient before step\(\).*opt.accumulate\(\)"):
        cases_overlap.twice_without_context(gradzip.comm.make_group(1)[0])


def test_unused_parameters_equal_the_one_call_path():
    import cases_optim

    def runs(comm):
        return [cases_optim.train_partial(comm, m, dict(o, overlap_backward=ov), cases_optim.AB)
                for m, o in (("ssgd", {"momentum": 0.9}), ("efsgd", {"compressor": "topk:ratio=0.3"}),
                             ("bitsgd", {"threshold": 0.05}), ("csea", {"compressor": "topk:ratio=0.3"}),
                             ("dgc", cases.SHORT_RUNS["dgc"]), ("cser", cases.SHORT_RUNS["cser"]))
                for ov in (True, False)]
    for out in gradzip.simulate(3, runs):
        for hooked, off in zip(out[::2], out[1::2]):
            _same(hooked, off, "unused parameters")


@pytest.mark.parametrize("name", ["ssgd", "efsgd-topk", "bitsgd", "csea", "dgc", "cser"])
def test_resume_mid_run_equals_the_uninterrupted_run(name):
    for a, b in gradzip.simulate(2, lambda c: (cases_overlap.resumed(c, name),
                                               cases_overlap.train(c, name, "hooked"))):
        _same(a, b, f"{name} resumed")


# -- guards ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ssgd", "efsgd-topk", "bitsgd", "csea", "dgc", "cser"])
def test_nan_seen_by_the_hooks_skip_is_the_step_left_out(name):
    for (p_s, s_s, n_s), (p_d, s_d, n_d) in gradzip.simulate(
            3, lambda c: (cases_overlap.bad_in_backward(c, name, "skip"),
                          cases_overlap.bad_in_backward(c, name, "skip", drop=True))):
        assert (n_s, n_d) == (1, 0)
        s_s["gradzip"].pop("skipped_steps"), s_d["gradzip"].pop("skipped_steps")
        _same((p_s, s_s), (p_d, s_d), f"{name} skip")


def test_nan_seen_by_the_hooks_raise_names_the_rank():
    with pytest.raises(NonFiniteGradient, match=r"step 3: non-finite gradient .* on rank 1, parameter #0"):
        gradzip.simulate(2, lambda c: cases_overlap.bad_in_backward(c, "efsgd-topk", "raise"))


def test_raise_with_hooks_leaves_the_state_as_before_the_backward():
    comm = gradzip.comm.make_group(1)[0]
    model, opt = cases_overlap.model_and_opt(comm, "ssgd", overlap=True)  # momentum: state the hooks change
    for t in (1, 2):
        opt.zero_grad()
        if t == 2:
            before = ([p.detach().clone() for p in model.parameters()], copy_state(opt))
        loss = cases_overlap.loss_of(model, t, comm)
        (loss * (float("nan") if t == 2 else 1.0)).backward()
        if t == 2:
            with pytest.raises(NonFiniteGradient):
                opt.step()
            after = ([p.detach().clone() for p in model.parameters()], copy_state(opt))
            after[1]["gradzip"].pop("exchanges"), before[1]["gradzip"].pop("exchanges")
            _same(before, after, "raise")
        else:
            opt.step()


def copy_state(opt):
    import copy
    return copy.deepcopy(opt.state_dict())


def test_settings_are_compared_before_the_first_hook_launch():
    with pytest.raises(InconsistentWorkers, match="lr"):
        gradzip.simulate(2, cases_overlap.different_lr)


# -- hooks' lifetime -----------------------------------------------------------------------------
def test_hooks_go_with_the_optimizer_and_no_grad_fires_none():
    comm = gradzip.comm.make_group(1)[0]
    model, opt = cases_overlap.model_and_opt(comm, "ssgd", overlap=True)
    w = next(model.parameters())
    assert len(w._post_accumulate_grad_hooks or {}) == 1
    with torch.no_grad():
        model(torch.zeros(2, 4))
    assert opt._run is None
    del opt
    gc.collect()
    assert not w._post_accumulate_grad_hooks
    cases_overlap.loss_of(model, 1, comm).backward()  # no optimizer left: nothing fires
    assert w.grad is not None


def test_overlap_backward_must_be_a_bool():
    with pytest.raises(GradzipError, match="overlap_backward must be True or False"):
        gradzip.optim.SSGD(cases.tiny_model().parameters(), lr=0.1, overlap_backward="yes")


# -- real process groups -----------------------------------------------------------------------
@pytest.mark.slow
def test_two_gloo_workers_hooked_equals_off_bitwise():
    # two summands: a float allreduce is exact whatever the buckets, so hooked = one call
    for rank_out in run_processes(2, cases_overlap.every_variant):
        for name, runs in rank_out.items():
            _same(runs["hooked"], runs["by_hand"], f"{name} hooked vs by hand")
            _same_but_bucketing(runs["hooked"], runs["off"], f"{name} hooked vs off")


@pytest.mark.slow
def test_three_gloo_workers_hooked_equals_by_hand_bitwise():
    # three summands: gloo's ring association depends on the buffer, so the comparison is
    # between the two paths that share the buckets; the one-call path agrees to ~1 ulp
    outs = run_processes(3, cases_overlap.every_variant)
    for rank_out in outs:
        for name, runs in rank_out.items():
            _same(runs["hooked"], runs["by_hand"], f"{name} hooked vs by hand")
            if name in ("ssgd", "ssgd-nesterov"):  # (a codec may amplify an ulp: a top-k tie, a vote)
                for a, b in zip(runs["hooked"][0], runs["off"][0]):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for other in outs[1:]:
        for name in outs[0]:
            if gradzip.optim.METHODS[cases_overlap.OVERLAPPED[name][0]].replicas_differ:  # error reset
                continue
            _same(outs[0][name]["hooked"][0], other[name]["hooked"][0], f"{name} replicas")


@pytest.mark.parametrize("unused", [False, True], ids=["launched in backward", "waiting for step"])
@pytest.mark.parametrize("edit", sorted(cases_overlap.EDITS))
def test_edits_of_large_gradients_digested_in_the_bucket_copy_are_seen(edit, unused):
    """Gradients larger than a snapshot copies are digested when the exchange reads them: in
    the bucket's copy (S-SGD, EF-SGD sending uncompressed), or at the end of backward where
    their bucket waits for ``step()``; an edit between backward and ``step()`` is seen either
    way: the bits of ``overlap_backward=False``, the traffic twice."""
    for name in cases_overlap.LARGE:
        for a, b, plain in gradzip.simulate(2, lambda c: (cases_overlap.train_large(c, name, edit, True, unused),
                                                          cases_overlap.train_large(c, name, edit, False, unused),
                                                          cases_overlap.train_large(c, name, None, True, unused))):
            sent = [sum(x["payload_bytes"] for x in r[1]["gradzip"]["exchanges"]) for r in (a, b, plain)]
            assert sent[0] == 2 * sent[1] == 2 * sent[2], f"{name} {edit}: not exchanged again ({sent})"
            _same_but_bucketing((a[0], _without_bytes(a[1])), (b[0], _without_bytes(b[1])), f"{name} {edit}")


def test_the_bucket_copy_makes_the_digests_of_large_gradients_sent_as_they_are(monkeypatch):
    """S-SGD's hooks read a large gradient once in backward, in the bucket's copy that digests
    it; a copy sent (top-k's input) gets its fingerprint in the hook; ``step()`` fingerprints
    each large gradient once."""
    from gradzip.optim.core import fingerprint

    calls = []
    real = fingerprint.fingerprint
    monkeypatch.setattr(fingerprint, "fingerprint", lambda t: calls.append(t.numel()) or real(t))
    comm = gradzip.comm.make_group(1)[0]
    for name in ("ssgd", "efsgd-none", "efsgd-topk"):
        method, options = cases_overlap.LARGE[name]
        model = cases_overlap.large_model(False)
        opt = gradzip.optim.METHODS[method](model.parameters(), comm=comm, **options)
        big = sorted(p.numel() for p in model.parameters() if p.numel() > fingerprint.SMALL)
        x, y = torch.randn(4, 12), torch.randn(4, 20)
        for step in range(2):   # EF-SGD with none: the first step's input is p = η g (no error yet)
            calls.clear()
            torch.nn.functional.mse_loss(model(x), y).backward()
            in_backward = sorted(calls)
            calls.clear()
            opt.step()
            assert sorted(calls) == big, (name, step)
        assert in_backward == ([] if name != "efsgd-topk" else big), name
