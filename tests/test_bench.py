"""gradzip.bench: the timeline model's arithmetic, byte accounting, the namespace emulator."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import gradzip
from gradzip import optim
from gradzip.bench import costs, emulated, netns, profiling, tables, timeline, units
from gradzip.bench.shapes import model_shapes, resnet50_shapes
from gradzip.cli import main
from gradzip.comm import allgather_wire_bytes, allreduce_wire_bytes
from gradzip.compressors import build
from gradzip.errors import GradzipError
from gradzip.train import models

ROOT_REASON = "network namespaces and tc need root (and the ip / tc programs)"


def _can_emulate() -> bool:
    try:
        netns.check_available()
    except GradzipError as exc:
        print(f"skipping emulator tests: {exc}")
        return False
    return True


needs_root = pytest.mark.skipif(not _can_emulate(), reason=ROOT_REASON)

# ----------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize("n", [2, 3, 4, 8, 256])
def test_ring_costs_match_the_formulas(n):
    S, B, alpha = 12_000_000, 1.25e8, 1e-4   # 12 MB over 1 Gbit/s links
    assert allreduce_wire_bytes(S, n) == 2 * (n - 1) * S // n
    assert allgather_wire_bytes(S, n) == (n - 1) * S
    assert costs.allreduce_time(S, n, B) == pytest.approx(2 * (n - 1) / n * S / B, rel=1e-12)
    assert costs.allreduce_time(S, n, B, alpha) == pytest.approx(2 * (n - 1) * alpha + 2 * (n - 1) / n * S / B, rel=1e-12)
    assert costs.allgather_time(S, n, B, alpha) == pytest.approx((n - 1) * alpha + (n - 1) * S / B, rel=1e-12)
    # the measurement: 100 MB among 2 workers at 1 Gbit/s is predicted at 800 ms
    assert costs.allreduce_time(100_000_000, 2, 1e9 / 8) == pytest.approx(0.8)
    assert costs.allreduce_time(S, 1, B, alpha) == 0 and costs.allgather_time(S, 1, B, alpha) == 0


def test_timeline_sums_without_overlap_and_takes_the_max_with_it():
    compute, compress, comm, update = 0.5, 0.1, 0.3, 0.05
    seq = timeline.timeline(compute, compress, comm, update, overlaps=False)
    ovl = timeline.timeline(compute, compress, comm, update, overlaps=True)
    assert seq.period == pytest.approx(compute + compress + comm + update)
    assert ovl.period == pytest.approx(max(compute, compress + comm) + update)   # 0.55, not 0.95
    slow_net = timeline.timeline(0.2, 0.1, 0.6, 0.05, overlaps=True)
    assert slow_net.period == pytest.approx(0.1 + 0.6 + 0.05)                     # the exchange dominates
    # spans: sequential phases never overlap; the overlapped exchange runs beside compute
    ends = [s[3] for s in seq.spans]
    assert [s[2] for s in seq.spans[1:]] == ends[:-1]
    tracks = {s[0]: s[1] for s in ovl.spans}
    assert tracks["compute"] == "main" and tracks["communicate"] == "exchange"


class _OverlappingSSGD(optim.SSGD):
    overlaps_exchange = True


def test_model_reads_overlap_from_the_method_class(monkeypatch):
    monkeypatch.setitem(optim.METHODS, "overlapping", _OverlappingSSGD)
    shapes = [(64, 32), (64,)]
    plain = profiling.profile_method("ssgd", {}, shapes, 4, steps=1)
    over = profiling.profile_method("overlapping", {}, shapes, 4, steps=1)
    assert not plain.overlaps and over.overlaps
    assert over.calls == plain.calls
    bw = 1e3  # bytes/s: the network dominates
    p, o = timeline.predict(plain, 1.0, bw, 0.0), timeline.predict(over, 1.0, bw, 0.0)
    comm = p["communicate"]
    assert p["iteration"] == pytest.approx(1.0 + p["compress"] + comm + p["update"])
    assert o["iteration"] == pytest.approx(max(1.0, o["compress"] + comm) + o["update"])


def test_resnet50_shapes_have_resnet50s_parameter_count():
    assert sum(math.prod(s) for s in resnet50_shapes()) == 25_557_032


# ----------------------------------------------------------------------------- bytes


@pytest.mark.parametrize("algo, codec, n", [("efsgd", "topk:ratio=0.05", 3), ("ssgd", None, 4),
                                            ("bitsgd", None, 2), ("bitsgd", None, 8)])
def test_bytes_per_step_are_codec_nbytes_plus_the_collectives_overhead(algo, codec, n):
    """Measured bytes (a real step on n simulated workers) = the model's recorded bytes =
    the codec's packet.nbytes summed over tensors, times the ring's factor."""
    shapes = [(40, 20), (40,), (12, 8, 3, 3), (12,)]
    options = {"compressor": codec} if codec else {}
    spec = codec or ("2bit" if algo == "bitsgd" else "none")
    c = build(spec)
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    packets = [c.compress(g, 0) for g in grads]
    nbytes = sum(p.nbytes for p in packets)
    if c.sum_dtype(n) is not None and allreduce_wire_bytes(
            c.summand(packets[0], n).numel() * c.summand(packets[0], n).element_size(), n) <= allgather_wire_bytes(packets[0].nbytes, n):
        summand = sum(c.summand(p, n).numel() * c.summand(p, n).element_size() for p in packets)
        expected = allreduce_wire_bytes(summand, n)          # one bucket: all tensors are small
    else:
        expected = allgather_wire_bytes(nbytes, n)

    def worker(comm):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        opt = optim.METHODS[algo](params, lr=0.1, comm=comm, **options)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        return opt.bytes_sent

    measured = gradzip.simulate(n, worker)
    assert measured == [expected] * n
    profile = profiling.profile_method(algo, options, shapes, n, steps=1)
    assert profile.wire_bytes_per_step == expected


def test_new_models_have_their_sizes():
    r18 = models.build("resnet18", (3, 32, 32), 10)
    assert sum(p.numel() for p in r18.parameters()) == 11_173_962
    assert r18(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    for shape in [(3, 32, 32), (784,)]:
        m = models.build("mlp10m", shape, 10)
        assert abs(sum(p.numel() for p in m.parameters()) / 10e6 - 1) < 0.05
    small = models.build("mlp10m:params=100000", (784,), 10)
    assert sum(p.numel() for p in small.parameters()) < 200_000
    with pytest.raises(GradzipError, match="norm"):
        models.build("resnet18:norm=ln", (3, 32, 32), 10)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("text", ["foo", "-1gbit", "0", ""])
def test_bad_rates_are_refused(text):
    with pytest.raises(GradzipError, match="bandwidth"):
        units.parse_rate(text)


def test_rates_parse():
    assert units.parse_rate("100mbit") == 1e8 and units.parse_rate("1gbit") == 1e9
    assert units.parse_rate("10g") == 1e10 and units.parse_rate("unshaped") is None


@pytest.mark.parametrize("args, message", [
    (["bench", "model", "--compute-ms", "-1", "--no-projection"], "--compute-ms must be"),
    (["bench", "model", "--bucket-mb", "0", "--no-projection"], "--bucket-mb must be"),
    (["bench", "model", "--measured", "/nonexistent.json", "--no-projection"], "bench net"),
    (["bench", "net", "--bandwidth", "fast"], "bad bandwidth"),
    (["bench", "net", "--workers", "0"], "--workers must be"),
    (["bench", "net", "--algos", "nope"], "unknown method"),
    (["bench", "net", "--transports", "auto,ring"], "unknown transport 'ring' in --transports"),
    (["bench", "net", "--workers", "2", "--write"], "python -m benchmarks.network net"),
    (["bench", "model", "--no-projection", "--write"], "python -m benchmarks.network model"),
    (["bench", "model", "--no-projection", "--plots", "docs/bench"], "python -m benchmarks.network model"),
])
def test_bench_bad_input_is_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_run_labels_and_method_lists_come_from_train_config():
    """One ``algo@codec`` label and one method-list parser for the CLI and the benchmarks."""
    from gradzip.train.config import method_label, parse_algos

    algos = parse_algos("ssgd,efsgd@topk:ratio=0.1,unbiased=true")
    assert [method_label(a, c) for a, c in algos] == ["ssgd", "efsgd@topk:ratio=0.1,unbiased=true"]
    bench = emulated.NetBench(workers=[2], bandwidths=[None], latencies=[0.0], algos=algos)
    assert [c["label"] for c in bench.configs(2)] == ["ssgd", "efsgd@topk:ratio=0.1,unbiased=true"]
    with pytest.raises(GradzipError, match="unknown method 'nope'; valid methods"):
        profiling.profile_method("nope", {}, [(4,)], 2)


def test_the_package_reads_no_file_from_benchmarks_or_docs():
    """The installed package has no benchmarks/ or docs/ next to it: nothing in src/gradzip
    may load from there (the docs writer and the plots live in benchmarks/)."""
    src = os.path.dirname(gradzip.__file__)
    for folder, _, files in os.walk(src):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(folder, name)).read()
                assert "docs_section" not in text and "parents[3]" not in text, name
                assert "import matplotlib" not in text or name == "report.py", name  # train/report.py plots runs


def test_one_section_writer_replaces_appends_and_marks(tmp_path):
    from benchmarks.docs_section import replace_marked, replace_section

    doc = tmp_path / "b.md"
    replace_section("A", "one", doc=doc)
    replace_section("B", "two", doc=doc)
    replace_section("A", "three", doc=doc)
    assert doc.read_text() == "# Benchmarks\n\n## A\n\nthree\n\n## B\n\ntwo\n"
    replace_marked("<!-- b -->", "<!-- e -->", "body\n", doc)
    replace_marked("<!-- b -->", "<!-- e -->", "new\n", doc)
    assert doc.read_text().endswith("two\n\n<!-- b -->\nnew\n<!-- e -->\n")


def test_topology_refuses_bad_sizes():
    with pytest.raises(GradzipError, match=">= 1 worker"):
        netns.Topology(0)
    with pytest.raises(GradzipError, match="bandwidth"):
        netns.Topology(2, -5.0)


# ----------------------------------------------------------------------------- emulator


def _ours(prefix):
    return [n for n in netns.list_namespaces() if n.startswith(prefix)]


@needs_root
def test_topology_builds_shaped_links_and_leaves_nothing_behind():
    with netns.Topology(3, 1e9) as topo:
        names = _ours(topo.prefix)
        assert sorted(names) == sorted([topo.switch] + [topo.worker(r) for r in range(3)])
        for r in range(3):
            addr = subprocess.run(["ip", "-n", topo.worker(r), "addr", "show", netns.IFNAME],
                                  capture_output=True, text=True).stdout
            assert f"{netns.address(r)}/15" in addr
            for ns, dev in ((topo.worker(r), netns.IFNAME), (topo.switch, f"p{r}")):
                qd = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
                assert "tbf" in qd and "rate 1Gbit" in qd, qd
        assert not [l for l in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout.splitlines()
                    if f"{netns.IFNAME}@" in l]  # nothing in our own namespace
    assert _ours(topo.prefix) == [] and topo.leftovers() == []


@needs_root
def test_topology_cleans_up_after_an_error_and_a_bad_latency():
    with pytest.raises(RuntimeError):
        with netns.Topology(2, 1e8) as topo:
            raise RuntimeError("crash inside")
    assert _ours(topo.prefix) == []
    topo = netns.Topology(2, 1e8, latency_s=0.002)
    try:
        with topo:
            pass  # a kernel with sch_netem
    except GradzipError as exc:
        assert "netem" in str(exc)
    assert _ours(topo.prefix) == []


# gradzip.bench.netns without gradzip/__init__ (which imports torch): starts in milliseconds
_HOLD = f"""
import sys, time, types
pkg = types.ModuleType("gradzip"); pkg.__path__ = [{str(os.path.dirname(gradzip.__file__))!r}]
sys.modules["gradzip"] = pkg
from gradzip.bench import netns
with netns.Topology(2, 1e9) as topo:
    print(topo.prefix, flush=True)
    time.sleep(600)
