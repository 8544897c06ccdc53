"""gradzip.optim.core.options: the shared betas parser (both CLI spellings) and the one
"momentum is beta1 here" refusal of the Adam-like methods."""
import pytest
import torch

import gradzip
import gradzip.integrations.accelerate
import gradzip.integrations.ddp
from gradzip import cli
from gradzip.errors import GradzipError
from gradzip.optim.core import options
from gradzip.optim.compressed import AdamWMethod, LAMBMethod
from gradzip.optim.diloco import DiLoCoMethod
from gradzip.optim import OneBitAdam, OneBitLAMB, ZeroOneAdam


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
            opt = cls(params(), lr=0.1, **cli.parser._given_options(args))
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


# -- issue 36, item 1: a misspelled keyword is refused, naming it and the option meant ------
def _misspelt(name: str) -> str:
    """``name`` with its second-to-last letter dropped (up to 3 letters: in the other case)."""
    return name.swapcase() if len(name) <= 3 else name[:-2] + name[-1]


def _one_line_refusal(make, bad: str, meant: str, where: str) -> None:
    with pytest.raises(GradzipError) as exc:
        make()
    text = str(exc.value)
    assert text.startswith(f"{where}: unknown option {bad!r} (did you mean {meant!r}?)") and "\n" not in text, text


@pytest.mark.parametrize("algo", sorted(gradzip.optim.METHODS))
def test_every_method_refuses_a_misspelled_option_naming_the_one_meant(algo):
    """Each of the method's own options and a common one, misspelled: before, the name
    became a param-group key and the run used the default (PowerSGD rnak=2 ran at rank 1)."""
    cls = gradzip.optim.METHODS[algo]
    for meant in [*gradzip.optim.method_options(cls), "momentum", "weight_decay"]:
        bad = _misspelt(meant)
        _one_line_refusal(lambda: cls(params(), lr=0.1, **{bad: 1}), bad, meant, cls.__name__)


def _inner():
    return torch.optim.SGD(params(), lr=0.1)


@pytest.mark.parametrize("make, bad, meant, where", [
    (lambda: gradzip.optim.Compressed(_inner(), compresor="topk"), "compresor", "compressor", "Compressed"),
    (lambda: gradzip.optim.DiLoCo(_inner(), H=2, outer_lrr=0.5), "outer_lrr", "outer_lr", "DiLoCo"),
    (lambda: gradzip.optim.LARS(params(), lr=0.1, momentun=0.9), "momentun", "momentum", "LARS"),
    (lambda: gradzip.optim.LAMB(params(), lr=0.1, bet=(0.9, 0.99)), "bet", "betas", "LAMB"),
    (lambda: gradzip.optim.SAM(_inner(), roh=0.1), "roh", "rho", "SAM"),
    (lambda: gradzip.integrations.ddp.hook("topk:ratio=0.5", modle=None), "modle", "model", "CodecState"),
    (lambda: gradzip.integrations.ddp.CodecState("topk:ratio=0.5", start_iters=2), "start_iters", "start_iter", "CodecState"),
    (lambda: gradzip.integrations.ddp.PowerSGDState(rnak=2), "rnak", "rank", "PowerSGDState"),
    (lambda: gradzip.integrations.accelerate.PerRank(_inner(), objs=1), "objs", "obj", "PerRank"),
])
def test_the_wrappers_and_hook_states_refuse_a_misspelled_option(make, bad, meant, where):
    _one_line_refusal(make, bad, meant, where)


def test_an_unknown_option_with_no_close_name_lists_the_valid_ones():
    with pytest.raises(GradzipError) as exc:
        gradzip.optim.LocalSGD(params(), lr=0.1, xyzzy=3)
    assert str(exc.value).startswith("LocalSGD: unknown option 'xyzzy'; valid options: params, lr, H, comm, momentum")


def test_options_kept_per_param_group_still_travel_and_a_group_may_hold_any_key():
    """CD-SGD's local_lr and the Adam methods' betas / eps are param-group options (a group
    may set its own); keys of an added group stay as torch allows them."""
    assert gradzip.optim.CDSGD(params(), lr=0.1, local_lr=0.02).param_groups[0]["local_lr"] == 0.02
    assert OneBitAdam(params(), lr=0.1, eps=1e-4).param_groups[0]["eps"] == 1e-4
    opt = gradzip.optim.EFSGD(params(), lr=0.1, compressor="topk:ratio=0.5")
    opt.add_param_group({"params": params(), "lr": 0.2, "my_tag": "head"})
    assert opt.param_groups[1]["my_tag"] == "head"
