"""The small shared pieces every layer uses: spec strings, validation, seeds, the version,
the default timeout, and the codec helpers shared by several codecs."""
import inspect
import math

import pytest
import torch

import gradzip
from gradzip import seeds, specs, validation
from gradzip.comm import base as comm_base, threads, torchdist
from gradzip.compressors import _util, build, dgc, onebit, powersgd, sparsify
from gradzip.errors import GradzipError
from gradzip.optim import EFSGD, SSGD
from gradzip.train import datasets


# ----------------------------------------------------------------------------- specs


def test_spec_split_strips_lowers_name_and_keeps_items_in_order():
    name, rest, options = specs.split("  TopK : ratio = 0.1 ,, unbiased=on, bare ")
    assert name == "topk" and rest == " ratio = 0.1 ,, unbiased=on, bare"
    assert [(o.key, o.value, o.has_value) for o in options] == [
        ("ratio", "0.1", True), ("unbiased", "on", True), ("bare", "", False)]
    assert options[2].item == "bare"


def test_one_bool_table_for_specs_and_cli():
    for word, value in specs.BOOLS.items():
        assert specs.parse_bool(f" {word.upper()} ") is value
        assert build(f"randomk:ratio=0.5,unbiased={word}").unbiased is value
    with pytest.raises(ValueError):
        specs.parse_bool("maybe")


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("value, integer, real", [
    (3, True, True), (True, False, False), (2.5, False, True), (float("nan"), False, False),
    (float("inf"), False, True), ("3", False, False), (None, False, False)])
def test_is_int_and_is_real(value, integer, real):
    assert validation.is_int(value) is integer
    assert validation.is_real(value) is real


def test_require_names_where():
    validation.require(True, "X", "unused")
    with pytest.raises(GradzipError, match=r"^SSGD: lr must"):
        validation.require(False, "SSGD", "lr must be a number")
    with pytest.raises(GradzipError, match=r"^plain$"):
        validation.require(False, None, "plain")


def test_codec_and_method_errors_keep_their_wording():
    with pytest.raises(GradzipError, match=r"^qsgd: levels must be an integer in \[1, 127\], got True$"):
        build("qsgd").__class__(levels=True)
    with pytest.raises(GradzipError, match=r"^SSGD: seed must be an integer, got True$"):
        SSGD([torch.zeros(1, requires_grad=True)], lr=0.1, seed=True)


# ----------------------------------------------------------------------------- seeds


def test_seeds_keep_their_values():
    """Every derived seed is pinned: results, checkpoints and tests depend on the numbers."""
    assert seeds.mix(0, 1, 2) == 7862180293416889277
    assert seeds.mix(2**70, -5) == 6078092096762219439
    assert gradzip.exchange.mix_seed is seeds.mix
    assert seeds.hashed("shard", 0, 0) == 6690038628884977183
    assert seeds.hashed("synthetic-teacher", 0, (1, 28, 28), 10) == 1113284368415820181
    assert datasets.shard(10, 0, 2, 0, 0).tolist() == [5, 9, 4, 2, 8]
    assert datasets.shard(10, 1, 2, 3, 7).tolist() == [2, 5, 6, 7, 4]
    assert seeds.exchange_seed(7, 1) == 7001
    assert seeds.worker_seed(3, 2) == 3 * 1_000_003 + 2


def test_methods_seed_their_exchanges_through_seeds():
    opt = EFSGD([torch.zeros(3, requires_grad=True)], lr=0.1, seed=5)
    assert opt.make_psync("none", salt=2).seed == seeds.exchange_seed(5, 2) == 5002


# ----------------------------------------------------------------------------- version, timeout


def test_version_lives_below_the_package():
    from gradzip.optim.core import base as optim_base
    from gradzip.version import __version__
    assert gradzip.__version__ == __version__
    assert "from .. import __version__" not in inspect.getsource(optim_base)


def test_one_default_timeout():
    from gradzip.comm import launch
    assert threads.DEFAULT_TIMEOUT_S is comm_base.DEFAULT_TIMEOUT_S
    assert torchdist.DEFAULT_TIMEOUT_S is comm_base.DEFAULT_TIMEOUT_S
    assert inspect.signature(launch.run_processes).parameters["timeout_s"].default == comm_base.DEFAULT_TIMEOUT_S


# ----------------------------------------------------------------------------- codec helpers


@pytest.mark.parametrize("shape, expected", [
    ((), (1, 1)), ((0,), (0, 1)), ((7,), (7, 1)), ((0, 5), (0, 5)), ((5, 0), (5, 0)),
    ((0, 3, 4), (0, 12)), ((2, 3, 4), (2, 12))])
def test_matrix_shape_one_function_rows_times_the_rest(shape, expected):
    """One matrix view for 1-bit, PowerSGD and the DDP hook; a (0, k) tensor is 0 x k (the
    PowerSGD copy said 0 x 0)."""
    assert onebit.matrix_shape is powersgd.matrix_shape is _util.matrix_shape
    assert powersgd.matrix_shape(shape) == expected
    rows, cols = expected
    assert rows * cols == math.prod(shape)
    torch.zeros(shape).reshape(rows, cols)  # a view of every tensor


@pytest.mark.parametrize("piecewise", [True, False])
def test_above_threshold_is_the_candidate_scan_of_topk_and_dgc(piecewise, monkeypatch):
    monkeypatch.setattr(_util, "PIECEWISE", piecewise)
    monkeypatch.setattr(_util, "CHUNK", 1 << 10)
    flat = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    for threshold in (0.0, 1.5, torch.tensor(2.0), 10.0):
        want = torch.nonzero(flat.abs() >= threshold).view(-1)
        assert torch.equal(_util.above_threshold(flat, threshold), want)
    idx, vals = dgc._candidates(flat, 1.5)
    assert torch.equal(idx, torch.nonzero(flat.abs() >= 1.5).view(-1))
    assert torch.equal(vals, flat.abs()[idx])
    big = torch.randn(1 << 16, generator=torch.Generator().manual_seed(1))
    got = sparsify.topk_indices(big, 100)
    assert set(got.tolist()) == set(torch.topk(big.abs(), 100).indices.tolist())


def test_a_bool_is_no_count_in_the_ddp_hook_or_the_emulated_network():
    """The last two int checks that took ``True`` for 1 now use ``validation.is_int``."""
    from gradzip.bench import netns
    from gradzip.integrations.ddp import PowerSGDState
    with pytest.raises(GradzipError, match="rank must be an integer >= 1, got True"):
        PowerSGDState(rank=True)
    with pytest.raises(GradzipError, match="start_iter must be an integer >= 0, got False"):
        PowerSGDState(start_iter=False)
    with pytest.raises(GradzipError, match="needs >= 1 worker, got True"):
        netns.Topology(n=True)
