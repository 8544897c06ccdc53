"""The language-model workload (issue 34, item 1): the ``gpt`` model, the ``text`` dataset
(embedded standard-library corpus and text files), per-target evaluation, the model/dataset
fit check, ``--eval-every``, and the LM fields of ``summary.json``."""
from __future__ import annotations

import hashlib
import json
import math
import platform
import re
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import cases
import gradzip
from gradzip import cli
from gradzip.errors import GradzipError
from gradzip.train import datasets, models
from gradzip.train.config import RunConfig
from gradzip.train.evaluation import evaluate, evaluate_shared
from gradzip.train.loop import run_worker

TINY_GPT = "gpt:layers=1,d=16,heads=2"
TINY_TEXT = "text:context=16,bytes=4000"


# -- the model ------------------------------------------------------------------------------
def test_gpt_maps_token_ids_to_a_class_per_position_causally_with_tied_embeddings():
    model = models.build("gpt:layers=2,d=32,heads=4", (12,), 256, seed=1)
    x = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(0))
    out = model(x)
    assert out.shape == (3, 256, 12)
    changed = x.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 256          # positions 0..6 cannot see 7..11
    again = model(changed)
    assert torch.equal(out[:, :, :7], again[:, :, :7]) and not torch.equal(out[:, :, 7:], again[:, :, 7:])
    assert torch.equal(model(x.float()), out)            # float ids that hold integers read the same
    # tied: the logits are the final hidden states times the token embedding matrix
    names = [n for n, _ in model.named_parameters()]
    assert "embed.weight" in names and not any("head" in n for n in names)
    h = model.embed(x) + model.position.weight[:12]
    for block in model.blocks:
        h = block(h)
    torch.testing.assert_close(out, (model.norm(h) @ model.embed.weight.t()).transpose(1, 2))
    F.cross_entropy(out, x).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_gpt_initialisation_is_gpt2s_and_fixed_by_the_seed():
    a = models.build("gpt:layers=3,d=64,heads=4", (8,), 256, seed=3)
    b = models.build("gpt:layers=3,d=64,heads=4", (8,), 256, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    std = {n: p.std().item() for n, p in a.named_parameters() if p.dim() == 2}
    assert abs(std["embed.weight"] - 0.02) < 0.002 and abs(std["blocks.0.qkv.weight"] - 0.02) < 0.002
    assert abs(std["blocks.0.proj.weight"] - 0.02 / math.sqrt(6)) < 0.001
    assert all(p.abs().sum() == 0 for n, p in a.named_parameters() if n.endswith("bias"))
    assert a.position.weight.shape == (8, 64)
    assert models.build("gpt:context=32", (8,), 256).position.weight.shape == (32, 128)


@pytest.mark.parametrize("spec, shape, needle", [
    ("gpt:d=10,heads=4", (8,), "multiple of heads"), ("gpt:context=4", (8,), "shorter than"),
    ("gpt", (1, 8, 8), "token sequences"), ("gpt:layers=0", (8,), "layers must be"),
    ("gpt:width=3", (8,), "valid options"),
])
def test_gpt_bad_options_are_one_line_errors(spec, shape, needle):
    with pytest.raises(GradzipError, match=needle):
        models.build(spec, shape, 256)


# -- the dataset ----------------------------------------------------------------------------
def test_text_is_the_sorted_standard_library_cut_into_next_byte_sequences():
    ds = datasets.load("text:context=32")
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), key=lambda p: p.name.encode())
    stream = b"".join(f.read_bytes() for f in files)
    assert ds.info == {"source": "python-stdlib", "python": platform.python_version(), "files": len(files),
                       "bytes": len(stream), "sha256": hashlib.sha256(stream).hexdigest(), "token": "byte"}
    count = (len(stream) - 1) // 32
    assert len(ds.train_x) + len(ds.test_x) == count and len(ds.test_x) == count // 20
    assert ds.num_classes == 256 and ds.input_shape == (32,) and ds.targets_per_sample == 32
    assert ds.train_x.dtype == ds.train_y.dtype == torch.int64
    # sequence j = stream[32j : 32j + 32], targets one byte on; j % 20 == 19 held out
    assert bytes(ds.train_x[0].tolist()) == stream[:32] and bytes(ds.train_y[0].tolist()) == stream[1:33]
    assert bytes(ds.train_x[19].tolist()) == stream[20 * 32:21 * 32]
    assert bytes(ds.test_x[0].tolist()) == stream[19 * 32:20 * 32]
    assert bytes(ds.test_y[1].tolist()) == stream[39 * 32 + 1:40 * 32 + 1]


