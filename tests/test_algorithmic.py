"""The transformer task (issue 17, item 5): the ``modadd`` dataset
(gradzip.train.datasets.algorithmic), the ``transformer`` model, and ``gradzip compare`` with
the adaptive methods on them."""
from __future__ import annotations

import json

import pytest
import torch

from gradzip import cli
from gradzip.errors import GradzipError
from gradzip.train import datasets, models


def test_modadd_holds_every_pair_once_labelled_by_the_sum_mod_p():
    ds = datasets.load("modadd:p=13,train=0.3,seed=2")
    assert ds.num_classes == 13 and ds.input_shape == (2,)
    x = torch.cat([ds.train_x, ds.test_x]).long()
    y = torch.cat([ds.train_y, ds.test_y])
    assert len(x) == 169 and len({tuple(r) for r in x.tolist()}) == 169       # every pair, once
    assert torch.equal(y, (x[:, 0] + x[:, 1]) % 13)
    assert len(ds.train_x) == round(0.3 * 169) and ds.train_x.dtype == torch.float32
    again = datasets.load("modadd:p=13,train=0.3,seed=2")
    assert torch.equal(again.train_x, ds.train_x)                             # fixed by its options
    assert not torch.equal(datasets.load("modadd:p=13,train=0.3,seed=3").train_x, ds.train_x)


@pytest.mark.parametrize("spec, needle", [("modadd:p=1", "p must be"), ("modadd:train=1.5", "train must"),
                                          ("modadd:q=3", "bad modadd option"), ("modadd:p=x", "integer")])
def test_modadd_bad_options(spec, needle):
    with pytest.raises(GradzipError, match=needle):
        datasets.load(spec)


def test_transformer_reads_token_ids_and_is_fixed_by_its_seed():
    model = models.build("transformer:layers=1,d=16,heads=2", (2,), 11, seed=4)
    x = torch.tensor([[0.0, 3.0], [10.0, 10.0], [5.0, 1.0]])
    out = model(x)
    assert out.shape == (3, 11)
    same = models.build("transformer:layers=1,d=16,heads=2", (2,), 11, seed=4)
    assert torch.equal(same(x), out)
    assert not torch.equal(models.build("transformer:layers=1,d=16,heads=2", (2,), 11, seed=5)(x), out)
    with pytest.raises(GradzipError, match="token sequences"):
        models.build("transformer", (1, 8, 8), 10)
    with pytest.raises(GradzipError, match="multiple of heads"):
        models.build("transformer:d=10,heads=4", (2,), 10)


def test_compare_runs_the_adaptive_methods_on_the_transformer_task(tmp_path, capsys):
    code = cli.main(["compare", "--dataset", "modadd:p=11", "--model", "transformer:layers=1,d=16,heads=2",
                     "--algos", "ssgd,onebitadam,zerooneadam,onebitlamb", "--workers", "2", "--backend", "threads",
                     "--epochs", "1", "--batch-size", "8", "--lr", "0.003", "--freeze-step", "2",
                     "--var-freeze-step", "3", "--var-update-scaler", "1", "--betas", "0.9,0.98",
                     "--quiet", "--no-plot", "--out", str(tmp_path)])
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    runs = {r["algo"]: r for r in summary}
    assert set(runs) == {"ssgd", "onebitadam", "zerooneadam", "onebitlamb"}
    dense = runs["ssgd"]["bytes_sent_per_worker"]
    for name in ("onebitadam", "zerooneadam", "onebitlamb"):   # 3 steps, the 3rd compressed in each
        assert 0 < runs[name]["bytes_sent_per_worker"] < dense, name
