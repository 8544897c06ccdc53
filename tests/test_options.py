"""gradzip.optim.options: the shared betas parser (both CLI spellings) and the one
"momentum is beta1 here" refusal of the Adam-like methods."""
import pytest
import torch

import gradzip
from gradzip import cli
from gradzip.errors import GradzipError
from gradzip.optim import options
from gradzip.optim.compressed import AdamWMethod, LAMBMethod
from gradzip.optim.diloco import DiLoCoMethod
from gradzip.optim.onebit import OneBitAdam, OneBitLAMB, ZeroOneAdam


def params():
    return [torch.nn.Parameter(torch.zeros(2))]


@pytest.mark.parametrize("kwargs, expected", [
    (dict(), (0.9, 0.999)), (dict(betas="0.8,0.95"), (0.8, 0.95)), (dict(betas=(0.8, 0.95)), (0.8, 0.95)),
    (dict(beta1=0.8), (0.8, 0.999)), (dict(beta1=0.8, beta2=0.95), (0.8, 0.95)), (dict(beta2=0.5), (0.9, 0.5)),
])
def test_parse_betas_reads_both_spellings(kwargs, expected):
    assert options.parse_betas("X", **kwargs) == expected


@pytest.mark.parametrize("kwargs, needle", [
    (dict(betas="0.9"), "betas"), (dict(betas=(0.9, 1.0)), "betas"), (dict(beta1=1.0), "beta1"),
    (dict(beta2=-0.1), "beta2"), (dict(betas="0.9,0.99", beta1=0.8), "not both"),
])
def test_parse_betas_refusals_are_one_line(kwargs, needle):
    with pytest.raises(GradzipError) as exc:
        options.parse_betas("X", **kwargs)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam, OneBitLAMB, AdamWMethod, LAMBMethod])
def test_every_adam_like_method_takes_both_spellings(cls):
    a = cls(params(), lr=0.1, betas="0.8,0.95")
    b = cls(params(), lr=0.1, beta1=0.8, beta2=0.95)
    for opt in (a, b):
        assert tuple(opt.param_groups[0]["betas"]) == (0.8, 0.95)
    assert tuple(cls(params(), lr=0.1).param_groups[0]["betas"]) == (0.9, 0.999)   # the default unchanged
    assert {"betas", "beta1", "beta2"} <= set(gradzip.optim.method_options(cls))   # the CLI's flags


def test_the_cli_accepts_both_spellings_for_both_families():
    parser = cli.build_parser()
    for algo in ("onebitadam", "adamw", "lamb"):
        for flags in (["--betas", "0.8,0.95"], ["--beta1", "0.8", "--beta2", "0.95"]):
            args = parser.parse_args(["train", "--algo", algo, *flags])
            cls = gradzip.optim.METHODS[algo]
            opt = cls(params(), lr=0.1, **cli._given_options(args))
            assert tuple(opt.param_groups[0]["betas"]) == (0.8, 0.95)


@pytest.mark.parametrize("make, kept", [
    (lambda: OneBitAdam(params(), lr=0.1, momentum=0.9), "momentum is betas[0]"),
    (lambda: ZeroOneAdam(params(), lr=0.1, nesterov=True), "momentum is betas[0]"),
    (lambda: AdamWMethod(params(), lr=0.1, momentum=0.9), "its moments are beta1, beta2"),
    (lambda: LAMBMethod(params(), lr=0.1, momentum=0.5), "its moments are beta1, beta2"),
    (lambda: DiLoCoMethod(params(), lr=0.1, momentum=0.9), "AdamW's moments"),
    (lambda: DiLoCoMethod(params(), lr=0.1, momentum=0.5, nesterov=True), "inner='sgd'"),
])
def test_one_momentum_refusal_keeps_each_methods_message(make, kept):
    with pytest.raises(GradzipError) as exc:
        make()
    text = str(exc.value)
    assert kept in text and "momentum is betas[0]" in text and "--momentum" in text and "\n" not in text


def test_old_names_are_aliases():
    from gradzip.optim import onebit
    assert onebit.parse_betas("X", "0.8,0.95") == (0.8, 0.95)