def test_text_bytes_option_cuts_the_stream_and_a_text_file_reads_from_the_data_dir(tmp_path):
    small = datasets.load("text:context=8,bytes=1000")
    assert small.info["bytes"] == 1000 and len(small.train_x) + len(small.test_x) == 999 // 8
    assert small.name == "text:context=8,bytes=1000"
    (tmp_path / "input.txt").write_bytes(b"First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40)
    ds = datasets.load("text:file=input.txt,context=16", tmp_path)
    assert ds.info["source"] == str(tmp_path / "input.txt") and "python" not in ds.info
    assert bytes(ds.train_x[0].tolist()) == b"First Citizen:\nB"


@pytest.mark.parametrize("spec, data_dir, needle", [
    ("text:file=missing.txt", "DIR", "was not found"), ("text:file=input.txt", None, "pass a data directory"),
    ("text:context=0", None, "context must be"), ("text:bytes=-1", None, "bytes must be"),
    ("text:context=64,bytes=500", None, "fewer than 20 sequences"), ("text:ctx=3", None, "bad text option"),
    ("text:context=x", None, "needs an integer"),
])
def test_text_bad_options_and_files_are_one_line_errors(tmp_path, spec, data_dir, needle):
    with pytest.raises(GradzipError, match=needle):
        datasets.load(spec, tmp_path if data_dir == "DIR" else data_dir)


# -- evaluation and the fit check -----------------------------------------------------------
def test_evaluation_of_a_language_model_is_per_target_and_the_same_split_among_workers():
    ds = datasets.load(TINY_TEXT)
    model = models.build(TINY_GPT, ds.input_shape, ds.num_classes, seed=0)
    acc, loss = evaluate(model, ds.test_x, ds.test_y, batch=5)
    with torch.no_grad():
        out = model(ds.test_x)
    assert loss == pytest.approx(F.cross_entropy(out, ds.test_y).item(), rel=1e-6)
    assert acc == pytest.approx((out.argmax(1) == ds.test_y).float().mean().item(), rel=1e-6)
    shared = gradzip.simulate(3, lambda comm: evaluate_shared(model, comm, ds.test_x, ds.test_y))
    assert all(s == pytest.approx((acc, loss), rel=1e-6) for s in shared)


@pytest.mark.parametrize("model, dataset, needle", [
    (TINY_GPT, "modadd:p=7", "predicts a class per position .* one label per sample; use a language-modelling"),
    ("transformer", TINY_TEXT, "predicts one class per sample .* targets of shape \\(16,\\) per sample; use the gpt"),
    ("mlp", TINY_TEXT, "model 'mlp' cannot read the inputs of dataset 'text:.*Long.*pick a model"),
    ("lenet", TINY_TEXT, "needs image input"),
])
def test_a_model_that_does_not_fit_the_dataset_is_refused_before_training(model, dataset, needle, capsys):
    code = cli.main(["train", "--dataset", dataset, "--model", model, "--epochs", "1", "--quiet", "--no-plot"])
    assert code == 2 and re.search(needle, capsys.readouterr().err)


# -- the harness -----------------------------------------------------------------------------
def test_cli_trains_gpt_on_text_with_lm_summary_fields_and_evaluations_every_n_steps(tmp_path, capsys):
    code = cli.main(["compare", "--algos", "adamw,diloco", "--H", "4", "--dataset", TINY_TEXT, "--model", TINY_GPT,
                     "--epochs", "1", "--batch-size", "8", "--workers", "2", "--backend", "threads",
                     "--eval-every", "5", "--quiet", "--no-plot", "--bandwidth", "1gbit,10gbit",
                     "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "bits/byte" in out and "tokens/s" in out and "proj. s/epoch 1 Gbit/s x2" in out
    summaries = json.loads((tmp_path / "summary.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for s in summaries:
        assert s["final_test_loss"] == pytest.approx(s["bits_per_byte"] * math.log(2))
        assert s["final_test_loss"] < math.log(256)       # it learned something in 14 steps
        assert s["dataset_info"]["python"] == platform.python_version() and s["tokens_per_s"] > 0
        assert len(s["projections"]) == 2
        mine = [r for r in records if r["algo"] == s["algo"]]
        assert [r["step"] for r in mine] == [5, 10, 14]   # 237 sequences / 2 workers / batch 8 = 14 steps
        assert mine[-1]["test_loss"] == s["final_test_loss"] and mine[1]["epoch"] == pytest.approx(10 / 14)


def _tiny(**changes):
    return RunConfig(**{**vars(RunConfig(algo="adamw", dataset=TINY_TEXT, model=TINY_GPT, epochs=2, batch_size=8,
                                         lr=3e-3, progress=False)), **changes})


def test_evaluating_every_n_steps_changes_no_number_and_splits_the_train_loss_exactly():
    plain, every = gradzip.simulate(2, lambda comm: [run_worker(comm, _tiny()), run_worker(comm, _tiny(eval_every=4))])[0]
    assert plain["summary"]["final_test_loss"] == every["summary"]["final_test_loss"]
    assert [r["step"] for r in every["history"]] == [4, 8, 12, 14, 16, 20, 24, 28]
    bounds = [0] + [r["step"] for r in every["history"]]
    for epoch, end in ((1, 14), (2, 28)):
        parts = [(b - a, r["train_loss"]) for a, b, r in zip(bounds, bounds[1:], every["history"])
                 if end - 14 < b <= end]
        weighted = sum(n * loss for n, loss in parts) / 14
        assert weighted == pytest.approx(plain["history"][epoch - 1]["train_loss"], rel=1e-6)


def test_a_resumed_lm_run_with_mid_epoch_evaluations_repeats_the_uninterrupted_one(tmp_path):
    def worker(comm):
        whole = run_worker(comm, _tiny(eval_every=3, checkpoint_dir=str(tmp_path / "whole"), checkpoint_every=4))
        cut = _tiny(eval_every=3, checkpoint_dir=str(tmp_path / "cut"), checkpoint_every=4, resume=True)
        try:
            run_worker(comm, cut, after_step=cases.interrupt_after(10))
        except cases.Interrupted:
            pass
        return whole, run_worker(comm, cut)

    whole, resumed = gradzip.simulate(2, worker)[0]
    assert resumed["summary"]["resumed_from_step"] == 8
    cases.assert_bitwise_equal(whole["history"], resumed["history"], "history")
