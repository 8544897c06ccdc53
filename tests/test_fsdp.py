"""gradzip.integrations.fsdp on real gloo processes (torch 2.13 CPU FSDP2): docs/algorithms.md §Sharded
exchange. Two suites of tiny models and three steps each: a 1-D mesh on 2 workers, HSDP on
2 nodes of 2 workers; each returns its measurements, asserted here."""
import pytest

import cases_fsdp
from gradzip.comm.launch import run_processes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fsdp"))


@pytest.fixture(scope="module")
def flat(workdir):
    return run_processes(2, cases_fsdp.flat_suite, workdir)


@pytest.fixture(scope="module")
def hsdp(workdir, flat):   # after flat: it loads flat's checkpoint on 4 workers
    return run_processes(4, cases_fsdp.hsdp_suite, workdir)


def results(outs, key):
    for out in outs:
        assert "failed" not in out[key], out[key].get("failed")
    return [out[key] for out in outs]


def one_line(message):
    assert message and "\n" not in message, message
    return message


def test_none_is_plain_fsdp2_and_exact_is_bit_identical(flat):
    for res in results(flat, "none"):
        # the owner sums its rank-ordered float32 slices; gloo's reduce-scatter sums in its
        # own order: the two may differ by float reassociation only
        assert res["none"] <= 1e-6
        assert res["exact_equal"]            # compressor=None: FSDP2's own collective, counted
        assert res["moved"] > 1e-2           # the comparison can fail: training moved the parameters


@pytest.mark.parametrize("case", ["ref 1bit full", "ref topk:ratio=0.3 full", "ref 1bit shard",
                                  "ref int8:block=4 full", "ref qsgd off"])
def test_shard_is_the_hand_written_box(flat, case):
    for res in results(flat, case):
        assert res["shard"] == 0.0           # every module, every step, on every rank
        assert res["identity"] <= 1e-6       # v == dec(C(v)) + r
        assert res.get("error", 0.0) == 0.0  # the error memory the box keeps
        assert res["bytes"] == res["expected_bytes"]


def test_error_memory_full_and_shard(flat):
    full, shard = results(flat, "ref 1bit full")[0], results(flat, "ref 1bit shard")[0]
    assert full["memory"] == 4 * full["gradient_numel"]       # the unsharded gradient, float32
    assert 0 < shard["memory"] <= 4 * shard["gradient_numel"] // 2 + 8 * 3   # a shard's, 3 modules
    assert results(flat, "ref qsgd off")[0]["memory"] == 0    # unbiased: no error feedback


def test_mixed_precision_codec_sees_what_fsdp_reduces(flat):
    for res in results(flat, "mixed"):
        assert res["input_dtypes"] == ["torch.float32"] and res["first_inputs_equal"]
        assert res["gather_dtypes"] == ["torch.bfloat16"]
        assert res["diff"] <= 1e-6


def test_resume_through_dcp_is_bit_exact_and_mismatches_are_refused(flat, hsdp):
    for res in results(flat, "resume") + results(hsdp, "resume"):
        assert res["equal"] and res["bytes"][0] == res["bytes"][1]
        assert "codec='1bit'" in one_line(res["codec"]) and "topk" in res["codec"]
        assert "error_feedback=" in one_line(res["error_feedback"]) and "'off'" in res["error_feedback"]
        assert "saved with world_size=" in one_line(res["world_size"])   # a state of twice the workers
    for res in results(hsdp, "resume"):
        assert res["server_errors"] > 0       # two-phase across nodes: its server errors resumed too
    for res in results(hsdp, "grow"):     # a 2-worker state on 4 workers
        assert "world_size=2" in one_line(res["partial"])
        assert res["strict"]                 # DCP's planner stops first (documented)


def test_bad_use_is_one_line(flat):
    res = results(flat, "bad")[0]
    expect = {"not_fsdp": "no FSDP2 module", "weights_topk": "drops entries", "ef_unbiased": "unbiased",
              "ef_unknown": "error_feedback must be", "replicas_3": "replicas=3 does not divide",
              "replicas_2": "replicas=2 does not divide", "twice": "already has gradzip",
              "groups": "2 parameter groups"}
    for key, words in expect.items():
        assert words in one_line(res[key]), (key, res[key])


def test_hsdp_none_is_plain_hsdp(hsdp):
    for res in results(hsdp, "none"):
        assert res["diff"] <= 1e-6
        assert "2-D mesh" in one_line(res["native"])


def test_hsdp_codec_replicas_identical_reference_and_bytes(hsdp):
    for res in results(hsdp, "codec"):
        assert res["identical"]
        assert res["shard"] == 0.0
        assert res["bytes"] == res["expected_bytes"]


# ----------------------------------------------------------------------------- the CLI
@pytest.mark.parametrize("args, message", [
    (["train", "--fsdp", "--algo", "efsgd"], "drop --algo efsgd"),
    (["train", "--weights", "int8"], "--weights belong to FSDP2 runs"),
    (["train", "--fsdp", "--workers", "2", "--backend", "threads"], "needs torch.distributed processes"),
    (["train", "--fsdp", "--checkpoint-dir", "{tmp}/ck"], "take no --checkpoint-dir"),
    (["train", "--fsdp", "--amp", "bf16"], "take no --amp"),
    (["train", "--fsdp", "--threshold", "0.1"], "fsdp takes no option threshold"),
    (["train", "--hsdp", "3", "--workers", "4"], "--hsdp 3 does not divide the 4 workers"),
    (["train", "--fsdp", "--error-memory", "shard", "--error-feedback", "false"], "drop --error-feedback false"),
    (["compare", "--algos", "ssgd,hsdp@1bit", "--workers", "2"], "needs the number of replicas: add --hsdp R"),
    (["compare", "--algos", "ssgd,fsdp", "--hsdp", "2", "--workers", "2"], "no method in --algos takes --hsdp"),
])
def test_cli_bad_sharded_use_is_one_line(args, message, capsys, tmp_path):
    from gradzip.cli import main

    code = main([a.replace("{tmp}", str(tmp_path)) for a in args] + ["--epochs", "1", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "\n" not in err, err


def test_cli_compare_puts_fsdp_and_hsdp_beside_a_method(tmp_path):
    """hsdp with 2 replicas of one worker each: its exchange across nodes is all there is."""
    import json

    from gradzip.cli import main

    code = main(["compare", "--algos", "ssgd,fsdp,fsdp@1bit,hsdp@2bit", "--hsdp", "2", "--workers", "2",
                 "--epochs", "1", "--quiet", "--no-plot", "--bandwidth", "none", "--weights", "int8",
                 "--out", str(tmp_path)])
    assert code == 0
    runs = {s["algo"]: s for s in json.loads((tmp_path / "summary.json").read_text())}
    assert set(runs) == {"ssgd", "fsdp", "fsdp@1bit", "hsdp@2bit"}
    assert runs["fsdp@1bit"]["bytes_sent_per_worker"] < runs["fsdp"]["bytes_sent_per_worker"]
    assert runs["fsdp@1bit"]["compression_ratio"] > 8 and runs["fsdp"]["compression_ratio"] == 1   # 1bit: + column means
    for summary in runs.values():
        assert summary["final_test_accuracy"] > 0.5 and summary["steps"] == runs["ssgd"]["steps"]