"""


@needs_root
def test_topology_cleans_up_on_ctrl_c_and_sigterm_and_after_sigkill():
    """Ctrl-C and SIGTERM: the run removes its namespaces itself. SIGKILL leaves them, and
    the next run's remove_stale() deletes them (their creator's pid is gone)."""
    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
    procs = [subprocess.Popen([sys.executable, "-c", _HOLD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in sigs]
    prefixes = [p.stdout.readline().strip() for p in procs]
    for proc, prefix, sig in zip(procs, prefixes, sigs):
        assert prefix.startswith(netns.PREFIX) and len(_ours(prefix)) == 3, proc.stderr.read()
        proc.send_signal(sig)
    for proc in procs:
        proc.wait(timeout=120)  # a hang guard: the children sleep 600 s unless the signal stops them
    assert _ours(prefixes[0]) == [] and _ours(prefixes[1]) == []
    assert len(_ours(prefixes[2])) == 3   # SIGKILL: no chance to clean up
    removed = netns.remove_stale()
    assert set(_ours(prefixes[2])) == set() and len([r for r in removed if r.startswith(prefixes[2])]) == 3


@needs_root
@pytest.mark.slow
def test_bench_net_runs_every_method_once_per_transport():
    """``--transports``: one run per (method, transport), labelled ``METHOD[TRANSPORT]``
    unless auto, with the transport in the run's configuration."""
    bench = emulated.NetBench(workers=[2], bandwidths=[None], latencies=[0.0], algos=[("bitsgd", None)],
                              transports=["auto", "allgather", "twophase"])
    cfgs = bench.configs(2)
    assert [c["label"] for c in cfgs] == ["bitsgd", "bitsgd[allgather]", "bitsgd[twophase]"]
    assert [c["transport"] for c in cfgs] == ["auto", "allgather", "twophase"]


def _span(name, ts, dur, tid="MainThread", **args):
    return {"name": name, "ph": "X", "ts": ts, "dur": dur, "tid": tid, **({"args": args} if args else {})}


def test_step_breakdown_splits_the_node_links_from_the_uplink():
    """A hierarchical exchange's waits on the node's links (``scope="node"`` spans) are
    network: their bytes are counted apart (bench net's second MB column) and a
    reduce-scatter waited for inside the compute span (from a gradient hook) is not local
    work."""
    events = [_span("compute", 0, 100), _span("communicate", 60, 30, kind="reduce_scatter", bytes=800_000, scope="node"),
              _span("step", 100, 50), _span("communicate", 110, 20, kind="allgather", bytes=120),
              _span("communicate", 130, 10, kind="allgather", bytes=800_000, scope="node"),
              _span("compute", 150, 100), _span("step", 250, 10)]
    first = emulated.step_breakdown(events, warmup=0)[0]
    assert first["intra_bytes"] == 1_600_000 and first["intra_in_compute"] == pytest.approx(30e-6)
    rank = {"runs": [{"summary": {"algo": "bitsgd", "method": "bitsgd", "options": {}, "model": "m", "parameters": 1,
                                  "steps": 2, "bytes_sent_per_worker": 2 * 5_420_000},
                      "steps": emulated.step_breakdown(events, warmup=0), "transport": "auto"}]}
    run = emulated.merge([rank, rank], 2, 1e8, 0.0, 0)["runs"][0]
    assert run["intra_bytes_per_step"] == 800_000   # the second step has none (mean over steps)
    # step 1: compute 100 less the 30 waited on the node + update 50 - 30 waits; step 2: 100 + 10
    assert run["critical_local_s"] == pytest.approx(((100 - 30 + 20) + (100 + 10)) / 2 * 1e-6)
    table = tables.time_table([{"workers": 2, "bandwidth_bps": 1e8, "workers_per_node": 2, "runs": [run]}])
    assert "| 2 | 100 Mbit/s, 2 per node | `bitsgd` |" in table and "| 4.62 | 0.80 |" in table


def test_validate_prices_twophase_and_hierarchical_runs():
    """Validation profiles a run with its own transport (two-phase: all-to-alls) and prices a
    hierarchical run (it skipped them) with k workers per node behind the uplink: the bytes
    on the uplink and inside the node both as the runs count them."""
    d = 64 * 16 + 64 + 10 * 64 + 10
    shapes = model_shapes("mlp:hidden=64", (16,))
    two = profiling.profile_method("bitsgd", {"transport": "twophase"}, shapes, 4, steps=1)
    run = {"algo": "bitsgd[twophase]", "method": "bitsgd", "options": {}, "transport": "twophase",
           "iteration_s": 0.1, "critical_local_s": 0.05, "communicate_s": 0.05, "hidden_compress_s": 0.0,
           "compress_s": 0.0, "update_s": 0.0, "loop_s": 0.0, "bytes_per_step": two.wire_bytes_per_step}
    hier = dict(run, algo="bitsgd", transport="auto", bytes_per_step=2000 + 4 * d, intra_bytes_per_step=4 * d)
    measured = {"settings": {"model": "mlp:hidden=64", "shape": "16"},
                "records": [{"workers": 4, "bandwidth_bps": 1e8, "latency_s": 0.0, "runs": [run]},
                            {"workers": 4, "workers_per_node": 2, "bandwidth_bps": 1e8, "latency_s": 0.0,
                             "runs": [hier]}]}
    flat, tiered = timeline.validate(measured, 1e-4, host_Bps=1e9)
    assert flat["bytes_model"] == flat["bytes_measured"] == two.wire_bytes_per_step
    assert flat["transport"] == "twophase" and flat["workers_per_node"] == 1
    assert tiered["workers_per_node"] == 2 and tiered["intra_bytes_model"] == tiered["intra_bytes_measured"] == 4 * d
    assert tiered["bytes_measured"] == 2000 and 0 < tiered["bytes_model"] < two.wire_bytes_per_step
    assert tiered["predicted_s"] == pytest.approx(0.05 + tiered["communicate_model_s"])


def test_validate_uses_the_checked_link_rate_and_an_overlapping_methods_max_per_step():
    """The link rate is the one the topology's shaping check sustained (below the shaped
    rate when n processes contend for the CPUs); CD-SGD's period is the mean over one of
    its periods of max(local, hidden + that step's exchange): its full-precision step does
    not hide behind compute, which max(local, hidden + mean exchange) pretended."""
    run = {"algo": "cdsgd", "method": "cdsgd", "options": {}, "iteration_s": 0.1, "critical_local_s": 0.001,
           "communicate_s": 0.05, "hidden_compress_s": 0.0001, "bytes_per_step": 0.0}
    check = {"counted_wire_bytes": 1_000_000, "measured_s": 0.2}   # 5 MB/s sustained on 12.5 MB/s links
    measured = {"settings": {"model": "mlp:hidden=64", "shape": "16"},
                "records": [{"workers": 2, "bandwidth_bps": 1e8, "latency_s": 0.0, "check": check, "runs": [run]}]}
    row = timeline.validate(measured, 1e-4)[0]
    nominal = timeline.validate(measured, 1e-4, calibrate=False)[0]
    assert row["model_Bps"] == 5e6 and nominal["model_Bps"] == 1.25e7
    prof = profiling.profile_method("cdsgd", {}, model_shapes("mlp:hidden=64", (16,)), 2, steps=5, warmup=0)
    per_step = [sum(costs.collective_time(k, b, 2, 5e6, 1e-4) for k, b in step) for step in prof.calls]
    assert max(per_step) > 0.0011 > min(per_step)   # the full-precision step does not hide, the others do
    assert row["predicted_s"] == pytest.approx(sum(max(0.001, 0.0001 + c) for c in per_step) / 5)
    assert row["predicted_s"] > max(0.001, 0.0001 + sum(per_step) / 5)


def test_bench_net_runs_gloo_in_namespaces_and_counts_bytes(tmp_path):
    """Two real gloo workers in their namespaces at 1 Gbit/s: the shaping check's
    interface bytes are the counted ring bytes plus a few % of headers, and the training
    steps' bytes equal the model's."""
    bench = emulated.NetBench(workers=[2], bandwidths=[1e9], latencies=[0.0],
                         algos=[("efsgd", "topk:ratio=0.1")], model="mlp:hidden=64", shape="64",
                         batch_size=4, steps=2, warmup=1, check_mb=4, check_repeats=1, out=str(tmp_path))
    result = bench.run(log=lambda *a, **k: None)
    record = result["records"][0]
    check = record["check"]
    assert check["counted_wire_bytes"] <= check["interface_bytes"] <= 1.1 * check["counted_wire_bytes"]
    run = record["runs"][0]
    assert run["steps_measured"] == 2 and run["iteration_s"] > 0
    shapes = model_shapes("mlp:hidden=64", (64,))
    profile = profiling.profile_method("efsgd", {"compressor": "topk:ratio=0.1"}, shapes, 2, steps=1)
    assert run["bytes_per_step"] == profile.wire_bytes_per_step
    assert json.loads((tmp_path / "results.json").read_text())["records"][0]["workers"] == 2
    assert not [n for n in netns.list_namespaces() if n.startswith(f"{netns.PREFIX}{os.getpid()}x")]


# ----------------------------------------------------------------------------- shutdown (issue 12, item 18)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_worker_leaves_without_interpreter_finalisation(tmp_path):
    """An emulated-network worker writes its results and leaves with os._exit: torch's C++
    threads can abort the interpreter's finalisation ("terminate called without an active
    exception", SIGABRT) after a finished run, failing the benchmark. An atexit hook that
    never runs shows that finalisation was skipped; the results are written and the code is 0."""
    spec = {"threads": 1, "timeout_s": 60, "check_bytes": 0, "check_repeats": 1, "warmup": 0,
            "configs": [], "out_dir": str(tmp_path)}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               CUDA_VISIBLE_DEVICES="")
    code = ("import atexit; atexit.register(lambda: print('FINALISED', flush=True))\n"
            f"from gradzip.bench.emulated import worker_main; worker_main({str(tmp_path / 'spec.json')!r}, 0)")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "FINALISED" not in proc.stdout, "the worker ran the interpreter's finalisation"
    assert json.loads((tmp_path / "rank0.json").read_text())["world_size"] == 1


@needs_root
def test_topology_cleans_up_on_sigint_when_started_with_sigint_ignored():
    """A job started in the background by a non-interactive shell (or under nohup) inherits
    SIGINT as *ignored*; the topology still removes its namespaces on SIGINT (it traps
    SIGINT itself while it exists)."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        prefix = proc.stdout.readline().strip()
        assert prefix.startswith(netns.PREFIX) and len(_ours(prefix)) == 3, proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)  # a hang guard: the child sleeps 600 s unless the signal stops it
        assert _ours(prefix) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        netns.remove_stale()


def test_remove_stale_deletes_namespaces_of_zombie_owners(monkeypatch):
    """A run killed but not yet reaped (a zombie) owns stale namespaces too: remove_stale()
    deletes them (it shares comm.liveness.process_gone); a live owner's are kept."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 120   # a hang guard: wait for the child to exit
        while not os.path.exists(f"/proc/{child.pid}/stat") or \
                open(f"/proc/{child.pid}/stat").read().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child never became a zombie"
            time.sleep(0.05)
        zombie, live = f"{netns.PREFIX}{child.pid}xabc", f"{netns.PREFIX}{os.getpid()}xdef"
        deleted = []
        monkeypatch.setattr(netns, "list_namespaces", lambda: [zombie, live])
        monkeypatch.setattr(netns.subprocess, "run", lambda cmd, **kw: deleted.append(cmd))
        assert netns.remove_stale() == [zombie]
        assert deleted == [["ip", "netns", "delete", zombie]]
    finally:
        child.wait()


@pytest.mark.parametrize("algo", ["cdsgd", "odsgd", "ssgd"])
def test_profile_above_the_timing_cap_sizes_the_collectives_by_a_dry_run(algo):
    """Above ``time_at_most`` the collectives come from a dry run at the real worker count:
    a method with a background exchange (CD-SGD, OD-SGD) stops its thread there although
    its pending dry exchange fails (it raised out of ``close()``: the projection to 256
    workers crashed)."""
    shapes = [(16, 8), (8,)]
    capped = profiling.profile_method(algo, {}, shapes, 16, steps=2, time_at_most=4)
    assert capped.workers == 16 and capped.wire_bytes_per_step > 0


@needs_root
def test_uplink_phases_times_every_pattern_on_two_nodes(capsys):
    """benchmarks.uplink_phases end to end on a small shard: every pattern (the allreduce, the
    two whole phases, the phases in rounds) timed on 4 workers in 2 nodes, one table row each."""
    from benchmarks import uplink_phases

    assert uplink_phases.main(["--bandwidth", "none", "--rounds", "3", "--repeat", "1",
                               "--shard-bytes", "60000"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| unshaped |")]
    assert [row.split("|")[2].strip() for row in rows] == ["allreduce", "2 phases", "2 phases / 3"]
    assert all(float(row.split("|")[3]) >= 0 for row in rows)
    assert uplink_phases.model_ms(3_159_060, 100e6) == pytest.approx(505.4, abs=0.1)


_WIRE_WORKER = """
import json, os, torch
from pathlib import Path
from gradzip.comm import init_from_env
comm = init_from_env(timeout_s=60)
tx = lambda: int(Path('/sys/class/net/gz0/statistics/tx_bytes').read_text())
x = torch.randn(comm.world_size, 250_000)
comm.reduce_scatter(x); comm.barrier()
before, counted = tx(), comm.bytes_sent
comm.reduce_scatter(x)
comm.barrier()
Path('{out}', 'rank{rank}.json').write_text(
    json.dumps({'interface': tx() - before, 'counted': comm.bytes_sent - counted}))
os._exit(0)
"""


@needs_root
def test_reduce_scatter_puts_the_counted_bytes_on_the_wire(tmp_path):
    """Group.reduce_scatter on gloo: the bytes that leave each worker's interface are the
    ring's (n-1)/n of the tensor it counts, plus headers and the barrier (gloo's own
    reduce_scatter_tensor sent an allreduce's 2(n-1)/n). Headers: 0.2% where the veth sends
    the writes as large GSO packets; on a loaded host, where it cannot, a TCP/IP header per
    segment and the ACKs of what the worker receives (as much again as it sends): 7.5% in one
    loaded full-suite run, 17.9% in a later one (3537084 bytes for 3000006 counted). So the
    bound is halfway to an allreduce's bytes, 100% over the count: 50% over it."""
    n = 4
    with netns.Topology(n, None) as topo:
        emulated.run_ranks(topo, _WIRE_WORKER.replace("{out}", str(tmp_path)), tmp_path, timeout_s=120, threads=1)
    for r in range(n):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["counted"] >= (n - 1) * 250_000 * 4   # (n-1)/n of the 4 MB tensor, + the barrier's few bytes
        assert got["counted"] <= got["interface"] <= 1.5 * got["counted"], got
